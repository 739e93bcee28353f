"""One bucket's gradients on their way to its shard: the flat unsharded gradient that
autograd fills (the parameters' `.grad` are views of it), the sums of micro-batches not yet
synced (in the reduce dtype, as FSDP2 keeps them) and, under HSDP, the reduce-scattered shards
not yet summed over the replicas. The reduce-scatter itself is the bucket's (flat_bucket.py)."""

from __future__ import annotations

import torch

from flatshard import comm


class BucketGradients:
    def __init__(self, padded_size: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.padded_size = padded_size
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.unsharded: torch.Tensor | None = None
        self.unsynced: torch.Tensor | None = None
        # HSDP: reduce-scattered gradient shards not yet summed over the replicas
        # (`set_requires_all_reduce(False)`), in the reduce dtype
        self.unreplicated: torch.Tensor | None = None

    def prepare(self, keep: bool, pool: comm.BufferPool, device: torch.device) -> None:
        """A zeroed flat gradient buffer, or the current one when `keep` (accumulating)."""
        if self.unsharded is None:
            self.unsharded = pool.empty(self.padded_size, self.param_dtype, device).zero_()
        elif not keep:
            self.unsharded.zero_()

    def release(self, pool: comm.BufferPool) -> None:
        grad, self.unsharded = self.unsharded, None
        if grad is not None:
            pool.give_back(grad)

    def drop(self, pool: comm.BufferPool) -> None:
        """Forget every gradient not yet reduced into the shard (a failed iteration's)."""
        self.release(pool)
        self.unsynced = self.unreplicated = None

    def hold_unsynced(self) -> bool:
        """Keep this microbatch's gradient for a later sync. Low-precision gradients are
        summed in the reduce dtype (as FSDP2 does), not in place in param_dtype; then the
        param-dtype buffer is dropped (returns True) and the next backward gets a new one."""
        if self.reduce_dtype == self.param_dtype:
            return False  # the next backward accumulates in place
        if self.unsynced is None:
            self.unsynced = self.unsharded.to(self.reduce_dtype)
        else:
            self.unsynced.add_(self.unsharded)
        self.unsharded = None
        return True

    def to_reduce(self, pool: comm.BufferPool) -> torch.Tensor:
        """The flat gradient to reduce-scatter, in the reduce dtype: the held sums with this
        micro-batch's added, or a copy of it (the unsharded buffer itself when the dtypes
        agree)."""
        flat = self.unsharded
        if self.unsynced is not None and flat is None:  # no backward since they were held
            flat, self.unsynced = self.unsynced, None
        elif self.unsynced is not None:
            flat, self.unsynced = self.unsynced.add_(flat), None
        elif flat.dtype != self.reduce_dtype:
            flat = pool.empty(flat.numel(), self.reduce_dtype, flat.device).copy_(flat)
        return flat

    def buffers(self) -> list[torch.Tensor]:
        """The gradient buffers held between micro-batches."""
        held = (self.unsharded, self.unsynced, self.unreplicated)
        return [buffer for buffer in held if buffer is not None]

    @property
    def pending(self) -> bool:
        """Something to reduce: this micro-batch's gradient or held sums."""
        return self.unsharded is not None or self.unsynced is not None
