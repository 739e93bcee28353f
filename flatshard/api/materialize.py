"""Initialise a model that was built on the meta device and then `fully_shard`-ed.

Eager construction initialises each leaf module in construction order through its
`reset_parameters()`. Replaying exactly that, one module at a time at full size, and
keeping only this rank's rows gives bitwise the eager weights for the same seed, at any
world size, while peak memory stays at the sharded model plus one module's parameters.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from flatshard import registry
from flatshard.errors import WrappingError
from flatshard.mesh import default_device
from flatshard.runtime import shard_placement
from flatshard.runtime.managed_param import home_of


@torch.no_grad()
def materialize(
    model: nn.Module, device: torch.device | str | None = None, replay: nn.Module | None = None
) -> nn.Module:
    """Give every meta parameter and buffer real values by replaying `reset_parameters()`
    over `model.modules()` (the order eager construction runs them).

    Tied parameters are initialised by their first module; a later module that shares one
    runs its `reset_parameters()` on a throwaway copy, as eager construction did before
    tying. Call it on every rank with the same RNG seed.

    replay: the whole model (on the meta device) that `model`, a pipeline stage, was split
    from: its modules are replayed in its order, those the stage lacks on throwaway copies,
    so every stage holds the whole model's weights.
    """
    device = torch.device(device) if device is not None else _units_device(model)
    for unit in registry.units_below(model):
        shard_placement.allocate(unit, device)  # shards still on meta (fully_shard of a meta model)
    done: dict[int, nn.Parameter] = {}  # id(original) -> what now holds its values
    for module in _in_order(model, replay, device):
        pending = _swap_in_full_tensors(module, device, done)
        meta_buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        for name in meta_buffers:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
        if not pending and not meta_buffers:
            continue
        reset = getattr(module, "reset_parameters", None)
        if reset is None:
            raise WrappingError(
                f"{type(module).__name__} has meta-device parameters or buffers but no "
                "reset_parameters(); give it one so it can be initialised after sharding"
            )
        reset()
        for name, (original, full, first) in pending.items():
            done.setdefault(id(original), _keep(module, name, original, full, first, done))
    return model


def _in_order(model: nn.Module, replay: nn.Module | None, device):
    """`model`'s modules in eager construction order; with `replay`, its modules by name,
    each one `model` lacks as a throwaway copy that draws the same random numbers."""
    if replay is None:
        yield from model.modules()
        return
    held = dict(model.named_modules())
    for name, module in replay.named_modules():
        if name in held:
            yield held[name]
        elif any(p is not None for p in module._parameters.values()):
            _draw_like(module, device)


def _draw_like(module: nn.Module, device) -> None:
    """Run `module`'s own initialisation on a real copy of its parameters, thrown away."""
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        return
    twin = copy.copy(module)  # its own parameters, the rest shared: reset writes only those
    twin._parameters = {
        name: None if p is None else nn.Parameter(torch.empty_like(p, device=device))
        for name, p in module._parameters.items()
    }
    twin.reset_parameters()


def _units_device(model: nn.Module) -> torch.device:
    """Where the model's units keep their shards (the default process group's device when
    nothing is sharded)."""
    units = registry.units_below(model)
    return units[0].mesh.device if units else default_device()


def _swap_in_full_tensors(module: nn.Module, device, done: dict) -> dict:
    pending = {}
    for name, param in list(module._parameters.items()):
        if param is None or not ((registry.managed_of(param) is not None) or param.is_meta):
            continue
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        pending[name] = (param, full, id(param) not in done)
        module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
    return pending


def _keep(module: nn.Module, name: str, original, full: torch.Tensor, first: bool, done):
    """Put the initialised values where they belong; returns the parameter that holds them."""
    if registry.managed_of(original) is None:
        # not sharded: a new full-size parameter replaces the meta one (tied ones share it)
        value = module._parameters[name] if first else done[id(original)]
        module._parameters[name] = value
        return value
    if first:
        home = home_of(original)
        home.rows().copy_(home.spec.piece_of(full))
    module._parameters[name] = original
    return original
