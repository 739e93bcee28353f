"""Sequence parallelism for a transformers causal LM: its own tensor-parallel plan
(transformers_plan.py) with torchtitan's sequence split around it.

Each decoder layer's two norms run on the layer's share of the sequence (`SequenceParallel`),
the attention and the MLP gather the sequence first (`PrepareModuleInput`) and their output
projections reduce-scatter it back (`RowwiseParallel` to `Shard(1)`); the embedding and the
head are split by vocabulary, the head's logits gathered for the loss. The residual stream
stays a sequence-sharded DTensor, so the model's own code sees the whole sequence's shape
(its positions, RoPE and mask as without SP). A mixture-of-experts `mlp` (one holding the
grouped experts of `base_model_ep_plan`) takes the gathered sequence as a plain tensor --
its router and experts, whole on every TP rank, see every token, so its routing counts are
the same on each -- and its output is cut back to this rank's share of the sequence; its
shared experts' TP split stays inside it. Layers of the Llama shape only (the two norms
`input_layernorm` / `post_attention_layernorm` around `self_attn` and `mlp`); another shape,
or tied embeddings, is refused by name.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from flatshard.errors import MeshError
from flatshard.parallel.tensor_parallel import moe_by_sequence, require_whole_sequence_shards
from flatshard.parallel.transformers_plan import grouped_experts, tensor_parallel_styles

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_SEQUENCE = Shard(1)
# a dense MLP: the gathered sequence as a DTensor, its down_proj reduce-scatters it back
_MLP_BY_SEQUENCE = PrepareModuleInput(
    input_layouts=(_SEQUENCE,), desired_input_layouts=(Replicate(),)
)


def apply_transformers_sequence_parallel(model: nn.Module, tp_mesh, layers) -> None:
    """Split a transformers causal LM over the 1-D `tp_mesh` by its own TP plan, with the
    sequence split between the blocks (`layers`: its decoder layers)."""
    _check(model, layers)
    moe = {name.rpartition(".")[0] for name in grouped_experts(model)}  # their `mlp`s
    styles = tensor_parallel_styles(model, tp_mesh.size())
    for name, style in styles.items():
        in_moe = any(name.startswith(f"{block}.") for block in moe)
        if type(style) is RowwiseParallel and not in_moe:  # o_proj, down_proj: to the split
            style = RowwiseParallel(output_layouts=_SEQUENCE, use_local_output=False)
        parallelize_module(model.get_submodule(name), tp_mesh, style)
    gather = {"hidden_states": Replicate()}
    names = {id(module): name for name, module in model.named_modules()}
    for layer in layers:
        is_moe = f"{names[id(layer)]}.mlp" in moe  # its residual stream: Shard(1) DTensors
        parallelize_module(layer, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": _SEQUENCE}, desired_input_kwarg_layouts=gather
            ),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": moe_by_sequence(local_output=False) if is_moe else _MLP_BY_SEQUENCE,
        })  # fmt: skip
    base = model.base_model
    require_whole_sequence_shards(base.embed_tokens, tp_mesh.size())
    parallelize_module(base, tp_mesh, {
        "embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=_SEQUENCE, use_local_output=False
        ),
        "norm": SequenceParallel(),
    })  # fmt: skip
    head = ColwiseParallel(input_layouts=_SEQUENCE, output_layouts=Replicate())
    parallelize_module(model.get_output_embeddings(), tp_mesh, head)


def _check(model: nn.Module, layers) -> None:
    name = type(model).__name__
    if getattr(model.config, "tie_word_embeddings", False):
        raise MeshError(
            f"sequence parallelism splits the embedding and the head by vocabulary in "
            f"different layouts; {name} ties them: use sequence_parallel=False"
        )
    base = model.base_model
    shapes = {type(layer).__name__ for layer in layers if not _llama_shaped(layer)}
    if shapes or not all(hasattr(base, part) for part in ("embed_tokens", "norm")):
        raise MeshError(
            f"sequence parallelism for transformers models takes Llama-shaped decoder "
            f"layers ({', '.join(_LAYER_PARTS)}) and a base model with embed_tokens and norm; "
            f"{name} ({', '.join(sorted(shapes)) or 'its base model'}) is not: use "
            "sequence_parallel=False"
        )


def _llama_shaped(layer: nn.Module) -> bool:
    children = {name for name, _ in layer.named_children()}
    return children == set(_LAYER_PARTS)
