"""Run configuration: sources and their order, one-line errors that name the bad key or
value, and the data formats."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli_helpers import flatshard, one_line_error

from flatshard.cli import config as run_config
from flatshard.cli.errors import ConfigError, DataError
from flatshard.cli.main import main
from flatshard.cli.schedule import learning_rate
from flatshard.data.sequences import SequenceOrder
from flatshard.data.tokens import load_tokens


def test_unknown_key_and_missing_data_are_one_line_errors_of_the_real_command():
    line = one_line_error(flatshard("train", "--set", "model.dimm=256"))
    assert "unknown config key 'model.dimm'" in line and "did you mean 'model.dim'?" in line
    line = one_line_error(flatshard("train", "--data", "/no/such/corpus.txt"))
    assert "data.path" in line and "/no/such/corpus.txt" in line


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "train.lr=fast"], "bad value for train.lr: 'fast' is not a number"),
        (["--lr", "-1"], "bad value for train.lr: -1.0 must be > 0"),
        (["--zero-stage", "4"], "bad value for train.zero_stage: 4; choose one of 1, 2, 3"),
        (["--precision", "fp8"], "bad value for train.precision: 'fp8'"),
        (["--set", "checkpoint.async_save=maybe"], "checkpoint.async_save: 'maybe' is not true"),
        (["--set", "model.n_heads=5"], "model: dim (384) is not divisible by n_heads (5)"),
        (["--global-batch", "6", "--micro-batch", "4"], "global_batch (6) must be a multiple"),
        (["--global-batch", "4", "--micro-batch", "4"], "(4 x 2 = 8; 2 processes asked for"),
        (["--set", "train.min_lr=1", "--lr", "0.1"], "train.min_lr (1.0) must not exceed"),
        (["--set", "model=3"], "unknown config key 'model'"),
        (["--set", "no_equals_sign"], "write it as section.key=value"),
        (["--set", "model.vocab_size=100"], "model.vocab_size (100) is too small for the data"),
        (["--seq-len", "1000000"], "too few for one sequence of data.seq_len=1000000"),
        (["--resume", "/no/such/run"], "nothing to resume: '/no/such/run'"),
    ],
)
def test_bad_values_name_the_key(capsys, args, expected):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("flatshard: error: "), err
    assert expected in err


def test_config_files_and_order(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "tiny"\ndim = 96\n[train]\nlr = 0.01\n')
    yaml = tmp_path / "run.yaml"
    yaml.write_text("train:\n  lr: 0.02\n  steps: 7\n")
    config = run_config.build([str(toml), str(yaml)], ["train.steps=9", "model.n_layers=3"])
    assert config.model.dim == 96 and config.model.n_layers == 3  # file, then override
    assert config.model.ffn_dim == run_config.PRESETS["tiny"]["ffn_dim"]  # preset fills
    assert config.train.lr == 0.02 and config.train.steps == 9  # later sources win
    # the saved TOML reads back to the same config
    saved = tmp_path / "saved.toml"
    saved.write_text(config.to_toml())
    assert run_config.build([str(saved)]).flat() == config.flat()
    assert json.loads(config.to_json())["train"]["steps"] == 9


@pytest.mark.parametrize(
    "text, suffix, expected",
    [
        ('[model]\ndim = "big"\n', ".toml", "bad value for model.dim: 'big' is not an integer"),
        ("[train]\nsteps = true\n", ".toml", "train.steps: True is not an integer"),
        ("[trian]\nsteps = 3\n", ".toml", "unknown config key 'trian.steps'"),
        ("lr = 3\n", ".toml", "'lr' is not a section"),
        ("[model\n", ".toml", "cannot be parsed"),
        ("train: {stepz: 3}\n", ".yaml", "unknown config key 'train.stepz'"),
        ("{}", ".ini", "use .toml, .yaml/.yml or .json"),
    ],
)
def test_bad_config_files(tmp_path, text, suffix, expected):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        run_config.build([str(path)])


def test_data_formats(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("héllo")
    (tmp_path / "docs" / "b.txt").write_text("world")
    data = load_tokens(str(tmp_path / "docs"), "auto", "text", "**/*.txt")
    assert data.tokenizer == "bytes" and data.vocab_size == 257
    assert data.tokens.tolist() == list("héllo".encode()) + [256] + list(b"world")

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "ab"}\n\n{"text": "c", "id": 2}\n')
    assert load_tokens(str(jsonl), "auto", "text", "").tokens.tolist() == [97, 98, 256, 99]
    jsonl.write_text('{"body": "ab"}\n')
    with pytest.raises(DataError, match="line 1 .* has no string field 'text'"):
        load_tokens(str(jsonl), "auto", "text", "")

    np.arange(10, dtype=np.uint32).tofile(tmp_path / "ids.bin")
    with pytest.raises(DataError, match="set data.format=uint16 or data.format=uint32"):
        load_tokens(str(tmp_path / "ids.bin"), "auto", "text", "")
    ids = load_tokens(str(tmp_path / "ids.bin"), "uint32", "text", "")
    assert ids.tokenizer == "none" and ids.vocab_size == 10
    assert ids.tokens.tolist() == list(range(10))
    np.save(tmp_path / "ids.npy", np.arange(7, dtype=np.uint16))
    assert load_tokens(str(tmp_path / "ids.npy"), "auto", "text", "").vocab_size == 7

    bundled = load_tokens("", "auto", "text", "")
    assert len(bundled.tokens) > 100_000 and "bundled corpus" in bundled.source


def test_sequence_order_is_a_seeded_permutation_per_epoch():
    order = SequenceOrder(np.arange(41), seq_len=4, seed=3)  # 10 windows
    epoch = [int(order.window(i)[0]) for i in range(10)]
    assert sorted(epoch) == list(range(0, 40, 4))
    again = SequenceOrder(np.arange(41), seq_len=4, seed=3)
    assert [int(again.window(i)[0]) for i in range(10, 20)] != epoch  # a new order per epoch
    assert order.batch(3, 2).tolist() == [order.window(3).tolist(), order.window(4).tolist()]


def test_learning_rate_schedule():
    lr = lambda step: learning_rate(step, peak=1.0, minimum=0.1, warmup=4, total=14)
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr(9) == pytest.approx(0.55) and lr(14) == pytest.approx(0.1)
    assert learning_rate(0, peak=1.0, minimum=0.0, warmup=10, total=2) == 0.5  # cut warmup
