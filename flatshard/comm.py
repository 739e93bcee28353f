"""Backends and devices: the one place that knows gloo from NCCL and CPU from CUDA.

Collectives move whole flat buckets (`all_gather_single` / `reduce_scatter_single` on NCCL),
or an embedding's looked-up rows (sharded_lookup.py).
They are issued with `async_op=True`; on CUDA, NCCL runs them on its own stream and
`Work.wait()` makes the current stream wait, so compute on the current stream overlaps
them. On CPU, gloo runs them on its own threads and `wait()` blocks the caller.

On gloo (CPU tensors) flatshard avoids two costs of torch's gloo backend:
- its reduce-scatter is a full clone + all-reduce + copy of the input, twice the bytes a
  reduce-scatter needs: flatshard reduce-scatters with one all-to-all (each rank receives
  every rank's copy of its own shard: (N-1)/N of the buffer on the wire, as NCCL's ring)
  and sums the N pieces locally;
- its all-gather gathers into a fresh temporary buffer and copies that out (a full-size
  allocation, page faults and copy per call: 3-4x the CPU time of the transfer itself):
  flatshard sends its shard to every peer and receives theirs straight into their place in
  the output (the same (N-1)/N of the buffer on the wire).

On CPU, large buffers freed during a step go to a `BufferPool` for the next unit of the
same size (CUDA's caching allocator does this by itself).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from flatshard import nccl_shim


def compute_device(device_type: str) -> torch.device:
    """Where unsharded parameters and buffers live for a mesh on `device_type`."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def group_device(group) -> torch.device:
    """The device `group`'s backend moves (None: the default group): NCCL only moves CUDA
    tensors; gloo here moves CPU ones. A visible GPU does not make a gloo run a CUDA one."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_generator(device: torch.device) -> torch.Generator:
    """The random-number generator that ops on `device` draw from when given none."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or torch.cuda.current_device()]
    return torch.default_generator


def thread_device_setter():
    """A function that makes another thread use this thread's CUDA device (a no-op without
    CUDA). A thread starts on device 0: an async checkpoint writer would open a context
    there from every rank (memory on GPU 0) when DCP syncs its streams."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        return lambda: torch.cuda.set_device(device)
    return lambda: None


def to_host(tensor: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A host copy of `tensor` (into `into` when given), without waiting for a device copy:
    from CUDA it lands in pinned memory, asynchronously; `host_copies_done()` returns what
    to wait on before reading it. On the CPU an ordinary copy."""
    if into is not None:
        return into.copy_(tensor, non_blocking=True)
    return tensor.detach().to("cpu", copy=True, non_blocking=True)


def to_host_now(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` that can be read at once (waits for a device copy)."""
    copy = to_host(tensor)
    done = host_copies_done()
    if done is not None:
        done.synchronize()
    return copy


def host_zeros(numel: int, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A zeroed host buffer; page-locked (pinned) when asked and CUDA is there, so copies
    to and from the GPU run asynchronously."""
    pin = pin_memory and torch.cuda.is_available()
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor in `dtype` on `device`: to CUDA, cast on the host into pinned memory (half
    the bytes for bf16), then copied asynchronously on the current stream (ordered before
    the collectives that read it; the pinned buffer is kept until the copy is done by
    torch's host allocator); on the CPU just the cast (itself when the dtype matches)."""
    if device.type != "cuda":
        return tensor.to(dtype)
    if tensor.dtype != dtype:
        pinned = torch.empty(tensor.shape, dtype=dtype, device="cpu", pin_memory=True)
        tensor = pinned.copy_(tensor)
    return tensor.to(device, non_blocking=True)


def host_copies_done():
    """An event after every `to_host` copy issued so far on this stream (None on the CPU,
    where they are done already); `.synchronize()` it before reading the copies."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_stream().record_event()
    return None


def wait_event(event) -> None:
    """Make the current stream wait for `event` (a CUDA event; None or the CPU: nothing)."""
    if event is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().wait_event(event)


def free_storage(tensor: torch.Tensor, pool: BufferPool | None = None) -> None:
    """Release a buffer's memory while views of it (saved for backward) stay valid objects."""
    storage = tensor.untyped_storage()
    if storage.size() == 0:
        return
    if pool is not None and pool.keeps(storage):
        pool.keep_memory_of(storage)
    else:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor, pool: BufferPool | None = None) -> None:
    """Give a buffer freed by `free_storage` its memory back (contents undefined)."""
    storage = tensor.untyped_storage()
    needed = tensor.numel() * tensor.element_size()
    if storage.size() == needed:
        return
    if not (storage.size() == 0 and pool is not None and pool.move_memory_into(storage, needed)):
        storage.resize_(needed)


class BufferPool:
    """Large flat buffers freed during one step, handed to the next unit of the same size.

    CUDA's caching allocator reuses freed blocks by itself. On CPU, glibc returns large
    blocks to the kernel, and using the memory again costs a page fault per 4 KiB (and the
    kernel's zeroing): at 120M parameters about 150,000 faults per step for the unsharded
    parameters, gradients and receive buffers. The pool is emptied when a forward or a
    backward pass ends, so no idle buffer is held where memory peaks (the loss and the start
    of backward) or between steps.
    """

    def __init__(self):
        self._free: dict[tuple[int, torch.device], list[torch.UntypedStorage]] = {}

    @staticmethod
    def keeps(storage: torch.UntypedStorage) -> bool:
        cpu = storage.device.type == "cpu" and not nccl_shim.active()  # NCCL path: none
        return cpu and hasattr(storage, "_swap_data_ptr_")

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised flat buffer, from the pool when one of its size is free."""
        holder = self._pop(numel * dtype.itemsize, device)
        if holder is None:
            return torch.empty(numel, dtype=dtype, device=device)
        return torch.empty(0, dtype=dtype, device=device).set_(holder, 0, (numel,), (1,))

    def give_back(self, tensor: torch.Tensor) -> None:
        """Offer a flat buffer nobody uses any more (a buffer something still views, e.g. a
        gradient a user kept, is left to the allocator)."""
        storage = tensor.untyped_storage()
        sole_owner = torch._C._storage_Use_Count(storage._cdata) <= 2  # tensor + wrapper
        if self.keeps(storage) and sole_owner and storage.size() == tensor.nbytes:
            self._free.setdefault((storage.size(), storage.device), []).append(storage)

    def keep_memory_of(self, storage: torch.UntypedStorage) -> None:
        """Take `storage`'s memory, leaving it empty (views of it stay valid objects)."""
        holder = torch.UntypedStorage(0, device=storage.device)
        holder._swap_data_ptr_(storage)
        self._free.setdefault((holder.size(), holder.device), []).append(holder)

    def move_memory_into(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        holder = self._pop(nbytes, storage.device)
        if holder is None:
            return False
        storage._swap_data_ptr_(holder)
        return True

    def clear(self) -> None:
        self._free.clear()

    def _pop(self, nbytes: int, device: torch.device) -> torch.UntypedStorage | None:
        free = self._free.get((nbytes, torch.device(device)))
        return free.pop() if free else None


class Traffic:
    """Payload bytes of the all-gathers and reduce-scatters issued here (metrics read it)."""

    def __init__(self):
        self.all_gather = 0
        self.reduce_scatter = 0
        self.all_reduce = 0
        self.all_to_all = 0  # expert parallelism's token rows (sent), forward and backward
        self.all_gather_by_group_size: dict[int, int] = {}  # e.g. hpZ's small groups

    def take(self) -> tuple[int, int, int, int]:
        """(all-gather, reduce-scatter, all-reduce, all-to-all) bytes since the last call."""
        counts = (self.all_gather, self.reduce_scatter, self.all_reduce, self.all_to_all)
        self.all_gather = self.reduce_scatter = self.all_reduce = self.all_to_all = 0
        return counts


traffic = Traffic()


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
        return dist.all_gather_single(output, shard, group=self.group, async_op=True)

    def _reduce_scatter(self, output, flat, op, average, pool):
        return dist.reduce_scatter_single(output, flat, op=op, group=self.group, async_op=True)


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
        run = lambda out, inp: dist.all_gather_single(out, inp, group=self.group)
        return nccl_shim.NcclLikeWork("all-gather", output, [shard], run)

    def _reduce_scatter(self, output, flat, op, average, pool):
        run = lambda out, inp: dist.reduce_scatter_single(out, inp, op=op, group=self.group)
        return nccl_shim.NcclLikeWork("reduce-scatter", output, [flat], run)


# group -> {hazard shim on: its collectives}; weak, so a destroyed group is not kept alive
_CHOSEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def for_group(group) -> Collectives:
    """The collectives of `group` (None: the default group), chosen once (again when the
    hazard shim is switched)."""
    group = group if group is not None else dist.group.WORLD
    chosen = _CHOSEN.setdefault(group, {})
    shim = nccl_shim.active()
    if shim not in chosen:
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
        for work in self.works:
            work.wait()
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
        self.received = (pool or BufferPool()).empty(flat.numel(), flat.dtype, flat.device)
        self.work = dist.all_to_all_single(self.received, flat, group=group, async_op=True)

    def wait(self) -> bool:
        if self.received is None:
            return True
        self.work.wait()
        self.work = None  # it refers to both buffers: drop it before one goes back to the pool
        pieces = self.received.view(self.world, -1)
        if self.world == 2:  # one add: the same rounding as torch.sum, ~2x faster
            torch.add(pieces[0], pieces[1], out=self.output)
        else:
            torch.sum(pieces, dim=0, out=self.output)
        if self.average:
            self.output.div_(self.world)
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
