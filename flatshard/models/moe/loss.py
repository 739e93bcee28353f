"""The auxiliary load-balancing loss of an MoE model (Switch Transformer, eqs. 4-6), as
transformers' `load_balancing_loss_func` defines it for Qwen3-MoE and Mixtral:

    aux = E * sum_e f_e * P_e,   f_e = counts_e / N,   P_e = prob_sum_e / N,

with counts (top-k assignments) and probabilities summed over every MoE layer and N the
tokens times the number of MoE layers. HF weights it by `router_aux_loss_coef`
(`MoEConfig.aux_loss_coef` here): `loss = lm_loss + coef * aux`.

Data parallelism: f and P are means over the whole batch, so aux over a global batch is not
the mean of per-rank aux values. Given the data-parallel `group`, the counts and token
numbers (no gradient) are summed over it, and each rank returns

    aux_r = W * E * sum_e f_e * (prob_sum_e on this rank) / N,

whose mean over the W ranks is exactly the global batch's aux, and whose gradient, averaged
over the ranks as `fully_shard` averages gradients, is exactly the global aux's gradient.
So sharded training equals one process training on the global batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from flatshard.models.moe.router import RouterStats


def load_balancing_loss(stats: Sequence[RouterStats], group=None) -> torch.Tensor:
    """The auxiliary loss from one forward's per-layer router statistics (see the module
    docstring); `group`: the data-parallel process group whose ranks split the batch."""
    if not stats:
        raise ValueError("load_balancing_loss needs the statistics of at least one MoE layer")
    n_experts = stats[0].counts.numel()
    counts = torch.stack([s.counts for s in stats]).sum(dim=0)
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(dim=0)
    tokens = torch.tensor([float(sum(s.tokens for s in stats))], device=counts.device)
    world = 1
    if group is not None and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        totals = torch.cat([counts, tokens]).to(torch.float64)
        dist.all_reduce(totals, group=group)
        counts, tokens = totals[:-1].to(counts.dtype), totals[-1:].to(counts.dtype)
    fraction = counts / tokens
    return world * n_experts * (fraction * (prob_sum / tokens)).sum()


def transformers_balancing_loss(model, router_logits, group=None) -> torch.Tensor:
    """The weighted load-balancing loss of a transformers MoE's forward, from the gate
    logits it returns with `output_router_logits` (one [tokens, E] tensor per MoE layer):
    read as transformers' `load_balancing_loss_func` reads them (softmax probabilities,
    top-k assignments, every row counting) and weighed by its `router_aux_loss_coef`, but
    with the counts summed over `group` (default: every rank), so that sharded training
    equals one process on the global batch as for flatshard's MoE."""
    stats = transformers_router_stats(model, router_logits)
    group = group if group is not None else dist.group.WORLD
    return model.router_aux_loss_coef * load_balancing_loss(stats, group)


def transformers_router_stats(model, router_logits) -> list[RouterStats]:
    """Each layer's routing from the gate logits a transformers MoE returns, read as
    transformers' `load_balancing_loss_func` reads them."""
    stats = []
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, model.num_experts_per_tok, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=probs.shape[-1]).float()
        stats.append(RouterStats(counts, probs.float().sum(dim=0), probs.shape[0]))
    return stats
