"""A `DeviceMesh` as `fully_shard` uses it (`ShardMesh`): the group a unit shards over,
this rank's place in it, and the mesh its DTensors live on -- the data-parallel mesh joined
with a TP or EP mesh sliced from the same root (mesh.py builds the meshes)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from flatshard.comm import devices
from flatshard.errors import MeshError
from flatshard.mesh import default_mesh


class ShardMesh:
    """A `DeviceMesh` as `fully_shard` uses it: the group a unit shards over, this rank's
    index in it and its size, the device of the buffers, and the mesh DTensors live on."""

    def __init__(
        self,
        device_mesh: DeviceMesh,
        inner_mesh: DeviceMesh | None = None,
        expert_parallel: bool = False,
    ):
        if device_mesh.ndim not in (1, 2):
            names = device_mesh.mesh_dim_names or ""
            raise MeshError(
                f"fully_shard takes a 1-D (shard) or 2-D (replicate, shard) data-parallel "
                f"mesh; got a {device_mesh.ndim}-D mesh {names}. Pass its data-parallel "
                "dimensions, e.g. mesh['dp_replicate', 'dp_shard']."
            )
        if device_mesh.get_coordinate() is None:
            # no member of the mesh waits for this rank: raising alone cannot hang anyone
            raise MeshError(
                f"rank {dist.get_rank()} is not in the device mesh {device_mesh}; only the "
                "mesh's ranks may call fully_shard with it"
            )
        self.device_mesh = device_mesh
        shard_dim = device_mesh.ndim - 1
        self.shard_group = device_mesh.get_group(shard_dim)
        self.shard_rank = device_mesh.get_local_rank(shard_dim)
        self.shard_size = device_mesh.size(shard_dim)
        hsdp = device_mesh.ndim == 2
        self.replicate_group = device_mesh.get_group(0) if hsdp else None
        self.replicate_size = device_mesh.size(0) if hsdp else 1
        # the parameters' own mesh dim: TP, or EP (whose ranks see different data, not the
        # same batch: gradients are averaged over them too)
        self.inner_mesh = inner_mesh
        self.inner_size = 1 if inner_mesh is None else inner_mesh.size()
        self.expert_parallel = expert_parallel and inner_mesh is not None
        # a sharded parameter: rows over the shard dim, the same rows on every replica;
        # with TP, its TP placement on the last dim (placements_for)
        self.placements = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
        self.shard_mesh_dim = shard_dim
        self.param_mesh = device_mesh if inner_mesh is None else _joined(device_mesh, inner_mesh)
        self.device = devices.compute_device(device_mesh.device_type)
        self._forward_groups: dict[int, object] = {}
        self._joined: dict[tuple, ShardMesh] = {}

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel mesh of the parameters (None: no TP)."""
        return None if self.expert_parallel else self.inner_mesh

    def joined(self, inner_mesh: DeviceMesh | None, expert_parallel: bool = False) -> ShardMesh:
        """This data-parallel mesh joined with the parameters' tensor- (or expert-)
        parallel mesh; itself for None."""
        if inner_mesh is None or inner_mesh is self.inner_mesh:
            return self
        if self.inner_mesh is not None:
            raise MeshError("a unit's parameters are DTensors on two different TP/EP meshes")
        key = (id(inner_mesh), expert_parallel)
        if key not in self._joined:
            self._joined[key] = ShardMesh(self.device_mesh, inner_mesh, expert_parallel)
        return self._joined[key]

    def placements_for(self, tp_placement=None) -> tuple:
        """A sharded parameter's placements on `param_mesh`: its rows over the shard dim
        and, with TP, its TP placement (`Replicate` for a parameter TP does not split)."""
        if self.inner_mesh is None:
            return self.placements
        return (*self.placements, tp_placement or Replicate())

    def forward_group(self, size: int):
        """The group of `size` consecutive shard ranks holding this rank (hpZ: where a unit
        stays sharded after forward). Created once per size, by every rank together."""
        if size not in self._forward_groups:
            ranks = dist.get_process_group_ranks(self.shard_group)
            if self.replicate_group is not None or len(ranks) != dist.get_world_size():
                raise NotImplementedError(
                    "reshard_after_forward=<int> needs a 1-D mesh over every rank for now"
                )
            if size < 1 or self.shard_size % size:
                raise MeshError(
                    f"reshard_after_forward={size} must divide the shard group's size "
                    f"({self.shard_size}), e.g. the ranks of one node"
                )
            blocks = [ranks[i : i + size] for i in range(0, len(ranks), size)]
            self._forward_groups[size], _ = dist.new_subgroups_by_enumeration(blocks)
        return self._forward_groups[size]

    @property
    def dp_size(self) -> int:
        """Ranks a gradient is averaged over: every rank training on its own data."""
        experts = self.inner_size if self.expert_parallel else 1
        return self.replicate_size * self.shard_size * experts

    @classmethod
    def resolve(cls, device_mesh: DeviceMesh | ShardMesh | None, dp_mesh_dims=None) -> ShardMesh:
        """The mesh given to `fully_shard` (with `dp_mesh_dims`, its data-parallel dims), or
        all ranks of the default process group on its backend's device (gloo: CPU, NCCL:
        CUDA), as FSDP2 defaults."""
        if isinstance(device_mesh, ShardMesh):
            return device_mesh
        if dp_mesh_dims is not None:
            if device_mesh is None:
                raise MeshError("dp_mesh_dims names dims of a mesh: pass mesh= too")
            device_mesh, _ = split_spmd_mesh(device_mesh, dp_mesh_dims)
        if device_mesh is None:
            if not dist.is_initialized():
                raise MeshError(
                    "torch.distributed is not initialised: call dist.init_process_group() "
                    "(torchrun sets the environment) or pass mesh=init_device_mesh(...)"
                )
            device_mesh = default_mesh(devices.group_device(None).type)
        return cls(device_mesh)

    def __repr__(self) -> str:
        replicas = f"{self.replicate_size} x " if self.replicate_size > 1 else ""
        kind = "ep" if self.expert_parallel else "tp"
        tp = f" x {kind} {self.inner_size}" if self.inner_mesh is not None else ""
        return f"ShardMesh({replicas}{self.shard_size}{tp} ranks on {self.device})"


def split_spmd_mesh(mesh: DeviceMesh, dims) -> tuple[DeviceMesh, DeviceMesh | None]:
    """FSDP2's `dp_mesh_dims` (a `DataParallelMeshDims`): `mesh` is the whole SPMD mesh.
    Returns the data-parallel mesh `fully_shard` shards over (replicate dims then shard
    dims, several names flattened into one) and the mesh of the other dim, where the
    parameters' own (tensor-parallel) placements are (None: there is none)."""
    names = tuple(mesh.mesh_dim_names or ())
    shard, replicate = tuple(dims.shard_names), tuple(dims.replicate_names)
    if not shard:
        raise MeshError(
            "dp_mesh_dims without a shard dim (FSDP2's replicate-only mode) is not supported "
            "by flatshard; name the dim(s) to shard over, e.g. DataParallelMeshDims(shard='dp')"
        )
    unknown = [n for n in (*shard, *replicate) if n not in names]
    if unknown:
        raise MeshError(f"dp_mesh_dims names {unknown}, which the mesh {names} does not have")
    dp = [_one_dim(mesh, group) for group in (replicate, shard) if group]
    rest = tuple(n for n in names if n not in (*shard, *replicate))
    if len(rest) > 1:
        raise MeshError(
            f"dp_mesh_dims leaves the dims {rest} of the mesh {names}: flatshard composes "
            "with one tensor-parallel dim (flatten the others into the data-parallel dims)"
        )
    return mesh[tuple(dp)] if len(dp) > 1 else mesh[dp[0]], mesh[rest[0]] if rest else None


def _one_dim(mesh: DeviceMesh, group: tuple[str, ...]) -> str:
    """The name of one mesh dim covering `group` (flattened when it has several)."""
    if len(group) == 1:
        return group[0]
    name = "_".join(group)
    mesh[group]._flatten(name)
    return name


def _joined(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (data-parallel..., tp) mesh both were sliced from, as one DeviceMesh."""
    root = dp_mesh._get_root_mesh()
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    how = (
        "slice both from one named mesh, e.g. mesh = init_device_mesh(device, (dp, tp), "
        "mesh_dim_names=('dp_shard', 'tp')); parallelize with mesh['tp'] and fully_shard "
        "with mesh=mesh['dp_shard']"
    )
    if tp_mesh.ndim != 1:
        raise MeshError(f"tensor parallelism over a {tp_mesh.ndim}-D mesh is not supported; {how}")
    order = list(root.mesh_dim_names or ())
    if not dp_names or not tp_names or root is dp_mesh or tp_names[0] not in order:
        raise MeshError(
            "the parameters are DTensors on a tensor-parallel mesh that is not a sibling of "
            f"fully_shard's mesh: {how}"
        )
    if any(order.index(tp_names[0]) < order.index(name) for name in dp_names if name in order):
        raise MeshError(
            f"the tensor-parallel dim {tp_names[0]!r} must come after the data-parallel dims "
            f"{dp_names} in the mesh ({tuple(order)}): TP is the innermost dimension"
        )
    joined = root[(*dp_names, *tp_names)]
    # torch caches sub-meshes by their ranks: compare ranks, not mesh objects
    if joined[tp_names[0]].mesh.tolist() != tp_mesh.mesh.tolist():
        raise MeshError(
            f"the TP mesh {tp_mesh} is not the {tp_names[0]!r} dim of fully_shard's mesh "
            f"{root}: {how}"
        )
    return joined
