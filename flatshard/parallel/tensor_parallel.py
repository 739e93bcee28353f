"""Tensor parallelism for the reference Llama, applied from outside the model.

Each block's attention splits its heads over the TP ranks (q/k/v column-parallel, o
row-parallel) and its MLP its hidden units (gate/up column-parallel, down row-parallel):
one all-reduce after o and one after down per block, as Megatron and torchtitan do. The
embedding, the norms and the head stay replicated (a small model's head is cheaper
replicated than gathered; vocab-parallel is a later choice).

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
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils.stateless import _reparametrize_module

from flatshard.errors import MeshError


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


def check_tp(config, tp: int) -> None:
    """A clear error before anything is split: every split dimension must divide by tp."""
    dims = {
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "ffn_dim": config.ffn_dim,
    }
    bad = [f"{name} ({value})" for name, value in dims.items() if value % tp]
    if tp < 1 or bad:
        raise MeshError(
            f"tensor parallelism over {tp} ranks needs {', '.join(dims)} divisible by {tp}; "
            f"{', '.join(bad) or 'tp'} is not. Pick a tp that divides them."
        )


# Each block's TP plan, by module: "colwise" splits output features (weight and bias
# rows), "rowwise" input features (weight columns; its bias stays whole), "fused" the
# output features of each of two stacked components. `flatshard plan` reads it too.
LLAMA_BLOCK_PLAN = {
    "attn.q_proj": "colwise",
    "attn.k_proj": "colwise",
    "attn.v_proj": "colwise",
    "attn.o_proj": "rowwise",
    "mlp.gate_up_proj": "fused",
    "mlp.down_proj": "rowwise",
}


def _style(kind: str) -> ParallelStyle:
    if kind == "fused":
        return FusedColwiseParallel(components=2)
    if kind == "head_norm":
        return HeadNormParallel()
    return ColwiseParallel() if kind == "colwise" else RowwiseParallel()


def parallelize_llama(model, tp_mesh, sequence_parallel: bool = False) -> None:
    """Split every block of a reference `Llama` over the 1-D `tp_mesh`, in place.

    sequence_parallel: also split what runs outside attention and the MLP, as torchtitan
    does: the norms and residual stream by sequence (`SequenceParallel`, activations a
    `1/tp` slice), the embedding and head by vocabulary (`RowwiseParallel` /
    `ColwiseParallel`, their weights a `1/tp` slice); the head's output is gathered, so
    the loss sees full logits. Not with tied embeddings."""
    check_tp(model.config, tp_mesh.size())
    kinds = dict(LLAMA_BLOCK_PLAN)
    if model.config.qk_norm:
        kinds.update({"attn.q_norm": "head_norm", "attn.k_norm": "head_norm"})
    plan = {name: _style(kind) for name, kind in kinds.items()}
    if sequence_parallel:
        if model.config.tie_embeddings:
            raise MeshError(
                "sequence_parallel splits the embedding and the head by vocabulary in "
                "different layouts; a tied model cannot: use sequence_parallel=False"
            )
        seq = Shard(1)
        plan.update({
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(
                input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attn.o_proj": RowwiseParallel(output_layouts=seq),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        })  # fmt: skip
        parallelize_module(model, tp_mesh, {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        })  # fmt: skip
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)


def parallelize_moe(model, tp_mesh) -> None:
    """Split the reference MoE's attention (and its dense MLPs, DeepSeek's first layers)
    over the 1-D `tp_mesh` as `parallelize_llama` does; routers and experts stay whole
    on every TP rank (each computes them for the same tokens; split the experts with
    `ExpertParallel` over ranks holding different data)."""
    check_tp(model.config, tp_mesh.size())
    attention = {k: v for k, v in LLAMA_BLOCK_PLAN.items() if k.startswith("attn.")}
    if model.config.qk_norm:
        attention.update({"attn.q_norm": "head_norm", "attn.k_norm": "head_norm"})
    for block in model.layers:
        kinds = dict(attention)
        if not hasattr(block.mlp, "experts"):  # a dense layer (DeepSeek's first ones)
            kinds.update({k: v for k, v in LLAMA_BLOCK_PLAN.items() if k.startswith("mlp.")})
        parallelize_module(block, tp_mesh, {name: _style(kind) for name, kind in kinds.items()})


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape a block parameter `name` (e.g. "layers.3.attn.q_proj.weight") has on each
    of `tp` ranks under `LLAMA_BLOCK_PLAN` (the same shape whatever the rank)."""
    module, _, attr = name.rpartition(".")
    kind = next((k for key, k in LLAMA_BLOCK_PLAN.items() if module.endswith(key)), None)
    dim = {"colwise": 0, "fused": 0, "rowwise": 1 if attr == "weight" else None}.get(kind)
    if dim is None or tp == 1:
        return tuple(shape)
    if shape[dim] % (2 * tp if kind == "fused" else tp):
        raise MeshError(
            f"{name} {tuple(shape)}: dim {dim} does not split evenly over {tp} "
            "tensor-parallel ranks; pick a tp that divides it"
        )
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))
