"""One weight shared by the embedding (first pipeline stage) and the output head (last
stage): tied embeddings under pipeline parallelism.

The first stage owns the weight: its optimizer steps it, its checkpoint holds it under both
names (as one process's does), its gradient norm counts it once. The last stage holds no
parameter for the head: each step it receives the whole weight from the first stage rank of
its pipeline (a plain tensor that requires gradients), and after the step's backwards sends
the head's gradient back, where it joins the embedding's gradient as one process's tied
weight would have it: summed over the data-parallel ranks, divided as flatshard divides the
others, and averaged over the micro-batches with them. A rank running both ends (the
V-shaped schedules' first rank) hands the weight and the gradient over in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flatshard import comm, registry
from flatshard.dtensor.sharded_param import local_data, shard_spec
from flatshard.errors import MeshError


@dataclass(frozen=True)
class TiedAcrossStages:
    """The embedding's and the head's weight names (`model.embed_tokens.weight`,
    `lm_head.weight`), the weight's shape and dtype, and which ends this rank's part holds."""

    embed: str
    head: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    first: bool
    last: bool
    trainable: bool  # False: frozen (LoRA), no gradient comes back

    def aliases(self) -> dict[str, str]:
        """Checkpoint names that stand for another on this rank's part (the head's for
        the embedding's, on the first stage): a checkpoint then names both, as a tied
        model in one process does."""
        return {self.head: self.embed} if self.first else {}


def untie_across_stages(model: nn.Module, embed: str, head: str, mine: list[int], last: int):
    """The tie of `model` (whole, before it is split: `embed` and `head` the modules'
    paths) for the stages `mine` of `last + 1`; None if this rank holds neither end."""
    first_here, last_here = 0 in mine, last in mine
    if not first_here and not last_here:
        return None
    weight = model.get_submodule(embed).weight
    return TiedAcrossStages(f"{embed}.weight", f"{head}.weight", tuple(weight.shape),
                            weight.dtype, first_here, last_here, weight.requires_grad)  # fmt: skip


def drop_head_weight(head: nn.Module) -> None:
    """The last stage's head without a parameter: `TiedWeight` sets its weight each step."""
    del head.weight
    head.weight = None


class TiedWeight:
    """Moves the tied weight to the last stage and its gradient back, around each step of
    `pipeline` (`Pipeline.step`, `Pipeline.evaluate`). `compute_dtype`: the dtype the
    stages compute in (mixed precision's param_dtype; None: the weight's own)."""

    def __init__(self, tie: TiedAcrossStages, part: nn.Module, pp_group, last_pp_rank: int,
                 device: torch.device, compute_dtype: torch.dtype | None = None):  # fmt: skip
        """`pp_group`: this rank's pipeline, a group torch's schedule does not use;
        `device`: the stages' (their parameters may still be on the meta device)."""
        self.tie, self.compute_dtype, self.group = tie, compute_dtype, pp_group
        ranks = dist.get_process_group_ranks(pp_group)
        # the rank holding the other end (None: this one holds both)
        self.peer = None if tie.first and tie.last else ranks[last_pp_rank if tie.first else 0]
        owner = lambda name: part.get_submodule(name.rpartition(".")[0])  # noqa: E731
        self.embed = owner(tie.embed) if tie.first else None
        self.head = owner(tie.head) if tie.last else None
        self.device = device
        self.grad_sum: torch.Tensor | None = None  # the head's micro-batches, in tie.dtype

    def send_weight(self, train: bool) -> None:
        """Before a step: the first stage sends the weight as it is now, the last receives
        it as its head's (requiring gradients when `train`)."""
        whole = None
        if self.tie.first:
            with torch.no_grad():
                whole = self.embed.weight.full_tensor()  # a collective of the first stage
            unit, _ = registry.managed_of(self.embed.weight)
            if train and _ranks(unit.mesh.shard_group) > 1:  # (a step's: the plan's)
                comm.traffic.tied_embedding += whole.numel() * whole.element_size()
            if tuple(whole.shape) != self.tie.shape or whole.dtype != self.tie.dtype:
                raise MeshError(
                    f"{self.tie.embed} is {tuple(whole.shape)} {whole.dtype} now, but the last "
                    f"stage receives it as {self.tie.shape} {self.tie.dtype}, as it was when "
                    "the model was split: convert the model before flatshard.pipeline"
                )
        whole = self._hand_over(whole, to_last=True)
        if whole is None:
            return
        weight = whole if self.compute_dtype is None else whole.to(self.compute_dtype)
        self.head.weight = weight.requires_grad_(train and self.tie.trainable)
        self.grad_sum = None
        if self.head.weight.requires_grad:  # each micro-batch's gradient summed in tie.dtype
            self.head.weight.register_post_accumulate_grad_hook(self._sum_gradient)

    def _sum_gradient(self, weight: torch.Tensor) -> None:
        grad, weight.grad = weight.grad, None
        if self.grad_sum is None:
            self.grad_sum = grad.to(self.tie.dtype)
        else:
            self.grad_sum.add_(grad)

    def release(self) -> None:
        """After a step or an evaluation: the last stage lets the weight go (the next one
        brings it again)."""
        if self.head is not None:
            self.head.weight, self.grad_sum = None, None

    def return_gradient(self, microbatches: int) -> None:
        """After a step's backwards: the last stage sends the head's gradient (this rank's
        micro-batches' sum), the first adds it to the embedding's as flatshard reduced that
        one (summed over the stage's data-parallel ranks and divided alike; `microbatches`:
        what the schedule divided by, 1 if it did not)."""
        if not self.tie.trainable:
            return
        grad = None
        if self.tie.last:  # (a zero-bubble weight pass sets .grad without the hook)
            weight = self.head.weight
            if weight.grad is not None:
                self._sum_gradient(weight)
            grad = self.grad_sum
            if grad is None:  # no micro-batch reached the head
                grad = torch.zeros(self.tie.shape, dtype=self.tie.dtype, device=self.device)
        grad = self._hand_over(grad, to_last=False)
        if grad is None:
            return
        param = self.embed.weight
        unit, _ = registry.managed_of(param)
        # summed where flatshard sums the embedding's own: over its shards and replicas
        for group in (unit.mesh.shard_group, unit.mesh.replicate_group):
            if _ranks(group) > 1:
                comm.traffic.tied_embedding += grad.numel() * grad.element_size()
                dist.all_reduce(grad, group=group)
        grad.div_(unit.grads.divide_factor * microbatches)
        piece = shard_spec(param).piece_of(grad)
        if param.grad is None:
            param.grad = param.detach().clone()
            local_data(param.grad).zero_()
        local = local_data(param.grad)
        if local.device != piece.device:  # the shard's rows offloaded to the host
            piece = comm.to_host_now(piece)
        local.add_(piece.to(local.dtype))

    def _hand_over(self, held: torch.Tensor | None, to_last: bool) -> torch.Tensor | None:
        """`held` (this end's tensor) at the other end: the first stage's to the last
        (`to_last`) or back. The sending rank returns None, the receiving one what came;
        a rank holding both ends keeps it."""
        sending = self.tie.first if to_last else self.tie.last
        if sending and self.peer is not None:
            dist.send(held.contiguous(), self.peer, group=self.group)
            return None
        if held is None and (self.tie.last if to_last else self.tie.first):
            held = torch.empty(self.tie.shape, dtype=self.tie.dtype, device=self.device)
            dist.recv(held, self.peer, group=self.group)
        return held


def _ranks(group) -> int:
    return 0 if group is None else dist.get_world_size(group)
