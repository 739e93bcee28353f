"""Any transformers causal LM, sharded in place: the adapter that builds it from its
config.json on the meta device, shards its decoder layers, and maps its parameters to the
tensors on disk by transformers' own conversion rules (conversion.py).

Parameters are created on the meta device and buffers for real, as their constructors
compute them (RoPE's `inv_freq`, Gemma's `embed_scale`): non-persistent buffers are never
in a checkpoint, so building them is the only way to get them right; they are small.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flatshard import registry
from flatshard.api.fsdp_module import FlatShardModule
from flatshard.api.parallel_plan import ParallelPlan, register_plan
from flatshard.api.parallelize import parallelize
from flatshard.dtensor import patches
from flatshard.dtensor.sharded_param import param_spec
from flatshard.hf.adapter import StateDictAdapter, register
from flatshard.hf.allocate import allocate_unsharded
from flatshard.hf.checkpoint import read_hf_config
from flatshard.hf.conversion import disk_mappings, model_tensors
from flatshard.hf.errors import HFCheckpointError, HFConfigError
from flatshard.hf.names import TensorMapping
from flatshard.mesh import ParallelDims
from flatshard.parallel.transformers_plan import (
    apply_transformers_expert_parallel,
    apply_transformers_tensor_parallel,
    grouped_experts,
)
from flatshard.runtime import shard_placement

# config.json fields that mean the weights are not plain tensors of the model's own code
_REFUSED_FIELDS = {
    "quantization_config": "the weights are quantized; import the unquantized checkpoint",
    "auto_map": "the model's code comes with the checkpoint (trust_remote_code); flatshard "
    "builds only models that transformers itself implements",
}


class TransformersAdapter(StateDictAdapter):
    """A `transformers.PreTrainedModel`: parameter names are its own, disk names follow
    transformers' conversion mapping for its model_type."""

    def handles(self, model: nn.Module) -> bool:
        transformers = _transformers()
        return transformers is not None and isinstance(model, transformers.PreTrainedModel)

    def handles_config(self, hf_config: dict) -> bool:
        return _transformers() is not None and "model_type" in hf_config

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
        hf["architectures"] = [model_class(model).__name__]
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


def build_causal_lm(hf_config: dict, dtype: torch.dtype | None = None) -> nn.Module:
    """The transformers causal LM `hf_config` (a config.json dict) describes, parameters on
    the meta device, buffers computed on the CPU. dtype: of the parameters (default float32)."""
    transformers = _transformers()
    if transformers is None:
        raise HFConfigError("building a Hugging Face model needs transformers (pip install it)")
    for field, why in _REFUSED_FIELDS.items():
        if hf_config.get(field):
            raise HFConfigError(f"config.json field {field!r} is set: {why}")
    model_type = hf_config.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise HFConfigError(
            f"config.json field 'model_type' is {model_type!r}, which transformers "
            f"{transformers.__version__} does not know"
        )
    _check_architectures(hf_config)
    config = transformers.CONFIG_MAPPING[model_type].from_dict(hf_config)
    try:
        # buffers on the CPU even inside a meta device context (from_pretrained's)
        with torch.device("cpu"), patches.parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=dtype or torch.float32
            )
    except ValueError as e:  # the auto class has no causal LM for this config
        raise HFConfigError(
            f"config.json model_type {model_type!r} (architectures "
            f"{hf_config.get('architectures')!r}) is not a causal language model transformers "
            f"can build: {e}"
        ) from None
    return model.eval()


def _check_architectures(hf_config: dict) -> None:
    """A checkpoint of another head (a classifier, a vision-language model) has tensors a
    causal LM does not: say so by name rather than list them as a mismatch."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = hf_config.get("architectures") or []
    if not archs or set(archs) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.get("model_type"))
    raise HFConfigError(
        f"config.json field 'architectures' is {archs!r}, not a causal language model; "
        "flatshard imports causal LMs"
        + (f" (for model_type {hf_config['model_type']!r}: {causal})" if causal else "")
    )


def shard_decoder_layers(model: nn.Module, dims: ParallelDims | None = None, **options):
    """fully_shard every decoder layer (the classes its `_no_split_modules` names), then the
    root, over every rank (or `dims`): `parallelize`'s data-parallel path, what
    `from_pretrained(..., shard=...)` needs. `options`: parallelize's (mp_policy, ...)."""
    decoder_layers(model)  # its blocks, or why they cannot be told, before any mesh
    dims = dims if dims is not None else ParallelDims(dist.get_world_size())
    return parallelize(model, dims, **options)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of the classes the model's `_no_split_modules` names (its blocks)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in classes]
    if not layers:
        raise HFConfigError(
            f"{type(model).__name__}._no_split_modules is {sorted(classes)}: no module of the "
            "model is of those classes, so flatshard cannot tell its decoder layers; pass a "
            "sharding function of your own"
        )
    return layers


# a transformers model's blocks are its decoder layers, split over TP and EP by
# transformers' own plans (`parallelize` finds them)
register_plan(
    lambda model: getattr(model, "_no_split_modules", None) is not None,
    lambda model: ParallelPlan(
        blocks=decoder_layers,
        tensor_parallel=apply_transformers_tensor_parallel,
        expert_parallel=apply_transformers_expert_parallel,
        # transformers' grouped-expert kernels route by data-dependent sizes (its CPU
        # fallback's backward cannot be traced): compiled blocks run them eagerly
        uncompiled=lambda model: list(grouped_experts(model).values()),
    ),
)


def model_class(model: nn.Module) -> type:
    """The model's own class (fully_shard puts a FlatShard subclass in front of it)."""
    if isinstance(model, FlatShardModule):
        return type(model).__mro__[FlatShardModule._orig_cls_mro_index]
    return type(model)


def _transformers():
    try:
        import transformers
    except ImportError:
        return None
    return transformers


TRANSFORMERS = register(TransformersAdapter(), fallback=True)
