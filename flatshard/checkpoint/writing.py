"""A checkpoint's files: each rank writes its share of the layout-derived plan, and rank 0
the DCP `.metadata` built from the same plan; no plan crosses the network. When the ranks
cannot all derive the plan (a tensor split by TP or EP as well), DCP plans and writes it.
"""

from __future__ import annotations

import os
import pickle
import uuid

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from flatshard.checkpoint import commit, global_plan, rank_file


def write_files(
    directory: str,
    state: dict,
    group,
    rank: int,
    world: int,
    *,
    staging_bytes: int = rank_file.DEFAULT_STAGING_BYTES,
    copy_always: bool = False,
    staged=None,
) -> dict:
    """Write this rank's part of `state` into `directory` (every rank calls it); returns
    {"planned_locally": ..., "peak_staging_bytes": ...}. `copy_always` / `staged`: see
    `rank_file.write`."""
    flat, mappings = flatten_state_dict(state)
    try:
        planned = global_plan.plan(flat, world)
    except Exception:  # noqa: BLE001 - a state it cannot plan: DCP plans it (and reports)
        planned = None
    if not _everyone_planned_alike(planned, group):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
                 process_group=group)  # fmt: skip
        if staged is not None:
            staged()
        return {"planned_locally": False, "peak_staging_bytes": None}
    where, peak = rank_file.write(
        directory,
        rank,
        planned.of_rank(rank),
        flat,
        staging_bytes=staging_bytes,
        copy_always=copy_always,
        staged=staged,
    )
    if rank == 0:
        storage = _storage_of_other_ranks(planned)
        storage.update(where)
        metadata = Metadata(
            planned.state_dict_metadata(),
            planner_data=mappings,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=directory, save_id=str(uuid.uuid4())),
            version=CURRENT_DCP_VERSION,
        )
        commit.write_durably(os.path.join(directory, ".metadata"), pickle.dumps(metadata))
    return {"planned_locally": True, "peak_staging_bytes": peak}


def _storage_of_other_ranks(planned: global_plan.GlobalPlan) -> dict:
    """Where every other rank's chunks sit in its file: back to back, in plan order."""
    storage, offsets = {}, [0] * planned.world
    for item in planned.items:
        if item.rank == 0:
            continue
        name = global_plan.file_name(item.rank)
        storage[item.item.index] = _StorageInfo(name, offsets[item.rank], item.length)
        offsets[item.rank] += item.length
    return storage


def _everyone_planned_alike(planned, group) -> bool:
    """One small all-reduce: did every rank derive the same plan?"""
    if planned is None:
        mine = torch.tensor([0, 0, 1], dtype=torch.int64)
    else:
        fingerprint = planned.fingerprint() >> 2  # room to negate
        mine = torch.tensor([fingerprint, -fingerprint, 0], dtype=torch.int64)
    if group is None:
        return planned is not None
    agreed = mine.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return bool(agreed[2] == 0 and agreed[0] == mine[0] and agreed[1] == mine[1])
