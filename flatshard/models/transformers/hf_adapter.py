"""The adapter of any transformers causal LM: builds it (build.py) and maps its parameters
to the tensors on disk by transformers' own conversion rules (flatshard/hf/conversion.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flatshard import registry
from flatshard.api.fsdp_module import own_class
from flatshard.dtensor.sharded_param import param_spec
from flatshard.hf.adapter import StateDictAdapter, register
from flatshard.hf.allocate import allocate_unsharded
from flatshard.hf.checkpoint import read_hf_config
from flatshard.hf.conversion import disk_mappings, model_tensors
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.names import TensorMapping
from flatshard.models.transformers.build import build_causal_lm, transformers_or_none
from flatshard.runtime import shard_placement


class TransformersAdapter(StateDictAdapter):
    """A `transformers.PreTrainedModel`: parameter names are its own, disk names follow
    transformers' conversion mapping for its model_type."""

    def handles(self, model: nn.Module) -> bool:
        transformers = transformers_or_none()
        return transformers is not None and isinstance(model, transformers.PreTrainedModel)

    def handles_config(self, hf_config: dict) -> bool:
        return transformers_or_none() is not None and "model_type" in hf_config

    def plan(self, model: nn.Module):
        return disk_mappings(model)

    def plan_for_checkpoint(self, model: nn.Module, names: set[str]):
        """transformers' on-disk layout, or the in-memory one (a checkpoint written with
        save_pretrained(save_original_format=False): fused experts as they are in memory),
        whichever the checkpoint holds; transformers loads both."""
        mappings, unmapped = self.plan(model)
        if {m.hf_name for m in mappings} == names:
            return mappings, unmapped
        direct = [
            TensorMapping(name, name, None, tuple(param_spec(model, name, t).info.global_shape))
            for name, t in model_tensors(model).items()
        ]
        if {m.hf_name for m in direct} == names:
            return direct, []
        return mappings, unmapped  # the mismatch report speaks of the on-disk layout

    def save_order(self, mappings: list[TensorMapping]) -> list[TensorMapping]:
        return mappings  # already transformers' order: that of revert_weight_conversion

    def tensors(self, model: nn.Module) -> dict:
        return model_tensors(model)

    def build(self, hf_config: dict, dtype: torch.dtype | None = None) -> nn.Module:
        return build_causal_lm(hf_config, dtype)

    def allocate(self, model: nn.Module, device: torch.device) -> None:
        """Real storage for what is still on meta (the load fills every parameter): the
        units' shards (as to_empty), unsharded parameters (ties kept); buffers move."""
        for unit in registry.units_below(model):
            shard_placement.allocate(unit, unit.mesh.device)
        allocate_unsharded(model, device)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)

    def check_config(self, model: nn.Module, path: Path) -> None:
        if not (path / "config.json").is_file():
            return
        theirs = read_hf_config(path).get("model_type")
        ours = getattr(getattr(model, "config", None), "model_type", None)
        if theirs != ours:
            raise HFCheckpointError(
                f"{path / 'config.json'} field 'model_type' is {theirs!r} but the model is "
                f"{ours!r}; build the model from that config (flatshard.hf.from_pretrained)"
            )

    def export_config(self, model: nn.Module, dtype: torch.dtype | None, extra: dict) -> dict:
        hf = model.config.to_diff_dict()  # what transformers writes: fields off the defaults
        hf["architectures"] = [own_class(model).__name__]
        dtypes = {p.dtype for p in model.parameters()}
        dtype = dtype or (dtypes.pop() if len(dtypes) == 1 else None)
        if dtype is not None:
            hf["dtype"] = str(dtype).removeprefix("torch.")
        return {**hf, **extra}

    def export_files(self, model: nn.Module) -> dict[str, dict]:
        """Other JSON files transformers' save_pretrained writes beside config.json."""
        generation = getattr(model, "generation_config", None)
        if generation is None or not model.can_generate():
            return {}
        return {"generation_config.json": generation.to_diff_dict()}

    def mismatch_hints(self, model: nn.Module, unexpected: list[str]) -> list[str]:
        if "lm_head.weight" in unexpected and model.config.tie_word_embeddings:
            return [
                "  (the config ties lm_head to embed_tokens but the checkpoint stores "
                "lm_head.weight: set tie_word_embeddings to false in config.json)"
            ]
        return []


TRANSFORMERS = register(TransformersAdapter(), fallback=True)
"""The adapter of any `transformers` causal LM: `hf.from_pretrained(path, adapter=TRANSFORMERS)`
builds the transformers model itself (asked after every flatshard family)."""
