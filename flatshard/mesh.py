"""The one owner of the device mesh: degrees of parallelism, sub-meshes, groups, ranks.

`ParallelDims` is the arithmetic (no process group; the planner uses it on paper):
`dp_replicate x dp_shard x tp` ranks, and expert parallelism `ep`, which borrows its ranks
from the data-parallel ranks (the experts are sharded over the other `efsdp = world / ep`
ranks). `ParallelDims.build()` makes every `DeviceMesh` of a run (`Meshes`): no
other code in flatshard, its trainer, benchmarks or tests builds one. `ShardMesh` is a
`DeviceMesh` as `fully_shard` uses it: it validates the mesh once and answers which group a
unit shards over, this rank's index in it, its size, the replica group of HSDP, the DTensor
placements of a sharded parameter and the device buffers live on. Nothing else takes a mesh
apart.

As FSDP2's, `fully_shard`'s mesh is 1-D (shard) or 2-D (dim 0 replicate, dim 1 shard:
HSDP). Tensor and expert parallelism join from the parameters: a unit whose parameters are
DTensors on a TP (or EP) mesh sliced from the same named mesh gets a `ShardMesh` whose
DTensors live on the (data-parallel..., tp) mesh, `Replicate` over TP for the parameters TP
does not split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from flatshard.comm import devices
from flatshard.errors import MeshError


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism over `world_size` ranks. -1 for `dp_shard` (the default) or
    `dp_replicate`: whatever the other dense degrees leave.

    Ranks are laid out `(dp_replicate, dp_shard, cp, tp)`, TP innermost. Context parallelism
    splits each sequence over `cp` ranks (they share a batch); the parameters are sharded
    over `dp_shard x cp`, as torchtitan shards them. Expert parallelism
    borrows `ep` of the data-parallel ranks (ranks holding different tokens, replicas
    included); each expert is sharded over all `efsdp = world_size / ep` other ranks, TP
    ranks included (they compute the experts for the same tokens). `sequence_parallel`:
    TP also splits the norms and the residual stream by sequence (the model's plan says
    how). `build()` makes the meshes."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    _built: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "ep", "cp"):
            _check_degree(name, getattr(self, name))
        left = [n for n in ("dp_replicate", "dp_shard") if getattr(self, n) == -1]
        if len(left) == 2:
            raise MeshError("give dp_replicate or dp_shard (at most one may be -1)")
        if left:
            given = [n for n in ("dp_replicate", "dp_shard", "cp", "tp") if n not in left]
            given = [n for n in given if n != "cp" or self.cp > 1]  # cp named where used
            for name in given:
                _check_degree(name, getattr(self, name))
            others = math.prod(getattr(self, n) for n in given)
            if self.world_size % others:
                named = " x ".join(given)
                values = " x ".join(str(getattr(self, n)) for n in given)
                raise MeshError(f"{named} ({values}) must divide world_size ({self.world_size})")
            object.__setattr__(self, left[0], self.world_size // others)
        _check_degree("dp_replicate", self.dp_replicate)
        _check_degree("dp_shard", self.dp_shard)
        dense = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if dense != self.world_size:
            with_cp = (" x cp", f" x {self.cp}") if self.cp > 1 else ("", "")
            raise MeshError(
                f"dp_replicate x dp_shard{with_cp[0]} x tp = {self.dp_replicate} x "
                f"{self.dp_shard}{with_cp[1]} x {self.tp} = {dense} ranks, but world_size is "
                f"{self.world_size}"
            )
        if self.cp > 1 and self.ep > 1:
            raise MeshError("context parallelism (cp > 1) with expert parallelism (ep > 1) is "
                            "not supported yet: use one of them")  # fmt: skip
        if self.sequence_parallel and self.tp == 1:
            raise MeshError(
                "sequence_parallel splits the sequence over the TP ranks: it needs tp > 1"
            )
        if self.dp % self.ep:
            raise MeshError(
                f"ep ({self.ep}) must divide the data-parallel ranks, dp_replicate x dp_shard "
                f"({self.dp_replicate} x {self.dp_shard}): expert parallelism borrows its ranks "
                "from the ones holding different tokens (TP ranks hold the same ones)"
            )

    @property
    def efsdp(self) -> int:
        """Ranks each expert is FSDP-sharded over."""
        return self.world_size // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each trains on its own data."""
        return self.dp_replicate * self.dp_shard

    @property
    def dense_grad_divide_factor(self) -> int:
        """What a dense parameter's summed gradient is divided by: the data-parallel ranks
        and, within each, the CP ranks' parts of its sequences (TP ranks hold pieces of one
        gradient, not copies)."""
        return self.dp * self.cp

    @property
    def expert_grad_divide_factor(self) -> int:
        """What an expert's gradient, summed over its `efsdp x ep` ranks (every rank), is
        divided by: every rank (the TP ranks' copies count as the same tokens)."""
        return self.world_size

    def build(self, device_type: str | None = None) -> Meshes:
        """Every DeviceMesh of these degrees (on the default process group's device unless
        `device_type` is given), built once: every rank must call it, in the same order."""
        if not dist.is_initialized():
            raise MeshError(
                "torch.distributed is not initialised: call dist.init_process_group() "
                "(torchrun sets the environment) before building meshes"
            )
        if dist.get_world_size() != self.world_size:
            raise MeshError(
                f"ParallelDims is for world_size {self.world_size}, but the process group "
                f"has {dist.get_world_size()} ranks"
            )
        device_type = device_type or devices.group_device(None).type
        if device_type not in self._built:
            self._built[device_type] = Meshes._build(self, device_type)
        return self._built[device_type]


@dataclass(frozen=True)
class Meshes:
    """The named meshes of a `ParallelDims`: `world` over (dp_replicate, dp_shard, tp) (a
    dim of degree 1 included; with context parallelism (dp_replicate, dp_shard, cp, tp) and
    `dp_shard_cp` flattened), `experts` over (efsdp, ep) when ep > 1, and `dp`, every
    data-parallel rank as one dim (data loading, loss averaging)."""

    dims: ParallelDims
    world: DeviceMesh
    dp: DeviceMesh
    experts: DeviceMesh | None

    @staticmethod
    def _build(dims: ParallelDims, device_type: str) -> Meshes:
        # a cp dim only where there is context parallelism: each dim costs process groups
        cp = ((dims.cp,), ("cp",)) if dims.cp > 1 else ((), ())
        shape = (dims.dp_replicate, dims.dp_shard, *cp[0], dims.tp)
        names = ("dp_replicate", "dp_shard", *cp[1], "tp")
        world = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if dims.cp > 1:  # the parameters' shard dim: dp_shard x cp as one
            world["dp_shard", "cp"]._flatten("dp_shard_cp")
        dp = world["dp_shard"]
        if dims.dp_replicate > 1:
            dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        experts = None
        if dims.ep > 1:
            # rank = data-parallel index x tp + TP index; an EP group: `ep` consecutive
            # data-parallel indices at one TP index; efsdp: every other rank
            ranks = torch.arange(dims.world_size).view(dims.dp // dims.ep, dims.ep, dims.tp)
            ranks = ranks.permute(0, 2, 1).reshape(dims.efsdp, dims.ep)
            experts = DeviceMesh(device_type, ranks, mesh_dim_names=("efsdp", "ep"))
        # every rank has made every group before any goes on: a rank that raised right
        # after (a bad config) and exited would take rank 0's store away from peers still
        # connecting their groups, which then print gloo's "Connection reset" traces
        dist.barrier()
        return Meshes(dims, world, dp, experts)

    @property
    def fsdp(self) -> DeviceMesh:
        """What `fully_shard` shards the dense parameters over: (dp_replicate, dp_shard),
        the shard dim `dp_shard x cp` with context parallelism."""
        shard = "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"
        if self.dims.dp_replicate > 1:
            return self.world["dp_replicate", shard]
        return self.world[shard]

    @property
    def cp(self) -> DeviceMesh | None:
        """The context-parallel mesh (None without context parallelism)."""
        return self.world["cp"] if self.dims.cp > 1 else None

    @property
    def tp(self) -> DeviceMesh | None:
        """The tensor-parallel mesh (None without tensor parallelism)."""
        return self.world["tp"] if self.dims.tp > 1 else None

    @property
    def ep(self) -> DeviceMesh | None:
        return self.experts["ep"] if self.experts is not None else None

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        """What `fully_shard` shards the experts over."""
        return self.experts["efsdp"] if self.experts is not None else None

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which data it reads)."""
        return self.dp.get_local_rank()


def default_mesh(device_type: str) -> DeviceMesh:
    """All ranks of the default process group as one 1-D mesh (FSDP2's default)."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _check_degree(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshError(f"{name} must be an int >= 1, got {value!r}")


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


def default_device() -> torch.device:
    """Where flatshard puts new buffers outside a mesh: the default process group's device
    (the CPU without a process group)."""
    return devices.group_device(None) if dist.is_initialized() else torch.device("cpu")
