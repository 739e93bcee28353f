"""Storage of one bucket: sharded main weights, the unsharded compute copy, gradients.

Every offset comes from the layout (the bucket's `BucketLayout` and its parameters'
`ShardSpec`s, and under optimizer offload the host cut that layout/offload.py chose); this
file only allocates, views and moves whole flat buffers. This rank's shard is `main` (on
the device) followed by `host_main` (on the host, from the cut on; None without offload):
a piece lies wholly in one of them.
"""

from __future__ import annotations

import weakref

import torch

from flatshard import comm
from flatshard.layout import BucketLayout


class FlatBucket:
    def __init__(
        self,
        layout: BucketLayout,
        rank: int,
        group,
        device: torch.device,
        main_dtype: torch.dtype,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
    ):
        self.layout = layout
        self.rank = rank
        self.group = group
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.specs = [layout.spec(slot, rank) for slot in layout.slots]
        self.cut = layout.shard_size  # where this rank's shard moves to the host
        self.pin_memory = False
        self.tier = None  # the disk tier of the offloaded pieces' optimizer state, if any
        self.allocate(device, main_dtype)
        self.unsharded_grad: torch.Tensor | None = None
        self._sharded_grad: weakref.ref | None = None
        self._gather_input: torch.Tensor | None = None
        self._version = 0
        self._main_version = (-1, -1)
        self._unsynced: torch.Tensor | None = None
        # hpZ: this rank's 1/n of the gathered bucket, kept from forward to backward, and
        # the weights' version it reflects
        self.secondary: torch.Tensor | None = None
        self._secondary_version = (-1, -1)
        # HSDP: reduce-scattered gradient shards not yet summed over the replicas
        # (`set_requires_all_reduce(False)`), in the reduce dtype
        self.unreplicated: torch.Tensor | None = None

    def allocate(self, device: torch.device, main_dtype: torch.dtype | None = None) -> None:
        """The sharded main weights (zeros: padding stays zero, it is all-gathered but never
        read) and the unsharded buffer, freed; on `meta` for a model built there, until
        `to_empty` / `materialize` allocates them on the real device."""
        self._allocate_shard(device, main_dtype or self.main.dtype)
        self.unsharded = torch.empty(self.layout.padded_size, dtype=self.param_dtype, device=device)
        if device.type != "meta":
            comm.free_storage(self.unsharded)

    def _allocate_shard(self, device: torch.device, dtype: torch.dtype) -> None:
        self.main = torch.zeros(self.cut, dtype=dtype, device=device)
        self.host_main = None
        size = self.layout.shard_size - self.cut
        if self.cut == self.layout.shard_size:
            pass
        elif device.type == "meta":
            self.host_main = torch.zeros(size, dtype=dtype, device=device)
        else:
            self.host_main = comm.host_zeros(size, dtype, self.pin_memory)

    def place(self, cut: int, pin_memory: bool, tier=None) -> bool:
        """Move this rank's shard so that `[cut, shard_size)` lives on the host (the layout's
        choice), its optimizer state in `tier` when given; returns whether anything
        changed."""
        if cut == self.cut and tier is self.tier:
            return False
        self.tier = tier
        device, values = self.main.device, self.main_shard()
        self.cut, self.pin_memory = cut, pin_memory
        self._allocate_shard(device, values.dtype)
        if device.type != "meta":
            self.main.copy_(values[:cut])
            if self.host_main is not None:
                self.host_main.copy_(values[cut:])
        return True

    @property
    def offloaded(self) -> bool:
        return self.host_main is not None

    def main_shard(self) -> torch.Tensor:
        """This rank's whole main-weight shard, on the device (a copy when offloaded)."""
        if self.host_main is None:
            return self.main
        return torch.cat([self.main, self.host_main.to(self.main.device)])

    def weights_version(self) -> tuple[int, int]:
        """Bumped by every write to the sharded main weights, on either side of the cut."""
        host = -1 if self.host_main is None else self.host_main._version
        return self.main._version, host

    @property
    def on_meta(self) -> bool:
        return self.main.is_meta

    # The flat gradient shard lives exactly as long as the parameters' `.grad` views of it
    # (a view keeps its base alive): `zero_grad()` frees it at once, as FSDP2's are freed.
    # Under offload it is two flat buffers, the device part and the host part.
    @property
    def sharded_grad(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if self._sharded_grad is None:
            return None
        parts = tuple(None if ref is None else ref() for ref in self._sharded_grad)
        alive = all(part is not None for part, ref in zip(parts, self._sharded_grad) if ref)
        return parts if alive else None

    def keep_grad(self, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A whole reduced gradient shard on the device becomes this bucket's gradient: its
        host part is copied down (asynchronously from CUDA: `comm.host_copies_done`)."""
        if self.host_main is None:
            parts = (fresh, None)
        else:
            parts = (fresh[: self.cut], comm.to_host(fresh[self.cut :]))
        self._sharded_grad = tuple(
            weakref.ref(part) if part is not None and part.numel() else None for part in parts
        )
        return parts

    def add_to_grad(self, reduced: torch.Tensor) -> None:
        """Accumulate a whole reduced shard into the kept gradient (one add per part; the
        host part's copy is waited for before the host adds it)."""
        device_part, host_part = self.sharded_grad
        if self.host_main is None:
            device_part.add_(reduced)
            return
        if self.cut:
            device_part.add_(reduced[: self.cut])
        host_part.add_(comm.to_host_now(reduced[self.cut :]))

    def grad_rows_of(self, parts, index: int) -> torch.Tensor:
        """The index-th param's rows of the kept gradient."""
        return self.rows(parts[0], parts[1], index)

    # --- views -------------------------------------------------------------------------
    def main_rows(self, index: int) -> torch.Tensor:
        """This rank's rows of the index-th param, a view of the main-weight shard."""
        return self.rows(self.main, self.host_main, index)

    def main_base(self, index: int) -> torch.Tensor:
        """The flat buffer `main_rows(index)` is a view of (whose version its writes bump)."""
        return self.host_main if self.on_host(index) else self.main

    def state_tier(self, index: int):
        """Where the optimizer state of the index-th param's piece goes: the disk tier for
        an offloaded piece under one (None: next to the piece)."""
        return self.tier if self.on_host(index) else None

    def on_host(self, index: int) -> bool:
        return self.host_main is not None and self.specs[index].shard_offset >= self.cut

    def rows(self, device_part: torch.Tensor, host_part: torch.Tensor | None, index: int):
        """The index-th param's rows of a shard split at the cut (a whole shard on the
        device: `host_part` None or ignored when the piece lies before the cut)."""
        spec = self.specs[index]
        shard, start = device_part, spec.shard_offset
        if self.on_host(index):
            shard, start = host_part, start - self.cut
        return shard[start : start + spec.numel].view(spec.local_shape)

    def grad_rows(self, grad_shard: torch.Tensor, index: int) -> torch.Tensor:
        """The index-th param's rows of a whole gradient shard on the device."""
        spec = self.specs[index]
        return grad_shard[spec.shard_offset : spec.shard_offset + spec.numel].view(spec.local_shape)

    def unsharded_view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        return buffer[slot.offset : slot.offset + slot.numel].view(slot.info.shape)

    # --- all-gather ----------------------------------------------------------------------
    def start_all_gather(self, pool: comm.BufferPool | None = None):
        comm.alloc_storage(self.unsharded, pool)
        source = self._gather_source()
        self._gather_input = source  # alive until the collective is waited on
        self._version = self.unsharded._version
        # The copy reflects the weights as of now: a write before the wait (an optimizer
        # step, a load, a user edit) makes it stale, or torn where NCCL reads `main` late.
        self._gathering_version = self.weights_version()
        return comm.all_gather(
            self.unsharded, source, self.group, self.layout.shard_views(self.unsharded)
        )

    def _gather_source(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, on the device: the host part (offload)
        is cast on the host, then copied up (asynchronously from pinned memory)."""
        device_part = self.main.to(self.param_dtype)
        if self.host_main is None:
            return device_part
        host_part = comm.to_device(self.host_main.to(self.param_dtype), self.main.device)
        return torch.cat([device_part, host_part]) if self.cut else host_part

    def keep_secondary(self, group_size: int, index: int) -> None:
        """After forward (hpZ): keep piece `index` of `group_size` of the gathered bucket;
        the group's ranks together hold all of it."""
        piece = self.layout.padded_size // group_size
        self.secondary = self.unsharded[index * piece : (index + 1) * piece].clone()
        self._secondary_version = self._main_version

    def secondary_fresh(self) -> bool:
        """A kept piece that still reflects the sharded weights (no step since forward)."""
        return self.secondary is not None and self.weights_version() == self._secondary_version

    def start_secondary_gather(self, group, pool: comm.BufferPool | None = None):
        """Gather the bucket from the group's kept pieces (hpZ's backward all-gather)."""
        comm.alloc_storage(self.unsharded, pool)
        self._gather_input, self.secondary = self.secondary, None
        self._version = self.unsharded._version
        self._gathering_version = self._secondary_version
        return comm.all_gather(self.unsharded, self._gather_input, group)

    def finish_all_gather(self, work) -> None:
        work.wait()
        self._main_version = self._gathering_version
        # Views of this buffer saved for backward must not see a version bump from a
        # re-gather of the same values; gloo bumps it when the collective completes.
        torch._C._autograd._unsafe_set_version_counter((self.unsharded,), (self._version,))
        self._gather_input = None

    def gathered_version_changed(self) -> bool:
        """Whether the sharded weights were written since they were last gathered."""
        return self.weights_version() != self._main_version

    def free_unsharded(self, pool: comm.BufferPool | None = None) -> None:
        comm.free_storage(self.unsharded, pool)

    # --- gradients -----------------------------------------------------------------------
    def prepare_unsharded_grad(self, keep: bool, pool: comm.BufferPool) -> None:
        """A zeroed flat gradient buffer, or the current one when `keep` (accumulating)."""
        if self.unsharded_grad is None:
            self.unsharded_grad = pool.empty(
                self.layout.padded_size, self.param_dtype, self.main.device
            ).zero_()
        elif not keep:
            self.unsharded_grad.zero_()

    def release_unsharded_grad(self, pool: comm.BufferPool) -> None:
        grad, self.unsharded_grad = self.unsharded_grad, None
        if grad is not None:
            pool.give_back(grad)

    def hold_unsynced_grad(self) -> bool:
        """Keep this microbatch's gradient for a later sync. Low-precision gradients are
        summed in the reduce dtype (as FSDP2 does), not in place in param_dtype; then the
        param-dtype buffer is dropped (returns True) and the next backward gets a new one."""
        if self.reduce_dtype == self.param_dtype:
            return False  # the next backward accumulates in place
        if self._unsynced is None:
            self._unsynced = self.unsharded_grad.to(self.reduce_dtype)
        else:
            self._unsynced.add_(self.unsharded_grad)
        self.unsharded_grad = None
        return True

    @property
    def holds_unsynced(self) -> bool:
        return self._unsynced is not None

    def start_reduce_scatter(
        self,
        divide_factor: float,
        shard_size: int,
        replicate_size: int,
        pool: comm.BufferPool,
        force_sum: bool = False,
    ):
        """Reduce the unsharded gradient over the shard group; returns (work, output, input,
        post-scale). Divided by `divide_factor` once the replicas (HSDP) sum the output."""
        flat = self.unsharded_grad
        if self._unsynced is not None:
            flat, self._unsynced = self._unsynced.add_(flat), None
        elif flat.dtype != self.reduce_dtype:
            flat = pool.empty(flat.numel(), self.reduce_dtype, flat.device).copy_(flat)
        output = torch.empty(self.layout.shard_size, dtype=self.reduce_dtype, device=flat.device)
        # fp16 averaged by the collective can underflow (and overflow before its divide):
        # scaled first and summed instead, like a custom divide factor
        average = (
            divide_factor == shard_size * replicate_size
            and flat.dtype != torch.float16
            and not force_sum
        )
        if average:  # averaged over the shard group; each replica's share of their sum
            post_scale = 1.0 / replicate_size if replicate_size > 1 else None
        elif flat.dtype == torch.float32:
            post_scale = 1.0 / divide_factor
        else:
            post_scale = None
            # Low-precision sums can overflow: scale before reducing.
            flat.mul_(1.0 / divide_factor)  # consumed by this reduce: scale in place
        work = comm.reduce_scatter(output, flat, self.group, average=average, pool=pool)
        return work, output, flat, post_scale
