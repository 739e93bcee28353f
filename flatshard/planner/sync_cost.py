"""The planner's weight sync (`flatshard.sync_weights`): the bytes one full sync moves to
each receiver, and how they split over the trainer's ranks. Every rank of one replica
sends its own blocks (HSDP's other replicas hold the same and send nothing), so a sync
takes about one rank's bytes over its link. A delta sync sends only what a step wrote."""

from __future__ import annotations

import math

WIRE_BYTES = {"none": 4, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}  # fp8: + a scale per row


def sync_figures(num_params: int, setup) -> dict[str, float]:
    replicas = setup.world_size // (setup.dp_shard * setup.tp)
    senders = setup.world_size // max(1, replicas)
    total = num_params * WIRE_BYTES[setup.sync_wire]
    return {
        "wire": setup.sync_wire,
        "bytes_per_receiver": total,
        "senders": senders,
        "bytes_per_sender": math.ceil(total / senders),
    }
