"""Sizes and options of the reference mixture-of-experts decoder (`flatshard.models.MoE`).

One config covers three families by its options:
- Qwen3-MoE: softmax router, top-k, optional top-k renormalisation (`norm_topk_prob`),
  per-head q/k RMSNorm (`qk_norm=True`).
- Mixtral: softmax router, top-k always renormalised, no q/k norm (`MoEConfig.tiny(
  style="mixtral")` shows the settings).
- DeepSeek-V3-style MoE layers: sigmoid scores, a score-correction bias buffer that only
  chooses experts, group-limited routing, a routed scaling factor, shared experts and the
  first k layers dense (attention stays the reference GQA attention, not MLA).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.models.llama.model import LlamaConfig, check_positive_int

SCORE_FUNCS = ("softmax", "sigmoid")
EXPERT_COMPUTE = ("auto", "loop", "grouped_mm")


@dataclass(kw_only=True)
class MoEConfig(LlamaConfig):
    """A Llama-style decoder whose MLPs (after the first `first_k_dense`) are MoE layers.

    `ffn_dim` sizes the dense layers' MLPs; `expert_ffn_dim` each routed expert's, and the
    shared experts together form one SwiGLU MLP of `n_shared_experts * expert_ffn_dim`.
    `expert_compute`: "loop" (one matmul per expert, the reference), "grouped_mm"
    (`torch._grouped_mm`; an error where the dtype or sizes do not allow it) or "auto"
    (grouped where allowed, else the loop).
    """

    n_experts: int
    top_k: int
    expert_ffn_dim: int
    norm_topk_prob: bool = False
    score_func: str = "softmax"
    score_bias: bool = False
    n_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    n_shared_experts: int = 0
    first_k_dense: int = 0
    aux_loss_coef: float = 0.0
    expert_compute: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_experts", "top_k", "expert_ffn_dim", "n_groups", "topk_groups"):
            check_positive_int(name, getattr(self, name))
        for name in ("n_shared_experts", "first_k_dense"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.first_k_dense > self.n_layers:
            raise ValueError(
                f"first_k_dense ({self.first_k_dense}) exceeds n_layers ({self.n_layers})"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.expert_compute not in EXPERT_COMPUTE:
            raise ValueError(
                f"expert_compute must be one of {EXPERT_COMPUTE}, got {self.expert_compute!r}"
            )
        if self.n_experts % self.n_groups != 0:
            raise ValueError(
                f"n_experts ({self.n_experts}) must be a multiple of n_groups ({self.n_groups})"
            )
        if self.topk_groups > self.n_groups:
            raise ValueError(f"topk_groups ({self.topk_groups}) exceeds n_groups ({self.n_groups})")
        per_group = self.n_experts // self.n_groups
        if self.n_groups > 1 and per_group < 2:
            raise ValueError(
                f"n_groups ({self.n_groups}) leaves {per_group} expert per group; a group is "
                "scored by its two best experts, so it needs at least 2"
            )
        if self.top_k > self.topk_groups * per_group:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the experts the router may choose from "
                f"(topk_groups {self.topk_groups} x {per_group} experts per group)"
            )
        if not self.routed_scaling > 0:
            raise ValueError(f"routed_scaling must be > 0, got {self.routed_scaling}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    @classmethod
    def tiny(cls, style: str = "qwen3_moe", **overrides) -> MoEConfig:
        """A model small enough for unit tests: hidden 32, 4 experts, top-2, 2 layers.

        `style` picks the family's options: "qwen3_moe", "mixtral" or "deepseek_v3" (one
        shared expert, sigmoid scores with a correction bias, the first layer dense).
        """
        styles = {
            "qwen3_moe": dict(qk_norm=True, norm_topk_prob=True),
            "mixtral": dict(norm_topk_prob=True),
            "deepseek_v3": dict(
                score_func="sigmoid", score_bias=True, norm_topk_prob=True, n_groups=2,
                topk_groups=2, routed_scaling=2.5, n_shared_experts=1, first_k_dense=1,
            ),
        }  # fmt: skip
        if style not in styles:
            raise ValueError(f"style must be one of {tuple(styles)}, got {style!r}")
        # expert_ffn_dim 48: rows of 192 bytes in fp32, as torch._grouped_mm needs (x16).
        defaults = dict(
            vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
            max_seq_len=64, n_experts=4, top_k=2, expert_ffn_dim=48, aux_loss_coef=0.01,
        )  # fmt: skip
        return cls(**{**defaults, **styles[style], **overrides})

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense

    def num_params(self) -> int:
        """Number of distinct parameters of `MoE(self)` (buffers not counted)."""
        d, n_moe = self.dim, self.n_layers - self.first_k_dense
        dense_mlp = 3 * d * self.ffn_dim
        routed = self.n_experts * 3 * d * self.expert_ffn_dim + self.n_experts * d
        shared = 3 * d * self.n_shared_experts * self.expert_ffn_dim
        return super().num_params() + n_moe * (routed + shared - dense_mlp)
