"""A global optimizer hook that catches an optimizer built before `fully_shard`: it holds
the replaced parameters and would silently train nothing."""

from __future__ import annotations

import weakref

from flatshard import registry
from flatshard.errors import OptimizerOrderError

_checked: weakref.WeakSet = weakref.WeakSet()  # optimizers already checked (first step only)


def check_first_step(optimizer, args, kwargs) -> None:
    if optimizer in _checked:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if registry.replacement_of(param) is not None:
                raise OptimizerOrderError(
                    f"{type(optimizer).__name__} holds parameters that fully_shard replaced: "
                    "it was built before the model was wrapped and would train nothing. "
                    "Build the optimizer after fully_shard, e.g. AdamW(model.parameters())."
                )
    _checked.add(optimizer)
