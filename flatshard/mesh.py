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

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flatshard.comm import devices
from flatshard.errors import MeshError


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism over `world_size` ranks. -1 for `dp_shard` (the default) or
    `dp_replicate`: whatever the other dense degrees leave.

    Ranks are laid out `(pp, dp_replicate, dp_shard, cp, tp)`, TP innermost. Pipeline
    parallelism splits the model into stages over `pp` ranks (outermost: each stage's ranks
    are a whole data/tensor-parallel run of their own). Context parallelism
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
    pp: int = 1
    _built: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "ep", "cp", "pp"):
            _check_degree(name, getattr(self, name))
        if self.world_size % self.pp:
            raise MeshError(f"pp ({self.pp}) must divide world_size ({self.world_size})")
        stage = self.world_size // self.pp  # the ranks of one pipeline stage
        left = [n for n in ("dp_replicate", "dp_shard") if getattr(self, n) == -1]
        if len(left) == 2:
            raise MeshError("give dp_replicate or dp_shard (at most one may be -1)")
        if left:
            given = [n for n in ("dp_replicate", "dp_shard", "cp", "tp") if n not in left]
            given = [n for n in given if n != "cp" or self.cp > 1]  # cp named where used
            for name in given:
                _check_degree(name, getattr(self, name))
            others = math.prod(getattr(self, n) for n in given)
            if stage % others:
                named = " x ".join(given)
                values = " x ".join(str(getattr(self, n)) for n in given)
                ranks = f"world_size / pp ({stage})" if self.pp > 1 else f"world_size ({stage})"
                raise MeshError(f"{named} ({values}) must divide {ranks}")
            object.__setattr__(self, left[0], stage // others)
        _check_degree("dp_replicate", self.dp_replicate)
        _check_degree("dp_shard", self.dp_shard)
        dense = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if dense != self.world_size:
            with_cp = (" x cp", f" x {self.cp}") if self.cp > 1 else ("", "")
            with_pp = ("pp x ", f"{self.pp} x ") if self.pp > 1 else ("", "")
            raise MeshError(
                f"{with_pp[0]}dp_replicate x dp_shard{with_cp[0]} x tp = {with_pp[1]}"
                f"{self.dp_replicate} x {self.dp_shard}{with_cp[1]} x {self.tp} = {dense} "
                f"ranks, but world_size is {self.world_size}"
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
        """Ranks each expert is FSDP-sharded over (within its pipeline stage)."""
        return self.world_size // (self.pp * self.ep)

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
        """What an expert's gradient, summed over its `efsdp x ep` ranks (every rank of its
        pipeline stage), is divided by: those ranks (the TP ranks' copies count as the same
        tokens)."""
        return self.world_size // self.pp

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
    `dp_shard_cp` flattened; with pipeline parallelism a `pp` dim first), `experts` over
    (efsdp, ep) when ep > 1 (with pipeline parallelism (pp, efsdp, ep): each stage's
    experts over its own ranks), and `dp`, every data-parallel rank of the stage as one dim
    (data loading, loss averaging)."""

    dims: ParallelDims
    world: DeviceMesh
    dp: DeviceMesh
    experts: DeviceMesh | None

    @staticmethod
    def _build(dims: ParallelDims, device_type: str) -> Meshes:
        # cp and pp dims only where used: each dim costs process groups
        cp = ((dims.cp,), ("cp",)) if dims.cp > 1 else ((), ())
        pp = ((dims.pp,), ("pp",)) if dims.pp > 1 else ((), ())
        shape = (*pp[0], dims.dp_replicate, dims.dp_shard, *cp[0], dims.tp)
        names = (*pp[1], "dp_replicate", "dp_shard", *cp[1], "tp")
        world = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if dims.cp > 1:  # the parameters' shard dim: dp_shard x cp as one
            world["dp_shard", "cp"]._flatten("dp_shard_cp")
            # the ranks of a stage holding other tokens (`token_ranks`)
            world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        dp = world["dp_shard"]
        if dims.dp_replicate > 1:
            dp = world["dp_replicate", "dp_shard"]._flatten("dp")
        experts = None
        if dims.ep > 1:
            # rank = stage x its ranks + data-parallel index x tp + TP index; an EP group:
            # `ep` consecutive data-parallel indices at one TP index; efsdp: every other rank
            # of the stage (each stage's experts are its own)
            ranks = torch.arange(dims.world_size).view(dims.pp, dims.dp // dims.ep, dims.ep,
                                                       dims.tp)  # fmt: skip
            ranks = ranks.permute(0, 1, 3, 2).reshape(dims.pp, dims.efsdp, dims.ep)
            names = ("pp", "efsdp", "ep")
            if dims.pp == 1:
                ranks, names = ranks[0], names[1:]
            experts = DeviceMesh(device_type, ranks, mesh_dim_names=names)
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
    def token_ranks(self) -> DeviceMesh:
        """The ranks of this rank's pipeline stage that hold other tokens of the step: the
        data-parallel ones, and the context-parallel ones splitting each sequence (what a
        sum over the step's tokens, such as an MoE's routing counts, reduces over)."""
        return self.world["dp_cp"] if self.dims.cp > 1 else self.dp

    @property
    def cp(self) -> DeviceMesh | None:
        """The context-parallel mesh (None without context parallelism)."""
        return self.world["cp"] if self.dims.cp > 1 else None

    @property
    def pp(self) -> DeviceMesh | None:
        """The pipeline-parallel mesh: this rank and the ranks holding the other stages
        (None without pipeline parallelism)."""
        return self.world["pp"] if self.dims.pp > 1 else None

    @functools.cached_property
    def pp_apart(self) -> dist.ProcessGroup | None:
        """This rank's pipeline (the ranks of `pp`) as a process group of its own, for what
        goes between stages outside torch's schedule (a tied embedding's weight and
        gradient), which must not pair with the schedule's own messages on `pp`'s group. A
        collective: every rank builds it, on first use."""
        if self.pp is None:
            return None
        pipelines = self.world.mesh.reshape(self.dims.pp, -1).T.tolist()  # one per row
        mine, _ = dist.new_subgroups_by_enumeration(pipelines)
        return mine

    @property
    def pp_rank(self) -> int:
        """Which stage of the pipeline this rank runs (0 without pipeline parallelism)."""
        return self.pp.get_local_rank() if self.pp is not None else 0

    @property
    def tp(self) -> DeviceMesh | None:
        """The tensor-parallel mesh (None without tensor parallelism)."""
        return self.world["tp"] if self.dims.tp > 1 else None

    @property
    def ep(self) -> DeviceMesh | None:
        """This rank's expert-parallel group (of its pipeline stage)."""
        return self.experts["ep"] if self.experts is not None else None

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        """What `fully_shard` shards the experts over (within this rank's stage)."""
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


def default_device() -> torch.device:
    """Where flatshard puts new buffers outside a mesh: the default process group's device
    (the CPU without a process group)."""
    return devices.group_device(None) if dist.is_initialized() else torch.device("cpu")
