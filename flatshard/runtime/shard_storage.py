"""This rank's shard of one bucket: its main weights and their gradient, on the device up to
the cut and on the host after it.

Without optimizer offload the cut is the shard's end: `main` is the whole shard and
`host_main` None. With it, `[cut, shard_size)` lives in `host_main` (the cut that
layout/offload.py chose for this rank: a piece lies wholly on one side), and so do the
gradient rows of those pieces, copied down after each reduce-scatter; the optimizer then
creates their state on the host (or in the disk tier's files: `tier`) and steps it there.
Every offset comes from the pieces' `ShardSpec`s.
"""

from __future__ import annotations

import weakref

import torch

from flatshard import comm
from flatshard.layout import ShardSpec


def as_param(flat: torch.Tensor, spec: ShardSpec, stored_shape=None) -> torch.Tensor:
    """A flat piece in the shape of this rank's piece (`stored_shape` given: of that
    stored shape, e.g. the whole parameter's). The buffers hold a parameter sharded along a
    dim d > 0 with d first, so its view moves d back: a strided view."""
    view = flat.view(stored_shape or spec.stored_local_shape)
    return view.movedim(0, spec.info.shard_dim) if spec.info.shard_dim else view


class ShardStorage:
    def __init__(
        self, specs: list[ShardSpec], shard_size: int, device: torch.device, dtype: torch.dtype
    ):
        self.specs = specs
        self.shard_size = shard_size
        self.cut = shard_size  # where this rank's shard moves to the host
        self.pin_memory = False
        self.tier = None  # the disk tier of the offloaded pieces' optimizer state, if any
        self._grad: tuple | None = None  # weak references to the gradient's two parts
        self.allocate(device, dtype)

    def allocate(self, device: torch.device, dtype: torch.dtype | None = None) -> None:
        """Zeros (padding stays zero: it is all-gathered but never read), the device part on
        `device` (`meta` for a model built there, until `to_empty` / `materialize`)."""
        dtype = dtype or self.main.dtype
        self.main = torch.zeros(self.cut, dtype=dtype, device=device)
        self.host_main = None
        if self.cut == self.shard_size:
            return
        size = self.shard_size - self.cut
        if device.type == "meta":
            self.host_main = torch.zeros(size, dtype=dtype, device=device)
        else:
            self.host_main = comm.host_zeros(size, dtype, self.pin_memory)

    def convert(self, dtype: torch.dtype) -> None:
        """The same values kept in `dtype` (a module's `.to(dtype)` after fully_shard)."""
        main, host_main = self.main, self.host_main
        self.allocate(main.device, dtype)
        self._grad = None
        if not main.is_meta:
            self.main.copy_(main)
            if host_main is not None:
                self.host_main.copy_(host_main)

    def place(self, cut: int, pin_memory: bool, tier=None) -> bool:
        """Move the shard so that `[cut, shard_size)` lives on the host, its optimizer state
        in `tier` when given; returns whether anything changed."""
        if cut == self.cut and tier is self.tier:
            return False
        self.tier = tier
        device, values = self.main.device, self.whole()
        self.cut, self.pin_memory = cut, pin_memory
        self.allocate(device, values.dtype)
        if device.type != "meta":
            self.main.copy_(values[:cut])
            if self.host_main is not None:
                self.host_main.copy_(values[cut:])
        return True

    @property
    def offloaded(self) -> bool:
        return self.host_main is not None

    @property
    def on_meta(self) -> bool:
        return self.main.is_meta

    @property
    def dtype(self) -> torch.dtype:
        return self.main.dtype

    def whole(self) -> torch.Tensor:
        """The whole main-weight shard, on the device (a copy when offloaded)."""
        if self.host_main is None:
            return self.main
        return torch.cat([self.main, self.host_main.to(self.main.device)])

    def version(self) -> tuple[int, int]:
        """Bumped by every write to the main weights, on either side of the cut."""
        host = -1 if self.host_main is None else self.host_main._version
        return self.main._version, host

    def compute_copy(self, dtype: torch.dtype) -> torch.Tensor:
        """The shard in the compute dtype, on the device (what an all-gather sends): the
        host part is cast on the host, then copied up (asynchronously from pinned memory)."""
        device_part = self.main.to(dtype)
        if self.host_main is None:
            return device_part
        host_part = comm.to_device(self.host_main, self.main.device, dtype)
        return torch.cat([device_part, host_part]) if self.cut else host_part

    # --- a piece's rows -------------------------------------------------------------------
    def on_host(self, index: int) -> bool:
        return self.host_main is not None and self.specs[index].shard_offset >= self.cut

    def side_offset(self, index: int) -> tuple[bool, int]:
        """(on the host, offset in that side's buffer) of the index-th param's piece."""
        host = self.on_host(index)
        return host, self.specs[index].shard_offset - (self.cut if host else 0)

    def rows(self, index: int) -> torch.Tensor:
        """The index-th param's rows of the main weights."""
        return self._split_rows(self.main, self.host_main, index)

    def base(self, index: int) -> torch.Tensor:
        """The flat buffer `rows(index)` is a view of (whose version its writes bump)."""
        return self.host_main if self.on_host(index) else self.main

    def tier_of(self, index: int):
        """Where the optimizer state of the index-th param's piece goes: the disk tier for
        an offloaded piece under one (None: next to the piece)."""
        return self.tier if self.on_host(index) else None

    def piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """The index-th param's rows of a whole shard-sized buffer on the device."""
        spec = self.specs[index]
        return as_param(flat[spec.shard_offset : spec.shard_offset + spec.numel], spec)

    def _split_rows(self, device_part, host_part, index: int) -> torch.Tensor:
        spec = self.specs[index]
        host, start = self.side_offset(index)
        shard = host_part if host else device_part
        return as_param(shard[start : start + spec.numel], spec)

    # --- the gradient shard ---------------------------------------------------------------
    # It lives exactly as long as the parameters' `.grad` views of it (a view keeps its base
    # alive): `zero_grad()` frees it at once, as FSDP2's are freed.
    @property
    def grad(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(device part, host part) of the kept gradient, or None once it was freed."""
        if self._grad is None:
            return None
        parts = tuple(None if ref is None else ref() for ref in self._grad)
        alive = all(part is not None for part, ref in zip(parts, self._grad) if ref)
        return parts if alive else None

    def keep_grad(self, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A whole reduced gradient shard on the device becomes the kept gradient: its host
        part is copied down (asynchronously from CUDA: `comm.host_copies_done`)."""
        if self.host_main is None:
            parts = (fresh, None)
        else:
            parts = (fresh[: self.cut], comm.to_host(fresh[self.cut :]))
        self._grad = tuple(
            weakref.ref(part) if part is not None and part.numel() else None for part in parts
        )
        return parts

    def add_to_grad(self, reduced: torch.Tensor) -> None:
        """Accumulate a whole reduced shard into the kept gradient (one add per part; the
        host waits for its part's copy before adding it)."""
        device_part, host_part = self.grad
        if self.host_main is None:
            device_part.add_(reduced)
            return
        if self.cut:
            device_part.add_(reduced[: self.cut])
        host_part.add_(comm.to_host_now(reduced[self.cut :]))

    def grad_rows(self, parts, index: int) -> torch.Tensor:
        """The index-th param's rows of the kept gradient `parts`."""
        return self._split_rows(parts[0], parts[1], index)
