"""Which Hugging Face tensor fills which rows of which flatshard parameter.

The mapping is data: a tuple of `NameRule`s, each pairing an HF tensor name pattern with a
flatshard parameter name pattern and, for a fused parameter, the component it fills. The
rows of a component are never computed here from shapes: the model declares them in the
`fused_components` attribute of the module that owns the parameter (e.g. the MLP's
`gate_up_proj` = [gate_proj rows; up_proj rows]), so the model stays the one owner of its
layout. A new architecture (MoE experts, a TP variant) is a new rule tuple.

`plan_tensors(model)` turns rules + a model (meta, plain or sharded) into the list of HF
tensors the model corresponds to, in parameter order: the order export streams them in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from torch import nn

from flatshard.hf.errors import HFCheckpointError


@dataclass(frozen=True)
class NameRule:
    """HF tensor `hf` <-> flatshard parameter `ours` (or one fused `component` of it).

    Patterns may hold `{placeholders}`, each standing for one dot-free name part; both
    patterns use the same placeholders. `component` names an entry of the parameter's
    `fused_components` declaration; None means the HF tensor is the whole parameter.
    """

    hf: str
    ours: str
    component: str | None = None

    @cached_property
    def _ours_regex(self) -> re.Pattern:
        parts = re.split(r"\{(\w+)\}", self.ours)
        # even indices are literal text, odd ones placeholder names
        body = "".join(
            re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^.]+)" for i, p in enumerate(parts)
        )
        return re.compile(body)

    def hf_name(self, param_name: str) -> str | None:
        """The HF tensor name for `param_name`, or None if this rule does not apply to it."""
        match = self._ours_regex.fullmatch(param_name)
        return None if match is None else self.hf.format(**match.groupdict())


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


@dataclass(frozen=True)
class TensorMapping:
    """HF tensor `hf_name` is rows [row_start, row_end) of parameter `param_name`."""

    hf_name: str
    param_name: str
    row_start: int
    row_end: int
    shape: tuple[int, ...]  # the HF tensor's shape


def plan_tensors(
    model: nn.Module, rules: tuple[NameRule, ...] = LLAMA_RULES
) -> tuple[list[TensorMapping], list[str]]:
    """(the HF tensors of `model` in parameter order, the parameters no rule maps).

    Tied parameters appear once (under their first name), as `named_parameters()` gives
    them: HF omits the tied `lm_head.weight` the same way.
    """
    mappings, unmapped = [], []
    for name, param in model.named_parameters():
        shape = tuple(param.shape)  # a DTensor's shape is the global one
        matches = [(rule, rule.hf_name(name)) for rule in rules]
        matches = [(rule, hf) for rule, hf in matches if hf is not None]
        if not matches:
            unmapped.append(name)
        elif all(rule.component is None for rule, _ in matches):
            mappings.append(TensorMapping(matches[0][1], name, 0, shape[0], shape))
        else:
            mappings.extend(_component_mappings(model, name, shape, matches))
    return mappings, unmapped


def _component_mappings(model, name, shape, matches) -> list[TensorMapping]:
    declared = _declared_components(model, name)
    by_component = {rule.component: hf for rule, hf in matches}
    if set(by_component) != {component for component, _ in declared}:
        raise HFCheckpointError(
            f"parameter {name!r} declares fused components {[c for c, _ in declared]} but the "
            f"name rules give {sorted(c for c in by_component if c)}; every component needs "
            "exactly one NameRule"
        )
    out, start = [], 0
    for component, rows in declared:
        hf = by_component[component]
        out.append(TensorMapping(hf, name, start, start + rows, (rows, *shape[1:])))
        start += rows
    if start != shape[0]:
        raise HFCheckpointError(
            f"parameter {name!r} has {shape[0]} rows but its fused_components declare {start}"
        )
    return out


def _declared_components(model: nn.Module, name: str) -> list[tuple[str, int]]:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    declared = getattr(module, "fused_components", {}).get(attr)
    if not declared:
        raise HFCheckpointError(
            f"a NameRule maps a component of {name!r}, but {type(module).__name__} declares no "
            f"fused_components for {attr!r}"
        )
    return [(component, int(rows)) for component, rows in declared]
