"""One rank's checkpoint file, written in waves of bounded host memory.

The chunks a rank writes (its share of the global plan, in plan order) are written as
`torch.save` records, as DCP writes them, at the offsets the plan gave them. A chunk in
host memory is written straight from there (a view of exactly its bytes: torch.save
writes a tensor's whole storage, which for a shard is the whole flat buffer). Chunks on a
device, and those of an asynchronous save (whose originals change at the next optimizer
step), are copied to host memory a wave at a time: a wave holds at most half of
`staging_bytes` and the file write of one wave overlaps the copy of the next, so at most
`staging_bytes` of copies are alive. The copies go into two reused buffers of a wave each
(pinned on CUDA: allocated once per size, not per save), so the bound is what the process
holds, not what a memory allocator keeps. An asynchronous save writes a host chunk larger
than a wave straight from its original instead, before it lets the optimizer step; a
device chunk larger than a wave is copied into a buffer of its own. The file's CRC-32 is
computed as it is written (no second read for the manifest), and torch.save's own CRC-32
of every zip record is switched off while it writes (torch.load and DCP read records without
it): the manifest's checksum covers the whole file, so one pass over the bytes is enough.
"""

from __future__ import annotations

import io
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object

from flatshard import comm, compat
from flatshard.checkpoint.global_plan import PlannedItem, file_name

DEFAULT_STAGING_BYTES = 256 << 20
"""The most host memory a save's copies hold at once (256 MiB), in waves of half of it."""


def write(
    directory: str,
    rank: int,
    mine: list[PlannedItem],
    flat_state: dict,
    *,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    copy_always: bool = False,
    staged: Callable[[], None] | None = None,
) -> tuple[dict, int, dict]:
    """Write `mine` to this rank's file in `directory`; returns ({index: where it is}, the
    most bytes of host copies alive at once, {file name: its size and CRC-32}).

    copy_always: the originals change once `staged` has been called (an asynchronous save):
        copy host chunks too, or write them before calling it.
    staged: called once nothing more is read from the originals.
    """
    name = file_name(rank)
    limit = max(1, staging_bytes // 2)
    where: dict = {}
    peak = 0
    # the manifest's CRC-32 covers every byte: torch's per-record one would be a second pass
    with (
        compat.torch_save_without_record_crc32(),
        open(os.path.join(directory, name), "wb") as raw,
        ThreadPoolExecutor(1) as writer,
    ):
        file = _ChecksummedFile(raw)
        pending = reads_originals = None
        for number, wave in enumerate(_waves(mine, limit)):
            buffer = _Carver(limit, number % 2)
            copies = [
                _host_value(planned, flat_state, copy_always, limit, buffer) for planned in wave
            ]
            ready = comm.host_copies_done()
            alive = sum(copied for _, _, copied in copies)
            if pending is not None:
                alive += pending.result()  # at most two waves alive: this one and the last
            peak = max(peak, alive)
            pending = writer.submit(write_wave, file, name, copies, ready, where)
            if any(copied == 0 for planned, _, copied in copies if planned.length):
                reads_originals = pending
        if staged is not None:
            if copy_always and reads_originals is not None:
                reads_originals.result()
            staged()
        if pending is not None:
            pending.result()
        raw.flush()
        os.fsync(raw.fileno())
    return where, peak, {name: {"size": file.size, "crc32": file.crc}}


def _waves(items: list[PlannedItem], limit: int) -> list[list[PlannedItem]]:
    waves, current, size = [], [], 0
    for planned in items:
        if current and size + planned.length > limit:
            waves.append(current)
            current, size = [], 0
        current.append(planned)
        size += planned.length
    if current:
        waves.append(current)
    return waves


def _host_value(planned, flat_state: dict, copy_always: bool, limit: int, buffer) -> tuple:
    """(planned, what to write, bytes copied for it)."""
    value = find_state_dict_object(flat_state, planned.item.index)
    if planned.item.type == WriteItemType.BYTE_IO:
        serialised = io.BytesIO()
        torch.save(value, serialised)  # as DCP serialises a value
        return planned, serialised, serialised.getbuffer().nbytes
    tensor = value.detach()
    nbytes = tensor.numel() * tensor.element_size()
    if not _needs_copy(tensor, copy_always, limit):
        return planned, _exactly_its_bytes(tensor), 0
    if nbytes <= limit:
        copy = buffer.take(tensor)
    else:
        pinned = tensor.device.type == "cuda"
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
    return planned, comm.to_host(tensor, into=copy), nbytes


def _needs_copy(tensor: torch.Tensor, copy_always: bool, limit: int) -> bool:
    on_host = tensor.device.type == "cpu" and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    return not (on_host and (not copy_always or nbytes > limit))


_buffers: dict = {}  # (bytes, pinned): the two wave buffers, kept for the next save


def _staging_buffers(limit: int) -> tuple:
    """The two wave buffers, allocated by the first save that copies anything."""
    pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
    key = (limit, pinned)
    if key not in _buffers:
        _buffers.clear()  # another bound: free the old pair first
        _buffers[key] = tuple(
            torch.empty(limit, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)
        )
    return _buffers[key]


class _Carver:
    """Hands out consecutive, aligned pieces of wave buffer `which` as tensors."""

    ALIGN = 64

    def __init__(self, limit: int, which: int):
        self._limit, self._which = limit, which
        self._buffer = None
        self._used = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = _staging_buffers(self._limit)[self._which]
        nbytes = like.numel() * like.element_size()
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if start + nbytes > self._buffer.numel():
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=self._buffer.is_pinned())
        self._used = start + nbytes
        return self._buffer[start : start + nbytes].view(like.dtype).view(like.shape)


def _exactly_its_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous, on the host) over a storage of just its own bytes, no copy."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor.as_subclass(torch.Tensor)
    as_bytes = tensor.reshape(-1).view(torch.uint8)  # numpy has no bfloat16
    return torch.from_numpy(as_bytes.numpy()).view(tensor.dtype).view(tensor.shape)


class _ChecksummedFile:
    """A binary file that keeps the CRC-32 and size of what is written to it."""

    def __init__(self, raw):
        self._raw = raw
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        written = self._raw.write(data)
        self.size += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()


def write_wave(file, name: str, copies: list, ready, where: dict) -> int:
    if ready is not None:
        ready.synchronize()  # the wave's device-to-host copies have landed
    for planned, value, _ in copies:
        offset = file.tell()
        if isinstance(value, io.BytesIO):
            file.write(value.getbuffer())
        else:
            torch.save(_exactly_its_bytes(value), file)
        length = file.tell() - offset
        if planned.item.type != WriteItemType.BYTE_IO and length != planned.length:
            raise RuntimeError(
                f"{planned.item.index.fqn}: torch.save wrote {length} bytes, the plan "
                f"expected {planned.length}: the layout-derived checkpoint plan is wrong"
            )
        where[planned.item.index] = _StorageInfo(name, offset, length)
    return sum(copied for _, _, copied in copies)
