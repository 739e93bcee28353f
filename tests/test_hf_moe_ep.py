"""Hugging Face Qwen3-MoE and Mixtral checkpoints into flatshard's reference MoE
(`flatshard.models.moe.MOE`), fully sharded with expert parallelism: each rank reads only the
rows it holds of its own experts (per-expert tensors on disk, as transformers 5 writes
them), the logits equal transformers', and the export from any (world, ep) is bitwise the
original checkpoint and loads in transformers."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_full_weights import assert_streamed_as_saved
from test_hf import assert_bit_exact, hf_logits, read_all, rel

import flatshard
from flatshard import hf
from flatshard.dtensor.sharded_param import shard_spec
from flatshard.models import MoE, MoEConfig
from flatshard.models.moe import MOE, hf_to_moe_config, moe_config_to_hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
SIZES = dict(
    vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    num_experts_per_tok=2, max_position_embeddings=64,
)  # fmt: skip
ARCHS = {
    # a dense first layer, and head_dim 16 != hidden / heads
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SIZES,
        num_hidden_layers=3,
        mlp_only_layers=[0],
        intermediate_size=64,
        num_experts=4,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        head_dim=16,
    ),  # fmt: skip
    "mixtral": lambda: transformers.MixtralConfig(
        **SIZES, num_hidden_layers=2, num_local_experts=4, intermediate_size=48
    ),
    # fewer experts than ranks: a finer row, each rank holds (and reads) half of one expert
    "mixtral_2_experts": lambda: transformers.MixtralConfig(
        **{**SIZES, "num_experts_per_tok": 1},
        num_hidden_layers=2,
        num_local_experts=2,
        intermediate_size=48,
    ),  # fmt: skip
}
LAYOUTS = [(4, 1), (4, 2), (4, 4), (2, 2)]  # (world, ep)
CASES = [(arch, *layout) for arch in ("qwen3_moe", "mixtral") for layout in LAYOUTS] + [
    ("mixtral_2_experts", 4, 1),
    ("mixtral_2_experts", 4, 2),
]


def _save_random(make_config, path, seed: int) -> None:
    """Unit-scale random weights (transformers' std-0.02 init hides errors in tiny logits)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(make_config()).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (directory, tokens, transformers' fp32 logits)."""
    out = {}
    for seed, (arch, make_config) in enumerate(ARCHS.items()):
        path = tmp_path_factory.mktemp(arch)
        _save_random(make_config, path, seed)
        tokens = torch.randint(0, SIZES["vocab_size"], (2, 11))
        out[arch] = (str(path), tokens, hf_logits(path, tokens))
    return out


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _shard_with_ep(model, ep: int):
    """Experts over `ep` ranks (EP), each rank's experts sharded over the other world / ep
    ranks; attention, routers and dense MLPs sharded over all ranks."""
    flatshard.parallelize(model, flatshard.ParallelDims(dist.get_world_size(), ep=ep))


def _import_export(path, out, tokens, ep):
    shard = functools.partial(_shard_with_ep, ep=ep)
    model = hf.from_pretrained(path, shard=shard, adapter=MOE)
    stats = hf.load_pretrained(model, path)  # again, to count what one load reads
    with torch.no_grad():
        logits = model(tokens).detach().clone()
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    experts = [block.mlp.experts for block in model.layers if hasattr(block.mlp, "experts")]
    expert_rows = [flatshard.row_range(e.gate_up_proj) for e in experts]
    boxes = [shard_spec(e.gate_up_proj).global_box for e in experts]
    hf.save_pretrained(model, out)
    streamed = [(n, t.clone()) for n, t in flatshard.full_weights(model, max_bytes=10_000)]
    return logits, stats.bytes_read, held, expert_rows, boxes, streamed


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, world, ep", CASES, ids=str)
def test_import_with_ep_reads_own_experts_and_exports_bitwise(
    checkpoints, tmp_path, arch, world, ep
):
    path, tokens, expected = checkpoints[arch]
    out = str(tmp_path / "export")
    results = run_distributed(_import_export, world, path, out, tokens, ep)
    assert expected.abs().max() > 0.5  # the comparison is not trivially small
    for logits, *_ in results:
        assert rel(logits, expected) <= TOLERANCE
    # each rank read exactly the bytes of what it holds, and together they read every
    # tensor once: no rank read another's rows (no tensor is replicated here)
    for _, read, held, *_ in results:
        assert read == held
    for *_, streamed in results:  # what an RL trainer pushes: the files' tensors, bitwise
        assert_streamed_as_saved(streamed, out)
    whole = sum(t.numel() * t.element_size() for t in read_all(path).values())
    assert sum(r[1] for r in results) == whole
    # rank r holds experts of its EP index (r % ep) only, and the ranks cover them all
    n_experts = hf.read_hf_config(path)["num_local_experts"]
    per_rank = n_experts // ep
    for layer in range(len(results[0][3])):
        covered = set()
        for rank, (*_, rows, _, _) in enumerate(results):
            start, end = rows[layer]
            low = (rank % ep) * per_rank
            assert low <= start <= end <= low + per_rank, (rank, rows[layer])
            covered.update(range(start, end))
        assert covered == set(range(n_experts))
        if n_experts < world:  # a finer row: each rank holds a part of one expert
            assert all(r[4][layer].shape[0] == 1 for r in results)
            assert len({r[4][layer] for r in results}) == world  # all different boxes
    assert_bit_exact(out, path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(tokens).logits, expected)


def test_fused_in_memory_layout_loads_too(checkpoints, tmp_path):
    """save_pretrained(save_original_format=False) keeps the experts fused; transformers
    loads that, and so does the adapter (one process, no sharding)."""
    path, tokens, expected = checkpoints["mixtral"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(tmp_path, save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in read_all(tmp_path)
    ours = hf.from_pretrained(tmp_path, adapter=MOE)
    with torch.no_grad():
        assert rel(ours(tokens), expected) <= TOLERANCE


def test_another_number_of_experts_is_one_error_naming_it(checkpoints, tmp_path):
    """A checkpoint with 8 experts into a model of 4: the config check names num_experts;
    without it (or without a config.json) the tensor check names the experts."""
    _save_random(lambda: transformers.MixtralConfig(**SIZES, num_hidden_layers=2,
                 num_local_experts=8, intermediate_size=48), tmp_path, seed=5)  # fmt: skip
    path, _, _ = checkpoints["mixtral"]
    model = MOE.build(hf.read_hf_config(path))
    assert model.config.n_experts == 4
    with pytest.raises(hf.HFCheckpointError, match=r"n_experts \(config.json num_experts\)"):
        hf.load_pretrained(model, tmp_path)
    with pytest.raises(hf.HFCheckpointError) as error:
        hf.load_pretrained(model, tmp_path, check_config=False)
    message = str(error.value)
    assert "block_sparse_moe.experts.7.w1.weight" in message
    assert "experts up to index 7 per layer; the model has n_experts=4" in message
    assert "model.layers.0.block_sparse_moe.gate.weight: checkpoint [8, 32]" in message


@pytest.mark.parametrize("style", ["qwen3_moe", "mixtral"])
def test_config_round_trip(style):
    # Mixtral has no dense layers: its one intermediate size is the experts'
    sizes = dict(first_k_dense=1) if style == "qwen3_moe" else dict(ffn_dim=48)
    cfg = MoEConfig.tiny(style, **sizes)
    cfg.aux_loss_coef = 0.02
    back = hf_to_moe_config(moe_config_to_hf(cfg))
    assert back == cfg
    # and transformers builds the model it describes: same tensors, same shapes
    with torch.device("meta"):
        theirs = hf.build_causal_lm(moe_config_to_hf(cfg))
        ours = MoE(cfg)
    mappings, unmapped = MOE.plan(ours)
    assert not unmapped
    disk, _ = hf.TRANSFORMERS.plan(theirs)
    assert [(m.hf_name, m.shape) for m in mappings] == [(m.hf_name, m.shape) for m in disk]


QWEN = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4)
MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral")


@pytest.mark.parametrize(
    "hf_config, field",
    [
        ({**QWEN, "use_sliding_window": True, "sliding_window": 16}, "sliding_window"),
        ({**QWEN, "decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({**QWEN, "mlp_only_layers": [1]}, "mlp_only_layers"),
        ({**QWEN, "attention_bias": True}, "attention_bias"),
        ({**QWEN, "hidden_act": "gelu"}, "hidden_act"),
        ({**QWEN, "made_up_field": 1}, "made_up_field"),
        ({**MIXTRAL, "router_jitter_noise": 0.1}, "router_jitter_noise"),
        ({**MIXTRAL, "sliding_window": 4096}, "sliding_window"),
        ({**MIXTRAL, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        ({**QWEN, "architectures": ["DeepseekV3ForCausalLM"]}, "architectures"),
    ],
)
def test_unsupported_config_is_an_error_naming_the_field(hf_config, field):
    with pytest.raises(hf.HFConfigError, match=field):
        hf_to_moe_config(hf_config)


def test_export_refuses_what_neither_family_expresses():
    with pytest.raises(hf.HFConfigError, match="score_func='sigmoid'"):
        moe_config_to_hf(MoEConfig.tiny("deepseek_v3"))
    with pytest.raises(hf.HFConfigError, match="norm_topk_prob=False"):
        moe_config_to_hf(MoEConfig.tiny("mixtral", norm_topk_prob=False))
