"""What a new user broke (issue "Reliability"): a resume that silently changed the model, a
torn metrics line, partial checkpoints a failed save left, checkpoint commands that read a
corrupt checkpoint before checking it, a lost `latest` marker, a signal-stopped run that
looked finished, and more processes than cores. Each test is one of them, run as a user
runs the command."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_cli_helpers import TINY, check_ok, cli_env, flatshard, metrics, one_line_error

from flatshard.cli.launch import LAUNCHER_VARS
from flatshard.cli.main import main

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.slow,  # deselect with -m 'not slow' for a quick loop
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished two-rank TINY run of 4 steps with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("trained") / "run"
    check_ok(
        flatshard("train", *TINY, "--steps", 4, "--out", run, "--set", "checkpoint.interval=2")
    )
    return run


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run to change."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def steps_of(run_dir) -> list[int]:
    return sorted(n for n in os.listdir(run_dir / "checkpoints") if n.startswith("step-"))


def test_resume_with_another_model_is_refused(run):
    # `--model small` used to train the run's own (tiny) sizes: its saved sizes won
    line = one_line_error(flatshard("train", "--resume", run, "--model", "small"))
    assert 'model.preset: run "tiny", given "small"' in line, line
    assert "model.dim: run 64, given 384" in line and "model.n_layers: run 2, given 6" in line
    line = one_line_error(
        flatshard("train", "--resume", run, "--set", "model.n_heads=2", "--seed", "1")
    )
    assert "model.n_heads: run 4, given 2; train.seed: run 0, given 1" in line, line
    assert "only train.* (except train.seed and train.lora_*), checkpoint.* and run.* may" in line
    # what may change: the steps, the lr schedule, checkpointing; restating the model is fine
    resumed = check_ok(
        flatshard("train", "--resume", run, "--model", "tiny", "--steps", 5, "--lr", "1e-3",
                  "--set", "train.warmup_steps=0", "--checkpoint-interval", 1)
    )  # fmt: skip
    assert "resuming from step 4" in resumed.stdout and "dim 64" in resumed.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]


def test_torn_last_metrics_line_is_dropped_on_resume(run):
    with open(run / "metrics.jsonl", "ab") as handle:  # step 5's record, cut by a power loss
        handle.write(b'{"step": 5, "loss": 2.71\0\0\0')
    resumed = check_ok(flatshard("train", "--resume", run, "--steps", 5))
    assert "metrics.jsonl: dropped 1 torn line(s)" in resumed.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]


def test_resume_removes_partial_checkpoints_failed_saves_left(run):
    partial = run / "checkpoints" / ".step-00000006.partial"
    (partial / "rng").mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)  # a save that ran out of space
    resumed = check_ok(flatshard("train", "--resume", run, "--steps", 5))
    assert "removed .step-00000006.partial" in resumed.stdout
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", *steps_of(run)]
    assert steps_of(run) == ["step-00000002", "step-00000004", "step-00000005"]


@pytest.mark.parametrize("damage", ["deleted rank file", "flipped byte in .metadata"])
def test_checkpoint_commands_verify_before_reading(run, tmp_path, capsys, monkeypatch, damage):
    for name in LAUNCHER_VARS:  # one plain process, as the user's would be
        monkeypatch.delenv(name, raising=False)
    step = run / "checkpoints" / "step-00000004"
    if damage == "deleted rank file":
        name, what = "__1_0.distcp", "__1_0.distcp is missing"
        (step / name).unlink()
    else:
        name, what = ".metadata", ".metadata fails its CRC-32 check (corrupted)"
        blob = bytearray((step / name).read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        (step / name).write_bytes(bytes(blob))
    commands = [
        ["inspect", str(run)],
        ["sample", "--checkpoint", str(run), "--tokens", "2"],
        ["convert", "checkpoint-to-hf", str(run), str(tmp_path / "hf")],
    ]
    for command in commands:
        capsys.readouterr()
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"flatshard: error: checkpoint {step}"), err
        assert f"is corrupt: {what}" in err, err


def test_resume_without_latest_marker_or_from_a_step_directory(run):
    checkpoints = run / "checkpoints"
    (checkpoints / "latest").unlink()
    resumed = check_ok(flatshard("train", "--resume", run, "--steps", 5))
    assert (
        "flatshard: warning: " in resumed.stderr
        and "no 'latest' marker; using the newest complete checkpoint step-00000004"
        in resumed.stderr
    ), resumed.stderr
    assert "resuming from step 4" in resumed.stdout
    # a step directory: the newest continues; an older one would write over the newer ones
    line = one_line_error(flatshard("train", "--resume", checkpoints / "step-00000002"))
    assert "newer than step 2 (4, 5)" in line, line
    resumed = check_ok(flatshard("train", "--resume", checkpoints / "step-00000005", "--steps", 6))
    assert "resuming from step 5" in resumed.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_sigterm_saves_and_exits_with_the_resumable_status(tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "flatshard", "train", *TINY, "--steps", 100000,
               "--out", run]  # fmt: skip
    proc = subprocess.Popen(
        list(map(str, command)), env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or not metrics(run):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what a scheduler sends at the end of a time slot
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err  # EXIT_STOPPED: resumable
    assert "interrupted by SIGTERM" in out and "exit status 75" in out
    last = metrics(run)[-1]["step"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{last:08d}"


def test_more_processes_than_cores_warn(tmp_path):
    core = min(os.sched_getaffinity(0))  # the command sees one core, whatever the machine
    result = subprocess.run(
        [sys.executable, "-m", "flatshard", "train", *map(str, TINY), "--steps", "1",
         "--out", str(tmp_path / "run"), "--set", "checkpoint.at_end=false"],
        env=cli_env(), capture_output=True, text=True, timeout=180,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )  # fmt: skip
    check_ok(result)
    warning = "flatshard: warning: 2 processes on this node share 1 CPU core(s) with 1 thread(s)"
    assert result.stderr.count(warning) == 1, result.stderr
    assert "start at most 1 (--nproc" in result.stderr


def test_resuming_a_finished_run_says_how_to_go_on(run):
    """A finished run resumed with the same steps trains nothing and names the flag; without
    TensorBoard installed a run says it writes no events (metrics.jsonl has them)."""
    result = check_ok(flatshard("train", "--resume", run))
    assert "nothing to train: the run is at step 4 of train.steps 4; raise it to go on " \
        "(--steps 8)" in result.stdout  # fmt: skip
    assert len(metrics(run)) == 4
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "TensorBoard is not installed: no events written" in result.stdout


def test_resuming_with_more_steps_says_how_the_rate_moves(run):
    """More steps on resume recompute the cosine schedule: the header says so, with the next
    step's rate under both schedules, and that step runs at the new one."""
    result = check_ok(flatshard("train", "--resume", run, "--steps", 8))
    line = next(line for line in result.stdout.splitlines() if "train.steps 4 -> 8" in line)
    now, before = re.fullmatch(
        r"train\.steps 4 -> 8: the learning-rate schedule is recomputed; step 5 runs at "
        r"(\S+) \(the run's schedule: (\S+)\)",
        line,
    ).groups()
    assert float(now) == pytest.approx(metrics(run)[4]["lr"], rel=1e-2)
    assert float(before) < float(now)  # the old schedule had decayed further
