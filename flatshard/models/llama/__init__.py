"""The reference Llama family (Llama, Qwen2, Qwen3 checkpoints): model.py the model and its
config, hf_adapter.py / hf_config.py its Hugging Face names and config.json, parallel.py
its tensor-parallel plan."""

import functools

from flatshard.api.parallel_plan import ParallelPlan
from flatshard.models.llama.hf_adapter import LLAMA, LLAMA_RULES
from flatshard.models.llama.hf_config import IGNORED_FIELDS, config_to_hf, hf_to_config
from flatshard.models.llama.model import (
    INIT_STD,
    MLP,
    Attention,
    Embedding,
    Linear,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
)
from flatshard.models.llama.parallel import (
    LLAMA_BLOCK_PLAN,
    check_tp,
    parallelize_llama,
    split_context,
    tp_local_shape,
)
from flatshard.models.llama.rope import apply_rope, rope_cos_sin, rope_inv_freq
from flatshard.models.registry import ModelFamily, register

FAMILY = register(
    ModelFamily(
        "llama",
        LlamaConfig,
        Llama,
        plan=lambda model: ParallelPlan(
            "layers",
            parallelize_llama,
            sequence_parallel=functools.partial(parallelize_llama, sequence_parallel=True),
            context_parallel=split_context,
        ),
        describe=lambda config: "Llama",
    )
)
"""The Llama family as the registry knows it: config, model, parallel plan, run header."""

__all__ = [
    "FAMILY",
    "IGNORED_FIELDS",
    "INIT_STD",
    "LLAMA",
    "LLAMA_BLOCK_PLAN",
    "LLAMA_RULES",
    "MLP",
    "Attention",
    "Embedding",
    "Linear",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "check_tp",
    "config_to_hf",
    "hf_to_config",
    "parallelize_llama",
    "rope_cos_sin",
    "rope_inv_freq",
    "split_context",
    "tp_local_shape",
]
