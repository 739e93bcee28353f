"""Translate a Hugging Face Qwen3-MoE or Mixtral `config.json` (as a dict) to and from
flatshard's `MoEConfig`.

As llama/hf_config.py does for the dense families, every field is accounted for: read, held
to the one value flatshard implements, or on the list of fields that do not change the
model (`IGNORED_FIELDS`). Defaults of absent fields, and the aliases transformers accepts
(`num_experts` / `num_local_experts`, `rope_scaling` / `rope_parameters`), are resolved by
transformers' own config class, so they are those of the installed version.

DeepSeek-V3 is not among them: its attention is MLA, which the reference MoE lacks (its
MoE layers alone are checked against transformers in tests/test_moe_hf.py).
"""

from __future__ import annotations

import re

import torch

from flatshard.hf.errors import HFConfigError
from flatshard.models.llama.hf_config import model_type_of, rope_fields, unknown_fields
from flatshard.models.moe.config import MoEConfig

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}

_COMMON_READ = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "rope_scaling", "rope_theta", "num_experts_per_tok", "num_experts", "num_local_experts",
    "router_aux_loss_coef", "output_router_logits",
    # checked through the resolved `sliding_window` (None: full attention)
    "sliding_window", "use_sliding_window",
}  # fmt: skip
_READ = {
    "qwen3_moe": _COMMON_READ
    | {"moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"},
    "mixtral": _COMMON_READ,
}
# resolved field -> (values flatshard implements, why)
_COMMON_FIXED = {
    "hidden_act": (("silu", "swish"), "the experts are SwiGLU with SiLU"),
    "attention_dropout": ((0.0,), "flatshard's attention has no dropout"),
    "sliding_window": ((None,), "flatshard has no sliding-window attention"),
}
_FIXED = {
    "qwen3_moe": {
        **_COMMON_FIXED,
        "attention_bias": ((False,), "flatshard's attention has no biases"),
        "decoder_sparse_step": ((1,), "flatshard's MoE layers are all layers after the first k"),
    },
    "mixtral": {
        **_COMMON_FIXED,
        "router_jitter_noise": ((0.0,), "flatshard's router adds no noise in training"),
    },
}
# MoEConfig field -> config.json field, for error messages
HF_NAMES = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "ffn_dim": "intermediate_size", "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_parameters.rope_theta", "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings", "n_experts": "num_experts",
    "top_k": "num_experts_per_tok", "expert_ffn_dim": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob", "first_k_dense": "mlp_only_layers",
    "qk_norm": "architectures",
}  # fmt: skip


def hf_to_moe_config(hf: dict) -> MoEConfig:
    """flatshard's `MoEConfig` for a Qwen3-MoE or Mixtral `config.json` dict."""
    model_type = _model_type(hf)
    unknown = unknown_fields(hf, _READ[model_type] | set(_FIXED[model_type]))
    if unknown:
        raise HFConfigError(
            f"config.json has field(s) {unknown} that flatshard does not know for {model_type}; "
            "they may change the model, so the import stops rather than ignore them"
        )
    config = _resolved(hf, model_type)
    for name, (allowed, why) in _FIXED[model_type].items():
        value = getattr(config, name)
        if value not in allowed:
            raise HFConfigError(
                f"config.json field {name!r} is {value!r}, which flatshard does not support "
                f"({why}); supported: {list(allowed)}"
            )
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":  # the MoE model's forward has no frequency scaling
        raise HFConfigError(
            f"config.json field 'rope_parameters.rope_type' is {rope_type!r}; flatshard's MoE "
            "model rotates with plain RoPE only (rope_type 'default')"
        )
    rope = rope_fields({"rope_parameters": config.rope_parameters}, config.max_position_embeddings)
    qwen = model_type == "qwen3_moe"
    try:
        return MoEConfig(
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None),  # None: hidden_size // heads, as HF
            # Mixtral has no dense layers: its intermediate_size is the experts'
            ffn_dim=config.intermediate_size,
            norm_eps=float(config.rms_norm_eps),
            rope_theta=rope["rope_theta"],
            max_seq_len=config.max_position_embeddings,
            tie_embeddings=bool(config.tie_word_embeddings),
            qk_norm=qwen,
            n_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            expert_ffn_dim=config.moe_intermediate_size if qwen else config.intermediate_size,
            norm_topk_prob=bool(config.norm_topk_prob) if qwen else True,  # Mixtral always
            first_k_dense=_first_k_dense(config.mlp_only_layers) if qwen else 0,
            # transformers adds the auxiliary loss only with output_router_logits
            aux_loss_coef=float(config.router_aux_loss_coef * bool(config.output_router_logits)),
        )
    except (TypeError, ValueError) as e:
        message = re.sub(r"\b\w+\b", lambda m: HF_NAMES.get(m.group(), m.group()), str(e))
        raise HFConfigError(f"config.json describes an invalid model: {message}") from None


def moe_config_to_hf(config: MoEConfig, dtype: torch.dtype | None = None) -> dict:
    """A `config.json` dict that transformers builds into the same model: Qwen3-MoE when
    q/k norms are on, Mixtral otherwise."""
    refused = {
        "score_func": (config.score_func, "softmax"),
        "score_bias": (config.score_bias, False),
        "n_groups": (config.n_groups, 1),
        "routed_scaling": (config.routed_scaling, 1.0),
        "n_shared_experts": (config.n_shared_experts, 0),
        "attention_bias": (config.attention_bias, False),
        "rope_type": (config.rope_type, "default"),
    }
    if not config.qk_norm:  # Mixtral: every layer MoE, top-k always renormalised
        refused["norm_topk_prob"] = (config.norm_topk_prob, True)
        refused["first_k_dense"] = (config.first_k_dense, 0)
    off = [f"{k}={got!r} (needs {want!r})" for k, (got, want) in refused.items() if got != want]
    if off:
        arch = "Qwen3-MoE" if config.qk_norm else "Mixtral (qk_norm=False)"
        raise HFConfigError(
            f"this MoE model cannot be written as {arch}: {', '.join(off)}; flatshard exports "
            "Qwen3-MoE and Mixtral checkpoints only (DeepSeek-V3 needs MLA attention)"
        )
    hf = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.top_k,
        "router_aux_loss_coef": config.aux_loss_coef,
        "output_router_logits": config.aux_loss_coef > 0,
    }
    if config.qk_norm:
        hf.update(
            architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
            intermediate_size=config.ffn_dim, moe_intermediate_size=config.expert_ffn_dim,
            norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1,
            mlp_only_layers=list(range(config.first_k_dense)), attention_bias=False,
            use_sliding_window=False,
        )  # fmt: skip
    else:
        hf.update(
            architectures=["MixtralForCausalLM"], model_type="mixtral",
            intermediate_size=config.expert_ffn_dim, router_jitter_noise=0.0,
        )  # fmt: skip
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    return hf


def _model_type(hf: dict) -> str:
    return model_type_of(hf, ARCHITECTURES, "flatshard's MoE model imports")


def _resolved(hf: dict, model_type: str):
    """transformers' config object for `hf`: its defaults for absent fields, its aliases."""
    try:
        import transformers
    except ImportError:
        raise HFConfigError(
            "importing a Qwen3-MoE or Mixtral checkpoint needs transformers (pip install it)"
        ) from None
    try:
        return transformers.CONFIG_MAPPING[model_type].from_dict(hf)
    except (TypeError, ValueError) as e:
        raise HFConfigError(f"transformers rejects this config.json: {e}") from None


def _first_k_dense(mlp_only_layers) -> int:
    """Qwen3-MoE's dense layers as flatshard's `first_k_dense`: they must be the first k."""
    layers = sorted(mlp_only_layers or [])
    if layers != list(range(len(layers))):
        raise HFConfigError(
            f"config.json field 'mlp_only_layers' is {mlp_only_layers!r}; flatshard's MoE "
            "model has its dense layers first (mlp_only_layers = [0, 1, ..., k-1])"
        )
    return len(layers)
