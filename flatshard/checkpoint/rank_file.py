"""One rank's checkpoint file, written in waves of bounded host memory.

The chunks a rank writes (its share of the global plan, in plan order) are copied to host
memory a wave at a time; a wave holds at most half of `staging_bytes`, and the file write
of one wave overlaps the copy of the next, so at most `staging_bytes` of copies are alive
(a single chunk larger than a wave is a wave of its own). Each chunk is a `torch.save`
record, as DCP writes it, at the offset the plan gave it.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object

from flatshard import comm
from flatshard.checkpoint.global_plan import PlannedItem, file_name

DEFAULT_STAGING_BYTES = 256 << 20


def write(
    directory: str,
    rank: int,
    mine: list[PlannedItem],
    flat_state: dict,
    *,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    copy_always: bool = False,
    staged: Callable[[], None] | None = None,
) -> tuple[dict, int]:
    """Write `mine` to this rank's file in `directory`; returns ({index: where it is}, the
    most bytes of host copies alive at once).

    copy_always: copy host tensors too (an asynchronous save, whose originals may change
        once `staged` has been called); otherwise a compact host tensor is written as is.
    staged: called once every chunk has been copied (the originals may change from then).
    """
    name = file_name(rank)
    where: dict = {}
    peak = 0
    with open(os.path.join(directory, name), "wb") as file, ThreadPoolExecutor(1) as writer:
        pending = None
        for wave in _waves(mine, max(1, staging_bytes // 2)):
            copies = [_host_copy(planned, flat_state, copy_always) for planned in wave]
            ready = comm.host_copies_done()
            alive = sum(copied for _, _, copied in copies)
            if pending is not None:
                alive += pending.result()  # at most two waves alive: this one and the last
            peak = max(peak, alive)
            pending = writer.submit(_write_wave, file, name, copies, ready, where)
        if staged is not None:
            staged()
        if pending is not None:
            pending.result()
        file.flush()
        os.fsync(file.fileno())
    return where, peak


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


def _host_copy(planned: PlannedItem, flat_state: dict, copy_always: bool) -> tuple:
    """(planned, what to write, bytes copied for it)."""
    value = find_state_dict_object(flat_state, planned.item.index)
    if planned.item.type == WriteItemType.BYTE_IO:
        buffer = io.BytesIO()
        torch.save(value, buffer)  # as DCP serialises a value
        return planned, buffer, buffer.getbuffer().nbytes
    tensor = value.detach()
    if _compact_on_host(tensor) and not copy_always:
        return planned, tensor, 0
    # its own storage: torch.save writes a tensor's whole storage, not just a view's
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
    return planned, comm.to_host(tensor, into=copy), tensor.numel() * tensor.element_size()


def _compact_on_host(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and type(tensor) is torch.Tensor
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def _write_wave(file, name: str, copies: list, ready, where: dict) -> int:
    if ready is not None:
        ready.synchronize()  # the wave's device-to-host copies have landed
    for planned, value, _ in copies:
        offset = file.tell()
        if isinstance(value, io.BytesIO):
            file.write(value.getbuffer())
        else:
            torch.save(value, file)
        length = file.tell() - offset
        if planned.item.type != WriteItemType.BYTE_IO and length != planned.length:
            raise RuntimeError(
                f"{planned.item.index.fqn}: torch.save wrote {length} bytes, the plan "
                f"expected {planned.length}: the layout-derived checkpoint plan is wrong"
            )
        where[planned.item.index] = _StorageInfo(name, offset, length)
    return sum(copied for _, _, copied in copies)
