"""A mixture-of-experts decoder: the reference Llama with MoE layers for its MLPs.

Attention, norms, RoPE, the dense MLP and the initialisation contract are llama.py's (see
its docstring: every random draw happens in a leaf module's `reset_parameters()`, in
`modules()` order, so meta-device construction plus `flatshard.materialize` replays it).
Parameter names follow Hugging Face's in-memory Qwen3-MoE / DeepSeek-V3 layout where they
can: per layer `mlp.gate.weight (E, H)` (router), `mlp.gate.e_score_correction_bias (E,)`
(a buffer), `mlp.experts.gate_up_proj (E, 2I, H)` with gate and up as contiguous halves
along dim 1, `mlp.experts.down_proj (E, H, I)`, and `mlp.shared_experts.*` (a dense MLP).

`model(tokens)` returns logits; `model(tokens, return_router_stats=True)` returns
`(logits, stats)`, one `RouterStats` per MoE layer, for `load_balancing_loss`.
"""

from __future__ import annotations

import torch
from torch import nn

from flatshard.models.llama.model import (
    INIT_STD,
    MLP,
    Attention,
    Embedding,
    Linear,
    RMSNorm,
    attention_extras,
    attention_mask,
    indexed_layers,
    stage_positions,
)
from flatshard.models.llama.rope import rope_at
from flatshard.models.moe.config import MoEConfig
from flatshard.models.moe.expert_compute import (
    expert_outputs,
    grouped_mm_supported,
    routed_experts,
)
from flatshard.models.moe.router import Router, RouterStats, router_totals_after


class GroupedExperts(nn.Module):
    """E SwiGLU experts as two 3-D parameters, `gate_up_proj (E, 2I, H)` and
    `down_proj (E, H, I)`."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        n, dim, inner = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim
        self.compute = cfg.expert_compute
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * inner, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, inner))
        # gate and up are separate checkpoint tensors (E, I, H), stacked along dim 1
        self.fused_components = {
            "gate_up_proj": {"dim": 1, "parts": (("gate_proj", inner), ("up_proj", inner))},
        }
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.down_proj, mean=0.0, std=INIT_STD)

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether a forward on x runs `torch._grouped_mm` (else the per-expert loop)."""
        if self.compute == "loop":
            return False
        supported = grouped_mm_supported(x, self.gate_up_proj, self.down_proj)
        if self.compute == "grouped_mm" and not supported:
            raise ValueError(
                f"expert_compute='grouped_mm' but torch._grouped_mm cannot compute these "
                f"experts: {x.dtype} on {x.device.type} (it takes fp32, bf16, fp16 on CPU, "
                f"bf16 on CUDA), hidden {self.down_proj.shape[1]} and expert_ffn_dim "
                f"{self.down_proj.shape[2]} (rows must be multiples of 16 bytes); use 'auto' "
                "or 'loop'"
            )
        return supported

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor):
        grouped = self.uses_grouped_mm(x)
        return routed_experts(x, self.gate_up_proj, self.down_proj, indices, weights, grouped)

    def expert_outputs(self, rows, gate_up, down, counts) -> torch.Tensor:
        """Runs of `rows` sorted by expert (`counts` each) through the experts `gate_up` and
        `down` (these, or a slice of them: expert parallelism computes its own experts)."""
        grouped = self.compute != "loop" and grouped_mm_supported(rows, gate_up, down)
        if self.compute == "grouped_mm" and not grouped:
            self.uses_grouped_mm(rows)  # raises, naming why
        return expert_outputs(rows, gate_up, down, counts, grouped)

    def extra_repr(self) -> str:
        n, two_inner, dim = self.gate_up_proj.shape
        return f"experts={n}, dim={dim}, ffn_dim={two_inner // 2}, compute={self.compute}"


class MoELayer(nn.Module):
    """Router, routed experts and (optionally) shared experts that every token passes."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = GroupedExperts(cfg)
        shared = cfg.n_shared_experts * cfg.expert_ffn_dim
        self.shared_experts = MLP(cfg, ffn_dim=shared) if shared else None
        self.router_stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices, self.router_stats = self.gate(flat)
        out = self.experts(flat, indices, weights).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def pop_router_stats(self) -> RouterStats:
        """The last forward's statistics, dropped here so they keep no graph alive."""
        stats, self.router_stats = self.router_stats, None
        if stats is None:
            raise RuntimeError("pop_router_stats() before a forward of this MoE layer")
        return stats


class MoEBlock(nn.Module):
    """Pre-norm residual block whose MLP is an MoE layer, or dense for the first k layers.

    Its output is only the hidden state: the router statistics stay on `mlp` for the model
    to collect, so the load-balancing gradient reaches the router through the same autograd
    node as the routing weights' (a block output would start the block's backward early).
    """

    def __init__(self, cfg: MoEConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoELayer(cfg) if cfg.is_moe_layer(index) else MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None, layer: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        args, kwargs = attention_extras(cache, layer, mask)
        h = x + self.attn(self.attn_norm(x), cos, sin, *args, **kwargs)
        return h + self.mlp(self.mlp_norm(h))


class MoE(nn.Module):
    """Decoder-only MoE language model: tokens [B, T] -> logits [B, T, vocab_size]."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(MoEBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)  # see Llama: always drawn
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, tokens: torch.Tensor, router_totals: torch.Tensor | None = None, *,
        return_router_stats: bool = False, cache=None, position_ids=None,
    ):  # fmt: skip
        """`cache`, `position_ids`: as Llama's (flatshard.models.KVCache; packed documents).

        A pipeline stage of a model trained with the load-balancing loss
        (`carries_router_totals`) returns `(output, router_totals)`: the totals it was
        handed by the stage before (none on the first) plus its own layers' (`router_totals`:
        counts, probability sums and tokens: `router_totals_after`), so the last stage holds
        every layer's and the loss's gradient flows back through them to every router."""
        position_ids = stage_positions(self, tokens, position_ids)
        cos, sin = rope_at(self.config, tokens, cache, position_ids)
        mask = attention_mask(self, position_ids)
        h = tokens if self.embed_tokens is None else self.embed_tokens(tokens)  # see Llama
        stats = []
        for index, layer in indexed_layers(self.layers):
            args, kwargs = attention_extras(cache, index, mask)
            h = layer(h, cos, sin, *args, **kwargs)
            if isinstance(layer.mlp, MoELayer):
                stats.append(layer.mlp.pop_router_stats())
        if cache is not None:
            cache.length += tokens.shape[1]
        logits = h if self.lm_head is None else self.lm_head(self.norm(h))
        if getattr(self, "carries_router_totals", False):
            return logits, router_totals_after(router_totals, stats, self.config.n_experts, h)
        return (logits, tuple(stats)) if return_router_stats else logits
