"""Hugging Face import/export through per-family state-dict adapters (adapter.py).

model = flatshard.hf.from_pretrained(path, shard=flatshard.hf.shard_decoder_layers)  # build + load
flatshard.hf.load_pretrained(model, path)                          # into an existing model
flatshard.hf.save_pretrained(model, out_path, max_shard_size="5GB")

flatshard's reference Llama (Llama, Qwen2, Qwen3 checkpoints) has an adapter (llama.py),
and so has its reference MoE (Qwen3-MoE, Mixtral checkpoints: moe.py; from_pretrained
builds it with adapter=MOE, else transformers' own model);
any transformers causal LM is built and sharded in place (transformers_model.py), its disk
tensors mapped by transformers' own conversion rules (conversion.py, tiles.py); a model
whose parameter names are the HF names needs no adapter (GENERIC).
"""

from flatshard.hf.adapter import GENERIC, StateDictAdapter, adapter_for, adapter_for_config
from flatshard.hf.checkpoint import read_hf_config
from flatshard.hf.errors import HFCheckpointError, HFConfigError
from flatshard.hf.llama import LLAMA, LLAMA_RULES
from flatshard.hf.llama_config import IGNORED_FIELDS, config_to_hf, hf_to_config
from flatshard.hf.load import LoadStats, load_pretrained
from flatshard.hf.moe import MOE, MOE_RULES
from flatshard.hf.moe_config import hf_to_moe_config, moe_config_to_hf
from flatshard.hf.names import NameRule, TensorMapping, plan_tensors
from flatshard.hf.pretrained import from_pretrained
from flatshard.hf.save import save_pretrained
from flatshard.hf.transformers_model import TRANSFORMERS, build_causal_lm, shard_decoder_layers

__all__ = [
    "GENERIC",
    "IGNORED_FIELDS",
    "LLAMA",
    "LLAMA_RULES",
    "HFCheckpointError",
    "HFConfigError",
    "LoadStats",
    "MOE",
    "MOE_RULES",
    "NameRule",
    "StateDictAdapter",
    "TRANSFORMERS",
    "TensorMapping",
    "adapter_for",
    "adapter_for_config",
    "build_causal_lm",
    "config_to_hf",
    "from_pretrained",
    "hf_to_config",
    "hf_to_moe_config",
    "load_pretrained",
    "moe_config_to_hf",
    "plan_tensors",
    "read_hf_config",
    "save_pretrained",
    "shard_decoder_layers",
]
