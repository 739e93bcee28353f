"""The planner's checkpoint: what a save writes (the fp32 weights and the optimizer state,
each element once), in how many files, and how long the writes take at a given speed.

Each rank of one replica writes its own equal shard to its own file (DCP's one file per
rank; HSDP's other replicas hold the same bytes and write nothing), plus the metadata file,
so the ranks write in parallel and a save takes about one rank's bytes over its write speed.
"""

from __future__ import annotations

import math

FP32 = 4


def checkpoint_figures(num_params: int, setup) -> dict[str, float]:
    replicas = setup.world_size // (setup.dp_shard * setup.tp)
    writers = setup.world_size // max(1, replicas)
    total = round((1 + setup.optimizer_states) * num_params) * FP32
    per_writer = math.ceil(total / writers)
    return {
        "bytes": total,
        "files": writers + 1,
        "writers": writers,
        "bytes_per_writer": per_writer,
        "save_seconds": per_writer / (setup.write_gbps * 1e9),
    }
