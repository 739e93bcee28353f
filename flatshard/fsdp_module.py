"""`FlatShardModule`: the methods a `fully_shard`-ed module gains, as FSDP2's `FSDPModule`
(unshard, reshard, gradient sync, resharding, prefetch, divide factor)."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from flatshard.errors import WrappingError
from flatshard.runtime import hooks, shard_placement
from flatshard.runtime.sharded_lookup import embedding_forward
from flatshard.runtime.unit import Unit


class FlatShardModule(nn.Module):
    """Methods a `fully_shard`-ed module gains (the `FSDPModule` ones that apply here)."""

    _flatshard_unit: Unit

    def unshard(self, async_op: bool = False):
        """Gather this unit's parameters now; with `async_op`, return a handle to `wait()` on."""
        unit = self._flatshard_unit
        unit.unshard(async_op=async_op)
        return _UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters."""
        self._flatshard_unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """False: keep accumulating unsharded gradients locally, with no communication."""
        for unit in self._units(recurse):
            unit.grads.requires_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        """HSDP: False keeps reduce-scattered gradients on this replica (accumulation
        without the replica all-reduce); the next sync with True sums them over replicas."""
        for unit in self._units(recurse):
            unit.grads.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        for unit in self._units(recurse):
            unit.resharding.after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True):
        for unit in self._units(recurse):
            unit.resharding.after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[FlatShardModule]) -> None:
        self._flatshard_unit.forward_prefetch = [_require_unit(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FlatShardModule]) -> None:
        self._flatshard_unit.backward_prefetch = [_require_unit(m) for m in modules]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not gather this unit's parameters (its backward does not
        read them, e.g. an embedding's); gradients are still reduced."""
        self._flatshard_unit.unshard_in_backward = unshard_in_backward

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce gradients with SUM and divide afterwards, never the collective's AVG."""
        for unit in self._units(recurse=True):
            unit.grads.force_sum = enable

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 scripts (pipeline schedules). flatshard finishes every
        reduction at the end of each backward anyway: False costs overlap, never results."""
        for unit in self._units(recurse=True):
            unit.is_last_backward = is_last_backward

    def set_post_optim_event(self, event) -> None:
        """The next forward's all-gathers wait for `event` (a CUDA event recorded after the
        optimizer step); nothing to wait for on the CPU."""
        self._flatshard_unit.post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by `factor` instead of the data-parallel world size."""
        if factor <= 0:
            raise WrappingError(f"gradient divide factor must be positive, got {factor}")
        for unit in self._units(recurse=True):
            unit.grads.divide_factor = float(factor)

    def _units(self, recurse: bool) -> list[Unit]:
        if not recurse:
            return [self._flatshard_unit]
        units = [m._flatshard_unit for m in self.modules() if isinstance(m, FlatShardModule)]
        return list(dict.fromkeys(units))  # a unit over several modules once

    def __deepcopy__(self, memo):
        raise WrappingError(
            f"deepcopy of a fully_shard-ed {type(self).__name__} is not supported (its "
            "parameters are views of shared flat buffers and hooks): copy the model before "
            "fully_shard, or save it and load the copy (flatshard.checkpoint)"
        )

    def _apply(self, fn, recurse=True):
        # `to_empty()`, `.to()` etc. must not replace the sharded parameters: they are views
        # of flat buffers. Hide them while the conversion runs over everything else, and
        # refuse a conversion that would change their dtype or device.
        _refuse_conversion(self._flatshard_unit, fn)
        below = set(self.modules())
        hidden = []
        for param in self._flatshard_unit.params:
            for module, name in param.occurrences:
                if module in below:  # a unit over several modules: each hides its own
                    hidden.append((module, name, module._parameters.pop(name)))
        try:
            return super()._apply(fn, recurse)
        finally:
            for module, name, value in reversed(hidden):
                module._parameters[name] = value


def _refuse_conversion(unit: Unit, fn) -> None:
    """A conversion that would change the shards' dtype or device is refused (the shards are
    views of flat buffers it would not reach); `to_empty` of a unit still on meta allocates
    its shards on the mesh's device."""
    for bucket in unit.buckets:
        probe = bucket.shard.main.new_empty(0)
        converted = fn(probe)
        if bucket.on_meta and isinstance(converted, torch.Tensor):
            if converted.dtype == probe.dtype and converted.device == unit.mesh.device:
                shard_placement.allocate(
                    unit, unit.mesh.device
                )  # to_empty of a model built on meta
                return
        if isinstance(converted, torch.Tensor) and (
            converted.dtype != probe.dtype or converted.device != probe.device
        ):
            raise WrappingError(
                f"converting a fully_shard-ed module to {converted.dtype} on "
                f"{converted.device} would leave its sharded parameters ({probe.dtype} on "
                f"{probe.device}) as they are. Convert the model before fully_shard (for the "
                "compute dtype use mp_policy=MixedPrecisionPolicy(param_dtype=...))."
            )


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` (e.g. `generate`) gather and release parameters like
    `forward` does, as FSDP2's function of the same name; a no-op on a module that is not
    fully_shard-ed."""
    if not isinstance(module, FlatShardModule):
        return
    unit = module._flatshard_unit
    method = getattr(module, method_name)

    @functools.wraps(method)
    def with_hooks(*args, **kwargs):
        args, kwargs = hooks.pre_forward(unit, args, kwargs)
        return hooks.post_forward(unit, method(*args, **kwargs))

    setattr(module, method_name, with_hooks)


def weights_changed(model: nn.Module) -> None:
    """Make every unit gather again before its next use. In-place writes to the sharded
    weights are noticed on their own (version counters); this is for writes that bypass
    autograd's version tracking (e.g. through `.data` or raw storage)."""
    for module in model.modules():
        if isinstance(module, FlatShardModule):
            module._flatshard_unit.mark_stale()


class _UnshardHandle:
    def __init__(self, unit: Unit):
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_unshard()


def _require_unit(module) -> Unit:
    if not isinstance(module, FlatShardModule):
        raise WrappingError(f"{type(module).__name__} is not fully_shard-ed; prefetch needs units")
    return module._flatshard_unit


_CLASS_CACHE: dict[type, type] = {}


def wrapped_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        plain_embedding = issubclass(cls, nn.Embedding) and cls.forward is nn.Embedding.forward
        methods = {"forward": embedding_forward} if plain_embedding else {}
        _CLASS_CACHE[cls] = type(f"FlatShard{cls.__name__}", (FlatShardModule, cls), methods)
    return _CLASS_CACHE[cls]
