"""`fully_shard`: wrap a module's parameters into flat, row-aligned, sharded buckets.

Called bottom-up like PyTorch FSDP2 (blocks first, then the root). Afterwards every
managed parameter is an `nn.Parameter(DTensor)` on the mesh, `Shard(0)`, whose local tensor
is a view of the unit's sharded main-weight buffer; the module's class gains the
`FlatShardModule` methods (fsdp_module.py).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from flatshard import registry
from flatshard.api.fsdp_module import FlatShardModule, wrapped_class
from flatshard.comm import peer_failure
from flatshard.dtensor import patches
from flatshard.dtensor.tp_params import onto_tp_mesh
from flatshard.errors import WrappingError
from flatshard.policy import (
    MixedPrecisionPolicy,
    as_mixed_precision,
    as_offload,
    forward_group_size,
    resolve_zero_stage,
)
from flatshard.runtime.build_unit import UnitSettings, build_unit
from flatshard.runtime.first_use import first_use_groups
from flatshard.runtime.offload import place as offload_pieces
from flatshard.shard_mesh import ShardMesh, split_spmd_mesh


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
    offload = as_offload(offload_policy)
    settings = UnitSettings(
        zero_stage=stage,
        mp_policy=as_mixed_precision(mp_policy),
        offload=offload,
        forward_group=group_size if stage == 3 else None,
        shard_placement_fn=shard_placement_fn,
        ignored=frozenset(id(p) for p in ignored_params or ()),
    )
    patches.install()
    peer_failure.install()
    mesh = mesh.joined(*_inner_mesh(modules))
    if len(modules) == 1:
        for members in first_use_groups(module):
            _wrap(build_unit(members, mesh, settings, first_use_of=module))
    members = [("", modules[0])] if len(modules) == 1 else [
        (f"[{i}].", each) for i, each in enumerate(modules)
    ]  # fmt: skip
    _wrap(build_unit(members, mesh, settings))
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


def _wrap(unit) -> None:
    """Each module of the unit gains the FSDPModule methods (its class is swapped)."""
    for module in unit.modules:
        module.__class__ = wrapped_class(type(module))


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
                if isinstance(param, DTensor) and not registry.sharded_by_flatshard(param):
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
