"""Tests of the reference MoE model's pieces: config checks, expert compute (per-expert loop,
torch._grouped_mm, a per-token reference), routing, the aux loss, declared components."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flatshard.layout import describe_param
from flatshard.models import MoE, MoEConfig, RouterStats, load_balancing_loss, update_score_bias
from flatshard.models.moe import GroupedExperts
from flatshard.models.moe.expert_compute import grouped_mm_supported, routed_experts

STYLES = ["qwen3_moe", "mixtral", "deepseek_v3"]


def _tokens(cfg: MoEConfig, batch: int = 2, seq: int = 11) -> torch.Tensor:
    return torch.randint(
        0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
    )


# --- config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"n_experts": 0}, "n_experts"),
        ({"top_k": 5}, "top_k"),  # more than the 4 experts
        ({"expert_ffn_dim": 2.5}, "expert_ffn_dim"),
        ({"score_func": "relu"}, "score_func"),
        ({"expert_compute": "cuda"}, "expert_compute"),
        ({"n_groups": 3}, "n_groups"),  # 4 experts do not split into 3 groups
        ({"n_groups": 4}, "n_groups"),  # one expert per group cannot be scored by its top 2
        ({"n_groups": 2, "topk_groups": 3}, "topk_groups"),
        ({"first_k_dense": 3}, "first_k_dense"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"routed_scaling": 0.0}, "routed_scaling"),
        ({"aux_loss_coef": -0.1}, "aux_loss_coef"),
        ({"n_kv_heads": 3}, "n_kv_heads"),  # the dense checks still apply
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        MoEConfig.tiny(**overrides)


def test_unknown_style_is_named():
    with pytest.raises(ValueError, match="style"):
        MoEConfig.tiny("switch")


@pytest.mark.parametrize("style", STYLES)
def test_num_params_matches_model(style):
    cfg = MoEConfig.tiny(style)
    assert sum(p.numel() for p in MoE(cfg).parameters()) == cfg.num_params()


# --- expert compute ---------------------------------------------------------------------


def _per_token_reference(x, gate_up, down, indices, weights):
    """Every (token, choice) computed on its own: no sorting, no grouping."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = indices[t, j]
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


def _expert_inputs(dtype=torch.float32, experts=4, dim=32, inner=48, tokens=13, top_k=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inner, dim, generator=g) / dim**0.5).to(dtype)
    down = (torch.randn(experts, dim, inner, generator=g) / inner**0.5).to(dtype)
    # expert 2 gets no token: an empty group
    choices = torch.tensor([0, 1, 3])
    indices = torch.stack([choices[torch.randperm(3, generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).to(dtype)
    return x, gate_up, down, indices, weights


@pytest.mark.parametrize("grouped", [False, True])
def test_expert_compute_matches_per_token_reference(grouped):
    x, gate_up, down, indices, weights = _expert_inputs()
    ours = routed_experts(x, gate_up, down, indices, weights, use_grouped_mm=grouped)
    reference = _per_token_reference(x, gate_up, down, indices, weights)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_and_loop_agree_forward_and_backward(dtype):
    inputs = _expert_inputs(dtype)
    results = []
    for grouped in (False, True):
        leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = routed_experts(*leaves, use_grouped_mm=grouped)
        out.backward(torch.ones_like(out))  # a stride-0 upstream gradient, the awkward case
        grads = [leaf.grad for leaf in leaves if leaf.requires_grad]
        results.append((out, grads))
    (loop_out, loop_grads), (grouped_out, grouped_grads) = results
    assert grouped_mm_supported(inputs[0], inputs[1], inputs[2])
    torch.testing.assert_close(grouped_out, loop_out, rtol=0, atol=0)
    for loop_grad, grouped_grad in zip(loop_grads, grouped_grads):
        torch.testing.assert_close(grouped_grad, loop_grad, rtol=0, atol=0)
    assert loop_grads[1][2].abs().sum() == 0  # the empty expert's gate_up gets a zero gradient


@pytest.mark.parametrize(
    "dtype, inner, supported",
    [
        (torch.float32, 48, True),
        (torch.bfloat16, 48, True),  # 96-byte rows
        (torch.bfloat16, 12, False),  # 24-byte rows
        (torch.float32, 45, False),  # 180-byte rows
        (torch.float64, 48, False),  # not a grouped_mm dtype
    ],
)
def test_grouped_mm_eligibility_and_fallback(dtype, inner, supported):
    x, gate_up, down, indices, weights = _expert_inputs(dtype, inner=inner)
    assert grouped_mm_supported(x, gate_up, down) == supported
    experts = GroupedExperts(MoEConfig.tiny(expert_ffn_dim=inner)).to(dtype)
    assert experts.uses_grouped_mm(x) == supported  # "auto" falls back to the loop
    forced = GroupedExperts(MoEConfig.tiny(expert_ffn_dim=inner, expert_compute="grouped_mm"))
    forced = forced.to(dtype)
    if supported:
        assert forced.uses_grouped_mm(x)
    else:
        with pytest.raises(ValueError, match="expert_compute"):
            forced(x, indices, weights)


@pytest.mark.parametrize("style", STYLES)
def test_model_loop_and_grouped_mm_agree(style):
    tokens = _tokens(MoEConfig.tiny(style))
    logits = []
    for compute in ("loop", "grouped_mm"):
        torch.manual_seed(0)
        logits.append(MoE(MoEConfig.tiny(style, expert_compute=compute))(tokens))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


# --- routing and the model --------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_forward_is_causal(style):
    cfg = MoEConfig.tiny(style)
    torch.manual_seed(0)
    model = MoE(cfg)
    tokens = _tokens(cfg)
    logits = model(tokens)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % cfg.vocab_size
    # not bitwise: later tokens change how many rows each expert's matmul has, and so its
    # blocking and rounding; a causality leak would be orders of magnitude larger
    torch.testing.assert_close(model(changed)[:, :7], logits[:, :7], rtol=0, atol=1e-6)


@pytest.mark.parametrize("style", STYLES)
def test_router_weights(style):
    cfg = MoEConfig.tiny(style, n_experts=8, n_groups=4 if style == "deepseek_v3" else 1)
    torch.manual_seed(0)
    router = MoE(cfg).layers[-1].mlp.gate
    x = torch.randn(40, cfg.dim)
    weights, indices, stats = router(x)
    # renormalised weights sum to the routed scaling; choices are distinct experts
    torch.testing.assert_close(weights.sum(-1), torch.full((40,), cfg.routed_scaling))
    assert (indices.sort(-1).values.diff(dim=-1) > 0).all()
    assert stats.counts.sum() == 40 * cfg.top_k and stats.tokens == 40
    torch.testing.assert_close(stats.prob_sum.sum(), torch.tensor(40.0))
    if style == "deepseek_v3":
        # two of the four groups: every token's experts lie in at most two groups
        groups_used = [len(set((row // 2).tolist())) for row in indices]
        assert max(groups_used) <= cfg.topk_groups


def test_aux_loss_gradient_reaches_every_router():
    cfg = MoEConfig.tiny("deepseek_v3", first_k_dense=0)
    torch.manual_seed(0)
    model = MoE(cfg)
    _, stats = model(_tokens(cfg), return_router_stats=True)
    load_balancing_loss(stats).backward()
    for layer in model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
    # the last layer's experts only receive gradient through later layers' routers: none
    assert model.layers[-1].mlp.experts.gate_up_proj.grad is None


def test_aux_loss_is_one_for_uniform_routing():
    """E * sum_e (k/E)(1/E) = k when every expert gets the same load and probability."""
    counts, probs = torch.full((4,), 5.0), torch.full((4,), 10 / 4)
    loss = load_balancing_loss([RouterStats(counts, probs, 10)])
    torch.testing.assert_close(loss, torch.tensor(2.0))  # top-2: 20 assignments of 10 tokens
    with pytest.raises(ValueError, match="MoE layer"):
        load_balancing_loss([])


def test_grouped_experts_declare_gate_and_up_along_dim_1():
    cfg = MoEConfig.tiny()
    model = MoE(cfg)
    name = "layers.0.mlp.experts.gate_up_proj"
    info = describe_param(model, name, model.get_parameter(name))
    assert [(c.name, c.dim, c.start, c.stop) for c in info.components] == [
        ("gate_proj", 1, 0, cfg.expert_ffn_dim),
        ("up_proj", 1, cfg.expert_ffn_dim, 2 * cfg.expert_ffn_dim),
    ]
    assert info.components[0].global_shape == (cfg.n_experts, cfg.expert_ffn_dim, cfg.dim)


def test_score_bias_moves_towards_balance():
    cfg = MoEConfig.tiny("deepseek_v3")
    model = MoE(cfg)
    counts = torch.tensor([9.0, 3.0, 6.0, 6.0])  # mean 6: expert 0 over, 1 under, 2-3 even
    update_score_bias(model, [RouterStats(counts, torch.zeros(4), 12)], rate=0.01)
    bias = model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    with pytest.raises(ValueError, match="statistics of 0 MoE layers"):
        update_score_bias(model, [], rate=0.01)
    with pytest.raises(ValueError, match="rate"):
        update_score_bias(model, [RouterStats(counts, torch.zeros(4), 12)], rate=0.0)
    with pytest.raises(ValueError, match="score_bias=True"):
        update_score_bias(MoE(MoEConfig.tiny(n_layers=1)), [RouterStats(counts, counts, 12)], 0.1)
