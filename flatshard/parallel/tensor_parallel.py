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
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ParallelStyle,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils.stateless import _reparametrize_module


class FusedColwiseParallel(ParallelStyle):
    """Column parallelism for a Linear whose output rows stack `components` equal parts
    (SwiGLU's `[gate; up]`): each rank holds its share of every part, `[gate_r; up_r]`.

    DTensor's matmul does not keep a `_StridedShard` weight in place (it redistributes it
    to plain row blocks, which pairs the wrong rows), so this Linear computes with its
    local weight: its input is the replicated activation (its gradient summed over the TP
    ranks in backward, as a column-parallel layer's must be) and its output the local
    `[gate_r, up_r]` features the row-parallel layer after it consumes."""

    def __init__(self, components: int = 2):
        super().__init__()
        self.components = components

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError("FusedColwiseParallel splits nn.Linear modules only")
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        for name, param in list(module.named_parameters()):
            parts = param.detach().chunk(self.components)
            local = torch.cat([part.chunk(size)[rank] for part in parts])
            sharded = DTensor.from_local(
                local, device_mesh, [_StridedShard(0, split_factor=self.components)],
                run_check=False, shape=param.shape, stride=param.stride(),
            )  # fmt: skip
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        group = device_mesh.get_group()

        def local_forward(x):
            bias = module.bias.to_local() if module.bias is not None else None
            return F.linear(_SumGradient.apply(x, group), module.weight.to_local(), bias)

        module.forward = local_forward
        return module


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
                name: _SumGradient.apply(param.to_local(), group)
                for name, param in module.named_parameters(recurse=False)
            }
            with _reparametrize_module(module, local):
                return forward(module, x)

        module.forward = local_forward
        return module


class _SumGradient(torch.autograd.Function):
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
