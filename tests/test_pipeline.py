"""Pipeline parallelism with torch's own schedules over flatshard-sharded stages
(`flatshard.pipeline`): the reference Llama split into stages over `pp`, each parallelized
over its data- and tensor-parallel ranks, trained 5 AdamW steps at world 4, ends with the
losses and weights of one process training the whole model on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from reference import adamw, batches, build_model, config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import flatshard
from flatshard import checkpoint
from flatshard.errors import WrappingError
from flatshard.runtime.states import ShardedState

SHARDED = ShardedState.SHARDED

pytestmark = pytest.mark.slow

STEPS, BATCH = 5, 8


def _loss(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def _pipelined(schedule: str, pp: int, tp: int, zero_stage: int, microbatches: int,
               offload: float = 0.0, tied: bool = False):  # fmt: skip
    """(per step: the whole batch's loss, the reference's; the largest weight difference).
    Asserts every unit is sharded again after each step (ZeRO-2/3). `offload`: that share of
    each rank's optimizer on the host (flatshard.OffloadPolicy). `tied`: the embedding and
    the head share one weight (the first stage's; the last stage's head receives it)."""
    dims = flatshard.ParallelDims(dist.get_world_size(), pp=pp, tp=tp)
    per_rank = 1 if schedule in ("gpipe", "1f1b") else 2
    cfg = config(n_layers=max(4, pp * per_rank), ffn_dim=48, tie_embeddings=tied)  # 48: TP
    whole = build_model(cfg)
    reference = copy.deepcopy(whole)
    reference_optimizer = adamw(reference.parameters())
    policy = flatshard.OffloadPolicy(fraction=offload) if offload else None
    pipe = flatshard.pipeline(whole, dims, loss_fn=_loss, microbatches=microbatches,
                              schedule=schedule, zero_stage=zero_stage,
                              offload_policy=policy)  # fmt: skip
    optimizer = adamw(pipe.model.parameters())
    meshes = dims.build()
    losses = []
    for tokens in batches(cfg, STEPS, batch=BATCH):
        expected = _loss(reference(tokens[:, :-1]), tokens[:, 1:])
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        mine = tokens.chunk(meshes.dp.size())[meshes.dp_rank]
        loss = pipe.step(mine[:, :-1], mine[:, 1:])
        if zero_stage > 1:  # no unit left gathered after the step
            assert {u.sharded_state for u in flatshard.units(pipe.model)} == {SHARDED}
        optimizer.step()
        optimizer.zero_grad()
        total = loss.double().reshape(1)
        dist.all_reduce(total, group=meshes.dp.get_group())
        losses.append(((total / meshes.dp.size()).item(), expected.item()))
    options = StateDictOptions(full_state_dict=True)
    ours = get_model_state_dict(pipe.model, options=options)
    theirs = reference.state_dict()
    worst = max(((v - theirs[k]).norm() / theirs[k].norm()).item() for k, v in ours.items())
    held = torch.tensor([len(ours)])
    dist.all_reduce(held)  # every parameter is on some stage: a copy on each dp x tp rank
    # (a tied weight on the first stage only, under the embedding's name)
    assert held.item() == dist.get_world_size() // pp * (len(theirs) - tied), held.item()
    return losses, worst


CASES = [  # schedule, pp, tp, ZeRO stage, micro-batches, offload (dp: what pp and tp leave)
    ("gpipe", 2, 1, 3, 4),
    ("1f1b", 2, 1, 3, 4),
    ("1f1b", 2, 1, 2, 2),
    ("gpipe", 2, 1, 1, 2),
    ("interleaved-1f1b", 2, 1, 3, 4),
    ("looped-bfs", 2, 1, 3, 2),
    ("interleaved-1f1b", 4, 1, 3, 4),
    ("1f1b", 2, 2, 3, 2),
    ("interleaved-zb", 2, 1, 3, 4),  # zero bubble: weight gradients after input gradients
    ("zbv", 2, 1, 3, 4),  # V-shaped: rank r runs stages r and 3 - r
    ("dualpipev", 2, 1, 2, 4),
    ("1f1b", 2, 1, 3, 4, 0.5),  # half of each rank's optimizer stepped on the host
    ("1f1b", 2, 1, 3, 4, 0.0, True),  # tied embeddings: the head's gradient sent back
    ("interleaved-1f1b", 2, 1, 2, 2, 0.0, True),
    ("zbv", 2, 1, 3, 4, 0.0, True),  # rank 0 runs both ends: the weight handed over in place
    ("interleaved-zb", 2, 1, 3, 4, 0.0, True),  # the head's weight gradient taken apart
]


@pytest.mark.parametrize("case", CASES, ids=[
    f"{c[0]}-pp{c[1]}-tp{c[2]}-zero{c[3]}" + (f"-offload{c[5]}" if len(c) > 5 and c[5] else "")
    + ("-tied" if len(c) > 6 else "")
    for c in CASES
])  # fmt: skip
def test_a_pipelined_run_equals_one_process(case):
    results = run_distributed(_pipelined, 4, *case)
    for losses, worst in results:
        for ours, expected in losses:
            assert abs(ours - expected) <= 1e-5 * abs(expected), losses
        assert worst <= 1e-5, worst


def test_stage_modules_split_the_blocks_and_keep_their_names():
    cfg = config(n_layers=5)
    model = build_model(cfg)
    parts = [flatshard.stage_modules(model, 3, s) for s in range(3)]
    assert [p.layers.indices for p in parts] == [[0, 1], [2, 3], [4]]
    assert parts[0].embed_tokens is not None and parts[1].embed_tokens is None
    assert parts[2].lm_head is not None and parts[0].lm_head is None and parts[0].norm is None
    names = [n for p in parts for n in p.state_dict()]
    assert sorted(names) == sorted(model.state_dict())  # the whole model's names, once each
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    hidden = tokens
    for part in parts:
        hidden = part(hidden)
    assert torch.equal(hidden, model(tokens))
    with pytest.raises(WrappingError, match="untie them"):
        flatshard.stage_modules(build_model(config(tie_embeddings=True)), 2, 0)
    with pytest.raises(WrappingError, match="between 1 and the blocks"):
        flatshard.stage_modules(model, 6, 0)


def _train_and_save(path: str, pp: int, first: int, last: int):
    """Steps [first, last) at `pp` (after loading `first` from `path` when first > 0), then
    save `last`; returns (the whole batch's losses, the full weights)."""
    world = dist.get_world_size()
    cfg = config(n_layers=4)
    dims = flatshard.ParallelDims(world, pp=pp)
    if pp > 1:
        pipe = flatshard.pipeline(build_model(cfg, seed=7), dims, loss_fn=_loss,
                                  microbatches=4, schedule="1f1b")  # fmt: skip
        model = pipe.model
    else:
        model = flatshard.parallelize(build_model(cfg, seed=7), dims)
    optimizer = adamw(model.parameters())
    if first:
        checkpoint.load(path, model=model, optimizer=optimizer, step=first)
    meshes = dims.build()
    losses = []
    for tokens in batches(cfg, last, batch=BATCH)[first:last]:
        mine = tokens.chunk(meshes.dp.size())[meshes.dp_rank]
        if pp > 1:
            loss = pipe.step(mine[:, :-1], mine[:, 1:])
        else:
            loss = _loss(model(mine[:, :-1]), mine[:, 1:])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total, group=meshes.dp.get_group())
        losses.append((total / meshes.dp.size()).item())
    checkpoint.save(path, model=model, optimizer=optimizer, step=last)
    return losses, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


@pytest.mark.parametrize("save_pp,load_pp", [(2, 1), (2, 4), (1, 2)])
def test_a_checkpoint_does_not_depend_on_pp(tmp_path, save_pp, load_pp):
    """3 steps at one pp, saved; 2 more at another from the checkpoint: the losses and
    weights of 5 steps straight at world 4 without a pipeline."""
    straight, weights = run_distributed(_train_and_save, 4, str(tmp_path / "straight"), 1, 0, 5)[0]
    first = run_distributed(_train_and_save, 4, str(tmp_path / "run"), save_pp, 0, 3)[0][0]
    results = run_distributed(_train_and_save, 4, str(tmp_path / "run"), load_pp, 3, 5)
    assert first + results[0][0] == pytest.approx(straight, rel=1e-5)
    merged = {k: v for _, ours in results for k, v in ours.items()}
    assert merged.keys() == weights.keys()
    for key, value in weights.items():
        assert (merged[key] - value).norm() <= 1e-5 * value.norm(), key


def _pipeline_errors():
    dims = flatshard.ParallelDims(2, pp=2)
    found = []
    for make in (
        lambda: flatshard.parallelize(build_model(config()), dims),
        lambda: flatshard.pipeline(build_model(config()), dims, loss_fn=_loss,
                                   microbatches=2, schedule="zigzag"),  # fmt: skip
        lambda: flatshard.pipeline(build_model(config()), dims, loss_fn=_loss,
                                   microbatches=2, schedule="gpipe").step(  # fmt: skip
            torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long)
        ),
    ):
        try:
            make()
            found.append("no error")
        except (flatshard.MeshError, ValueError) as error:
            found.append(str(error))
    return found


def test_what_a_pipeline_cannot_take_is_said_plainly():
    no_stages, schedule, batch = run_distributed(_pipeline_errors, 2)[0]
    assert "pp=2 splits the model into pipeline stages" in no_stages
    assert "unknown schedule 'zigzag'" in schedule and "interleaved-1f1b" in schedule
    assert "3 rows does not split into 2 equal micro-batches" in batch


def _materialized_stage(pp: int):
    cfg = config(n_layers=4)
    with torch.device("meta"):
        whole = build_model(cfg)
    dims = flatshard.ParallelDims(dist.get_world_size(), pp=pp)
    pipe = flatshard.pipeline(whole, dims, loss_fn=_loss, microbatches=2, schedule="gpipe")
    torch.manual_seed(0)
    flatshard.materialize(pipe.model, "cpu", replay=whole)
    return get_model_state_dict(pipe.model, options=StateDictOptions(full_state_dict=True))


def test_a_stage_built_on_meta_holds_the_whole_models_weights():
    """`materialize(stage, replay=whole)`: the blocks other stages hold draw their random
    numbers on throwaway copies, so each stage's weights are the eager model's."""
    eager = build_model(config(n_layers=4), seed=0).state_dict()
    for pp, world in ((2, 2), (4, 4)):
        stages = run_distributed(_materialized_stage, world, pp)
        assert sorted(k for s in stages for k in s) == sorted(eager)
        for weights in stages:
            for key, value in weights.items():
                assert torch.equal(value, eager[key]), key


def _pipelined_transformers():
    """A transformers Llama at (pp 2, dp 2) under 1F1B against the same model in one
    process: (per step the whole batch's loss and the reference's, the largest weight
    difference)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = HFConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)  # fmt: skip
    whole = LlamaForCausalLM(config)
    reference = copy.deepcopy(whole)
    reference_optimizer = adamw(reference.parameters())
    dims = flatshard.ParallelDims(dist.get_world_size(), pp=2)
    pipe = flatshard.pipeline(whole, dims, loss_fn=_loss, microbatches=2, schedule="1f1b")
    optimizer = adamw(pipe.model.parameters())
    meshes = dims.build()
    generator = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 96, (BATCH, 17), generator=generator)
        expected = _loss(reference(tokens[:, :-1]).logits, tokens[:, 1:])
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        mine = tokens.chunk(meshes.dp.size())[meshes.dp_rank]
        loss = pipe.step(mine[:, :-1], mine[:, 1:])
        optimizer.step()
        optimizer.zero_grad()
        total = loss.double().reshape(1)
        dist.all_reduce(total, group=meshes.dp.get_group())
        losses.append(((total / meshes.dp.size()).item(), expected.item()))
    ours = get_model_state_dict(pipe.model, options=StateDictOptions(full_state_dict=True))
    theirs = reference.state_dict()
    worst = max(((v - theirs[k]).norm() / theirs[k].norm()).item() for k, v in ours.items())
    return losses, worst, sorted(ours)


def test_a_transformers_model_pipelined_equals_one_process():
    results = run_distributed(_pipelined_transformers, 4)
    names = set()
    for losses, worst, held in results:
        for ours, expected in losses:
            assert abs(ours - expected) <= 1e-5 * abs(expected), losses
        assert worst <= 1e-5, worst
        names.update(held)
    assert "model.layers.3.mlp.down_proj.weight" in names and "lm_head.weight" in names


def _mixed_precision():
    """bf16 compute, fp32 reduction: the pipeline (pp 2 x dp 2, 2 micro-batches of 2 rows a
    data-parallel rank) against the same model without one (dp 4, 2 rows a rank): the rows
    meet the same bf16 weights in the same groups: the first step's losses are equal, then
    the fp32 sums' rounding moves a few bf16 roundings, which AdamW's normalised steps carry
    into the weights (losses within 2e-4 relative, weights 5e-3)."""
    cfg = config(n_layers=4)
    policy = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    world = dist.get_world_size()
    plain = flatshard.parallelize(build_model(cfg), flatshard.ParallelDims(world), mp_policy=policy)
    dims = flatshard.ParallelDims(world, pp=2)
    pipe = flatshard.pipeline(build_model(cfg), dims, loss_fn=_loss, microbatches=2,
                              schedule="1f1b", mp_policy=policy)  # fmt: skip
    meshes = dims.build()
    optimizers = adamw(plain.parameters()), adamw(pipe.model.parameters())
    losses = []
    for tokens in batches(cfg, STEPS, batch=BATCH):
        mine = tokens.chunk(world)[dist.get_rank()]
        loss = _loss(plain(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        rows = tokens.chunk(meshes.dp.size())[meshes.dp_rank]
        piped = pipe.step(rows[:, :-1], rows[:, 1:])
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        both = torch.stack([loss.detach().double() / world, piped.double() / meshes.dp.size()])
        dist.all_reduce(both[:1])
        dist.all_reduce(both[1:], group=meshes.dp.get_group())
        losses.append(both.tolist())
    options = StateDictOptions(full_state_dict=True)
    ours = get_model_state_dict(pipe.model, options=options)
    theirs = get_model_state_dict(plain, options=options)
    worst = max(((v - theirs[k]).norm() / theirs[k].norm()).item() for k, v in ours.items())
    return losses, worst


def test_mixed_precision_pipelined_equals_the_run_without_a_pipeline():
    for losses, worst in run_distributed(_mixed_precision, 4):
        assert losses[0][0] == losses[0][1], losses
        for plain, piped in losses:
            assert abs(piped - plain) <= 2e-4 * abs(plain), losses
        assert worst <= 5e-3, worst
