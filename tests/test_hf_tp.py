"""Hugging Face into tensor-parallel + sharded models: each rank reads only its TP x DP
piece of every tensor (safetensors slices, no broadcast), logits equal transformers', and
the export from any (dp, tp) is bitwise the original."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from distributed import run_distributed
from test_full_weights import assert_streamed_as_saved
from test_hf import assert_bit_exact, hf_logits, rel

import flatshard
from flatshard import hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,  # splits over tp 2 and 4
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(7)
    config = transformers.Qwen2Config(**SIZES)  # q/k/v biases: split with their rows
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    tokens = torch.randint(0, SIZES["vocab_size"], (2, 11))
    return str(path), tokens, hf_logits(path, tokens)


def _tp_shard(model, shard: int, tp: int):
    flatshard.parallelize(model, flatshard.ParallelDims(shard * tp, tp=tp))


def _import_export(path, out, tokens, shard, tp):
    model = hf.from_pretrained(path, shard=functools.partial(_tp_shard, shard=shard, tp=tp))
    stats = hf.load_pretrained(model, path)  # again, to count what one load reads
    with torch.no_grad():
        logits = model(tokens).detach().clone()
    hf.save_pretrained(model, out)
    streamed = [(n, t.clone()) for n, t in flatshard.full_weights(model, max_bytes=10_000)]
    return logits, stats.bytes_read, streamed


def _total_bytes(path) -> int:
    from test_hf import read_all

    return sum(t.numel() * t.element_size() for t in read_all(path).values())


@pytest.mark.parametrize("layout", [(2, 2), (1, 4), (1, 2)], ids=str)
def test_hf_import_into_tp_reads_own_pieces_and_exports_bitwise(checkpoint, tmp_path, layout):
    path, tokens, expected = checkpoint
    shard, tp = layout
    out = str(tmp_path / "export")
    results = run_distributed(_import_export, shard * tp, path, out, tokens, shard, tp)
    for logits, _, streamed in results:
        assert rel(logits, expected) <= 1e-5
        assert_streamed_as_saved(streamed, out)  # what an RL trainer pushes, bitwise
    assert_bit_exact(out, path)
    # every rank read its own piece: replicated tensors (embedding, norms, head, the
    # row-parallel biases) once per TP rank, TP-split tensors once in all
    sizes = functools.reduce(lambda a, b: a + b, [r[1] for r in results])
    whole = _total_bytes(path)
    replicated = _replicated_bytes(path)
    assert sizes == (whole - replicated) + tp * replicated, (sizes, whole, replicated)


def _replicated_bytes(path) -> int:
    from test_hf import read_all

    split = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj.weight",
        "gate_proj",
        "up_proj",
        "down_proj.weight",
    )
    return sum(
        t.numel() * t.element_size()
        for name, t in read_all(path).items()
        if not any(key in name for key in split)
    )
