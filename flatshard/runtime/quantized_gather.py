"""Weights all-gathered in 8 bits (ZeRO++'s qwZ): each rank quantizes its shard in blocks
of `block` elements, one fp32 scale a block (its largest magnitude maps to the format's
largest value), and the bucket's one all-gather moves those bytes (about 1.02 bytes an
element against 4 for fp32 and 2 for bf16); every rank widens all shards back into the
bucket's unsharded compute buffer at the wait. Only the gathered copy is rounded: the main
weights, gradients and optimizer step stay in full precision.

A bucket transport's `gather` (transport.py); hpZ's backward gather inside its group goes
through it too.
"""

from __future__ import annotations

import torch

from flatshard import comm

FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
BLOCK = 256  # elements a scale covers, by default


def pack(shard: torch.Tensor, dtype: torch.dtype, largest: float, block: int) -> torch.Tensor:
    """`shard` as bytes: its 8-bit blocks (zero-padded to whole blocks), then their scales."""
    blocks = -(-shard.numel() // block)
    padded = shard.new_zeros(blocks * block, dtype=torch.float32)
    padded[: shard.numel()] = shard.reshape(-1)
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1, keepdim=True) / largest
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = padded / scales
    if dtype == torch.int8:
        scaled = scaled.round_()
    values = scaled.to(dtype).view(torch.uint8).reshape(-1)
    return torch.cat([values, scales.reshape(-1).view(torch.uint8)])


def unpack(packed: torch.Tensor, numel: int, dtype: torch.dtype, block: int) -> torch.Tensor:
    """Rows of `pack`ed shards (one a rank) back to fp32 rows of `numel` elements."""
    blocks = -(-numel // block)
    values = packed[:, : blocks * block].contiguous().view(dtype).to(torch.float32)
    scales = packed[:, blocks * block :].contiguous().view(torch.float32)
    widened = values.view(packed.shape[0], blocks, block) * scales.unsqueeze(-1)
    return widened.view(packed.shape[0], -1)[:, :numel]


def packed_bytes(numel: int, block: int) -> int:
    """Bytes one shard of `numel` elements takes on the wire."""
    blocks = -(-numel // block)
    return blocks * block + 4 * blocks


class QuantizedWeightGather:
    """Gathers a bucket's weights in `fmt` ("int8" or "fp8")."""

    def __init__(self, fmt: str, block: int):
        self.dtype, self.largest = FORMATS[fmt]
        self.block = block

    def __call__(self, bucket, output, shard, group, pieces):
        packed = pack(shard, self.dtype, self.largest, self.block)
        ranks = output.numel() // shard.numel()
        wire = torch.empty(ranks * packed.numel(), dtype=torch.uint8, device=packed.device)
        work = comm.for_group(group).all_gather(wire, packed)
        return _Widen(work, wire.view(ranks, -1), output.view(ranks, -1), self)


class _Widen:
    def __init__(self, work, wire, output, gather: QuantizedWeightGather):
        self._work, self._wire, self._output, self._gather = work, wire, output, gather

    def wait(self) -> bool:
        self._work.wait()
        numel = self._output.shape[1]
        self._output.copy_(unpack(self._wire, numel, self._gather.dtype, self._gather.block))
        self._wire = None
        return True
