"""Backends and devices: the one place that knows gloo from NCCL and CPU from CUDA.

Collectives move whole flat buckets with `all_gather_single` / `reduce_scatter_single`.
They are issued with `async_op=True`; on CUDA, NCCL runs them on its own stream and
`Work.wait()` makes the current stream wait, so compute on the current stream overlaps
them. On CPU, gloo runs them on its own threads and `wait()` blocks the caller.

gloo's reduce-scatter is a full clone + all-reduce + copy of the input: twice the bytes a
reduce-scatter needs. On gloo, flatshard reduce-scatters with one all-to-all (each rank
receives every rank's copy of its own shard: (N-1)/N of the buffer on the wire, as NCCL's
ring) and sums the N pieces locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatshard.errors import FlatShardError


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_device(device_type: str) -> torch.device:
    """Where unsharded parameters and buffers live for a mesh on `device_type`."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def group_device(group) -> torch.device:
    """Where small control tensors for `group` must live: NCCL only moves CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_storage(tensor: torch.Tensor) -> None:
    """Release a buffer's memory while views of it (saved for backward) stay valid objects."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give a buffer freed by `free_storage` its memory back (contents undefined)."""
    storage = tensor.untyped_storage()
    needed = tensor.numel() * tensor.element_size()
    if storage.size() != needed:
        storage.resize_(needed)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group) -> dist.Work | None:
    """Start gathering every rank's equal `shard` into the flat `output`."""
    return dist.all_gather_single(output, shard, group=group, async_op=True)


def reduce_scatter(output: torch.Tensor, flat: torch.Tensor, group, average: bool):
    """Start summing (or averaging) `flat` over ranks, leaving this rank's shard in `output`.

    Returns an object whose `wait()` leaves the result in `output`.
    """
    if flat.device.type == "cpu" and dist.get_backend(group) == "gloo":
        return _AllToAllReduceScatter(output, flat, group, average)
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return dist.reduce_scatter_single(output, flat, op=op, group=group, async_op=True)


class _AllToAllReduceScatter:
    """A reduce-scatter as one all-to-all (rank r receives every rank's piece r) and a local
    sum of the N pieces."""

    def __init__(self, output: torch.Tensor, flat: torch.Tensor, group, average: bool):
        self.output, self.average = output, average
        self.world = dist.get_world_size(group)
        self.received = torch.empty_like(flat)
        self.work = dist.all_to_all_single(self.received, flat, group=group, async_op=True)

    def wait(self) -> bool:
        if self.received is None:
            return True
        self.work.wait()
        pieces = self.received.view(self.world, -1)
        torch.sum(pieces, dim=0, out=self.output)
        if self.average:
            self.output.div_(self.world)
        self.received = None
        return True


def agree(local_problem: str | None, group, error_type: type[FlatShardError]) -> None:
    """Raise on every rank if any rank found a problem, so no rank waits alone in a collective.

    Costs one small all-reduce; used only at set-up, never per step.
    """
    if group is None or dist.get_world_size(group) == 1:
        if local_problem:
            raise error_type(local_problem)
        return
    flag = torch.tensor([1 if local_problem else 0], dtype=torch.int32, device=group_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return
    problems: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, local_problem, group=group)
    found = [f"rank {rank}: {text}" for rank, text in enumerate(problems) if text]
    raise error_type("; ".join(found))
