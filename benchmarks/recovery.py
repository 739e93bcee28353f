"""What surviving a failure costs `flatshard train`, in one run per setting.

    python benchmarks/recovery.py [--size 35m|120m|tiny] [--nproc 2] [--steps 16] [--out FILE]

Snapshot overhead: the median step time with a host-memory snapshot after every step
(`checkpoint.memory_interval=1`, written in the background) against none. Recovery: a
run with `--max-restarts 1` and snapshots every step has rank 1 SIGKILLed mid-run; the
recovery time is from the kill to the first step trained after the restart (the agent
noticing, every process started again, the model built and loaded, one step trained),
next to the same with disk checkpoints only (every 4 steps); the steps lost are trained
again after it. On this 2-core machine a process start (Python, torch, flatshard) is most
of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the reference Llama with the other benchmarks' 35m and 120m shapes (byte-level data: its
# vocabulary is 257, so fewer parameters than those presets: 23M and 76M)
SIZES = {
    "tiny": ["--model", "tiny"],
    "35m": ["--set", "model.dim=512", "--set", "model.n_layers=8", "--set", "model.n_heads=8",
            "--set", "model.n_kv_heads=4", "--set", "model.ffn_dim=1376"],
    "120m": ["--set", "model.dim=768", "--set", "model.n_layers=12", "--set", "model.n_heads=12",
             "--set", "model.n_kv_heads=4", "--set", "model.ffn_dim=2048"],
}  # fmt: skip


def _command(args, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flatshard", "train", *SIZES[args.size], "--steps",
            str(args.steps), "--nproc", str(args.nproc), "--seq-len", "256", "--micro-batch",
            "2", "--global-batch", str(2 * args.nproc), "--out", out, "--set",
            "run.sample_tokens=0", "--set", "run.restart_backoff=0", *extra]  # fmt: skip


def _metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _run(command: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run(command, check=True, env=env, capture_output=True, text=True)


def step_time(args, base: str, snapshots: bool) -> float:
    out = os.path.join(base, f"steps-{int(snapshots)}")
    extra = ["--set", "checkpoint.memory_interval=1"] if snapshots else []
    _run(_command(args, out, "--checkpoint-interval", "0", *extra))
    return statistics.median(r["step_s"] for r in _metrics(out)[2:])  # warm steps


def recovery_time(args, base: str, memory: bool) -> tuple[float, int]:
    """(seconds from the kill to the first step after the restart, steps lost)."""
    out = os.path.join(base, f"recover-{int(memory)}")
    extra = ["--set", "checkpoint.memory_interval=1"] if memory else []
    command = _command(args, out, "--max-restarts", "1", "--checkpoint-interval", "4", *extra)
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    log = os.path.join(out, "metrics.jsonl")
    record = os.path.join(out, "attempts", "0", "rank-1.json")
    while not (os.path.exists(record) and os.path.exists(log) and len(_metrics(out)) >= 6):
        time.sleep(0.01)
    with open(record) as handle:
        os.kill(json.load(handle)["pid"], signal.SIGKILL)
    killed = time.time()
    notes = os.path.join(out, "restarts.jsonl")
    while not os.path.exists(notes):
        time.sleep(0.005)
    with open(notes) as handle:
        note = json.loads(handle.readline())
    resumed, truncated = note["resumed_from"], False
    while True:  # the lost steps' records are dropped first, then the next one comes
        steps = [r["step"] for r in _metrics(out)]
        truncated = truncated or max(steps, default=0) <= resumed
        if truncated and resumed + 1 in steps:
            break
        time.sleep(0.005)
    recovered = time.time()
    proc.wait(timeout=600)
    return recovered - killed, note["lost_steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="35m")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="flatshard-recovery-")
    plain, snapshot = step_time(args, base, False), step_time(args, base, True)
    from_disk, lost_disk = recovery_time(args, base, memory=False)
    from_memory, lost_memory = recovery_time(args, base, memory=True)
    text = "\n".join([
        f"### recovery, {args.size}, {args.nproc} processes "
        f"({datetime.now(timezone.utc):%Y-%m-%d})",
        "",
        f"`python benchmarks/recovery.py --size {args.size} --nproc {args.nproc} --steps "
        f"{args.steps}`; {platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"cores, torch {torch.__version__}",
        "",
        "| what | figure |",
        "|---|---|",
        f"| step time, no snapshot | {plain:.3f} s |",
        f"| step time, a host-memory snapshot every step | {snapshot:.3f} s "
        f"({snapshot / plain - 1:+.1%}) |",
        f"| recovery, disk checkpoint every 4 steps | {from_disk:.1f} s, {lost_disk} step(s) "
        "lost |",
        f"| recovery, host-memory snapshot every step | {from_memory:.1f} s, {lost_memory} "
        "step(s) lost |",
    ]) + "\n"  # fmt: skip
    print(text)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
