"""`flatshard plan` for any transformers causal LM the zoo has no formulas for (Phi-3,
Gemma, GPT-NeoX, OLMoE, Qwen3-Next, ...): the transformers model itself, built on the meta
device from its config.json as `flatshard train --hf` builds it, its decoder layers the
units, split over TP as transformers' own plan says (`tensor_parallel_splits`, the
planner's view of what `parallelize` applies). Activations are estimated with the dense
Llama formulas from the config's widths (an MoE's routed experts as `top_k` MLPs).
"""

from __future__ import annotations

from functools import partial

import torch

from flatshard.errors import ConfigError, MeshError
from flatshard.planner.activations import (
    Activations,
    attention_bytes,
    layer_activations,
    norm_bytes,
    projection_outputs,
    swiglu_bytes,
)
from flatshard.planner.model_spec import ModelSpec, UnitSpec, adapt, nf4_shapes, param_infos


def from_transformers_config(hf_config: dict, name: str, lora=None, nf4=False) -> ModelSpec:
    from flatshard.hf import HFConfigError
    from flatshard.models.transformers import build_causal_lm, decoder_layers

    try:
        with torch.device("meta"):
            model = build_causal_lm(hf_config)
        layers = decoder_layers(model)
    except HFConfigError as error:
        raise ConfigError(f"{name}: {error}") from None
    adapt(model, lora, name, nf4)
    names = {id(m): n for n, m in model.named_modules()}
    runs: list[tuple] = []  # (first layer, last layer, its ParamInfos, its shapes, NF4 bases)
    for index, layer in enumerate(layers):
        prefix = names[id(layer)]
        named = list(layer.named_parameters())
        shapes = tuple((n, tuple(p.shape)) for n, p in named)
        if runs and runs[-1][3] == shapes:  # the same layer again: one more of the run
            runs[-1] = (runs[-1][0], index, *runs[-1][2:])
        else:
            infos = param_infos((f"{prefix}.{n}", p) for n, p in named)
            runs.append((index, index, infos, shapes, nf4_shapes(named)))
    units = [UnitSpec(f"layers.{a}-{b}", infos, b - a + 1, nf4=nf4)
             for a, b, infos, _, nf4 in runs]  # fmt: skip
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in in_layers]
    units.append(UnitSpec("root", param_infos(root), is_root=True, nf4=nf4_shapes(root)))
    config = model.config

    splits: dict[int, dict] = {}  # tp -> {parameter: (dim, parts)}, computed once

    def tp_local_shape(param: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        if tp not in splits:
            splits[tp] = _splits(model, tp)
        if param not in splits[tp]:
            return tuple(shape)
        dim, _ = splits[tp][param]
        return tuple(n // tp if d == dim else n for d, n in enumerate(shape))

    return ModelSpec(
        name,
        tuple(units),
        len(layers),
        partial(_activations, config),
        top_k=getattr(config, "num_experts_per_tok", 0) or 0,
        tp_local_shape=tp_local_shape,
    )


def _splits(model, tp: int) -> dict:
    from flatshard.parallel.transformers_plan import tensor_parallel_splits

    try:
        return tensor_parallel_splits(model, tp) if tp > 1 else {}
    except MeshError as error:
        raise ConfigError(f"--tp {tp}: {error}") from None


def _activations(config, a: int, grouped_kv: bool = False) -> Activations:
    hidden = config.hidden_size
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    expert = getattr(config, "moe_intermediate_size", None)
    ffn = (
        (expert * top_k) if (top_k and expert) else getattr(config, "intermediate_size", 4 * hidden)
    )
    layer = (
        2 * norm_bytes(hidden, a)
        + attention_bytes(
            heads, getattr(config, "num_key_value_heads", heads) or heads, head_dim, False, a,
            grouped_kv,
        )  # fmt: skip
        + swiglu_bytes(ffn, a)
        + projection_outputs(hidden, a)
    )
    layers = [(config.num_hidden_layers, layer)]
    return layer_activations(layers, hidden, config.vocab_size, a)
