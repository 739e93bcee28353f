"""State-dict adapters: how one model family appears in Hugging Face checkpoints.

The HF code (load, save, from_pretrained) talks to a model only through its adapter: the
name rules (HF tensor <-> parameter or fused component), the config.json it is built from
and exported with, and hints for a mismatched checkpoint. The base class is the generic
case and needs no per-model code: HF tensor names are the parameters' fully-qualified names
(a `transformers` model, sharded in place), and the config is the model's own `config`.
A family whose parameters are named or fused differently (flatshard's reference Llama:
llama.py) registers an adapter of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flatshard.hf.allocate import allocate_and_materialize
from flatshard.hf.errors import HFCheckpointError, HFConfigError
from flatshard.hf.names import NameRule, TensorMapping, natural_key, plan_tensors


class StateDictAdapter:
    """How a model family's parameters map to a Hugging Face checkpoint's tensors and
    config.json: the name rules, which models and configs it handles, and how it builds one."""

    rules: tuple[NameRule, ...] | None = None  # None: HF names are the parameter names

    def handles(self, model: nn.Module) -> bool:
        """Whether this adapter is the one for `model`."""
        return False

    def handles_config(self, hf_config: dict) -> bool:
        """Whether this adapter builds the model `hf_config` (a config.json) describes."""
        return False

    def with_rules(self, rules: tuple[NameRule, ...]) -> StateDictAdapter:
        """This adapter with other name rules (e.g. a model with an extra parameter)."""
        adapter = type(self).__new__(type(self))
        adapter.__dict__.update(self.__dict__, rules=tuple(rules))
        return adapter

    def plan(self, model: nn.Module) -> tuple[list[TensorMapping], list[str]]:
        """(the HF tensors of `model` in parameter order, the parameters nothing maps)."""
        return plan_tensors(model, self.rules)

    def save_order(self, mappings: list[TensorMapping]) -> list[TensorMapping]:
        """The order transformers' save_pretrained writes these tensors in: a model loaded
        with from_pretrained, without conversions, saves its state dict by natural_key."""
        return sorted(mappings, key=lambda m: natural_key(m.hf_name))

    def plan_for_checkpoint(self, model: nn.Module, names: set[str]):
        """plan(), for loading a checkpoint holding tensors `names` (an adapter that knows
        several layouts picks the checkpoint's)."""
        return self.plan(model)

    def tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's tensors a checkpoint holds, by name (tied parameters once)."""
        return dict(model.named_parameters())

    def build(self, hf_config: dict, dtype: torch.dtype | None = None) -> nn.Module:
        """The model `hf_config` describes, built on the current (e.g. meta) device."""
        archs = hf_config.get("architectures")
        raise HFConfigError(
            f"config.json architectures {archs!r}: from_pretrained builds "
            f"{', '.join(supported_architectures())}. For another transformers model, build it "
            "with transformers, fully_shard it and call flatshard.hf.load_pretrained."
        )

    def allocate(self, model: nn.Module, device: torch.device) -> None:
        """Real storage for a model built on meta and sharded, before a load fills it."""
        allocate_and_materialize(model, device)

    def export_files(self, model: nn.Module) -> dict[str, dict]:
        """JSON files to write beside config.json (name -> content)."""
        return {}

    def check_config(self, model: nn.Module, path: Path) -> None:
        """Raise if `path/config.json` describes another model than `model` (shapes alone
        do not catch e.g. a different rope_theta)."""

    def export_config(self, model: nn.Module, dtype: torch.dtype | None, extra: dict) -> dict:
        """The config.json to write with `model`'s weights."""
        config = getattr(model, "config", None)
        if not hasattr(config, "to_dict"):
            raise HFCheckpointError(
                f"{type(model).__name__} has no `config` with to_dict(); save_pretrained writes "
                "config.json from it"
            )
        hf = config.to_dict()
        if dtype is not None:
            hf["dtype"] = str(dtype).removeprefix("torch.")
        return {**hf, **extra}

    def mismatch_hints(self, model: nn.Module, unexpected: list[str]) -> list[str]:
        """Extra lines for a load's mismatch report."""
        return []


GENERIC = StateDictAdapter()
"""The adapter of a model whose Hugging Face names are its own parameter names."""
_FAMILIES: list[StateDictAdapter] = []
_FALLBACKS: list[StateDictAdapter] = []  # asked after every family, whatever the order


def register(adapter: StateDictAdapter, fallback: bool = False) -> StateDictAdapter:
    """A model family's adapter (fallback: one that handles what no family claims, e.g.
    any transformers model), whichever is imported first."""
    (_FALLBACKS if fallback else _FAMILIES).append(adapter)
    return adapter


def adapter_for(model: nn.Module) -> StateDictAdapter:
    """The registered adapter that handles `model` (`GENERIC` when none does)."""
    return next((a for a in _FAMILIES + _FALLBACKS if a.handles(model)), GENERIC)


def adapter_for_config(hf_config: dict) -> StateDictAdapter:
    """The registered adapter that handles a config.json (`GENERIC` when none does)."""
    return next((a for a in _FAMILIES + _FALLBACKS if a.handles_config(hf_config)), GENERIC)


def supported_architectures() -> list[str]:
    return [arch for adapter in _FAMILIES for arch in getattr(adapter, "architectures", ())]


def config_differences(ours, theirs, skip=(), hf_names=None) -> list[str]:
    """The fields in which two model configs (dataclasses) differ, as "field: model X,
    config.json Y" (with the config.json name where `hf_names` gives one)."""
    hf_names = hf_names or {}
    return [
        f"{field}{f' (config.json {hf_names[field]})' if field in hf_names else ''}: model "
        f"{getattr(ours, field)!r}, config.json {getattr(theirs, field)!r}"
        for field in ours.__dataclass_fields__
        if field not in skip and getattr(ours, field) != getattr(theirs, field)
    ]


def export_dtype(model: nn.Module, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype an export records: the one asked for, else the parameters' one (if one)."""
    dtypes = {p.dtype for p in model.parameters()}
    return dtype or (dtypes.pop() if len(dtypes) == 1 else None)


def with_extra_fields(hf: dict, extra: dict, ignorable: set[str]) -> dict:
    """`hf` with the user's `extra` config.json fields, which may not change the model."""
    not_ignorable = sorted(set(extra) - ignorable)
    if not_ignorable:
        raise HFCheckpointError(
            f"extra_config may only add fields that do not change the model "
            f"(flatshard.models.llama.IGNORED_FIELDS); {not_ignorable} are not among them"
        )
    return {**hf, **extra}
