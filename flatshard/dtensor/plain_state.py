"""Optimizer states kept as plain local tensors (TransformerEngine's FusedAdam does; so can
any optimizer that calls `to_local()`): for flatshard they are bare `RowShard`s, which know
their rows but not their mesh. DCP sizes a plain tensor by its local shape, so for a
checkpoint each is viewed as a DTensor on its parameter's mesh, with its parameter's
placements (no copy: loads land in the optimizer's own tensor), and unwrapped after."""

from __future__ import annotations

import torch

from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import dtensor_viewing


def as_dtensors(model, optim_state: dict) -> None:
    """Replace every bare `RowShard` in `optim_state["state"]` (keyed by parameter FQN) by a
    DTensor view of it on its parameter's mesh."""
    for fqn, states in optim_state.get("state", {}).items():
        bare = [k for k, v in states.items() if isinstance(v, RowShard)]
        if not bare:
            continue
        param = model.get_parameter(fqn)
        for key in bare:
            local = states[key]
            view = dtensor_viewing(  # on the host when offloaded: no device copy
                local,
                param.device_mesh,
                param.placements,
                shape=torch.Size(local.spec.global_shape),
                stride=local.spec.global_strides,
            )
            view._flatshard_plain = True
            states[key] = view


def unwrap(optim_state: dict) -> None:
    """Back to the plain local tensors (loaded in place) before the optimizer takes them."""
    for states in optim_state.get("state", {}).values():
        for key, value in states.items():
            if getattr(value, "_flatshard_plain", False):
                states[key] = value._local_tensor
