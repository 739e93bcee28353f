"""HSDP: parameters sharded over `dp_shard`, replicated over `dp_replicate` (FSDP2's 2-D
mesh). Gradients are reduce-scattered inside a replica and summed over the replicas; the
result equals one process, tensor by tensor; checkpoints are written once per replica
group and load at any other layout."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import (
    adamw,
    batches,
    build_model,
    config,
    full_optimizer_state,
    full_state,
    hsdp_mesh,
    lm_loss,
    rank_slice,
    rel_diff,
    rel_losses,
    shard,
    train,
)
from test_gradients import (
    backward_micro_batches,
    full_grads,
    per_tensor_errors,
    variant_data,
    variant_model,
)

from flatshard import checkpoint, registry

TOLERANCE = 1e-6
STEPS = 5


def _train(zero_stage, microbatches, sync_last_only, tied, replicas):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(tie_embeddings=tied)
    data = batches(cfg, STEPS, batch=12 * microbatches)
    model = shard(build_model(cfg), zero_stage, mesh=hsdp_mesh(replicas))
    losses = train(
        model, data, rank=rank, world=world, microbatches=microbatches,
        sync_last_only=sync_last_only,
    )  # fmt: skip
    return losses, full_state(model)


CASES = [
    # (ZeRO stage, micro-batches, sync on the last only, tied embeddings)
    (3, 1, False, False),
    (2, 1, False, False),
    (3, 3, False, True),
    (2, 3, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "zero{}-micro{}-last{}-tied{}".format(*c))
def test_hsdp_trains_like_one_process(case):
    zero_stage, microbatches, sync_last_only, tied = case
    cfg = config(tie_embeddings=tied)
    reference = build_model(cfg)
    data = batches(cfg, STEPS, batch=12 * microbatches)
    ref_losses = train(reference, data, microbatches=microbatches)
    for losses, weights in run_distributed(_train, 4, *case, 2):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE


def _gradients(variant, replicas, hold_all_reduce):
    """First gradients, with micro-batches accumulated without the replica all-reduce
    (set_requires_all_reduce(False)) until the last when `hold_all_reduce`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(variant_model(variant), 3, mesh=hsdp_mesh(replicas))
    tokens = variant_data(variant)[0]
    pieces = tokens.chunk(3)
    for i, piece in enumerate(pieces):
        if hold_all_reduce:
            model.set_requires_all_reduce(i == len(pieces) - 1)
        backward_micro_batches(model, piece, 1, False, rank, world)
    grads = full_grads(model)
    unit = registry.unit_of(model.embed_tokens)
    return grads, unit.looked_up_from_shards()


@pytest.mark.parametrize("replicas", [2, 4])
def test_hsdp_gradients_per_tensor(replicas):
    for variant in ("plain", "lookup"):
        for hold in (False, True):
            reference = variant_model(variant)
            for piece in variant_data(variant)[0].chunk(3):
                backward_micro_batches(reference, piece, 1, False)
            expected = full_grads(reference)
            grads, looked_up = run_distributed(_gradients, 4, variant, replicas, hold)[0]
            errors = per_tensor_errors(grads, expected)
            assert max(errors.values()) <= 2e-6, (variant, hold, errors)
            if variant == "lookup":  # (the small plain batches may look up too)
                assert looked_up == (4 // replicas > 1), (variant, replicas, looked_up)


def _save_hsdp(path, replicas):
    cfg = config()
    model = shard(build_model(cfg), 3, mesh=hsdp_mesh(replicas) if replicas else None)
    optimizer = adamw(model.parameters())
    train_steps = batches(cfg, 2)
    rank, world = dist.get_rank(), dist.get_world_size()
    for tokens in train_steps:
        lm_loss(model, rank_slice(tokens, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(path, model=model, optimizer=optimizer, step=2)
    return full_state(model), full_optimizer_state(model, optimizer)


def _load(path, replicas):
    cfg = config()
    mesh = hsdp_mesh(replicas) if replicas else None
    model = shard(build_model(cfg, seed=3), 3, mesh=mesh)
    optimizer = adamw(model.parameters())
    checkpoint.load(path, model=model, optimizer=optimizer)
    return full_state(model), full_optimizer_state(model, optimizer)


def _data_bytes(path) -> int:
    step = os.path.join(path, "step-00000002")
    return sum(
        os.path.getsize(os.path.join(step, f)) for f in os.listdir(step) if f.endswith(".distcp")
    )


def test_hsdp_checkpoint_written_once_and_loads_anywhere(tmp_path):
    hsdp, flat = str(tmp_path / "hsdp"), str(tmp_path / "flat")
    saved = run_distributed(_save_hsdp, 4, hsdp, 2)[0]
    run_distributed(_save_hsdp, 2, flat, 0)  # the same shards (2), no replicas
    # the replicas hold the same rows: each is written once
    assert _data_bytes(hsdp) == _data_bytes(flat)
    for world, replicas in ((4, 0), (4, 4), (2, 0), (1, 0)):
        weights, optim = run_distributed(_load, world, hsdp, replicas)[0]
        assert rel_diff(weights, saved[0]) == 0.0, (world, replicas)
        assert optim.keys() == saved[1].keys()
        assert all(torch.equal(optim[k], saved[1][k]) for k in optim), (world, replicas)
    weights, _ = run_distributed(_load, 4, flat, 2)[0]  # a 1-D checkpoint into HSDP
    assert rel_diff(weights, run_distributed(_load, 1, flat, 0)[0][0]) == 0.0


# --- a hook in place of the replica all-reduce (torchft's fault-tolerant HSDP) --------------
def _replicas_by_hook(by_hook: bool):
    """fully_shard over each replica's shard ranks only; `set_all_reduce_hook` averages the
    reduced shards over the replicas itself (against native HSDP 2 x 2)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    mesh = hsdp_mesh(2)
    if not by_hook:
        model = shard(build_model(cfg), 3, mesh=mesh)
    else:
        model = shard(build_model(cfg), 3, mesh=mesh["dp_shard"])
        replicas = mesh.get_group("dp_replicate")

        def average_over_replicas(reduced: torch.Tensor) -> None:
            dist.all_reduce(reduced, group=replicas)
            reduced.div_(dist.get_world_size(replicas))

        for unit in (*model.layers, model):
            unit.set_all_reduce_hook(average_over_replicas)
    losses = train(model, batches(cfg, STEPS), rank=rank, world=world)
    return losses, full_state(model)


def test_all_reduce_hook_in_place_of_the_replica_all_reduce_trains_like_hsdp():
    native = run_distributed(_replicas_by_hook, 4, False)
    hooked = run_distributed(_replicas_by_hook, 4, True)
    for (losses, weights), (reference_losses, reference_weights) in zip(hooked, native):
        assert rel_losses(losses, reference_losses) <= TOLERANCE
        assert rel_diff(weights, reference_weights) <= TOLERANCE
    assert rel_diff(hooked[0][1], hooked[2][1]) == 0.0  # the replicas stay equal
