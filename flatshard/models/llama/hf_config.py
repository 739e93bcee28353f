"""Translate a Hugging Face `config.json` (as a dict) to and from flatshard's `LlamaConfig`.

Three HF architectures share flatshard's Llama model: Llama (plain), Qwen2 (bias on q, k,
v) and Qwen3 (per-head RMSNorm on q and k). Every field of the dict is accounted for: it is
read, or it must hold the one value flatshard implements, or it is on the explicit list of
fields that do not change the model's math. Anything else is an error naming the field,
never silently dropped: a dropped field is a model that quietly computes something else.
"""

from __future__ import annotations

import math
import re

import torch

from flatshard.hf.errors import HFConfigError
from flatshard.models.llama.model import LlamaConfig

# architecture -> model_type, one per supported HF class
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# What transformers 5.18's config classes assume for a field absent from config.json.
# Absent means "the class default", so we must apply the same defaults to agree with HF.
_LLAMA_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, head_dim=None,
    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
_QWEN_DEFAULTS = dict(
    vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
    max_position_embeddings=32768,
)  # fmt: skip
_DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    "qwen2": {**_LLAMA_DEFAULTS, **_QWEN_DEFAULTS},
    "qwen3": {**_LLAMA_DEFAULTS, **_QWEN_DEFAULTS, "head_dim": 128},
}
_READ = set(_LLAMA_DEFAULTS) | {
    "architectures", "model_type", "rope_parameters", "rope_scaling", "rope_theta",
    "partial_rotary_factor", "layer_types",
}  # fmt: skip

# field -> (values flatshard implements, why). Absent means the first value (HF's default).
_COMMON_FIXED = {
    "hidden_act": (("silu", "swish"), "the MLP is SwiGLU with SiLU"),
    "attention_dropout": ((0.0,), "flatshard's attention has no dropout"),
}
_FIXED = {
    "llama": {
        **_COMMON_FIXED,
        "attention_bias": ((False,), "HF Llama then also biases o_proj; flatshard never does"),
        "mlp_bias": ((False,), "flatshard's MLP has no biases"),
    },
    "qwen2": {
        **_COMMON_FIXED,
        "use_sliding_window": ((False,), "flatshard has no sliding-window attention"),
    },
    "qwen3": {
        **_COMMON_FIXED,
        "attention_bias": ((False,), "HF Qwen3 then also biases o_proj; flatshard never does"),
        "use_sliding_window": ((False,), "flatshard has no sliding-window attention"),
    },
}

# Fields that do not change the weights or the forward math, ignored on purpose.
IGNORED_FIELDS = frozenset({
    # bookkeeping and dtype (the weights' dtype comes from the safetensors files)
    "transformers_version", "dtype", "torch_dtype", "_name_or_path", "name_or_path",
    # tokenizer and generation settings
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tokenizer_class", "use_cache", "max_length", "min_length", "do_sample", "temperature",
    "top_k", "top_p", "num_beams", "repetition_penalty", "bad_words_ids",
    # training-time init and HF output plumbing
    "initializer_range", "output_hidden_states", "output_attentions", "return_dict",
    "id2label", "label2id", "num_labels", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "torchscript", "use_bfloat16", "finetuning_task", "prefix", "task_specific_params",
    "pruned_heads", "tf_legacy_loss",
    # Llama: a slicing trick of the original training code; transformers 5 ignores it too
    "pretraining_tp",
    # Qwen2/3: only meaningful when use_sliding_window is true (checked to be false)
    "sliding_window", "max_window_layers",
})  # fmt: skip
"""config.json fields that change neither the weights nor the forward math."""


def is_metadata(field: str) -> bool:
    """Whether a config.json field is metadata that never changes the weights or the forward
    pass: the fields above, and by their names those transformers and the tools around it
    write as records (`_name_or_path`, `_model_name_or_path`, `unk_token_id`,
    `*_version`). Such a field never stops an import."""
    return (
        field in IGNORED_FIELDS
        or field.startswith("_")
        or field.endswith(("_token_id", "_token_ids", "_version"))
    )


def unknown_fields(hf: dict, known: set[str]) -> list[str]:
    """The fields of `hf` neither in `known` nor metadata, sorted."""
    return sorted(name for name in hf if name not in known and not is_metadata(name))


# LlamaConfig field -> config.json field, for error messages
_HF_NAMES = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size", "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings", "rope_factor": "rope_parameters.factor",
    "rope_low_freq_factor": "rope_parameters.low_freq_factor",
    "rope_high_freq_factor": "rope_parameters.high_freq_factor",
    "rope_original_max_seq_len": "rope_parameters.original_max_position_embeddings",
}  # fmt: skip
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# Llama 3.1-3.3 frequency scaling: config.json key -> LlamaConfig field
_LLAMA3_KEYS = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_seq_len",
}


def hf_to_config(hf: dict) -> LlamaConfig:
    """flatshard's `LlamaConfig` for a Llama/Qwen2/Qwen3 `config.json` dict."""
    model_type = _model_type(hf)
    get = lambda name: hf.get(name, _DEFAULTS[model_type][name])
    _check_fields(hf, model_type)
    _check_layer_types(hf)
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads")
    try:
        return LlamaConfig(
            vocab_size=get("vocab_size"),
            dim=get("hidden_size"),
            n_layers=get("num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=heads if kv_heads is None else kv_heads,
            head_dim=get("head_dim"),  # None: hidden_size // heads, as HF
            ffn_dim=get("intermediate_size"),
            norm_eps=float(get("rms_norm_eps")),
            **rope_fields(hf, get("max_position_embeddings")),
            max_seq_len=get("max_position_embeddings"),
            tie_embeddings=bool(get("tie_word_embeddings")),
            qk_norm=model_type == "qwen3",
            attention_bias=model_type == "qwen2",  # Qwen2 always biases q, k, v (never o)
        )
    except (TypeError, ValueError) as e:
        # LlamaConfig speaks of its own fields: name the config.json ones instead
        message = re.sub(r"\b\w+\b", lambda m: _HF_NAMES.get(m.group(), m.group()), str(e))
        raise HFConfigError(f"config.json describes an invalid model: {message}") from None


def config_to_hf(config: LlamaConfig, dtype: torch.dtype | None = None) -> dict:
    """A `config.json` dict that transformers builds into the same model.

    Qwen3 when q/k norms are on, Qwen2 when q/k/v biases are on, Llama otherwise.
    """
    if config.qk_norm and config.attention_bias:
        raise HFConfigError(
            "no Hugging Face architecture has both q/k norms (Qwen3) and q/k/v biases "
            "(Qwen2); turn one of qk_norm / attention_bias off to export this model"
        )
    arch = (
        "Qwen3ForCausalLM"
        if config.qk_norm
        else ("Qwen2ForCausalLM" if config.attention_bias else "LlamaForCausalLM")
    )
    model_type = ARCHITECTURES[arch]
    hf = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": _rope_parameters(config),
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    else:
        hf.update(
            use_sliding_window=False,
            sliding_window=None,
            layer_types=["full_attention"] * config.n_layers,
        )
    if model_type == "qwen3":
        hf["attention_bias"] = False
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    return hf


def _model_type(hf: dict) -> str:
    return model_type_of(hf, ARCHITECTURES, "flatshard imports")


def model_type_of(hf: dict, architectures: dict[str, str], importer: str) -> str:
    """The model_type of a config.json whose one architecture `importer` (a phrase: who
    imports it) knows, checked against its own model_type field."""
    archs = hf.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in architectures:
        raise HFConfigError(
            f"config.json field 'architectures' is {archs!r}; {importer} exactly one of "
            f"{sorted(architectures)}"
        )
    model_type = architectures[archs[0]]
    if hf.get("model_type", model_type) != model_type:
        raise HFConfigError(
            f"config.json field 'model_type' is {hf['model_type']!r} but 'architectures' is "
            f"{archs[0]!r}, whose model_type is {model_type!r}; fix one of them"
        )
    return model_type


def _check_fields(hf: dict, model_type: str) -> None:
    fixed = _FIXED[model_type]
    for name, (allowed, why) in fixed.items():
        value = hf.get(name, allowed[0])
        if value not in allowed:
            raise HFConfigError(
                f"config.json field {name!r} is {value!r}, which flatshard does not support "
                f"({why}); supported: {list(allowed)}"
            )
    # head_dim is read for Qwen2 too: its config class lacks the field, but its attention
    # takes config.head_dim when config.json sets one.
    unknown = unknown_fields(hf, _READ | set(fixed))
    if unknown:
        raise HFConfigError(
            f"config.json has field(s) {unknown} that flatshard does not know for {model_type}; "
            "they may change the model, so the import stops rather than ignore them. Remove "
            "them from config.json only if they do not change the weights or the forward pass."
        )


def _check_layer_types(hf: dict) -> None:
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise HFConfigError(
            f"config.json field 'layer_types' contains {other}; flatshard supports only "
            "'full_attention' layers (no sliding-window attention)"
        )


def _rope_parameters(config: LlamaConfig) -> dict:
    params = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type == "llama3":
        params.update({key: getattr(config, field) for key, field in _LLAMA3_KEYS.items()})
    return params


def rope_fields(hf: dict, max_position_embeddings: int) -> dict:
    """LlamaConfig's RoPE fields from `rope_parameters` (transformers 5) or the 4.x
    `rope_scaling`/`rope_theta`: plain RoPE, or Llama 3.1's "llama3" scaling."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(field) or {}
    if not isinstance(params, dict):
        raise HFConfigError(f"config.json field {field!r} must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise HFConfigError(
            f"config.json field '{field}.rope_type' is {rope_type!r}; flatshard supports "
            "rope_type 'default' (plain RoPE) and 'llama3' (Llama 3.1 scaling), not scalings "
            "such as yarn, linear, dynamic or longrope"
        )
    known = _ROPE_KEYS | (set(_LLAMA3_KEYS) if rope_type == "llama3" else set())
    extra = sorted(set(params) - known)
    if extra:
        raise HFConfigError(
            f"config.json field {field!r} has key(s) {extra} that rope_type {rope_type!r} does "
            f"not use; flatshard reads only {sorted(known)} there"
        )
    fields = {"rope_theta": _rope_theta(hf, params), "rope_type": rope_type}
    if rope_type == "llama3":
        missing = sorted(set(_LLAMA3_KEYS) - set(params) - {"original_max_position_embeddings"})
        if missing:
            raise HFConfigError(
                f"config.json field {field!r} has rope_type 'llama3' but lacks {missing}; "
                "Llama 3.1 scaling needs factor, low_freq_factor and high_freq_factor"
            )
        # transformers defaults the pretraining context to max_position_embeddings
        values = {"original_max_position_embeddings": max_position_embeddings, **params}
        fields.update({f: values[key] for key, f in _LLAMA3_KEYS.items()})
    return fields


def _rope_theta(hf: dict, params: dict) -> float:
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1.0):
        raise HFConfigError(
            f"config.json 'partial_rotary_factor' is {factor!r}; flatshard rotates the whole "
            "head (factor 1.0 only)"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise HFConfigError(f"config.json rope_theta must be a positive number, got {theta!r}")
    return float(theta)
