"""Model families, one folder each: llama/ and moe/ (flatshard's own, registered in
registry.py) and transformers/ (any transformers causal LM, sharded in place)."""

from flatshard.models.kv_cache import KVCache
from flatshard.models.llama import Llama, LlamaConfig
from flatshard.models.moe import MoE, MoEConfig, RouterStats, load_balancing_loss, update_score_bias
from flatshard.models.registry import ModelFamily, family_of_config, family_of_model
from flatshard.models.transformers import TRANSFORMERS, build_causal_lm, shard_decoder_layers

__all__ = [
    "KVCache",
    "Llama",
    "LlamaConfig",
    "ModelFamily",
    "MoE",
    "MoEConfig",
    "RouterStats",
    "TRANSFORMERS",
    "build_causal_lm",
    "family_of_config",
    "family_of_model",
    "load_balancing_loss",
    "shard_decoder_layers",
    "update_score_bias",
]
