"""Write one safetensors file a tensor at a time.

`safetensors.torch.save_file` needs every tensor of the file in memory at once; a 5 GB shard
would mean 5 GB of gathered weights per save. The format only needs names, dtypes and
shapes up front (an 8-byte little-endian header length, a JSON header with each tensor's
byte range, then the bytes back to back), and those are known before any data, so the
header is written first and each tensor streamed after it in the declared order.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from flatshard.errors import CheckpointError

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_dtype(dtype: torch.dtype) -> str:
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a safetensors file")
    return SAFETENSORS_DTYPES[dtype]


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


class StreamingSafetensorsWriter:
    """Writes `entries` = [(name, shape, dtype)] to `file`, in that order, one `write` each.

    The data goes to `file` + ".tmp" and is renamed into place by `close()` once complete,
    so an interrupted save never leaves a truncated file under the final name.
    """

    def __init__(self, file: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.file = Path(file)
        self._entries = list(entries)
        self._next = 0
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in self._entries:
            size = tensor_bytes(shape, dtype)
            header[name] = {
                "dtype": safetensors_dtype(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # safetensors pads the header to 8 bytes
        self._tmp = self.file.with_name(self.file.name + ".tmp")
        self._out = open(self._tmp, "wb")
        self._out.write(struct.pack("<Q", len(encoded)))
        self._out.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, shape, dtype = self._entries[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (expected_name, shape, dtype):
            raise CheckpointError(  # a bug in the caller, but never a corrupt file
                f"{self.file.name}: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected "
                f"{expected_name} {shape} {dtype} next"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._out.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        self._out.flush()
        os.fsync(self._out.fileno())  # durable before it appears under its final name
        self._out.close()
        if self._next != len(self._entries):
            raise CheckpointError(
                f"{self.file.name}: only {self._next} of {len(self._entries)} tensors written"
            )
        os.replace(self._tmp, self.file)

    def abort(self) -> None:
        self._out.close()
        self._tmp.unlink(missing_ok=True)
