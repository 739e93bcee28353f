"""Context parallelism for a transformers model: its attention modules run flatshard's
(registered with transformers as the attention implementation "flatshard_cp"), which
gathers the keys and values over the CP ranks and attends each query chunk over them
(flatshard/parallel/context_parallel.py); RoPE comes from the position ids the loss passes.
Attention that is not plain causal (sliding windows, logit soft-capping, sinks) is refused."""

from __future__ import annotations

from torch import nn

from flatshard.errors import MeshError
from flatshard.parallel.context_parallel import apply_context_parallel

NAME = "flatshard_cp"
# config fields of attention that is not plain causal over the whole sequence
_NOT_PLAIN = ("sliding_window", "attn_logit_softcapping", "attention_chunk_size")


def split_context(model: nn.Module, layers: list[nn.Module], cp_mesh) -> None:
    """Every decoder layer's attention (`layers`: the decoder layers) over the CP mesh."""
    config = model.config
    found = [f for f in _NOT_PLAIN if getattr(config, f, None)]
    if found or any(n.endswith("sinks") for n, _ in model.named_parameters()):
        what = ", ".join(found) or "attention sinks"
        raise MeshError(
            f"context parallelism attends causally over the whole sequence; "
            f"{type(model).__name__}'s attention is not plain causal ({what}): use cp=1"
        )
    _register()
    attention = [layer.self_attn for layer in layers]
    apply_context_parallel(model, attention, cp_mesh)
    model.set_attn_implementation(NAME)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function interface: [B, H, T, D] in, [B, T, H, D] out."""
    out = module.context_parallel.attention(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # the attention places each chunk itself


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _no_mask)
