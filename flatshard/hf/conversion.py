"""The on-disk tensors of a transformers model, by transformers' own conversion rules.

transformers 5 keeps the mapping between a model's parameters and the tensors its
`save_pretrained` writes in `conversion_mapping.get_model_conversion_mapping(model)` (per
`model_type`: renamings, and converters such as per-expert MoE weights <-> one fused
tensor), and applies it on save with `core_model_loading.revert_weight_conversion`. Here
that same function runs on stand-ins (`tiles.Tiled`), so the result says, for every disk
tensor, which block of which parameter it is; loading reads those blocks back. Models
without a conversion (Llama, Mistral, Phi-3's fused qkv/gate_up, ...) map one to one.
"""

from __future__ import annotations

import contextlib
import math

from torch import nn

from flatshard.dtensor.sharded_param import param_spec
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.names import TensorMapping, is_adapter_name, natural_key
from flatshard.hf.tiles import Tiled


def model_tensors(model: nn.Module) -> dict[str, object]:
    """What a checkpoint of `model` stores: parameters (tied ones once, under their first
    name, as transformers omits the tied copy) and persistent buffers."""
    tensors = {n: p for n, p in model.named_parameters() if not is_adapter_name(n)}
    non_persistent = {
        f"{prefix}{'.' if prefix else ''}{name}"
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }
    for name, buffer in model.named_buffers():
        if name not in non_persistent:
            tensors.setdefault(name, buffer)
    return tensors


def disk_mappings(model: nn.Module) -> tuple[list[TensorMapping], list[str]]:
    """(the disk tensors of `model` in the order transformers saves them, each with the
    block of its parameter it fills; the tensors nothing on disk fills)."""
    from transformers.core_model_loading import revert_weight_conversion

    tensors = model_tensors(model)
    shapes = {name: _global_shape(model, name, t) for name, t in tensors.items()}
    # by natural_key, as transformers' save sorts a state dict (which it leaves unsorted
    # when the model has no conversion but was not loaded by from_pretrained)
    ordered = sorted(shapes, key=natural_key)
    stand_ins = {name: Tiled.leaf(name, shapes[name]) for name in ordered}
    try:
        with _own_classes(model):
            disk = revert_weight_conversion(model, stand_ins)
    except (AttributeError, TypeError, NotImplementedError) as e:  # an op Tiled lacks
        raise HFCheckpointError(
            f"transformers' checkpoint conversion for {type(model).__name__} (model_type "
            f"{model.config.model_type!r}) does more than rearrange blocks of parameters "
            f"({e}); flatshard cannot map its tensors row by row"
        ) from None
    mappings, covered = [], dict.fromkeys(tensors, 0)
    for hf_name, tiled in disk.items():
        if not isinstance(tiled, Tiled):
            raise HFCheckpointError(
                f"transformers' conversion for {type(model).__name__} produced {hf_name!r} "
                "from data rather than by rearranging parameters; flatshard cannot map it"
            )
        storage = (tiled.storage.key, tiled.storage.numel)
        for tile in tiled.tiles:
            covered[tile.origin] += tile.numel
            back = tile.inverse(hf_name)  # disk tensor -> its block of the parameter
            shape = tuple(tiled.shape)
            mappings.append(TensorMapping(hf_name, tile.origin, None, shape, back, storage))
    for name, numel in covered.items():
        if numel not in (0, math.prod(shapes[name])):
            raise HFCheckpointError(
                f"transformers' conversion for {type(model).__name__} writes {numel} of the "
                f"{math.prod(shapes[name])} elements of {name!r}; flatshard cannot map it"
            )
    return mappings, [name for name, numel in covered.items() if numel == 0]


@contextlib.contextmanager
def _own_classes(model: nn.Module):
    """Every fully_shard-ed module back in its own class while transformers looks its
    conversion up: it goes by class name (GPT-NeoX's `embed_out` -> `lm_head` renaming is
    registered for `GPTNeoXForCausalLM`, not for fully_shard's `FlatShardGPTNeoX...`)."""
    from flatshard.api.fsdp_module import FlatShardModule, own_class

    wrapped = [(m, type(m)) for m in model.modules() if isinstance(m, FlatShardModule)]
    for module, _ in wrapped:
        module.__class__ = own_class(module)
    try:
        yield
    finally:
        for module, cls in wrapped:
            module.__class__ = cls


def _global_shape(model: nn.Module, name: str, tensor) -> tuple[int, ...]:
    return tuple(param_spec(model, name, tensor).info.global_shape)
