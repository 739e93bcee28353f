"""Row-aligned bucket layout: where every parameter element lives.

The layout is the only place that computes offsets. Given a unit's parameters (shapes,
dtypes, requires_grad) and a world size, it packs them into flat 1-D buckets, cuts each
bucket into `world_size` equal shards, and translates between the four coordinate systems
(param, bucket, shard, global) described in DESIGN.md.

Invariants (property-tested in tests/test_layout.py):
- a bucket holds one dtype and one requires_grad value;
- each parameter is a contiguous range [offset, offset + numel) of its bucket, params never
  overlap, and padding lies only between params and at the end;
- every shard cut k * shard_size strictly inside a parameter is on one of its row
  boundaries, so each rank holds a contiguous range of whole rows (possibly none);
- padded_size == world_size * shard_size.

Pure integer arithmetic over shapes: no tensors, no torch.distributed, no per-element loops,
so it runs on models of any size and every rank computes the same answer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from flatshard.errors import LayoutError

# A merge of two buckets that costs padding is still taken while the merged bucket stays
# under this padding fraction: fewer buckets mean fewer, larger collectives.
MERGE_TOLERANCE = 0.001


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, multiple: int) -> int:
    return _ceil_div(a, multiple) * multiple


@dataclass(frozen=True)
class ParamInfo:
    """What the layout needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: object
    requires_grad: bool = True

    def __post_init__(self) -> None:
        # Accept torch.Size / lists, but store a plain tuple so equality and hashing are exact.
        try:
            shape = tuple(int(d) for d in self.shape)
        except TypeError as err:
            raise LayoutError(
                f"parameter {self.name!r}: shape {self.shape!r} is not a sequence of ints"
            ) from err
        if any(d < 0 for d in shape):
            raise LayoutError(f"parameter {self.name!r}: shape {shape} has a negative dim")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_size(self) -> int:
        """Elements per dim-0 row; 1 for 0-d and 1-d params, 0 if a trailing dim is 0."""
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else 1

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


def _alignment(info: ParamInfo) -> int:
    # A param with no elements is never cut, so it needs no alignment.
    return info.row_size if info.numel > 0 else 1


@dataclass(frozen=True)
class ParamSlot:
    """One parameter placed in a bucket."""

    index: int
    info: ParamInfo
    offset: int

    @property
    def numel(self) -> int:
        return self.info.numel

    @property
    def row_size(self) -> int:
        return self.info.row_size

    @property
    def rows(self) -> int:
        return self.info.rows

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class LocalPiece:
    """What one rank holds of one parameter: whole rows [row_start, row_end)."""

    shard_offset: int
    numel: int
    row_start: int
    row_end: int


@dataclass(frozen=True)
class BucketLayout:
    """One flat buffer of same-dtype params, cut into world_size equal shards."""

    dtype: object
    requires_grad: bool
    world_size: int
    shard_size: int
    slots: tuple[ParamSlot, ...]

    @property
    def padded_size(self) -> int:
        return self.world_size * self.shard_size

    @property
    def used_size(self) -> int:
        return sum(slot.numel for slot in self.slots)

    @property
    def padding(self) -> int:
        return self.padded_size - self.used_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        self._check_rank(rank)
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def row_bounds(self, slot: ParamSlot) -> tuple[int, ...]:
        """Rank r holds rows [b[r], b[r+1]) of the param."""
        self._check_slot(slot)
        ranks = range(self.world_size + 1)
        if slot.row_size == 0:
            # Rows of zero elements (shape (n, 0, ...)): all go to the rank at the param's
            # offset, so the local row counts still add up to shape[0].
            holder = self._rank_at(slot.offset)
            return tuple(0 if r <= holder else slot.rows for r in ranks)
        # Rows starting before cut r*S belong to ranks < r; a row never straddles a cut.
        return tuple(
            min(max(_ceil_div(r * self.shard_size - slot.offset, slot.row_size), 0), slot.rows)
            for r in ranks
        )

    def local_piece(self, slot: ParamSlot, rank: int) -> LocalPiece:
        self._check_rank(rank)
        bounds = self.row_bounds(slot)
        row_start, row_end = bounds[rank], bounds[rank + 1]
        start = slot.offset + row_start * slot.row_size - rank * self.shard_size
        # An empty piece is clamped into the shard so slicing with it is always valid.
        start = min(max(start, 0), self.shard_size)
        return LocalPiece(start, (row_end - row_start) * slot.row_size, row_start, row_end)

    # -- coordinate translations ------------------------------------------------------

    def bucket_to_shard(self, bucket_offset: int) -> tuple[int, int]:
        self._check_range("bucket offset", bucket_offset, self.padded_size)
        return divmod(bucket_offset, self.shard_size)

    def shard_to_bucket(self, rank: int, shard_offset: int) -> int:
        self._check_rank(rank)
        self._check_range("shard offset", shard_offset, self.shard_size)
        return rank * self.shard_size + shard_offset

    def bucket_to_param(self, bucket_offset: int) -> tuple[ParamSlot, int] | None:
        """The param element at a bucket offset, or None when it is padding."""
        self._check_range("bucket offset", bucket_offset, self.padded_size)
        starts, filled = self._filled_slots
        i = bisect.bisect_right(starts, bucket_offset) - 1
        if i >= 0 and bucket_offset < filled[i].end:
            return filled[i], bucket_offset - filled[i].offset
        return None

    def param_to_bucket(self, slot: ParamSlot, param_offset: int) -> int:
        self._check_slot(slot)
        self._check_range("param offset", param_offset, slot.numel)
        return slot.offset + param_offset

    def param_to_global(self, slot: ParamSlot, param_offset: int) -> tuple[int, ...]:
        """Flat param offset -> multi-dim index in the param's shape (row-major)."""
        self._check_slot(slot)
        self._check_range("param offset", param_offset, slot.numel)
        index = []
        for dim in reversed(slot.info.shape):
            param_offset, i = divmod(param_offset, dim)
            index.append(i)
        return tuple(reversed(index))

    def global_to_param(self, slot: ParamSlot, index: tuple[int, ...]) -> int:
        self._check_slot(slot)
        shape = slot.info.shape
        if len(index) != len(shape) or any(
            not 0 <= i < d for i, d in zip(index, shape, strict=True)
        ):
            raise ValueError(f"index {index} is outside shape {shape} of {slot.info.name!r}")
        offset = 0
        for i, dim in zip(index, shape, strict=True):
            offset = offset * dim + i
        return offset

    # -- helpers ------------------------------------------------------------------------

    def _rank_at(self, bucket_offset: int) -> int:
        # The end of the bucket (an empty param placed last) counts as the last rank's.
        if self.shard_size == 0:
            return 0
        return min(bucket_offset // self.shard_size, self.world_size - 1)

    @cached_property
    def _filled_slots(self) -> tuple[list[int], list[ParamSlot]]:
        # Slots with elements, by offset: what bucket_to_param searches.
        filled = sorted((s for s in self.slots if s.numel > 0), key=lambda s: s.offset)
        return [s.offset for s in filled], filled

    @cached_property
    def _slot_set(self) -> frozenset[ParamSlot]:
        return frozenset(self.slots)

    def _check_slot(self, slot: ParamSlot) -> None:
        if slot not in self._slot_set:
            raise ValueError(f"slot of {slot.info.name!r} is not in this bucket")

    def _check_rank(self, rank: int) -> None:
        self._check_range("rank", rank, self.world_size)

    @staticmethod
    def _check_range(what: str, value: int, size: int) -> None:
        if not 0 <= value < size:
            raise ValueError(f"{what} {value} is outside [0, {size})")


@dataclass(frozen=True)
class UnitLayout:
    """All buckets of one unit (one `fully_shard(module)` call)."""

    world_size: int
    params: tuple[ParamInfo, ...]
    buckets: tuple[BucketLayout, ...]

    def locate(self, param_index: int) -> tuple[int, ParamSlot]:
        """(bucket index, slot) of params[param_index]."""
        if param_index not in self._locations:
            raise ValueError(f"param index {param_index} is outside [0, {len(self.params)})")
        return self._locations[param_index]

    @property
    def used_size(self) -> int:
        return sum(b.used_size for b in self.buckets)

    @property
    def padded_size(self) -> int:
        return sum(b.padded_size for b in self.buckets)

    @property
    def padding(self) -> int:
        return self.padded_size - self.used_size

    @property
    def padding_fraction(self) -> float:
        used = self.used_size
        return self.padding / used if used else 0.0

    def empty_ranks(self) -> tuple[int, ...]:
        """Ranks whose shards hold no parameter element in any bucket."""
        busy: set[int] = set()
        for bucket in self.buckets:
            for slot in bucket.slots:
                if slot.numel > 0:
                    first = slot.offset // bucket.shard_size
                    last = (slot.end - 1) // bucket.shard_size
                    busy.update(range(first, last + 1))
        return tuple(r for r in range(self.world_size) if r not in busy)

    def report(self) -> str:
        lines = [f"layout for world_size {self.world_size}, {len(self.params)} params:"]
        for i, b in enumerate(self.buckets):
            row_sizes = sorted({s.row_size for s in b.slots}, reverse=True)
            lines.append(
                f"  bucket {i}: dtype={b.dtype} requires_grad={b.requires_grad} "
                f"params={len(b.slots)} row_sizes={row_sizes} used={b.used_size:,} "
                f"padded={b.padded_size:,} padding={_percent(b.padding, b.used_size)} "
                f"shard_size={b.shard_size:,}"
            )
        lines.append(
            f"  total: used={self.used_size:,} padded={self.padded_size:,} "
            f"padding={_percent(self.padding, self.used_size)} buckets={len(self.buckets)}"
        )
        empty = self.empty_ranks()
        if empty and self.used_size:
            lines.append(f"  ranks holding no parameter element: {len(empty)} of {self.world_size}")
        return "\n".join(lines)

    @cached_property
    def _locations(self) -> dict[int, tuple[int, ParamSlot]]:
        return {s.index: (i, s) for i, b in enumerate(self.buckets) for s in b.slots}


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.3f}%" if whole else "0.000%"


# -- planning -----------------------------------------------------------------------------

Member = tuple[int, ParamInfo]  # (index in the planned list, param)


def plan_unit_layout(params: Sequence[ParamInfo], world_size: int) -> UnitLayout:
    """Lay out a unit's params in row-aligned, equally sharded buckets.

    Params are split by (dtype, requires_grad), grouped by row size (largest first), and
    groups are merged into one bucket only where that costs (almost) no padding: one
    least-common-multiple over incompatible rows (dense next to grouped experts) would pad
    by up to a third.
    """
    _check_world_size(world_size)
    params = tuple(params)
    buckets: list[BucketLayout] = []
    for members in _split_by_kind(params).values():
        buckets.extend(_merge_groups(_groups_by_row(members), world_size))
    return UnitLayout(world_size, params, tuple(buckets))


def single_lcm_padded_size(params: Sequence[ParamInfo], world_size: int) -> int:
    """Padded size under the naive rule, for reports: one bucket per (dtype, requires_grad),
    padded to a multiple of world_size x lcm(all its row sizes)."""
    _check_world_size(world_size)
    total = 0
    for members in _split_by_kind(tuple(params)).values():
        used = sum(info.numel for _, info in members)
        row_lcm = math.lcm(*(_alignment(info) for _, info in members))
        total += _round_up(used, world_size * row_lcm)
    return total


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"world_size must be an int >= 1, got {world_size!r}")


def _split_by_kind(params: tuple[ParamInfo, ...]) -> dict[tuple, list[Member]]:
    # Insertion order (first appearance) keeps the result a pure function of the list.
    kinds: dict[tuple, list[Member]] = {}
    for index, info in enumerate(params):
        kinds.setdefault((info.dtype, info.requires_grad), []).append((index, info))
    return kinds


def _groups_by_row(members: list[Member]) -> list[list[Member]]:
    """One group per alignment row size, largest rows first (they are the hardest to fit)."""
    groups: dict[int, list[Member]] = {}
    for member in members:
        groups.setdefault(_alignment(member[1]), []).append(member)
    return [groups[row] for row in sorted(groups, reverse=True)]


def _merge_groups(groups: list[list[Member]], world_size: int) -> list[BucketLayout]:
    """Greedily add each group to the existing bucket where it costs least, if cheap."""
    buckets: list[BucketLayout] = []
    for group in groups:
        alone = _build_bucket(group, world_size)
        best, best_extra = None, 0
        for i, bucket in enumerate(buckets):
            merged = _build_bucket(_members(bucket) + group, world_size)
            extra = merged.padding - bucket.padding - alone.padding
            cheap = extra <= 0 or merged.padding <= MERGE_TOLERANCE * merged.used_size
            if cheap and (best is None or extra < best_extra):
                best, best_extra = (i, merged), extra
        if best is None:
            buckets.append(alone)
        else:
            buckets[best[0]] = best[1]
    return buckets


def _members(bucket: BucketLayout) -> list[Member]:
    return [(slot.index, slot.info) for slot in bucket.slots]


def _build_bucket(members: list[Member], world_size: int) -> BucketLayout:
    """Smallest shard size whose packing puts every cut on a row boundary.

    A parameter longer than a shard may hold two cuts, which are then both on row
    boundaries only if the shard size is a multiple of its row size: the shard size is a
    multiple of the lcm of those rows. Shorter parameters hold at most one cut, which a
    small gap before the parameter moves onto a row boundary.
    """
    _, first = members[0]
    # Largest rows first: small rows then fill gaps before cuts cheaply.
    order = sorted(members, key=lambda m: (-_alignment(m[1]), m[0]))
    used = sum(info.numel for _, info in order)
    even_share = _ceil_div(used, world_size)
    long_rows = [_alignment(info) for _, info in order if info.numel > even_share]
    # With one rank there are no cuts, so no alignment and no padding are needed.
    step = 1 if world_size == 1 else math.lcm(1, *long_rows)
    shard_size = _round_up(even_share, step)
    while True:
        slots, end = _pack(order, shard_size, world_size)
        if end <= world_size * shard_size:
            return BucketLayout(first.dtype, first.requires_grad, world_size, shard_size, slots)
        # Alignment gaps pushed the end past the last shard: grow the shards.
        shard_size += step


def _pack(
    order: list[Member], shard_size: int, world_size: int
) -> tuple[tuple[ParamSlot, ...], int]:
    """Place params back to back; shift one only where a cut would split a row."""
    slots, cursor = [], 0
    for index, info in order:
        if info.numel > 0 and _crosses_cut(cursor, info.numel, shard_size, world_size):
            row = _alignment(info)
            if shard_size % row == 0:
                # every cut is then on a row boundary of a row-aligned start
                cursor = _round_up(cursor, row)
            else:
                # no longer than a shard (see _build_bucket): one cut, moved onto a row edge
                cut = (cursor // shard_size + 1) * shard_size
                cursor += (cut - cursor) % row
        slots.append(ParamSlot(index, info, cursor))
        cursor += info.numel
    return tuple(slots), cursor


def _crosses_cut(start: int, numel: int, shard_size: int, world_size: int) -> bool:
    next_cut = start // shard_size + 1
    return next_cut < world_size and next_cut * shard_size < start + numel
