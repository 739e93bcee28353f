"""Pipeline parallelism over flatshard-sharded stages, run by torch's own schedules
(`torch.distributed.pipelining`).

`pipeline(model, dims, ...)` splits a decoder into stages over the `pp` mesh dim (one stage
per rank, or several interleaved), gives each stage `parallelize`'s TP/CP/FSDP on the
stage's own data- and tensor-parallel meshes, and drives them with a torch schedule. This
rank's stages live in one module under the whole model's names (`Pipeline.model`: its
optimizer's parameters, its checkpoints), so a checkpoint does not depend on `pp`.

A schedule runs every micro-batch's backward without gradient sync (FSDP2's setters, which
flatshard's modules have) and then asks each stage to reduce: torch's `PipelineStage`
reaches into FSDP2's private state there, which a flatshard module does not have.
`PipelineStage` here is torch's with that one step done flatshard's way: the held gradients
reduce-scattered once per step, whatever the number of micro-batches.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import schedules

from flatshard import compat, registry
from flatshard.api.parallel_plan import plan_for
from flatshard.api.parallelize import parallelize
from flatshard.api.pipeline_split import assign_blocks, stage_view, stages_part, ties_ends
from flatshard.api.pipeline_tie import TiedWeight
from flatshard.errors import MeshError
from flatshard.mesh import Meshes, ParallelDims
from flatshard.runtime import hooks

SCHEDULES = {
    "gpipe": schedules.ScheduleGPipe,
    "1f1b": schedules.Schedule1F1B,
    "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
    "looped-bfs": schedules.ScheduleLoopedBFS,
    "interleaved-zb": schedules.ScheduleInterleavedZeroBubble,
    "zbv": schedules.ScheduleZBVZeroBubble,
    "dualpipev": schedules.ScheduleDualPipeV,
}
"""The schedules `pipeline` runs, by name (torch's classes): gpipe and 1f1b one stage a
rank, the others two (stage i on rank i % pp; the V-shaped zbv and dualpipev: rank r runs
stages r and 2 pp - 1 - r). The zero-bubble ones (interleaved-zb, zbv, dualpipev) compute
each backward's input gradients first and its weight gradients later."""
V_SHAPED = ("zbv", "dualpipev")
V_SHAPED_CLASSES = tuple(SCHEDULES[name] for name in V_SHAPED)


class PipelineStage(pipelining.PipelineStage):
    """torch's `PipelineStage` for a stage module that flatshard shards (`fully_shard` on
    its blocks and itself); torch's schedules take it. Gradients are reduced once per step,
    after the last micro-batch's backward; the schedule then divides them by the number of
    micro-batches (its `scale_grads`)."""

    def _forward_metadata_inference(self, *args, **kwargs):
        """torch's shape inference (2.12 on): the stage's forward once more, on the first
        micro-batch (first stage) or empty tensors (the others), before the step's own; not
        a training forward for what counts them (`registry.shape_inference`)."""
        with registry.shape_inference():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):
        """The same before torch 2.12."""
        with registry.shape_inference():
            return super()._shape_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        """torch's backward shape inference (2.13 on): the last stage's loss on the outputs
        of that forward, whose inputs may have been empty tensors (any values)."""
        with registry.shape_inference():
            return super()._backward_metadata_inference(*args, **kwargs)

    # modules whose `weight` is lent to this stage for a step, not a parameter of it (the
    # last stage's head under tied embeddings: pipeline_tie.py)
    lent: tuple[nn.Module, ...] = ()

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        """torch's, with the parameters the forwards used on the modules: the zero-bubble
        schedules take each backward apart (the inputs' gradients first, the weights'
        later) and find the weights among `submod.parameters()` (a lent weight among them
        for the while)."""
        units = registry.units_below(self.submod)
        for unit in units:
            unit.register("unsharded")
        lent = [m for m in self.lent if isinstance(m.weight, torch.Tensor)
                and m.weight.requires_grad]  # fmt: skip
        for module in lent:
            module._parameters["weight"] = module.weight
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            for module in lent:
                del module._parameters["weight"]
            for unit in units:
                unit.register("sharded")

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


class Pipeline:
    """This rank's part of a pipelined model: `model` holds its stages' parameters under
    the whole model's names (build the optimizer on `model.parameters()`, save and load
    `model`), `stages` are torch `PipelineStage`s, `schedule` the torch schedule running
    them with `loss_fn`. `step(inputs, target)` runs one step's forwards and backwards,
    `evaluate(inputs, target)` its forwards only."""

    def __init__(self, model, modules, stages, schedule, meshes: Meshes, microbatches, loss_fn,
                 tied: TiedWeight | None = None):  # fmt: skip
        self.model, self.modules, self.stages = model, modules, stages
        self.schedule, self.meshes, self.microbatches = schedule, meshes, microbatches
        self.loss_fn, self.tied = loss_fn, tied
        # the last stage's outputs (the logits of every micro-batch) are not ours to return
        self._step = functools.partial(schedule.step, **compat.pipeline_step_options(schedule.step))

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage (it takes the inputs)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it takes the targets, computes the loss)."""
        return any(stage.is_last for stage in self.stages)

    def step(self, inputs=None, target=None, **stage_inputs) -> torch.Tensor:
        """Forward and backward over this data-parallel rank's batch, split into the
        micro-batches along dim 0 (every rank of the stage's pipeline calls it; `inputs`
        are used on the first stage, `target` on the last; `stage_inputs`, given on every
        rank, are split alike and passed to every stage's forward by name, e.g. the
        `position_ids` of packed documents). Gradients end on the
        parameters, reduced over the data-parallel ranks and averaged over the micro-
        batches (summed with scale_grads=False), as one process would have them. Returns
        the loss they are of (the micro-batches' losses' mean, or sum), on every rank of
        the pipeline."""
        if self.tied is not None:
            self.tied.send_weight(train=True)
        losses = self._run(self._step, inputs, target, stage_inputs)
        if self.tied is not None:
            self.tied.return_gradient(self.microbatches if self.schedule.scale_grads else 1)
            self.tied.release()
        return self._to_all(losses, summed=not self.schedule.scale_grads)

    @torch.no_grad()
    def evaluate(self, inputs=None, target=None, **stage_inputs) -> torch.Tensor:
        """Forwards only (the schedule's `eval`), over the batch as `step` takes it: the
        sum of the micro-batches' losses, on every rank of the pipeline. Not under the
        V-shaped schedules, whose actions torch's `eval` cannot run."""
        if isinstance(self.schedule, V_SHAPED_CLASSES):
            raise MeshError(
                f"{type(self.schedule).__name__} cannot run forwards only (torch's eval "
                "of a V-shaped schedule fails): evaluate with a pipeline of another schedule"
            )
        if self.tied is not None:
            self.tied.send_weight(train=False)
        losses = self._run(self.schedule.eval, inputs, target, stage_inputs)
        if self.tied is not None:
            self.tied.release()
        return self._to_all(losses, summed=True)

    def _run(self, run, inputs, target, stage_inputs: dict) -> list[torch.Tensor]:
        """The last stage's loss of each micro-batch after `run` (the schedule's step or
        eval) took the batch."""
        batch = (inputs if self.is_first else target) if self.is_first or self.is_last else None
        if batch is not None and batch.shape[0] % self.microbatches:
            raise ValueError(
                f"the batch of {batch.shape[0]} rows does not split into {self.microbatches} "
                "equal micro-batches: make the batch a multiple of them"
            )
        losses: list[torch.Tensor] = []
        args = [inputs] if self.is_first else []
        kwargs = {"target": target, "losses": losses} if self.is_last else {}
        run(*args, **kwargs, **stage_inputs)
        return losses

    def _to_all(self, losses: list[torch.Tensor], summed: bool) -> torch.Tensor:
        """The last stage's losses summed (or their mean), on every rank of the pipeline."""
        loss = torch.zeros((), device=self.stages[0].device)  # NCCL reduces device tensors
        if self.is_last:
            loss = torch.stack(losses).detach()
            loss = loss.sum() if summed else loss.mean()
        loss = loss.to(torch.float32)
        dist.all_reduce(loss, group=self.meshes.pp.get_group())  # the last stage's, to all
        return loss


def pipeline(
    model: nn.Module,
    dims: ParallelDims | Meshes,
    *,
    loss_fn,
    microbatches: int,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
    scale_grads: bool = True,
    **parallelize_options,
) -> Pipeline:
    """Split `model` into pipeline stages over `dims.pp` and return this rank's `Pipeline`.

    loss_fn: `loss_fn(output, target)` of one micro-batch (its mean: the schedule averages
        the micro-batches' gradients; with scale_grads=False their sum).
    microbatches: how many micro-batches each step's batch is cut into (at least the
        number of stages keeps every stage busy).
    schedule: a name of `SCHEDULES`.
    stages_per_rank: stages each rank runs (default 1; 2 for the interleaved schedules),
        stage i on pipeline rank i % pp.
    parallelize_options: `parallelize`'s (mp_policy, zero_stage, activation_checkpointing,
        ...), for every stage.

    The model is split as `stage_modules` splits it (its plan's `StageParts`)."""
    meshes = dims if isinstance(dims, Meshes) else dims.build()
    if meshes.pp is None:
        raise MeshError("pipeline needs pp > 1 in ParallelDims; without it use parallelize")
    if schedule not in SCHEDULES:
        raise MeshError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    kind = SCHEDULES[schedule]
    multi = issubclass(kind, schedules.PipelineScheduleMulti)
    per_rank = stages_per_rank or (2 if multi else 1)
    if not multi and per_rank != 1:
        raise MeshError(f"schedule {schedule!r} runs one stage per rank; pick an interleaved "
                        "one (interleaved-1f1b, looped-bfs) for more")  # fmt: skip
    pp, rank = meshes.pp.size(), meshes.pp_rank
    num_stages = pp * per_rank
    mine = list(range(rank, num_stages, pp))
    if schedule in V_SHAPED:
        if per_rank != 2:
            raise MeshError(f"schedule {schedule!r} runs two stages a rank (a V)")
        mine = [rank, num_stages - 1 - rank]
    # a tied embedding moves outside the schedule, on a group of its own (a collective)
    side = meshes.pp_apart if ties_ends(model) else None
    part = stages_part(model, num_stages, mine, untie=True)
    ranges = assign_blocks(len(plan_blocks(model)), num_stages)
    views = [part] if len(mine) == 1 else [
        stage_view(part, ranges[i], i == 0, i == num_stages - 1) for i in mine
    ]  # fmt: skip
    device = torch.device(meshes.world.device_type)
    stages = []
    for index, view in zip(mine, views):
        parallelize(view, meshes, **parallelize_options)
        stages.append(PipelineStage(view, index, num_stages, device, group=meshes.pp.get_group()))
    context = getattr(views[0], "context_parallel", None)
    if context is not None:  # the part splits its inputs as its stages do
        part.context_parallel = context
    runner = kind(stages if multi else stages[0], n_microbatches=microbatches, loss_fn=loss_fn,
                  scale_grads=scale_grads)  # fmt: skip
    tie = getattr(part, "tied_across_stages", None)
    last_rank = (num_stages - 1) % pp  # the pipeline rank of the last stage
    policy = parallelize_options.get("mp_policy")
    compute = policy.param_dtype if policy is not None else None
    tied = None if tie is None else TiedWeight(tie, part, side, last_rank, device, compute)
    if tied is not None and tied.head is not None:
        stages[mine.index(num_stages - 1)].lent = (tied.head,)
    return Pipeline(part, views, stages, runner, meshes, microbatches, loss_fn, tied)


def plan_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, as its plan names them."""
    return list(model.get_submodule(plan_for(model).stages.blocks))
