"""Which Hugging Face tensor fills which rows of which flatshard parameter.

The mapping is data: a tuple of `NameRule`s, each pairing an HF tensor name pattern with a
flatshard parameter name pattern and, for a fused parameter, the component it fills. Where
a component lies is never computed here: the model declares its components
(`fused_components` on the module that owns the parameter, e.g. the MLP's `gate_up_proj` =
[gate_proj rows; up_proj rows]) and the layout turns them into offsets (`ShardSpec`).

`plan_tensors(model)` turns rules + a model (meta, plain or sharded) into the list of HF
tensors the model corresponds to, in parameter order: the order export streams them in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from torch import nn

from flatshard.dtensor.sharded_param import param_spec
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.tiles import Tile
from flatshard.layout import ParamInfo

# Parameters of LoRA adapters (flatshard.models.lora) are in no base checkpoint: the HF
# files of a model with adapters are its base's (the adapters export on their own).
ADAPTER_MARKERS = (".lora_A.", ".lora_B.")


def is_adapter_name(name: str) -> bool:
    return any(marker in name for marker in ADAPTER_MARKERS)


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


@dataclass(frozen=True)
class TensorMapping:
    """HF tensor `hf_name` is parameter `param_name`, or its fused `component`."""

    hf_name: str
    param_name: str
    component: str | None
    shape: tuple[int, ...]  # the HF tensor's shape
    # or: the block of the parameter it fills (origin: the HF tensor), as transformers'
    # conversions place it (e.g. expert 3's gate_proj in the fused gate_up_proj)
    tile: Tile | None = None
    # the storage (key, elements) transformers' save would hold it in, when it shares one
    # with other HF tensors (a fused parameter's per-expert views): they go to one file
    storage: tuple[object, int] | None = None


def plan_tensors(
    model: nn.Module, rules: tuple[NameRule, ...] | None = None
) -> tuple[list[TensorMapping], list[str]]:
    """(the HF tensors of `model` in parameter order, the parameters no rule maps).

    rules None: every HF tensor is named like the parameter (a transformers model).
    Tied parameters appear once (under their first name), as `named_parameters()` gives
    them: HF omits the tied `lm_head.weight` the same way.
    """
    mappings, unmapped = [], []
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue
        if rules is None:
            shape = param_spec(model, name, param).info.global_shape
            mappings.append(TensorMapping(name, name, None, shape))
            continue
        matches = [(rule, rule.hf_name(name)) for rule in rules]
        matches = [(rule, hf) for rule, hf in matches if hf is not None]
        if not matches:
            unmapped.append(name)
            continue
        info = param_spec(model, name, param).info
        if all(rule.component is None for rule, _ in matches):
            mappings.append(TensorMapping(matches[0][1], name, None, info.global_shape))
        else:
            mappings.extend(_component_mappings(name, info, matches))
    return mappings, unmapped


def _component_mappings(name: str, info: ParamInfo, matches) -> list[TensorMapping]:
    by_component = {rule.component: hf for rule, hf in matches}
    declared = [component.name for component in info.components]
    if set(by_component) != set(declared):
        raise HFCheckpointError(
            f"parameter {name!r} declares fused components {declared} but the name "
            f"rules give {sorted(c for c in by_component if c)}; every component needs "
            "exactly one NameRule (and the module must declare them in `fused_components`)"
        )
    return [
        TensorMapping(by_component[c.name], name, c.name, c.global_shape) for c in info.components
    ]


def natural_key(name: str) -> list[tuple]:
    """Sort key of a tensor name as transformers orders a state dict before saving it: by
    dot-separated parts, numbers numerically (layers.2 before layers.10) and before words,
    a word's trailing digits numerically too."""
    key = []
    for part in name.split("."):
        if part.isdigit():
            key.append((0, int(part)))
            continue
        word = part.rstrip("0123456789")
        digits = part[len(word) :]
        key.append((1, word, int(digits)) if digits else (1, word))
    return key
