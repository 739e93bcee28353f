"""Hugging Face import/export through per-family state-dict adapters (adapter.py).

model = flatshard.hf.from_pretrained(path, shard=flatshard.models.shard_decoder_layers)
flatshard.hf.load_pretrained(model, path)                          # into an existing model
flatshard.hf.save_pretrained(model, out_path, max_shard_size="5GB")
for name, tensor in flatshard.full_weights(model): ...       # stream into an engine

This package is generic and imports no model: each of flatshard's model families registers
its adapter from its own folder (flatshard/models/llama/hf_adapter.py: Llama, Qwen2, Qwen3
checkpoints; flatshard/models/moe/hf_adapter.py: Qwen3-MoE, Mixtral, from_pretrained builds
it with adapter=MOE, else transformers' own model); any transformers causal LM is built
and sharded in place by flatshard/models/transformers/, its disk tensors mapped by
transformers' own conversion rules (conversion.py, tiles.py); a model whose parameter names
are the HF names needs no adapter (GENERIC). That family's TRANSFORMERS, build_causal_lm and
shard_decoder_layers are read here too: the package face (flatshard/__init__.py), above
both, hands them down, so this layer imports nothing above it.
"""

from flatshard.hf.adapter import GENERIC, StateDictAdapter, adapter_for, adapter_for_config
from flatshard.hf.checkpoint import read_hf_config
from flatshard.hf.errors import HFCheckpointError, HFConfigError
from flatshard.hf.load import LoadStats, load_pretrained
from flatshard.hf.names import NameRule, TensorMapping, plan_tensors
from flatshard.hf.pretrained import from_pretrained
from flatshard.hf.save import save_pretrained
from flatshard.hf.stream import full_weights

__all__ = [
    "GENERIC",
    "HFCheckpointError",
    "HFConfigError",
    "LoadStats",
    "NameRule",
    "StateDictAdapter",
    "TensorMapping",
    "adapter_for",
    "adapter_for_config",
    "from_pretrained",
    "full_weights",
    "load_pretrained",
    "plan_tensors",
    "read_hf_config",
    "save_pretrained",
]
