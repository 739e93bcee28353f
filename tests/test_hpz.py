"""`reshard_after_forward=<int>` (ZeRO++ hpZ, FSDP2's int): after forward each block stays
sharded over n consecutive ranks, so backward's all-gathers stay inside that small group.
Same losses as one process and as FSDP2's own, fewer bytes gathered over all ranks."""

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
    full_state,
    lm_loss,
    mean_over_ranks,
    rank_slice,
    rel_diff,
    train,
)

import flatshard
from flatshard import comm

STEPS = 3


def _train(framework: str, reshard_after_forward):
    if framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = flatshard.fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(config())
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optimizer = adamw(model.parameters())
    losses, gathered = [], []
    for tokens in batches(config(), STEPS, batch=12 * 2):
        comm.traffic.all_gather_by_group_size.clear()
        step_loss = torch.zeros(())
        for piece in tokens.chunk(2):  # accumulation: backward gathers twice per step
            loss = lm_loss(model, rank_slice(piece, rank, world)) / 2
            loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        gathered.append(dict(comm.traffic.all_gather_by_group_size))
        losses.append(mean_over_ranks(step_loss.item(), world))
    return losses, full_state(model), gathered


def test_hpz_matches_fsdp2_and_one_process_with_fewer_wide_gathers():
    reference = build_model(config())
    ref_losses = train(reference, batches(config(), STEPS, batch=12 * 2), microbatches=2)
    ours, weights, gathered = run_distributed(_train, 4, "flatshard", 2)[0]
    plain_gathered = run_distributed(_train, 4, "flatshard", True)[0][2]
    theirs = run_distributed(_train, 4, "fsdp2", 2)[0][0]
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) <= 1e-6
    assert rel_diff(weights, reference.state_dict()) <= 1e-6
    assert max(abs(a - b) / b for a, b in zip(ours, ref_losses)) <= 1e-6
    for hpz, zero3 in zip(gathered, plain_gathered):
        assert hpz.get(2, 0) > 0 and hpz[4] < zero3[4]
        assert hpz[4] + hpz[2] == zero3[4]  # the same bytes, the backward's on pairs


def _bad(size):
    try:
        flatshard.fully_shard(torch.nn.Linear(2, 2), reshard_after_forward=size)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("size", [3])
def test_hpz_group_size_must_divide(size):
    for message in run_distributed(_bad, 4, size):
        assert "must divide the shard group's size (4)" in message
