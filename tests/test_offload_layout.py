"""Which pieces optimizer offload puts on the host (layout/offload.py): whole pieces, a
suffix of each bucket's shard, as close to the fraction as the pieces allow; on real
models within 1% (the planner runs the same choice)."""

from __future__ import annotations

import json
import random

import pytest
from test_cli_helpers import check_ok, flatshard

from flatshard.layout.offload import BucketPieces, offload_cuts, offloaded_fraction


def _random_buckets(rng: random.Random) -> list[BucketPieces]:
    buckets = []
    for _ in range(rng.randint(1, 6)):
        offset, pieces = 0, []
        for _ in range(rng.randint(0, 5)):
            numel = rng.choice([0, rng.randint(1, 100)])
            pieces.append((offset, numel))
            offset += numel + rng.randint(0, 3)  # alignment gaps
        buckets.append(BucketPieces(tuple(pieces), offset + rng.randint(0, 4)))
    return buckets


@pytest.mark.parametrize("seed", range(40))
def test_cuts_are_piece_boundaries_and_land_near_the_fraction(seed):
    rng = random.Random(seed)
    buckets = _random_buckets(rng)
    fraction = rng.choice([0.0, 1.0, rng.random()])
    cuts = offload_cuts(buckets, fraction)
    total = sum(b.elements for b in buckets)
    for bucket, cut in zip(buckets, cuts):
        starts = {offset for offset, numel in bucket.pieces if numel}
        assert cut in starts | {0, bucket.shard_size}  # a piece is wholly on one side
    offloaded = sum(b.offloaded(cut) for b, cut in zip(buckets, cuts))
    if fraction == 1.0:
        assert cuts == [0] * len(buckets)
    elif fraction == 0.0:
        assert offloaded == 0
    else:  # short of (or past) the target by less than one piece
        pieces = [numel for b in buckets for _, numel in b.pieces if numel]
        assert abs(offloaded - round(fraction * total)) < max(pieces, default=1), seed


def test_pieces_of_one_element_hit_the_fraction_exactly():
    buckets = [BucketPieces(tuple((i, 1) for i in range(n)), n + 1) for n in (7, 3, 11, 5)]
    for fraction in (0.1, 0.25, 0.5, 0.77):
        cuts = offload_cuts(buckets, fraction)
        assert sum(b.offloaded(c) for b, c in zip(buckets, cuts)) == round(fraction * 26)


def test_fraction_of_a_real_model_within_one_percent():
    """llama3-8b over 8 ranks: each rank's packed shard holds one piece per block (2.7% of
    it), so a fraction lays every parameter out in a bucket of its own (fine pieces)."""
    for fraction in (0.1, 0.3, 0.5, 0.9):
        result = check_ok(flatshard("plan", "llama3-8b", "--world-size", 8, "--offload",
                                    fraction, "--json"))  # fmt: skip
        memory = json.loads(result.stdout)["memory"]
        assert abs(memory["offloaded_share"] - fraction) <= 0.01 * fraction, fraction
        assert memory["host"] > 0 and memory["device"] + memory["host"] == memory["total"]


def test_full_fraction_needs_no_search():
    buckets = [BucketPieces(((0, 5),), 8), BucketPieces((), 3)]
    assert offload_cuts(buckets, 1.0) == [0, 0]
    assert offloaded_fraction(buckets, [0, 0]) == 1.0
