"""Splitting a model root's own parameters by where the forward pass first uses them.

A model root (embedding, blocks, final norm, output head) owns parameters used at both
ends of the forward pass. As one unit, the head would be gathered before the first block
runs and its gradient reduced only after the whole backward, neither overlapped. So
`fully_shard` gives each run of consecutive children that hold no unit (e.g. [embedding]
and [norm, head]) a unit of its own: gathered when first used (prefetched by the block
before it) and reduced as soon as its gradient is complete. Like the root's own, their
parameters stay gathered from forward to backward, so bytes and memory stay as before.
"""

from __future__ import annotations

from collections import Counter

import torch.nn as nn

from flatshard import registry


def first_use_groups(root: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """Runs of `root`'s direct children, in registration order, that each become a unit:
    children holding no unit whose parameters are not shared with the rest of the root.
    Empty unless some child already holds a unit of a block (a model root over its
    blocks; a block whose experts are a unit of their own, expert-parallel, is not one)."""
    children = list(root.named_children())
    if not any(_holds_block_unit(child) for _, child in children):
        return []
    everywhere = _param_counts(root)
    groups, run = [], []
    for name, child in children:
        counts = _param_counts(child)
        if not counts and not _holds_unit(child):
            continue  # no parameters (e.g. rotary tables): does not end a run
        own = not _holds_unit(child) and all(everywhere[key] == n for key, n in counts.items())
        if own:
            run.append((name + ".", child))
        else:
            if run:
                groups.append(run)
            run = []
    if run:
        groups.append(run)
    return groups


def _holds_unit(module: nn.Module) -> bool:
    return bool(registry.units_below(module))


def _holds_block_unit(module: nn.Module) -> bool:
    return any(
        not getattr(getattr(unit, "mesh", None), "expert_parallel", False)
        for unit in registry.units_below(module)
    )


def _param_counts(module: nn.Module) -> Counter:
    """How often each parameter (by id) is registered below `module`, outside units."""
    counts: Counter = Counter()
    stack = [module]
    while stack:
        current = stack.pop()
        if registry.unit_of(current) is not None:
            continue
        counts.update(id(p) for p in current._parameters.values() if p is not None)
        stack.extend(child for child in current._modules.values() if child is not None)
    return counts
