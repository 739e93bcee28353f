"""`FlatShardModule`: the methods a `fully_shard`-ed module gains. It is a subclass of
PyTorch's `torch.distributed.fsdp.FSDPModule` with every one of its methods, so code that
finds FSDP units with `isinstance(m, FSDPModule)` (torchtitan, accelerate, Lightning)
finds flatshard's too and reaches flatshard's state, never FSDP2's."""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from flatshard import registry
from flatshard.api.comm_settings import CommSettings
from flatshard.errors import WrappingError
from flatshard.runtime import hooks, shard_placement
from flatshard.runtime.sharded_lookup import embedding_forward
from flatshard.runtime.states import ShardedState
from flatshard.runtime.unit import Unit


class FlatShardModule(CommSettings, FSDPModule, nn.Module):
    """Methods a `fully_shard`-ed module gains: FSDP2's `FSDPModule` ones (its
    communication settings in fsdp_comm_settings.py)."""

    # FSDPModule.__new__ (indexing a wrapped container builds a new one) constructs the
    # original class, found at this index of the wrapped class's MRO:
    # [FlatShard<Orig>, FlatShardModule, CommSettings, FSDPModule, Orig, ...]
    _orig_cls_mro_index = 4

    def unshard(self, async_op: bool = False):
        """Gather this module's parameters (a root's: also its first-use groups, as FSDP2's
        root group holds them); once gathered (now, or with `async_op` when the returned
        handle is waited on) the unsharded parameters are registered on the modules, as
        FSDP2's (`reshard()` registers the sharded ones again). Not recursive."""
        units = self._own_units()
        for unit in units:
            unit.unshard(async_op=async_op)
        handle = _UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters; the sharded ones are registered again."""
        for unit in self._own_units():
            unit.reshard()

    def _own_units(self) -> list[Unit]:
        """This module's unit and the first-use groups made of its children (api.py): the
        parameters FSDP2's group of this module would hold."""
        unit = registry.unit_of(self)
        groups = {
            registry.unit_of(m)
            for m in self.modules()
            if isinstance(m, FlatShardModule) and registry.unit_of(m).first_use_of is self
        }
        return [unit, *sorted(groups - {unit}, key=lambda u: u.created)]

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
        registry.unit_of(self).forward_prefetch = [_require_unit(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FlatShardModule]) -> None:
        registry.unit_of(self).backward_prefetch = [_require_unit(m) for m in modules]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not gather this unit's parameters (its backward does not
        read them, e.g. an embedding's); gradients are still reduced."""
        registry.unit_of(self).unshard_in_backward = unshard_in_backward

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
        registry.unit_of(self).post_optim_event = event

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted: flatshard's gathers are always asynchronous, waited for where used."""

    def reset_iter_state(self) -> None:
        """After `forward()` or `backward()` raised: wait for collectives in flight, drop
        the failed iteration's gradients (those held for accumulation too) and reshard
        every unit, so that the next iteration runs normally. Call it on the root."""
        unit = registry.unit_of(self)
        if unit.context is not None and unit.context.root is not unit:
            raise RuntimeError(
                "reset_iter_state() must be called on the root module (the one whose "
                f"forward runs first), not on {type(self).__name__}"
            )
        hooks.reset_iteration(unit)

    def _get_fsdp_state(self):
        raise NotImplementedError(
            f"{type(self).__name__} is sharded by flatshard, which keeps no FSDP2 FSDPState; "
            "use the FSDPModule methods (set_requires_gradient_sync, unshard, ...) instead"
        )

    def _units(self, recurse: bool) -> list[Unit]:
        if not recurse:
            return [registry.unit_of(self)]
        return registry.units_below(self)

    def __deepcopy__(self, memo):
        raise WrappingError(
            f"deepcopy of a fully_shard-ed {type(self).__name__} is not supported (its "
            "parameters are views of shared flat buffers and hooks): copy the model before "
            "fully_shard, or save it and load the copy (flatshard.checkpoint)"
        )

    def _apply(self, fn, recurse=True):
        # `to_empty()`, `.to()` etc. must not replace the sharded parameters: they are views
        # of flat buffers. The unit converts its shards itself (allocates them when on meta,
        # changes their dtype); the conversion runs over everything else with them hidden,
        # and each module gets its parameters back in their order (an optimizer state
        # loaded by position must find the same parameters).
        self.reshard()
        unit = registry.unit_of(self)
        shard_placement.convert(unit, fn)
        below = set(self.modules())
        orders, hidden = {}, {}
        for param in unit.params:
            for module, name in param.occurrences:
                if module in below:  # a unit over several modules: each hides its own
                    orders.setdefault(module, list(module._parameters))
                    hidden[(module, name)] = module._parameters.pop(name)
        try:
            return super(FSDPModule, self)._apply(fn, recurse)
        finally:
            for module, order in orders.items():
                params = module._parameters
                ordered = {name: hidden.get((module, name), params.get(name)) for name in order}
                params.clear()
                params.update(ordered)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` (e.g. `generate`) gather and release parameters like
    `forward` does, as FSDP2's function of the same name; a no-op on a module that is not
    fully_shard-ed."""
    if not isinstance(module, FlatShardModule):
        return
    unit = registry.unit_of(module)
    method = getattr(module, method_name)

    @functools.wraps(method)
    def with_hooks(*args, **kwargs):
        args, kwargs = hooks.pre_forward(unit, args, kwargs)
        return hooks.post_forward(unit, method(*args, **kwargs))

    setattr(module, method_name, with_hooks)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's function of the same name (pipeline stages: several roots share CUDA streams).
    Checked as FSDP2 checks it; flatshard's roots issue collectives on the current stream
    and share no buffers across roots, so there is nothing else to share."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")


def weights_changed(model: nn.Module) -> None:
    """Make every unit gather again before its next use. In-place writes to the sharded
    weights are noticed on their own (version counters); this is for writes that bypass
    autograd's version tracking (e.g. through `.data` or raw storage)."""
    for module in model.modules():
        if isinstance(module, FlatShardModule):
            registry.unit_of(module).mark_stale()


class _UnshardHandle(UnshardHandle):
    def __init__(self, units: list[Unit]):
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            unit.wait_unshard()
            if unit.sharded_state is ShardedState.UNSHARDED:  # not freed since by a forward
                unit.make_unsharded_params()
                unit.register("unsharded")


def _require_unit(module) -> Unit:
    if not isinstance(module, FlatShardModule):
        raise WrappingError(f"{type(module).__name__} is not fully_shard-ed; prefetch needs units")
    return registry.unit_of(module)


_CLASS_CACHE: dict[type, type] = {}


def wrapped_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        plain_embedding = issubclass(cls, nn.Embedding) and cls.forward is nn.Embedding.forward
        methods = {"forward": embedding_forward} if plain_embedding else {}
        _CLASS_CACHE[cls] = type(f"FlatShard{cls.__name__}", (FlatShardModule, cls), methods)
    return _CLASS_CACHE[cls]


def own_class(module: nn.Module) -> type:
    """The module's class before fully_shard put a FlatShard subclass in front of it."""
    if isinstance(module, FlatShardModule):
        return type(module).__mro__[FlatShardModule._orig_cls_mro_index]
    return type(module)
