"""Gradients reduce-scattered in 8 bits (ZeRO++'s qgZ), with error feedback.

Each rank quantizes its unsharded gradient in blocks of `block` elements per destination
shard (one fp32 scale a block, as the weight gathers of quantized_gather.py), one
all-to-all sends every rank the blocks of its shard (about 1.02 bytes an element against 4
for fp32), and each rank widens what it received and sums it in fp32. Error feedback: what
the rounding dropped (the gradient less its quantized copy) is kept and added to the next
step's gradient before quantizing, so the sum over steps loses nothing but the last step's
rounding. It costs one unsharded gradient of the bucket (reduce dtype) per rank.

A bucket transport's `scatter` (transport.py).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from flatshard.comm import collectives
from flatshard.runtime.quantized_gather import FORMATS, pack, unpack


class QuantizedGradientScatter:
    """Reduce-scatters a bucket's gradient in `fmt` ("int8" or "fp8")."""

    def __init__(self, fmt: str, block: int, error_feedback: bool = True):
        self.dtype, self.largest = FORMATS[fmt]
        self.block = block
        self.error_feedback = error_feedback
        self._residuals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, bucket, output, flat, average, group):
        ranks, shard = dist.get_world_size(group), output.numel()
        gradient = flat.float().view(ranks, shard)
        residual = self._residuals.get(bucket)
        if residual is not None:
            gradient = gradient + residual
        packed = torch.stack([pack(row, self.dtype, self.largest, self.block) for row in gradient])
        if self.error_feedback:
            self._residuals[bucket] = gradient - unpack(packed, shard, self.dtype, self.block)
        collectives.traffic.reduce_scatter += packed.numel()
        if ranks == 1:
            return _Sum(None, packed, output, self, average)
        received = torch.empty_like(packed)
        work = dist.all_to_all_single(received, packed, group=group, async_op=True)
        return _Sum(work, received, output, self, average)


class _Sum:
    """At the wait: every rank's blocks of this shard widened and summed in fp32."""

    def __init__(self, work, received, output, scatter: QuantizedGradientScatter, average):
        self._work, self._received, self._output = work, received, output
        self._scatter, self._average = scatter, average

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        scatter, ranks = self._scatter, self._received.shape[0]
        rows = unpack(self._received, self._output.numel(), scatter.dtype, scatter.block)
        total = rows.sum(dim=0)
        self._output.copy_(total / ranks if self._average else total)
        self._received = None
        return True
