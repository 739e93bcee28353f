"""Pipeline parallelism over flatshard-sharded stages, run by torch's own schedules
(`torch.distributed.pipelining`: GPipe, 1F1B, interleaved, zero bubble).

A schedule runs every micro-batch's backward without gradient sync (FSDP2's setters, which
flatshard's modules have) and, after the last, asks the stage to reduce: torch's
`PipelineStage` then reaches into FSDP2's private state, which a flatshard module does not
have. `PipelineStage` here is torch's with that one step done flatshard's way: the held
gradients reduce-scattered once per step, whatever the number of micro-batches.
"""

from __future__ import annotations

import copy

from torch import nn
from torch.distributed import pipelining

from flatshard import registry
from flatshard.errors import WrappingError
from flatshard.runtime import hooks

_PARTS = ("embed_tokens", "layers", "norm", "lm_head")  # the reference families' names


class PipelineStage(pipelining.PipelineStage):
    """torch's `PipelineStage` for a stage module that flatshard shards (`fully_shard` on
    its blocks and itself); any of torch's schedules takes it. Gradients are reduced once
    per step, after the last micro-batch's backward; the schedule then divides them by the
    number of micro-batches (its `scale_grads`)."""

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        unit = registry.unit_of(self.submod)
        if unit is None:
            return super().perform_reduce_grad(grad_scale_factor)
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        if unit.context is not None:  # None: no forward ran on this stage yet
            hooks.sync_held_gradients(unit.context)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


def stage_modules(model: nn.Module, num_stages: int, stage: int) -> nn.Module:
    """Stage `stage` of `num_stages` of a decoder (`embed_tokens`, `layers`, `norm`,
    `lm_head`, as flatshard's reference models have them): a copy holding its share of the
    blocks in a ModuleDict under their indices (names stay the whole model's, so checkpoints
    do not depend on the split), the embedding on the first stage, norm and head on the
    last. Blocks are split as evenly as they go, the earlier stages taking the extra ones."""
    missing = [name for name in _PARTS if not hasattr(model, name)]
    if missing:
        raise WrappingError(
            f"{type(model).__name__} has no {', '.join(missing)}: split it into stages "
            "yourself (a module per stage) and wrap each in flatshard.PipelineStage"
        )
    layers = list(model.layers.items() if isinstance(model.layers, nn.ModuleDict)
                  else enumerate(model.layers))  # fmt: skip
    if not 1 <= num_stages <= len(layers) or not 0 <= stage < num_stages:
        raise WrappingError(
            f"cannot make stage {stage} of {num_stages} from {len(layers)} blocks: the "
            "stages must number between 1 and the blocks, and the stage be one of them"
        )
    if getattr(getattr(model, "config", None), "tie_embeddings", False) and num_stages > 1:
        raise WrappingError(
            "the embedding and the output head share one weight, but pipeline stages put "
            "them on the first and the last stage: untie them (tie_embeddings=False)"
        )
    per, extra = divmod(len(layers), num_stages)
    start = stage * per + min(stage, extra)
    mine = layers[start : start + per + (stage < extra)]
    kept = {name: getattr(model, name) for name in _PARTS}
    try:  # copy the model without the blocks and parts other stages hold
        for name in _PARTS:
            setattr(model, name, None)
        part = copy.deepcopy(model)
    finally:
        for name, module in kept.items():
            setattr(model, name, module)
    part.layers = nn.ModuleDict({str(i): copy.deepcopy(block) for i, block in mine})
    if stage == 0:
        part.embed_tokens = copy.deepcopy(model.embed_tokens)
    if stage == num_stages - 1:
        part.norm, part.lm_head = copy.deepcopy(model.norm), copy.deepcopy(model.lm_head)
    return part
