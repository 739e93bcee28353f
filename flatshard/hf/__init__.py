"""Hugging Face import/export through per-family state-dict adapters (adapter.py).

model = flatshard.hf.from_pretrained(path, shard=flatshard.hf.shard_decoder_layers)  # build + load
flatshard.hf.load_pretrained(model, path)                          # into an existing model
flatshard.hf.save_pretrained(model, out_path, max_shard_size="5GB")
for name, tensor in flatshard.full_weights(model): ...       # stream into an engine

This package is generic and imports no model: each of flatshard's model families registers
its adapter from its own folder (flatshard/models/llama/hf_adapter.py: Llama, Qwen2, Qwen3
checkpoints; flatshard/models/moe/hf_adapter.py: Qwen3-MoE, Mixtral, from_pretrained builds
it with adapter=MOE, else transformers' own model); any transformers causal LM is built
and sharded in place (transformers_model.py), its disk tensors mapped by transformers' own
conversion rules (conversion.py, tiles.py); a model whose parameter names are the HF names
needs no adapter (GENERIC).
"""

from flatshard.hf.adapter import GENERIC, StateDictAdapter, adapter_for, adapter_for_config
from flatshard.hf.checkpoint import read_hf_config
from flatshard.hf.errors import HFCheckpointError, HFConfigError
from flatshard.hf.load import LoadStats, load_pretrained
from flatshard.hf.names import NameRule, TensorMapping, plan_tensors
from flatshard.hf.pretrained import from_pretrained
from flatshard.hf.save import save_pretrained
from flatshard.hf.stream import full_weights
from flatshard.hf.transformers_model import TRANSFORMERS, build_causal_lm, shard_decoder_layers

__all__ = [
    "GENERIC",
    "HFCheckpointError",
    "HFConfigError",
    "LoadStats",
    "NameRule",
    "StateDictAdapter",
    "TRANSFORMERS",
    "TensorMapping",
    "adapter_for",
    "adapter_for_config",
    "build_causal_lm",
    "from_pretrained",
    "full_weights",
    "load_pretrained",
    "plan_tensors",
    "read_hf_config",
    "save_pretrained",
    "shard_decoder_layers",
]
