"""How a transformers model is split: its blocks are its decoder layers (the classes its
`_no_split_modules` names), split over TP and EP by transformers' own plans
(parallel/transformers_plan.py), then sharded by `parallelize` like any model."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from flatshard.api.parallel_plan import ParallelPlan, StageParts, register_plan
from flatshard.api.parallelize import parallelize
from flatshard.hf.errors import HFConfigError
from flatshard.mesh import ParallelDims
from flatshard.models.moe.loss import transformers_router_stats
from flatshard.models.moe.router import router_totals_after
from flatshard.models.transformers.context_parallel import split_context
from flatshard.parallel.transformers_plan import (
    apply_transformers_expert_parallel,
    apply_transformers_tensor_parallel,
    grouped_experts,
)
from flatshard.parallel.transformers_sequence import apply_transformers_sequence_parallel


def shard_decoder_layers(model: nn.Module, dims: ParallelDims | None = None, **options):
    """fully_shard every decoder layer, then the root, over every rank (or `dims`):
    `parallelize`'s data-parallel path, what `from_pretrained(..., shard=...)` needs.
    `options`: parallelize's (mp_policy, ...)."""
    decoder_layers(model)  # its blocks, or why they cannot be told, before any mesh
    dims = dims if dims is not None else ParallelDims(dist.get_world_size())
    return parallelize(model, dims, **options)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of the classes the model's `_no_split_modules` names (its blocks)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in classes]
    if not layers:
        raise HFConfigError(
            f"{type(model).__name__}._no_split_modules is {sorted(classes)}: no module of the "
            "model is of those classes, so flatshard cannot tell its decoder layers; pass a "
            "sharding function of your own"
        )
    return layers


def stage_forward(stage: nn.Module, x, first: bool, router_totals=None, position_ids=None):
    """A pipeline stage of a transformers causal LM: token ids into the first stage, the
    previous stage's hidden states (as `inputs_embeds`) into the others (under context
    parallelism at the positions of this rank's part; packed documents at their
    `position_ids`); out come the logits, or (norm and head standing in as Identity) the
    hidden states. An MoE trained with its load-balancing loss (`carries_router_totals`:
    its experts' number) also hands on the routing totals it was given plus its own
    layers' (as flatshard's MoE does: `router_totals_after`)."""
    inputs = {"input_ids": x} if first else {"inputs_embeds": x}
    context = getattr(stage, "context_parallel", None)
    if context is not None:  # its tokens are the CP split's: their positions
        inputs["position_ids"] = context.positions(x.shape[0], x.shape[1], x.device)
    elif position_ids is not None:
        inputs["position_ids"] = position_ids
    output = type(stage).forward(stage, **inputs, use_cache=False)
    experts = getattr(stage, "carries_router_totals", 0)
    if not experts:
        return output.logits
    stats = transformers_router_stats(stage, output.router_logits or ())
    return output.logits, router_totals_after(router_totals, stats, experts, output.logits)


# a causal LM's parts (`model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`, as
# most families name them); a stage without the norm or head passes its hidden states on
CAUSAL_LM_STAGES = StageParts(
    embed="model.embed_tokens", blocks="model.layers", norm="model.norm", head="lm_head",
    missing=lambda path: None if path.endswith("embed_tokens") else nn.Identity(),
    forward=stage_forward,
)  # fmt: skip


register_plan(
    lambda model: getattr(model, "_no_split_modules", None) is not None,
    lambda model: ParallelPlan(
        blocks=decoder_layers,
        tensor_parallel=apply_transformers_tensor_parallel,
        expert_parallel=apply_transformers_expert_parallel,
        # transformers' grouped-expert kernels route by data-dependent sizes (its CPU
        # fallback's backward cannot be traced): compiled blocks run them eagerly
        uncompiled=lambda model: list(grouped_experts(model).values()),
        context_parallel=lambda model, mesh: split_context(model, decoder_layers(model), mesh),
        sequence_parallel=lambda model, mesh: apply_transformers_sequence_parallel(
            model, mesh, decoder_layers(model)
        ),
        stages=CAUSAL_LM_STAGES,
    ),
)
