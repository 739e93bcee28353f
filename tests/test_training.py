"""Sharded training equals single-process training (fp32): losses and final weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed, world_sizes
from reference import (
    GLOBAL_BATCH,
    batches,
    build_model,
    config,
    full_state,
    rel_diff,
    rel_losses,
    shard,
    train,
)

import flatshard
from flatshard import registry
from flatshard.models import Llama

TOLERANCE = 1e-6
STEPS = 5


def _compare(
    zero_stage,
    microbatches=1,
    sync_last_only=False,
    cfg_overrides=None,
    freeze=None,
    make_optimizer=None,
    meta_init=False,
):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(**(cfg_overrides or {}))
    data = batches(cfg, STEPS, batch=GLOBAL_BATCH * microbatches)
    extra = {} if make_optimizer is None else {"make_optimizer": make_optimizer}

    reference = build_model(cfg)
    if freeze:
        reference.get_parameter(freeze).requires_grad_(False)
    ref_losses = train(reference, data, microbatches=microbatches, **extra)

    if meta_init:
        with torch.device("meta"):
            model = Llama(cfg)
    else:
        model = build_model(cfg)
    if freeze:
        model.get_parameter(freeze).requires_grad_(False)
    shard(model, zero_stage)
    if meta_init:
        torch.manual_seed(0)
        flatshard.materialize(model)
    losses = train(
        model,
        data,
        rank=rank,
        world=world,
        microbatches=microbatches,
        sync_last_only=sync_last_only,
        **extra,
    )
    unit = registry.unit_of(model.embed_tokens)  # None when tied to the head
    looked_up = unit is not None and unit.looked_up_from_shards()
    return (
        rel_losses(losses, ref_losses),
        rel_diff(full_state(model), reference.state_dict()),
        looked_up,
    )


def pairwise(offset: int, *extra: str):
    """The (world size, ZeRO stage[, flag]) cases of a feature's test: in CI the half whose
    sum is odd after `offset` (each stage at two world sizes, each world size at least once;
    the features' offsets differ, so together they cover every pair), the rest exhaustive
    (test_gradients.py checks every feature at every pair per tensor)."""
    names = ", ".join(("world_size", "zero_stage", *extra))
    flags = [(False,), (True,)] if extra else [()]
    cases = [
        pytest.param(
            w, s, *f, marks=() if (w + s + sum(f) + offset) % 2 else pytest.mark.exhaustive
        )
        for w in (1, 2, 3, 4)
        for s in (1, 2, 3)
        for f in flags
    ]
    return pytest.mark.parametrize(names, cases)


def _check(results, looked_up=False):
    for loss_error, weight_error, used_lookup in results:
        assert loss_error <= TOLERANCE, results
        assert weight_error <= TOLERANCE, results
        assert used_lookup == looked_up, results


@world_sizes
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_matches_single_process(world_size, zero_stage):
    _check(run_distributed(_compare, world_size, zero_stage))


@pairwise(0, "sync_last_only")
def test_gradient_accumulation(world_size, zero_stage, sync_last_only):
    _check(
        run_distributed(
            _compare, world_size, zero_stage, microbatches=4, sync_last_only=sync_last_only
        )
    )


# 509 rows > ranks x tokens per rank (96): ZeRO-2/3 look the embedding up from its shards
# (sharded_lookup.py) instead of gathering it; at vocab 61 they gather.
LARGE_VOCAB = {"vocab_size": 509}


@pairwise(1)
def test_embedding_looked_up_from_shards(world_size, zero_stage):
    results = run_distributed(_compare, world_size, zero_stage, cfg_overrides=LARGE_VOCAB)
    _check(results, looked_up=world_size > 1 and zero_stage != 1)


@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("sync_last_only", [False, True])
def test_embedding_lookup_with_gradient_accumulation(zero_stage, sync_last_only):
    results = run_distributed(
        _compare,
        4,
        zero_stage,
        microbatches=4,
        sync_last_only=sync_last_only,
        cfg_overrides=LARGE_VOCAB,
    )
    _check(results, looked_up=True)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_frozen_embedding_looked_up_from_shards(zero_stage):
    results = run_distributed(
        _compare, 2, zero_stage, freeze="embed_tokens.weight", cfg_overrides=LARGE_VOCAB
    )
    _check(results, looked_up=True)


@pairwise(0)
def test_tied_embeddings(world_size, zero_stage):
    _check(
        run_distributed(_compare, world_size, zero_stage, cfg_overrides={"tie_embeddings": True})
    )


@pairwise(1)
def test_frozen_embedding(world_size, zero_stage):
    _check(run_distributed(_compare, world_size, zero_stage, freeze="embed_tokens.weight"))


@pairwise(1)
def test_meta_device_init(world_size, zero_stage):
    _check(
        run_distributed(
            _compare, world_size, zero_stage, meta_init=True, cfg_overrides={"tie_embeddings": True}
        )
    )


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3)


@pytest.mark.parametrize("make_optimizer", [_sgd, _adam])
def test_other_optimizers(make_optimizer):
    _check(run_distributed(_compare, 3, 3, make_optimizer=make_optimizer))
