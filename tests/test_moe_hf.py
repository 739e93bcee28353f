"""The reference MoE model equals transformers' Qwen3-MoE, Mixtral and DeepSeek-V3 MoE layer
on the same weights (fp32), and its auxiliary loss equals `load_balancing_loss_func`."""

from __future__ import annotations

import pytest
import torch

from flatshard.models import MoE, MoEConfig, load_balancing_loss
from flatshard.models.moe import MoELayer

transformers = pytest.importorskip("transformers")

RENAMES = {
    "self_attn.": "attn.",
    "input_layernorm.": "attn_norm.",
    "post_attention_layernorm.": "mlp_norm.",
}


def from_hf(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An in-memory HF (transformers 5) MoE state dict under our names. Experts are already
    fused there as `gate_up_proj (E, 2I, H)` / `down_proj (E, H, I)`; only dense MLPs
    (shared experts) have separate gate and up, which we stack along dim 0."""
    out = {}
    for key, value in hf_state.items():
        key = key.removeprefix("model.")
        if key.endswith(".up_proj.weight"):
            continue  # stacked with its gate_proj below
        if key.endswith(".gate_proj.weight"):
            up = hf_state.get("model." + key.replace("gate_proj", "up_proj"))
            if up is None:
                up = hf_state[key.replace("gate_proj", "up_proj")]
            value, key = torch.cat([value, up]), key.replace("gate_proj", "gate_up_proj")
        for old, new in RENAMES.items():
            key = key.replace(old, new)
        out[key] = value
    return out


def _shared_sizes(cfg: MoEConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, num_experts_per_tok=cfg.top_k,
        rope_parameters=_rope(cfg),
        tie_word_embeddings=cfg.tie_embeddings, attn_implementation="eager",
        router_aux_loss_coef=cfg.aux_loss_coef,
    )  # fmt: skip


def _rope(cfg: MoEConfig) -> dict:
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "llama3":
        rope.update(
            factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_seq_len,
        )  # fmt: skip
    return rope


def _qwen3_moe(cfg: MoEConfig):
    config = transformers.Qwen3MoeConfig(
        **_shared_sizes(cfg), intermediate_size=cfg.ffn_dim, num_experts=cfg.n_experts,
        moe_intermediate_size=cfg.expert_ffn_dim, norm_topk_prob=cfg.norm_topk_prob,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def _mixtral(cfg: MoEConfig):
    config = transformers.MixtralConfig(
        **_shared_sizes(cfg), intermediate_size=cfg.expert_ffn_dim,
        num_local_experts=cfg.n_experts,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _randomise(module: torch.nn.Module) -> None:
    """Unit-scale weights (HF's std-0.02 init makes logits tiny and hides errors), norm
    scales near one, and a distinct router per layer."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)


def _tokens(cfg: MoEConfig, batch: int = 3, seq: int = 17) -> torch.Tensor:
    return torch.randint(
        0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3)
    )


CASES = [
    ("qwen3_moe", dict(norm_topk_prob=True), _qwen3_moe),
    ("qwen3_moe", dict(norm_topk_prob=False, norm_eps=1e-6, rope_theta=1e6), _qwen3_moe),
    ("mixtral", dict(), _mixtral),
    # Llama 3.1's RoPE scaling, with wavelengths on both sides of its band at 17 tokens
    ("qwen3_moe", dict(rope_type="llama3", rope_factor=8.0, rope_original_max_seq_len=16),
     _qwen3_moe),
]  # fmt: skip


@pytest.mark.parametrize("compute", ["loop", "grouped_mm"])
@pytest.mark.parametrize("style, overrides, build_hf", CASES)
def test_matches_hf(style, overrides, build_hf, compute):
    cfg = MoEConfig.tiny(style, expert_compute=compute, **overrides)
    torch.manual_seed(0)
    hf = build_hf(cfg).eval()
    _randomise(hf)
    model = MoE(cfg).eval()
    model.load_state_dict(from_hf(hf.state_dict()), strict=True)
    tokens = _tokens(cfg)
    with torch.no_grad():
        ours, stats = model(tokens, return_router_stats=True)
        theirs = hf(tokens, output_router_logits=True)
    assert ours.abs().max() > 0.5  # the comparison is not trivially small
    torch.testing.assert_close(ours, theirs.logits, rtol=1e-5, atol=1e-5)
    # the auxiliary loss, as HF adds it to the LM loss
    torch.testing.assert_close(load_balancing_loss(stats), theirs.aux_loss, rtol=1e-6, atol=0)
    # every expert received tokens: the comparison exercised all of them
    assert all((s.counts > 0).all() for s in stats)


@pytest.mark.parametrize("compute", ["loop", "grouped_mm"])
def test_deepseek_v3_moe_layer_matches_hf(compute):
    """DeepSeek-V3's attention is MLA (not ours), so compare the MoE layer alone: sigmoid
    scores, correction bias, group-limited top-k, scaling, and a shared expert."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    # 8 experts in 4 groups, 2 of them kept: the group limit changes which experts win
    cfg = MoEConfig.tiny("deepseek_v3", expert_compute=compute, n_experts=8, n_groups=4)
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=cfg.dim, moe_intermediate_size=cfg.expert_ffn_dim,
        n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, n_group=cfg.n_groups,
        topk_group=cfg.topk_groups, n_shared_experts=cfg.n_shared_experts,
        routed_scaling_factor=cfg.routed_scaling, norm_topk_prob=cfg.norm_topk_prob,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = DeepseekV3MoE(hf_cfg).eval()
    _randomise(hf)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_experts))
    ours = MoELayer(cfg).eval()
    ours.load_state_dict(from_hf(hf.state_dict()), strict=True)
    x = torch.randn(3, 17, cfg.dim)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)
    # the bias moved choices: without it, some token picks other experts
    with torch.no_grad():
        _, with_bias, _ = ours.gate(x.view(-1, cfg.dim))
        ours.gate.e_score_correction_bias.zero_()
        _, without_bias, _ = ours.gate(x.view(-1, cfg.dim))
    assert not torch.equal(with_bias.sort(-1).values, without_bias.sort(-1).values)
