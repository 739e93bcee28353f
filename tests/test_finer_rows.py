"""Grouped experts fewer than ranks take a finer row (planner.py `finer_row`): with 2
experts over 4 ranks (and with ExpertParallel ep 2 at world 4: 1 local expert over 2
efsdp ranks) each rank holds half the rows of one expert, a `(1, R/2, C)` box. Training
equals one process (losses, weights), no rank warns of empty ranks, DCP checkpoints
reshard bitwise between world 4, 2 and 1 (model and optimizer), meta-device init and
full-weights files work."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, full_optimizer_state, full_state, rel_diff, rel_losses, train
from test_moe_training import moe_loss

import flatshard
from flatshard import checkpoint
from flatshard.dtensor.sharded_param import shard_spec
from flatshard.models import MoE, MoEConfig

STEPS = 5
TOLERANCE = 1e-6
EXPERTS = ("gate_up_proj", "down_proj")


def _config():
    return MoEConfig.tiny("qwen3_moe", aux_loss_coef=0.1, n_experts=2, top_k=1)


def _build(seed=0, meta=False):
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return MoE(_config())
    return MoE(_config())


def _sharded(ep: int, seed=0, meta=False):
    """Experts over `ep` EP ranks and sharded over the rest (ep 0: no EP, every block over
    every rank); warnings are recorded and returned."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = _build(seed, meta)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flatshard.parallelize(model, flatshard.ParallelDims(world, ep=ep or 1))
    if meta:
        torch.manual_seed(seed)
        flatshard.materialize(model)
    return model, [str(w.message) for w in caught if "hold none" in str(w.message)]


def _expert_pieces(model):
    """(row dims, local shape, global offset) of every expert weight on this rank."""
    out = {}
    for i, block in enumerate(model.layers):
        for name in EXPERTS:
            spec = shard_spec(getattr(block.mlp.experts, name))
            out[f"{i}.{name}"] = (spec.info.row_dims, spec.local_shape, spec.global_offset)
    return out


def _loss_fn():
    world = dist.get_world_size() if dist.is_initialized() else 1
    return partial(moe_loss, group=dist.group.WORLD if world > 1 else None)


def _train(ep, meta=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, empty_warnings = _sharded(ep, meta=meta)
    pieces = _expert_pieces(model)
    data = batches(_config(), STEPS)
    losses = train(model, data, rank=rank, world=world, loss_fn=_loss_fn())
    return losses, full_state(model), pieces, empty_warnings


def _reference():
    model = _build()
    return model, train(model, batches(_config(), STEPS), loss_fn=moe_loss)


@pytest.mark.parametrize("ep, meta", [(0, False), (2, False), (0, True)], ids=str)
def test_finer_rows_train_like_one_process(ep, meta):
    reference, ref_losses = _reference()
    cfg = _config()
    rows = {"gate_up_proj": 2 * cfg.expert_ffn_dim, "down_proj": cfg.dim}
    cols = {"gate_up_proj": cfg.dim, "down_proj": cfg.expert_ffn_dim}
    for rank, (losses, weights, pieces, empty) in enumerate(run_distributed(_train, 4, ep, meta)):
        assert not empty, empty
        for key, (row_dims, shape, offset) in pieces.items():
            name = key.partition(".")[2]
            half = rows[name] // 2
            # rank r: half r % 2 of expert r // 2 (with EP: ep rank r % 2, efsdp rank r // 2)
            expert, part = (rank // 2, rank % 2) if not ep else (rank % 2, rank // 2)
            assert (row_dims, shape) == (2, (1, half, cols[name])), (rank, key)
            assert offset == (expert, part * half, 0), (rank, key)
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE


def _save(path, ep):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _sharded(ep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = batches(_config(), 2)
    make = lambda _: optimizer  # noqa: E731
    train(model, data, rank=rank, world=world, loss_fn=_loss_fn(), make_optimizer=make)
    checkpoint.save(path, model=model, optimizer=optimizer, step=2)
    return full_state(model), full_optimizer_state(model, optimizer)


def _load(path, ep):
    """Load, then train the remaining steps with the loaded optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _sharded(ep, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    checkpoint.load(path, model=model, optimizer=optimizer)
    loaded = full_state(model), full_optimizer_state(model, optimizer)
    data = batches(_config(), STEPS)[2:]
    make = lambda _: optimizer  # noqa: E731
    losses = train(model, data, rank=rank, world=world, loss_fn=_loss_fn(), make_optimizer=make)
    return loaded, losses, full_state(model)


@pytest.mark.parametrize(
    "saved, loads",
    [((4, 0), ((2, 0), (1, 0), (4, 2))), ((4, 2), ((2, 0), (1, 0))), ((1, 0), ((4, 0), (4, 2)))],
    ids=str,
)
def test_finer_row_checkpoints_reshard_bitwise(tmp_path, saved, loads):
    """Saved at (world, ep), loaded at each other (world, ep): model and optimizer bitwise,
    the remaining steps equal uninterrupted training in one process."""
    reference, ref_losses = _reference()
    path = str(tmp_path / "ckpt")
    saved_weights, saved_moments = run_distributed(_save, saved[0], path, saved[1])[0]
    for world, ep in loads:
        (weights, moments), losses, final = run_distributed(_load, world, path, ep)[0]
        assert rel_diff(weights, saved_weights) == 0.0, (world, ep)
        assert moments.keys() == saved_moments.keys(), (world, ep)
        assert all(torch.equal(moments[k], saved_moments[k]) for k in moments), (world, ep)
        assert rel_losses(losses, ref_losses[2:]) <= TOLERANCE, (world, ep)
        assert rel_diff(final, reference.state_dict()) <= TOLERANCE, (world, ep)


def _full_weights_round_trip(path, ep):
    """Export full weights from finer-row shards, load them into another seed's model."""
    model, _ = _sharded(ep)
    checkpoint.export_full(model, path)
    other, _ = _sharded(ep, seed=3)
    checkpoint.load_full(other, path)
    return full_state(model), full_state(other)


@pytest.mark.parametrize("ep", [0, 2], ids=str)
def test_full_weights_file_round_trips(tmp_path, ep):
    from safetensors.torch import load_file

    path = str(tmp_path / "full.safetensors")
    expected = _build().state_dict()
    for exported, loaded in run_distributed(_full_weights_round_trip, 4, path, ep):
        assert rel_diff(exported, expected) == 0.0
        assert rel_diff(loaded, expected) == 0.0
    on_disk = load_file(path)
    assert all(torch.equal(on_disk[k], v) for k, v in expected.items())
