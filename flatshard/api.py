"""`fully_shard`: wrap a module's parameters into flat, row-aligned, sharded buckets.

Called bottom-up like PyTorch FSDP2 (blocks first, then the root). Afterwards every
managed parameter is an `nn.Parameter(DTensor)` on the mesh, `Shard(0)`, whose local tensor
is a view of the unit's sharded main-weight buffer; the module's class gains the
`FlatShardModule` methods (fsdp_module.py).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from flatshard import agreement, load_hooks, registry
from flatshard.dtensor import patches
from flatshard.dtensor.tp_params import onto_tp_mesh, tp_param_info, tp_placement
from flatshard.errors import LayoutError, WrappingError
from flatshard.fsdp_module import FlatShardModule, wrapped_class
from flatshard.layout import ParamInfo, declared_components, plan_unit_layout
from flatshard.layout.offload import needs_bucket_per_param
from flatshard.mesh import ShardMesh, split_spmd_mesh
from flatshard.policy import (
    MixedPrecisionPolicy,
    as_mixed_precision,
    as_offload,
    forward_group_size,
    resolve_zero_stage,
)
from flatshard.runtime.first_use import first_use_groups
from flatshard.runtime.flat_bucket import FlatBucket
from flatshard.runtime.hooks import attach
from flatshard.runtime.offload import place as offload_pieces
from flatshard.runtime.shard_placement import sharded_parameter
from flatshard.runtime.states import Resharding
from flatshard.runtime.unit import ManagedParam, Unit


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy=None,
    ignored_params: set[nn.Parameter] | None = None,
    zero_stage: int | None = None,
    dp_mesh_dims=None,
):
    """Shard `module`'s parameters (those not already managed by an inner `fully_shard`).

    module: a module, or a list of modules that become one unit (gathered and reduced
        together, e.g. torchtitan's `[tok_embeddings, norm, output]`).
    reshard_after_forward: True (default) is ZeRO-3, False is ZeRO-2; an int n (hpZ, a
        divisor of the shard group's size, e.g. the ranks of a node) stays sharded over n
        consecutive ranks after forward, so that backward gathers inside that group.
    zero_stage: 1, 2 or 3, the same choice by name; 1 also keeps gradients unsharded
        between optimizer steps (only the optimizer state and main weights are sharded).
    mp_policy: mixed precision, as in FSDP2 (param_dtype, reduce_dtype, output_dtype).
    shard_placement_fn: as FSDP2's: `Shard(d)` (any dim of the parameter) or None (rows).
    offload_policy: `flatshard.OffloadPolicy(fraction=f)` keeps a fraction f of each rank's
        main weights, gradients and optimizer state on the host (chosen over every unit
        below `module`: shard the root with the same policy); FSDP2's `OffloadPolicy()`
        (none) and `CPUOffloadPolicy()` (all) are accepted.
    ignored_params: parameters left alone: not sharded, not reduced.
    dp_mesh_dims: FSDP2's `DataParallelMeshDims`: `mesh` is the whole SPMD mesh, these of
        its dims are data-parallel (shard, replicate), the parameters are DTensors on it
        (`Replicate` over those dims; a remaining dim is tensor parallelism).
    On a model root (a module some of whose children are already units), each run of
    consecutive children holding no unit, e.g. [embedding] and [norm, output head], gets a
    unit of its own with the same settings, gathered on first use (`runtime/first_use.py`).
    Returns `module` (the list for a list), whose class now also derives from
    `FlatShardModule`.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for each in modules:
        _check_module(each)
    if dp_mesh_dims is not None and mesh is not None:
        onto_tp_mesh(modules, mesh, split_spmd_mesh(mesh, dp_mesh_dims)[1])
    mesh = ShardMesh.resolve(mesh, dp_mesh_dims)
    group_size = forward_group_size(reshard_after_forward, mesh.shard_size)
    if reshard_after_forward == 1 and not isinstance(reshard_after_forward, bool):
        reshard_after_forward = False  # one rank keeps it all: no resharding
    stage = resolve_zero_stage(zero_stage, reshard_after_forward)
    policy = as_mixed_precision(mp_policy)
    offload = as_offload(offload_policy)
    settings = (stage, policy, group_size if stage == 3 else None, offload)
    patches.install()
    mesh = mesh.joined(*_inner_mesh(modules))
    ignored = {id(p) for p in ignored_params or ()}
    if len(modules) == 1:
        for members in first_use_groups(module):
            _shard(members, mesh, settings, module, ignored, shard_placement_fn)
    members = [("", modules[0])] if len(modules) == 1 else [
        (f"[{i}].", each) for i, each in enumerate(modules)
    ]  # fmt: skip
    _shard(members, mesh, settings, None, ignored, shard_placement_fn)
    if offload.offloads:
        offload_pieces(modules, offload)
    return module


def _check_module(module) -> None:
    if not isinstance(module, nn.Module):
        raise WrappingError(f"fully_shard takes a module or a list of modules, got {module!r}")
    if isinstance(module, FlatShardModule):
        raise WrappingError(
            f"{type(module).__name__} is already fully_shard-ed; call fully_shard once per "
            "module (inner blocks first, then the root)"
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and (
        type(module).forward is nn.Module.forward
    ):
        raise WrappingError(
            f"fully_shard needs a module whose forward runs its parameters; a "
            f"{type(module).__name__} has no forward. Shard each of its modules, or pass "
            "them as a list: fully_shard(list(container))"
        )


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


def _shard(members, mesh, settings, first_use_of, ignored, shard_placement_fn) -> Unit:
    """One unit over the parameters below `members` [(fqn prefix, module)] that no inner
    unit manages; its hooks go on every member. settings: (ZeRO stage, mixed precision,
    hpZ group size)."""
    stage, policy, group_size, offload = settings
    if group_size is not None:
        mesh.forward_group(group_size)  # every rank creates the groups here, together
    found = [entry for entry in _collect_params(members) if id(entry[1]) not in ignored]
    shard_dims = _shard_dims(shard_placement_fn, found)
    problem = _check_params(found)
    names = "+".join(type(m).__name__ for _, m in members)
    # Ranks that build different models would crash (or hang) in the first collective:
    # one tiny all-gather per group checks the problems above and the unit's layout.
    described = (names, [_describe_param(fqn, p) for fqn, p, _ in found])
    for group in (mesh.shard_group, mesh.replicate_group):
        agreement.agree_on(problem, described, group, WrappingError, _model_differences)

    rank, world_size = mesh.shard_rank, mesh.shard_size
    infos = [
        _param_info(fqn, p, places, dim) for (fqn, p, places), dim in zip(found, shard_dims)
    ]
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
                fqn, occurrences, bucket_index, index, sharded, tp_placement=placement,
                shard_dim=bucket.specs[index].info.shard_dim,
            )  # fmt: skip
        )
        _retire(original, sharded)

    modules = [m for _, m in members]
    resharding = Resharding.for_stage(stage)
    resharding.forward_group_size = group_size
    unit = Unit(modules, mesh, layout, buckets, managed, resharding, policy, first_use_of, offload)
    for param in managed:
        registry.bind_param(param.sharded, unit, param)
        for owner, name in param.occurrences:
            owner._parameters[name] = param.sharded
    for module in modules:
        registry.bind_unit(module, unit)
        module.__class__ = wrapped_class(type(module))
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


def _inner_mesh(modules):
    """(mesh, is expert-parallel) of the tensor- or expert-parallel DTensor parameters below
    `modules` (made by a `ParallelStyle`; those of inner units included). A root's
    embedding and head, which TP does not split, join an inner unit's TP mesh too
    (`Replicate` over it): every parameter of a TP model lives on one mesh, as one
    optimizer's foreach math and gradient clipping want. An inner unit of experts (EP)
    does not make its parent's dense parameters expert-parallel."""
    meshes, splits = [], set()
    for module in modules:
        for sub in module.modules():
            unit = registry.unit_of(sub)
            if unit is not None and unit.mesh.tp_mesh is not None:
                meshes.append(unit.mesh.tp_mesh)
                splits.add(False)
            for param in sub._parameters.values():
                if isinstance(param, DTensor) and registry.managed_of(param) is None:
                    meshes.append(param.device_mesh)
                    splits.add(registry.is_expert_parallel(param))
    # torch may hand out equal sub-meshes as different objects: compare their ranks
    if len({(tuple(m.mesh.flatten().tolist()), m.mesh_dim_names) for m in meshes}) > 1 or (
        len(splits) > 1
    ):
        found = sorted({str(m) for m in meshes})
        raise WrappingError(
            f"the module's parameters are DTensors on different meshes or styles ({found}); "
            "one fully_shard unit takes one tensor- or expert-parallel mesh (shard a "
            "module's experts in a unit of their own, e.g. fully_shard(block.mlp.experts, "
            "mesh=mesh['efsdp']) before the block)"
        )
    return (meshes[0] if meshes else None), bool(splits and splits.pop())


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
            managed = (registry.replacement_of(param) or param)
            if (registry.managed_of(managed) is not None):
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
            if child is not None and not isinstance(child, FlatShardModule)
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
        subclass = _tensor_subclass(param)
        if subclass is not None:
            return (
                f"parameter {fqn!r} is a {subclass} (a tensor subclass); flatshard keeps "
                "parameters in flat buckets of plain tensors and does not run the "
                "tensor-subclass all-gather (fsdp_pre_all_gather) yet: keep it a plain "
                "tensor, or leave it out with ignored_params"
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
