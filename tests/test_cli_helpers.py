"""Helpers (no tests) for the CLI tests: run the real `flatshard` command, `python -m flatshard`,
in a subprocess or in this process, and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model and batch small enough for a step to take milliseconds on two CPU ranks.
TINY = [
    "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--global-batch", "4",
    "--set", "train.warmup_steps=2", "--set", "run.sample_tokens=0", "--set", "run.log_interval=1",
]  # fmt: skip


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def flatshard(*args, cwd=None, timeout=180, env=None, exact_memory=False):
    """Run `python -m flatshard ARGS`; returns the completed process (never raises on rc).
    With the default environment the command runs in a process forked from a server that has
    already imported torch, flatshard and transformers (tests/forked_command.py): the same
    command, without the two seconds of imports; `exact_memory`: glibc returns freed blocks
    at once (as MALLOC_MMAP_THRESHOLD_=65536 at a process's start), so measured peaks are
    the live ones. An `env` of its own (read as a process starts: a sitecustomize) takes a
    fresh interpreter."""
    args = [str(a) for a in args]
    if env is None:
        from forked_command import run_forked

        return run_forked(["flatshard", *args], cwd=cwd or REPO_ROOT, timeout=timeout,
                          exact_memory=exact_memory)  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "flatshard", *args],
        cwd=cwd or REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_in_process(*args) -> int:
    """`flatshard ARGS` in this process, no interpreter start: for one-process runs (--nproc
    1; processes forked from here would inherit its torch state). The run's process group
    and launcher variables are taken down after it, so the next call starts afresh."""
    import torch.distributed as dist

    from flatshard.cli.launch import LAUNCHER_VARS
    from flatshard.cli.main import main

    saved = {name: os.environ.get(name) for name in LAUNCHER_VARS}
    try:
        return main([str(a) for a in args])
    finally:
        if dist.is_initialized() and not all(saved.values()):
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single `flatshard: error: ...` line of a failed command (no traceback; one-line
    `flatshard: warning: ...`s, e.g. more processes than cores, may come before it)."""
    assert result.returncode == 2, f"rc {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("flatshard: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("flatshard: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]
