"""Collectives: how a process group moves flat buffers, chosen once per group.

`Collectives` runs torch's `all_gather_single` / `reduce_scatter_single` (NCCL: issued with
`async_op=True` on NCCL's stream, `Work.wait()` makes the current stream wait).
`GlooCollectives` avoids two costs of torch's gloo backend on CPU tensors:
- its reduce-scatter is a full clone + all-reduce + copy of the input, twice the bytes a
  reduce-scatter needs: here one all-to-all (each rank receives every rank's copy of its
  own shard: (N-1)/N of the buffer on the wire, as NCCL's ring) and a local sum;
- its all-gather gathers into a fresh temporary buffer and copies that out (3-4x the CPU
  time of the transfer itself): here each rank sends its shard to every peer and receives
  theirs straight into their place in the output.
`HazardShimCollectives` takes the NCCL path on CPU tensors with NCCL's hazards made
visible (nccl_shim.py). `traffic` counts the payload bytes of everything issued here.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from flatshard import compat
from flatshard.comm import exit_guard, nccl_shim, peer_failure


class Counts(NamedTuple):
    """Payload bytes of each kind since `Traffic.take` was last called."""

    all_gather: int
    reduce_scatter: int
    all_reduce: int
    all_to_all: int
    tied_embedding: int


class Traffic:
    """Payload bytes of the all-gathers and reduce-scatters issued here (metrics read it)."""

    def __init__(self):
        self.all_gather = 0
        self.reduce_scatter = 0
        self.all_reduce = 0
        self.all_to_all = 0  # expert parallelism's token rows (sent), forward and backward
        # pipeline stages' tied embedding: the first stage's gather of the weight and sums
        # of its gradient (api/pipeline_tie.py)
        self.tied_embedding = 0
        self.optimizer = 0  # an optimizer's own exchanges (Muon's matrices to their owners)
        self.all_gather_by_group_size: dict[int, int] = {}  # e.g. hpZ's small groups

    def take(self) -> Counts:
        """The step's bytes (all but the optimizer's) since the last call."""
        counts = Counts(self.all_gather, self.reduce_scatter, self.all_reduce, self.all_to_all,
                        self.tied_embedding)  # fmt: skip
        self.all_gather = self.reduce_scatter = self.all_reduce = self.all_to_all = 0
        self.tied_embedding = 0
        return counts


traffic = Traffic()
"""This process's payload counters: bytes each kind of collective moved (reset per step)."""


class Collectives:
    """How one process group moves flat buffers: `all_gather` and `reduce_scatter`, each
    starting a collective and returning an object whose `wait()` leaves the result in the
    output. Chosen once per group (`for_group`): this base runs torch's own
    `all_gather_single` / `reduce_scatter_single` (NCCL); `GlooCollectives` and
    `HazardShimCollectives` are the CPU implementations."""

    def __init__(self, group):
        self._group = weakref.ref(group)  # held weakly: for_group's cache is keyed by it
        self.size = dist.get_world_size(group)

    @property
    def group(self):
        return self._group()

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, pieces=None):
        """Gather every rank's equal `shard` into the flat `output`; `pieces` are the views
        of `output` each rank's shard lands in (a bucket's come from its layout; default:
        equal consecutive chunks, as `all_gather_single` places them)."""
        nbytes = output.numel() * output.element_size()
        traffic.all_gather += nbytes
        by_size = traffic.all_gather_by_group_size
        by_size[self.size] = by_size.get(self.size, 0) + nbytes
        if self.size == 1:
            return _Done(output.copy_(shard))
        return self._all_gather(output, shard, pieces)

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, average: bool, pool=None):
        """Sum (or average) `flat` over the ranks, leaving this rank's shard in `output`."""
        traffic.reduce_scatter += flat.numel() * flat.element_size()
        if self.size == 1:
            # one rank: its gradient is the sum and the average (NCCL has corrupted a
            # one-rank AVG; a copy cannot)
            return _Done(output.copy_(flat))
        return self._reduce_scatter(output, flat, _op(average), average, pool)

    def _all_gather(self, output, shard, pieces):
        return compat.all_gather_single(output, shard, group=self.group, async_op=True)

    def _reduce_scatter(self, output, flat, op, average, pool):
        return compat.reduce_scatter_single(output, flat, op=op, group=self.group, async_op=True)


class GlooCollectives(Collectives):
    """gloo on CPU tensors: the all-gather as point-to-point sends straight into the output,
    the reduce-scatter as one all-to-all and a local sum (see the module docstring)."""

    def _all_gather(self, output, shard, pieces):
        if shard.device.type != "cpu":
            return super()._all_gather(output, shard, pieces)
        pieces = output.chunk(self.size) if pieces is None else pieces
        return _PointToPointAllGather(pieces, shard, self.group)

    def _reduce_scatter(self, output, flat, op, average, pool):
        if flat.device.type != "cpu":
            return super()._reduce_scatter(output, flat, op, average, pool)
        return _AllToAllReduceScatter(output, flat, self.group, average, pool)


class HazardShimCollectives(Collectives):
    """The NCCL code path on CPU tensors with NCCL's hazards made visible (nccl_shim.py)."""

    def _all_gather(self, output, shard, pieces):
        run = lambda out, inp: compat.all_gather_single(out, inp, group=self.group)
        return nccl_shim.NcclLikeWork("all-gather", output, [shard], run)

    def _reduce_scatter(self, output, flat, op, average, pool):
        run = lambda out, inp: compat.reduce_scatter_single(out, inp, op=op, group=self.group)
        return nccl_shim.NcclLikeWork("reduce-scatter", output, [flat], run)


# group -> {hazard shim on: its collectives}; weak, so a destroyed group is not kept alive
_CHOSEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def for_group(group) -> Collectives:
    """The collectives of `group` (None: the default group), chosen once (again when the
    hazard shim is switched)."""
    group = group if group is not None else dist.group.WORLD
    chosen = _CHOSEN.get(group)
    if chosen is None:
        chosen = _CHOSEN[group] = {}
    shim = nccl_shim.active()
    if shim not in chosen:
        exit_guard.install()
        if shim:
            kind = HazardShimCollectives
        elif dist.get_backend(group) == "gloo":
            kind = GlooCollectives
        else:
            kind = Collectives
        chosen[shim] = kind(group)
    return chosen[shim]


def _op(average: bool):
    return dist.ReduceOp.AVG if average else dist.ReduceOp.SUM


def all_gather(output: torch.Tensor, shard: torch.Tensor, group, pieces=None):
    """`for_group(group).all_gather(...)`."""
    return for_group(group).all_gather(output, shard, pieces)


def reduce_scatter(output: torch.Tensor, flat: torch.Tensor, group, average: bool, pool=None):
    """`for_group(group).reduce_scatter(...)`."""
    return for_group(group).reduce_scatter(output, flat, average, pool)


# Tag of flatshard's point-to-point all-gathers, apart from a user's own sends on the group.
# gloo matches messages of one tag between two ranks in the order they were posted, and
# every rank gathers the same buckets in the same order, so gathers in flight never mix.
_ALL_GATHER_TAG = 0x46A7


class _PointToPointAllGather:
    """An all-gather as N-1 sends of this rank's shard and N-1 receives straight into the
    output; peers in ring order (rank+1 first) so no rank is everyone's first target."""

    def __init__(self, pieces: list[torch.Tensor], shard: torch.Tensor, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        pieces[rank].copy_(shard)
        self.works = []
        for step in range(1, world):
            to, source = (rank + step) % world, (rank - step) % world
            self.works.append(dist.isend(shard, group=group, group_dst=to, tag=_ALL_GATHER_TAG))
            self.works.append(
                dist.irecv(pieces[source], group=group, group_src=source, tag=_ALL_GATHER_TAG)
            )

    def wait(self) -> bool:
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as error:
            peer_failure.raise_for(error, "an all-gather")
        self.works = []  # they refer to the buffers
        return True


class _Done:
    """A collective that was a local copy: nothing to wait for."""

    def __init__(self, output: torch.Tensor):
        self.output = output

    def wait(self) -> bool:
        return True


class _AllToAllReduceScatter:
    """A reduce-scatter as one all-to-all (rank r receives every rank's piece r) and a local
    sum of the N pieces."""

    def __init__(self, output: torch.Tensor, flat: torch.Tensor, group, average: bool, pool):
        self.output, self.average, self.pool = output, average, pool
        self.world = dist.get_world_size(group)
        self.received = (
            pool.empty(flat.numel(), flat.dtype, flat.device)
            if pool is not None
            else torch.empty_like(flat)
        )
        self.work = dist.all_to_all_single(self.received, flat, group=group, async_op=True)

    def wait(self) -> bool:
        if self.received is None:
            return True
        try:
            self.work.wait()
        except RuntimeError as error:
            peer_failure.raise_for(error, "a reduce-scatter")
        self.work = None  # it refers to both buffers: drop it before one goes back to the pool
        pieces = self.received.view(self.world, -1)
        if self.world == 2:  # one add: the same rounding as torch.sum, ~2x faster
            torch.add(pieces[0], pieces[1], out=self.output)
        else:
            torch.sum(pieces, dim=0, out=self.output)
        if self.average:
            self.output.div_(self.world)
        del pieces  # a view: the pool takes a buffer only where nothing else holds it
        if self.pool is not None:
            self.pool.give_back(self.received)
        self.received = None
        return True


def all_reduce(tensor: torch.Tensor, group) -> None:
    """Sum `tensor` in place over `group` (HSDP's replicas) and wait for it."""
    traffic.all_reduce += tensor.numel() * tensor.element_size()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)


def all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """Rows to the ranks of `group` (`in_splits` to each, `out_splits` from each), with
    autograd (backward sends the gradients the other way); counts the bytes this rank
    sends both ways."""
    return _AllToAll.apply(rows, out_splits, in_splits, group)


def exchange(flat: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """All-to-all of a flat buffer, no autograd (an optimizer moving matrix pieces to their
    owners): `in_splits[r]` elements to rank r, `out_splits[r]` from it. Counted in
    `traffic.optimizer` (bytes sent to other ranks)."""
    to_others = sum(in_splits) - in_splits[dist.get_rank(group)]
    traffic.optimizer += to_others * flat.element_size()
    out = flat.new_empty(sum(out_splits))
    dist.all_to_all_single(out, flat.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _send_rows(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _send_rows(grad, in_splits, out_splits, ctx.group), None, None, None


def _send_rows(rows: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    rows = rows.contiguous()  # gloo refuses a non-contiguous input
    traffic.all_to_all += rows.numel() * rows.element_size()
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows, out_splits, in_splits, group=group)
    return out
