"""Tensor-parallel styles beyond torch's, for any model's plan.

The fused `[gate; up]` weight is the trap the peers fell in: `ColwiseParallel` gives rank r
a contiguous block of the fused rows (at TP 2, all of gate on rank 0), so `silu(gate) * up`
pairs the wrong rows. `FusedColwiseParallel` gives each rank its share of every component,
`[gate_r; up_r]`, placed `_StridedShard(0, split_factor=2)`: the global tensor is still
`[gate; up]`, whatever the TP size, so checkpoints do not depend on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInputOutput
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils.stateless import _reparametrize_module

from flatshard.dtensor import patches, strided_parts


class FusedColwiseParallel(ParallelStyle):
    """Column parallelism for a Linear whose output rows stack parts (SwiGLU's `[gate;
    up]`, Phi-3's `[q; k; v]`): each rank holds its share of every part, `[gate_r; up_r]`.
    The parts are those the module declares (`fused_components`), else `components`
    equal ones.

    DTensor's matmul does not keep a `_StridedShard` weight in place (it redistributes it
    to plain row blocks, which pairs the wrong rows), so this Linear computes with its
    local weight: its input is the replicated activation (its gradient summed over the TP
    ranks in backward, as a column-parallel layer's must be) and its output the local
    `[gate_r, up_r]` features the row-parallel layer after it consumes -- or, with
    `gather_output`, every rank's, put back in the global order `[gate, up]` (for a model
    that splits the output itself). A module's `tp_local_extra(x)`, if it has one, adds
    to the local output before any gather; x's gradient, its part of it included, is
    summed over the TP ranks (LoRA adapters: flatshard/models/lora_parallel.py)."""

    def __init__(self, components: int = 2, gather_output: bool = False):
        super().__init__()
        self.components = components
        self.gather_output = gather_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError("FusedColwiseParallel splits nn.Linear modules only")
        size = device_mesh.size()
        sizes = self._part_sizes(module)
        for name in list(dict(module.named_parameters())):
            split_by_parts(module, name, sizes, device_mesh)
        group = device_mesh.get_group()
        local_sizes = [n // size for n in sizes]

        def local_forward(x):
            bias = module.bias.to_local() if module.bias is not None else None
            x = SumGradient.apply(x, group)
            out = F.linear(x, module.weight.to_local(), bias)
            extra = getattr(module, "tp_local_extra", None)  # e.g. LoRA adapters' output
            if extra is not None:  # of x, whose gradient is summed over the TP ranks
                out = out + extra(x)
            if self.gather_output:
                out = _GatherParts.apply(out, group, local_sizes)
            return out

        module.forward = local_forward
        return module

    def _part_sizes(self, module: nn.Module) -> list[int]:
        declared = (getattr(module, "fused_components", None) or {}).get("weight")
        if declared:
            return [int(rows) for _, rows in declared]
        return [module.out_features // self.components] * self.components


def split_by_parts(module: nn.Module, name: str, sizes: list[int], device_mesh) -> None:
    """Replace `module`'s parameter `name`, whose dim-0 rows stack parts of `sizes`, by this
    TP rank's share of every part, `[a_r; b_r; ...]` (a `_StridedShard(0)` DTensor of the
    same global tensor; the module must declare the parts in `fused_components`)."""
    patches.install()  # its full_tensor() goes by strided_parts.py (torch 2.11 raises)
    rank, size = device_mesh.get_local_rank(), device_mesh.size()
    param = module.get_parameter(name)
    placement = _StridedShard(0, split_factor=len(sizes))
    strided_parts.register(device_mesh, placement, param.shape, sizes)
    held = strided_parts.held_indices(placement, param.shape[0], size, tuple(sizes))[rank]
    local = param.detach().index_select(0, held.to(param.device))
    sharded = DTensor.from_local(
        local, device_mesh, [placement], run_check=False, shape=param.shape, stride=param.stride()
    )
    module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))


def moe_by_sequence(local_output: bool) -> ParallelStyle:
    """An MoE block under sequence parallelism: it takes the gathered sequence as a plain
    tensor (its router and experts, whole on every TP rank, see every token, so its routing
    is the same on each) and hands on this rank's share of its (replicated) output: a plain
    tensor (`local_output`, for a residual stream of plain tensors) or a `Shard(1)`
    DTensor."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
        use_local_output=local_output,
    )  # fmt: skip


class HeadNormParallel(ParallelStyle):
    """A norm applied to each TP rank's own heads (Qwen3's q/k norms): its weight is the
    same on every TP rank (a `Replicate` DTensor), but each rank's gradient covers only its
    heads, so the gradient is summed over the TP ranks in backward."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(
                param.detach(), device_mesh, [Replicate()], run_check=False
            )
            module.register_parameter(name, nn.Parameter(replicated, param.requires_grad))
        group, forward = device_mesh.get_group(), type(module).forward

        def local_forward(x):
            local = {
                name: SumGradient.apply(param.to_local(), group)
                for name, param in module.named_parameters(recurse=False)
            }
            with _reparametrize_module(module, local):
                return forward(module, x)

        module.forward = local_forward
        return module


class SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the TP group (each rank's
    columns contribute a part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherParts(torch.autograd.Function):
    """Each TP rank's `[a_r, b_r, ...]` output features gathered into `[a, b, ...]`;
    backward keeps this rank's columns of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, local, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.contiguous(), group=group)
        by_rank = [piece.split(sizes, dim=-1) for piece in pieces]
        return torch.cat([parts[i] for i in range(len(sizes)) for parts in by_rank], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        full = grad.split([n * size for n in ctx.sizes], dim=-1)
        mine = [part.chunk(size, dim=-1)[rank] for part in full]
        return torch.cat(mine, dim=-1), None, None


def require_whole_sequence_shards(embedding: nn.Module, tp: int) -> None:
    """Sequence parallelism splits the sequence into `tp` equal shards: check each input of
    the model's `embedding` (token ids [B, T]) before anything runs, so a length that does
    not split is one clear error rather than a shape mismatch deep in a block."""

    def check(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("input")
        if tokens is not None and tokens.shape[-1] % tp:
            raise ValueError(
                f"sequence parallelism splits each sequence over {tp} TP ranks: the model's "
                f"input of {tokens.shape[-1]} tokens is not a multiple of {tp}; pick a "
                f"sequence length whose input (data.seq_len) is one"
            )

    embedding.register_forward_pre_hook(check, with_kwargs=True)
