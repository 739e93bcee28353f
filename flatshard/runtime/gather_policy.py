"""What is gathered when, and what an embedding lookup from the shards costs: written once,
used by the runtime (its decisions), `flatshard plan` (its byte and memory counts) and the
benchmarks (their analytic byte counts). Pure arithmetic, no tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

# What each rank sends every peer to plan a lookup: its token count and whether its ids fit
# the table (two int64s).
LOOKUP_PLAN_BYTES = 2 * 8


def stays_gathered(position: int, root_parts: Sequence[bool], units_in_model: int) -> bool:
    """Whether the unit at `position` of a forward order stays gathered from its forward to
    its backward under ZeRO-3. `root_parts[i]`: the i-th unit to run forward is the model
    root or one of its first-use groups (needed again early in backward: FSDP2 keeps its
    root gathered). Besides those, the last unit before which only root parts run: its
    backward comes next (torchtitan keeps its last block gathered by hand). A model that
    is one unit reshards like any other."""
    if units_in_model == 1:
        return False
    return root_parts[position] or all(root_parts[position + 1 :])


def all_gathers_per_step(stage: int, stays: bool, microbatches: int, pipelined=False) -> int:
    """How often a unit is all-gathered in one optimizer step. `pipelined`: a pipeline
    stage's (api/pipeline.py: its schedule keeps each unit gathered after its first
    backward, until the step's gradients are reduced)."""
    if pipelined:
        # ZeRO-3: each micro-batch's forward, then its first backward; ZeRO-1/2: once
        return microbatches + 1 if stage == 3 and not stays else 1
    if stage == 3:
        return microbatches * (1 if stays else 2)  # forward, and again for backward
    if stage == 2:
        return microbatches  # gathered from forward to backward
    return 1  # ZeRO-1: once, after the optimizer changed the weights


def reduce_scatters_per_step(stage: int, microbatches: int, pipelined=False) -> int:
    """How often a unit's gradients are reduce-scattered in one step (synced every
    micro-batch; ZeRO-1 keeps them unsharded and reduces once, as every stage of a
    pipeline does)."""
    return 1 if stage == 1 or pipelined else microbatches


def lookup_possible(stage: int, ranks: int) -> bool:
    """Whether a unit over one embedding may look up from its shards: not under ZeRO-1
    (its unsharded gradient buffer is kept anyway) nor on one rank (nothing is sharded)."""
    return stage != 1 and ranks > 1


def looks_up(ranks: int, tokens_per_rank: int, rows: int) -> bool:
    """Whether a lookup from the shards moves less than gathering the table would: the
    ranks' tokens (padded to the largest count) are fewer than the table's rows."""
    return 0 < ranks * tokens_per_rank < rows


def lookup_payloads(ranks: int, tokens_per_rank: int, dim: int, itemsize: int, trainable: bool):
    """Collective payload bytes of one lookup from the shards (and its backward when
    `trainable`): (all-gathered: token ids and output gradients, reduce-scattered: rows)."""
    positions = ranks * tokens_per_rank
    rows = positions * dim * itemsize
    return positions * 8 + (rows if trainable else 0), rows
