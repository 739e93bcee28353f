"""Global optimizer hooks: catch an optimizer built before `fully_shard`, and mark units
whose sharded weights an optimizer step changed (their kept unsharded copy is stale)."""

from __future__ import annotations

import weakref

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from flatshard.errors import OptimizerOrderError

_installed = False
# optimizer -> the flatshard units its parameters belong to (computed on its first step)
_units_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install() -> None:
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_check_first_step)
        register_optimizer_step_post_hook(_mark_stale)
        _installed = True


def _params(optimizer):
    for group in optimizer.param_groups:
        yield from group["params"]


def _check_first_step(optimizer, args, kwargs) -> None:
    if optimizer in _units_of:
        return
    for param in _params(optimizer):
        if hasattr(param, "_flatshard_replaced_by"):
            raise OptimizerOrderError(
                f"{type(optimizer).__name__} holds parameters that fully_shard replaced: it was "
                "built before the model was wrapped and would train nothing. Build the "
                "optimizer after fully_shard, e.g. AdamW(model.parameters())."
            )
    units = {
        id(p._flatshard_param[0]): p._flatshard_param[0]
        for p in _params(optimizer)
        if hasattr(p, "_flatshard_param")
    }
    _units_of[optimizer] = list(units.values())


def _mark_stale(optimizer, args, kwargs) -> None:
    for unit in _units_of.get(optimizer, ()):
        unit.mark_stale()
