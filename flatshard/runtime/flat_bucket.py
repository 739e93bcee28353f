"""One bucket: this rank's shard (shard_storage.py: main weights and their gradient, on
the device or, under optimizer offload, partly on the host), the unsharded compute copy
that all-gathers fill, and the gradients (bucket_grads.py) that its reduce-scatter empties.

Every offset comes from the layout (the bucket's `BucketLayout` and its parameters'
`ShardSpec`s); this file only allocates, views and moves whole flat buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatshard import comm
from flatshard.layout import BucketLayout
from flatshard.runtime.bucket_grads import BucketGradients
from flatshard.runtime.shard_storage import ShardStorage, as_param
from flatshard.runtime.transport import Transport


@dataclass(frozen=True)
class KeptPiece:
    """hpZ: this rank's 1/n of the gathered bucket, kept from forward to backward, and the
    version of the sharded weights (`ShardStorage.version()`) it was gathered from."""

    rows: torch.Tensor
    version: tuple[int, int]


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
        self.shard = ShardStorage(self.specs, layout.shard_size, device, main_dtype)
        self._allocate_unsharded(device)
        self.grads = BucketGradients(layout.padded_size, param_dtype, reduce_dtype)
        self.transport = Transport()  # how its collectives move its bytes (transport.py)
        self._gather_input: torch.Tensor | None = None
        self._version = 0
        # the version of the sharded weights the unsharded buffer holds (None: nothing
        # gathered yet), and of the gather in flight
        self.gathered_version: tuple[int, int] | None = None
        self._gathering_version: tuple[int, int] | None = None
        self.secondary: KeptPiece | None = None  # hpZ's piece kept for backward

    def allocate(self, device: torch.device) -> None:
        """Real (zeroed) shards and the unsharded buffer on `device`, for a bucket built on
        the meta device (`to_empty` / `materialize`)."""
        self.shard.allocate(device)
        self._allocate_unsharded(device)

    def convert(self, dtype: torch.dtype, policy) -> None:
        """Keep the main weights in `dtype` (their values converted), with the compute and
        reduce dtypes `policy` (a MixedPrecisionPolicy) gives it; nothing gathered or
        reduced survives. The unit must be resharded."""
        self.shard.convert(dtype)
        self.param_dtype, self.reduce_dtype = policy.dtypes_for(dtype)
        self._allocate_unsharded(self.shard.main.device)
        self.grads = BucketGradients(self.layout.padded_size, self.param_dtype, self.reduce_dtype)
        self.secondary = None
        self.gathered_version = None

    def _allocate_unsharded(self, device: torch.device) -> None:
        # freed until gathered (on `meta` nothing to free)
        self.unsharded = torch.empty(self.layout.padded_size, dtype=self.param_dtype, device=device)
        if device.type != "meta":
            comm.free_storage(self.unsharded)

    @property
    def on_meta(self) -> bool:
        return self.shard.on_meta

    # --- views -------------------------------------------------------------------------
    def unsharded_view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.layout.slots[index]
        flat = buffer[slot.offset : slot.offset + slot.numel]
        return as_param(flat, self.specs[index], slot.info.stored_shape)

    # --- all-gather ----------------------------------------------------------------------
    def start_all_gather(self, pool: comm.BufferPool | None = None):
        comm.alloc_storage(self.unsharded, pool)
        source = self.shard.compute_copy(self.param_dtype)
        self._gather_input = source  # alive until the collective is waited on
        self._version = self.unsharded._version
        # The copy reflects the weights as of now: a write before the wait (an optimizer
        # step, a load, a user edit) makes it stale, or torn where NCCL reads the shard late.
        self._gathering_version = self.shard.version()
        pieces = self.layout.shard_views(self.unsharded)
        return self._all_gather(self.unsharded, source, self.group, pieces)

    def gather_main(self) -> torch.Tensor:
        """The whole bucket's main weights (in their dtype: fp32 under mixed precision),
        gathered from every rank's shard in one collective: full parameters to cut from."""
        shard = self.shard.whole()
        output = torch.empty(self.layout.padded_size, dtype=shard.dtype, device=shard.device)
        pieces = self.layout.shard_views(output)
        comm.for_group(self.group).all_gather(output, shard, pieces).wait()
        return output

    def keep_secondary(self, group_size: int, index: int) -> None:
        """After forward (hpZ): keep piece `index` of `group_size` of the gathered bucket;
        the group's ranks together hold all of it."""
        piece = self.layout.padded_size // group_size
        rows = self.unsharded[index * piece : (index + 1) * piece].clone()
        self.secondary = KeptPiece(rows, self.gathered_version)

    def secondary_fresh(self) -> bool:
        """A kept piece that still reflects the sharded weights (no step since forward)."""
        return self.secondary is not None and self.shard.version() == self.secondary.version

    def start_secondary_gather(self, group, pool: comm.BufferPool | None = None):
        """Gather the bucket from the group's kept pieces (hpZ's backward all-gather)."""
        comm.alloc_storage(self.unsharded, pool)
        kept, self.secondary = self.secondary, None
        self._gather_input = kept.rows
        self._version = self.unsharded._version
        self._gathering_version = kept.version
        return self._all_gather(self.unsharded, self._gather_input, group)

    def _all_gather(self, output: torch.Tensor, shard: torch.Tensor, group, pieces=None):
        return self.transport.all_gather(self, output, shard, group, pieces)

    def finish_all_gather(self, work) -> None:
        work.wait()
        self.gathered_version = self._gathering_version
        # Views of this buffer saved for backward must not see a version bump from a
        # re-gather of the same values; gloo bumps it when the collective completes.
        torch._C._autograd._unsafe_set_version_counter((self.unsharded,), (self._version,))
        self._gather_input = None

    def gathered_version_changed(self) -> bool:
        """Whether the sharded weights were written since they were last gathered."""
        return self.shard.version() != self.gathered_version

    def free_unsharded(self, pool: comm.BufferPool | None = None) -> None:
        comm.free_storage(self.unsharded, pool)

    # --- gradients -----------------------------------------------------------------------
    def gradient_buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer this bucket holds: the kept shard's device part, and between
        micro-batches the unsharded gradient and the sums not yet reduced."""
        kept = self.shard.grad  # (device part, host part); either may be None
        device_part = kept[0] if kept is not None else None
        return ([device_part] if device_part is not None else []) + self.grads.buffers()

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
        flat = self.grads.to_reduce(pool)
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
        work = self.transport.reduce_scatter(self, output, flat, average, self.group, pool)
        return work, output, flat, post_scale
