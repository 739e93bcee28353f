"""Expert parallelism (flatshard.parallel.ExpertParallel) under fully_shard: each EP rank
owns E/ep experts, tokens travel by all-to-all, experts are sharded over the
expert-data-parallel ranks (efsdp = world / ep), dense layers over all ranks. Every expert
and dense gradient equals one process's, tensor by tensor, whatever ep and efsdp (1
included: no FSDP2-style ep-times scaling error), and training equals one process; the
checkpoint is keyed by global expert and loads at any other ep."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import (
    batches,
    full_optimizer_state,
    full_state,
    rank_slice,
    rel_diff,
    rel_losses,
    train,
)
from test_gradients import full_grads, per_tensor_errors
from test_moe_training import moe_loss
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import flatshard
from flatshard import checkpoint
from flatshard.models import MoE, MoEConfig
from flatshard.models.moe import split_experts

STEPS = 5
TOLERANCE = 1e-6
STYLES = {"qwen3_moe": {}, "deepseek_v3": {"n_experts": 8}, "mixtral": {}}


def _config(style):
    return MoEConfig.tiny(style, aux_loss_coef=0.1, **STYLES[style])


def build(style="qwen3_moe", seed=0, silent_expert=None):
    """The reference MoE; `silent_expert`: an expert no token is routed to (its router
    correction bias very negative: DeepSeek-style only)."""
    torch.manual_seed(seed)
    model = MoE(_config(style))
    if silent_expert is not None:
        for block in model.layers:
            bias = getattr(getattr(block.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias[silent_expert] = -1e4
    return model


def ep_model(ep: int, style="qwen3_moe", zero_stage=3, seed=0, silent_expert=None, **settings):
    """Experts split over `ep` ranks and sharded over world/ep (ep 1: no EP, experts in
    their blocks' units); the rest over every rank. `settings`: more fully_shard arguments
    for every unit (mp_policy, offload_policy)."""
    model = build(style, seed, silent_expert)
    dims = flatshard.ParallelDims(dist.get_world_size(), ep=ep)
    return flatshard.parallelize(model, dims, zero_stage=zero_stage, **settings)


def _reference(style, steps, silent_expert=None):
    return build(style, 0, silent_expert), batches(_config(style), steps)


def _train_ep(ep, style, zero_stage, silent_expert=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ep_model(ep, style, zero_stage, silent_expert=silent_expert)
    data = batches(_config(style), STEPS)
    loss_fn = partial(moe_loss, group=dist.group.WORLD)
    losses = train(model, data, rank=rank, world=world, loss_fn=loss_fn)
    return losses, full_state(model)


# (world, ep, style, ZeRO stage, an expert no token reaches); ep = world: efsdp is 1
CASES = [(4, 1, "qwen3_moe", 3, None), (4, 2, "qwen3_moe", 2, None),
         (4, 4, "qwen3_moe", 3, None), (2, 2, "qwen3_moe", 3, None),
         (4, 2, "deepseek_v3", 3, 5)]  # fmt: skip


@pytest.mark.parametrize("world, ep, style, stage, silent", CASES, ids=str)
def test_expert_parallel_trains_like_one_process(world, ep, style, stage, silent):
    reference, data = _reference(style, STEPS, silent)
    ref_losses = train(reference, data, loss_fn=moe_loss)
    for losses, weights in run_distributed(_train_ep, world, ep, style, stage, silent):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE


def _train_bf16(ep, fraction):
    rank, world = dist.get_rank(), dist.get_world_size()
    mp = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = flatshard.OffloadPolicy(fraction=fraction)
    model = ep_model(ep, mp_policy=mp, offload_policy=offload)
    loss_fn = partial(moe_loss, group=dist.group.WORLD)
    return train(
        model, batches(_config("qwen3_moe"), STEPS), rank=rank, world=world, loss_fn=loss_fn
    )


def test_bf16_expert_parallel_and_offload():
    """bf16 compute with fp32 reduction: EP 2 takes the steps of no EP up to bf16 rounding,
    and offloading half of the optimizer (experts included) changes nothing."""
    plain = run_distributed(_train_bf16, 4, 1, 0.0)[0]
    ep = run_distributed(_train_bf16, 4, 2, 0.0)[0]
    ep_offloaded = run_distributed(_train_bf16, 4, 2, 0.5)[0]
    assert rel_losses(ep, plain) <= 2**-8
    assert ep_offloaded == ep


def _first_gradients(ep):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ep_model(ep)
    tokens = batches(_config("qwen3_moe"), 1)[0]
    moe_loss(model, rank_slice(tokens, rank, world), group=dist.group.WORLD).backward()
    return full_grads(model)


@pytest.mark.parametrize("world, ep", [(4, 4), (4, 2), (2, 2)], ids=str)
def test_expert_gradients_equal_one_process_per_tensor(world, ep):
    """efsdp = 1 (ep = world) included: a divide factor that forgot the EP ranks (or the
    size-1 shard group) shows here as a factor of ep."""
    reference, data = _reference("qwen3_moe", 1)
    moe_loss(reference, data[0]).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for grads in run_distributed(_first_gradients, world, ep):
        errors = per_tensor_errors(grads, expected)
        assert max(errors.values()) <= 2e-6, errors


def _save_ep(path, ep):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ep_model(ep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = batches(_config("qwen3_moe"), 2)
    loss_fn = partial(moe_loss, group=dist.group.WORLD)
    train(model, data, rank=rank, world=world, loss_fn=loss_fn, make_optimizer=lambda _: optimizer)
    checkpoint.save(path, model=model, optimizer=optimizer, step=2)
    return full_state(model), full_optimizer_state(model, optimizer)


def _load_ep(path, ep):
    """Load, then train the remaining steps with the loaded optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ep_model(ep, seed=3) if ep else _plain_sharded(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    checkpoint.load(path, model=model, optimizer=optimizer)
    loaded = full_state(model), full_optimizer_state(model, optimizer)
    data = batches(_config("qwen3_moe"), STEPS)[2:]
    group = dist.group.WORLD if world > 1 else None
    loss_fn = partial(moe_loss, group=group)
    losses = train(
        model, data, rank=rank, world=world, loss_fn=loss_fn, make_optimizer=lambda _: optimizer
    )
    return loaded, losses, full_state(model)


def _plain_sharded(seed):
    torch.manual_seed(seed)
    model = MoE(_config("qwen3_moe"))
    for block in model.layers:
        flatshard.fully_shard(block)
    flatshard.fully_shard(model)
    return model


def test_ep_checkpoint_is_keyed_by_global_expert(tmp_path):
    """Saved at ep 2 (world 4), loaded at ep 4, ep 1, world 2 with ep 2, in one process and
    without EP: model and optimizer bitwise; the remaining steps equal uninterrupted
    training in one process."""
    reference, data = _reference("qwen3_moe", STEPS)
    ref_losses = train(reference, data, loss_fn=moe_loss)
    path = str(tmp_path / "ep")
    saved_weights, saved_moments = run_distributed(_save_ep, 4, path, 2)[0]
    for world, ep in ((4, 4), (4, 1), (2, 2), (1, 0), (2, 0)):
        (weights, moments), losses, final = run_distributed(_load_ep, world, path, ep)[0]
        assert rel_diff(weights, saved_weights) == 0.0, (world, ep)
        assert moments.keys() == saved_moments.keys(), (world, ep)
        assert all(torch.equal(moments[k], saved_moments[k]) for k in moments), (world, ep)
        assert rel_losses(losses, ref_losses[2:]) <= TOLERANCE, (world, ep)
        assert rel_diff(final, reference.state_dict()) <= TOLERANCE, (world, ep)


def _clip_norm(ep):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ep_model(ep)
    tokens = batches(_config("qwen3_moe"), 1)[0]
    moe_loss(model, rank_slice(tokens, rank, world), group=dist.group.WORLD).backward()
    norm = flatshard.clip_grad_norm_(model.parameters(), max_norm=0.5)
    return norm.item(), full_grads(model)


def test_clip_grad_norm_over_dense_and_expert_parameters():
    """Dense parameters live on the data-parallel mesh, experts on (efsdp, ep): the total
    norm counts every element once, and the clipped gradients equal one process's."""
    reference, data = _reference("qwen3_moe", 1)
    moe_loss(reference, data[0]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5).item()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for norm, grads in run_distributed(_clip_norm, 4, 2):
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm
        assert max(per_tensor_errors(grads, expected).values()) <= 2e-6


def _bad_router_index():
    """Rank 2's router picks expert E (out of range) in the first MoE layer."""
    model = ep_model(4)
    if dist.get_rank() == 2:
        router = model.layers[0].mlp.gate
        original = router.forward

        def broken(x):
            weights, indices, stats = original(x)
            return weights, torch.full_like(indices, router.n_experts), stats

        router.forward = broken
    tokens = batches(_config("qwen3_moe"), 1)[0]
    try:
        moe_loss(model, rank_slice(tokens, dist.get_rank(), 4), group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "no error"


def test_out_of_range_expert_index_raises_on_every_rank():
    for message in run_distributed(_bad_router_index, 4):
        assert "rank(s) [2]" in message and "outside [0, 4)" in message, message


def _tp_and_ep():
    """Dense layers TP over pairs of ranks (attention split by heads), experts EP over the
    ranks holding different data (the same TP index) and sharded over each TP pair."""
    dims = flatshard.ParallelDims(dist.get_world_size(), tp=2, ep=2)
    attention = {f"attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    attention["attn.o_proj"] = RowwiseParallel()
    plan = flatshard.ParallelPlan(
        "layers",
        lambda model, tp_mesh: [parallelize_module(b, tp_mesh, attention) for b in model.layers],
        split_experts,
    )
    model = flatshard.parallelize(build("mixtral"), dims, plan=plan)
    meshes = dims.build()
    data = batches(_config("mixtral"), STEPS)
    group = meshes.dp.get_group()
    losses = train(
        model, data, rank=meshes.dp_rank, world=dims.dp, loss_fn=partial(moe_loss, group=group)
    )
    return [loss / dims.tp for loss in losses], full_state(model)  # train() summed tp copies


def test_tensor_parallel_dense_layers_with_expert_parallel_experts():
    reference, data = _reference("mixtral", STEPS)
    ref_losses = train(reference, data, loss_fn=moe_loss)
    for losses, weights in run_distributed(_tp_and_ep, 4):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE
