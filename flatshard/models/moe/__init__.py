"""The reference mixture-of-experts family (Qwen3-MoE, Mixtral, DeepSeek-V3 options): the
Llama's attention with routed grouped experts. model.py / config.py the model,
router.py, expert_compute.py, balance.py and loss.py its routing, hf_adapter.py /
hf_config.py its Hugging Face names and config.json, parallel.py its TP and EP plan."""

import functools

import torch
import torch.distributed as dist

from flatshard.api.parallel_plan import ParallelPlan
from flatshard.models.llama.parallel import split_context
from flatshard.models.moe.balance import (
    count_transformers_routers,
    update_score_bias,
    update_score_bias_from_counts,
)
from flatshard.models.moe.config import MoEConfig
from flatshard.models.moe.hf_adapter import MOE, MOE_RULES
from flatshard.models.moe.hf_config import hf_to_moe_config, moe_config_to_hf
from flatshard.models.moe.loss import load_balancing_loss
from flatshard.models.moe.model import GroupedExperts, MoE, MoEBlock, MoELayer
from flatshard.models.moe.parallel import parallelize_moe, split_experts
from flatshard.models.moe.router import RouterStats
from flatshard.models.registry import (
    ModelFamily,
    model_inputs,
    position_kwargs,
    register,
    token_loss,
)


def moe_training_loss(
    model, batch: torch.Tensor, group=None, labels=None, divisor=None, position_ids=None
) -> torch.Tensor:
    """Next-token cross-entropy (`token_loss`) plus the weighted load-balancing loss, whose
    router statistics are summed over `group` (default: every rank; each holds another
    slice of the batch), so the loss and its gradients are the global batch's."""
    inputs, targets, position_ids = model_inputs(model, batch, labels, position_ids)
    positions = position_kwargs(model, position_ids)
    logits, stats = model(inputs, return_router_stats=True, **positions)
    loss = token_loss(logits, targets, divisor)
    group = group if group is not None else dist.group.WORLD
    return loss + model.config.aux_loss_coef * load_balancing_loss(stats, group)


def describe(config: MoEConfig) -> str:
    return (
        f"MoE ({config.n_experts} experts, top-{config.top_k}, expert ffn "
        f"{config.expert_ffn_dim}, aux loss x{config.aux_loss_coef:g})"
    )


FAMILY = register(
    ModelFamily(
        "moe",
        MoEConfig,
        MoE,
        plan=lambda model: ParallelPlan(
            "layers",
            parallelize_moe,
            split_experts,
            context_parallel=split_context,
            sequence_parallel=functools.partial(parallelize_moe, sequence_parallel=True),
            # the experts run rows by data-dependent counts (and torch._grouped_mm compiles
            # in bf16 only): compiled blocks run them eagerly, as under EP, where they are
            # units of their own
            uncompiled=lambda model: [m for m in model.modules() if isinstance(m, GroupedExperts)],
        ),
        loss=moe_training_loss,
        describe=describe,
        hf_export=False,
    )
)
"""The MoE family as the registry knows it: config, model, parallel plan, loss, run header."""

__all__ = [
    "FAMILY",
    "MOE",
    "MOE_RULES",
    "GroupedExperts",
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoELayer",
    "RouterStats",
    "hf_to_moe_config",
    "load_balancing_loss",
    "moe_config_to_hf",
    "moe_training_loss",
    "parallelize_moe",
    "split_experts",
    "update_score_bias",
    "update_score_bias_from_counts",
    "count_transformers_routers",
]
