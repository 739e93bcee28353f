"""A checkpoint's files: each rank writes its share of the layout-derived plan, and rank 0
the DCP `.metadata` built from the same plan; no plan crosses the network. When the ranks
cannot all derive the plan (a tensor split by TP or EP as well), DCP plans and writes it.
"""

from __future__ import annotations

import copy
import os
import pickle
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.tensor import DTensor

from flatshard import comm
from flatshard.checkpoint import commit, global_plan, rank_file


@dataclass
class Prepared:
    """What `prepare` found: the flattened state and, when every rank derived the same
    one, the plan (None: DCP plans the save)."""

    state: dict
    flat: dict
    mappings: dict
    planned: global_plan.GlobalPlan | None

    def copy_small_values(self) -> None:
        """Host copies of everything but the sharded tensors, taken now (an asynchronous
        save stages those in waves later; buffers and values may change before that)."""
        for fqn, value in self.flat.items():
            if isinstance(value, DTensor):
                continue
            if isinstance(value, torch.Tensor):
                self.flat[fqn] = comm.to_host_now(value)
            else:
                self.flat[fqn] = copy.deepcopy(value)


def prepare(state: dict, group, rank: int, world: int) -> Prepared:
    """Plan the save of `state` (every rank calls it: one small all-reduce)."""
    flat, mappings = flatten_state_dict(state)
    try:  # rank 0 writes the metadata: it keeps the whole plan
        planned = global_plan.plan(flat, world, keep_rank=None if rank == 0 else rank)
    except Exception:  # noqa: BLE001 - a state it cannot plan: DCP plans it (and reports)
        planned = None
    if not _everyone_planned_alike(planned, group):
        planned = None
    return Prepared(state, flat, mappings, planned)


def write_files(
    directory: str,
    prepared: Prepared,
    group,
    rank: int,
    *,
    staging_bytes: int = rank_file.DEFAULT_STAGING_BYTES,
    copy_always: bool = False,
    staged=None,
) -> tuple[int, dict] | None:
    """Write this rank's part into `directory` (every rank calls it); returns the most bytes
    of host copies alive at once and {file name: size and CRC-32} (None when DCP wrote it).
    `copy_always` / `staged`: see `rank_file.write`."""
    planned = prepared.planned
    if planned is None:
        writer = dcp.FileSystemWriter(directory, sync_files=True)
        dcp.save(prepared.state, storage_writer=writer, process_group=group)
        if staged is not None:
            staged()
        return None
    where, peak, checksums = rank_file.write(
        directory,
        rank,
        planned.of_rank(rank),
        prepared.flat,
        staging_bytes=staging_bytes,
        copy_always=copy_always,
        staged=staged,
    )
    if rank == 0:
        storage = storage_of_other_ranks(planned)
        storage.update(where)
        metadata = Metadata(
            planned.state_dict_metadata(),
            planner_data=prepared.mappings,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=directory, save_id=str(uuid.uuid4())),
            version=CURRENT_DCP_VERSION,
        )
        commit.write_durably(os.path.join(directory, ".metadata"), pickle.dumps(metadata))
    return peak, checksums


def storage_of_other_ranks(planned: global_plan.GlobalPlan) -> dict:
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
        fingerprint = planned.fingerprint >> 2  # room to negate
        mine = torch.tensor([fingerprint, -fingerprint, 0], dtype=torch.int64)
    if group is None:
        return planned is not None
    agreed = mine.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return bool(agreed[2] == 0 and agreed[0] == mine[0] and agreed[1] == mine[1])
