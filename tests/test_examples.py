"""Every script in examples/ runs as its docstring says (torchrun, gloo, tiny sizes), and
what it prints holds: losses, a resumed run's loss equal to the saved one's, a fine-tuned
model that transformers loads and that differs from the one it started from."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from forked_command import torchrun_forked

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _torchrun(script: str, nproc: int, *args, cwd) -> str:
    """`torchrun --standalone --nproc-per-node NPROC examples/SCRIPT ARGS`: under torchrun
    itself for the README's example; the others with their ranks forked from the test
    server with torchrun's variables (tests/forked_command.py: seconds of imports a rank
    fewer)."""
    path = os.path.join(EXAMPLES, script)
    if script == "train_fully_shard.py":
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*launch, f"--nproc-per-node={nproc}", path, *map(str, args)]
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    else:
        proc = torchrun_forked(path, nproc, list(args), cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]


def test_every_example_is_tested():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
    assert scripts == sorted(SCRIPTS), scripts


SCRIPTS = {
    "train_fully_shard.py": 2, "muon.py": 2, "rl_offload.py": 2, "parallelize_tp_ep.py": 4,
    "long_context.py": 4, "resume_other_world.py": None, "finetune_transformers.py": None,
}  # fmt: skip


@pytest.mark.parametrize("script", [s for s, n in SCRIPTS.items() if n])
def test_a_training_example_runs(script, tmp_path):
    out = _torchrun(script, SCRIPTS[script], cwd=tmp_path)
    if script == "rl_offload.py":
        assert re.search(r"21 tensors streamed; [0-9.]+ MiB per rank offloaded and back", out)
    else:
        losses = _losses(out)
        assert len(losses) >= 3 and all(0 < loss < 10 for loss in losses), out


def test_a_checkpoint_saved_at_two_ranks_resumes_at_one(tmp_path):
    saved = _torchrun("resume_other_world.py", 2, "save", tmp_path / "ckpt", cwd=tmp_path)
    loaded = _torchrun("resume_other_world.py", 1, "load", tmp_path / "ckpt", cwd=tmp_path)
    assert "resumed at step 2 of a run on 2 rank(s)" in loaded
    after = [re.search(r"loss after 2 steps: ([0-9.]+)", out).group(1) for out in (saved, loaded)]
    assert after[0] == after[1]  # bitwise: the same digits


def test_a_transformers_model_is_fine_tuned_and_saved_for_transformers(tmp_path):
    import transformers
    from tiny_tokenizer import make_llama_dir

    make_llama_dir(tmp_path / "model")
    out = _torchrun("finetune_transformers.py", 2, tmp_path / "model", tmp_path / "out",
                    cwd=tmp_path)  # fmt: skip
    losses = _losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0], out
    before = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokens = torch.arange(10).unsqueeze(0)
    assert not torch.equal(before(tokens).logits, after(tokens).logits)
