"""Any transformers causal LM, sharded in place (flatshard.hf.TRANSFORMERS), against
transformers itself: twelve families built offline from config objects with random weights,
saved by transformers, imported into `fully_shard`-ed transformers models at world 1, 2 and
3 (each rank reading only its rows, MoE experts from their per-expert tensors on disk),
exported back, and trained five steps against the same model trained in one process.

One worker call per world size runs every family, to keep the suite fast.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from reference import rel_diff, rel_losses
from safetensors.torch import load_file

from flatshard import hf
from flatshard.hf.checkpoint import checkpoint_tensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the network
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

TOLERANCE = 1e-5  # logits, relative to transformers'
TRAIN_TOLERANCE = 2e-6  # after training, relative to one process (gemma-3 on torch 2.11: 1.08e-6)
STEPS, BATCH, SEQ = 5, 6, 9  # batch 6 splits evenly over 1, 2 and 3 ranks

SIZES = dict(
    vocab_size=61,  # prime: embedding rows never split evenly
    hidden_size=32,
    intermediate_size=48,  # rows of 48 fp32 = 192 bytes: transformers' MoE needs 16-byte rows
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
    high_freq_factor=8.0, original_max_position_embeddings=256,
)  # fmt: skip
MOE = dict(num_experts_per_tok=2)
ARCHS = {
    "llama3": lambda: transformers.LlamaConfig(**SIZES, rope_theta=500000.0),
    "llama31": lambda: transformers.LlamaConfig(**SIZES, rope_parameters=LLAMA3_ROPE),
    "smollm_tied": lambda: transformers.LlamaConfig(**SIZES, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES),
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SIZES, **MOE, num_experts=4, moe_intermediate_size=32
    ),
    "mixtral": lambda: transformers.MixtralConfig(**SIZES, **MOE, num_local_experts=4),
    "mistral": lambda: transformers.MistralConfig(**SIZES, sliding_window=None),
    "gemma": lambda: transformers.GemmaConfig(**SIZES, head_dim=8),
    "phi3": lambda: transformers.Phi3Config(**SIZES, pad_token_id=0),
    "olmo2": lambda: transformers.Olmo2Config(**SIZES),
    # its head is `embed_out` on disk: transformers' renaming found by the model's own class
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **{k: v for k, v in SIZES.items() if k != "num_key_value_heads"}
    ),
}


def random_model(config):
    """The transformers model of `config` with random weights, norms' too (not the trivial
    ones: Gemma adds 1 itself)."""
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    return model


def rel(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(model, data, rank: int = 0, world: int = 1) -> list[float]:
    """SGD on data-parallel rank `rank`'s slice (of `world`) of every global batch; the
    global mean loss per step (every rank of a TP group holds its data-parallel rank's)."""
    model.train()
    # SGD, not Adam: Adam turns gradients that are zero in exact arithmetic (Qwen2's k_proj
    # bias: softmax ignores a constant added to every key) into full-size steps along their
    # rounding noise, which differs with the summation order of any two correct runs
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    losses = []
    for tokens in data:
        per_rank = tokens.shape[0] // world
        loss = lm_loss(model, tokens[rank * per_rank : (rank + 1) * per_rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = torch.tensor([loss.item()])
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


# --------------------------------------------------------------------------------------------
# References (built once, in the parent process)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> dict(path, tokens, logits, data, losses, weights) from transformers alone."""
    out = {}
    for seed, (arch, make_config) in enumerate(ARCHS.items()):
        torch.manual_seed(seed)
        model = random_model(make_config())
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        tokens = torch.randint(0, SIZES["vocab_size"], (2, 11))
        data = [torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ)) for _ in range(STEPS)]
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            logits = reference.eval()(tokens).logits
        losses = train(reference, data)
        weights = {n: p.detach().clone() for n, p in reference.named_parameters()}
        out[arch] = dict(path=str(path), tokens=tokens, logits=logits, data=data)
        out[arch].update(losses=losses, weights=weights)
    return out


# --------------------------------------------------------------------------------------------
# Worker side (module level: run_distributed sends it by reference)
# --------------------------------------------------------------------------------------------


def _every_family(cases: dict, out_root: str) -> dict:
    """For each family: import sharded, logits, bytes read, export, five training steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for arch, case in cases.items():
        model = hf.from_pretrained(
            case["path"], shard=hf.shard_decoder_layers, adapter=hf.TRANSFORMERS
        )
        with torch.no_grad():
            logits = model(case["tokens"]).logits.detach().clone()
        read = hf.load_pretrained(model, case["path"]).bytes_read  # again, to count it
        share = sum(
            p.to_local().numel() * p.element_size() for p in hf.TRANSFORMERS.tensors(model).values()
        )
        hf.save_pretrained(model, os.path.join(out_root, arch))
        losses = train(model, case["data"], rank, world)
        weights = {n: p.full_tensor() for n, p in model.named_parameters()}
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        results[arch] = dict(logits=logits, read=read, share=share, losses=losses)
        results[arch].update(weights=weights, tied=tied)
    return results


@pytest.fixture(scope="module")
def sharded_runs(checkpoints, tmp_path_factory):
    """world -> (results per rank, export directory)."""
    cases = {
        arch: {k: case[k] for k in ("path", "tokens", "data")} for arch, case in checkpoints.items()
    }
    runs = {}
    for world in (1, 2, 3):
        out = str(tmp_path_factory.mktemp(f"export-w{world}"))
        runs[world] = (run_distributed(_every_family, world, cases, out, timeout=300), out)
    return runs


# --------------------------------------------------------------------------------------------
# Import, export, training: every family at world 1, 2 and 3
# --------------------------------------------------------------------------------------------

WORLDS = pytest.mark.parametrize("world", [1, 2, 3])
FAMILIES = pytest.mark.parametrize("arch", list(ARCHS))


@WORLDS
@FAMILIES
def test_logits_equal_transformers(checkpoints, sharded_runs, arch, world):
    for rank_results in sharded_runs[world][0]:
        assert rel(rank_results[arch]["logits"], checkpoints[arch]["logits"]) <= TOLERANCE


@WORLDS
@FAMILIES
def test_each_rank_reads_only_its_share(checkpoints, sharded_runs, arch, world):
    results = [r[arch] for r in sharded_runs[world][0]]
    for rank_results in results:  # every byte a rank reads is a byte it holds
        assert rank_results["read"] == rank_results["share"]
    total = sum(
        t.numel() * t.element_size()
        for t in load_file(os.path.join(checkpoints[arch]["path"], "model.safetensors")).values()
    )
    assert sum(r["read"] for r in results) == total  # and every byte once


@WORLDS
@FAMILIES
def test_training_equals_one_process(checkpoints, sharded_runs, arch, world):
    reference = checkpoints[arch]
    for rank_results in sharded_runs[world][0]:
        ours = rank_results[arch]
        assert ours["tied"] == (arch in ("smollm_tied", "gemma"))
        assert rel_losses(ours["losses"], reference["losses"]) <= TRAIN_TOLERANCE
        assert rel_diff(ours["weights"], reference["weights"]) <= TRAIN_TOLERANCE


@WORLDS
@FAMILIES
def test_export_is_what_transformers_writes(checkpoints, sharded_runs, arch, world):
    original, out = checkpoints[arch]["path"], os.path.join(sharded_runs[world][1], arch)
    assert sorted(os.listdir(out)) == sorted(os.listdir(original))
    theirs, ours = (load_file(os.path.join(p, "model.safetensors")) for p in (original, out))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():  # bitwise, dtype and shape included
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name
    for file in ("config.json", "generation_config.json"):  # the same JSON, field by field
        theirs, ours = (json.loads(open(os.path.join(p, file)).read()) for p in (original, out))
        assert ours == theirs, file
    if world == 3:  # transformers loads the export as the very same model
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            logits = model.eval()(checkpoints[arch]["tokens"]).logits
        assert torch.equal(logits, checkpoints[arch]["logits"])


def test_moe_experts_are_read_from_per_expert_tensors(checkpoints):
    """The checkpoints hold transformers 5's on-disk form: one tensor per expert, which the
    import fuses into (E, 2I, H) and (E, H, I) by transformers' conversion rules."""
    for arch, gate in (
        ("qwen3_moe", "mlp.experts.3.gate_proj"),
        ("mixtral", "block_sparse_moe.experts.3.w1"),
    ):
        names = checkpoint_tensors(checkpoints[arch]["path"])
        assert f"model.layers.1.{gate}.weight" in names
        assert not any(name.endswith("gate_up_proj") for name in names)
        with torch.device("meta"):
            model = hf.build_causal_lm(hf.read_hf_config(checkpoints[arch]["path"]))
        mappings, unmapped = hf.TRANSFORMERS.plan(model)
        assert not unmapped and sorted({m.hf_name for m in mappings}) == sorted(names)


def test_plain_import_in_another_dtype(checkpoints):
    """No sharding, no process group, parameters in bf16: each expert's gate and up rows of
    the fused tensor are the checkpoint's per-expert tensors, cast."""
    path = checkpoints["qwen3_moe"]["path"]
    model = hf.from_pretrained(path, dtype=torch.bfloat16)  # not a Llama: transformers' model
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    disk = load_file(os.path.join(path, "model.safetensors"))
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    for e in range(4):
        prefix = f"model.layers.1.mlp.experts.{e}."
        gate, up = (disk[prefix + f"{part}_proj.weight"] for part in ("gate", "up"))
        assert torch.equal(fused[e], torch.cat([gate, up]).to(torch.bfloat16))


def _import_logits_and_bytes(path, tokens):
    model = hf.from_pretrained(path, shard=hf.shard_decoder_layers, adapter=hf.TRANSFORMERS)
    with torch.no_grad():
        logits = model(tokens).logits.detach().clone()
    return logits, hf.load_pretrained(model, path).bytes_read


def test_checkpoint_in_the_in_memory_layout(checkpoints, tmp_path):
    """save_pretrained(save_original_format=False) keeps the fused experts as in memory;
    transformers loads that too, and so does flatshard, each rank reading its experts."""
    case = checkpoints["qwen3_moe"]
    model = transformers.AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
    model.save_pretrained(tmp_path, save_original_format=False)
    names = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    results = run_distributed(_import_logits_and_bytes, 2, str(tmp_path), case["tokens"])
    for logits, _ in results:
        assert rel(logits, case["logits"]) <= TOLERANCE
    assert sum(read for _, read in results) == sum(
        t.numel() * t.element_size() for t in names.values()
    )


def _export(path, out, max_shard_size):
    model = hf.from_pretrained(path, shard=hf.shard_decoder_layers, adapter=hf.TRANSFORMERS)
    hf.save_pretrained(model, out, max_shard_size=max_shard_size)


@pytest.mark.parametrize("arch", ["mistral", "qwen3_moe", "mixtral"])
def test_sharded_export_is_cut_as_transformers_cuts_it(checkpoints, tmp_path, arch):
    """Several files: the same files, each with the same tensors, and the same index (MoE:
    transformers keeps the per-expert views of one fused tensor in one file)."""
    path = checkpoints[arch]["path"]
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(
        theirs, max_shard_size="20KB"
    )
    run_distributed(_export, 2, path, str(ours), "20KB")
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    index = "model.safetensors.index.json"
    assert json.loads((ours / index).read_text()) == json.loads((theirs / index).read_text())
    for file in os.listdir(theirs):
        if file.endswith(".safetensors"):
            a, b = load_file(theirs / file), load_file(ours / file)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file


def test_bf16_checkpoint_round_trip(checkpoints, tmp_path):
    """A bf16 checkpoint imports exactly into fp32 parameters (the default) and exports
    back to the very bytes with dtype=bfloat16; config.json keeps saying bfloat16."""
    path = checkpoints["mixtral"]["path"]
    original = tmp_path / "bf16"
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(
        original
    )
    model = hf.from_pretrained(original)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    hf.save_pretrained(model, tmp_path / "out", dtype=torch.bfloat16)
    theirs, ours = (load_file(p / "model.safetensors") for p in (original, tmp_path / "out"))
    assert theirs.keys() == ours.keys()
    for name, tensor in theirs.items():
        assert tensor.dtype == ours[name].dtype == torch.bfloat16
        assert torch.equal(tensor.view(torch.uint8), ours[name].view(torch.uint8)), name
    assert hf.read_hf_config(tmp_path / "out")["dtype"] == "bfloat16"
