"""FSDP2's custom collectives: the same `AllGather` / `ReduceScatter` objects, set with
`set_custom_all_gather` / `set_custom_reduce_scatter` on every module, run every bucket's
collectives under flatshard (counted), and train as flatshard's own collectives do and as
FSDP2 does with them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, build_model, config, rel_losses, train
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

import flatshard

STEPS = 4


class _Counting:
    """Counts calls and buffers handed out."""

    def __init__(self):
        self.calls = self.allocations = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_Counting, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


class CountingReduceScatter(_Counting, ReduceScatter):
    """Sums with gloo's reduce-scatter (AVG divided here: the op arrives as FSDP2 gives it)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        average = op == dist.ReduceOp.AVG
        dist.reduce_scatter_tensor(output_tensor, input_tensor, dist.ReduceOp.SUM, group)
        if average:
            output_tensor.div_(dist.get_world_size(group))
        return None


def _train(library: str, custom: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    if library == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = flatshard.fully_shard
    model = build_model(config())
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    gather, scatter = CountingAllGather(), CountingReduceScatter()
    if custom:
        for module in (*model.layers, model):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
    losses = train(model, batches(config(), STEPS), rank=rank, world=world)
    return losses, (gather.calls, gather.allocations, scatter.calls, scatter.allocations)


def test_custom_collectives_run_every_bucket_and_train_like_the_default_and_fsdp2():
    own = run_distributed(_train, 2, "flatshard", False)[0][0]
    ours, (gathers, gather_buffers, scatters, scatter_buffers) = run_distributed(
        _train, 2, "flatshard", True
    )[0]
    theirs, _ = run_distributed(_train, 2, "fsdp2", True)[0]
    assert gathers >= 3 * STEPS and scatters >= 3 * STEPS  # every unit, every step
    assert gather_buffers == gathers and scatter_buffers == 2 * scatters  # input and output
    assert rel_losses(ours, own) <= 1e-6
    assert rel_losses(ours, theirs) <= 1e-5
