"""Model families, one folder each (llama/, moe/), registered in registry.py."""

from flatshard.models.kv_cache import KVCache
from flatshard.models.llama import Llama, LlamaConfig
from flatshard.models.moe import MoE, MoEConfig, RouterStats, load_balancing_loss, update_score_bias
from flatshard.models.registry import ModelFamily, family_of_config, family_of_model

__all__ = [
    "KVCache",
    "Llama",
    "LlamaConfig",
    "ModelFamily",
    "MoE",
    "MoEConfig",
    "RouterStats",
    "family_of_config",
    "family_of_model",
    "load_balancing_loss",
    "update_score_bias",
]
