"""A tensor-parallel DTensor parameter (made by `parallelize_module`) as the layout sees it:
its TP-local tensor, where that sits in the global tensor, and its TP placement.

Supported TP placements: `Replicate`, `Shard(d)` (column/row parallel) and, for a fused
parameter whose module declares its components, `_StridedShard(d, k)` over its k
components (each TP rank holds its share of every one: `[gate_r; up_r]`). A plain
`Shard(d)` across a fused parameter's components would give each TP rank a contiguous
block of the fused rows (at TP 2, all of gate on rank 0): refused, it pairs the wrong rows.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from flatshard import registry
from flatshard.errors import WrappingError
from flatshard.layout import ParamInfo, tp_block_info, tp_split_info


def tp_param_info(fqn: str, param: DTensor, components) -> ParamInfo:
    """The `ParamInfo` of this rank's TP-local piece of `param`; `components` are those its
    module declares for the global shape."""
    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1:
        raise WrappingError(
            f"parameter {fqn!r} is a DTensor on a {mesh.ndim}-D mesh; fully_shard composes "
            "with tensor parallelism over a 1-D TP mesh"
        )
    placement = placements[0]
    local = param._local_tensor
    global_shape = tuple(param.shape)
    if type(placement) is _StridedShard:
        dims = {c.dim for c in components}
        if dims != {placement.dim} or len(components) != placement.split_factor:
            raise WrappingError(
                f"parameter {fqn!r} is {placement} over TP, but its module declares "
                f"{len(components)} components along dims {sorted(dims)}: declare its "
                "fused parts (`fused_components`) so each TP rank's share is known"
            )
        info = tp_split_info(
            fqn,
            local.dtype,
            param.requires_grad,
            global_shape,
            components,
            mesh.get_local_rank(),
            mesh.size(),
        )
    elif type(placement) is Shard or type(placement) is Replicate:
        if type(placement) is Shard and any(c.dim == placement.dim for c in components):
            names = [c.name for c in components]
            raise WrappingError(
                f"parameter {fqn!r} fuses {names} along dim {placement.dim} and is "
                f"{placement} over TP: each TP rank would hold a contiguous block of the "
                "fused rows, pairing the wrong ones. Split it per component with "
                "flatshard.parallel.FusedColwiseParallel"
            )
        shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
        info = tp_block_info(
            fqn, local.dtype, param.requires_grad, global_shape, shape, offset, components
        )
    else:
        raise WrappingError(
            f"parameter {fqn!r} is {placement} over TP; fully_shard takes Shard, Replicate "
            "and _StridedShard (fused) TP parameters"
        )
    if tuple(local.shape) != info.shape:
        raise WrappingError(
            f"parameter {fqn!r}: its TP-local tensor has shape {tuple(local.shape)}, but "
            f"{placement} of {global_shape} over {mesh.size()} ranks gives {info.shape}"
        )
    return info


def tp_placement(param) -> object | None:
    """The TP placement of a DTensor parameter (None for a plain tensor)."""
    return param.placements[0] if isinstance(param, DTensor) else None


def onto_tp_mesh(modules, spmd_mesh, tp_mesh) -> None:
    """FSDP2's `dp_mesh_dims` flow: parameters that are DTensors on the whole SPMD mesh
    (`Replicate` over its data-parallel dims) become DTensors of the same local tensor on
    its tensor-parallel dim `tp_mesh` (plain tensors when there is none), the form
    `fully_shard` composes with. Tied parameters stay one."""
    done: dict[int, nn.Parameter] = {}
    dp_dims = [d for d, name in enumerate(spmd_mesh.mesh_dim_names) if tp_mesh is None or (
        name not in tp_mesh.mesh_dim_names)]  # fmt: skip
    for module in (m for each in modules for m in each.modules()):
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor) or registry.sharded_by_flatshard(param):
                continue
            if id(param) not in done:
                done[id(param)] = _on_tp_mesh(name, param, spmd_mesh, tp_mesh, dp_dims)
            module._parameters[name] = done[id(param)]


def _on_tp_mesh(name, param: DTensor, spmd_mesh, tp_mesh, dp_dims) -> nn.Parameter:
    if param.device_mesh.mesh.tolist() != spmd_mesh.mesh.tolist():
        raise WrappingError(
            f"parameter {name!r} is a DTensor on {param.device_mesh}, not on fully_shard's "
            f"mesh {spmd_mesh} (with dp_mesh_dims, parameters live on the whole mesh)"
        )
    placements = param.placements
    if any(not isinstance(placements[d], Replicate) for d in dp_dims):
        raise WrappingError(
            f"parameter {name!r} has placements {placements}: with dp_mesh_dims it must be "
            "Replicate() over the data-parallel dims, which fully_shard then shards"
        )
    local = param._local_tensor
    if tp_mesh is None:
        value = local
    else:
        tp_dim = spmd_mesh.mesh_dim_names.index(tp_mesh.mesh_dim_names[0])
        value = DTensor.from_local(
            local, tp_mesh, [placements[tp_dim]], run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip
    return nn.Parameter(value, requires_grad=param.requires_grad)
