"""Row shards: the local tensor of every flatshard DTensor.

flatshard's `Shard(0)` pieces follow the layout, not `torch.chunk`: rank r holds rows
`[row_bounds[r], row_bounds[r+1])`. DTensor itself only knows chunk-style unevenness, so the
local tensor carries the true row bounds. The metadata survives the ops an optimizer or a
state dict applies (detach, zeros_like, pointwise and foreach math), so parameters,
gradients and optimizer states all know where their rows sit globally, with no
communication.

DTensor redistribution of such a tensor is routed here: `Shard(0) -> Replicate` (what
`full_tensor()` and full state dicts use) gathers by the true bounds; any other
redistribution raises `UnevenShardError` on every rank alike, before any collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from flatshard.errors import UnevenShardError


class RowShard(torch.Tensor):
    """A plain tensor (`data`) holding rows `[row_bounds[index], row_bounds[index+1])` of a
    tensor sharded on dim 0 across `len(row_bounds) - 1` ranks."""

    data_: torch.Tensor
    row_bounds: tuple[int, ...]
    index: int
    # The flat buffer this piece is a view of. Ops run below autograd here, where views do
    # not share version counters: writes bump the base's counter explicitly.
    version_base: torch.Tensor | None

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        row_bounds: tuple[int, ...],
        index: int,
        version_base: torch.Tensor | None = None,
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
        wrapper.row_bounds = row_bounds
        wrapper.index = index
        wrapper.version_base = version_base
        return wrapper

    def __init__(self, data, row_bounds, index, version_base=None):  # set in __new__
        super().__init__()

    @property
    def row_start(self) -> int:
        return self.row_bounds[self.index]

    def __repr__(self):
        return f"RowShard(rows={self.row_start}:{self.row_bounds[self.index + 1]}, {self.data_!r})"

    # --- DCP: this rank's chunk is known from the row bounds, with no communication --------
    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        if self.shape[0] == 0:
            return []  # an empty piece writes and reads nothing
        offsets = torch.Size((self.row_start,) + (0,) * (self.dim() - 1))
        return [ChunkStorageMetadata(offsets=offsets, sizes=self.shape)]

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
                    size=dtensor.size(),
                ),
            )
            for chunk in self.__create_chunk_list__()
        ]

    def __get_tensor_shard__(self, index):
        return self.data_  # DCP reads from it on save and loads into it in place

    def __tensor_flatten__(self):
        return ["data_"], (self.row_bounds, self.index)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return RowShard(inner["data_"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("_c10d_functional", "c10d", "_dtensor"):
            # A collective on row shards means DTensor took its chunk-based path.
            raise UnevenShardError(_unsupported(f"the collective {func}"))
        shards = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, RowShard)]
        inner_of = {id(s.data_): s for s in shards}
        unwrap = lambda t: t.data_
        plain_args = tree_map_only(RowShard, unwrap, args)
        plain_kwargs = tree_map_only(RowShard, unwrap, kwargs)
        out = func(*plain_args, **plain_kwargs)
        _bump_written(func, args, kwargs)
        keeps_rows = _keeps_rows(func)

        def rewrap(t, like):
            if id(t) in inner_of:  # in-place / out= ops return their (unwrapped) input
                return inner_of[id(t)]
            # Decided by the op alone, so every rank wraps (or not) alike; a view is kept
            # when it is the identity view (DTensor's to_local/from_local make those).
            if like is None or t.dim() == 0 or t.dim() != like.dim():
                return t
            if keeps_rows or (func in _VIEWS and t.shape == like.shape):
                aliases = func in _VIEWS or func.name().split("::")[1].split(".")[0] in _ALIASES
                base = like.version_base if aliases else None
                return RowShard(t, like.row_bounds, like.index, base)
            return t

        if func.name().split("::")[1].startswith("_foreach_") and isinstance(out, (list, tuple)):
            # foreach: output i has the rows of the i-th tensor of the first list argument
            firsts = args[0] if isinstance(args[0], (list, tuple)) else [None] * len(out)
            return type(out)(
                rewrap(o, f if isinstance(f, RowShard) else None)
                if isinstance(o, torch.Tensor)
                else o
                for o, f in zip(out, firsts)
            )
        flat_out, spec = tree_flatten(out)
        like = shards[0] if shards else None
        flat_out = [rewrap(o, like) if isinstance(o, torch.Tensor) else o for o in flat_out]
        return tree_unflatten(flat_out, spec)


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


def _keeps_rows(func) -> bool:
    name = func.name().split("::")[1].split(".")[0]
    return torch.Tag.pointwise in func.tags or name.startswith("_foreach_") or name in _ROW_KEEPING


def _bump_written(func, args, kwargs) -> None:
    """Bump the version of every flat buffer an in-place op wrote into, so writes to the
    sharded weights are visible (that is how a unit knows its gathered copy is stale)."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written = value if isinstance(value, (list, tuple)) else [value]
        bases = [
            t.version_base
            for t in written
            if isinstance(t, RowShard) and t.version_base is not None
        ]
        if bases:
            torch.autograd.graph.increment_version(bases)


def _unsupported(what: str) -> str:
    return (
        f"{what} is not supported on flatshard parameters: their Shard(0) pieces are "
        "row ranges set by flatshard's layout, not torch.chunk pieces. Use "
        "`full_tensor()` / `redistribute(placements=[Replicate()])` to get the full tensor, "
        "or `to_local()` for this rank's rows."
    )


def gather_rows(shard: RowShard, group: dist.ProcessGroup) -> torch.Tensor:
    """All ranks' rows, concatenated in rank order: one all-gather padded to the longest piece."""
    bounds = shard.row_bounds
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    row_shape = tuple(shard.shape[1:])
    row_numel = 1
    for size in row_shape:
        row_numel *= size
    longest = max(counts)
    send = torch.zeros(longest * row_numel, dtype=shard.dtype, device=shard.device)
    send[: counts[shard.index] * row_numel].copy_(shard.data_.reshape(-1))
    received = torch.empty(
        longest * row_numel * len(counts), dtype=shard.dtype, device=shard.device
    )
    dist.all_gather_single(received, send, group=group)
    received = received.view(len(counts), longest, *row_shape)
    if all(n == longest for n in counts):
        return received.view(-1, *row_shape)  # no padding to squeeze out: no copy
    return torch.cat([received[r, :n] for r, n in enumerate(counts)])


_original_redistribute = None


def _redistribute_local_tensor(local_tensor, current_spec, target_spec, **kwargs):
    if not isinstance(local_tensor, RowShard):
        return _original_redistribute(local_tensor, current_spec, target_spec, **kwargs)
    current, target = tuple(current_spec.placements), tuple(target_spec.placements)
    if current == target:
        return local_tensor
    if current == (Shard(0),) and target == (Replicate(),):
        return gather_rows(local_tensor, current_spec.mesh.get_group(0))
    raise UnevenShardError(_unsupported(f"redistributing {current} -> {target}"))


def install_redistribute_override() -> None:
    """Route DTensor redistribution of row shards through `_redistribute_local_tensor`.

    DTensor calls `redistribute_local_tensor` from three modules (explicit `redistribute`,
    the autograd function, implicit redistribution during op dispatch); each gets the
    wrapper, which only changes behaviour for `RowShard` local tensors.
    """
    global _original_redistribute
    if _original_redistribute is not None:
        return
    from torch.distributed.tensor import _api, _dispatch, _redistribute

    _original_redistribute = _redistribute.redistribute_local_tensor
    for module in (_api, _dispatch, _redistribute):
        module.redistribute_local_tensor = _redistribute_local_tensor


def row_range(param: DTensor) -> tuple[int, int]:
    """The global rows `[start, end)` of a flatshard DTensor that this rank holds."""
    local = param._local_tensor if isinstance(param, DTensor) else None
    if not isinstance(local, RowShard):
        raise TypeError(f"expected a flatshard-sharded DTensor, got {type(param).__name__}")
    return local.row_start, local.row_bounds[local.index + 1]


def local_data(dtensor: DTensor) -> torch.Tensor:
    """The plain tensor behind a DTensor's local shard."""
    local = dtensor._local_tensor
    return local.data_ if isinstance(local, RowShard) else local


def make_row_sharded_dtensor(
    local: torch.Tensor,
    mesh,
    global_shape: tuple[int, ...],
    row_bounds: tuple[int, ...],
    index: int,
    version_base: torch.Tensor | None = None,
) -> DTensor:
    """A `Shard(0)` DTensor whose local tensor is `local` (a view of `version_base`)."""
    strides = []
    step = 1
    for size in reversed(global_shape):
        strides.append(step)
        step *= size
    return DTensor.from_local(
        RowShard(local, row_bounds, index, version_base),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size(global_shape),
        stride=tuple(reversed(strides)),
    )
