"""Which of a rank's parameter pieces live on the host under optimizer offload.

A rank offloads a suffix of each bucket's shard: `[cut, shard_size)`, where `cut` is the
shard offset of one of its pieces (or 0, or shard_size for nothing). A piece is then wholly
on the host or wholly on the device (its sharded parameter is one tensor, stepped where it
lives), each bucket's device and host parts stay flat, and a bucket is moved by at most
two copies. The cuts are chosen over all of a rank's buckets at once (a model's units
together), so that the offloaded elements come as close to the fraction as the pieces
allow: whole buckets first, in the order given (the caller puts first the buckets whose
gradients are ready earliest in backward), then the suffix that comes closest.

Pure integer arithmetic over the rank's `ShardSpec`s: the runtime and the planner run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flatshard.layout.spec import ShardSpec


@dataclass(frozen=True)
class BucketPieces:
    """One rank's pieces of one bucket: (shard offset, elements), and the shard's size."""

    pieces: tuple[tuple[int, int], ...]
    shard_size: int

    @classmethod
    def of(cls, specs: Sequence[ShardSpec], shard_size: int) -> BucketPieces:
        return cls(tuple((s.shard_offset, s.numel) for s in specs if s.numel), shard_size)

    @property
    def elements(self) -> int:
        return sum(numel for _, numel in self.pieces)

    def suffixes(self) -> list[tuple[int, int]]:
        """(cut, elements at or after it) for every cut, largest suffix first."""
        options, total = [], 0
        for offset, numel in sorted(self.pieces, reverse=True):
            total += numel
            options.append((offset, total))
        options = [(cut, size) for cut, size in reversed(options)] + [(self.shard_size, 0)]
        options[0] = (0, options[0][1])  # the whole shard, with its padding
        return options

    def offloaded(self, cut: int) -> int:
        return sum(numel for offset, numel in self.pieces if offset >= cut)


def offload_cuts(buckets: Sequence[BucketPieces], fraction: float) -> list[int]:
    """The host cut of each bucket so that about `fraction` of the elements are offloaded:
    each bucket in turn takes the suffix closest to what is still to offload, so the total
    misses by at most half of the last bucket's finest step."""
    if fraction >= 1.0:
        return [0] * len(buckets)  # everything, padding and empty shards included
    remaining = round(fraction * sum(b.elements for b in buckets))
    cuts = []
    for bucket in buckets:
        # the suffix closest to what is left (the smaller one on a tie)
        cut, size = min(
            bucket.suffixes(), key=lambda option: (abs(remaining - option[1]), option[1])
        )
        cuts.append(cut)
        remaining -= size
    return cuts


def offloaded_fraction(buckets: Sequence[BucketPieces], cuts: Sequence[int]) -> float:
    """The share of the elements the cuts put on the host."""
    total = sum(b.elements for b in buckets)
    return sum(b.offloaded(cut) for b, cut in zip(buckets, cuts)) / total if total else 0.0
