"""Who owns what: the unit (what one `fully_shard` made) of a module, the unit and managed
parameter behind a sharded DTensor, the sharded replacement of an original parameter, and
the parameters expert parallelism split.

The one place these links live (weak, by identity: nothing here keeps a module or tensor
alive), so no code reads private attributes set elsewhere. A unit refers to its modules
and parameters, so the links to it are weak too (a weak key whose value led back to it
would keep it forever: a model deleted would keep its device memory); each module holds
its unit through its hooks, which keeps the unit alive exactly as long as the module.
A leaf: it imports nothing of flatshard, so every layer may ask it.
`flatshard.state(module)` and `flatshard.units(model)` are its public face.
"""

from __future__ import annotations

import contextlib
import weakref

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_UNIT_OF_MODULE = WeakIdKeyDictionary()  # module -> weakref of its unit
_MANAGED = WeakIdKeyDictionary()  # sharded DTensor -> weakrefs of (unit, ManagedParam)
_REPLACED_BY = WeakIdKeyDictionary()  # original parameter -> its sharded replacement
_EXPERT_PARALLEL = WeakIdKeyDictionary()  # parameters an EP style split
_SUBCLASS_SHARDS = WeakIdKeyDictionary()  # sharded tensor-subclass params (subclass_params.py)
_ACTIVATION_OFFLOAD = WeakIdKeyDictionary()  # block -> its runtime.ActivationOffload
_STATES_AWAY = WeakIdKeyDictionary()  # model -> what flatshard.offload_states moved


def bind_unit(module: nn.Module, unit) -> None:
    _UNIT_OF_MODULE[module] = weakref.ref(unit)


def unit_of(module: nn.Module):
    """The unit `module` belongs to (a fully_shard-ed module, or a member of a list or
    first-use group); None if none."""
    return _alive(_UNIT_OF_MODULE.get(module))


def units_below(module: nn.Module) -> list:
    """Every unit of `module` and the modules below it, each once, in `modules()` order."""
    found: dict[int, object] = {}
    for sub in module.modules():
        unit = _alive(_UNIT_OF_MODULE.get(sub))
        if unit is not None:
            found.setdefault(id(unit), unit)
    return list(found.values())


def bind_param(sharded, unit, managed) -> None:
    _MANAGED[sharded] = (weakref.ref(unit), weakref.ref(managed))


def managed_of(param):
    """(unit, ManagedParam) of a sharded parameter; None for any other tensor (or one whose
    model is gone)."""
    refs = _MANAGED.get(param)
    if refs is None:
        return None
    unit, managed = refs[0](), refs[1]()
    return None if unit is None or managed is None else (unit, managed)


def mark_replaced(original, replacement) -> None:
    _REPLACED_BY[original] = replacement


def replacement_of(param):
    """The sharded parameter that replaced `param` (None: it was not replaced)."""
    return _REPLACED_BY.get(param)


def mark_subclass_shard(param) -> None:
    """`param` is a sharded parameter whose tensor subclass gathers itself."""
    _SUBCLASS_SHARDS[param] = True


def sharded_by_flatshard(param) -> bool:
    """Whether `param` is one of flatshard's sharded parameters, of either kind."""
    return param in _SUBCLASS_SHARDS or managed_of(param) is not None


def mark_expert_parallel(param) -> None:
    """`param` was split by expert parallelism: its ranks train on different tokens."""
    _EXPERT_PARALLEL[param] = True


def is_expert_parallel(param) -> bool:
    return param in _EXPERT_PARALLEL


def bind_activation_offload(module: nn.Module, offload) -> None:
    _ACTIVATION_OFFLOAD[module] = offload


def activation_offload_of(module: nn.Module):
    """The ActivationOffload of a block whose saved activations go to the host; None if not."""
    return _ACTIVATION_OFFLOAD.get(module)


def bind_states_away(model: nn.Module, away) -> None:
    _STATES_AWAY[model] = away


def take_states_away(model: nn.Module):
    """What `flatshard.offload_states` moved off `model`'s device (None: nothing), forgotten."""
    return _STATES_AWAY.pop(model, None)


def states_away_of(model: nn.Module):
    return _STATES_AWAY.get(model)


def _alive(ref):
    return None if ref is None else ref()


_SHAPE_INFERENCE = [False]  # a list: read at each forward (dynamo guards on its value)


@contextlib.contextmanager
def shape_inference():
    """Inside: forwards that run only so that torch learns their outputs' shapes (a pipeline
    stage's first, on its first micro-batch or on empty tensors), which modules counting
    what their training forwards see (MoE routers) leave out."""
    _SHAPE_INFERENCE[0] = True
    try:
        yield
    finally:
        _SHAPE_INFERENCE[0] = False


def in_shape_inference() -> bool:
    return _SHAPE_INFERENCE[0]
