"""Long sequences. Context parallelism (`ParallelDims(cp=N)`): each sequence split over the
CP ranks in load-balanced chunks, attention over the whole of it, the parameters sharded
over dp_shard x cp; and sequence parallelism for a transformers model (the reference
Llama's is in test_tp_fsdp.py). Every layout trains as one process does, and a CP
checkpoint resumes at any other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from reference import build_model, config, full_state, mean_over_ranks, rel_diff, rel_losses
from reference import train as train_ranks
from torch.distributed.tensor import Shard

import flatshard
from flatshard import checkpoint
from flatshard.errors import MeshError
from flatshard.models.registry import next_token_loss
from flatshard.parallel import sequence_positions, split_sequence

pytestmark = pytest.mark.slow

CFG = dict(n_heads=8, n_kv_heads=4, dim=32, ffn_dim=48)  # tp | 4
SEQ = 17  # a model input of 16 tokens: 2 x cp chunks for cp 2 and 4
STEPS, SAVED_STEPS = 5, 2
TOLERANCE = 1e-5


def _batches(steps=STEPS):
    generator = torch.Generator().manual_seed(1)
    vocab = config(**CFG).vocab_size
    return [torch.randint(0, vocab, (8, SEQ), generator=generator) for _ in range(steps)]


def _loss(model, tokens, cp_mesh):
    """This rank's mean loss over its part of each sequence (positions given: RoPE and the
    causal mask follow them)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    if cp_mesh is not None:
        inputs, targets, positions = (
            split_sequence(t, cp_mesh) for t in (inputs, targets, positions)
        )
    logits = model(inputs, position_ids=positions)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _model(dims, seed=0):
    model = build_model(config(**CFG), seed=seed)
    if dims is None:
        return model, None, 0, 1
    meshes = dims.build()
    flatshard.parallelize(model, meshes)
    return model, meshes.cp, meshes.dp_rank, dims.dp


def _train(dims, data, model=None, optimizer=None):
    model, cp_mesh, dp_rank, dp = model or _model(dims)
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_ranks(
        model, data, rank=dp_rank, world=dp, make_optimizer=lambda _: optimizer,
        loss_fn=lambda m, tokens: _loss(m, tokens, cp_mesh),
    )  # fmt: skip
    if dims is not None and dp == 1:  # train() reduced nothing: the mean over every rank
        losses = [mean_over_ranks(loss, dims.world_size) for loss in losses]
    elif dims is not None:  # train() summed every rank's and divided by dp
        losses = [loss * dp / dims.world_size for loss in losses]
    return losses, model, optimizer


def _layout(dp_shard, cp, tp, sp=False):
    return flatshard.ParallelDims(
        dp_shard * cp * tp, dp_shard=dp_shard, cp=cp, tp=tp, sequence_parallel=sp
    )


def _run(layout):
    losses, model, _ = _train(_layout(*layout), _batches())
    return losses, full_state(model)


@pytest.mark.parametrize("layout", [(2, 2, 1), (1, 2, 2), (1, 4, 1)], ids=str)
def test_context_parallel_trains_like_one_process(layout):
    """(dp 2, cp 2), (cp 2, tp 2), (cp 4) at world 4: 5 AdamW steps, losses and weights
    equal one process's."""
    ref_losses, reference, _ = _train(None, _batches())
    for losses, weights in run_distributed(_run, 4, layout):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE


def _save(path):
    dims = _layout(1, 2, 2)
    _, model, optimizer = _train(dims, _batches(SAVED_STEPS))
    checkpoint.save(path, model=model, optimizer=optimizer, step=SAVED_STEPS)


def _resume(path, layout):
    dims = None if layout is None else _layout(*layout)
    parts = _model(dims, seed=3)
    optimizer = torch.optim.AdamW(parts[0].parameters(), lr=1e-2)
    checkpoint.load(path, model=parts[0], optimizer=optimizer)
    losses, model, _ = _train(dims, _batches()[SAVED_STEPS:], parts, optimizer)
    return losses, full_state(model)


def test_a_checkpoint_written_at_cp_and_tp_resumes_at_dp_and_in_one_process(tmp_path):
    ref_losses, reference, _ = _train(None, _batches())
    path = str(tmp_path / "cp")
    run_distributed(_save, 4, path)
    resumed = [run_distributed(_resume, world, path, (world, 1, 1))[0] for world in (4, 1)]
    for losses, weights in resumed:
        assert rel_losses(losses, ref_losses[SAVED_STEPS:]) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE


def _transformers_llama(seed=0):
    """A tiny transformers Llama (GQA, 4 query heads per rank at tp 2)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def _train_transformers(layout):
    """Its 5 AdamW steps on `layout` (None: one process): the mean loss of every step and
    the final weights; the loss is the trainer's (`next_token_loss`, CP-aware)."""
    model = _transformers_llama()
    dp_rank, dp, world = 0, 1, 1
    if layout is not None:
        dims = _layout(*layout)
        meshes = dims.build()
        flatshard.parallelize(model, meshes)
        dp_rank, dp, world = meshes.dp_rank, dims.dp, dims.world_size
        if dims.sequence_parallel:  # the embedding split by vocabulary over TP
            assert model.model.embed_tokens.weight.placements[-1] == Shard(0)
    losses = train_ranks(
        model, _batches(), rank=dp_rank, world=dp,
        # lr 1e-3: AdamW turns the rounding of near-zero gradients into whole steps (at
        # 1e-2 the weights differ by 2e-5; SGD at lr 1 shows the gradients equal to 1e-7)
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=next_token_loss,
    )  # fmt: skip
    if world > 1 and dp == 1:
        losses = [mean_over_ranks(loss, world) for loss in losses]
    elif world > 1:
        losses = [loss * dp / world for loss in losses]
    return losses, full_state(model)


@pytest.mark.parametrize(
    "layout", [(2, 2, 1), (1, 2, 2), (2, 1, 2, True)], ids=["dp2-cp2", "cp2-tp2", "dp2-tp2-sp"]
)
def test_a_transformers_model_under_context_and_sequence_parallelism_trains_like_one_process(
    layout,
):
    """transformers' own Llama, its attention run by flatshard's CP attention (registered
    as an attention implementation): (dp 2, cp 2) and (cp 2, tp 2 by its own TP plan); and
    under its TP plan with the sequence split between the blocks (dp 2, tp 2 + SP)."""
    ref_losses, reference = _train_transformers(None)
    for losses, weights in run_distributed(_train_transformers, 4, layout):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference) <= TOLERANCE


def _odd_sequence_under_sp():
    model = build_model(config(**CFG, tie_embeddings=False))
    flatshard.parallelize(model, _layout(1, 1, 2, sp=True).build())
    with pytest.raises(ValueError, match="input of 15 tokens is not a multiple of 2"):
        model(torch.zeros(2, 15, dtype=torch.long))


def test_a_sequence_the_tp_ranks_cannot_split_is_one_clear_error_under_sp():
    run_distributed(_odd_sequence_under_sp, 2)


def test_load_balanced_chunks_and_a_length_they_cannot_split():
    # rank r holds chunks r and 2cp - 1 - r: the same causal work on every rank
    assert sequence_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(MeshError, match="input of 10 tokens is not a multiple of 4"):
        sequence_positions(10, 2, 0)
    with pytest.raises(MeshError, match="dp_replicate x dp_shard x cp x tp = 1 x 2 x 2 x 2"):
        flatshard.ParallelDims(4, dp_shard=2, cp=2, tp=2)


@pytest.mark.parametrize("prefix", [0, 14], ids=["first-chunk", "later-chunk"])
def test_a_chunks_attention_over_its_prefix_equals_masked_sdpa(prefix):
    """Forward and gradients of the maskless chunk attention (prefix unmasked, own chunk
    causal, merged by log-sum-exp) equal SDPA's with the explicit lower-right mask."""
    from flatshard.parallel.chunk_attention import chunk_attention

    torch.manual_seed(0)
    length = 6
    q = torch.randn(2, 4, length, 8, requires_grad=True)
    k, v = (torch.randn(2, 4, prefix + length, 8, requires_grad=True) for _ in range(2))
    mask = torch.ones(length, prefix + length, dtype=torch.bool).tril(prefix)
    ours = chunk_attention(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), grad),
                    torch.autograd.grad(theirs, (q, k, v), grad)):  # fmt: skip
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert torch.allclose(ours, theirs, atol=1e-6)


def _attention_on_ranks(ring):
    """This rank's output and q/k/v gradients under CP attention (torch's ring or the
    all-gather), beside the whole sequence's causal SDPA at this rank's positions."""
    from flatshard.parallel.context_parallel import ContextParallel
    from flatshard.parallel.ring_attention import ring_runs

    world = torch.distributed.get_world_size()
    mesh = flatshard.ParallelDims(world, cp=world).build("cpu").cp
    context = ContextParallel(mesh, ring=ring)
    torch.manual_seed(0)
    length = 16
    q = torch.randn(2, 4, length, 8, requires_grad=True)  # 4 query heads over 2 KV heads
    k, v = (torch.randn(2, 2, length, 8, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 4, length, 8)
    mine = [split_sequence(t, mesh, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = context.attention(*mine)
    out.backward(split_sequence(grad, mesh, dim=2))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    full.backward(grad)
    # every rank's key/value gradients sum over the ranks' queries: gathered, in order
    reference = [split_sequence(t, mesh, dim=2) for t in (full, q.grad, k.grad, v.grad)]
    gradients = [mine[0].grad, mine[1].grad, mine[2].grad]
    errors = [(a - b).abs().max().item() for a, b in zip([out, *gradients], reference)]
    return ring_runs(q), errors


@pytest.mark.parametrize("ring", [True, False], ids=["torch-ring", "all-gather"])
def test_context_parallel_attention_equals_causal_sdpa(ring):
    """At cp 4 with grouped KV heads: the attention output and the query, key and value
    gradients of each rank equal those of causal SDPA over the whole sequence, by torch's
    ring (its ring functions over the fused CPU kernel) and by the all-gather variant."""
    for runs, errors in run_distributed(_attention_on_ranks, 4, ring):
        assert runs  # torch 2.13 has the ring and the CPU kernel returns its log-sum-exp
        assert max(errors) < 1e-5, errors
