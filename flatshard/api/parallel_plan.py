"""What `parallelize` needs to know about a model: its blocks, its tensor-parallel plan, its
experts -- a `ParallelPlan`, found by the model's family.

A model family (`flatshard/models/<family>/`) registers a function from a model to its plan
(`register_plan`); `plan_for(model)` looks the model's class up (its bases too, so a
`transformers` family can register `PreTrainedModel`). A model nobody registered gets the
data-parallel plan of its `layers` (a `ModuleList`), or passes its own plan to `parallelize`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from flatshard.errors import MeshError

# a function of (model, mesh), or parallelize_module's {module name or pattern: style}
MeshPlan = Callable[[nn.Module, DeviceMesh], None] | dict[str, ParallelStyle]


@dataclass(frozen=True)
class StageParts:
    """Where a decoder keeps what pipeline stages split (`flatshard.pipeline`), as dotted
    paths: the embedding (on the first stage), the blocks (a ModuleList, spread over the
    stages), the final norm and the head (on the last). `missing(path)`: what stands in for
    a part a stage lacks (default None: the model's forward skips it). `forward(stage, x,
    first, **kwargs)`: the stage's forward, where the model's own cannot take the previous
    stage's hidden states or must return its own (None: the model's, as flatshard's models
    do); `kwargs`: what `Pipeline.step` passes every stage (`position_ids`)."""

    embed: str = "embed_tokens"
    blocks: str = "layers"
    norm: str = "norm"
    head: str = "lm_head"
    missing: Callable[[str], nn.Module | None] = lambda path: None
    forward: Callable | None = None


@dataclass(frozen=True)
class ParallelPlan:
    """How a model is split.

    blocks: the modules `fully_shard`-ed before the root (transformer blocks, in order): a
        function of the model, or the name of a `ModuleList` attribute ("layers").
    tensor_parallel: splits the model over the TP mesh, in place: a function of (model,
        tp_mesh) or a `parallelize_module` plan (names may use `*`, e.g.
        "layers.*.attn.q_proj").
    expert_parallel: splits the experts over the EP mesh, in place, and returns the expert
        modules (each becomes a unit of its own, sharded over the other ranks):
        a function of (model, ep_mesh).
    uncompiled: the modules `parallelize(compile=...)` leaves eager (code dynamo or inductor
        cannot take, e.g. data-dependent expert routing); each block is then compiled
        region by region around them: a function of the model.
    sequence_parallel: as tensor_parallel, also splitting the norms and residual stream by
        sequence (torch's `SequenceParallel`), for `ParallelDims(sequence_parallel=True)`.
    context_parallel: makes the model's attention see the whole sequence while each rank
        of the CP mesh holds part of it (`flatshard.parallel.apply_context_parallel`): a
        function of (model, cp_mesh).
    stages: where its pipeline stages' parts are (`StageParts`; `flatshard.pipeline`)."""

    blocks: Callable[[nn.Module], list[nn.Module]] | str = "layers"
    tensor_parallel: MeshPlan | None = None
    expert_parallel: Callable[[nn.Module, DeviceMesh], list[nn.Module]] | None = None
    uncompiled: Callable[[nn.Module], list[nn.Module]] | None = None
    sequence_parallel: MeshPlan | None = None
    context_parallel: Callable[[nn.Module, DeviceMesh], None] | None = None
    stages: StageParts = StageParts()

    def blocks_of(self, model: nn.Module) -> list[nn.Module]:
        if callable(self.blocks):
            return list(self.blocks(model))
        try:
            found = model.get_submodule(self.blocks)
        except AttributeError:
            found = None
        if not isinstance(found, (nn.ModuleList, nn.Sequential)):
            raise MeshError(
                f"{type(model).__name__} has no ModuleList {self.blocks!r} of blocks: pass "
                "parallelize(..., plan=flatshard.ParallelPlan(blocks=...)) naming its blocks"
            )
        return list(found)

    def apply_tensor_parallel(
        self, model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False
    ) -> None:
        if sequence_parallel:
            if self.sequence_parallel is None:
                raise MeshError(
                    f"sequence_parallel, but {type(model).__name__}'s plan has no sequence "
                    "parallelism: pass parallelize(..., plan=flatshard.ParallelPlan("
                    "sequence_parallel=...)) or leave it out"
                )
            apply_mesh_plan(self.sequence_parallel, model, tp_mesh)
            return
        if self.tensor_parallel is None:
            raise MeshError(
                f"tp={tp_mesh.size()}, but {type(model).__name__} has no tensor-parallel "
                "plan: pass parallelize(..., plan=flatshard.ParallelPlan(tensor_parallel="
                "{'layers.*.attn.q_proj': ColwiseParallel(), ...})) or use tp=1"
            )
        apply_mesh_plan(self.tensor_parallel, model, tp_mesh)

    def apply_context_parallel(self, model: nn.Module, cp_mesh: DeviceMesh) -> None:
        if self.context_parallel is None:
            raise MeshError(
                f"cp={cp_mesh.size()}, but {type(model).__name__}'s plan has no context "
                "parallelism: pass parallelize(..., plan=flatshard.ParallelPlan("
                "context_parallel=...)) or use cp=1"
            )
        self.context_parallel(model, cp_mesh)

    def apply_expert_parallel(self, model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
        experts = self.expert_parallel(model, ep_mesh) if self.expert_parallel else []
        if not experts:
            raise MeshError(
                f"ep={ep_mesh.size()}, but {type(model).__name__} has no experts to split "
                "(expert parallelism needs a mixture-of-experts model); use ep=1"
            )
        return list(experts)


_PLANS: list[tuple[type | Callable[[nn.Module], bool], Callable[[nn.Module], ParallelPlan]]] = []


def register_plan(
    model_type: type | Callable[[nn.Module], bool], plan: Callable[[nn.Module], ParallelPlan]
) -> None:
    """Models of `model_type` (its subclasses too; or models a predicate accepts) are split
    by `plan(model)`. The latest registration wins."""
    _PLANS.insert(0, (model_type, plan))


def plan_for(model: nn.Module) -> ParallelPlan:
    """The plan registered for `model`'s class, else for a predicate accepting it, else
    the plan of its `layers`."""
    by_type = [(t, plan) for t, plan in _PLANS if isinstance(t, type)]
    by_predicate = [(t, plan) for t, plan in _PLANS if not isinstance(t, type)]
    for model_type, plan in by_type:
        if isinstance(model, model_type):
            return plan(model)
    for accepts, plan in by_predicate:
        if accepts(model):
            return plan(model)
    return ParallelPlan()


def apply_mesh_plan(plan: MeshPlan, model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A plan's TP (or SP) part on `model`: a `parallelize_module` plan, or a function."""
    if isinstance(plan, dict):
        parallelize_module(model, tp_mesh, plan)
    else:
        plan(model, tp_mesh)
