"""Any transformers causal LM built from its config.json: parameters on the meta device,
buffers for real, as their constructors compute them (RoPE's `inv_freq`, Gemma's
`embed_scale`): non-persistent buffers are never in a checkpoint, so building them is the
only way to get them right; they are small."""

from __future__ import annotations

import torch
from torch import nn

from flatshard.dtensor import patches
from flatshard.hf.errors import HFConfigError

# config.json fields that mean the weights are not plain tensors of the model's own code
_REFUSED_FIELDS = {
    "quantization_config": "the weights are quantized; import the unquantized checkpoint",
    "auto_map": "the model's code comes with the checkpoint (trust_remote_code); flatshard "
    "builds only models that transformers itself implements",
}


def build_causal_lm(hf_config: dict, dtype: torch.dtype | None = None) -> nn.Module:
    """The transformers causal LM `hf_config` (a config.json dict) describes, parameters on
    the meta device, buffers computed on the CPU. dtype: of the parameters (default float32)."""
    transformers = transformers_or_none()
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


def transformers_or_none():
    """The transformers package, or None where it is not installed (flatshard runs without)."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers
