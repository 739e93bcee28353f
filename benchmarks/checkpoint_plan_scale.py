"""What planning a checkpoint costs at scale, on paper: llama3-70b with AdamW state, laid out
by flatshard's layout for 1,024 ranks (FSDP) and 16,384 ranks (HSDP, 16 replicas of 1,024),
no processes and no tensors.

    python benchmarks/checkpoint_plan_scale.py [--ranks 1024 16384] [--shard 1024]

For each: the time one process takes to derive the whole plan and DCP's `.metadata` from
the layout (what rank 0 does on every save; every rank derives its own share the same way)
and the metadata's pickled size, against what DCP's planning would move through rank 0:
every rank's local save plan gathered, and the global plan scattered back.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flatshard.checkpoint import global_plan  # noqa: E402
from flatshard.checkpoint.writing import storage_of_other_ranks  # noqa: E402
from flatshard.layout import ParamInfo  # noqa: E402
from flatshard.layout.packing import plan_unit_layout  # noqa: E402

LLAMA3_70B = dict(vocab=128256, dim=8192, ffn=28672, layers=80, heads=64, kv_heads=8)


def units(cfg: dict) -> list[list[ParamInfo]]:
    """One unit per block (fully_shard per block) and the root's (embeddings, norm, head)."""
    dim, head = cfg["dim"], cfg["dim"] // cfg["heads"]
    kv = cfg["kv_heads"] * head
    out = []
    for layer in range(cfg["layers"]):
        p = f"model.layers.{layer}."
        shapes = {
            "attention.wq.weight": (dim, dim),
            "attention.wk.weight": (kv, dim),
            "attention.wv.weight": (kv, dim),
            "attention.wo.weight": (dim, dim),
            "feed_forward.w1.weight": (cfg["ffn"], dim),
            "feed_forward.w3.weight": (cfg["ffn"], dim),
            "feed_forward.w2.weight": (dim, cfg["ffn"]),
            "attention_norm.weight": (dim,),
            "ffn_norm.weight": (dim,),
        }
        out.append([ParamInfo(p + name, shape, torch.float32) for name, shape in shapes.items()])
    out.append(
        [
            ParamInfo("model.tok_embeddings.weight", (cfg["vocab"], dim), torch.float32),
            ParamInfo("model.norm.weight", (dim,), torch.float32),
            ParamInfo("model.output.weight", (cfg["vocab"], dim), torch.float32),
        ]
    )
    return out


def plan_of(cfg: dict, ranks: int, shard: int) -> global_plan.GlobalPlan:
    """The global plan of model + exp_avg + exp_avg_sq on a (ranks // shard, shard) mesh."""
    lowest = global_plan.lowest_ranks(torch.arange(ranks).view(ranks // shard, shard), 1)
    properties = TensorProperties(dtype=torch.float32)
    items = []
    for params in units(cfg):
        layout = plan_unit_layout(params, shard)
        for index, info in enumerate(layout.params):
            spec = layout.spec(index, 0)
            chunks = global_plan.row_shard_chunks(spec, lowest)
            name = info.name.removeprefix("model.")
            names = [
                f"model.{name}",
                f"optim.state.{name}.exp_avg",
                f"optim.state.{name}.exp_avg_sq",
            ]
            for fqn in names:
                for offsets, sizes, rank in chunks:
                    items.append(
                        global_plan.chunk_item(fqn, offsets, sizes, info.shape, properties, rank)
                    )
    return global_plan.GlobalPlan(sorted(items, key=lambda p: p.rank), ranks)


def measure(cfg: dict, ranks: int, shard: int) -> dict:
    started = time.perf_counter()
    planned = plan_of(cfg, ranks, shard)
    metadata = Metadata(planned.state_dict_metadata(), storage_data=storage_of_other_ranks(planned))
    blob = pickle.dumps(metadata)
    seconds = time.perf_counter() - started
    # DCP: every rank's local plan (its own chunks, replicas' too, before dedup) to rank 0,
    # the global plans back; a replica's plan is the size of its shard peer's
    per_shard_rank = {}
    for planned_item in planned.items:
        per_shard_rank.setdefault(planned_item.rank % shard, []).append(planned_item.item)
    sample = len(pickle.dumps(SavePlan(per_shard_rank[0])))
    gathered = sample * ranks
    return {
        "ranks": ranks,
        "shard": shard,
        "chunks": sum(1 for p in planned.items),
        "seconds": seconds,
        "metadata_bytes": len(blob),
        "dcp_gather_bytes": gathered,
        "dcp_round_trip_bytes": 2 * gathered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--shard", type=int, default=1024)
    args = parser.parse_args()
    print(
        "| ranks | mesh | chunks | derive plan + .metadata (one process) | .metadata | "
        "DCP plan gather to rank 0 | gather + scatter |"
    )
    print("|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        shard = min(args.shard, ranks)
        row = measure(LLAMA3_70B, ranks, shard)
        print(
            f"| {ranks} | {ranks // shard} x {shard} | {row['chunks']:,} | "
            f"{row['seconds']:.1f} s | {row['metadata_bytes'] / 1e6:.0f} MB | "
            f"{row['dcp_gather_bytes'] / 1e9:.2f} GB | {row['dcp_round_trip_bytes'] / 1e9:.2f} GB |"
        )


if __name__ == "__main__":
    main()
