"""Which of a rank's parameter pieces live on the host under optimizer offload.

A rank offloads a suffix of each bucket's shard: `[cut, shard_size)`, where `cut` is the
shard offset of one of its pieces (or 0, or shard_size for nothing). A piece is then wholly
on the host or wholly on the device (its sharded parameter is one tensor, stepped where it
lives), each bucket's device and host parts stay flat, and a bucket is moved by at most
two copies. The cuts are chosen over all of a rank's buckets at once (a model's units
together), so that the offloaded elements come as close to the fraction as the pieces
allow: whole buckets first, in the order given (the caller puts first the buckets whose
gradients are ready earliest in backward), then the largest suffixes that still fit.

A rank's pieces are only as fine as its buckets: packed buckets cut over 8 ranks leave
a rank one piece per transformer block (2.7% of its shards for llama3-8b), so a fraction
strictly between 0 and 1 lays every parameter out in a bucket of its own
(`needs_bucket_per_param`): each rank then holds a piece of every parameter, and the cuts
land within a small parameter's piece of the fraction (0.5M of a rank's 1B elements). It
costs more, smaller collectives; 0 and 1 keep the packed buckets.

Pure integer arithmetic over the rank's `ShardSpec`s: the runtime and the planner run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flatshard.layout.spec import ShardSpec


def needs_bucket_per_param(fraction: float) -> bool:
    return 0.0 < fraction < 1.0


@dataclass(frozen=True)
class BucketPieces:
    """One rank's pieces of one bucket: (shard offset, elements), and the shard's size."""

    pieces: tuple[tuple[int, int], ...]
    shard_size: int

    @classmethod
    def of(cls, specs: Sequence[ShardSpec], shard_size: int) -> BucketPieces:
        return cls(tuple((s.shard_offset, s.numel) for s in specs), shard_size)

    @property
    def elements(self) -> int:
        return sum(numel for _, numel in self.pieces)

    def suffixes(self) -> list[tuple[int, int]]:
        """(cut, elements at or after it) for every cut, largest suffix first."""
        options, total = [], 0
        for offset, numel in sorted((p for p in self.pieces if p[1]), reverse=True):
            total += numel
            options.append((offset, total))
        options = [(cut, size) for cut, size in reversed(options)] + [(self.shard_size, 0)]
        options[0] = (0, options[0][1])  # the whole shard, with its padding
        return options

    def offloaded(self, cut: int) -> int:
        return sum(numel for offset, numel in self.pieces if offset >= cut)


def offload_cuts(buckets: Sequence[BucketPieces], fraction: float) -> list[int]:
    """The host cut of each bucket so that about `fraction` of the elements are offloaded:
    each bucket in turn takes the largest suffix that does not exceed what is still to
    offload; then the one bucket change that brings the total closest is made."""
    if fraction >= 1.0:
        return [0] * len(buckets)  # everything, padding and empty shards included
    target = round(fraction * sum(b.elements for b in buckets))
    remaining = target
    chosen = []
    for bucket in buckets:
        cut, size = next(option for option in bucket.suffixes() if option[1] <= remaining)
        chosen.append((cut, size))
        remaining -= size
    if remaining > 0:  # short of the target: one bucket may take a larger suffix
        best = None
        for index, bucket in enumerate(buckets):
            for cut, size in bucket.suffixes():
                error = abs(remaining - (size - chosen[index][1]))
                if error < remaining and (best is None or error < best[0]):
                    best = (error, index, (cut, size))
        if best is not None:
            chosen[best[1]] = best[2]
    return [cut for cut, _ in chosen]


def offloaded_fraction(buckets: Sequence[BucketPieces], cuts: Sequence[int]) -> float:
    """The share of the elements the cuts put on the host."""
    total = sum(b.elements for b in buckets)
    return sum(b.offloaded(cut) for b, cut in zip(buckets, cuts)) / total if total else 0.0
