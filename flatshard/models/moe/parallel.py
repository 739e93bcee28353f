"""The reference MoE's parallel plan: its attention (and dense MLPs) split over TP as the
Llama's, its grouped experts over EP."""

from __future__ import annotations

from torch.distributed.tensor.parallel import parallelize_module

from flatshard.models.llama.parallel import LLAMA_BLOCK_PLAN, check_tp, style
from flatshard.parallel import ExpertParallel


def parallelize_moe(model, tp_mesh) -> None:
    """Split the reference MoE's attention (and its dense MLPs, DeepSeek's first layers)
    over the 1-D `tp_mesh` as `parallelize_llama` does; routers and experts stay whole
    on every TP rank (each computes them for the same tokens; split the experts with
    `ExpertParallel` over ranks holding different data)."""
    check_tp(model.config, tp_mesh.size())
    attention = {k: v for k, v in LLAMA_BLOCK_PLAN.items() if k.startswith("attn.")}
    if model.config.qk_norm:
        attention.update({"attn.q_norm": "head_norm", "attn.k_norm": "head_norm"})
    for block in model.layers:
        kinds = dict(attention)
        if not hasattr(block.mlp, "experts"):  # a dense layer (DeepSeek's first ones)
            kinds.update({k: v for k, v in LLAMA_BLOCK_PLAN.items() if k.startswith("mlp.")})
        parallelize_module(block, tp_mesh, {name: style(kind) for name, kind in kinds.items()})


def split_experts(model, ep_mesh) -> list:
    """Every MoE layer's grouped experts over the EP mesh; their modules."""
    experts = [block.mlp.experts for block in model.layers if hasattr(block.mlp, "experts")]
    for module in experts:
        parallelize_module(module, ep_mesh, ExpertParallel())
    return experts
