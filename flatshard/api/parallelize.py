"""`parallelize`: the one composition of tensor, expert and fully sharded data parallelism.

TP first (the blocks' parameters become DTensors on the TP mesh), then CP (attention over
the whole sequence while each CP rank holds part of it), then EP (each block's
experts split over the EP mesh and sharded, in units of their own, over the other ranks),
then each block's activation memory mode (checkpointing, or offload to the host), then
`fully_shard` of every block, then of the root, all on the meshes of one `ParallelDims`;
last, on request, each block compiled (its unit hooks stay outside the graphs). The
trainer, the benchmarks and the tests build their models through it; `fully_shard` stays
FSDP2's drop-in for scripts that compose by hand.
"""

from __future__ import annotations

from torch import nn

from flatshard.api.activation_checkpointing import check_mode, checkpoint_block
from flatshard.api.compile import compile_backend, compile_block
from flatshard.api.parallel_plan import ParallelPlan, plan_for
from flatshard.api.sharding import fully_shard
from flatshard.errors import MeshError
from flatshard.mesh import Meshes, ParallelDims


def parallelize(
    model: nn.Module,
    dims: ParallelDims | Meshes,
    *,
    plan: ParallelPlan | None = None,
    mp_policy=None,
    offload_policy=None,
    reshard_after_forward: bool | int | None = None,
    zero_stage: int | None = None,
    activation_checkpointing=None,
    compile: bool | str = False,
) -> nn.Module:
    """Split `model` (on the meta device or a real one) over `dims` in place and return it.

    plan: how (default: the plan of the model's family, see `flatshard.plan`).
    mp_policy, offload_policy, reshard_after_forward, zero_stage: `fully_shard`'s, for
    every unit.
    activation_checkpointing: "full", "selective", "offload" (activations on the host;
    every block but the last) or None, per block (`flatshard.activation_checkpointing`).
    compile: True (inductor) or a `torch.compile` backend name: each block is compiled
    (`block.compile`, whole graph where the plan allows: its math only, the unit hooks
    run outside). Materialise a meta model afterwards with `flatshard.materialize`."""
    check_mode(activation_checkpointing)
    backend = compile_backend(compile)
    meshes = dims if isinstance(dims, Meshes) else dims.build()
    if meshes.pp is not None and not getattr(model, "pipeline_stage", False):
        raise MeshError(
            f"pp={meshes.pp.size()} splits the model into pipeline stages: build them with "
            "flatshard.pipeline(model, dims, loss_fn=..., microbatches=...)"
        )
    plan = plan if plan is not None else plan_for(model)
    blocks = plan.blocks_of(model)
    shard = dict(
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
        zero_stage=zero_stage,
    )
    if meshes.tp is not None:
        frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
        plan.apply_tensor_parallel(model, meshes.tp, meshes.dims.sequence_parallel)
        _keep_frozen(model, frozen)
    if meshes.cp is not None:
        plan.apply_context_parallel(model, meshes.cp)
    if meshes.ep is not None:  # experts: their own units, before their blocks'
        for experts in plan.apply_expert_parallel(model, meshes.ep):
            fully_shard(experts, mesh=meshes.expert_fsdp, **shard)
    for index, block in enumerate(blocks):
        # offload: not the last block, whose backward comes first
        keeps_its_own = activation_checkpointing == "offload" and index == len(blocks) - 1
        if activation_checkpointing is not None and not keeps_its_own:
            checkpoint_block(block, activation_checkpointing)
        fully_shard(block, mesh=meshes.fsdp, **shard)
    fully_shard(model, mesh=meshes.fsdp, **shard)
    if backend is not None:  # after fully_shard: the unit hooks stay outside the graphs
        eager = set(plan.uncompiled(model)) if plan.uncompiled else set()
        for block in blocks:
            compile_block(block, backend, eager)
    return model


def _keep_frozen(model: nn.Module, frozen: set[str]) -> None:
    """Frozen parameters stay frozen: torch's `SequenceParallel` re-registers a norm's
    weight as a new Parameter that requires gradients (LoRA's frozen norms would train)."""
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
