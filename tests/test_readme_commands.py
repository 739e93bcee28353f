"""Every `flatshard ...` command the README and the docs show runs as written (a few steps
for `train`): the lines of their code blocks and the commands quoted in their text.
Placeholders (`runs/<time>`, `path/to/model`, `my.txt`, ...) become a run, a tiny Hugging Face
model or a file made here; `torchrun` lines need GPUs and are left to scripts/gpu_check.py."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex

import pytest
import torch
from forked_command import run_forked
from test_cli_helpers import REPO_ROOT
from tiny_tokenizer import make_tokenizer_dir

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop
transformers = pytest.importorskip("transformers")

PAGES = [
    os.path.join(REPO_ROOT, "README.md"),
    *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "**", "*.md"), recursive=True)),
]
PAIRED = "<!-- not run: paired"
QUOTED = re.compile(r"`(flatshard (?:train|plan|sample|inspect|convert) [^`]*)`")


def readme_commands() -> list[str]:
    """The README's and the docs' flatshard commands, in order: code-block lines
    (continuations joined, comments dropped) and commands quoted in the text."""
    commands, in_block, output, pending, previous = [], False, False, "", ""
    for line in "\n".join(open(page).read() for page in PAGES).splitlines():
        if line.strip().startswith("```"):
            in_block = not in_block
            # what a command prints, or commands that wait for each other (another test
            # runs them together): not commands to run one by one
            output = line.strip() == "```text" or previous.startswith(PAIRED)
            previous = ""
            continue
        previous = line.strip()
        if in_block:
            if output:
                continue
            line = pending + line.strip()
            pending = ""
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            if line.startswith("flatshard "):
                commands.append(line.split("  #")[0].strip())
        else:
            commands += [match.strip() for match in QUOTED.findall(line)]
    return list(dict.fromkeys(commands))


def _hf_model(path, moe: bool) -> str:
    """A tiny Llama (or Qwen3-MoE) directory with a tiny tokenizer of its own (and a
    vocabulary that also holds byte-level data)."""
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    if moe:
        config = transformers.Qwen3MoeConfig(
            **sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8
        )
    else:
        config = transformers.LlamaConfig(**sizes)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    make_tokenizer_dir(path)
    return str(path)


def _places(tmp_path) -> dict[str, str]:
    text = tmp_path / "my_text_dir"
    text.mkdir()
    sentence = "The value of a flat shard is that every rank holds whole rows. "
    (text / "a.txt").write_text(sentence * 400)
    (tmp_path / "my.txt").write_text(sentence * 400)
    (tmp_path / "run.toml").write_text("[train]\nmicro_batch = 2\nglobal_batch = 4\n")
    turns = [("What is a flat shard?", "A shard of whole rows."), ("Lists?", "Mutable.")] * 4
    (tmp_path / "chat.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q},
                                 {"role": "assistant", "content": a}]}) + "\n"
        for q, a in turns
    ))  # fmt: skip
    return {
        "my_text_dir/": str(text) + "/",
        "my.txt": str(tmp_path / "my.txt"),
        "run.toml": str(tmp_path / "run.toml"),
        "chat.jsonl": str(tmp_path / "chat.jsonl"),
        "/tmp/optim": str(tmp_path / "optim"),
        "path/to/hf_model": _hf_model(tmp_path / "hf_model", moe=False),
        "ckpt/": str(tmp_path / "ckpt") + "/",
        "out/": str(tmp_path / "out") + "/",
    }


def _run(command: str, cwd, places: dict, moe_model: str, dense_model: str):
    args = shlex.split(command)
    model = moe_model if "--ep" in args else dense_model
    args = [places.get(a, a.replace("path/to/model", model)) for a in args[1:]]
    if args[0] == "sample" and "--tokens" not in args:
        args += ["--tokens", "16"]  # a few tokens' worth of generation, not the default 200
    if args[0] == "train" and "--help-config" not in args:
        args += ["--steps", "3" if "--resume" in args else "2", "--set", "run.sample_tokens=0"]
        if "--seq-len" not in args:
            args += ["--seq-len", "32"]  # a few steps' worth of tokens, not the default 256
    return run_forked(["flatshard", *args], cwd=cwd, timeout=300)


def test_every_readme_command_runs_as_written(tmp_path):
    commands = readme_commands()
    assert len(commands) >= 15 and all(c.startswith("flatshard ") for c in commands)
    places = _places(tmp_path)
    dense = _hf_model(tmp_path / "model", moe=False)
    moe = _hf_model(tmp_path / "moe_model", moe=True)
    cwd = tmp_path / "work"
    cwd.mkdir()
    failed = []
    for command in commands:
        runs = sorted((cwd / "runs").glob("2*")) if (cwd / "runs").exists() else []
        if runs:  # the newest run so far stands for runs/<time>
            newest = runs[-1]
            step = sorted((newest / "checkpoints").glob("step-*"))[-1]
            places["runs/<time>/checkpoints/step-00000100"] = str(step)
            places["runs/<time>"] = places["runs/<run>"] = str(newest)
        result = _run(command, cwd, places, moe, dense)
        if result.returncode != 0:
            failed.append(f"{command}\n    {result.stderr.strip()[-600:]}")
    assert not failed, "\n".join(failed)
