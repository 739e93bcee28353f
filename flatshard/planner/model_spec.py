"""What `flatshard plan` knows of a model: its `fully_shard` units and every parameter's
shape (what the layout buckets; QLoRA's NF4 bases beside them), and how many activation
bytes a token leaves for backward. `zoo.py` and `zoo_transformers.py` build these."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from flatshard.errors import ConfigError
from flatshard.layout import ParamInfo
from flatshard.models.lora import LoRAError, LoRASpec, adapted_modules, add_lora
from flatshard.models.qlora import nf4_bytes, scale_group
from flatshard.planner.activations import FP32, Activations

__all__ = ["FP32", "ModelSpec", "UnitSpec", "adapt", "nf4_shapes", "param_infos"]

NF4_BASE = "_flatshard_nf4_base"  # the mark adapt() puts on a QLoRA base (meta) parameter


@dataclass(frozen=True)
class UnitSpec:
    """`count` identical `fully_shard` units: transformer blocks of one shape, or a part of
    the model root (`is_root`: the root or one of its first-use groups, see runtime/first_use.py;
    these stay gathered from forward to backward)."""

    name: str
    params: tuple[ParamInfo, ...]
    count: int = 1
    is_root: bool = False
    # one plain `nn.Embedding`: ZeRO-2/3 may look it up from its shards (sharded_lookup.py)
    embedding: bool = False
    # ranks it is sharded over, when not the data-parallel shard group (EP experts: efsdp)
    shard_ranks: int | None = None
    # a unit of a module inside the previous unit's (EP experts in their block): each of
    # its `count` runs within one of the previous unit's forwards
    inner: bool = False
    # QLoRA: the shapes of its NF4 bases, sharded outside its buckets (not in `params`)
    nf4: tuple[tuple[int, ...], ...] = ()

    @property
    def nf4_bytes(self) -> int:
        return sum(nf4_bytes(shape) for shape in self.nf4)

    @property
    def nf4_numel(self) -> int:
        return sum(math.prod(shape) for shape in self.nf4)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    units: tuple[UnitSpec, ...]
    n_layers: int
    # bytes saved for backward per token (layers and head, per AC mode), given the compute
    # dtype's size and whether attention keeps keys and values grouped (Setup.kv_grouped)
    activations: Callable[..., Activations]
    top_k: int = 0  # experts per token (MoE)
    # (parameter name, shape, tp) -> its shape on each TP rank; None: the reference Llama's plan
    tp_local_shape: Callable[[str, tuple[int, ...], int], tuple[int, ...]] | None = None

    @property
    def num_params(self) -> int:
        return sum((unit.numel + unit.nf4_numel) * unit.count for unit in self.units)


def adapt(model, lora: LoRASpec | None, name: str, nf4: bool = False) -> None:
    """LoRA adapters on the meta model: its base frozen, so the plan counts gradients and
    optimizer state for the adapters only; nf4: the adapted bases marked as QLoRA's."""
    if lora is None:
        if nf4:
            raise ConfigError("--qlora quantizes the bases LoRA adapts: give --lora R too")
        return
    try:
        add_lora(model, lora)
        for module in adapted_modules(model).values():
            if nf4:
                scale_group(tuple(module.weight.shape), name)  # whole blocks, or an error
                setattr(module.weight, NF4_BASE, True)
    except LoRAError as error:
        raise ConfigError(f"{name}: {error}") from None


def param_infos(named) -> tuple[ParamInfo, ...]:
    """What the layout buckets of these parameters (not QLoRA's NF4 bases)."""
    return tuple(
        ParamInfo(n, tuple(p.shape), p.dtype, p.requires_grad)
        for n, p in named
        if not getattr(p, NF4_BASE, False)
    )


def nf4_shapes(named) -> tuple[tuple[int, ...], ...]:
    """The shapes of the QLoRA bases among these parameters."""
    return tuple(tuple(p.shape) for _, p in named if getattr(p, NF4_BASE, False))
