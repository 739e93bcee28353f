"""Consolidated full weights in one safetensors file, streamed one tensor at a time.

Export: every rank helps gather one tensor, rank 0 appends it to the file, and the tensor is
dropped before the next: peak memory per rank is the largest tensor, not the model.
Import: each rank reads only its own rows of each tensor from the file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from flatshard.api.fsdp_module import weights_changed
from flatshard.checkpoint.safetensors_stream import StreamingSafetensorsWriter
from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import shard_spec
from flatshard.errors import CheckpointError


def export_full(model: torch.nn.Module, path: str) -> None:
    """Write `model.state_dict()` at full size to the safetensors file `path` (every rank
    calls it; rank 0 writes)."""
    state = model.state_dict()
    writing = not dist.is_initialized() or dist.get_rank() == 0
    entries = [(key, tuple(value.shape), value.dtype) for key, value in state.items()]
    writer = StreamingSafetensorsWriter(path, entries) if writing else None
    for key, value in state.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if writer:
            writer.write(key, full)
        del full  # one full tensor at a time
    if writer:
        writer.close()
    if dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def load_full(model: torch.nn.Module, path: str) -> None:
    """Load a full-weights safetensors file into a (sharded) model; each rank reads only the
    rows it holds. Missing, unexpected and mismatched tensors are reported together."""
    state = model.state_dict()
    with safe_open(path, framework="pt") as source:
        stored = set(source.keys())
        problems = (
            [f"missing in file: {sorted(set(state) - stored)}"] if set(state) - stored else []
        )
        if stored - set(state):
            problems.append(f"unexpected in file: {sorted(stored - set(state))}")
        for key in sorted(stored & set(state)):
            piece = source.get_slice(key)
            if tuple(piece.get_shape()) != tuple(state[key].shape):
                problems.append(
                    f"{key}: file shape {tuple(piece.get_shape())}, model {tuple(state[key].shape)}"
                )
        if problems:
            raise CheckpointError(f"{path} does not match the model: " + "; ".join(problems))
        for key, value in state.items():
            piece = source.get_slice(key)
            if isinstance(value, DTensor) and isinstance(value._local_tensor, RowShard):
                for local, box in shard_spec(value).pieces:
                    value.to_local()[local.slices].copy_(piece[box.slices])
            elif isinstance(value, DTensor):
                raise CheckpointError(f"{key} is a DTensor flatshard did not shard; load it by DCP")
            else:
                value.copy_(piece[:])
    weights_changed(model)
