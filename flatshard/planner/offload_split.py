"""The planner's optimizer offload: which share of a rank's shards the layout puts on the
host (layout/offload.py, the runtime's own choice, over the model's units in the order
`flatshard train` creates them), and the per-rank memory split into device, host and disk.

Offloaded pieces keep their fp32 main weights, gradient shards and optimizer state on the
host (with a disk directory, the optimizer state in its files instead); the device keeps
the rest, and everything the forward and backward passes gather and compute.
"""

from __future__ import annotations

from flatshard.layout import plan_unit_layout
from flatshard.layout.offload import (
    BucketPieces,
    needs_bucket_per_param,
    offload_cuts,
    offloaded_fraction,
)


def offloaded_share(units, dp_shard: int, fraction: float, rank: int = 0) -> float:
    """The share of `rank`'s shard elements the layout offloads for `fraction`."""
    if fraction <= 0:
        return 0.0
    created = []  # each repeated unit `count` times, in creation order
    for unit in units:
        layout = plan_unit_layout(
            unit.params, unit.shard_ranks or dp_shard, needs_bucket_per_param(fraction)
        )
        buckets = [
            BucketPieces.of([b.spec(slot, rank) for slot in b.slots], b.shard_size)
            for b in layout.buckets
        ]
        created += [buckets] * unit.count
    # the runtime's order: the last unit created first, its last bucket first
    order = [bucket for buckets in reversed(created) for bucket in reversed(buckets)]
    return offloaded_fraction(order, offload_cuts(order, fraction))


def split_memory(memory: dict[str, int], share: float, disk: bool) -> dict[str, int]:
    """`memory` (estimate.py's per-rank figures) with the offloaded share moved off the
    device: `device` (its peak), `host`, `disk`, `total` = device + host (what a CPU run,
    whose device is its host, holds in memory), and `offload_states`: what
    `flatshard.offload_states` moves off the device between steps (weights, gradients and
    optimizer state still there)."""
    moved = {name: round(share * memory[name]) for name in ("params", "grads", "optimizer")}
    on_disk = moved["optimizer"] if disk else 0
    start = memory["peak_start_of_backward"] - moved["params"] - moved["optimizer"]
    end = memory["peak_end_of_backward"] - sum(moved.values())
    device = max(start, end)
    host = sum(moved.values()) - on_disk
    return {
        **memory,
        "offloaded_share": share,
        "device": device,
        "host": host,
        "disk": on_disk,
        "total": device + host,
        "offload_states": sum(memory[name] - moved[name] for name in moved),
    }
