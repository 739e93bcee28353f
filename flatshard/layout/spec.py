"""`ShardSpec`: everything one rank needs to know about its piece of one parameter.

Computed by the layout (`BucketLayout.spec`) from the parameter's place in its bucket; the
runtime, the DTensor integration (DCP chunks, full-tensor gathers), checkpoints, Hugging
Face slicing, meta-device materialisation and the sharded embedding lookup read it and
never recompute an offset from a tensor's own `shape` or `numel()`. A plain-tensor
optimizer state has a local numel and a DTensor a global one: only the spec knows both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from flatshard.layout.params import ParamInfo


@dataclass(frozen=True)
class Box:
    """A block of a tensor: `offset` and `shape`, one entry per dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape))

    @property
    def empty(self) -> bool:
        return any(n == 0 for n in self.shape)

    def intersection(self, other: Box) -> Box | None:
        """The block both hold (None: they do not meet)."""
        low = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        high = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape)
        )
        if any(h <= lo for lo, h in zip(low, high)):
            return None
        return Box(low, tuple(h - lo for lo, h in zip(low, high)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Where this block lies in `outer`'s own indices (`outer` holds it)."""
        return tuple(
            slice(o - p, o - p + n) for o, p, n in zip(self.offset, outer.offset, self.shape)
        )


@dataclass(frozen=True)
class ComponentPiece:
    """What a rank's piece holds of one component: `local` indexes the rank's local rows,
    `stored` the component's own (checkpoint) tensor of `stored_shape`."""

    name: str
    local: Box
    stored: Box
    stored_shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardSpec:
    """Rank `rank`'s piece of parameter `info`: its rows `[row_start, row_end)` of the
    parameter, stored at `shard_offset` of the rank's bucket shard.

    A row is what `info.row_dims` says: a dim-0 row, or (grouped experts fewer than ranks)
    a dim-1 slice, rows then counted over the flattened first two dims. Either way the
    piece is one box of the parameter (`param_box`): whole dim-0 rows, or some dim-1 rows
    of one expert, `(1, n, C)`.

    row_bounds: every rank's rows (rank r holds `[row_bounds[r], row_bounds[r+1])`), so a
        full tensor is gathered with no communication about sizes.
    """

    info: ParamInfo
    rank: int
    shard_offset: int
    row_bounds: tuple[int, ...]

    @property
    def row_start(self) -> int:
        return self.row_bounds[self.rank]

    @property
    def row_end(self) -> int:
        return self.row_bounds[self.rank + 1]

    @property
    def local_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def row_size(self) -> int:
        return self.info.row_size

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row (what a full-tensor gather moves, row by row)."""
        return self.info.row_shape

    @property
    def numel(self) -> int:
        return self.local_rows * self.info.row_size

    @cached_property
    def param_box(self) -> Box:
        """The piece as one box of the (local) parameter."""
        shape, start, rows = self.info.shape, self.row_start, self.local_rows
        if not shape:
            return Box((), ())
        if self.info.row_dims == 1:
            d = self.info.shard_dim
            offset = tuple(start if i == d else 0 for i in range(len(shape)))
            return Box(offset, tuple(rows if i == d else n for i, n in enumerate(shape)))
        per_expert, rest = shape[1], (0,) * (len(shape) - 2)
        expert, first = divmod(start, per_expert)
        if rows == 0 or (first == 0 and rows % per_expert == 0):  # whole experts
            return Box((expert, 0, *rest), (rows // per_expert, per_expert, *shape[2:]))
        if first + rows > per_expert:
            raise ValueError(
                f"{self.info.name!r}: rows {start}:{self.row_end} of dim-1 slices span two "
                "experts; the layout never cuts them so"
            )
        return Box((expert, first, *rest), (1, rows, *shape[2:]))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.param_box.shape

    @property
    def stored_local_shape(self) -> tuple[int, ...]:
        """The piece as the flat buffers hold it (`local_shape` with the shard dim first;
        the same for `shard_dim` 0)."""
        if self.info.shard_dim == 0 or not self.info.shape:
            return self.local_shape
        return (self.local_rows, *self.info.row_shape)

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.info.global_shape

    @property
    def global_offset(self) -> tuple[int, ...]:
        """Where this piece starts in the global tensor, in every dim."""
        return tuple(o + i for o, i in zip(self.info.global_offset, self.param_box.offset))

    @property
    def global_box(self) -> Box:
        """The piece as one block of the global tensor (not for a parameter split by
        components: see `pieces`)."""
        if self.info.split_by_components:
            raise ValueError(
                f"{self.info.name!r} holds a part of each of its components: it is not one "
                "block of its global tensor (use ShardSpec.pieces)"
            )
        return Box(self.global_offset, self.local_shape)

    @property
    def pieces(self) -> tuple[tuple[Box, Box], ...]:
        """(local box, global box) of every block this rank holds of the global tensor:
        one, or one per component for a parameter split by components (empty ones left
        out)."""
        if not self.info.split_by_components:
            box = Box(self.global_offset, self.local_shape)
            return () if box.empty else ((self.local_box, box),)
        out = []
        for component, piece in zip(self.info.components, self.components):
            if piece.local.empty:
                continue
            offset = list(piece.stored.offset)
            offset[component.dim] += component.fused_start
            out.append((piece.local, Box(tuple(offset), piece.stored.shape)))
        return tuple(out)

    @property
    def local_box(self) -> Box:
        """The whole local piece, as a box of itself."""
        return Box((0,) * len(self.local_shape), self.local_shape)

    @property
    def global_row_counts(self) -> tuple[int, ...]:
        """Rows each rank holds, in rank order (what a full-tensor gather receives)."""
        return tuple(b - a for a, b in zip(self.row_bounds, self.row_bounds[1:]))

    @property
    def first_chunk_shape(self) -> tuple[int, ...]:
        """The piece of the (local) parameter that `torch.chunk` gives the first rank
        (FSDP2's `Shard(0)`): what FSDP2's random initialisation draws for on every rank
        that holds a full chunk."""
        shape, ranks, d = self.info.shape, len(self.row_bounds) - 1, self.info.shard_dim
        rows = min(shape[d], -(-shape[d] // ranks))
        return tuple(rows if i == d else n for i, n in enumerate(shape))

    @property
    def global_strides(self) -> tuple[int, ...]:
        """Strides of the contiguous global tensor."""
        return contiguous_strides(self.global_shape)

    @property
    def components(self) -> tuple[ComponentPiece, ...]:
        """The intersection of this piece with each declared component (empty ones too)."""
        return tuple(self._component_piece(c) for c in self.info.components)

    def component(self, name: str) -> ComponentPiece:
        return self._component_piece(self.info.component(name))

    def _component_piece(self, component) -> ComponentPiece:
        # The piece's box in parameter coordinates, cut by the component's slab.
        box = self.param_box
        low = list(box.offset)
        high = [o + n for o, n in zip(box.offset, box.shape)]
        low[component.dim] = max(low[component.dim], component.start)
        high[component.dim] = min(high[component.dim], component.stop)
        high = [max(h, lo) for h, lo in zip(high, low)]
        shape = tuple(h - lo for h, lo in zip(high, low))
        local = Box(tuple(lo - o for lo, o in zip(low, box.offset)), shape)
        in_slab = [lo - (component.start if d == component.dim else 0) for d, lo in enumerate(low)]
        stored = Box(tuple(o + i for o, i in zip(component.global_offset, in_slab)), shape)
        return ComponentPiece(component.name, local, stored, component.global_shape)

    def rows_of(self, param_tensor):
        """This rank's rows of a tensor shaped like the (local) parameter."""
        if not self.info.shape:
            return param_tensor[self.row_start : self.row_end]
        return param_tensor[self.param_box.slices]

    def piece_of(self, global_tensor):
        """This rank's piece of a tensor shaped like the global tensor (a view when it is
        one block)."""
        if not self.info.split_by_components:
            return global_tensor[self.global_box.slices]
        out = global_tensor.new_empty(self.local_shape)
        for local, stored in self.pieces:
            out[local.slices] = global_tensor[stored.slices]
        return out

    def to_local_row(self, global_row):
        """A global dim-0 row index (an int or an index tensor) in this rank's local rows
        (a piece of whole dim-0 rows: an embedding table)."""
        if self.info.row_dims != 1 or self.info.shard_dim != 0:
            raise ValueError(f"{self.info.name!r} is not sharded by dim-0 rows")
        return global_row - self.global_offset[0]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def whole_param_spec(info: ParamInfo) -> ShardSpec:
    """The spec of a parameter that one rank holds whole (not sharded)."""
    return ShardSpec(info, rank=0, shard_offset=0, row_bounds=(0, info.rows))
