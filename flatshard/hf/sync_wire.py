"""How a bucket of pieces travels: one flat byte buffer per bucket, each piece cast to the
wire dtype (bf16, fp16, fp32, or its own dtype) or quantized to fp8 (e4m3) with one fp32
scale per row (a piece's dim-0 slice; a 1-D piece is one row), each segment padded to 8
bytes so the receiver views it in place. gloo has no fp8 dtype: bytes move as bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
WIRES = {
    None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8,
}  # fmt: skip
_ALIGN = 8


def wire_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """The wire dtype named (None: each tensor's own)."""
    if isinstance(name, torch.dtype) and name in WIRES.values():
        return name
    if name in WIRES:
        return WIRES[name]
    raise ValueError(f"wire dtype {name!r}: use one of {[k for k in WIRES if k]} or None")


@dataclass(frozen=True)
class Piece:
    """A block of a full tensor one sender sends: the tensor's name, the block's offset
    in every dim and its shape, and the dtype it has at the sender."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))


def _rows(piece: Piece) -> int:
    return piece.shape[0] if len(piece.shape) > 1 else 1


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def piece_bytes(piece: Piece, wire: torch.dtype | None) -> int:
    """The bytes a piece takes in a bucket's buffer."""
    dtype = wire or piece.dtype
    payload = _padded(piece.numel * dtype.itemsize)
    return payload + (_padded(4 * _rows(piece)) if dtype is FP8 else 0)


def pack(pieces: list[Piece], values: list[torch.Tensor], wire, device) -> torch.Tensor:
    """One bucket's byte buffer from its pieces' values."""
    buffer = torch.empty(sum(piece_bytes(p, wire) for p in pieces), dtype=torch.uint8,
                         device=device)  # fmt: skip
    at = 0
    for piece, value in zip(pieces, values):
        dtype = wire or piece.dtype
        if dtype is FP8:
            rows = value.reshape(_rows(piece), -1).float()
            scales = rows.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
            payload = (rows / scales[:, None]).to(FP8)
            parts = (payload, scales)
        else:
            parts = (value.to(dtype),)
        for part in parts:
            nbytes = part.numel() * part.element_size()
            buffer[at : at + nbytes].copy_(part.contiguous().reshape(-1).view(torch.uint8))
            at += _padded(nbytes)
    return buffer


def unpack(pieces: list[Piece], buffer: torch.Tensor, wire) -> list[torch.Tensor]:
    """The pieces' values (each in its sender's dtype, its shape) out of a bucket's bytes."""
    values, at = [], 0
    for piece in pieces:
        dtype = wire or piece.dtype
        nbytes = piece.numel * dtype.itemsize
        payload = buffer[at : at + nbytes].view(dtype)
        at += _padded(nbytes)
        if dtype is FP8:
            rows = _rows(piece)
            scales = buffer[at : at + 4 * rows].view(torch.float32)
            at += _padded(4 * rows)
            value = payload.reshape(rows, -1).float() * scales[:, None]
        else:
            value = payload
        values.append(value.reshape(piece.shape).to(piece.dtype))
    return values
