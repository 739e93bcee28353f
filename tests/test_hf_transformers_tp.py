"""transformers causal LMs under tensor and expert parallelism, by transformers' own
`base_model_tp_plan` / `base_model_ep_plan`: imported with `hf.from_pretrained(path,
dims=...)`, each rank reading only its slices (Phi-3's fused qkv_proj and gate_up_proj
split by component, GPT-NeoX's head-interleaved query_key_value by heads, MoE experts
from their per-expert tensors), against transformers itself: logits, three training
steps, bitwise export. Dense families at (dp 2, tp 2), (tp 4) and HSDP 2 x TP 2; MoE
families (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 with MLA split by heads, its
score-correction bias and shared experts, Qwen3-Next with Gated DeltaNet layers split by
heads, GLM-4-MoE) at (efsdp 2, ep 2), (tp 2, ep 2), (dp 2, tp 2), (tp 4) and HSDP 2 x
TP 2 x EP 2; PhiMoE and GPT-OSS (no TP plan in transformers) at (efsdp 2, ep 2). A DCP checkpoint
written at (tp 2, ep 2) loads bitwise at (dp 2) and in one process.

One worker call per layout runs every family, to keep the suite fast.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import rel_diff, rel_losses
from safetensors.torch import load_file
from test_hf_transformers import lm_loss, random_model, rel, train

import flatshard
from flatshard import hf
from flatshard.dtensor.sharded_param import param_spec
from flatshard.errors import MeshError
from flatshard.parallel.transformers_plan import tensor_parallel_splits

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

TOLERANCE = 1e-5  # logits, relative to transformers'
TRAIN_TOLERANCE = 1e-6  # losses and weights after training, relative to one process
# Qwen3-Next's Gated DeltaNet (transformers' torch fallback) is not batch-invariant: in one
# process, the same three steps with each batch split in two halves (gradients
# accumulated) differ from whole batches by 5.2e-6 (losses) and 8.4e-5 (weights); plain
# data parallelism over 4 ranks by 3.4e-5 and 1.2e-4 (a wrong gradient is ~1e-1)
NOISY_TRAINING = {"qwen3_next": 1e-3}
STEPS, BATCH, SEQ = 3, 4, 9

SIZES = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,  # splits over tp 2 and 4
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,  # GQA, 4 kv heads: splits over tp 4
    max_position_embeddings=64,
)
# 4 heads of 8 and 4 kv heads: attention splits over tp 4 (the dense families cover GQA)
MOE_SIZES = dict(SIZES, num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2)
ARCHS = {
    "llama3": lambda: transformers.LlamaConfig(**SIZES, rope_theta=500000.0),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES),  # q/k/v biases split with rows
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, head_dim=8),  # q/k norms
    "gemma2": lambda: transformers.Gemma2Config(**SIZES, head_dim=8),  # tied, softcaps
    "phi3": lambda: transformers.Phi3Config(**SIZES, pad_token_id=0),  # fused on disk
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **{k: v for k, v in SIZES.items() if k != "num_key_value_heads"}
    ),  # [q_h; k_h; v_h] per head in query_key_value; biases everywhere
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **MOE_SIZES, num_experts=4, moe_intermediate_size=32
    ),
    "mixtral": lambda: transformers.MixtralConfig(**MOE_SIZES, num_local_experts=4),
    "olmoe": lambda: transformers.OlmoeConfig(**MOE_SIZES, num_experts=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **MOE_SIZES, n_routed_experts=4, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    ),  # MLA attention (split by heads), a dense first layer, shared experts
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **MOE_SIZES, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        linear_num_value_heads=4, linear_num_key_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, head_dim=8, layer_types=["linear_attention", "full_attention"],
    ),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **MOE_SIZES, n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1,
        n_group=1, topk_group=1, n_shared_experts=1,
    ),
    # no tensor-parallel plan in transformers: expert parallelism only
    # no router jitter: training draws it from each process's own generator
    "phimoe": lambda: transformers.PhimoeConfig(
        **MOE_SIZES, num_local_experts=4, router_jitter_noise=0.0
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **dict(MOE_SIZES, intermediate_size=32), head_dim=8, num_local_experts=4,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8,
    ),  # experts (E, in, out) with biases, interleaved gate/up, clamped GLU
}  # fmt: skip
DENSE = ["llama3", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox"]
MOE = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "qwen3_next", "glm4_moe"]
EP_ONLY = ["phimoe", "gpt_oss"]
# what the plan splits over TP, by the end of the HF name (every other tensor, the
# row-parallel biases included, is whole on every TP rank)
SPLIT = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_proj.bias",
    "k_proj.bias", "v_proj.bias", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "qkv_proj.weight", "gate_up_proj.weight", "query_key_value.weight",
    "query_key_value.bias", "attention.dense.weight", "dense_h_to_4h.weight",
    "dense_h_to_4h.bias", "dense_4h_to_h.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
    "linear_attn.out_proj.weight", "linear_attn.conv1d.weight", "A_log", "dt_bias",
    "q_b_proj.weight", "kv_b_proj.weight",
)  # fmt: skip
LAYOUTS = {  # name: ((dp_replicate, dp_shard, tp, ep), families)
    "dp2-tp2": ((1, 2, 2, 1), DENSE + MOE),
    "tp4": ((1, 1, 4, 1), DENSE + MOE),
    "hsdp2-tp2": ((2, 1, 2, 1), DENSE),
    "efsdp2-ep2": ((1, 4, 1, 2), MOE + EP_ONLY),
    "tp2-ep2": ((1, 2, 2, 2), MOE),
    "hsdp2-tp2-ep2": ((2, 1, 2, 2), MOE),
}


def copies(arch: str, name: str, layout) -> int:
    """How many ranks read HF tensor `name` in all: the routed experts once (split over
    EP, sharded over the rest) or, without EP, once per TP rank of each replica; a TP-split
    tensor once per replica; a buffer on every rank; every other parameter once per TP
    rank of each replica."""
    replicate, shard, tp, ep = layout
    if name.endswith("e_score_correction_bias"):  # a buffer: every rank holds it whole
        return replicate * shard * tp
    if re.search(r"\.experts\.(\d+\.|gate_up_proj|down_proj)", name):  # routed experts
        return 1 if ep > 1 else replicate * tp
    return replicate if name.endswith(SPLIT) else replicate * tp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> dict(path, tokens, logits, data, losses, weights) from transformers alone."""
    out = {}
    for seed, (arch, make_config) in enumerate(ARCHS.items()):
        torch.manual_seed(100 + seed)
        model = random_model(make_config())
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        tokens = torch.randint(0, SIZES["vocab_size"], (2, 11))
        data = [torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ)) for _ in range(STEPS)]
        with torch.no_grad():
            logits = model.eval()(tokens).logits
        losses = train(model, data, 0, 1)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[arch] = dict(path=str(path), tokens=tokens, logits=logits, data=data)
        out[arch].update(losses=losses, weights=weights)
    return out


def _every_family(cases: dict, layout: tuple[int, int, int, int], out_root: str) -> dict:
    dims = flatshard.ParallelDims(dist.get_world_size(), *layout)
    meshes = dims.build()
    results = {}
    for arch, case in cases.items():
        model = hf.from_pretrained(case["path"], dims=dims, adapter=hf.TRANSFORMERS)
        with torch.no_grad():
            logits = model(case["tokens"]).logits.detach().clone()
        read = hf.load_pretrained(model, case["path"]).bytes_read  # again, to count it
        share = sum(  # a persistent buffer (DeepSeek's score-correction bias): whole
            getattr(t, "to_local", lambda t=t: t)().nbytes
            for t in hf.TRANSFORMERS.tensors(model).values()
        )
        hf.save_pretrained(model, os.path.join(out_root, arch))
        losses = train(model, case["data"], meshes.dp_rank, dims.dp_replicate * dims.dp_shard)
        weights = {n: p.full_tensor() for n, p in model.named_parameters()}
        results[arch] = dict(logits=logits, read=read, share=share, losses=losses)
        results[arch]["weights"] = weights
        results[arch]["tp_shapes"] = {  # each parameter's TP-local shape, as the layout has it
            n: param_spec(model, n, p).info.shape for n, p in model.named_parameters()
        }
    return results


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """layout -> (results per rank, export directory)."""
    cases = {a: {k: c[k] for k in ("path", "tokens", "data")} for a, c in checkpoints.items()}
    out = {}
    for name, (layout, archs) in LAYOUTS.items():
        root = str(tmp_path_factory.mktemp(f"export-{name}"))
        world = layout[0] * layout[1] * layout[2]
        mine = {arch: cases[arch] for arch in archs}
        out[name] = (run_distributed(_every_family, world, mine, layout, root, timeout=600), root)
    return out


CASES = pytest.mark.parametrize(
    "layout, arch", [(name, arch) for name, (_, archs) in LAYOUTS.items() for arch in archs]
)


@CASES
def test_logits_equal_transformers(checkpoints, runs, arch, layout):
    for rank_results in runs[layout][0]:
        assert rel(rank_results[arch]["logits"], checkpoints[arch]["logits"]) <= TOLERANCE


@CASES
def test_each_rank_reads_only_its_slices(checkpoints, runs, arch, layout):
    results = [r[arch] for r in runs[layout][0]]
    for rank_results in results:  # every byte a rank reads is a byte it holds
        assert rank_results["read"] == rank_results["share"]
    on_disk = load_file(os.path.join(checkpoints[arch]["path"], "model.safetensors"))
    expected = sum(t.nbytes * copies(arch, n, LAYOUTS[layout][0]) for n, t in on_disk.items())
    assert sum(r["read"] for r in results) == expected


@CASES
def test_training_equals_one_process(checkpoints, runs, arch, layout):
    reference, tolerance = checkpoints[arch], NOISY_TRAINING.get(arch, TRAIN_TOLERANCE)
    for rank_results in runs[layout][0]:
        ours = rank_results[arch]
        assert rel_losses(ours["losses"], reference["losses"]) <= tolerance
        assert rel_diff(ours["weights"], reference["weights"]) <= tolerance


@CASES
def test_the_planner_sees_the_tp_split_the_runtime_makes(checkpoints, runs, arch, layout):
    """`flatshard plan`'s TP-local shapes (tensor_parallel_splits, no mesh) are those the
    parallelized model holds; with EP, each rank holds E / ep experts (as the planner's
    ep_local has them)."""
    _, _, tp, ep = LAYOUTS[layout][0]
    with torch.device("meta"):
        model = hf.build_causal_lm(hf.read_hf_config(checkpoints[arch]["path"]))
    splits = tensor_parallel_splits(model, tp) if tp > 1 else {}  # as flatshard plan asks
    expected = {
        name: tuple(n // tp if d == splits[name][0] else n for d, n in enumerate(p.shape))
        if name in splits else tuple(p.shape)
        for name, p in model.named_parameters()
    }  # fmt: skip
    for name, shape in expected.items():
        if "." not in name.rpartition(".mlp.experts.")[2] and ".mlp.experts." in name:
            expected[name] = (shape[0] // ep, *shape[1:])  # the experts module's own tensors
    assert runs[layout][0][0][arch]["tp_shapes"] == expected


@CASES
def test_export_is_bitwise_the_original(checkpoints, runs, arch, layout):
    original, out = checkpoints[arch]["path"], os.path.join(runs[layout][1], arch)
    theirs, ours = (load_file(os.path.join(p, "model.safetensors")) for p in (original, out))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name


# --------------------------------------------------------------------------------------------
# Bad input: one line naming the number and the fix, on every rank
# --------------------------------------------------------------------------------------------


def _refused(path: str, tp: int, ep: int = 1) -> str:
    dims = flatshard.ParallelDims(dist.get_world_size(), tp=tp, ep=ep)
    try:
        hf.from_pretrained(path, dims=dims, adapter=hf.TRANSFORMERS)
    except MeshError as error:
        return str(error)
    return "loaded"


def test_tp_that_does_not_divide_the_heads_is_refused_on_every_rank(checkpoints):
    # 1 kv head of 16 features: k_proj's 16 features divide by 2, its heads do not
    path = checkpoints["llama3"]["path"]
    messages = run_distributed(_refused_with_heads, 2, path)
    assert len(set(messages)) == 1
    assert "num_key_value_heads is 1, not divisible by 2" in messages[0]


def _refused_with_heads(path: str) -> str:
    import json
    import tempfile

    config = json.loads(open(os.path.join(path, "config.json")).read())
    config.update(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    other = tempfile.mkdtemp()
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(config, f)
    return _refused(other, 2)


def test_a_model_without_a_plan_is_refused(tmp_path):
    config = transformers.FalconConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    (message,) = run_distributed(_refused, 2, str(tmp_path), 2)[:1]
    assert "has no tensor-parallel plan in transformers" in message and "tp=1" in message


def test_an_ep_that_does_not_divide_the_experts_is_refused_on_every_rank(tmp_path):
    config = transformers.Qwen3MoeConfig(**MOE_SIZES, num_experts=3, moe_intermediate_size=32)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    messages = run_distributed(_refused, 2, str(tmp_path), 1, 2)
    assert len(set(messages)) == 1
    assert "has 3 experts, not divisible by 2; pick an ep that divides it" in messages[0]


def test_a_tp_that_does_not_divide_the_deltanet_key_heads_is_refused(tmp_path):
    config = ARCHS["qwen3_next"]()
    config.linear_num_key_heads, config.linear_num_value_heads = 1, 2
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    messages = run_distributed(_refused, 2, str(tmp_path), 2)
    assert len(set(messages)) == 1
    assert "linear_num_key_heads is 1, not divisible by 2; pick a tp" in messages[0]


# --------------------------------------------------------------------------------------------
# Checkpoints written at one TP/EP size load at another (fused parts stored by component)
# --------------------------------------------------------------------------------------------

RESHARDED = ["phi3", "qwen3_next", "qwen3_moe"]  # fused projections, DeltaNet conv, experts


def _state(model, optimizer) -> dict:
    """Every weight and Adam moment, as full tensors by parameter name."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = optimizer.state[param][key].full_tensor()
    return out


def _step_and_save(cases: dict, layout, root: str) -> dict:
    states = {}
    for arch, case in cases.items():
        ep = layout[3] if arch in MOE else 1  # a dense model has no experts to split
        dims = flatshard.ParallelDims(dist.get_world_size(), *layout[:3], ep)
        dp_rank, dp = dims.build().dp_rank, dims.dp_replicate * dims.dp_shard
        model = hf.from_pretrained(case["path"], dims=dims, adapter=hf.TRANSFORMERS)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        tokens = case["data"][0]
        per_rank = tokens.shape[0] // dp
        lm_loss(model, tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]).backward()
        optimizer.step()
        path = os.path.join(root, arch)
        flatshard.checkpoint.save(path, model=model, optimizer=optimizer, step=1)
        states[arch] = _state(model, optimizer)
    return states


def _load(cases: dict, layout, root: str) -> dict:
    dims = flatshard.ParallelDims(dist.get_world_size(), *layout)
    states = {}
    for arch, case in cases.items():
        model = hf.from_pretrained(case["path"], dims=dims, adapter=hf.TRANSFORMERS)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        flatshard.checkpoint.load(os.path.join(root, arch), model=model, optimizer=optimizer)
        states[arch] = _state(model, optimizer)
    return states


def test_checkpoint_at_tp2_ep2_loads_at_tp1_ep1_and_in_one_process(checkpoints, tmp_path):
    """Weights and Adam moments after one step at (dp 2, tp 2, ep 2 for the MoE), saved with
    DCP, load bitwise at (dp 2) and in one process."""
    cases = {a: {k: checkpoints[a][k] for k in ("path", "data")} for a in RESHARDED}
    saved = run_distributed(_step_and_save, 4, cases, (1, 2, 2, 2), str(tmp_path))[0]
    for world in (2, 1):
        loaded = run_distributed(_load, world, cases, (1, world, 1, 1), str(tmp_path))[0]
        for arch in cases:
            assert loaded[arch].keys() == saved[arch].keys()
            for name, tensor in saved[arch].items():
                assert torch.equal(loaded[arch][name], tensor), (arch, world, name)


def test_a_style_flatshard_does_not_know_is_named(checkpoints):
    with torch.device("meta"):
        model = hf.build_causal_lm(hf.read_hf_config(checkpoints["llama3"]["path"]))
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "local_packed_rowwise"}
    with pytest.raises(MeshError, match=r"model.layers.0.mlp.gate_proj \(Linear\) has "
                       r"transformers' tensor-parallel style 'local_packed_rowwise'"):  # fmt: skip
        tensor_parallel_splits(model, 2)
