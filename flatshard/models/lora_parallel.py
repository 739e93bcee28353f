"""LoRA adapters under tensor parallelism: each adapter split as its base Linear is.

- a column-parallel base (output features split, a `Shard(0)` weight): A whole on every TP
  rank, B's rows split alike, so B(A(x)) is this rank's output features;
- a row-parallel base (input features split, `Shard(1)`): A's columns split alike and B
  whole, so the adapter's output is a partial sum, reduced with the base's;
- a fused base (`FusedColwiseParallel`: each rank holds its share of every part, `[gate_r;
  up_r]`): A whole, each part's B split by rows (one B over every part is split by parts,
  as the base), added to the base's local output before any gather.

The global adapters are those of the unsplit model, so checkpoints and the PEFT export do
not depend on the TP size. torch's styles split every parameter under the module they are
given (the adapters' too, by the base's rule), so a plan is applied with the adapters set
aside, and they are put back split after it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from flatshard.api.parallel_plan import ParallelPlan, apply_mesh_plan
from flatshard.errors import MeshError
from flatshard.models.lora import PLAIN, adapted_modules, adapter_split_dim
from flatshard.parallel.tensor_parallel import SumGradient, split_by_parts


def lora_plan(plan: ParallelPlan) -> ParallelPlan:
    """`plan` for a model with adapters: its tensor (and sequence) parallel plan applied to
    the bases, each adapter then split as its base was."""

    def with_adapters(mesh_plan):
        if mesh_plan is None:
            return None

        def apply(model: nn.Module, tp_mesh) -> None:
            modules = adapted_modules(model)
            aside = {name: (m._modules.pop("lora_A"), m._modules.pop("lora_B"))
                     for name, m in modules.items()}  # fmt: skip
            apply_mesh_plan(mesh_plan, model, tp_mesh)
            for name, module in modules.items():
                module.lora_A, module.lora_B = aside[name]
                split_adapters(name, module, tp_mesh)

        return apply

    return dataclasses.replace(
        plan,
        tensor_parallel=with_adapters(plan.tensor_parallel),
        sequence_parallel=with_adapters(plan.sequence_parallel),
    )


def split_adapters(name: str, module: nn.Module, tp_mesh) -> None:
    """Split `module`'s adapters over `tp_mesh` as its base weight was split."""
    placement = module.weight.placements[0] if isinstance(module.weight, DTensor) else None
    parts = [part for part, _ in module.lora_parts]
    if placement is None:
        return  # a base the plan keeps whole: so are its adapters
    if type(placement) is _StridedShard:
        _split_fused(module, parts, tp_mesh)
    elif placement in (Shard(0), Shard(1)):
        for part in parts:
            for matrix in ("lora_A", "lora_B"):
                dim = adapter_split_dim(matrix, placement.dim)
                split = Replicate() if dim is None else Shard(dim)
                _place(getattr(module, matrix)[part], tp_mesh, split)
    else:
        raise MeshError(
            f"{name}: its weight is {placement} over TP, and LoRA adapters split only as a "
            "column-, row- or fused column-parallel base; leave it out of train.lora_targets"
        )


def _split_fused(module: nn.Module, parts: list[str], tp_mesh) -> None:
    """A fused base: A whole; B per part by rows, or one B over every part split by parts;
    the adapters' local output added to the base's by `FusedColwiseParallel`."""
    for part in parts:
        _place(module.lora_A[part], tp_mesh, Replicate())
        if part == PLAIN:  # B's rows stack the base's parts: declared and split as its
            declared = module.fused_components["weight"]
            module.lora_B[part].fused_components = {"weight": declared}
            sizes = [int(rows) for _, rows in declared]
            split_by_parts(module.lora_B[part], "weight", sizes, tp_mesh)
        else:
            _place(module.lora_B[part], tp_mesh, Shard(0))
    group = tp_mesh.get_group()

    def local_delta(x: torch.Tensor) -> torch.Tensor:
        """This rank's `[a_r, b_r, ...]` adapter output. Each rank's B columns give a part
        of A's gradient: summed over the TP ranks, so the A every rank holds stays one (a
        rank's own dropout mask included); x's part joins the base's sum."""
        spec = module.lora_spec
        x = F.dropout(x, spec.dropout, module.training) if spec.dropout else x
        deltas = []
        for part in parts:
            a = SumGradient.apply(module.lora_A[part].weight.to_local(), group)
            deltas.append(F.linear(F.linear(x, a), module.lora_B[part].weight.to_local()))
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
        return delta * spec.scale

    module.tp_local_extra = local_delta


def _place(linear: nn.Linear, tp_mesh, placement) -> None:
    weight = linear.weight
    split = distribute_tensor(weight.detach(), tp_mesh, [placement], src_data_rank=None)
    linear.register_parameter("weight", nn.Parameter(split, weight.requires_grad))
