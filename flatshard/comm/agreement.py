"""Ranks that reach the same decision: a check that can differ per rank is agreed before
anyone enters a collective, so every rank raises the same error and none waits alone.

Each costs one tiny collective and runs at set-up (or once per forward, for the few ints a
lookup plans with), never on the per-step data path.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from flatshard import compat
from flatshard.comm import group_device
from flatshard.errors import FlatShardError


def all_gather_ints(values: torch.Tensor, group) -> list[list[int]]:
    """Every rank's few int64 `values`, in rank order (one tiny all-gather; a host sync on
    CUDA)."""
    values = values.to(group_device(group))
    gathered = values.new_empty(dist.get_world_size(group) * values.numel())
    compat.all_gather_single(gathered, values, group=group)
    return gathered.view(-1, values.numel()).tolist()


def agree(local_problem: str | None, group, error_type: type[FlatShardError]) -> None:
    """Raise on every rank if any rank found a problem, so no rank waits alone in a collective.

    Costs one small all-reduce; used only at set-up, never per step.
    """
    if group is None or dist.get_world_size(group) == 1:
        if local_problem:
            raise error_type(local_problem)
        return
    flag = torch.tensor([1 if local_problem else 0], dtype=torch.int32, device=group_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return
    problems: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, local_problem, group=group)
    raise error_type(_joined(problems))


def _joined(problems: list) -> str:
    """The ranks' problems as one message: once when every rank found the same."""
    if len(set(problems)) == 1:
        return problems[0]
    return "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(problems) if text)


def fingerprint(value) -> int:
    """A signed 64-bit hash of `repr(value)`, the same in every process (Python's own hash
    of a str is salted per process)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def agree_on(
    local_problem: str | None,
    description,
    group,
    error_type: type[FlatShardError],
    explain_difference,
) -> None:
    """`agree`, and also that every rank of `group` holds the same `description` (e.g. the
    layout of what it is about to shard): one all-gather of (problem flag, 64-bit
    fingerprint of `description`). Only when something is wrong are the problems and
    descriptions gathered (all_gather_object), and every rank raises the same `error_type`:
    the ranks' problems, or `explain_difference(descriptions in rank order)`.
    Costs one tiny collective; used only at set-up, never per step.
    """
    if group is None or dist.get_world_size(group) == 1:
        if local_problem:
            raise error_type(local_problem)
        return
    mine = torch.tensor(
        [1 if local_problem else 0, fingerprint(description)],
        dtype=torch.int64,
        device=group_device(group),
    )
    everyone = all_gather_ints(mine, group)
    if not any(flag for flag, _ in everyone) and len({fp for _, fp in everyone}) == 1:
        return
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (local_problem, description), group=group)
    problems = [text for text, _ in gathered]
    if any(problems):
        raise error_type(_joined(problems))
    raise error_type(explain_difference([described for _, described in gathered]))
