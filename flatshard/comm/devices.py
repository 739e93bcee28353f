"""Devices and host copies: the one place that knows CPU from CUDA (streams, events,
pinned host memory, the caching allocator) for the rest of the package.

On CPU, large buffers freed during a step go to a `BufferPool` for the next unit of the
same size (CUDA's caching allocator does this by itself).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

from flatshard import compat
from flatshard.comm import nccl_shim


def compute_device(device_type: str) -> torch.device:
    """Where unsharded parameters and buffers live for a mesh on `device_type`."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def attends_grouped_kv(query: torch.Tensor, key: torch.Tensor, mask) -> bool:
    """Whether attention gives SDPA grouped-query keys and values as they are
    (`enable_gqa`) rather than repeated to the query heads: where CUDA's flash kernel runs
    (fp16/bf16, no mask, a GPU and head size it supports), which reads them as they are
    (bitwise the repeats' result on a lent H200), so the repeats are neither made nor kept
    for backward (SmolLM2-135M at 16k tokens a step held 1,080 MiB of them at its peak).
    Elsewhere SDPA would fall back to its math kernel, which keeps the whole score matrix:
    the memory-efficient kernel (fp32, older GPUs, larger heads) takes no groups. On the CPU
    the repeat keeps logits bitwise transformers'."""
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and mask is None):
        return False
    shape = (query.device.index, query.dtype, query.shape[-1], query.shape[1], key.shape[1])
    return flash_reads_groups(*shape, torch.is_grad_enabled())


@torch.compiler.assume_constant_result  # (a compiled block bakes the answer in)
def flash_reads_groups(index, dtype, head_dim: int, heads: int, kv_heads: int, grad: bool) -> bool:
    """Whether CUDA's flash kernel takes `heads` query heads over `kv_heads` key and value
    heads of `head_dim` on GPU `index`, as the backends enabled now allow (torch's own
    check, on one token; once per kind)."""
    enabled = torch.backends.cuda.flash_sdp_enabled()
    return enabled and _flash_takes(index, dtype, head_dim, heads, kv_heads, grad)


@functools.cache
def _flash_takes(index, dtype, head_dim: int, heads: int, kv_heads: int, grad: bool) -> bool:
    device = torch.device("cuda", index)
    query = torch.empty(1, heads, 1, head_dim, device=device, dtype=dtype, requires_grad=grad)
    key = torch.empty(1, kv_heads, 1, head_dim, device=device, dtype=dtype, requires_grad=grad)
    try:
        params = torch.backends.cuda.SDPAParams(query, key, key, None, 0.0, True, True)
    except TypeError:  # a torch whose SDPAParams takes no enable_gqa: repeat
        return False
    return torch.backends.cuda.can_use_flash_attention(params)


def process_start_method() -> str:
    """How to start local worker processes: fork where it is safe (Linux, CUDA not yet
    initialised in this process): a worker starts in milliseconds, its imports inherited;
    spawn elsewhere (a fresh interpreter imports torch again: seconds)."""
    if sys.platform == "linux" and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def group_device(group) -> torch.device:
    """The device `group`'s backend moves (None: the default group): NCCL only moves CUDA
    tensors; gloo here moves CPU ones. A visible GPU does not make a gloo run a CUDA one.
    "cuda:nccl,cpu:gloo" (the trainer's on CUDA: host pieces reduce over gloo) is CUDA."""
    backend = str(dist.get_backend(group))
    if backend == "nccl" or "cuda:nccl" in backend:
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


_side_streams: dict[torch.device, object] = {}


def _side_stream(device: torch.device):
    """One stream per CUDA device for the activation copies, beside compute."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _is_dense(tensor: torch.Tensor) -> bool:
    """Its elements fill one block of memory without gaps (a contiguous layout, its dims
    perhaps permuted): then a copy with the same strides is one memcpy."""
    expected = 1
    for size, stride in sorted(
        ((size, stride) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1),
        key=lambda pair: pair[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _host_like(tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    # a dense tensor keeps its strides (one memcpy each way); one with gaps (a slice of a
    # fused projection) is packed: copying into its own strides would go through pageable
    # temporaries on the host, synchronously
    if _is_dense(tensor):
        return torch.empty_strided(
            tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=pin_memory
        )
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin_memory)


def activation_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a saved activation (`activation_to_device` restores its strides). From
    CUDA: into pinned memory on a side stream that first waits for the compute that made it;
    the device tensor is marked in use by that stream, so dropping it is safe at once. On
    the CPU: a copy (the memory is the same; the path is what is exercised)."""
    if tensor.device.type != "cuda":
        return _host_like(tensor, pin_memory=False).copy_(tensor.detach())
    side = _side_stream(tensor.device)
    side.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(side):
        host = _host_like(tensor, pin_memory=True).copy_(tensor, non_blocking=True)
    tensor.record_stream(side)
    return host


def activation_to_device(host: torch.Tensor, like: tuple, device: torch.device):
    """(the activation on `device` with the (shape, strides) `like` it was saved with, and an
    event to wait for before reading it): from pinned memory on the side stream, after its
    copy down (same stream, so in order). Strides are kept because a copy made contiguous
    could send backward's kernels down another summation order: results stay bitwise those
    without offload. On the CPU: the host copy itself where its strides are the same."""
    shape, stride = like
    if device.type != "cuda":
        if host.stride() == tuple(stride):
            return host, None
        restrided = torch.empty_strided(shape, stride, dtype=host.dtype, device=device)
        return restrided.copy_(host), None
    side = _side_stream(device)
    with torch.cuda.stream(side):
        tensor = torch.empty_strided(shape, stride, dtype=host.dtype, device=device)
        tensor.copy_(host, non_blocking=True)
        event = side.record_event()
    return tensor, event


def use_on_current_stream(tensor: torch.Tensor, event) -> torch.Tensor:
    """Make the current stream wait for `event` and mark `tensor` in use by it (CUDA)."""
    if event is not None:
        stream = torch.cuda.current_stream(tensor.device)
        stream.wait_event(event)
        tensor.record_stream(stream)
    return tensor


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


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_to_host(storage: torch.UntypedStorage, pin_memory: bool) -> torch.Tensor:
    """A host copy of a storage's bytes: from CUDA into pinned memory (when asked),
    asynchronously; `host_copies_done()` says when it can be read or the storage freed."""
    source = _bytes_of(storage)
    pin = pin_memory and source.is_cuda
    host = torch.empty(source.numel(), dtype=torch.uint8, device="cpu", pin_memory=pin)
    return host.copy_(source, non_blocking=pin)


def storage_from_host(storage: torch.UntypedStorage, host: torch.Tensor) -> None:
    """Give a storage freed to size 0 its memory back and its bytes from `host` (copied on
    the current stream: whatever runs after it on the stream sees them)."""
    storage.resize_(host.numel())
    _bytes_of(storage).copy_(host, non_blocking=host.is_pinned())


def release_device_memory(device: torch.device) -> None:
    """Hand memory freed on `device` back to the driver, so another engine in the process
    (an inference server between training steps) can have it; the CPU: nothing to do."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


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
        return cpu and compat.storage_memory_moves()

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
