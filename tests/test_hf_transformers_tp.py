"""transformers causal LMs under tensor parallelism, by transformers' own
`base_model_tp_plan`: imported with `hf.from_pretrained(path, dims=...)` at (dp 2, tp 2),
(dp 1, tp 4) and HSDP 2 x TP 2, each rank reading only its slices (Phi-3's fused qkv_proj
and gate_up_proj split by component, GPT-NeoX's head-interleaved query_key_value by
heads), against transformers itself: logits, three training steps, bitwise export.

One worker call per layout runs every family, to keep the suite fast.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import rel_diff, rel_losses
from safetensors.torch import load_file
from test_hf_transformers import lm_loss, rel

import flatshard
from flatshard import hf
from flatshard.errors import MeshError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # logits, relative to transformers'
TRAIN_TOLERANCE = 1e-6  # losses and weights after training, relative to one process
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
ARCHS = {
    "llama3": lambda: transformers.LlamaConfig(**SIZES, rope_theta=500000.0),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES),  # q/k/v biases split with rows
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, head_dim=8),  # q/k norms
    "gemma2": lambda: transformers.Gemma2Config(**SIZES, head_dim=8),  # tied, softcaps
    "phi3": lambda: transformers.Phi3Config(**SIZES, pad_token_id=0),  # fused on disk
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **{k: v for k, v in SIZES.items() if k != "num_key_value_heads"}
    ),  # [q_h; k_h; v_h] per head in query_key_value; biases everywhere
}
# what the plan splits over TP, by the end of the HF name (every other tensor, the
# row-parallel biases included, is whole on every TP rank)
SPLIT = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_proj.bias",
    "k_proj.bias", "v_proj.bias", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "qkv_proj.weight", "gate_up_proj.weight", "query_key_value.weight",
    "query_key_value.bias", "attention.dense.weight", "dense_h_to_4h.weight",
    "dense_h_to_4h.bias", "dense_4h_to_h.weight",
)  # fmt: skip
LAYOUTS = {  # name: (dp_replicate, dp_shard, tp)
    "dp2-tp2": (1, 2, 2),
    "tp4": (1, 1, 4),
    "hsdp2-tp2": (2, 1, 2),
}


def train(model, data, dp_rank: int, dp: int) -> list[float]:
    """SGD on this data-parallel rank's slice of every batch; the global mean loss."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    losses = []
    for tokens in data:
        per_rank = tokens.shape[0] // dp
        loss = lm_loss(model, tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = torch.tensor([loss.item()])
        if dist.is_initialized():  # every TP rank holds its data-parallel rank's loss
            dist.all_reduce(value)
            value /= dist.get_world_size() / dp
        losses.append(value.item() / dp)
    return losses


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> dict(path, tokens, logits, data, losses, weights) from transformers alone."""
    out = {}
    for seed, (arch, make_config) in enumerate(ARCHS.items()):
        torch.manual_seed(100 + seed)
        model = transformers.AutoModelForCausalLM.from_config(make_config()).float()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.3 * torch.randn_like(param))
                else:
                    param.normal_(0.0, 0.2)
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


def _every_family(cases: dict, layout: tuple[int, int, int], out_root: str) -> dict:
    replicate, shard, tp = layout
    dims = flatshard.ParallelDims(dist.get_world_size(), replicate, shard, tp)
    meshes = dims.build()
    results = {}
    for arch, case in cases.items():
        model = hf.from_pretrained(case["path"], dims=dims, adapter=hf.TRANSFORMERS)
        with torch.no_grad():
            logits = model(case["tokens"]).logits.detach().clone()
        read = hf.load_pretrained(model, case["path"]).bytes_read  # again, to count it
        share = sum(
            p.to_local().numel() * p.element_size() for p in hf.TRANSFORMERS.tensors(model).values()
        )
        hf.save_pretrained(model, os.path.join(out_root, arch))
        losses = train(model, case["data"], meshes.dp_rank, dims.dp_replicate * dims.dp_shard)
        weights = {n: p.full_tensor() for n, p in model.named_parameters()}
        results[arch] = dict(logits=logits, read=read, share=share, losses=losses)
        results[arch]["weights"] = weights
    return results


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """layout -> (results per rank, export directory)."""
    cases = {a: {k: c[k] for k in ("path", "tokens", "data")} for a, c in checkpoints.items()}
    out = {}
    for name, layout in LAYOUTS.items():
        root = str(tmp_path_factory.mktemp(f"export-{name}"))
        world = layout[0] * layout[1] * layout[2]
        out[name] = (run_distributed(_every_family, world, cases, layout, root, timeout=600), root)
    return out


PER_LAYOUT = pytest.mark.parametrize("layout", list(LAYOUTS))
FAMILIES = pytest.mark.parametrize("arch", list(ARCHS))


@PER_LAYOUT
@FAMILIES
def test_logits_equal_transformers(checkpoints, runs, arch, layout):
    for rank_results in runs[layout][0]:
        assert rel(rank_results[arch]["logits"], checkpoints[arch]["logits"]) <= TOLERANCE


@PER_LAYOUT
@FAMILIES
def test_each_rank_reads_only_its_slices(checkpoints, runs, arch, layout):
    replicate, _, tp = LAYOUTS[layout]
    results = [r[arch] for r in runs[layout][0]]
    for rank_results in results:  # every byte a rank reads is a byte it holds
        assert rank_results["read"] == rank_results["share"]
    on_disk = load_file(os.path.join(checkpoints[arch]["path"], "model.safetensors"))
    split = sum(t.nbytes for n, t in on_disk.items() if n.endswith(SPLIT))
    whole = sum(t.nbytes for n, t in on_disk.items() if not n.endswith(SPLIT))
    assert split > 0 and whole > 0
    # split tensors once per replica, TP-replicated ones once per TP rank of a replica
    assert sum(r["read"] for r in results) == replicate * (split + tp * whole)


@PER_LAYOUT
@FAMILIES
def test_training_equals_one_process(checkpoints, runs, arch, layout):
    reference = checkpoints[arch]
    for rank_results in runs[layout][0]:
        ours = rank_results[arch]
        assert rel_losses(ours["losses"], reference["losses"]) <= TRAIN_TOLERANCE
        assert rel_diff(ours["weights"], reference["weights"]) <= TRAIN_TOLERANCE


@PER_LAYOUT
@FAMILIES
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


def _refused(path: str, tp: int) -> str:
    dims = flatshard.ParallelDims(dist.get_world_size(), tp=tp)
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
