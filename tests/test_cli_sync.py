"""`flatshard train --sync-to HOST:PORT` with `flatshard receive` beside it, as separate
commands: the receiver takes every step's weights while the run trains, and at the end it
holds exactly what the run's own export holds."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from safetensors.torch import load_file
from test_cli_helpers import check_ok, flatshard, metrics, one_line_error
from tiny_tokenizer import make_llama_dir

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_and_receive(tmp_path, trainers: int, *train_args, **sizes):
    """`flatshard train --hf` of a tiny Llama (`sizes`: its config's) on `trainers`
    processes with `train_args`, syncing after every step to `flatshard receive` beside it:
    (the run, the model the receiver saved, the model it started from, the run's export),
    once both ended."""
    model_dir = tmp_path / "model"
    make_llama_dir(model_dir, **sizes)
    (tmp_path / "my.txt").write_text("Every rank holds whole rows of every parameter. " * 300)
    address = f"127.0.0.1:{_free_port()}"
    received = {}

    def receive():
        received["result"] = flatshard(
            "receive", "--address", address, "--hf", model_dir, "--trainers", trainers,
            "--out", tmp_path / "received", timeout=300,
        )  # fmt: skip

    thread = threading.Thread(target=receive)
    thread.start()
    run = tmp_path / "run"
    check_ok(flatshard(
        "train", "--hf", model_dir, "--data", tmp_path / "my.txt", "--steps", 3,
        "--nproc", trainers, "--seq-len", 32, "--micro-batch", 2, "--sync-to", address,
        "--out", run, "--set", "run.sample_tokens=0", "--set", "run.log_interval=1",
        *train_args, timeout=300,
    ))  # fmt: skip
    thread.join(timeout=120)
    out = check_ok(received["result"]).stdout
    assert "the run ended after 3 update(s)" in out, out
    check_ok(flatshard("convert", "checkpoint-to-hf", run, tmp_path / "export"))
    held = load_file(tmp_path / "received" / "model.safetensors")
    original = load_file(model_dir / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert set(held) == set(exported)
    return run, held, original, exported


@pytest.mark.parametrize("layout", ["dp2", "pp2", "pp2-tied"])
def test_a_receiver_holds_the_runs_weights_after_every_step(tmp_path, layout):
    """Every step's weights reach the receiver; at the end it holds the run's export
    bitwise. In pipeline stages (--pp 2) each stage's ranks send their own tensors (rank 0
    announces every stage's); a tied embedding goes from the first stage, once."""
    more = ["--global-batch", 4] if layout == "dp2" else ["--global-batch", 4, "--pp", 2]
    tied = layout.endswith("tied")
    run, held, original, exported = _train_and_receive(tmp_path, 2, *more,
                                                       tie_word_embeddings=tied)  # fmt: skip
    assert all(record["sync_bytes"] > 0 for record in metrics(run))
    for name, value in exported.items():
        assert torch.equal(held[name], value), name
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert ("lm_head.weight" in held) is not tied
    assert not torch.equal(held[head], original[head])  # it trained


def test_a_lora_run_syncs_its_weights_with_the_adapters_merged(tmp_path):
    """A LoRA run (--lora 4 at dp 2 x tp 2: the adapters sharded, and split as their
    bases) streams the base with the adapters merged: after the first full sync a delta
    sync sends the adapted projections only (every step moves their adapters; the frozen
    rest never changes), and the receiver ends holding what the run's merged export
    holds."""
    run, held, original, exported = _train_and_receive(
        tmp_path, 4, "--tp", 2, "--lora", 4, "--lr", "1e-2", "--global-batch", 4
    )
    sent = [record["sync_bytes"] for record in metrics(run)]
    assert 0 < sent[1] == sent[2] < sent[0] / 2, sent  # deltas: the adapted projections
    for name, value in exported.items():  # a block of B @ A against the whole product
        assert torch.allclose(held[name], value, rtol=0, atol=1e-6), name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (held[q] - original[q]).abs().max() > 1e-4  # the adapters trained
    embed = "model.embed_tokens.weight"
    assert torch.equal(held[embed], original[embed])  # frozen


def test_a_bad_sync_address_is_a_one_line_error(tmp_path):
    result = flatshard("train", "--model", "tiny", "--steps", 1, "--sync-to", "nowhere",
                       "--out", tmp_path / "run")  # fmt: skip
    assert "sync.address 'nowhere': give it as host:port" in one_line_error(result)
