"""The MoE router: which experts each token goes to, with what weight, and the statistics
the load-balancing loss is built from.

Scores are softmax probabilities (Qwen3-MoE, Mixtral) or sigmoids (DeepSeek-V3). Experts are
chosen by top-k over the scores plus an optional score-correction bias (a buffer that only
steers the choice, never the weights), optionally restricted to the best `topk_groups` of
`n_groups` groups of experts (a group is scored by its two best experts, as DeepSeek-V3).
The chosen scores are optionally renormalised to sum to one and scaled by `routed_scaling`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from flatshard import registry
from flatshard.models.llama.model import INIT_STD
from flatshard.models.moe.config import MoEConfig


class RouterStats(NamedTuple):
    """One MoE layer's routing over the tokens of one forward.

    counts: float32 (E,), top-k assignments per expert (no gradient).
    prob_sum: float32 (E,), the sum over tokens of each expert's probability (softmax, or
        the sigmoid scores normalised to sum to one per token); carries the gradient.
    tokens: how many tokens were routed.
    """

    counts: torch.Tensor
    prob_sum: torch.Tensor
    tokens: int

    @staticmethod
    def from_totals(totals: torch.Tensor) -> RouterStats:
        """The statistics `router_totals_after` summed into one tensor."""
        n_experts = (totals.numel() - 1) // 2
        counts = totals[:n_experts].detach()
        return RouterStats(counts, totals[n_experts:-1], int(totals[-1].item()))


def router_totals_after(totals: torch.Tensor | None, stats, n_experts: int, like: torch.Tensor
                        ) -> torch.Tensor:  # fmt: skip
    """`totals` (`[counts, prob_sum, tokens]` of the layers before, float32; None: none)
    plus those of `stats` (RouterStats of more layers): what a pipeline stage hands on."""
    if totals is None:
        totals = torch.zeros(2 * n_experts + 1, dtype=torch.float32, device=like.device)
    for stat in stats:
        tokens = torch.tensor([float(stat.tokens)], device=totals.device)
        totals = totals + torch.cat([stat.counts.detach().float(), stat.prob_sum.float(), tokens])
    return totals


class Router(nn.Module):
    """`weight (E, H)` scores each token against each expert."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.n_experts = cfg.top_k, cfg.n_experts
        self.score_func, self.norm_topk_prob = cfg.score_func, cfg.norm_topk_prob
        self.n_groups, self.topk_groups = cfg.n_groups, cfg.topk_groups
        self.routed_scaling = cfg.routed_scaling
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        if cfg.score_bias:
            # DeepSeek-V3's auxiliary-loss-free balancing: updated outside autograd, from
            # the assignments its training forwards counted since (balance.py)
            self.register_buffer("e_score_correction_bias", torch.empty(cfg.n_experts))
            self.register_buffer("step_counts", torch.empty(cfg.n_experts), persistent=False)
        else:
            self.e_score_correction_bias = self.step_counts = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
        if self.e_score_correction_bias is not None:
            nn.init.zeros_(self.e_score_correction_bias)
            nn.init.zeros_(self.step_counts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        """x (T, H) -> weights (T, k) in x's dtype, expert indices (T, k), statistics."""
        if self.score_func == "softmax":
            # logits in the compute dtype, probabilities in float32 (as HF Qwen3-MoE/Mixtral)
            scores = F.linear(x, self.weight).float().softmax(dim=-1)
            probs = scores
        else:
            # sigmoid scores from float32 logits (as HF DeepSeek-V3)
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        indices = self._choose(scores.detach())
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        if self.routed_scaling != 1.0:
            weights = weights * self.routed_scaling
        # a forward that trains counts its assignments for the bias update (balance.py):
        # not torch's pipeline stage's shape inference (an extra forward, on empty tensors
        # on all but the first stage); recomputed under activation checkpointing, every
        # forward of the layer counts twice, which the update's sign does not see
        counting = (
            self.step_counts is not None and self.training and torch.is_grad_enabled()
            and not registry.in_shape_inference()
        )
        with torch.no_grad():
            counts = torch.bincount(indices.flatten(), minlength=self.n_experts).float()
            if counting:
                self.step_counts.add_(counts)
        stats = RouterStats(counts, probs.sum(dim=0), x.shape[0])
        return weights.to(x.dtype), indices, stats

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.float()
        if self.n_groups > 1:
            tokens, per_group = choice.shape[0], self.n_experts // self.n_groups
            grouped = choice.view(tokens, self.n_groups, per_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best = group_scores.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            keep = keep.repeat_interleave(per_group, dim=1)
            choice = choice.masked_fill(~keep, float("-inf"))
        return choice.topk(self.top_k, dim=-1).indices

    def extra_repr(self) -> str:
        return (
            f"experts={self.n_experts}, top_k={self.top_k}, scores={self.score_func}, "
            f"norm_topk_prob={self.norm_topk_prob}"
        )
