"""One weight shared by the embedding (first pipeline stage) and the output head (last
stage): tied embeddings under pipeline parallelism.

The first stage owns the weight: its optimizer steps it, its checkpoint holds it under both
names (as one process's does), its gradient norm counts it once. The last stage holds no
parameter for the head: each step it receives the whole weight from the first stage rank of
its pipeline (a plain tensor that requires gradients), and after the step's backwards sends
the head's gradient back, where it joins the embedding's gradient as one process's tied
weight would have it: summed over the data-parallel ranks, divided as flatshard divides the
others, and averaged over the micro-batches with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flatshard import registry
from flatshard.dtensor.sharded_param import local_data, shard_spec
from flatshard.errors import WrappingError


@dataclass(frozen=True)
class TiedAcrossStages:
    """The embedding's and the head's weight names (`model.embed_tokens.weight`,
    `lm_head.weight`), the weight's shape and dtype, and which end this rank's part holds."""

    embed: str
    head: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    first: bool
    trainable: bool  # False: frozen (LoRA), no gradient comes back

    def aliases(self) -> dict[str, str]:
        """Checkpoint names that stand for another on this rank's part (the head's for
        the embedding's, on the first stage): a checkpoint then names both, as a tied
        model in one process does."""
        return {self.head: self.embed} if self.first else {}


def untie_across_stages(model: nn.Module, embed: str, head: str, mine: list[int], last: int):
    """The tie of `model` (whole, before it is split: `embed` and `head` the modules'
    paths) for the stages `mine` of `last + 1`: None if this rank holds neither end; raises
    if it holds both apart (a V-shaped schedule's first rank)."""
    first_here, last_here = 0 in mine, last in mine
    if first_here and last_here:
        raise WrappingError(
            "the embedding and the output head share one weight, and this schedule runs the "
            "first and the last stage on one rank apart: pick a schedule that does not (not "
            "zbv or dualpipev), or untie them (tie_embeddings=False)"
        )
    if not first_here and not last_here:
        return None
    weight = model.get_submodule(embed).weight
    return TiedAcrossStages(f"{embed}.weight", f"{head}.weight", tuple(weight.shape),
                            weight.dtype, first_here, weight.requires_grad)  # fmt: skip


def drop_head_weight(head: nn.Module) -> None:
    """The last stage's head without a parameter: `TiedWeight` sets its weight each step."""
    del head.weight
    head.weight = None


class TiedWeight:
    """Moves the tied weight to the last stage and its gradient back, around each step of
    `pipeline` (`Pipeline.step`, `Pipeline.evaluate`)."""

    def __init__(self, tie: TiedAcrossStages, part: nn.Module, pp_group, last_pp_rank: int):
        self.tie, self.part = tie, part
        ranks = dist.get_process_group_ranks(pp_group)
        self.peer = ranks[last_pp_rank] if tie.first else ranks[0]
        module = tie.embed if tie.first else tie.head
        self.module = part.get_submodule(module.rpartition(".")[0])

    def send_weight(self, train: bool) -> None:
        """Before a step: the first stage sends the weight as it is now, the last receives
        it as its head's (requiring gradients when `train`)."""
        if self.tie.first:
            whole = self.module.weight.full_tensor()  # a collective of the first stage
            dist.send(whole.contiguous(), self.peer)
            return
        unit = registry.unit_of(self.part)
        device = next(self.part.parameters()).device
        received = torch.empty(self.tie.shape, dtype=self.tie.dtype, device=device)
        dist.recv(received, self.peer)
        compute = unit.mp_policy.param_dtype if unit is not None else None
        weight = received if compute is None else received.to(compute)
        self.module.weight = weight.requires_grad_(train and self.tie.trainable)

    def return_gradient(self, microbatches: int) -> None:
        """After a step's backwards: the last stage sends the head's gradient (this rank's
        micro-batches' sum), the first adds it to the embedding's as flatshard reduced that
        one (summed over the stage's data-parallel ranks and divided alike; `microbatches`:
        what the schedule divided by, 1 if it did not)."""
        if not self.tie.trainable:
            return
        if not self.tie.first:
            grad = self.module.weight.grad
            grad = torch.zeros_like(self.module.weight) if grad is None else grad
            dist.send(grad.to(self.tie.dtype).contiguous(), self.peer)
            self.module.weight.grad = None
            return
        param = self.module.weight
        unit = registry.unit_of(self.module)
        received = torch.empty(self.tie.shape, dtype=self.tie.dtype, device=param.device)
        dist.recv(received, self.peer)
        # summed where flatshard sums the embedding's own: over its shards and replicas
        for group in (unit.mesh.shard_group, unit.mesh.replicate_group):
            if group is not None:
                dist.all_reduce(received, group=group)
        received.div_(unit.grads.divide_factor * microbatches)
        piece = shard_spec(param).piece_of(received)
        if param.grad is None:
            param.grad = param.detach().clone()
            local_data(param.grad).zero_()
        local_data(param.grad).add_(piece.to(param.grad.dtype))
