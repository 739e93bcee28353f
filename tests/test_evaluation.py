"""Evaluation on held-out tokens: the same loss at world 1, 2 and 4 as one process computes
with the unsharded model (windows that do not fill the last round of micro-batches
included), and the trainer reports it in metrics.jsonl at train.eval_interval and at the end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from test_cli_helpers import TINY, metrics, run_in_process

from flatshard.cli.evaluation import Evaluation
from flatshard.cli.model import build_sharded, reference_model
from flatshard.data.sequences import SequenceOrder
from flatshard.models import LlamaConfig

CFG = LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                  max_seq_len=16)  # fmt: skip
SEQ, WINDOWS = 8, 7  # 7 windows: no world's rounds of micro-batches of 2 come out even
TOKENS = np.random.default_rng(0).integers(0, 61, SEQ * WINDOWS + 3).astype(np.uint16)


def _reference_loss() -> float:
    torch.manual_seed(3)
    model = reference_model(CFG)
    windows = [TOKENS[i * SEQ : i * SEQ + SEQ + 1] for i in range(WINDOWS)]
    batch = torch.from_numpy(np.stack(windows).astype(np.int64))
    with torch.no_grad():
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def _sharded_eval() -> dict:
    import torch.distributed as dist

    model = build_sharded(CFG, zero_stage=3, precision="fp32", seed=3, device=torch.device("cpu"))
    world = dist.get_world_size()
    return Evaluation(SequenceOrder(TOKENS, SEQ, 0), 0).run(model, 2, dist.get_rank(), world, "cpu")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_eval_loss_is_the_same_at_every_world_size(world_size):
    expected = _reference_loss()
    results = run_distributed(_sharded_eval, world_size)
    for result in results:
        assert abs(result["eval_loss"] - expected) <= 1e-6 * expected
        assert result["eval_tokens"] == WINDOWS * SEQ
        assert result["eval_perplexity"] == pytest.approx(math.exp(result["eval_loss"]))


def test_the_trainer_evaluates_at_its_interval_and_at_the_end(tmp_path):
    out = tmp_path / "run"
    args = ["train", *map(str, TINY), "--steps", "3", "--nproc", "1", "--out", str(out),
            "--set", "data.eval=0.05", "--set", "train.eval_interval=2",
            "--set", "train.eval_sequences=4"]  # fmt: skip
    assert run_in_process(*args) == 0
    records = metrics(out)
    assert ["eval_loss" in r for r in records] == [False, True, True]
    assert all(r["eval_tokens"] == 4 * 32 for r in records[1:])
