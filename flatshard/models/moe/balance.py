"""DeepSeek-V3's auxiliary-loss-free load balancing: after each step, every MoE layer's
score-correction bias (`mlp.gate.e_score_correction_bias`, a buffer that only steers which
experts are chosen) moves by a fixed `rate`, up for the experts that received fewer than the
mean number of tokens and down for those that received more.

The bias is a buffer every rank holds whole, so the counts are summed over the
data-parallel `group` first: every rank then makes the same update, the one a single process
would make on the global batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from flatshard.models.moe.router import Router, RouterStats


@torch.no_grad()
def update_score_bias(
    model: nn.Module, stats: Sequence[RouterStats], rate: float, group=None
) -> None:
    """Move each MoE layer's correction bias by `rate * sign(mean load - load)`.

    `stats`: one `RouterStats` per MoE layer, in layer order, as `model(tokens,
    return_router_stats=True)` returns them (sum the counts of several micro-batches first).
    """
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if len(routers) != len(stats):
        raise ValueError(
            f"update_score_bias got statistics of {len(stats)} MoE layers for a model with "
            f"{len(routers)}"
        )
    if any(r.e_score_correction_bias is None for r in routers):
        raise ValueError(
            "update_score_bias needs a model built with score_bias=True (a correction bias "
            "in every router)"
        )
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    counts = torch.stack([s.counts for s in stats])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    _move(routers, counts, rate)


@torch.no_grad()
def update_score_bias_from_counts(model: nn.Module, rate: float, groups=()) -> None:
    """As `update_score_bias`, from the assignments each router counted itself over the
    training forwards since the last update (`step_counts`, then zeroed): what a trainer
    calls after each optimizer step, whatever split the step's forwards (micro-batches,
    pipeline stages: each updates the routers it holds). `groups`: the process groups
    whose ranks routed other tokens through the same routers (data- and context-parallel
    ranks of this stage), summed over one after the other."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers:
        return
    if any(r.step_counts is None for r in routers):
        raise ValueError("update_score_bias_from_counts needs a model built with "
                         "score_bias=True (a correction bias in every router)")  # fmt: skip
    counts = torch.stack([r.step_counts for r in routers])
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    _move(routers, counts, rate)
    for router in routers:
        router.step_counts.zero_()


def _move(routers, counts: torch.Tensor, rate: float) -> None:
    """Each router's bias up by `rate` for its experts loaded below the layer's mean, down
    for those above (the sign: the counts' scale does not matter)."""
    for router, load in zip(routers, counts):
        bias = router.e_score_correction_bias
        bias += rate * torch.sign(load.mean() - load).to(bias.dtype)
