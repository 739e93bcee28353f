"""FSDP2's custom collectives on flatshard's buckets (`set_custom_all_gather`,
`set_custom_reduce_scatter`): a `Comm` object allocates the buffers it moves
(`allocate(size, dtype=, device=)`, e.g. from a memory pool its transport registers) and
runs the collective (`comm(output, input, group[, op], async_op=True)`). As in FSDP2, the
gathered buffer is copied out into the bucket's unsharded parameters, and the gradient
copied into the reduce-scatter's input and out of its output, when the collective is
waited on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatshard.comm import collectives


class _CopyOut:
    """The custom collective's work: waiting on it also copies its result where flatshard
    keeps it (and keeps its input alive until then)."""

    def __init__(self, work, result: torch.Tensor, target: torch.Tensor, moved: torch.Tensor):
        self._work, self._result, self._target, self._moved = work, result, target, moved

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        self._target.copy_(self._result)
        self._work = self._moved = None
        return True


def all_gather_hook(comm):
    """A bucket transport's `gather` running FSDP2's `AllGather` `comm`."""

    def gather(bucket, output, shard, group, pieces):
        gathered = comm.allocate((output.numel(),), dtype=output.dtype, device=output.device)
        collectives.traffic.all_gather += gathered.numel() * gathered.element_size()
        work = comm(gathered, shard, group, async_op=True)
        return _CopyOut(work, gathered, output, shard)

    return gather


def reduce_scatter_hook(comm):
    """A bucket transport's `scatter` running FSDP2's `ReduceScatter` `comm`."""

    def reduce_scatter(bucket, output, flat, average, group):
        source = comm.allocate((flat.numel(),), dtype=flat.dtype, device=flat.device)
        source.copy_(flat)
        reduced = comm.allocate((output.numel(),), dtype=output.dtype, device=output.device)
        collectives.traffic.reduce_scatter += source.numel() * source.element_size()
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        work = comm(reduced, source, group, op, async_op=True)
        return _CopyOut(work, reduced, output, source)

    return reduce_scatter
