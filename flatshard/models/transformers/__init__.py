"""Any transformers causal LM as a model family: built from its config.json on the meta
device (build.py), split by its own decoder layers and TP/EP plans through `parallelize`
(parallel.py), its parameters mapped to the tensors on disk by transformers' own
conversion rules (hf_adapter.py, over flatshard/hf/conversion.py)."""

from flatshard.models.transformers.build import build_causal_lm
from flatshard.models.transformers.hf_adapter import TRANSFORMERS, TransformersAdapter
from flatshard.models.transformers.parallel import decoder_layers, shard_decoder_layers

__all__ = [
    "TRANSFORMERS",
    "TransformersAdapter",
    "build_causal_lm",
    "decoder_layers",
    "shard_decoder_layers",
]
