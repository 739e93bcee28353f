"""Storage for a model built on the meta device before a load fills it: empty for what no
fully_shard manages, an init for the shards (which the load then overwrites)."""

from __future__ import annotations

import torch
from torch import nn

from flatshard.api.materialize import materialize


def allocate_and_materialize(model: nn.Module, device: torch.device) -> None:
    """Empty storage for unsharded meta parameters, an init for the shards (flatshard's
    own models, whose modules all have reset_parameters)."""
    allocate_unsharded(model, device)
    # materialize draws an init that the load overwrites: leave the caller's RNG as it was
    with torch.random.fork_rng(devices=[]):
        materialize(model, device)


def allocate_unsharded(model: nn.Module, device: torch.device) -> None:
    """Give parameters that no fully_shard manages (still meta) empty storage, keeping ties.

    Their values would only be overwritten by the load, so no init is drawn for them (and
    `materialize` skips them; today it cannot re-home an unsharded meta parameter anyway).
    """
    allocated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in allocated:
                empty = torch.empty_like(param, device=device)
                allocated[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
            module._parameters[name] = allocated[id(param)]
