"""Planning a unit's buckets: which parameters share a bucket, their order and offsets,
and the shard size that puts every cut between ranks on a row boundary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from flatshard.errors import LayoutError
from flatshard.layout.bucket import BucketLayout, ParamSlot, UnitLayout, ceil_div
from flatshard.layout.params import ParamInfo

# A merge of two buckets that costs padding is still taken while the merged bucket stays
# under this padding fraction: fewer buckets mean fewer, larger collectives.
MERGE_TOLERANCE = 0.001
"""The padding fraction a merge of two buckets may cost and still be taken."""


def _round_up(a: int, multiple: int) -> int:
    return ceil_div(a, multiple) * multiple


def _alignment(info: ParamInfo) -> int:
    # A param with no elements is never cut, so it needs no alignment.
    return info.row_size if info.numel > 0 else 1


Member = tuple[int, ParamInfo]  # (index in the planned list, param)


def plan_unit_layout(
    params: Sequence[ParamInfo], world_size: int, bucket_per_param: bool = False
) -> UnitLayout:
    """Lay out a unit's params in row-aligned, equally sharded buckets.

    Params are split by (dtype, requires_grad), grouped by row size (largest first), and
    groups are merged into one bucket only where that costs (almost) no padding: one
    least-common-multiple over incompatible rows (dense next to grouped experts) would pad
    by up to a third. `bucket_per_param` gives each param a bucket of its own instead, so
    every rank holds a piece of every param (optimizer offload of a fraction: fine pieces
    to choose from, see offload.py).

    Grouped experts fewer than ranks take a finer row (`finer_row`) and a bucket of their
    own, so no rank is left empty; the returned layout's params carry the row chosen.
    """
    _check_world_size(world_size)
    params = tuple(finer_row(info, world_size) or info for info in params)
    buckets: list[BucketLayout] = []
    for members in _split_by_kind(params).values():
        finer = [member for member in members if member[1].row_dims > 1]
        members = [member for member in members if member[1].row_dims == 1]
        if bucket_per_param:
            buckets.extend(_build_bucket([member], world_size) for member in members)
        elif members:
            buckets.extend(_merge_groups(_groups_by_row(members), world_size))
        buckets.extend(_build_bucket([member], world_size) for member in finer)
    return UnitLayout(world_size, params, tuple(buckets))


def finer_row(info: ParamInfo, world_size: int) -> ParamInfo | None:
    """`info` with a row of one dim-1 slice, where its dim-0 rows are too few to share.

    A grouped weight `(E, R, C)` with fewer experts than ranks leaves most ranks empty
    when a row is a whole expert. Where the ranks are a multiple `m` of `E` and `m`
    divides `R`, a bucket of its own cut into `E * m` shards gives each rank `R / m` rows
    of one expert: a single box `(1, R / m, C)`, never spanning two experts. Otherwise
    (or when the rows are enough) None: the param keeps its dim-0 rows.
    """
    if (
        info.row_dims != 1
        or info.shard_dim != 0
        or len(info.shape) < 3
        or info.numel == 0
        or info.split_by_components
        or info.shape[0] >= world_size
        or world_size % info.shape[0]
    ):
        return None
    per_expert = world_size // info.shape[0]
    if info.shape[1] % per_expert:
        return None
    return replace(info, row_dims=2)


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
    even_share = ceil_div(used, world_size)
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
