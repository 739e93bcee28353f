"""Loading full (unsharded) state dicts into flatshard DTensors.

`set_model_state_dict` / `set_optimizer_state_dict` with `full_state_dict=True` cut each
full tensor into `torch.chunk` pieces before copying it into a DTensor. flatshard's pieces
are layout rows, so for DTensors whose local tensor is a `RowShard` the piece its spec
names is taken instead (no communication); every other entry goes the usual way
(`original`: torch's function, which patches.py replaces with these).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from flatshard import registry
from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import RowShardedParameter, shard_spec


def _is_row_sharded(value) -> bool:
    return isinstance(value, DTensor) and isinstance(value._local_tensor, RowShard)


@torch.no_grad()
def _copy_rows(local: DTensor, full: torch.Tensor) -> DTensor:
    """Copy this rank's rows of `full` into `local`; returns what now holds them: `local`,
    or for a parameter of a model still on the meta device (FSDP2's loading flow, no
    `to_empty`) the parameter its unit's newly allocated shards gave it."""
    if local.is_meta and isinstance(local, RowShardedParameter):
        local.data = full  # allocates the unit's shards and loads this one
        unit, managed = registry.managed_of(local)
        return managed.sharded
    local.to_local().copy_(shard_spec(local).piece_of(full).to(local.device))
    return local


def distribute_state_dict(original, full_state_dict, local_state_dict, device, pg=None):
    rest = {}
    for key, value in full_state_dict.items():
        local = local_state_dict.get(key)
        if torch.is_tensor(value) and value.dim() > 0 and _is_row_sharded(local):
            local_state_dict[key] = _copy_rows(local, value.detach())
        else:
            rest[key] = value
    original(rest, local_state_dict, device, pg)


def distribute_tensors(original, local_state_dict, keys, device, pg=None):
    rest = []
    for key in keys:
        entry = local_state_dict.get(key)
        if isinstance(entry, tuple) and _is_row_sharded(entry[0]):
            local_state_dict[key] = _copy_rows(entry[0], entry[1])
        else:
            rest.append(key)
    original(local_state_dict, rest, device, pg)
