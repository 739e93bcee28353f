"""Tests of the reference Llama model: shapes, causality, variants, HF parity, meta init."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatshard.models import Llama, LlamaConfig


def _tokens(cfg: LlamaConfig, batch: int = 2, seq: int = 11, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


# --- config -----------------------------------------------------------------------------


def test_config_defaults_are_resolved():
    cfg = LlamaConfig(vocab_size=10, dim=24, n_layers=1, n_heads=3, ffn_dim=8)
    assert cfg.n_kv_heads == 3 and cfg.head_dim == 8
    # tiny() derives head_dim from the overridden dim, not from its own default.
    assert LlamaConfig.tiny(dim=64).head_dim == 16


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"dim": 30}, "n_heads"),  # 30 % 4 != 0 and no head_dim given
        ({"head_dim": 7}, "head_dim"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_layers": -1}, "n_layers"),
        ({"ffn_dim": 2.5}, "ffn_dim"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        LlamaConfig.tiny(**overrides)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("extras", [False, True])
def test_num_params_matches_model(tie, extras):
    cfg = LlamaConfig.tiny(tie_embeddings=tie, qk_norm=extras, attention_bias=extras)
    model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


# --- forward ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # GQA (4 query heads, 2 kv heads)
        {"n_kv_heads": 4},  # MHA
        {"n_kv_heads": 1},  # MQA
        {"qk_norm": True},
        {"attention_bias": True},
        {"head_dim": 12},  # head_dim independent of dim // n_heads (Qwen3 style)
    ],
)
def test_forward_shape_and_causality(overrides):
    cfg = LlamaConfig.tiny(**overrides)
    torch.manual_seed(0)
    model = Llama(cfg)
    tokens = _tokens(cfg)
    logits = model(tokens)
    assert logits.shape == (2, 11, cfg.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()

    # Changing a late token must leave every earlier position's logits untouched.
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % cfg.vocab_size
    new = model(changed)
    torch.testing.assert_close(new[:, :7], logits[:, :7], rtol=0, atol=0)
    assert not torch.allclose(new[:, 7], logits[:, 7])


@pytest.mark.parametrize("kv_heads", [2, 1])  # GQA, MQA
def test_grouped_keys_attend_as_repeated_ones(monkeypatch, kv_heads):
    # CUDA's half-precision path hands SDPA the grouped keys and values (`enable_gqa`);
    # forced here on the CPU, the logits and gradients are those of the repeats
    from flatshard.comm import devices

    cfg = LlamaConfig.tiny(n_kv_heads=kv_heads)
    torch.manual_seed(0)
    model, tokens = Llama(cfg), _tokens(cfg)
    runs = []
    for grouped in (False, True):
        decide = lambda q, k, mask, grouped=grouped: grouped  # noqa: E731
        monkeypatch.setattr(devices, "attends_grouped_kv", decide)
        model.zero_grad()
        logits = model(tokens)
        logits.square().mean().backward()
        runs.append([logits.detach()] + [p.grad.clone() for p in model.parameters()])
    for repeated, grouped in zip(*runs):
        torch.testing.assert_close(grouped, repeated, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "device, dtype, mask, flash, grouped",
    [
        ("cuda", torch.bfloat16, None, True, True),  # the flash kernel reads the groups
        ("cuda", torch.float16, None, True, True),
        ("cuda", torch.bfloat16, None, False, False),  # no flash here (GPU, head size,
        # disabled): the memory-efficient kernel takes no groups
        ("cuda", torch.float32, None, True, False),  # fp32: no flash
        ("cuda", torch.bfloat16, "mask", True, False),  # packed documents: no flash
        ("cpu", torch.bfloat16, None, True, False),  # bitwise transformers' logits
    ],
)
def test_grouped_keys_go_to_sdpa_where_its_flash_kernel_runs(
    monkeypatch, device, dtype, mask, flash, grouped
):
    from types import SimpleNamespace

    from flatshard.comm import devices

    asked = []
    monkeypatch.setattr(devices, "flash_reads_groups", lambda *a: asked.append(a) or flash)
    query = SimpleNamespace(  # (no GPU here)
        is_cuda=device == "cuda", dtype=dtype, device=SimpleNamespace(index=0), shape=(2, 8, 5, 64)
    )
    key = SimpleNamespace(shape=(2, 2, 5, 64))
    assert devices.attends_grouped_kv(query, key, mask) is grouped
    if asked:  # torch's check is asked of the GPU, dtype, head size and heads
        assert asked == [(0, dtype, 64, 8, 2, torch.is_grad_enabled())]


def test_bf16_forward_keeps_dtype():
    model = Llama(LlamaConfig.tiny()).to(torch.bfloat16)
    assert model(_tokens(model.config)).dtype == torch.bfloat16


def test_too_long_sequence_is_rejected():
    cfg = LlamaConfig.tiny(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        Llama(cfg)(_tokens(cfg, seq=9))


def test_tied_embeddings_share_one_parameter():
    model = Llama(LlamaConfig.tiny(tie_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names
    # The checkpoint still carries both keys (as HF does).
    assert {"embed_tokens.weight", "lm_head.weight"} <= model.state_dict().keys()


def test_names_and_fused_components():
    cfg = LlamaConfig.tiny(qk_norm=True, attention_bias=True)
    keys = set(Llama(cfg).state_dict())
    prefix = "layers.1."
    expected = {
        "attn_norm.weight",
        "attn.q_proj.weight",
        "attn.q_proj.bias",
        "attn.k_proj.weight",
        "attn.k_proj.bias",
        "attn.v_proj.weight",
        "attn.v_proj.bias",
        "attn.o_proj.weight",
        "attn.q_norm.weight",
        "attn.k_norm.weight",
        "mlp_norm.weight",
        "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight",
    }
    assert {prefix + k for k in expected} <= keys
    assert {"embed_tokens.weight", "norm.weight", "lm_head.weight"} <= keys
    assert "layers.1.attn.o_proj.bias" not in keys

    gate_up = Llama(cfg).layers[0].mlp.gate_up_proj
    comps = gate_up.fused_components["weight"]
    assert comps == (("gate_proj.weight", cfg.ffn_dim), ("up_proj.weight", cfg.ffn_dim))
    assert sum(rows for _, rows in comps) == gate_up.weight.shape[0]


# --- Hugging Face parity ----------------------------------------------------------------


def _hf_config(cls, cfg: LlamaConfig, **extra):
    return cls(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attn_implementation="eager",
        **extra,
    )


def _from_hf(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Maps an HF Llama/Qwen2/Qwen3 state dict onto our names, fusing gate and up."""
    renames = {
        "self_attn.": "attn.",
        "input_layernorm.": "attn_norm.",
        "post_attention_layernorm.": "mlp_norm.",
    }
    out = {}
    for key, value in hf_state.items():
        key = key.removeprefix("model.")
        if key.endswith("mlp.up_proj.weight"):
            continue  # consumed together with gate_proj below
        if key.endswith("mlp.gate_proj.weight"):
            up = hf_state["model." + key.replace("gate_proj", "up_proj")]
            out[key.replace("gate_proj", "gate_up_proj")] = torch.cat([value, up], dim=0)
            continue
        for old, new in renames.items():
            key = key.replace(old, new)
        out[key] = value
    return out


def _check_parity(hf_cls, hf_cfg_cls, cfg: LlamaConfig, **extra):
    torch.manual_seed(0)
    hf = hf_cls(_hf_config(hf_cfg_cls, cfg, **extra)).eval()
    # HF's default init (std 0.02, norms at one) makes logits tiny and would hide errors
    # in the norm scales; draw unit-scale activations and non-trivial norm weights.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)

    model = Llama(cfg).eval()
    model.load_state_dict(_from_hf(hf.state_dict()), strict=True)
    tokens = _tokens(cfg, seq=17)
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert ours.abs().max() > 0.5  # the comparison is not trivially small
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_matches_hf_llama(tie):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    cfg = LlamaConfig.tiny(rope_theta=500.0, norm_eps=1e-6, tie_embeddings=tie)
    _check_parity(LlamaForCausalLM, HFLlamaConfig, cfg)


def test_matches_hf_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 16 != dim // n_heads, as in real Qwen3 models.
    cfg = LlamaConfig.tiny(qk_norm=True, head_dim=16, rope_theta=1e6, norm_eps=1e-6)
    _check_parity(Qwen3ForCausalLM, Qwen3Config, cfg)


def test_matches_hf_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = LlamaConfig.tiny(attention_bias=True, rope_theta=1e6, norm_eps=1e-6)
    # Qwen2Config has no head_dim argument; it derives dim // n_heads like we do.
    _check_parity(Qwen2ForCausalLM, _without_head_dim(Qwen2Config), cfg)


def _without_head_dim(cfg_cls):
    def build(**kwargs):
        kwargs.pop("head_dim")
        return cfg_cls(**kwargs)

    return build


# --- meta-device init replay ------------------------------------------------------------


def _replay_meta_init(cfg: LlamaConfig, seed: int) -> Llama:
    """Builds on meta, then materialises and resets module by module in modules() order.

    This is the procedure a sharding wrapper uses; it must reproduce eager construction.
    """
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Llama(cfg)
    materialised: dict[int, nn.Parameter] = {}  # id(meta param) -> real param
    for module in model.modules():
        restore = {}
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            real = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            if id(p) in materialised:
                # Tied and already initialised: reset runs on a throwaway, then re-tie.
                restore[name] = materialised[id(p)]
            else:
                materialised[id(p)] = real
            module._parameters[name] = real
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty_like(b, device="cpu")
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        module._parameters.update(restore)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_meta_init_replay_matches_eager(tie):
    cfg = LlamaConfig.tiny(tie_embeddings=tie, qk_norm=True, attention_bias=True)
    torch.manual_seed(1234)
    eager = Llama(cfg)
    replayed = _replay_meta_init(cfg, seed=1234)

    assert not any(p.is_meta for p in replayed.parameters())
    eager_sd, replayed_sd = eager.state_dict(), replayed.state_dict()
    assert eager_sd.keys() == replayed_sd.keys()
    for key in eager_sd:
        torch.testing.assert_close(replayed_sd[key], eager_sd[key], rtol=0, atol=0, msg=key)
    if tie:
        assert replayed.lm_head.weight is replayed.embed_tokens.weight
    # Replay also consumed exactly as much randomness as eager construction.
    after_replay = torch.rand(4)
    torch.manual_seed(1234)
    Llama(cfg)
    assert torch.equal(torch.rand(4), after_replay)

    tokens = _tokens(cfg)
    torch.testing.assert_close(replayed(tokens), eager(tokens), rtol=0, atol=0)

