"""`flatshard train --max-restarts N`: a rank killed outright (SIGKILL, as the kernel's OOM
killer does) makes torch's elastic agent restart every rank, which resume from the newest
checkpoint; the run ends with the losses and weights of a run that never failed, says what
failed and which steps were lost, and once its restarts are spent fails naming the cause."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from test_cli_helpers import REPO_ROOT, check_ok, cli_env, flatshard, metrics

pytestmark = pytest.mark.slow

RUN = [
    "train", "--model", "tiny", "--steps", "40", "--nproc", "2", "--checkpoint-interval", "4",
    "--seq-len", "128", "--global-batch", "16", "--micro-batch", "8",
    "--set", "run.sample_tokens=0", "--set", "run.restart_backoff=0",
]  # fmt: skip


class _Launched:
    """A command running with its output in files: a pipe read only at the end fills up
    with the restarts' tracebacks and blocks the writer (the elastic agent)."""

    def __init__(self, command: list[str], cwd, logs, **env):
        logs.mkdir(parents=True, exist_ok=True)
        self.out, self.err = open(logs / "out.txt", "w+"), open(logs / "err.txt", "w+")
        self.proc = subprocess.Popen(command, cwd=cwd, env=cli_env(**env), text=True,
                                     stdout=self.out, stderr=self.err)  # fmt: skip

    def poll(self):
        return self.proc.poll()

    @property
    def returncode(self) -> int:
        return self.proc.returncode

    def communicate(self, timeout: float) -> tuple[str, str]:
        self.proc.wait(timeout=timeout)
        self.out.seek(0)
        self.err.seek(0)
        return self.out.read(), self.err.read()


def _start(out, restarts: int) -> _Launched:
    command = [sys.executable, "-m", "flatshard", *RUN, "--max-restarts", str(restarts)]
    return _Launched(command + ["--out", str(out)], REPO_ROOT, out.parent / f"{out.name}-logs")


def _under_torchrun() -> list[str]:
    """RUN without --nproc: torchrun says how many processes."""
    return [arg for i, arg in enumerate(RUN) if "--nproc" not in RUN[max(0, i - 1) : i + 1]]


def _kill_rank(out, attempt: int, rank: int, after_steps: int, host_lost=False) -> None:
    """SIGKILL `rank` of `attempt` once the metrics hold `after_steps` records; `host_lost`:
    its host's memory goes too (the directory its FLATSHARD_HOST_MEMORY names)."""
    record = out / "attempts" / str(attempt) / f"rank-{rank}.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        log = out / "metrics.jsonl"
        lines = log.read_text().count("\n") if record.exists() and log.exists() else 0
        if record.exists() and lines >= after_steps:
            pid = json.loads(record.read_text())["pid"]
            environ = open(f"/proc/{pid}/environ", "rb").read().decode().split("\0")
            os.kill(pid, signal.SIGKILL)
            if host_lost:
                (memory,) = [v[22:] for v in environ if v.startswith("FLATSHARD_HOST_MEMORY=")]
                shutil.rmtree(memory)
            return
        time.sleep(0.01)
    raise AssertionError(f"attempt {attempt} never reached step {after_steps}")


def _weights(run, tmp_path, name):
    check_ok(flatshard("convert", "checkpoint-to-hf", run, tmp_path / name))
    return load_file(tmp_path / name / "model.safetensors")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The run that never failed."""
    out = tmp_path_factory.mktemp("clean") / "run"
    check_ok(flatshard(*RUN, "--out", out, timeout=300))
    return out


def test_a_killed_rank_restarts_the_run_which_ends_as_if_nothing_failed(tmp_path, clean):
    run = tmp_path / "restarted"
    proc = _start(run, restarts=2)
    _kill_rank(run, attempt=0, rank=1, after_steps=6)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    (restart,) = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert restart["cause"].startswith("rank 1 died without an error")
    assert restart["resumed_from"] % 4 == 0 and restart["resumed_from"] >= 4
    assert "restart 1: attempt 0 failed: rank 1 died without an error" in out
    losses = [r["loss"] for r in metrics(run)]
    assert [r["step"] for r in metrics(run)] == list(range(1, 41))  # lost steps trained again
    assert losses == [r["loss"] for r in metrics(clean)]
    ours, theirs = _weights(run, tmp_path, "a"), _weights(clean, tmp_path, "b")
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_when_the_restarts_are_spent_the_run_fails_naming_the_cause(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, restarts=1)
    _kill_rank(run, attempt=0, rank=1, after_steps=2)
    _kill_rank(run, attempt=1, rank=0, after_steps=2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGKILL, out[-2000:] + err[-3000:]
    assert ("flatshard: error: the run failed and its restarts are spent (--max-restarts 1): "
            "rank 0 died without an error") in err  # fmt: skip


def test_torchrun_max_restarts_restarts_the_run_in_its_own_directory(tmp_path, clean):
    """Under torchrun each attempt starts the command again: the run keeps its directory
    (picked by the first attempt) and resumes there."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", "--max-restarts", "1", "-m", "flatshard"]  # fmt: skip
    proc = _Launched(launch + _under_torchrun(), tmp_path, tmp_path / "logs")
    deadline = time.monotonic() + 120
    while not list((tmp_path / "runs").glob("2*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    (run,) = (tmp_path / "runs").glob("2*")
    _kill_rank(run, attempt=0, rank=1, after_steps=6)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert len(list((tmp_path / "runs").glob("2*"))) == 1
    assert "rank 1 died" in (run / "restarts.jsonl").read_text()
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(clean)]


def _recipe() -> list[str]:
    """The multi-node command of the GPU guide, as it is written there."""
    guide = open(os.path.join(REPO_ROOT, "docs", "guides", "gpus.md")).read()
    (line,) = [line for line in guide.splitlines() if line.startswith("torchrun --nnodes 2")]
    return line.split()


def test_the_multi_node_recipe_restarts_after_a_node_is_lost(tmp_path, clean):
    """The guide's two-node command, as two agents on this machine (one process a node,
    HSDP with a replica per node, each node's host memory a directory of its own, snapshots
    every step): one node's process killed and its host memory lost, both restart and resume
    from the snapshot, whose lost part comes from the other node's copy."""
    port = str(_free_port())
    run = tmp_path / "myrun"
    places = {"HEAD:29500": f"127.0.0.1:{port}", "8": "1", "/shared/runs/myrun": str(run),
              "torchrun": sys.executable}  # fmt: skip
    command = [places.get(arg, arg) for arg in _recipe()]
    command[1:1] = ["-m", "torch.distributed.run"]
    command += _under_torchrun()[1:]  # after the recipe's own `train`: a small run
    command += ["--checkpoint-interval", "20", "--set", "checkpoint.memory_interval=1"]
    memory = [str(tmp_path / f"memory{i}") for i in range(2)]
    nodes = [_Launched(command, tmp_path, tmp_path / f"node{i}", FLATSHARD_HOST_MEMORY=memory[i])
             for i in range(2)]  # fmt: skip
    _kill_rank(run, attempt=0, rank=1, after_steps=8, host_lost=True)
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, out[-2000:] + err[-3000:]
    (note,) = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert "rank 1 died" in note["cause"] and note["source"] == "host memory", note
    assert note["resumed_from"] >= 6 and note["lost_steps"] <= 2, note
    losses = [r["loss"] for r in metrics(run)]
    assert len(losses) == 40
    assert losses == pytest.approx([r["loss"] for r in metrics(clean)], rel=1e-5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_never_comes_back_leaves_the_run_going_on_fewer(tmp_path):
    """4 processes, rank 3 killed in every attempt: once the restarts are spent the run goes
    on with 2 (3 cannot split the batch), resharding the checkpoint; its losses from there
    are those of a run resumed at 2 processes from the same checkpoint."""
    run = tmp_path / "run"
    shrink = ["--nproc", "4", "--min-nproc", "2", "--global-batch", "8", "--micro-batch", "2",
              "--set", "checkpoint.keep_last=0", "--steps", "14"]  # fmt: skip
    command = [sys.executable, "-m", "flatshard", *RUN, *shrink, "--max-restarts", "1"]
    proc = _Launched(command + ["--out", str(run)], REPO_ROOT, tmp_path / "logs")
    _kill_rank(run, attempt=0, rank=3, after_steps=6)
    _kill_rank(run, attempt=1, rank=3, after_steps=0)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "4 processes failed 2 time(s)" in err and "going on with 2" in err
    notes = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert [n["processes"] for n in notes] == [4, 2] and "rank 3" in notes[-1]["cause"]
    step = notes[-1]["resumed_from"]
    # the same checkpoint resumed by hand at 2 processes
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.toml", again)
    name = f"step-{step:08d}"
    shutil.copytree(run / "checkpoints" / name, again / "checkpoints" / name)
    check_ok(flatshard("train", "--resume", again / "checkpoints" / name, "--nproc", 2,
                       timeout=300))  # fmt: skip
    after = [(r["step"], r["loss"]) for r in metrics(run) if r["step"] > step]
    assert after and after == [(r["step"], r["loss"]) for r in metrics(again) if r["step"] > step]


def test_a_restart_resumes_from_the_snapshot_in_host_memory(tmp_path, clean):
    """Snapshots in host memory every step (disk checkpoints every 20): a rank killed at
    step ~12 costs at most the step in flight, and the run ends as the clean one."""
    from flatshard.cli.runs import memory_root

    run = tmp_path / "run"
    memory = ["--checkpoint-interval", "20", "--set", "checkpoint.memory_interval=1"]
    command = [sys.executable, "-m", "flatshard", *RUN, *memory, "--max-restarts", "1"]
    proc = _Launched(command + ["--out", str(run)], REPO_ROOT, tmp_path / "logs")
    _kill_rank(run, attempt=0, rank=1, after_steps=12)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    (note,) = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert note["source"] == "host memory" and note["resumed_from"] >= 11, note
    assert note["lost_steps"] <= 2, note  # the step in flight (and a snapshot still writing)
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(clean)]
    assert not os.path.exists(memory_root(str(run)))  # the host memory given back


@pytest.mark.chaos
def test_chaos_ten_random_kills_and_the_run_ends_bitwise_as_the_clean_one(tmp_path):
    """200 steps on 4 processes, snapshots in host memory every step, async disk
    checkpoints every 10: ten SIGKILLs of random ranks at random moments (forward,
    backward, the optimizer step, a save, a restart). The final weights equal a run that
    never failed, bitwise; every checkpoint left on disk is complete and valid; each
    failure's lost steps are on record. (`python -m pytest --chaos -k chaos`)"""
    import random

    chaos = ["--steps", "200", "--nproc", "4", "--global-batch", "8", "--micro-batch", "2",
             "--checkpoint-interval", "10", "--set", "checkpoint.async_save=true",
             "--set", "checkpoint.memory_interval=1"]  # fmt: skip
    base = [arg for arg in _under_torchrun() if arg not in ("--steps", "40")]
    clean, run = tmp_path / "clean", tmp_path / "run"
    check_ok(flatshard(*base, *chaos, "--out", clean, timeout=900))
    command = [sys.executable, "-m", "flatshard", *base, *chaos, "--max-restarts", "10"]
    proc = _Launched(command + ["--out", str(run)], REPO_ROOT, tmp_path / "logs")
    rng = random.Random(0)
    kills = 0
    while kills < 10 and proc.poll() is None:
        if not _training_again(run, kills):  # each kill fails an attempt that trains
            time.sleep(0.05)
            continue
        time.sleep(rng.uniform(0.0, 1.5))
        record = run / "attempts" / str(kills) / f"rank-{rng.randrange(4)}.json"
        os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
        kills += 1
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    notes = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert kills == 10 and len(notes) == 10, (kills, notes)
    print(f"{kills} kills, {len(notes)} restarts, steps lost: {[n['lost_steps'] for n in notes]}"
          f", from: {[n['source'] for n in notes]}")  # fmt: skip
    for step in sorted((run / "checkpoints").glob("step-*")):
        check_ok(flatshard("inspect", step))  # every file's size and CRC-32 checked
    ours, theirs = _weights(run, tmp_path, "a"), _weights(clean, tmp_path, "b")
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def _training_again(run, restarts: int) -> bool:
    """Whether attempt `restarts` has all 4 ranks up and has trained a step of its own."""
    attempt = run / "attempts" / str(restarts)
    if len(list(attempt.glob("rank-*.json"))) < 4 or not (run / "metrics.jsonl").exists():
        return False
    notes = (run / "restarts.jsonl").read_text().splitlines() if restarts else []
    if len(notes) < restarts:
        return False
    resumed = json.loads(notes[-1])["resumed_from"] if restarts else 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if line.strip()]  # fmt: skip
    return bool(steps) and steps[-1] > resumed and max(steps) == steps[-1]
