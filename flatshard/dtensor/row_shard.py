"""Row shards: the local tensor of every flatshard DTensor.

flatshard's `Shard(0)` pieces follow the layout, not `torch.chunk`: rank r holds the rows
its `ShardSpec` names. DTensor itself only knows chunk-style unevenness, so the local tensor
carries its spec (rows, global offsets, every rank's row counts, components). The spec
survives the ops an optimizer or a state dict applies (detach, zeros_like, pointwise and
foreach math), so parameters, gradients and optimizer states all know where their rows
sit globally, with no communication.

What it knows of each aten op is in row_ops.py, its DTensor redistribution in
redistribute.py, the sharded parameters and what reads their spec in sharded_param.py.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_flatten, tree_unflatten

from flatshard import comm
from flatshard.dtensor import disk_tier
from flatshard.dtensor.derived_rows import derived_spec
from flatshard.dtensor.disk_tier import (
    DiskTier,
    PagedBuffer,
    paged_pieces,
    run_by_piece,
)
from flatshard.dtensor.row_ops import OpInfo, op_info
from flatshard.errors import UnevenShardError
from flatshard.layout import ShardSpec


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
    # Optimizer offload's disk tier (disk_tier.py): where state made from this piece goes,
    # and the file mapping of this piece's own data when it is such state.
    tier: DiskTier | None
    paged: PagedBuffer | None

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        spec: ShardSpec,
        version_base: torch.Tensor | None = None,
        mesh_dim: int = 0,
        tier: DiskTier | None = None,
        paged: PagedBuffer | None = None,
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
        wrapper.tier = tier
        wrapper.paged = paged
        return wrapper

    def __init__(self, data, spec, version_base=None, mesh_dim=0, tier=None, paged=None):
        super().__init__()  # set in __new__

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

        if not _writes_its_replica(dtensor, self.mesh_dim):
            return []
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
        return ["data_"], (self.spec, None, self.mesh_dim, self.tier, self.paged)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return RowShard(inner["data_"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        op = op_info(func)
        if op.collective:
            # A collective on row shards means DTensor took its chunk-based path.
            raise UnevenShardError(unsupported(f"the collective {func}"))
        if func is torch.ops.aten.copy_.default:
            _check_copy_source(*args[:2])
        # a rank may hold no rows: the max of nothing is 0 here, not an error (on one
        # rank only, which would leave the others waiting in the next collective)
        if func is torch.ops.aten._foreach_norm.Scalar and _is_max_norm(args, kwargs):
            return [_max_abs(t.data_ if type(t) is RowShard else t) for t in args[0]]
        if func is torch.ops.aten.linalg_vector_norm.default and _is_whole_max_norm(args, kwargs):
            dtype = (kwargs or {}).get("dtype", args[4] if len(args) > 4 else None)
            return _max_abs(args[0].data_.to(dtype or args[0].dtype))
        if disk_tier.in_use and paged_pieces(args, kwargs):
            return _run_paged(func, op, args, kwargs)
        if op.seeded:
            return _draw_as_fsdp2(func, op, args, kwargs)
        return _dispatch(func, op, args, kwargs)


def _writes_its_replica(dtensor, split: int) -> bool:
    """Whether this rank writes its chunks: only the first of the ranks that replicate them
    (along every Replicate mesh dim but the row split's). Replicas may cut the same rows
    differently (a root unit whose vocabulary-parallel embedding has uneven TP pieces packs
    a Replicate norm at other offsets on each TP rank), so DCP's dedup, which drops only
    identical chunks, would keep overlapping ones."""
    if not isinstance(dtensor, DTensor):
        return True  # a plain-tensor optimizer state: no replicas
    coordinate = dtensor.device_mesh.get_coordinate()
    return all(
        coordinate[d] == 0
        for d, placement in enumerate(dtensor.placements)
        if d != split and type(placement) is Replicate
    )


def _draw_as_fsdp2(func, op: OpInfo, args, kwargs):
    """A random op (an init's `uniform_`, `normal_`, ...) on a row shard draws what FSDP2's
    `torch.chunk` pieces draw. On the CPU every FSDP2 rank draws its chunk from the same
    generator state, so here every rank draws the first chunk, and gives its row i what
    FSDP2's rank holding row i has there (row i % chunk rows): the same values as FSDP2
    wherever its chunks are equal, and every rank's generator left where FSDP2's first
    rank leaves it (all of them, when the chunks are equal), so a batch drawn next is the
    same on every rank. (On CUDA, DTensor's RNG tracker around this call decides the
    generator's state afterwards.) An op whose values depend on the input's (bernoulli of
    a probability tensor) runs on this rank's rows, and only the generator is moved."""
    like = _first_row_shard(args)
    rest = (_unwrap_args(args[1:]), _unwrap_kwargs(kwargs) if kwargs else {})
    scratch = like.data_.new_empty(like.spec.first_chunk_shape)
    if not op.fills:
        generator = (kwargs or {}).get("generator") or comm.default_generator(like.device)
        start = generator.get_state()
        out = _dispatch(func, op, args, kwargs)
        generator.set_state(start)
        func(scratch, *rest[0], **rest[1])
        return out
    values = _rows_of_chunk(func(scratch, *rest[0], **rest[1]), like.spec)
    if not op.written:  # rand_like and friends: a new tensor with this rank's rows
        return RowShard(values, like.spec, None, like.mesh_dim, like.tier)
    like.data_.copy_(values)
    _bump_versions(like)
    return like


def _rows_of_chunk(chunk: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's piece of a tensor that repeats `chunk` along the shard dim (what FSDP2's
    ranks hold after each drew `chunk` from the same state)."""
    box, d = spec.param_box, spec.info.shard_dim
    start, count = box.offset[d], box.shape[d]
    rows = torch.arange(start, start + count, device=chunk.device) % chunk.shape[d]
    picked = chunk.index_select(d, rows)
    return picked[tuple(slice(None) if i == d else s for i, s in enumerate(box.slices))]


def _dispatch(func, op: OpInfo, args, kwargs):
    """Run `func` on the row shards' data and give the results their rows."""
    like = _first_row_shard(args)
    if op.makes_state and like is not None and like.tier is not None:
        return _paged_state(func, args, kwargs, like)
    out = func(*_unwrap_args(args), **(_unwrap_kwargs(kwargs) if kwargs else {}))
    for position, name in op.written:
        value = args[position] if position < len(args) else (kwargs or {}).get(name)
        _bump_versions(value)
    if op.foreach and isinstance(out, (list, tuple)):
        # output i has the rows of the i-th tensor of the first list argument
        firsts = args[0] if isinstance(args[0], (list, tuple)) else [None] * len(out)
        return type(out)(_rewrap(op, o, f, args) for o, f in zip(out, firsts))
    if isinstance(out, torch.Tensor):
        return _rewrap(op, out, like, args, func, kwargs)
    flat_out, spec = tree_flatten(out)
    return tree_unflatten([_rewrap(op, o, like, args, func, kwargs) for o in flat_out], spec)


def _run_paged(func, op: OpInfo, args, kwargs):
    """An op on disk-tier state: piece by piece, each piece paged out after (disk_tier.py)."""
    if op.by_piece:
        return run_by_piece(
            func, args, kwargs, lambda f, a, k: _dispatch(f, op, a, k), _page_fresh_output
        )
    out = _dispatch(func, op, args, kwargs)
    for paged in paged_pieces(args, kwargs):
        paged.page_out()
    return out


def _page_fresh_output(out, args):
    """A foreach op's new tensor for a paged piece (a temporary an optimizer keeps for its
    next op) is paged too, so no list of them is held in memory."""
    if type(out) is not RowShard or out.paged is not None or out.tier is None:
        return out
    if any(out is arg for value in args for arg in (value if isinstance(value, list) else [value])):
        return out  # an in-place op's own argument
    return _as_paged(out.data_, out)


def _paged_state(func, args, kwargs, like: RowShard) -> RowShard:
    """Optimizer state made from a disk-tier piece, in a file of its own."""
    out = func(*_unwrap_args(args), **(_unwrap_kwargs(kwargs) if kwargs else {}))
    return _as_paged(out, like)


def _as_paged(values: torch.Tensor, like: RowShard) -> RowShard:
    paged = like.tier.allocate(values)
    paged.tensor.copy_(values)
    paged.page_out()
    return RowShard(paged.tensor, like.spec, None, like.mesh_dim, like.tier, paged)


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


def _rewrap(op: OpInfo, out, like, args, func=None, kwargs=None):
    """Give an op's output the rows of its row-shard input, when the op keeps rows (as
    they are, or in another shape: derived_rows.py)."""
    if not isinstance(out, torch.Tensor) or like is None or type(like) is not RowShard:
        return out
    if out is like.data_:  # in-place / out= ops return their (unwrapped) input
        return like
    for arg in args:  # ... possibly not the first one
        if type(arg) is RowShard and out is arg.data_:
            return arg
    # Decided by the op alone, so every rank wraps (or not) alike; a view is kept when it is
    # the identity view (DTensor's to_local/from_local make those).
    if out.dim() != 0 and out.dim() == like.dim():
        if op.keeps_rows or (op.view and out.shape == like.shape):
            if op.aliases:
                return RowShard(
                    out, like.spec, like.version_base, like.mesh_dim, like.tier, like.paged
                )
            return RowShard(out, like.spec, None, like.mesh_dim, like.tier)
    derived = derived_spec(func, args, kwargs, out, like) if func is not None else None
    if derived is None:
        return out
    shares = out.untyped_storage().data_ptr() == like.data_.untyped_storage().data_ptr()
    base = like.version_base if shares else None  # a view (a transpose) writes the buffer
    return RowShard(out, derived, base, like.mesh_dim)


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


def _is_whole_max_norm(args, kwargs) -> bool:
    """`linalg.vector_norm(x, inf)` over all of `x` (torch's per-tensor clipping path)."""
    dim = args[2] if len(args) > 2 else (kwargs or {}).get("dim")
    return dim is None and type(args[0]) is RowShard and _is_max_norm(args, kwargs)


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


def unsupported(what: str) -> str:
    return (
        f"{what} is not supported on flatshard parameters: their Shard(0) pieces are "
        "row ranges set by flatshard's layout, not torch.chunk pieces. Use "
        "`full_tensor()` / `redistribute(placements=[Replicate()])` to get the full tensor, "
        "or `to_local()` for this rank's rows."
    )
