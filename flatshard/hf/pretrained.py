"""`from_pretrained`: a model built, sharded and loaded from a Hugging Face directory.

The model is built on the meta device by its family's adapter, so no rank ever holds more
than its shards plus the parameters left unsharded: the sharding function wraps it
(allocating only this rank's shards), `materialize` initialises the shards, unsharded meta
parameters get empty storage, and the load then overwrites every parameter (a strict load
fills them all).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from flatshard.api.parallelize import parallelize
from flatshard.hf.adapter import StateDictAdapter, adapter_for_config
from flatshard.hf.checkpoint import read_hf_config
from flatshard.hf.load import load_pretrained
from flatshard.mesh import Meshes, ParallelDims, default_device


def from_pretrained(
    path: str | Path,
    *,
    shard: Callable[[nn.Module], object] | None = None,
    device: torch.device | str | None = None,
    adapter: StateDictAdapter | None = None,
    dtype: torch.dtype | None = None,
    dims: ParallelDims | Meshes | None = None,
) -> nn.Module:
    """Build the model `path/config.json` describes, apply `shard` (e.g. fully_shard each
    block, then the root; None keeps it unsharded) and load the weights. Call on every rank.

    dims: split the model with `flatshard.parallelize(model, dims)` instead of `shard`
    (tensor parallelism by the model's plan -- a transformers model's own
    `base_model_tp_plan` --, then FSDP/HSDP); each rank reads only its slices.

    Llama, Qwen2 and Qwen3 checkpoints build flatshard's reference Llama; any other
    transformers causal LM (or any, with adapter=flatshard.hf.TRANSFORMERS) builds the
    transformers model itself, sharded in place. shard=flatshard.hf.shard_decoder_layers
    shards each decoder layer and the root of either. dtype: of the parameters (default
    float32; the checkpoint's values are cast to it).
    """
    if dims is not None:
        if shard is not None:
            raise TypeError("from_pretrained takes shard= or dims=, not both")
        shard = functools.partial(parallelize, dims=dims)
    hf_config = read_hf_config(path)
    adapter = adapter or adapter_for_config(hf_config)
    device = torch.device(device) if device else default_device()
    with torch.device("meta"):
        # config errors before anything is allocated
        model = adapter.build(hf_config, dtype)
    if shard is not None:
        shard(model)
    adapter.allocate(model, device)
    load_pretrained(model, path, adapter=adapter)
    return model
