"""Hugging Face import/export: Llama, Qwen2 and Qwen3 safetensors checkpoints.

model = flatshard.hf.from_pretrained(path, shard=my_sharding_fn)   # build + load
flatshard.hf.load_pretrained(model, path)                          # into an existing model
flatshard.hf.save_pretrained(model, out_path, max_shard_size="5GB")
"""

from flatshard.hf.config import IGNORED_FIELDS, config_to_hf, hf_to_config, read_hf_config
from flatshard.hf.errors import HFCheckpointError, HFConfigError
from flatshard.hf.load import LoadStats, load_pretrained
from flatshard.hf.names import LLAMA_RULES, NameRule, TensorMapping, plan_tensors
from flatshard.hf.pretrained import from_pretrained
from flatshard.hf.save import save_pretrained

__all__ = [
    "IGNORED_FIELDS",
    "LLAMA_RULES",
    "HFCheckpointError",
    "HFConfigError",
    "LoadStats",
    "NameRule",
    "TensorMapping",
    "config_to_hf",
    "from_pretrained",
    "hf_to_config",
    "load_pretrained",
    "plan_tensors",
    "read_hf_config",
    "save_pretrained",
]
