"""The adapter of flatshard's reference MoE (Qwen3-MoE and Mixtral checkpoints): its
parameter names, its config.json conversion (hf_config.py), and the per-expert tensors
transformers 5 writes on disk for its fused experts.

Two steps map a parameter to the disk. Name rules give the transformers in-memory tensor
it is: the same names as the reference Llama's plus the router `mlp.gate.weight` and the
fused experts `mlp.experts.{gate_up_proj, down_proj}`, which have the very layout of
transformers' in memory (`(E, 2I, H)` with gate and up as contiguous halves, `(E, H, I)`).
Then transformers' own conversion rules for the model_type (conversion.py, run on the
transformers model built on the meta device from the exported config.json) say which
disk tensor is which block of it: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`
for Qwen3-MoE, `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` and the router under
`block_sparse_moe.gate` for Mixtral. A rank then reads only the blocks inside its piece
of each parameter (load.py: `Tile.clip` against the ShardSpec's global box, whose offset
includes the expert-parallel offset of its experts).

`from_pretrained` builds transformers' own model for these checkpoints unless given
`adapter=flatshard.models.moe.MOE` (the reference MoE: expert parallelism, grouped matmuls).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import replace
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
from flatshard.hf.names import NameRule, TensorMapping, plan_tensors
from flatshard.models.llama.hf_adapter import LLAMA_RULES
from flatshard.models.llama.hf_config import IGNORED_FIELDS
from flatshard.models.moe.config import MoEConfig
from flatshard.models.moe.hf_config import HF_NAMES, hf_to_moe_config, moe_config_to_hf
from flatshard.models.moe.model import MoE

# names of transformers' in-memory Qwen3-MoE / Mixtral model (Mixtral's disk renaming of
# `mlp.` to `block_sparse_moe.` is transformers' conversion, applied after these)
MOE_RULES: tuple[NameRule, ...] = (
    *LLAMA_RULES,  # attention, norms, embeddings, head, and the dense layers' MLPs
    NameRule("model.layers.{n}.mlp.gate.weight", "layers.{n}.mlp.gate.weight"),
    NameRule("model.layers.{n}.mlp.experts.{tensor}", "layers.{n}.mlp.experts.{tensor}"),
)
"""Hugging Face tensor names of Qwen3-MoE and Mixtral (in memory) against the reference MoE's."""
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
# fields a model may set differently from the checkpoint: they do not change the weights
_UNCHECKED = {"max_seq_len", "expert_compute", "aux_loss_coef"}


class MoEAdapter(StateDictAdapter):
    rules = MOE_RULES

    def handles(self, model: nn.Module) -> bool:
        return isinstance(getattr(model, "config", None), MoEConfig)

    # handles_config stays False: from_pretrained keeps transformers' model as the default
    # for these checkpoints; adapter=MOE asks for the reference MoE

    def build(self, hf_config: dict, dtype: torch.dtype | None = None) -> nn.Module:
        model = MoE(hf_to_moe_config(hf_config))
        return model if dtype is None else model.to(dtype)

    def plan(self, model: nn.Module) -> tuple[list[TensorMapping], list[str]]:
        """The disk tensors (transformers' layout) in the order transformers saves them."""
        in_memory, unmapped = plan_tensors(model, self.rules)
        return _on_disk(model.config, in_memory), unmapped

    def plan_for_checkpoint(self, model: nn.Module, names: set[str]):
        """transformers' disk layout, or its in-memory one (a checkpoint written with
        save_pretrained(save_original_format=False): fused experts), whichever it holds."""
        mappings, unmapped = self.plan(model)
        if {m.hf_name for m in mappings} != names:
            direct, direct_unmapped = plan_tensors(model, self.rules)
            if {m.hf_name for m in direct} == names:
                return direct, direct_unmapped
        return mappings, unmapped  # the mismatch report speaks of the disk layout

    def save_order(self, mappings: list[TensorMapping]) -> list[TensorMapping]:
        return mappings  # plan's order is transformers' save order already

    def check_config(self, model: nn.Module, path: Path) -> None:
        if not (path / "config.json").is_file():
            return
        ours, theirs = model.config, hf_to_moe_config(read_hf_config(path))
        unchecked = set(_UNCHECKED)
        if not ours.first_k_dense and not theirs.first_k_dense:
            unchecked.add("ffn_dim")  # sizes only dense layers, and there are none
        names = {field: HF_NAMES.get(field, field) for field in ours.__dataclass_fields__}
        differ = config_differences(ours, theirs, skip=unchecked, hf_names=names)
        if differ:
            raise HFCheckpointError(
                f"the model's config differs from {path / 'config.json'}: {'; '.join(differ)}. "
                "Build the model with flatshard.models.moe.hf_to_moe_config(read_hf_config(path)) "
                "(or flatshard.hf.from_pretrained(path, adapter=flatshard.models.moe.MOE))"
            )

    def export_config(self, model: nn.Module, dtype: torch.dtype | None, extra: dict) -> dict:
        hf = moe_config_to_hf(model.config, export_dtype(model, dtype))
        return with_extra_fields(hf, extra, IGNORED_FIELDS)

    def mismatch_hints(self, model: nn.Module, unexpected: list[str]) -> list[str]:
        experts = [int(m.group(1)) for name in unexpected if (m := _EXPERT_INDEX.search(name))]
        if not experts:
            return []
        return [
            f"  (the checkpoint holds experts up to index {max(experts)} per layer; the model "
            f"has n_experts={model.config.n_experts}: build it from the checkpoint's config.json)"
        ]


def _on_disk(config: MoEConfig, in_memory: list[TensorMapping]) -> list[TensorMapping]:
    """`in_memory` (mappings to transformers' in-memory names) as the disk tensors
    transformers' conversion writes: renamed, and fused experts cut into per-expert tiles."""
    by_name = {m.hf_name: m for m in in_memory}
    hf_config = json.dumps(moe_config_to_hf(config), sort_keys=True)
    disk_tensors, shapes = _transformers_layout(hf_config)
    differ = [
        f"{name}: transformers {list(shapes.get(name, ()))}, flatshard {list(m.shape)} "
        f"({m.component + ' of ' if m.component else ''}{m.param_name})"
        for name, m in by_name.items()
        if shapes.get(name) != tuple(m.shape)
    ] + [f"{name}: no parameter of the reference MoE" for name in shapes if name not in by_name]
    if differ:  # a name rule or the config export is wrong: not the user's checkpoint
        raise HFCheckpointError(
            "the reference MoE does not match transformers' model for its own config: "
            + "; ".join(differ[:5])
        )
    out = []
    for disk in disk_tensors:
        ours = by_name[disk.param_name]
        if _is_whole(disk, shapes[disk.param_name]):
            out.append(replace(ours, hf_name=disk.hf_name))
        elif ours.component is None:  # a block of a whole parameter: same coordinates
            out.append(replace(disk, param_name=ours.param_name))
        else:
            raise HFCheckpointError(
                f"transformers stores {disk.param_name!r} in blocks on disk, and flatshard's "
                f"{ours.param_name!r} holds it as component {ours.component!r}; flatshard "
                "cannot compose the two"
            )
    return out


@functools.lru_cache(maxsize=8)
def _transformers_layout(hf_config_json: str):
    """(transformers' disk tensors for a config, each mapped to an in-memory tensor; the
    in-memory tensors' shapes), from its model built on the meta device. Cached: load and
    save each ask."""
    from flatshard.hf.conversion import disk_mappings, model_tensors
    from flatshard.models.transformers.build import build_causal_lm

    with torch.device("meta"):
        hf_model = build_causal_lm(json.loads(hf_config_json))
    mappings, unmapped = disk_mappings(hf_model)
    if unmapped:
        raise HFCheckpointError(f"transformers' conversion writes no tensor for {unmapped[:5]}")
    shapes = {name: tuple(t.shape) for name, t in model_tensors(hf_model).items()}
    return tuple(mappings), shapes


def _is_whole(disk: TensorMapping, shape: tuple[int, ...]) -> bool:
    """Whether the disk tensor is its in-memory tensor (of `shape`) unchanged, or renamed."""
    tile, n = disk.tile, len(shape)
    zeros = (0,) * n
    return (
        tuple(disk.shape) == shape
        and tile.offset == zeros
        and tile.dims == tuple(range(n))
        and tile.box.offset == zeros
    )


MOE = register(MoEAdapter())
"""The adapter that builds flatshard's reference `MoE` from a Qwen3-MoE or Mixtral
checkpoint (`hf.from_pretrained(path, adapter=MOE)`), so it takes expert parallelism."""
