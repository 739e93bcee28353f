"""Models for `flatshard plan`: their units (one per transformer block, plus the root) with
every parameter's shape, and how many activation bytes a token leaves for backward.

Dense Llama/Qwen2/Qwen3 models are the reference `Llama`, built on the meta device from
their Hugging Face config, and a training config's MoE model the reference `MoE`; the
parameters are read off it exactly as `fully_shard` collects them. Hugging Face
mixture-of-experts configs (Qwen3-MoE, Mixtral, DeepSeek-V3) are described by their layer
shapes from the public configs, with grouped expert weights `(experts, out, in)` as a
grouped-GEMM implementation (and the reference `MoE`) holds them.
"""

from __future__ import annotations

import json
import os
from functools import partial

import torch

from flatshard.errors import ConfigError
from flatshard.layout import ParamInfo
from flatshard.models import Llama, LlamaConfig, MoEConfig, family_of_config
from flatshard.models.lora import LoRASpec
from flatshard.planner.activations import (
    FP32,
    Activations,
    Saved,
    attention_bytes,
    layer_activations,
    norm_bytes,
    projection_outputs,
    swiglu_bytes,
)
from flatshard.planner.model_spec import ModelSpec, UnitSpec, adapt, nf4_shapes, param_infos

# --- the zoo: public Hugging Face configs (only the fields that shape the weights) --------

ZOO: dict[str, dict] = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False,
    ),
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=1536, tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8,
        num_experts_per_tok=2, intermediate_size=14336, tie_word_embeddings=False,
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
        first_k_dense_replace=3, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False,
    ),
}  # fmt: skip


def resolve(name_or_path: str, lora: LoRASpec | None = None, nf4: bool = False) -> ModelSpec:
    """A zoo name, or a path to a Hugging Face config.json (or the directory holding it);
    lora: its projections adapted, the rest frozen (what `train --lora` trains); nf4: their
    bases in NF4 (`train --qlora`)."""
    if name_or_path in ZOO:
        return from_hf_config(ZOO[name_or_path], name_or_path, lora, nf4)
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"unknown model {name_or_path!r}: name one of {', '.join(ZOO)} or give a Hugging "
            "Face config.json"
        )
    try:
        with open(path) as handle:
            hf = json.load(handle)
    except ValueError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
    return from_hf_config(hf, path, lora, nf4)


def from_hf_config(
    hf: dict, name: str, lora: LoRASpec | None = None, nf4: bool = False
) -> ModelSpec:
    model_type = hf.get("model_type")
    if lora is not None and model_type in ("qwen3_moe", "mixtral", "deepseek_v3"):
        raise ConfigError(f"{name}: LoRA plans are for dense models so far (not {model_type})")
    if model_type == "qwen3_moe":  # transformers 5 writes num_local_experts, 4.x num_experts
        experts = hf.get("num_local_experts", hf.get("num_experts"))
        return _moe(hf, name, experts=experts, ffn=hf["moe_intermediate_size"], qk_norm=True)
    if model_type == "mixtral":
        return _moe(
            hf, name, experts=hf["num_local_experts"], ffn=hf["intermediate_size"], qk_norm=False
        )
    if model_type == "deepseek_v3":
        return _deepseek_v3(hf, name)
    from flatshard.models.llama import hf_to_config  # Llama, Qwen2, Qwen3: the reference model
    from flatshard.models.llama.hf_config import ARCHITECTURES

    if model_type not in (None, *ARCHITECTURES.values()):  # the transformers model itself
        from flatshard.planner.zoo_transformers import from_transformers_config

        return from_transformers_config(hf, name, lora, nf4)
    return from_llama_config(hf_to_config(hf), name, lora, nf4)


# --- dense: the reference Llama on the meta device ----------------------------------------


def from_llama_config(
    cfg: LlamaConfig, name: str, lora: LoRASpec | None = None, nf4: bool = False
) -> ModelSpec:
    """The reference model of the config's family (the Llama, or the MoE for a MoEConfig)."""
    family = family_of_config(cfg)
    with torch.device("meta"):
        model = family.model_type(cfg)
    adapt(model, lora, name, nf4)
    units = _layer_units(model)
    if cfg.tie_embeddings:  # embedding and head are one parameter: the root keeps it
        parts = [("root", ("embed_tokens.",), False), ("norm", ("norm.",), False)]
    else:  # the embedding is a unit over one plain nn.Embedding
        parts = [("embed_tokens", ("embed_tokens.",), True)]
        parts.append(("norm+lm_head", ("norm.", "lm_head."), False))
    units += tuple(_root_part(model, *part) for part in parts)
    activations = ACTIVATIONS[family.name]
    top_k = getattr(cfg, "top_k", 0)
    return ModelSpec(name, units, cfg.n_layers, partial(activations, cfg), top_k=top_k)


def _layer_units(model) -> tuple[UnitSpec, ...]:
    """One unit spec per run of consecutive blocks with the same parameters (an MoE model's
    first dense layers, then its MoE layers)."""
    runs: list[tuple] = []  # (first layer, last layer, its ParamInfos, its NF4 bases)
    for index, layer in enumerate(model.layers):
        infos = param_infos(layer.named_parameters())
        nf4 = nf4_shapes(layer.named_parameters())
        if runs and runs[-1][2:] == (infos, nf4):
            runs[-1] = (runs[-1][0], index, infos, nf4)
        else:
            runs.append((index, index, infos, nf4))
    return tuple(UnitSpec(f"layers.{a}-{b}", infos, b - a + 1, nf4=nf4)
                 for a, b, infos, nf4 in runs)  # fmt: skip


def _root_part(model: Llama, name: str, prefixes: tuple[str, ...], embedding: bool) -> UnitSpec:
    named = [(n, p) for n, p in model.named_parameters() if n.startswith(prefixes)]
    nf4 = nf4_shapes(named)
    return UnitSpec(name, param_infos(named), is_root=True, embedding=embedding, nf4=nf4)


def _attention(cfg, a: int, grouped_kv: bool) -> Saved:
    return attention_bytes(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.qk_norm, a, grouped_kv)


def _dense_activations(cfg: LlamaConfig, a: int, grouped_kv: bool = False) -> Activations:
    layer = (
        2 * norm_bytes(cfg.dim, a)
        + _attention(cfg, a, grouped_kv)
        + swiglu_bytes(cfg.ffn_dim, a)
        + projection_outputs(cfg.dim, a)
    )
    return layer_activations([(cfg.n_layers, layer)], cfg.dim, cfg.vocab_size, a)


def _reference_moe_activations(cfg: MoEConfig, a: int, grouped_kv: bool = False) -> Activations:
    common = (
        2 * norm_bytes(cfg.dim, a)
        + _attention(cfg, a, grouped_kv)
        + projection_outputs(cfg.dim, a)
    )
    dense = common + swiglu_bytes(cfg.ffn_dim, a)
    moe = common + _moe_bytes(cfg.dim, cfg.n_experts, cfg.top_k, cfg.expert_ffn_dim, a)
    moe += swiglu_bytes(cfg.n_shared_experts * cfg.expert_ffn_dim, a)
    n_moe = cfg.n_layers - cfg.first_k_dense
    layers = [(cfg.first_k_dense, dense), (n_moe, moe)]
    return layer_activations([kind for kind in layers if kind[0]], cfg.dim, cfg.vocab_size, a)


# the activation bytes per token of each family's layers (by family name)
ACTIVATIONS = {"llama": _dense_activations, "moe": _reference_moe_activations}


# --- mixture of experts: layer shapes -------------------------------------------------------


def _p(name: str, *shape: int) -> ParamInfo:
    return ParamInfo(name, shape, torch.float32)


def _moe_params(hidden: int, experts: int, moe_ffn: int) -> list[ParamInfo]:
    return [
        _p("mlp.gate.weight", experts, hidden),
        _p("mlp.experts.gate_up_proj", experts, 2 * moe_ffn, hidden),
        _p("mlp.experts.down_proj", experts, hidden, moe_ffn),
    ]


def _moe_bytes(hidden: int, experts: int, top_k: int, moe_ffn: int, a: int) -> Saved:
    # router logits and fp32 probabilities; each token copied to its top_k experts.
    # Selective AC keeps the router's logits and each expert's products
    per_copy = Saved(a * hidden, a * hidden) + swiglu_bytes(moe_ffn, a)
    return Saved((a + FP32) * experts, a * experts) + top_k * per_copy


def _layer_norms(hidden: int) -> list[ParamInfo]:
    return [_p("input_layernorm.weight", hidden), _p("post_attention_layernorm.weight", hidden)]


def _root(vocab: int, hidden: int, tied: bool) -> tuple[UnitSpec, ...]:
    """A Hugging Face root: `model` (embedding, norm, the blocks) and `lm_head`; an untied
    head is a first-use group of its own."""
    params = (_p("embed_tokens.weight", vocab, hidden), _p("norm.weight", hidden))
    if tied:
        return (UnitSpec("root", params, is_root=True),)
    head = (_p("lm_head.weight", vocab, hidden),)
    return UnitSpec("root", params, is_root=True), UnitSpec("lm_head", head, is_root=True)


def _moe(hf: dict, name: str, experts: int, ffn: int, qk_norm: bool) -> ModelSpec:
    """A Qwen3-MoE (q/k norms) or Mixtral layer stack: attention, a router and grouped
    experts in every layer."""
    d, h, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    hd, top_k = hf.get("head_dim") or d // h, hf["num_experts_per_tok"]
    layers, vocab = hf["num_hidden_layers"], hf["vocab_size"]
    attention = [
        _p("self_attn.q_proj.weight", h * hd, d),
        _p("self_attn.k_proj.weight", kv * hd, d),
        _p("self_attn.v_proj.weight", kv * hd, d),
        _p("self_attn.o_proj.weight", d, h * hd),
    ]
    if qk_norm:
        attention += [_p("self_attn.q_norm.weight", hd), _p("self_attn.k_norm.weight", hd)]
    params = tuple(attention + _moe_params(d, experts, ffn) + _layer_norms(d))
    layer = UnitSpec(f"layers.0-{layers - 1}", params, layers)

    def activations(a: int, grouped_kv: bool = False) -> Activations:
        per_layer = (
            2 * norm_bytes(d, a)
            + attention_bytes(h, kv, hd, qk_norm, a, grouped_kv)
            + _moe_bytes(d, experts, top_k, ffn, a)
            + projection_outputs(d, a)
        )
        return layer_activations([(layers, per_layer)], d, vocab, a)

    roots = _root(vocab, d, hf.get("tie_word_embeddings", False))
    return ModelSpec(name, (layer, *roots), layers, activations, top_k=top_k)


def _deepseek_v3(hf: dict, name: str) -> ModelSpec:
    d, h, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
    q_rank, kv_rank = hf["q_lora_rank"], hf["kv_lora_rank"]
    nope, rope, v_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    layers, dense = hf["num_hidden_layers"], hf["first_k_dense_replace"]
    experts, top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    ffn = hf["moe_intermediate_size"]
    shared_ffn = hf["n_shared_experts"] * ffn
    mla = [  # multi-head latent attention
        _p("self_attn.q_a_proj.weight", q_rank, d),
        _p("self_attn.q_a_layernorm.weight", q_rank),
        _p("self_attn.q_b_proj.weight", h * (nope + rope), q_rank),
        _p("self_attn.kv_a_proj_with_mqa.weight", kv_rank + rope, d),
        _p("self_attn.kv_a_layernorm.weight", kv_rank),
        _p("self_attn.kv_b_proj.weight", h * (nope + v_dim), kv_rank),
        _p("self_attn.o_proj.weight", d, h * v_dim),
    ]
    dense_mlp = [
        _p("mlp.gate_up_proj.weight", 2 * hf["intermediate_size"], d),
        _p("mlp.down_proj.weight", d, hf["intermediate_size"]),
    ]
    shared = [
        _p("mlp.shared_experts.gate_up_proj.weight", 2 * shared_ffn, d),
        _p("mlp.shared_experts.down_proj.weight", d, shared_ffn),
    ]
    units = (
        UnitSpec(f"layers.0-{dense - 1} (dense)", tuple(mla + dense_mlp + _layer_norms(d)), dense),
        UnitSpec(
            f"layers.{dense}-{layers - 1} (MoE)",
            tuple(mla + _moe_params(d, experts, ffn) + shared + _layer_norms(d)),
            layers - dense,
        ),
        *_root(vocab, d, hf.get("tie_word_embeddings", False)),
    )

    def activations(a: int, grouped_kv: bool = False) -> Activations:
        # (multi-head latent attention: as many key and value heads as query heads)
        qk = h * (nope + rope)
        # the latents, q, k, v, SDPA's output and o_proj's input; selective AC keeps the
        # projections' outputs and SDPA's
        products = a * (q_rank + kv_rank + rope + 2 * qk + 2 * h * v_dim) + FP32 * h
        attention = (
            norm_bytes(q_rank, a) + norm_bytes(kv_rank, a)
            + Saved(a * (kv_rank + rope) + a * (2 * qk + 3 * h * v_dim) + FP32 * h, products)
        )  # fmt: skip
        common = 2 * norm_bytes(d, a) + attention + projection_outputs(d, a)
        dense_layer = common + swiglu_bytes(hf["intermediate_size"], a)
        moe_layer = common + _moe_bytes(d, experts, top_k, ffn, a) + swiglu_bytes(shared_ffn, a)
        return layer_activations([(dense, dense_layer), (layers - dense, moe_layer)], d, vocab, a)

    return ModelSpec(name, units, layers, activations, top_k=top_k)
