"""Buckets: where every parameter element lives, and what each rank holds of it.

A bucket is one flat 1-D buffer of same-dtype parameters back to back, cut into
`world_size` equal shards. This file translates between the four coordinate systems of
DESIGN.md (param, bucket, shard, global) and gives each rank's `ShardSpec`; packing.py
decides the packing.

Invariants (property-tested in tests/test_layout.py):
- a bucket holds one dtype and one requires_grad value;
- each parameter is a contiguous range [offset, offset + numel) of its bucket, params never
  overlap, and padding lies only between params and at the end;
- every shard cut k * shard_size strictly inside a parameter is on one of its row
  boundaries, so each rank holds a contiguous range of whole rows (possibly none); a row
  is a dim-0 row, or for grouped experts fewer than ranks one dim-1 slice (`row_dims`
  2, in a bucket of its own: each rank's rows then lie in one expert);
- padded_size == world_size * shard_size.

Pure integer arithmetic over shapes: no tensors, no torch.distributed, no per-element loops,
so it runs on models of any size and every rank computes the same answer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

from flatshard.layout.params import ParamInfo
from flatshard.layout.spec import ShardSpec


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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
            min(max(ceil_div(r * self.shard_size - slot.offset, slot.row_size), 0), slot.rows)
            for r in ranks
        )

    def spec(self, slot: ParamSlot, rank: int) -> ShardSpec:
        """What `rank` holds of the param: its rows, where they sit in its shard, their
        global offsets and their intersection with every component."""
        self._check_rank(rank)
        bounds = self.row_bounds(slot)
        start = slot.offset + bounds[rank] * slot.row_size - rank * self.shard_size
        # An empty piece is clamped into the shard so slicing with it is always valid.
        start = min(max(start, 0), self.shard_size)
        return ShardSpec(slot.info, rank, start, bounds)

    def shard_views(self, flat):
        """Every rank's shard of a flat buffer of this bucket's padded size, in rank order."""
        return [flat[a:b] for a, b in map(self.shard_range, range(self.world_size))]

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
        """Flat param offset (row-major over the stored shape: the shard dim first) ->
        multi-dim index in the global tensor."""
        self._check_slot(slot)
        self._check_range("param offset", param_offset, slot.numel)
        index = []
        for dim in reversed(slot.info.stored_shape):
            param_offset, i = divmod(param_offset, dim)
            index.append(i)
        index.reverse()
        d = slot.info.shard_dim
        index = [*index[1 : d + 1], index[0], *index[d + 1 :]] if d else index
        return tuple(o + i for o, i in zip(slot.info.global_offset, index))

    def global_to_param(self, slot: ParamSlot, index: tuple[int, ...]) -> int:
        self._check_slot(slot)
        shape = slot.info.shape
        local = tuple(i - o for i, o in zip(index, slot.info.global_offset))
        if len(index) != len(shape) or any(
            not 0 <= i < d for i, d in zip(local, shape, strict=True)
        ):
            raise ValueError(f"index {index} is outside {slot.info.name!r} in its global tensor")
        d = slot.info.shard_dim
        local = (local[d], *local[:d], *local[d + 1 :]) if d else local
        offset = 0
        for i, dim in zip(local, slot.info.stored_shape, strict=True):
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

    def spec(self, param_index: int, rank: int) -> ShardSpec:
        """What `rank` holds of params[param_index]."""
        bucket, slot = self.locate(param_index)
        return self.buckets[bucket].spec(slot, rank)

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

    def _busy_ranks(self) -> set[int]:
        busy: set[int] = set()
        for bucket in self.buckets:
            for slot in bucket.slots:
                if slot.numel > 0:
                    first = slot.offset // bucket.shard_size
                    last = (slot.end - 1) // bucket.shard_size
                    busy.update(range(first, last + 1))
        return busy

    def empty_ranks(self) -> tuple[int, ...]:
        """Ranks whose shards hold no parameter element in any bucket."""
        busy = self._busy_ranks()
        return tuple(r for r in range(self.world_size) if r not in busy)

    def empty_rank_count(self) -> int:
        """How many ranks hold no parameter element (without listing them)."""
        return self.world_size - len(self._busy_ranks())

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
