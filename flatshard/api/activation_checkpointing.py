"""Activation checkpointing of a block, per a mode: what `parallelize(activation_checkpointing=)`
and the trainer's `--ac` apply to every block.

- "full": the block keeps only its inputs; backward reruns its forward.
- "selective": per op, as torchtitan's selective AC: the outputs of matrix products,
  attention and collectives are saved (costly to recompute, or a collective that must not
  run twice), every other op (norms, activations, RoPE, elementwise) is recomputed.

- "offload": nothing is recomputed; the block's saved activations wait on the host
  (pinned) between its forward and its backward, and come back one unit ahead of it
  (runtime/activation_offload.py).

The block's `forward` is wrapped in place (no wrapper module), so parameter names, state
dicts and checkpoints stay the same. flatshard's unit hooks sit outside it: backward
registers the gathered parameters before the recompute reads them, so a recompute never
gathers again.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from flatshard import registry
from flatshard.errors import WrappingError
from flatshard.runtime.activation_offload import ActivationOffload

MODES = ("full", "selective", "offload")


def _saved_ops() -> set:
    aten, names = torch.ops.aten, (
        "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    )  # fmt: skip
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    functional = torch.ops._c10d_functional  # TP's and EP's collectives: never rerun
    for name in (
        "all_reduce",
        "reduce_scatter_tensor",
        "all_gather_into_tensor",
        "all_to_all_single",
    ):
        if hasattr(functional, name):
            ops.add(getattr(functional, name).default)
    return ops


SAVED_OPS = _saved_ops()


def _save_costly_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_costly_ops)


def check_mode(mode) -> None:
    if mode is not None and mode not in MODES:
        raise WrappingError(
            f"activation_checkpointing={mode!r} is not a mode; use one of "
            f"{', '.join(map(repr, MODES))} or None"
        )


def checkpoint_block(block: nn.Module, mode: str) -> None:
    """Wrap `block.forward` so its activations are checkpointed per `mode`, in place (or,
    for "offload", mark the block for its unit's hooks)."""
    check_mode(mode)
    forward = block.forward
    if mode == "offload":  # the unit's hooks move the activations: runtime/activation_offload.py
        registry.bind_activation_offload(block, ActivationOffload())
        return
    options = {"use_reentrant": False}
    if mode == "selective":
        options["context_fn"] = _selective_contexts

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, **options, **kwargs)

    block.forward = checkpointed_forward
