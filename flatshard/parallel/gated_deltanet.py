"""Tensor parallelism of a Gated DeltaNet layer (Qwen3-Next's linear attention) by heads.

transformers' plan gathers the outputs of its in-projections, so every TP rank runs the
whole recurrence. Its tensors are laid out by key heads, though, so a split by heads is
exact: `in_proj_qkvz` holds, per key head, `[q_h; k_h; v_h; z_h]` (the value heads
grouped with their key head) and `in_proj_ba` `[b_h; a_h]`, so a block of rows is a
block of whole heads (column-parallel, local outputs); `out_proj` takes the value heads
(row-parallel); `A_log` and `dt_bias` are per value head (`Shard(0)`); the depthwise
`conv1d` runs over the channels `[q; k; v]`, three parts each split by heads
(`_StridedShard`, declared as components so checkpoints stay TP-independent); the gated
norm's weight is shared by all heads (replicated, gradients summed over TP). Each rank
then runs the recurrence for its own heads: the module's head counts become local.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.utils.stateless import _reparametrize_module

from flatshard.errors import MeshError
from flatshard.parallel.tensor_parallel import SumGradient, split_by_parts

# the module attributes its forward reads, each a multiple of the heads
_PER_HEAD = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


def is_gated_deltanet(module: nn.Module) -> bool:
    return all(
        hasattr(module, attr)
        for attr in ("in_proj_qkvz", "in_proj_ba", "conv1d", "A_log", "dt_bias", "out_proj")
    ) and all(hasattr(module, attr) for attr in _PER_HEAD)


class GatedDeltaNetParallel(ParallelStyle):
    """Split a Gated DeltaNet layer over a 1-D TP mesh by its key heads (and the value
    heads that go with them)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp = device_mesh.size()
        check_gated_deltanet(module, tp)
        parallelize_module(module.in_proj_qkvz, device_mesh, ColwiseParallel())
        parallelize_module(module.in_proj_ba, device_mesh, ColwiseParallel())
        parallelize_module(module.out_proj, device_mesh, RowwiseParallel())
        conv_parts = (("q", module.key_dim), ("k", module.key_dim), ("v", module.value_dim))
        module.conv1d.fused_components = {"weight": conv_parts}
        split_by_parts(module.conv1d, "weight", [n for _, n in conv_parts], device_mesh)
        for name in ("A_log", "dt_bias"):
            _place(module, name, device_mesh, Shard(0))
        for name, _ in list(module.norm.named_parameters()):
            _place(module.norm, name, device_mesh, Replicate())
        for attr in _PER_HEAD:
            setattr(module, attr, getattr(module, attr) // tp)
        group, forward = device_mesh.get_group(), type(module).forward

        def local_forward(*args, **kwargs):
            # the parameters the layer's own forward reads directly, as local tensors
            local = {
                "conv1d.weight": module.conv1d.weight.to_local(),
                "A_log": module.A_log.to_local(),
                "dt_bias": module.dt_bias.to_local(),
            }
            for name, param in module.norm.named_parameters():
                local[f"norm.{name}"] = SumGradient.apply(param.to_local(), group)
            with _reparametrize_module(module, local):
                return forward(module, *args, **kwargs)

        module.forward = local_forward
        return module

    @staticmethod
    def splits(module: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
        """{parameter: (dim, parts)} as `_apply` splits them (the planner reads this)."""
        conv = (module.key_dim, module.key_dim, module.value_dim)
        rows = ("in_proj_qkvz.weight", "in_proj_ba.weight", "A_log", "dt_bias")
        return {
            **{name: (0, ()) for name in rows},
            "conv1d.weight": (0, conv),
            "out_proj.weight": (1, ()),
        }


def check_gated_deltanet(module: nn.Module, tp: int) -> None:
    if module.num_k_heads % tp:
        raise MeshError(
            f"tensor parallelism over {tp} ranks splits Gated DeltaNet by key heads, but "
            f"linear_num_key_heads is {module.num_k_heads}, not divisible by {tp}; pick a tp "
            "that divides it"
        )


def _place(module: nn.Module, name: str, device_mesh, placement) -> None:
    param = module.get_parameter(name)
    rank, size = device_mesh.get_local_rank(), device_mesh.size()
    local = param.detach().chunk(size)[rank] if isinstance(placement, Shard) else param.detach()
    value = DTensor.from_local(
        local, device_mesh, [placement], run_check=False, shape=param.shape, stride=param.stride()
    )
    module.register_parameter(name, nn.Parameter(value, param.requires_grad))
