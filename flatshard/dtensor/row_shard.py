"""Row shards: the local tensor of every flatshard DTensor.

flatshard's `Shard(0)` pieces follow the layout, not `torch.chunk`: rank r holds the rows
its `ShardSpec` names. DTensor itself only knows chunk-style unevenness, so the local tensor
carries its spec (rows, global offsets, every rank's row counts, components). The spec
survives the ops an optimizer or a state dict applies (detach, zeros_like, pointwise and
foreach math), so parameters, gradients and optimizer states all know where their rows
sit globally, with no communication.

DTensor redistribution of such a tensor is routed here: `Shard(0) -> Replicate` (what
`full_tensor()` and full state dicts use) gathers by the true bounds; any other
redistribution raises `UnevenShardError` on every rank alike, before any collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_flatten, tree_unflatten

from flatshard.errors import UnevenShardError
from flatshard.layout import ShardSpec, describe_param, whole_param_spec


class RowShard(torch.Tensor):
    """A plain tensor (`data`) holding the piece of a dim-0 sharded tensor that `spec`
    describes."""

    data_: torch.Tensor
    spec: ShardSpec
    # The flat buffer this piece is a view of. Ops run below autograd here, where views do
    # not share version counters: writes bump the base's counter explicitly.
    version_base: torch.Tensor | None
    # The dim of the DTensor's mesh whose ranks split the rows (the others: HSDP replicas
    # before it, tensor parallelism after it).
    mesh_dim: int

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        spec: ShardSpec,
        version_base: torch.Tensor | None = None,
        mesh_dim: int = 0,
    ):
        if isinstance(data, RowShard):
            data = data.data_
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            layout=data.layout,
            requires_grad=False,
        )
        wrapper.data_ = data
        wrapper.spec = spec
        wrapper.version_base = version_base
        wrapper.mesh_dim = mesh_dim
        return wrapper

    def __init__(self, data, spec, version_base=None, mesh_dim=0):  # set in __new__
        super().__init__()

    def __repr__(self):
        return f"RowShard(rows={self.spec.row_start}:{self.spec.row_end}, {self.data_!r})"

    # --- DCP: this rank's chunks are known from its spec, with no communication ----------
    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        # one per block of the global tensor (a fused parameter split over TP: one per
        # component); an empty piece writes and reads nothing
        return [
            ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=torch.Size(box.shape))
            for _, box in self.spec.pieces
        ]

    def __create_write_items__(self, fqn: str, dtensor):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self.data_),
                    # the global size, also for a plain-tensor optimizer state (a RowShard
                    # that is not inside a DTensor)
                    size=torch.Size(self.spec.global_shape),
                ),
            )
            for chunk in self.__create_chunk_list__()
        ]

    def __get_tensor_shard__(self, index):
        # DCP reads from it on save and loads into it in place
        for local, box in self.spec.pieces:
            if index.offset is None or tuple(index.offset) == box.offset:
                return self.data_[local.slices]
        raise ValueError(f"no chunk at {index.offset} in {self!r}")

    def __tensor_flatten__(self):
        return ["data_"], (self.spec, None, self.mesh_dim)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return RowShard(inner["data_"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        op = _op_info(func)
        if op.collective:
            # A collective on row shards means DTensor took its chunk-based path.
            raise UnevenShardError(_unsupported(f"the collective {func}"))
        if func is torch.ops.aten.copy_.default:
            _check_copy_source(*args[:2])
        if func is torch.ops.aten._foreach_norm.Scalar and _is_max_norm(args, kwargs):
            # a rank may hold no rows: the max of nothing is 0 here, not an error
            return [_max_abs(t.data_ if type(t) is RowShard else t) for t in args[0]]
        like = _first_row_shard(args)
        out = func(*_unwrap_args(args), **(_unwrap_kwargs(kwargs) if kwargs else {}))
        for position, name in op.written:
            value = args[position] if position < len(args) else (kwargs or {}).get(name)
            _bump_versions(value)
        if op.foreach and isinstance(out, (list, tuple)):
            # output i has the rows of the i-th tensor of the first list argument
            firsts = args[0] if isinstance(args[0], (list, tuple)) else [None] * len(out)
            return type(out)(_rewrap(op, o, f, args) for o, f in zip(out, firsts))
        if isinstance(out, torch.Tensor):
            return _rewrap(op, out, like, args)
        flat_out, spec = tree_flatten(out)
        return tree_unflatten([_rewrap(op, o, like, args) for o in flat_out], spec)


class _OpInfo:
    """What the dispatch needs to know about an op, computed once per op."""

    def __init__(self, func):
        name = func.name().split("::")[1].split(".")[0]
        self.collective = func.namespace in ("_c10d_functional", "c10d", "_dtensor")
        self.foreach = name.startswith("_foreach_")
        self.view = func in _VIEWS
        self.aliases = self.view or name in _ALIASES
        self.keeps_rows = torch.Tag.pointwise in func.tags or self.foreach or name in _ROW_KEEPING
        self.written = [
            (position, argument.name)
            for position, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ]


_OPS: dict = {}


def _op_info(func) -> _OpInfo:
    info = _OPS.get(func)
    if info is None:
        info = _OPS[func] = _OpInfo(func)
    return info


def _first_row_shard(args):
    for arg in args:
        if type(arg) is RowShard:
            return arg
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if type(item) is RowShard:
                    return item
    return None


def _unwrap(value):
    if type(value) is RowShard:
        return value.data_
    if isinstance(value, (list, tuple)):
        return type(value)(v.data_ if type(v) is RowShard else v for v in value)
    return value


def _unwrap_args(args):
    return [_unwrap(arg) for arg in args]


def _unwrap_kwargs(kwargs):
    return {key: _unwrap(value) for key, value in kwargs.items()}


def _rewrap(op: _OpInfo, out, like, args):
    """Give an op's output the rows of its row-shard input, when the op keeps rows."""
    if not isinstance(out, torch.Tensor) or like is None or type(like) is not RowShard:
        return out
    if out is like.data_:  # in-place / out= ops return their (unwrapped) input
        return like
    for arg in args:  # ... possibly not the first one
        if type(arg) is RowShard and out is arg.data_:
            return arg
    # Decided by the op alone, so every rank wraps (or not) alike; a view is kept when it is
    # the identity view (DTensor's to_local/from_local make those).
    if out.dim() == 0 or out.dim() != like.dim():
        return out
    if op.keeps_rows or (op.view and out.shape == like.shape):
        base = like.version_base if op.aliases else None
        return RowShard(out, like.spec, base, like.mesh_dim)
    return out


# Ops whose output has the rows of their row-shard input (besides pointwise and foreach).
_ROW_KEEPING = {
    "detach",
    "alias",
    "clone",
    "_to_copy",
    "copy_",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "zero_",
    "fill_",
    "contiguous",
}
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}
_ALIASES = {"detach", "alias"}


def _bump_versions(written) -> None:
    """An in-place op wrote into these: bump their flat buffers' versions, so writes to the
    sharded weights are visible (that is how a unit knows its gathered copy is stale)."""
    items = written if isinstance(written, (list, tuple)) else (written,)
    bases = [t.version_base for t in items if type(t) is RowShard and t.version_base is not None]
    if bases:
        torch.autograd.graph.increment_version(bases)


def _is_max_norm(args, kwargs) -> bool:
    ord_ = args[1] if len(args) > 1 else (kwargs or {}).get("ord", 2)
    return ord_ in (float("inf"), -float("inf")) and ord_ > 0


def _max_abs(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.abs().amax() if tensor.numel() else tensor.new_zeros(())


def _check_copy_source(destination, source) -> None:
    """A copy into a row shard from a piece of another layout (DTensor's `copy_` between a
    flatshard parameter and a `torch.chunk`-sharded DTensor lands here with the chunk's
    local tensor) would broadcast or fail deep inside torch: say what to do instead."""
    if (
        isinstance(destination, RowShard)
        and not isinstance(source, RowShard)
        and source.dim() == destination.dim()
        and source.shape != destination.shape
    ):
        raise UnevenShardError(
            f"copying a tensor of shape {tuple(source.shape)} into this rank's rows (shape "
            f"{tuple(destination.shape)}) of a flatshard parameter: the source is sharded by "
            "another layout. Load values with `module.load_state_dict` (any layout), or "
            "copy this rank's rows of the full tensor into `param.to_local()` (the rows "
            "`flatshard.row_range(param)`)."
        )


def _unsupported(what: str) -> str:
    return (
        f"{what} is not supported on flatshard parameters: their Shard(0) pieces are "
        "row ranges set by flatshard's layout, not torch.chunk pieces. Use "
        "`full_tensor()` / `redistribute(placements=[Replicate()])` to get the full tensor, "
        "or `to_local()` for this rank's rows."
    )


def gather_rows(shard: RowShard, group: dist.ProcessGroup) -> torch.Tensor:
    """All ranks' rows, concatenated in rank order: one all-gather padded to the longest piece."""
    spec = shard.spec
    counts, row_shape = spec.global_row_counts, spec.local_shape[1:]
    longest = max(counts)
    send = torch.zeros(longest * spec.row_size, dtype=shard.dtype, device=shard.device)
    send[: spec.numel].copy_(shard.data_.reshape(-1))
    received = torch.empty(
        longest * spec.row_size * len(counts), dtype=shard.dtype, device=shard.device
    )
    dist.all_gather_single(received, send, group=group)
    received = received.view(len(counts), longest, *row_shape)
    if all(n == longest for n in counts):
        return received.view(-1, *row_shape)  # no padding to squeeze out: no copy
    return torch.cat([received[r, :n] for r, n in enumerate(counts)])


def redistribute_rows(local_tensor: RowShard, current_spec, target_spec) -> torch.Tensor:
    """DTensor redistribution of a row shard (patches.py routes it here): `Shard(0) ->
    Replicate` on the mesh dim that holds the rows gathers by the true rows, then a TP
    dim after it (if it changes too, to `Replicate`) gathers the TP pieces by their TP
    placement; anything else raises on every rank alike."""
    current, target = tuple(current_spec.placements), tuple(target_spec.placements)
    if current == target:
        return local_tensor
    mesh, rows_dim = current_spec.mesh, local_tensor.mesh_dim
    changed = [dim for dim, (a, b) in enumerate(zip(current, target)) if a != b]
    tp_dims = [dim for dim in changed if dim > rows_dim]
    if changed[0] != rows_dim or any(
        not isinstance(target[dim], Replicate) for dim in changed
    ):  # fmt: skip
        raise UnevenShardError(_unsupported(f"redistributing {current} -> {target}"))
    gathered = gather_rows(local_tensor, mesh.get_group(rows_dim))
    for dim in tp_dims:  # the TP-local tensor, gathered by torch's own TP placement
        tp_mesh = mesh[mesh.mesh_dim_names[dim]]
        gathered = DTensor.from_local(
            gathered,
            tp_mesh,
            [current[dim]],
            run_check=False,
            shape=current_spec.shape,
            stride=current_spec.stride,
        ).full_tensor()
    return gathered


def rows_in_layout(value: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's rows (by `spec`) of a tensor shaped like the global one, whatever layout
    it comes in: a full tensor, flatshard's own rows, a Replicate DTensor, or another
    sharding (gathered: every rank loading the same values joins that collective)."""
    if not isinstance(value, DTensor):
        return spec.piece_of(value.detach())
    local = value._local_tensor
    if isinstance(local, RowShard) and local.spec.pieces == spec.pieces:
        return local.data_
    if all(isinstance(p, Replicate) for p in value.placements):
        return spec.piece_of(local)
    return spec.piece_of(value.full_tensor())


_TENSOR_DATA = torch._C.TensorBase.data


class RowShardedParameter(DTensor):
    """The class of flatshard's sharded parameters. A plain DTensor's `param.data = value`
    swaps the wrapper and keeps its old local tensor: the assignment would be silently
    dropped. Here it loads `value` into this rank's rows of the flat buffers instead."""

    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value) -> None:
        spec = shard_spec(self)
        if tuple(value.shape) != spec.global_shape:
            raise UnevenShardError(
                f"param.data = a tensor of shape {tuple(value.shape)}: this parameter's shape is "
                f"{spec.global_shape}; flatshard loads the values into its shards, it cannot "
                "change the shape"
            )
        target = self
        if self.is_meta and hasattr(self, "_flatshard_param"):
            # still on meta (FSDP2's flow): the unit gets real shards, whose new parameter
            # takes this one's place in the module and receives the values
            unit, managed = self._flatshard_param
            unit.allocate(unit.mesh.device)
            target = managed.sharded
        with torch.no_grad():
            target.to_local().copy_(rows_in_layout(value, spec))


def shard_spec(param: DTensor) -> ShardSpec:
    """The `ShardSpec` of this rank's piece of a flatshard DTensor (a parameter, its gradient
    or an optimizer state of it)."""
    local = param._local_tensor if isinstance(param, DTensor) else None
    if not isinstance(local, RowShard):
        raise TypeError(f"expected a flatshard-sharded DTensor, got {type(param).__name__}")
    return local.spec


def param_spec(root, fqn: str, param) -> ShardSpec:
    """What this rank holds of `root`'s parameter `fqn`: its flatshard spec, or the whole of
    a parameter flatshard does not shard."""
    if isinstance(param, DTensor):
        return shard_spec(param)
    return whole_param_spec(describe_param(root, fqn, param))


def stored_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape a checkpoint stores `tensor` as: the global one for flatshard's pieces, a
    plain-tensor optimizer state (a bare `RowShard`) included."""
    if isinstance(tensor, RowShard):
        return tensor.spec.global_shape
    return tuple(tensor.shape)


def row_range(param: DTensor) -> tuple[int, int]:
    """The global rows `[start, end)` of a flatshard DTensor that this rank holds."""
    box = shard_spec(param).global_box
    return box.offset[0], box.offset[0] + box.shape[0]


def local_data(dtensor: DTensor) -> torch.Tensor:
    """The plain tensor behind a DTensor's local shard."""
    local = dtensor._local_tensor
    return local.data_ if isinstance(local, RowShard) else local


def make_row_sharded_dtensor(
    local: torch.Tensor,
    mesh,
    spec: ShardSpec,
    version_base: torch.Tensor | None = None,
    tp_placement=None,
) -> DTensor:
    """A DTensor on `mesh` (a ShardMesh: `Shard(0)` over its shard dim, replicated over
    HSDP's replicas, `tp_placement` over TP) whose local tensor is `local` (a view of
    `version_base`)."""
    return DTensor.from_local(
        RowShard(local, spec, version_base, mesh.shard_mesh_dim),
        mesh.param_mesh,
        list(mesh.placements_for(tp_placement)),
        run_check=False,
        shape=torch.Size(spec.global_shape),
        stride=spec.global_strides,
    )
