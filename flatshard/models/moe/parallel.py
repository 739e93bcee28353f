"""The reference MoE's parallel plan: its attention (and dense MLPs) split over TP as the
Llama's, its grouped experts over EP."""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from flatshard.models.llama.model import indexed_layers
from flatshard.models.llama.parallel import (
    ATTENTION_BY_SEQUENCE,
    LLAMA_BLOCK_PLAN,
    SEQUENCE,
    check_tp,
    split_root_by_sequence,
    style,
)
from flatshard.parallel import ExpertParallel
from flatshard.parallel.tensor_parallel import moe_by_sequence


def parallelize_moe(model, tp_mesh, sequence_parallel: bool = False) -> None:
    """Split the reference MoE's attention (and its dense MLPs, DeepSeek's first layers)
    over the 1-D `tp_mesh` as `parallelize_llama` does; routers and experts stay whole
    on every TP rank (each computes them for the same tokens; split the experts with
    `ExpertParallel` over ranks holding different data). sequence_parallel: as
    `parallelize_llama`'s; an MoE layer gathers the sequence and every TP rank keeps its
    own shard of the output (its compute is the same on every TP rank)."""
    check_tp(model.config, tp_mesh.size())
    if sequence_parallel:
        split_root_by_sequence(model, tp_mesh)
    attention = {k: v for k, v in LLAMA_BLOCK_PLAN.items() if k.startswith("attn.")}
    if model.config.qk_norm:
        attention.update({"attn.q_norm": "head_norm", "attn.k_norm": "head_norm"})
    for _, block in indexed_layers(model.layers):
        kinds = dict(attention)
        dense = not hasattr(block.mlp, "experts")  # a dense layer (DeepSeek's first ones)
        if dense:
            kinds.update({k: v for k, v in LLAMA_BLOCK_PLAN.items() if k.startswith("mlp.")})
        plan = {name: style(kind) for name, kind in kinds.items()}
        if sequence_parallel:
            plan.update({**ATTENTION_BY_SEQUENCE, **_mlp_by_sequence(dense)})
        parallelize_module(block, tp_mesh, plan)


def _mlp_by_sequence(dense: bool) -> dict:
    """A block's MLP under sequence parallelism: a dense one as the Llama's; an MoE layer
    gathers the sequence and keeps this rank's shard of its (replicated) output."""
    if dense:
        return {
            "mlp": PrepareModuleInput(
                input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
            "mlp.down_proj": RowwiseParallel(output_layouts=SEQUENCE),
        }  # fmt: skip
    return {"mlp": moe_by_sequence(local_output=True)}


def split_experts(model, ep_mesh) -> list:
    """Every MoE layer's grouped experts over the EP mesh; their modules."""
    blocks = [block for _, block in indexed_layers(model.layers)]
    experts = [block.mlp.experts for block in blocks if hasattr(block.mlp, "experts")]
    for module in experts:
        parallelize_module(module, ep_mesh, ExpertParallel())
    return experts
