"""Building one unit (what one `fully_shard` call, or one first-use group, makes): its
parameters collected and checked (the same on every rank), laid out, copied into flat
buckets, and replaced by sharded DTensors; its hooks attached.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from flatshard import registry
from flatshard.comm import agreement
from flatshard.dtensor.tp_params import tp_param_info, tp_placement
from flatshard.errors import LayoutError, WrappingError
from flatshard.layout import ParamInfo, declared_components, plan_unit_layout
from flatshard.layout.offload import needs_bucket_per_param
from flatshard.policy import MixedPrecisionPolicy, OffloadPolicy
from flatshard.runtime import load_hooks
from flatshard.runtime.flat_bucket import FlatBucket
from flatshard.runtime.hooks import attach
from flatshard.runtime.managed_param import ManagedParam
from flatshard.runtime.shard_placement import sharded_parameter
from flatshard.runtime.states import Resharding
from flatshard.runtime.subclass_params import SubclassGather, has_gather_protocol, problem_with
from flatshard.runtime.subclass_params import shard as shard_subclass_param
from flatshard.runtime.unit import Unit
from flatshard.shard_mesh import ShardMesh


@dataclass(frozen=True)
class UnitSettings:
    """What one `fully_shard` call decides for every unit it makes."""

    zero_stage: int
    mp_policy: MixedPrecisionPolicy
    offload: OffloadPolicy
    forward_group: int | None = None  # hpZ: ranks a ZeRO-3 unit stays sharded over
    shard_placement_fn: Callable | None = None  # FSDP2's: Shard(d) per parameter
    ignored: frozenset[int] = frozenset()  # ids of parameters left alone


def _shard_dims(shard_placement_fn, found) -> list[int]:
    """The dim each parameter's pieces split: FSDP2's `shard_placement_fn` gives `Shard(d)`
    (or None: rows, `Shard(0)`) per parameter."""
    if shard_placement_fn is None:
        return [0] * len(found)
    dims = []
    for fqn, param, _ in found:
        placement = shard_placement_fn(param)
        if placement is None:
            dims.append(0)
            continue
        if type(placement) is not Shard or not -param.dim() <= placement.dim < param.dim():
            raise NotImplementedError(
                f"shard_placement_fn gave {placement!r} for {fqn!r} (shape "
                f"{tuple(param.shape)}): flatshard takes Shard(d) for a dim d of the "
                "parameter, or None (Shard(0)); per-parameter meshes are not supported"
            )
        dims.append(placement.dim % param.dim())
    return dims


def build_unit(members, mesh: ShardMesh, settings: UnitSettings, first_use_of=None) -> Unit:
    """One unit over the parameters below `members` [(fqn prefix, module)] that no inner
    unit manages (and `settings.ignored` does not name); its hooks go on every member.
    `first_use_of`: the module whose fully_shard made this first-use group (None: that
    call's own unit)."""
    policy, offload, group_size = settings.mp_policy, settings.offload, settings.forward_group
    if group_size is not None:
        mesh.forward_group(group_size)  # every rank creates the groups here, together
    found = [e for e in _collect_params(members) if id(e[1]) not in settings.ignored]
    shard_dims = _shard_dims(settings.shard_placement_fn, found)
    problem = _check_params(found)
    names = "+".join(type(m).__name__ for _, m in members)
    # Ranks that build different models would crash (or hang) in the first collective:
    # one tiny all-gather per group checks the problems above and the unit's layout.
    described = (names, [_describe_param(fqn, p) for fqn, p, _ in found])
    for group in (mesh.shard_group, mesh.replicate_group):
        agreement.agree_on(problem, described, group, WrappingError, _model_differences)
    # parameters whose subclass decides its own all-gather stay out of the flat buckets
    protocol = [entry for entry in found if has_gather_protocol(entry[1])]
    if protocol:
        kept = [i for i, entry in enumerate(found) if not has_gather_protocol(entry[1])]
        found, shard_dims = [found[i] for i in kept], [shard_dims[i] for i in kept]

    rank, world_size = mesh.shard_rank, mesh.shard_size
    infos = [_param_info(fqn, p, places, dim) for (fqn, p, places), dim in zip(found, shard_dims)]
    layout = plan_unit_layout(infos, world_size, needs_bucket_per_param(offload.fraction))
    if found and layout.empty_ranks():
        # Legal (e.g. 8 experts over 64 ranks) but wasteful: say so, with the fix.
        warnings.warn(
            f"fully_shard({names}): at world size {world_size}, ranks "
            f"{_ranges(layout.empty_ranks())} hold none of its {layout.used_size} parameter "
            f"elements (padding {100 * layout.padding_fraction:.1f}%). Wrap a larger module "
            "or use fewer data-parallel ranks.",
            stacklevel=3,
        )
    on_meta = bool(found) and all(param.is_meta for _, param, _ in found)
    buckets = [
        FlatBucket(
            bucket_layout,
            rank,
            mesh.shard_group,
            # a model built on meta stays there until to_empty / materialize, as FSDP2's
            torch.device("meta") if on_meta else mesh.device,
            bucket_layout.dtype,
            *policy.dtypes_for(bucket_layout.dtype),
        )
        for bucket_layout in layout.buckets
    ]
    managed = []
    for position, (fqn, original, occurrences) in enumerate(found):
        bucket_index, slot = layout.locate(position)
        bucket = buckets[bucket_index]
        index = bucket.layout.slots.index(slot)
        if not original.is_meta:
            local = original._local_tensor if isinstance(original, DTensor) else original
            with torch.no_grad():
                bucket.shard.rows(index).copy_(bucket.specs[index].rows_of(local.detach()))
        placement = tp_placement(original)
        sharded = sharded_parameter(bucket, index, mesh, original.requires_grad, placement)
        managed.append(
            ManagedParam(
                fqn,
                occurrences,
                bucket_index,
                index,
                sharded,
                tp_placement=placement,
                shard_dim=bucket.specs[index].info.shard_dim,
            )  # fmt: skip
        )
        _retire(original, sharded)

    modules = [m for _, m in members]
    resharding = Resharding.for_stage(settings.zero_stage)
    resharding.forward_group_size = group_size
    unit = Unit(modules, mesh, layout, buckets, managed, resharding, policy, first_use_of, offload)
    if protocol:
        subclass = [shard_subclass_param(fqn, p, places, mesh) for fqn, p, places in protocol]
        unit.subclass = SubclassGather(subclass, mesh, modules[0], policy)
        if buckets:
            buckets[0].transport.subclass_bytes = unit.subclass
        for param, (_, original, _) in zip(subclass, protocol):
            for owner, name in param.occurrences:
                owner._parameters[name] = param.sharded
            registry.mark_replaced(original, param.sharded)
            registry.mark_subclass_shard(param.sharded)
    for param in managed:
        registry.bind_param(param.sharded, unit, param)
        for owner, name in param.occurrences:
            owner._parameters[name] = param.sharded
    for module in modules:
        registry.bind_unit(module, unit)
        attach(unit, module)
        load_hooks.install(unit, module)
    return unit


def _param_info(fqn: str, param, places, shard_dim: int = 0) -> ParamInfo:
    """What the layout needs of a parameter: a TP DTensor's local piece, or the whole."""
    components = declared_components(*places[0], tuple(param.shape))
    if isinstance(param, DTensor):
        if shard_dim:
            raise NotImplementedError(
                f"shard_placement_fn gave Shard({shard_dim}) for the tensor-parallel "
                f"parameter {fqn!r}: flatshard shards TP pieces by rows (Shard(0))"
            )
        return tp_param_info(fqn, param, components)
    try:
        return ParamInfo(
            fqn, tuple(param.shape), param.dtype, param.requires_grad, components,
            shard_dim=shard_dim,
        )  # fmt: skip
    except LayoutError as error:
        raise NotImplementedError(str(error)) from error


def _ranges(ranks) -> str:
    ranks = list(ranks)
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 3 else str(ranks)


def _collect_params(members):
    """[(fqn, param, [(module, attr), ...])] for the params this unit manages: every param
    below the members that no inner unit manages, tied params once with all their places."""
    found: dict[int, tuple[str, nn.Parameter, list]] = {}
    stack = list(reversed(members))
    while stack:
        prefix, module = stack.pop()
        for name, param in module._parameters.items():
            if param is None:
                continue
            fqn = prefix + name
            replacement = registry.replacement_of(param)
            managed = param if replacement is None else replacement
            if registry.managed_of(managed) is not None:
                owner = registry.managed_of(managed)[0]
                raise WrappingError(
                    f"parameter {fqn!r} is shared with a parameter that the fully_shard unit "
                    f"of {type(owner.modules[0]).__name__} already manages (tied weights). "
                    "Tied parameters must live in one unit: do not fully_shard the "
                    "submodule holding one of them on its own."
                )
            if id(param) in found:
                found[id(param)][2].append((module, name))
            else:
                found[id(param)] = (fqn, param, [(module, name)])
        children = [
            (f"{prefix}{name}.", child)
            for name, child in module._modules.items()
            if child is not None and registry.unit_of(child) is None  # an inner unit's
        ]
        stack.extend(reversed(children))
    return list(found.values())


def _check_params(found) -> str | None:
    devices = {p.device for _, p, _ in found if not p.is_meta}
    if len(devices) > 1:
        return (
            f"one unit mixes parameters on devices {sorted(map(str, devices))}; move the "
            "module to one device (or the meta device) before fully_shard"
        )
    for fqn, param, _ in found:
        if has_gather_protocol(param):
            problem = problem_with(fqn, param)
            if problem:
                return problem
            continue
        subclass = _tensor_subclass(param)
        if subclass is not None:
            return (
                f"parameter {fqn!r} is a {subclass} (a tensor subclass); flatshard keeps "
                "parameters in flat buckets of plain tensors, and this subclass does not "
                "define FSDP2's all-gather protocol (fsdp_pre_all_gather and "
                "fsdp_post_all_gather): keep it a plain tensor, or leave it out with "
                "ignored_params"
            )
        if not torch.is_floating_point(param):
            return (
                f"parameter {fqn!r} has dtype {param.dtype}; only floating-point parameters shard"
            )
        if param.dim() == 0:
            return f"parameter {fqn!r} is 0-dimensional; make it shape (1,) to shard it"
    return None


def _tensor_subclass(param) -> str | None:
    """The class name of a parameter that is a tensor subclass (a DTensor's local tensor
    counts; DTensor itself, from tensor parallelism, does not)."""
    tensor = param._local_tensor if isinstance(param, DTensor) else param
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return None
    return type(tensor).__name__


def _describe_param(fqn: str, param) -> tuple:
    """What every rank must agree on about a parameter it shards."""
    dtype = str(param.dtype).removeprefix("torch.")
    return (fqn, tuple(param.shape), dtype, bool(param.requires_grad))


def _model_differences(described: list) -> str:
    """The first difference between rank 0's unit and another rank's, as a sentence."""

    def say(param, with_name: bool) -> str:
        if param is None:
            return "missing"
        fqn, shape, dtype, requires_grad = param
        text = f"{shape} {dtype}" + ("" if requires_grad else " frozen")
        return f"{fqn!r} {text}" if with_name else text

    names0, params0 = described[0]
    fix = (
        ". Every rank must build the same model (names, shapes, dtypes) and call fully_shard "
        "on the same modules in the same order"
    )
    for rank, (names, params) in enumerate(described[1:], start=1):
        unit = f"fully_shard({names0})" if names == names0 else (
            f"fully_shard({names0}) on rank 0, fully_shard({names}) on rank {rank}"
        )  # fmt: skip
        for index in range(max(len(params0), len(params))):
            a = params0[index] if index < len(params0) else None
            b = params[index] if index < len(params) else None
            if a == b:
                continue
            if a is not None and b is not None and a[0] == b[0]:
                what = f"parameter {a[0]!r} is {say(a, False)} on rank 0 but {say(b, False)}"
            else:
                what = f"parameter #{index} is {say(a, True)} on rank 0 but {say(b, True)}"
            what += f" on rank {rank}"
            return f"ranks disagree on the module being sharded ({unit}): {what}{fix}"
        if names != names0:
            return f"ranks disagree on the module being sharded ({unit}){fix}"
    return "ranks disagree on the module being sharded" + fix


def _retire(original: nn.Parameter, replacement: nn.Parameter) -> None:
    """Free the unsharded original and mark it, so an optimizer built on it is caught."""
    registry.mark_replaced(original, replacement)
    if not original.is_meta and not isinstance(original, DTensor):
        original.data = torch.empty(0, dtype=original.dtype, device=original.device)
