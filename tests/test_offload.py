"""Optimizer offload (`OffloadPolicy(fraction=f)`): a fraction of each rank's main weights,
gradients and optimizer state lives and is stepped on the host. The optimizer math is the
same, so training is bitwise the training without offload, at every ZeRO stage, world size
and fraction; checkpoints do not depend on where the state lived."""

from __future__ import annotations

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
    lm_loss,
    rank_slice,
    rel_diff,
    rel_losses,
    shard,
    train,
)

import flatshard
from flatshard import checkpoint
from flatshard.runtime.offload import units_below

STEPS = 4
FRACTIONS = (0.0, 0.3, 1.0)


def host_share(model) -> float:
    """The share of this rank's parameter elements whose shard lives in a host buffer."""
    host = total = 0
    for unit in units_below([model]):
        for param in unit.params:
            bucket = unit.buckets[param.bucket]
            numel = bucket.specs[param.index].numel
            host += numel if bucket.on_host(param.index) else 0
            total += numel
    return host / total


def _train_each_fraction(zero_stage, microbatches, sync_last_only, tied, precision):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(tie_embeddings=tied)
    data = batches(cfg, STEPS, batch=12 * microbatches)
    mp = flatshard.MixedPrecisionPolicy(param_dtype=precision) if precision else None
    results = {}
    for fraction in FRACTIONS:
        policy = flatshard.OffloadPolicy(fraction=fraction)
        model = shard(build_model(cfg), zero_stage, mp, offload_policy=policy)
        losses = train(
            model, data, rank=rank, world=world, microbatches=microbatches,
            sync_last_only=sync_last_only,
        )  # fmt: skip
        results[fraction] = (losses, full_state(model), host_share(model))
    return results


CASES = [
    # (world, ZeRO stage, micro-batches, sync on the last only, tied, param dtype)
    (1, 3, 1, False, False, None),
    (2, 3, 1, False, False, None),
    (2, 2, 2, False, True, None),
    (2, 1, 2, True, False, None),
    (4, 3, 3, True, True, None),
    (4, 2, 1, False, False, None),
    (2, 3, 1, False, False, torch.bfloat16),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "w{}-zero{}-micro{}-last{}-tied{}-{}".format(*c)
)
def test_offload_trains_bitwise_like_no_offload(case):
    world, *settings = case
    zero_stage, microbatches, sync_last_only, tied, precision = settings
    for results in run_distributed(_train_each_fraction, world, *settings):
        losses, weights, share = results[0.0]
        assert share == 0.0
        for fraction in FRACTIONS[1:]:
            offloaded_losses, offloaded_weights, offloaded_share = results[fraction]
            assert offloaded_losses == losses, fraction
            assert all(torch.equal(offloaded_weights[k], weights[k]) for k in weights)
            assert offloaded_share > 0.0 and (offloaded_share == 1.0) == (fraction == 1.0)
    if precision is None:  # and that is one process's training
        cfg = config(tie_embeddings=tied)
        reference = build_model(cfg)
        ref_losses = train(
            reference, batches(cfg, STEPS, batch=12 * microbatches), microbatches=microbatches
        )
        assert rel_losses(losses, ref_losses) <= 1e-6
        assert rel_diff(weights, reference.state_dict()) <= 1e-6


def _toy_with_empty_shards(fraction):
    """A head of 2 rows over 4 ranks: two ranks hold none of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    policy = flatshard.OffloadPolicy(fraction=fraction)
    flatshard.fully_shard(model[2], offload_policy=policy)
    flatshard.fully_shard(model, offload_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    rank = dist.get_rank()
    for _ in range(3):
        inputs = torch.randn(8, 6, generator=generator)[2 * rank : 2 * rank + 2]
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_state(model), host_share(model)


def test_offload_with_empty_local_shards():
    expected = run_distributed(_toy_with_empty_shards, 4, 0.0)
    for fraction in (0.5, 1.0):
        for (weights, share), (plain, _) in zip(
            run_distributed(_toy_with_empty_shards, 4, fraction), expected
        ):
            assert share > 0.0
            assert all(torch.equal(weights[k], plain[k]) for k in plain)


def _save(path, fraction, steps=2):
    cfg = config()
    model = shard(build_model(cfg), offload_policy=flatshard.OffloadPolicy(fraction=fraction))
    optimizer = adamw(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for tokens in batches(cfg, steps):
        lm_loss(model, rank_slice(tokens, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(path, model=model, optimizer=optimizer, step=steps)
    return full_state(model), full_optimizer_state(model, optimizer)


def _load_and_train(path, fraction, zero_stage):
    cfg = config()
    policy = flatshard.OffloadPolicy(fraction=fraction)
    model = shard(build_model(cfg, seed=3), zero_stage, offload_policy=policy)
    optimizer = adamw(model.parameters())
    checkpoint.load(path, model=model, optimizer=optimizer)
    loaded = full_state(model), full_optimizer_state(model, optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    for tokens in batches(cfg, 4)[2:]:  # the rest of a 4-step run
        lm_loss(model, rank_slice(tokens, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return loaded, full_state(model)


def test_checkpoint_does_not_depend_on_offload(tmp_path):
    """Saved with f = 0.3 at world 2, loaded at f = 0 and 1, world 4 and 1 (and f = 0 the
    other way): model and optimizer bitwise; the remaining steps equal an uninterrupted run."""
    uninterrupted = run_distributed(_save, 2, str(tmp_path / "full"), 0.0, 4)[0][0]
    saved = run_distributed(_save, 2, str(tmp_path / "f03"), 0.3)[0]
    plain = run_distributed(_save, 2, str(tmp_path / "f0"), 0.0)[0]
    for name in saved[0]:
        assert torch.equal(saved[0][name], plain[0][name])
    assert _files(tmp_path / "f03") == _files(tmp_path / "f0")  # same keys, shapes, bytes
    for path, world, fraction, zero_stage in (
        ("f03", 4, 0.0, 3),
        ("f03", 1, 1.0, 3),
        ("f03", 2, 1.0, 2),
        ("f0", 4, 0.3, 1),
    ):
        (weights, optim), trained = run_distributed(
            _load_and_train, world, str(tmp_path / path), fraction, zero_stage
        )[0]
        assert all(torch.equal(weights[k], saved[0][k]) for k in saved[0])
        assert optim.keys() == saved[1].keys()
        assert all(torch.equal(optim[k], saved[1][k]) for k in optim), (path, world, fraction)
        assert rel_diff(trained, uninterrupted) <= 1e-6, (path, world, fraction)


def _files(path) -> dict[str, int]:
    step = path / "step-00000002"
    return {f.name: f.stat().st_size for f in step.iterdir() if f.suffix == ".distcp"}


def _cpu_offload_policy_trains():
    from torch.distributed.fsdp import CPUOffloadPolicy

    cfg = config()
    model = shard(build_model(cfg), offload_policy=CPUOffloadPolicy())
    rank, world = dist.get_rank(), dist.get_world_size()
    return train(model, batches(cfg, 2), rank=rank, world=world), host_share(model)


def test_fsdp2_cpu_offload_policy_offloads_everything():
    cfg = config()
    reference = train(build_model(cfg), batches(cfg, 2))
    for losses, share in run_distributed(_cpu_offload_policy_trains, 2):
        assert share == 1.0
        assert rel_losses(losses, reference) <= 1e-6


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "half", True])
def test_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(flatshard.OffloadError, match=r"\[0, 1\]"):
        flatshard.OffloadPolicy(fraction=fraction)
