"""The parallel plans of the reference models: blocks `layers`, attention and dense MLPs
split by `flatshard.parallel`'s Llama plan, grouped experts by `ExpertParallel`."""

from __future__ import annotations

from torch.distributed.tensor.parallel import parallelize_module

from flatshard.models.llama import Llama
from flatshard.models.moe import MoE
from flatshard.parallel import ExpertParallel, parallelize_llama, parallelize_moe
from flatshard.plan import ParallelPlan, register_plan


def split_experts(model: MoE, ep_mesh) -> list:
    """Every MoE layer's grouped experts over the EP mesh; their modules."""
    experts = [block.mlp.experts for block in model.layers if hasattr(block.mlp, "experts")]
    for module in experts:
        parallelize_module(module, ep_mesh, ExpertParallel())
    return experts


register_plan(Llama, lambda model: ParallelPlan("layers", parallelize_llama))
register_plan(MoE, lambda model: ParallelPlan("layers", parallelize_moe, split_experts))
