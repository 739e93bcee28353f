"""LoRA: low-rank adapters on a model's linear projections, trained while the base is frozen.

`add_lora(model, spec)` gives every targeted `nn.Linear` (by the last part of its name:
q_proj, k_proj, ... ) a pair of small matrices A (rank x in) and B (out x rank) and makes
its forward `base(x) + (alpha / rank) * B(A(dropout(x)))`; B starts at zero, so the model
starts as the pretrained one. The Linear keeps its class's forward and its own parameter
names (`q_proj.weight` is still the base weight a Hugging Face checkpoint fills); the
adapters are named as PEFT names them inside its model (`q_proj.lora_A.default.weight`). A
fused projection (flatshard Llama's `gate_up_proj`, declared by its `fused_components`)
gets one adapter per component (`gate_up_proj.lora_A.gate_proj.weight`, ...), so each maps
to the unfused module a PEFT adapter directory names.

Call it on the model before it is sharded (on the meta device is fine): the adapters are
parameters of the same blocks, sharded with them; `init_adapters` then draws A (PEFT's
Kaiming-uniform) the same at any layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from flatshard.dtensor.sharded_param import local_data, rows_in_layout, shard_spec
from flatshard.errors import FlatShardError
from flatshard.hf.names import is_adapter_name

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
__all__ = ["LoRASpec", "add_lora", "init_adapters", "is_adapter_name", "lora_spec_of"]
PLAIN = "default"  # the adapter name PEFT gives a module's only adapter


class LoRAError(FlatShardError, ValueError):
    """A LoRA setting that cannot apply to this model."""


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRAMixin:
    """The forward of a Linear with adapters (a class made per Linear class, see _lora_class)."""

    base_class: type  # the Linear class this one adapts
    lora_spec: LoRASpec
    lora_parts: tuple[tuple[str, int], ...]  # (part, output rows) in dim-0 order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        x = F.dropout(x, self.lora_spec.dropout, self.training) if self.lora_spec.dropout else x
        deltas = [self.lora_B[part](self.lora_A[part](x)) for part, _ in self.lora_parts]
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
        return out + delta * self.lora_spec.scale

    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` (this module's full base weight) with the adapters folded in."""
        update = self.weight_update()((0,) * weight.dim(), tuple(weight.shape))
        return weight + update.to(weight.dtype)

    @torch.no_grad()
    def weight_update(self):
        """What the adapters add to this module's weight, as a function of a block of it
        ((row, column) offsets and shape, in the whole weight): scale * B @ A, a fused
        projection's parts stacked by rows. The adapters are gathered whole first: a
        collective, so every rank calls it for the same modules in the same order (weight
        sync streams the merged weights of a LoRA run this way)."""
        parts, start = [], 0
        for part, rows in self.lora_parts:
            a, b = (_whole(self.lora_A[part].weight), _whole(self.lora_B[part].weight))
            parts.append((start, b, a))
            start += rows
        scale = self.lora_spec.scale

        def block(offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
            (row, column), (rows, columns) = offsets, shape
            out = torch.zeros(shape, dtype=parts[0][1].dtype, device=parts[0][1].device)
            for first, b, a in parts:
                low, high = max(row, first), min(row + rows, first + b.shape[0])
                if low < high:
                    a_cols = a[:, column : column + columns]
                    out[low - row : high - row] = b[low - first : high - first] @ a_cols
            return out * scale

        return block


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor (a collective), or a plain one as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    """`LoRA<cls>`: cls with LoRAMixin's forward (made once per class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRAMixin, cls), {"base_class": cls})
    return _CLASSES[cls]


def _parts(name: str, module: nn.Linear, targets: tuple[str, ...]):
    """The (part, rows) of `module` that `targets` select, or None."""
    leaf = name.rsplit(".", 1)[-1]
    fused = getattr(module, "fused_components", {}).get("weight")
    if fused:  # e.g. (("gate_proj.weight", ffn), ("up_proj.weight", ffn))
        parts = tuple((component.rsplit(".", 1)[0], rows) for component, rows in fused)
        chosen = [part for part, _ in parts if part in targets]
        if not chosen:
            return None
        if len(chosen) != len(parts):  # the fused output needs every part's rows
            raise LoRAError(
                f"{name} fuses {', '.join(p for p, _ in parts)}: target all of them or none "
                f"(lora targets {', '.join(targets)})"
            )
        return parts
    return ((PLAIN, module.out_features),) if leaf in targets else None


def add_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Adapters on every targeted Linear of `model` (before it is sharded); every other
    parameter frozen. Returns the adapted modules' names."""
    if spec.rank < 1:
        raise LoRAError(f"lora rank must be >= 1, got {spec.rank}")
    if not 0.0 <= spec.dropout < 1.0:
        raise LoRAError(f"lora dropout must be in [0, 1), got {spec.dropout}")
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, LoRAMixin):
            continue
        parts = _parts(name, module, spec.targets)
        if parts is None:
            continue
        device, dtype = module.weight.device, module.weight.dtype
        module.lora_A = nn.ModuleDict({
            part: nn.Linear(module.in_features, spec.rank, bias=False, device=device, dtype=dtype)
            for part, _ in parts
        })  # fmt: skip
        module.lora_B = nn.ModuleDict({
            part: nn.Linear(spec.rank, rows, bias=False, device=device, dtype=dtype)
            for part, rows in parts
        })  # fmt: skip
        module.lora_spec, module.lora_parts = spec, parts
        module.__class__ = _lora_class(type(module))
        adapted.append(name)
    if not adapted:
        raise LoRAError(
            f"no Linear of the model is named as a lora target ({', '.join(spec.targets)}); "
            "set train.lora_targets to the names of its projections"
        )
    return adapted


def adapter_base(name: str) -> tuple[str, str] | None:
    """(its base weight's name, "lora_A" or "lora_B") of an adapter parameter's name
    (`...q_proj.lora_B.default.weight`); None for any other parameter."""
    for matrix in ("lora_A", "lora_B"):
        head, found, _ = name.partition(f".{matrix}.")
        if found:
            return f"{head}.weight", matrix
    return None


def adapter_split_dim(matrix: str, base_dim: int | None) -> int | None:
    """The dim tensor parallelism splits an adapter matrix along ("lora_A": rank x in,
    "lora_B": out x rank), given the dim its base weight splits along (None: whole): the
    base's input features split A's, its output features B's."""
    return {("lora_A", 1): 1, ("lora_B", 0): 0}.get((matrix, base_dim))


def adapted_modules(model: nn.Module) -> dict[str, LoRAMixin]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAMixin)}


def lora_spec_of(model: nn.Module) -> LoRASpec | None:
    """The spec `add_lora` gave `model` (None: no adapters)."""
    return next((m.lora_spec for m in model.modules() if isinstance(m, LoRAMixin)), None)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, whole: nn.Module | None = None) -> None:
    """A as PEFT draws it (Kaiming-uniform, a = sqrt(5)) from a generator of `seed`, B
    zero: every rank draws the full tensors and keeps its own rows, so the values are the
    same at any world size and layout. whole: the model `model` holds some modules of (a
    pipeline stage; the meta device will do), whose every adapter is drawn in turn, so a
    stage's adapters are those of the whole model."""
    generator = torch.Generator().manual_seed(seed)
    present = adapted_modules(model)
    for name, module in sorted(adapted_modules(model if whole is None else whole).items()):
        for part, _ in module.lora_parts:
            shape = module.lora_A[part].weight.shape
            bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on (rank, in)
            full = (torch.rand(shape, generator=generator) * 2 - 1) * bound
            if name in present:
                a, b = present[name].lora_A[part].weight, present[name].lora_B[part].weight
                _fill(a, full)
                _fill(b, torch.zeros(b.shape))


def _fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """This rank's rows of `full` into `param` (a flatshard DTensor or a plain tensor)."""
    if isinstance(param, DTensor):
        local_data(param).copy_(rows_in_layout(full.to(param.dtype), shard_spec(param)))
    else:
        param.copy_(full.to(param.dtype))


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight and take the adapters away: the model is
    then its base class with the fine-tuned weights (what a merged export writes). For an
    unsharded model (one process)."""
    for module in adapted_modules(model).values():
        if isinstance(module.weight, DTensor):
            raise LoRAError("merge the adapters of an unsharded model (one process)")
        module.weight.copy_(module.merged_weight(module.weight))
        del module.lora_A, module.lora_B, module.lora_spec, module.lora_parts
        module.__class__ = type(module).base_class


def peft_adapter(model: nn.Module, base_path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapters as a PEFT adapter directory holds them: (adapter_model.safetensors'
    tensors, adapter_config.json), named by the Hugging Face modules of the base model
    (a fused projection's parts by their unfused modules), for an unsharded model."""
    from flatshard.hf import adapter_for

    mappings, _ = adapter_for(model).plan(model)
    hf_module = {(m.param_name, (m.component or "").rsplit(".", 1)[0]): m.hf_name for m in mappings}
    tensors, targets, spec = {}, set(), None
    for name, module in adapted_modules(model).items():
        spec = module.lora_spec
        for part, _ in module.lora_parts:
            key = (f"{name}.weight", "" if part == PLAIN else part)
            target = hf_module[key].removesuffix(".weight")
            targets.add(target.rsplit(".", 1)[-1])
            for kind, layers in (("lora_A", module.lora_A), ("lora_B", module.lora_B)):
                weight = _whole(layers[part].weight.detach())
                tensors[f"base_model.model.{target}.{kind}.weight"] = weight.contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    return tensors, config
