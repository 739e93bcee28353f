"""Checkpoint integrity on real sizes: a data file larger than the blocks `manifest.checksum`
reads (4 MiB), corrupted at its first, middle or last byte or truncated, is refused by
`checkpoint.load` and by the CLI commands that load checkpoints, naming the file, before any
weight is touched. Files under one block cannot tell a CRC chained across blocks from one
that restarts at every block; these can.

One process, no torch.distributed: `save`/`load` then run as a world of one rank.
"""

from __future__ import annotations

import os
import random
import shutil
import zlib
from types import SimpleNamespace

import pytest
import torch

from flatshard import checkpoint
from flatshard.checkpoint import manifest
from flatshard.cli.launch import LAUNCHER_VARS
from flatshard.cli.main import main
from flatshard.errors import CheckpointError
from flatshard.models import Llama, LlamaConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

BLOCK = 1 << 22  # manifest.checksum's read size
# ~2.7M fp32 parameters: one ~10.5 MiB data file, so first, middle and last byte each lie
# in a different block.
CONFIG = LlamaConfig(vocab_size=4096, dim=256, n_layers=1, n_heads=4, ffn_dim=512, max_seq_len=64)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    torch.manual_seed(0)
    model = Llama(CONFIG)
    checkpoint.save(str(root), model=model, step=1)
    return str(root), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def ckpt(pristine, tmp_path, monkeypatch):
    """A fresh copy of the pristine checkpoint and its largest data file."""
    for name in LAUNCHER_VARS:  # the CLI then runs as one plain process, as the user's would
        monkeypatch.delenv(name, raising=False)
    source, weights = pristine
    root = str(tmp_path / "ckpt")
    shutil.copytree(source, root)
    step_dir = checkpoint.commit.latest_dir(root)
    files = manifest.read(step_dir)["files"]
    name = max(files, key=lambda n: files[n]["size"])
    size = files[name]["size"]
    assert name.endswith(".distcp") and size > 2 * BLOCK, (name, size)
    return SimpleNamespace(
        root=root,
        step_dir=step_dir,
        name=name,
        path=os.path.join(step_dir, name),
        size=size,
        weights=weights,
    )


def _other_model():
    torch.manual_seed(1)
    model = Llama(CONFIG)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_refused(ckpt, tmp_path, capsys, what: str) -> None:
    """Every path that loads the checkpoint refuses it, naming the file and `what`."""
    saved = manifest.read(ckpt.step_dir)
    problems = manifest.verify_files(ckpt.step_dir, saved, sorted(saved["files"]))
    assert len(problems) == 1 and ckpt.name in problems[0] and what in problems[0], problems

    model, before = _other_model()
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(ckpt.root, model=model)
    assert ckpt.name in str(info.value) and what in str(info.value)
    assert _same(model.state_dict(), before), "a refused checkpoint changed the model"

    capsys.readouterr()
    out = tmp_path / "hf-out"
    assert main(["convert", "checkpoint-to-hf", ckpt.root, str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("flatshard: error:") and ckpt.name in error and what in error, error
    assert not out.exists()


def test_checksum_is_one_crc_over_all_blocks(ckpt, tmp_path):
    with open(ckpt.path, "rb") as handle:
        data = handle.read()
    assert manifest.checksum(ckpt.path) == {"size": len(data), "crc32": zlib.crc32(data)}
    # a size that is no multiple of the block: a short last block
    blob = random.Random(0).randbytes(2 * BLOCK + 12345)
    path = tmp_path / "blob"
    path.write_bytes(blob)
    assert manifest.checksum(str(path)) == {"size": len(blob), "crc32": zlib.crc32(blob)}


def test_intact_large_checkpoint_loads_exactly(ckpt):
    saved = manifest.read(ckpt.step_dir)
    assert manifest.verify_files(ckpt.step_dir, saved, sorted(saved["files"])) == []
    model, before = _other_model()
    assert not _same(before, ckpt.weights)
    assert checkpoint.load(ckpt.root, model=model).step == 1
    assert _same(model.state_dict(), ckpt.weights)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_large_file_is_refused(ckpt, tmp_path, capsys, where):
    position = {"first": 0, "middle": ckpt.size // 2, "last": ckpt.size - 1}[where]
    assert position // BLOCK == ["first", "middle", "last"].index(where)  # one block each
    with open(ckpt.path, "r+b") as handle:
        handle.seek(position)
        byte = handle.read(1)[0]
        handle.seek(position)
        handle.write(bytes([byte ^ 0xFF]))
    assert os.path.getsize(ckpt.path) == ckpt.size
    _assert_refused(ckpt, tmp_path, capsys, "fails its CRC-32 check")


@pytest.mark.parametrize("keep", ["all_but_last_byte", "one_block"])
def test_truncated_large_file_is_refused(ckpt, tmp_path, capsys, keep):
    with open(ckpt.path, "r+b") as handle:
        handle.truncate(ckpt.size - 1 if keep == "all_but_last_byte" else BLOCK)
    _assert_refused(ckpt, tmp_path, capsys, "truncated")


def test_corruption_reaches_weights_when_not_verified(ckpt):
    """The flip in the middle lands in tensor data: without the CRC check it would load
    silently, so the CRC is what the refusals above rest on."""
    with open(ckpt.path, "r+b") as handle:
        handle.seek(ckpt.size // 2)
        byte = handle.read(1)[0]
        handle.seek(ckpt.size // 2)
        handle.write(bytes([byte ^ 0xFF]))
    model, _ = _other_model()
    checkpoint.load(ckpt.root, model=model, verify=False)
    loaded = model.state_dict()
    changed = [k for k in loaded if not torch.equal(loaded[k], ckpt.weights[k])]
    assert len(changed) == 1, changed
