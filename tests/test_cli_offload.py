"""`flatshard train --offload F` / `--offload-dir DIR` end to end: the same steps as without
offload, a resume that changes where the optimizer lives, the planner's device/host split
against a measured run, and the disk tier's memory drop."""

from __future__ import annotations

import json

import pytest
from test_cli_helpers import TINY, check_ok, cli_env, flatshard, metrics, one_line_error

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

NO_SAVE = ["--set", "checkpoint.interval=0", "--set", "checkpoint.at_end=false"]


def test_offloaded_run_takes_the_plain_steps_and_resumes_on_the_disk_tier(tmp_path):
    """All offloaded: bitwise the plain run's losses, also after resuming with the state in
    the disk tier; half offloaded (a bucket per parameter) too. The embedding is looked up
    from its shards (on the host when offloaded) as in the plain run."""
    plain, offloaded, half = tmp_path / "plain", tmp_path / "offloaded", tmp_path / "half"
    check_ok(flatshard("train", *TINY, "--steps", 4, "--out", plain, *NO_SAVE))
    result = check_ok(
        flatshard("train", *TINY, "--steps", 4, "--out", offloaded, "--offload", 1,
                  "--set", "run.stop_at_step=2")
    )  # fmt: skip
    assert "ZeRO-3, fp32, 100% of the optimizer on the host" in result.stdout
    tier = tmp_path / "tier"
    check_ok(flatshard("train", "--resume", offloaded, "--offload-dir", tier))
    check_ok(flatshard("train", *TINY, "--steps", 4, "--out", half, "--offload", 0.5, *NO_SAVE))
    expected = [r["loss"] for r in metrics(plain)]
    assert [r["loss"] for r in metrics(offloaded)] == expected  # the same optimizer math
    assert [r["loss"] for r in metrics(half)] == expected
    records = metrics(offloaded)
    assert records[0]["offload_host_bytes"] > 0 and records[0]["offload_disk_bytes"] == 0
    assert records[-1]["offload_disk_bytes"] > 0  # the resumed steps paged their state
    assert list(tier.iterdir()) == []  # no state file outlives its run


def test_plan_splits_memory_as_a_measured_run(tmp_path):
    """`flatshard plan` of the run's config: its host bytes within 10% of the bytes the run
    kept off the device, its peak within 10% of the measured resident peak."""
    sizes = ["--set", "model.preset=medium", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=1", "--set", "train.global_batch=2",
             "--set", "train.offload=0.5"]  # fmt: skip
    run = tmp_path / "run"
    check_ok(
        flatshard("train", *sizes, "--steps", 2, "--out", run, "--set", "run.sample_tokens=0",
                  *NO_SAVE, exact_memory=True)
    )  # fmt: skip
    measured = metrics(run)[-1]
    plan = json.loads(check_ok(flatshard("plan", *sizes, "--json")).stdout)["memory"]
    assert abs(plan["offloaded_share"] - 0.5) <= 0.005
    host = measured["offload_host_bytes"]
    assert abs(host - plan["host"]) <= 0.10 * plan["host"], (host, plan["host"])
    peak = measured["peak_mem_bytes"]
    assert abs(peak - plan["total"]) <= 0.10 * plan["total"], (peak, plan["total"])


def test_disk_tier_takes_the_optimizer_state_out_of_memory(tmp_path):
    """Peak resident memory drops by at least 80% of the optimizer state moved to the disk
    tier (everything offloaded: AdamW's two states of every shard)."""
    sizes = ["--set", "model.preset=medium", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=1", "--set", "train.global_batch=2",
             "--set", "run.sample_tokens=0", *NO_SAVE]  # fmt: skip
    plain, paged = tmp_path / "plain", tmp_path / "paged"
    check_ok(flatshard("train", *sizes, "--steps", 2, "--out", plain, exact_memory=True))
    check_ok(
        flatshard("train", *sizes, "--steps", 2, "--out", paged, "--offload-dir",
                  tmp_path / "tier", exact_memory=True)
    )  # fmt: skip
    state = metrics(paged)[-1]["offload_disk_bytes"]
    drop = metrics(plain)[-1]["peak_rss_bytes"] - metrics(paged)[-1]["peak_rss_bytes"]
    assert state > 0 and drop >= 0.8 * state, (drop, state)


def test_offload_outside_zero_one_is_a_one_line_error(tmp_path):
    message = one_line_error(flatshard("train", *TINY, "--offload", 1.5, "--out", tmp_path))
    assert "train.offload" in message and "[0, 1]" in message


# Loaded by every Python process of the run (a directory of it on PYTHONPATH): the disk is
# full for optimizer state files, as a disk that fills up between checkpoints would be.
FULL_DISK = """
import errno, os
_reserve = os.posix_fallocate
def _full(fd, offset, length):
    if "flatshard-state-" in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _reserve(fd, offset, length)
os.posix_fallocate = _full
"""


def test_full_disk_tier_is_a_one_line_error_and_the_checkpoint_stays(tmp_path):
    run = tmp_path / "run"
    check_ok(flatshard("train", *TINY, "--steps", 4, "--out", run, "--set", "run.stop_at_step=2"))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_DISK)
    env = cli_env()
    env["PYTHONPATH"] = f"{hook}:{env['PYTHONPATH']}"
    result = flatshard("train", "--resume", run, "--offload-dir", tmp_path / "tier", env=env)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("flatshard: error")]
    assert len(errors) == 1 and "is full" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    check_ok(flatshard("train", "--resume", run))  # and it resumes from there
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
