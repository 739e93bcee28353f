"""The disk tier of optimizer offload: optimizer state in memory-mapped files, paged in a
piece at a time.

An offloaded piece whose policy names a directory carries a `DiskTier` on its row shard
(row_shard.py). An optimizer creates its state with `zeros_like` / `empty_like` /
`full_like` / `clone` of the parameter or its gradient: for such a piece the state is
allocated in a file of its own in that directory (space reserved up front, so a full disk
is an error when the state is made, never a crash when a page is first written; unlinked
at once, so no file outlives its tensor). Every op that reads or writes such paged state
runs one piece at a time: a foreach or fused optimizer op (all pieces in one call) is
split by piece, the next piece's pages are read ahead while one is computed, and a
piece's pages leave this process's memory when its op is done (the kernel writes them
back to the file). The temporaries a foreach optimizer keeps between its ops are paged
the same way. So the optimizer state never needs to fit in memory, whatever optimizer.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from pathlib import Path

import torch

from flatshard.errors import OffloadError

# Ops an optimizer makes its state with: for a piece of the disk tier, their result is paged.
STATE_FACTORIES = {"zeros_like", "empty_like", "full_like", "ones_like", "clone"}

# Whether any paged buffer was ever made: until then no op needs its arguments searched
# for one (the row-shard dispatch runs for every op an optimizer applies).
in_use = False


class DiskTier:
    """A directory holding paged optimizer state."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self):
        return f"DiskTier({str(self.path)!r})"

    def check_writable(self) -> None:
        """Refuse a directory that cannot hold state now rather than at the first step."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.path):
                pass
        except OSError as error:
            raise OffloadError(
                f"the optimizer offload directory {str(self.path)!r} cannot be written "
                f"({error.strerror or error}); pass a writable directory with free space"
            ) from error

    def allocate(self, like: torch.Tensor) -> PagedBuffer:
        """A zeroed file-backed tensor shaped like `like`."""
        nbytes = like.numel() * like.element_size()
        if nbytes == 0:
            return PagedBuffer(torch.zeros_like(like), None)
        try:
            handle, name = tempfile.mkstemp(dir=self.path, prefix="flatshard-state-")
        except OSError as error:
            raise self._error(error) from error
        try:
            os.posix_fallocate(handle, 0, nbytes)  # ENOSPC here, not SIGBUS on a write
            mapping = mmap.mmap(handle, nbytes)
        except OSError as error:
            raise self._error(error) from error
        finally:
            os.close(handle)
            os.unlink(name)
        tensor = torch.frombuffer(mapping, dtype=like.dtype, count=like.numel())
        global in_use
        in_use = True
        return PagedBuffer(tensor.view(like.shape), mapping)

    def _error(self, error: OSError) -> OffloadError:
        if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return OffloadError(  # the same words on every rank it happens to
                f"the optimizer offload directory {str(self.path)!r} is full: the optimizer "
                "state does not fit. Free space there or point the offload at a larger disk "
                "(checkpoints already written are intact)"
            )
        return OffloadError(
            f"cannot create optimizer state in {str(self.path)!r}: {error.strerror or error}"
        )


class PagedBuffer:
    """A tensor in a memory-mapped file, and the mapping to page it in and out."""

    def __init__(self, tensor: torch.Tensor, mapping: mmap.mmap | None):
        self.tensor = tensor
        self.mapping = mapping

    def read_ahead(self) -> None:
        if self.mapping is not None:
            self.mapping.madvise(mmap.MADV_WILLNEED)

    def page_out(self) -> None:
        """Drop its pages from this process (written back to the file, read again on use)."""
        if self.mapping is not None:
            self.mapping.madvise(mmap.MADV_DONTNEED)


def paged_pieces(args, kwargs) -> list[PagedBuffer]:
    """The paged buffers among an op's arguments (row shards and lists of them)."""
    found = []
    for value in list(args) + list((kwargs or {}).values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        found.extend(p for p in (getattr(item, "paged", None) for item in items) if p is not None)
    return found


def run_by_piece(func, args, kwargs, run, store):
    """Run a foreach or fused op one list position at a time: `run(func, args, kwargs)` is
    the ordinary dispatch of the smaller op, `store(out, position_args)` pages a fresh
    output. Lists of another length (an unused `max_exp_avg_sqs`) pass whole."""
    kwargs = kwargs or {}
    count = len(args[0])
    outputs = []
    pieces = [_position(args, kwargs, i, count) for i in range(count)]
    for i, (piece_args, piece_kwargs) in enumerate(pieces):
        if i + 1 < count:
            for paged in paged_pieces(*pieces[i + 1]):
                paged.read_ahead()
        out = run(func, piece_args, piece_kwargs)
        if isinstance(out, (list, tuple)):
            outputs.append(store(out[0], piece_args))
        for paged in paged_pieces(piece_args, piece_kwargs):
            paged.page_out()
    return outputs if outputs else None


def _position(args, kwargs, i: int, count: int):
    def pick(value):
        if isinstance(value, (list, tuple)) and len(value) == count:
            return type(value)(value[i : i + 1])
        return value

    return [pick(a) for a in args], {k: pick(v) for k, v in kwargs.items()}


_TIERS: dict[str, DiskTier] = {}


def disk_tier(path) -> DiskTier:
    """One tier per directory (checked writable on first use)."""
    key = os.path.abspath(path)
    if key not in _TIERS:
        tier = DiskTier(key)
        tier.check_writable()
        _TIERS[key] = tier
    return _TIERS[key]
