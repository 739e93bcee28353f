"""DeepSeek-V3's auxiliary-loss-free load balancing: after each step, every MoE layer's
score-correction bias (`mlp.gate.e_score_correction_bias`, a buffer that only steers which
experts are chosen) moves by a fixed `rate`, up for the experts that received fewer than the
mean number of tokens and down for those that received more.

The bias is a buffer every rank holds whole, so the counts are summed over the
data-parallel `group` first: every rank then makes the same update, the one a single process
would make on the global batch.

transformers' routers with such a bias (DeepSeek-V3, GLM-4-MoE, dots.llm1: a module with an
`e_score_correction_bias` buffer returning the chosen experts' indices) never move it;
`count_transformers_routers` gives them the counting flatshard's `Router` does itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from flatshard import registry
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
    routers = [m for m in model.modules() if isinstance(m, Router) or _counted(m)]
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


def count_transformers_routers(model: nn.Module) -> int:
    """Give each transformers router of `model` with a score-correction bias (a buffer
    `e_score_correction_bias`, the experts it chooses among its outputs as an integer
    tensor) a `step_counts` buffer that its training forwards add their assignments to, as
    flatshard's `Router` counts its own; `update_score_bias_from_counts` then moves their
    biases. Returns how many routers count."""
    routers = [
        module for module in model.modules()
        if not isinstance(module, Router) and not _counted(module)
        and "e_score_correction_bias" in dict(module.named_buffers(recurse=False))
    ]  # fmt: skip
    for router in routers:
        bias = router.e_score_correction_bias
        counts = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        router.register_buffer("step_counts", counts, persistent=False)
        router.register_forward_hook(_count_assignments)
    return len(routers)


def _counted(module: nn.Module) -> bool:
    return not isinstance(module, Router) and hasattr(module, "step_counts")


def _count_assignments(router: nn.Module, args, output) -> None:
    """After a transformers router's forward: its chosen experts counted, in a forward that
    trains (as `Router.forward`: not torch's pipeline shape inference)."""
    if not (router.training and torch.is_grad_enabled()) or registry.in_shape_inference():
        return
    outputs = output if isinstance(output, tuple) else (output,)
    chosen = [t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if len(chosen) != 1:
        raise TypeError(
            f"{type(router).__name__} has a score-correction bias but returns "
            f"{len(chosen)} integer tensors, not one of the experts it chose: flatshard "
            "cannot count its assignments for model.bias_update_speed"
        )
    with torch.no_grad():
        counts = torch.bincount(chosen[0].flatten(), minlength=router.step_counts.numel())
        router.step_counts.add_(counts.to(router.step_counts.dtype))
