"""The NCCL hazard shim (flatshard/comm/nccl_shim.py) shows what asynchronous NCCL would race
on: a collective's input written before its wait gives a poisoned (torn) result, its output
read before the wait reads poison, and its output written or freed, or its input freed,
raises. CI also runs the training-parity tests with the shim on (scripts/test.sh)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, build_model, config, full_state, rel_diff, shard, train

from flatshard import comm
from flatshard.comm import nccl_shim


def _with_shim(fn):
    was = nccl_shim.active()
    nccl_shim.set_active(True)
    try:
        return fn()
    finally:
        nccl_shim.set_active(was)


def _hazards():
    group, world = dist.group.WORLD, dist.get_world_size()
    rank = dist.get_rank()
    found = {}

    def attempt(name, hazard):
        shard = torch.full((4,), float(rank + 1))
        output = torch.zeros(4 * world)
        work = comm.all_gather(output, shard, group)
        try:
            found[name] = hazard(shard, output)
            work.wait()
            found.setdefault(name, None)
            found[name + " result"] = output.tolist()
        except nccl_shim.HazardError as error:
            found[name] = str(error)

    def write_input(shard, output):
        shard.add_(1)

    def write_output(shard, output):
        output.zero_()

    attempt("clean", lambda shard, output: None)
    attempt("input written", write_input)
    attempt("output read", lambda shard, output: bool(output.sum().isnan()))
    attempt("output written", write_output)
    attempt("output freed", lambda shard, output: comm.free_storage(output))

    flat, out = torch.ones(2 * world), torch.zeros(2)
    work = comm.reduce_scatter(out, flat, group, average=False)
    flat.mul_(3)  # a write to the input while NCCL may still be reading it
    work.wait()
    found["reduce-scatter input written"] = out.isnan().all().item()
    return found


def test_shim_reports_each_hazard():
    for found in run_distributed(_hazards_under_shim, 2):
        assert found["clean"] is None
        assert found["clean result"] == [1.0] * 4 + [2.0] * 4
        assert all(math.isnan(v) for v in found["input written result"])  # torn: poisoned
        assert found["output read"] is True  # poisoned: the read saw NaN
        assert "the output was written" in found["output written"]
        assert "the output was freed" in found["output freed"]
        assert found["reduce-scatter input written"] is True


def _hazards_under_shim():
    return _with_shim(_hazards)


def _training():
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    model = shard(build_model(cfg), 3)
    losses = train(model, batches(cfg, 3), rank=rank, world=world, microbatches=2)
    return losses, full_state(model)


def _training_under_shim():
    return _with_shim(_training)


def test_training_under_the_shim_equals_one_process():
    cfg = config()
    reference = build_model(cfg)
    ref_losses = train(reference, batches(cfg, 3), microbatches=2)
    for losses, weights in run_distributed(_training_under_shim, 2):
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 1e-6
        assert rel_diff(weights, reference.state_dict()) <= 1e-6
