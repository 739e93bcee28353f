"""The adapter of flatshard's reference Llama (Llama, Qwen2 and Qwen3 checkpoints): its
parameter names, its fused gate/up projection, its config.json conversion. The one place
in `flatshard.hf` that knows the Llama model."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flatshard.hf.adapter import (
    StateDictAdapter,
    config_differences,
    export_dtype,
    register,
    with_extra_fields,
)
from flatshard.hf.checkpoint import read_hf_config
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.names import NameRule
from flatshard.models.llama.hf_config import (
    ARCHITECTURES,
    IGNORED_FIELDS,
    config_to_hf,
    hf_to_config,
)
from flatshard.models.llama.model import Llama, LlamaConfig

# Llama, Qwen2 and Qwen3 share one HF naming; which tensors exist follows from which
# parameters the model has (biases for Qwen2, q/k norms for Qwen3, no lm_head when tied).
LLAMA_RULES: tuple[NameRule, ...] = (
    NameRule("model.embed_tokens.weight", "embed_tokens.weight"),
    NameRule("model.layers.{n}.input_layernorm.weight", "layers.{n}.attn_norm.weight"),
    # q/k/v/o_proj weights and biases, q_norm and k_norm: same names below self_attn
    NameRule("model.layers.{n}.self_attn.{module}.{tensor}", "layers.{n}.attn.{module}.{tensor}"),
    NameRule("model.layers.{n}.post_attention_layernorm.weight", "layers.{n}.mlp_norm.weight"),
    NameRule(
        "model.layers.{n}.mlp.gate_proj.weight",
        "layers.{n}.mlp.gate_up_proj.weight",
        component="gate_proj.weight",
    ),
    NameRule(
        "model.layers.{n}.mlp.up_proj.weight",
        "layers.{n}.mlp.gate_up_proj.weight",
        component="up_proj.weight",
    ),
    NameRule("model.layers.{n}.mlp.down_proj.weight", "layers.{n}.mlp.down_proj.weight"),
    NameRule("model.norm.weight", "norm.weight"),
    NameRule("lm_head.weight", "lm_head.weight"),
)
"""Hugging Face tensor names of Llama, Qwen2 and Qwen3 against the reference Llama's."""


class LlamaAdapter(StateDictAdapter):
    rules = LLAMA_RULES
    architectures = tuple(ARCHITECTURES)

    def handles(self, model: nn.Module) -> bool:
        config = getattr(model, "config", None)
        # exactly: a MoEConfig is a LlamaConfig too, and the MoE has an adapter of its own
        return type(config) is LlamaConfig

    def handles_config(self, hf_config: dict) -> bool:
        return hf_config.get("architectures") in ([arch] for arch in ARCHITECTURES)

    def build(self, hf_config: dict, dtype: torch.dtype | None = None) -> nn.Module:
        model = Llama(hf_to_config(hf_config))
        return model if dtype is None else model.to(dtype)

    def check_config(self, model: nn.Module, path: Path) -> None:
        if not (path / "config.json").is_file():
            return
        ours, theirs = model.config, hf_to_config(read_hf_config(path))
        # max_seq_len only bounds the inputs: a shorter limit than the checkpoint's is fine
        differ = config_differences(ours, theirs, skip={"max_seq_len"})
        if differ:
            raise HFCheckpointError(
                f"the model's config differs from {path / 'config.json'}: {'; '.join(differ)}. "
                "Build the model with flatshard.models.llama.hf_to_config(read_hf_config(path)), "
                "or pass check_config=False if the difference is intended."
            )

    def export_config(self, model: nn.Module, dtype: torch.dtype | None, extra: dict) -> dict:
        hf = config_to_hf(model.config, export_dtype(model, dtype))
        return with_extra_fields(hf, extra, IGNORED_FIELDS)

    def mismatch_hints(self, model: nn.Module, unexpected: list[str]) -> list[str]:
        if "lm_head.weight" in unexpected and model.config.tie_embeddings:
            return [
                "  (the model ties lm_head to embed_tokens but the checkpoint stores "
                "lm_head.weight: build the model with tie_embeddings=False)"
            ]
        return []


LLAMA = register(LlamaAdapter())
"""The adapter of Llama, Qwen2 and Qwen3 checkpoints into flatshard's reference `Llama`."""
