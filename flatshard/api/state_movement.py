"""Move a sharded model's training state off the device and back, in place.

Reinforcement-learning trainers share their GPUs with an inference engine: between
rollouts the parameters, gradients and optimizer state must leave device memory. Each
storage moves whole (a bucket's shard is one, its gradient shard another; an optimizer
state tensor its own) into a host copy, pinned on CUDA and copied asynchronously, and the
device storage is resized to zero: the DTensors, their views and the optimizer's references
stay the same objects, so after `reload_states` training goes on bitwise as before. While
the state is away, a forward, an optimizer step and a state dict refuse with one line.
Pieces already on the host (optimizer offload, the disk tier) stay where they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatshard import comm, registry
from flatshard.dtensor.sharded_param import local_data
from flatshard.errors import StatesOffloadedError, WrappingError
from flatshard.runtime.managed_param import home_of
from flatshard.runtime.states import TrainingState

INCLUDE = ("params", "grads", "optimizer")


@dataclass
class _Away:
    moved: list[tuple[torch.UntypedStorage, torch.Tensor]]  # device storage, its host bytes
    units: list
    hooks: list = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        return sum(host.numel() for _, host in self.moved)


def offload_states(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    include=INCLUDE,
    pin_memory: bool = True,
) -> int:
    """Move `include` of a model flatshard sharded (and of `optimizer`'s state for it) to
    host memory and release the device memory; returns the bytes moved."""
    include = _checked(include, optimizer)
    if registry.states_away_of(model) is not None:
        raise StatesOffloadedError(
            "offload_states: the states are on the host already; reload_states first"
        )
    units = registry.units_below(model)
    if not units:
        raise WrappingError(
            "offload_states takes a model flatshard sharded (fully_shard or parallelize)"
        )
    busy = [u for u in units if u.training_state is not TrainingState.IDLE]
    if busy:
        raise StatesOffloadedError(
            "offload_states: a forward or backward is running; call it between steps"
        )
    for unit in units:
        unit.reshard()  # the gathered copies are gathered again after reload
    storages = _device_storages(model, units, optimizer, include)
    away = _Away([(s, comm.storage_to_host(s, pin_memory)) for s in storages], units)
    done = comm.host_copies_done()
    if done is not None:
        done.synchronize()
    for storage, _ in away.moved:
        storage.resize_(0)
    comm.release_device_memory(units[0].mesh.device)
    if {"params", "grads"} & set(include):
        for unit in units:
            unit.states_away = True
    away.hooks = _refusing_hooks(model, optimizer)
    registry.bind_states_away(model, away)
    return away.host_bytes


def reload_states(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bring back what `offload_states` moved, into the same tensors; returns the bytes
    (0: nothing was away). `optimizer` is accepted for symmetry: everything moved returns."""
    away = registry.take_states_away(model)
    if away is None:
        return 0
    for storage, host in away.moved:
        comm.storage_from_host(storage, host)
    for unit in away.units:
        unit.states_away = False
    for hook in away.hooks:
        hook.remove()
    return away.host_bytes


def _checked(include, optimizer) -> tuple[str, ...]:
    include = (include,) if isinstance(include, str) else tuple(include)
    unknown = [name for name in include if name not in INCLUDE]
    if unknown or not include:
        raise ValueError(f"offload_states include={include!r}: use some of {INCLUDE}")
    if "optimizer" in include and optimizer is None and include != INCLUDE:
        raise ValueError("offload_states: include='optimizer' needs the optimizer")
    return include


def _device_storages(model, units, optimizer, include) -> list[torch.UntypedStorage]:
    device = units[0].mesh.device
    tensors = []
    for unit in units:
        for bucket in unit.buckets:
            if "params" in include:
                tensors.append(bucket.shard.main)
            if "grads" in include:
                tensors += bucket.gradient_buffers()
    unmanaged = [p for p in model.parameters() if registry.managed_of(p) is None]
    for param in unmanaged:
        if "params" in include:
            tensors.append(param.data)
        if "grads" in include and param.grad is not None:
            tensors.append(param.grad)
    if "optimizer" in include and optimizer is not None:
        tensors += _optimizer_tensors(optimizer)
    unique: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        local = local_data(tensor) if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if local.device == device and storage.nbytes() > 0:
            unique.setdefault(storage.data_ptr(), storage)
    return list(unique.values())


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The state tensors of every parameter whose piece is on the device (a step count, a
    0-dim tensor, stays: the step reads it on the host)."""
    found = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            home = home_of(param)
            if home is not None and home.on_host:
                continue
            values = optimizer.state.get(param, {}).values()
            found += [v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0]
    return found


def _refusing_hooks(model, optimizer) -> list:
    def refuse(*_, **__):
        raise StatesOffloadedError(
            "the training state is on the host (flatshard.offload_states): call "
            "flatshard.reload_states(model, optimizer) first"
        )

    hooks = [
        model.register_state_dict_pre_hook(refuse),
        model.register_load_state_dict_pre_hook(refuse),
    ]
    if optimizer is not None:
        hooks += [
            optimizer.register_step_pre_hook(refuse),
            optimizer.register_state_dict_pre_hook(refuse),
            optimizer.register_load_state_dict_pre_hook(refuse),
        ]
    return hooks
