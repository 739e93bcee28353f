"""A training step through pipeline stages (`train.pp > 1`): this data-parallel rank's
micro-batches go through `flatshard.pipeline`'s schedule as one batch, each micro-batch's
loss the summed cross-entropy of its targets over the step's divisor, so the gradients are
those `accumulate_gradients` gives without a pipeline."""

from __future__ import annotations

import torch

from flatshard import registry
from flatshard.data.sequences import IGNORE
from flatshard.models.moe import load_balancing_loss
from flatshard.models.moe.router import RouterStats
from flatshard.models.registry import model_inputs, token_loss


class StepLoss:
    """The schedule's loss of one micro-batch: its summed cross-entropy over `divisor`
    (set per step: every labelled target of the step weighs alike); for an MoE trained with
    the load-balancing loss (`balance`), the last stage's output is `(logits, router
    totals)` and the loss adds that micro-batch's balancing term, weighed as
    `accumulate_gradients` weighs it (1 / the micro-batches)."""

    def __init__(self):
        self.divisor = 1.0
        self.balance = None  # (weight, micro-batches, data-parallel group) of the MoE term

    def __call__(self, output, targets: torch.Tensor) -> torch.Tensor:
        if not isinstance(output, tuple):
            return token_loss(output, targets, self.divisor)
        logits, totals = output
        loss = token_loss(logits, targets, self.divisor)
        if self.balance is None or not torch.is_grad_enabled():  # evaluation: tokens only
            return loss
        weight, microbatches, group = self.balance
        if registry.in_shape_inference():  # torch's, on empty tensors: their values are any
            totals = totals.nan_to_num(0.0, 0.0, 0.0)
        stats = [RouterStats.from_totals(totals)]
        return loss + weight * load_balancing_loss(stats, group) / microbatches


def pipeline_gradients(pipe, order, position: int, train, dp_rank: int, dp_world: int,
                       device) -> tuple[torch.Tensor, int | None]:  # fmt: skip
    """As `accumulate_gradients`, through the pipeline: (this rank's summed loss, how many
    targets carry loss: None when all do)."""
    accumulation = train.global_batch // (train.micro_batch * dp_world)
    step_labels = order.labels(position, train.global_batch)
    labelled = None if step_labels is None else int((step_labels != IGNORE).sum())
    firsts = [
        position + micro * train.micro_batch * dp_world + dp_rank * train.micro_batch
        for micro in range(accumulation)
    ]
    batch = torch.cat([order.batch(first, train.micro_batch) for first in firsts]).to(device)
    rows = [order.positions(first, train.micro_batch) for first in firsts]
    positions = None if rows[0] is None else torch.cat(rows).to(device)  # packed documents
    labels = None
    if labelled is not None:
        rows = [step_labels[f - position : f - position + train.micro_batch] for f in firsts]
        labels = torch.cat(rows).to(device)
    # under context parallelism this rank's part of each sequence (the stages place it)
    inputs, targets, _ = model_inputs(pipe.model, batch, labels, positions)
    packed = {} if positions is None else {"position_ids": positions}  # to every stage
    cp = 1 if pipe.meshes.cp is None else pipe.meshes.cp.size()
    if labelled is None:
        pipe.loss_fn.divisor = float(targets.numel())  # the mean over this rank's targets
    else:
        pipe.loss_fn.divisor = max(labelled, 1) / (dp_world * cp)
    loss = pipe.step(inputs, targets, **packed)
    return loss.double(), labelled
