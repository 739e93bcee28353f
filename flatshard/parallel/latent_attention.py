"""Tensor parallelism of multi-head latent attention (DeepSeek-V3's MLA) by heads.

transformers' plan leaves MLA whole on every TP rank. Its per-head up-projections split by
heads exactly: `q_b_proj` (or `q_proj`) holds `[nope_h; rope_h]` per head and `kv_b_proj`
`[k_nope_h; v_h]` per head, so row blocks are whole heads (column-parallel), and `o_proj`
takes the heads' outputs (row-parallel). The low-rank down-projections and their norms
are per token and stay whole. One subtlety: the rotary key `k_rot` (the last
`qk_rope_head_dim` outputs of `kv_a_proj_with_mqa`) is shared by every head without going
through a split projection, so each rank's gradient for it covers only its own heads:
it is summed over the TP ranks in backward (the latent half already is, by `kv_b_proj`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from flatshard.parallel.tensor_parallel import SumGradient


def is_latent_attention(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))


class LatentAttentionParallel(ParallelStyle):
    """Split an MLA module over a 1-D TP mesh by its heads."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        up = _up_projection(module)
        parallelize_module(module, device_mesh, {
            up: ColwiseParallel(), "kv_b_proj": ColwiseParallel(), "o_proj": RowwiseParallel(),
        })  # fmt: skip
        down, group = module.kv_a_proj_with_mqa, device_mesh.get_group()
        sizes = [module.kv_lora_rank, module.qk_rope_head_dim]
        forward = type(down).forward

        def latent_then_summed_rope(x):
            latent, rope = forward(down, x).split(sizes, dim=-1)
            return torch.cat([latent, SumGradient.apply(rope, group)], dim=-1)

        down.forward = latent_then_summed_rope
        return module

    @staticmethod
    def splits(module: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
        """{parameter: (dim, parts)} as `_apply` splits them (the planner reads this)."""
        up = _up_projection(module)
        return {f"{up}.weight": (0, ()), "kv_b_proj.weight": (0, ()), "o_proj.weight": (1, ())}


def _up_projection(module: nn.Module) -> str:
    """The query's per-head projection: `q_b_proj` after a low-rank `q_a_proj`, else `q_proj`."""
    return "q_b_proj" if getattr(module, "q_b_proj", None) is not None else "q_proj"
