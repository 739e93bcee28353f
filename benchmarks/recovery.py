"""What surviving a failure costs `flatshard train`, in one run per setting.

    python benchmarks/recovery.py [--size 35m|120m|tiny] [--nproc 2] [--steps 16] [--hosts 1]
                                  [--out FILE]

Snapshot overhead: the median step time with a host-memory snapshot after every step
(`checkpoint.memory_interval=1`, written in the background) against none. Recovery: a
run with `--max-restarts 1` and snapshots every step has rank 1 SIGKILLed mid-run; the
recovery time is from the kill to the first step trained after the restart (the agent
noticing, every process started again, the model built and loaded, one step trained),
next to the same with disk checkpoints only (every 4 steps); the steps lost are trained
again after it. On this 2-core machine a process start (Python, torch, flatshard) is most
of it.

`--hosts 2`: the processes run as two torchrun agents standing for two hosts, each with
its own host memory (FLATSHARD_HOST_MEMORY), so a snapshot also sends each rank's files to
the other host (the ring); the recovery from memory then loses rank 1's host with its
memory, and its part of the snapshot comes from the other host's copy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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


def _start(args, command: list[str], out: str) -> list[subprocess.Popen]:
    """The run: one process tree, or one torchrun agent per host (each its own memory)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    if args.hosts == 1:
        return [subprocess.Popen(command, env=env, **quiet)]
    restarts = command.index("--max-restarts") if "--max-restarts" in command else None
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.hosts),
             "--nproc-per-node", str(args.nproc // args.hosts), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "recovery",
             "--max-restarts", command[restarts + 1] if restarts else "0"]  # fmt: skip
    train = [a for i, a in enumerate(command[3:], 3)
             if restarts is None or i not in (restarts, restarts + 1)]  # fmt: skip
    train = [a for i, a in enumerate(train) if "--nproc" not in train[max(0, i - 1) : i + 1]]
    return [
        subprocess.Popen(
            agent + ["-m", "flatshard", *train],
            env={**env, "FLATSHARD_HOST_MEMORY": os.path.join(out + "-hosts", str(h))},
            **quiet,
        )  # fmt: skip
        for h in range(args.hosts)
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def step_time(args, base: str, snapshots: bool) -> float:
    out = os.path.join(base, f"steps-{int(snapshots)}")
    extra = ["--set", "checkpoint.memory_interval=1"] if snapshots else []
    for proc in _start(args, _command(args, out, "--checkpoint-interval", "0", *extra), out):
        if proc.wait() != 0:
            raise SystemExit(f"the run in {out} failed")
    return statistics.median(r["step_s"] for r in _metrics(out)[2:])  # warm steps


def recovery_time(args, base: str, memory: bool) -> tuple[float, int]:
    """(seconds from the kill to the first step after the restart, steps lost)."""
    out = os.path.join(base, f"recover-{int(memory)}")
    extra = ["--set", "checkpoint.memory_interval=1"] if memory else []
    command = _command(args, out, "--max-restarts", "1", "--checkpoint-interval", "4", *extra)
    procs = _start(args, command, out)
    log = os.path.join(out, "metrics.jsonl")
    record = os.path.join(out, "attempts", "0", "rank-1.json")
    while not (os.path.exists(record) and os.path.exists(log) and len(_metrics(out)) >= 6):
        time.sleep(0.01)
    with open(record) as handle:
        pid = json.load(handle)["pid"]
    with open(f"/proc/{pid}/environ", "rb") as handle:
        environ = dict(v.split("=", 1) for v in handle.read().decode().split("\0") if "=" in v)
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    if memory and args.hosts > 1:  # rank 1's host is lost, its memory with it
        shutil.rmtree(environ["FLATSHARD_HOST_MEMORY"], ignore_errors=True)
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
    for proc in procs:
        proc.wait(timeout=600)
    return recovered - killed, note["lost_steps"], note["source"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="35m")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hosts", type=int, default=1, help="torchrun agents standing for hosts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="flatshard-recovery-")
    plain, snapshot = step_time(args, base, False), step_time(args, base, True)
    from_disk, lost_disk, _ = recovery_time(args, base, memory=False)
    from_memory, lost_memory, source = recovery_time(args, base, memory=True)
    hosts = f", {args.hosts} hosts" if args.hosts > 1 else ""
    lost_host = ", rank 1's host lost with its memory" if args.hosts > 1 else ""
    text = "\n".join([
        f"### recovery, {args.size}, {args.nproc} processes{hosts} "
        f"({datetime.now(timezone.utc):%Y-%m-%d})",
        "",
        f"`python benchmarks/recovery.py --size {args.size} --nproc {args.nproc} --steps "
        f"{args.steps}{f' --hosts {args.hosts}' if hosts else ''}`; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"cores, torch {torch.__version__}",
        "",
        "| what | figure |",
        "|---|---|",
        f"| step time, no snapshot | {plain:.3f} s |",
        f"| step time, a host-memory snapshot every step | {snapshot:.3f} s "
        f"({snapshot / plain - 1:+.1%}) |",
        f"| recovery, disk checkpoint every 4 steps | {from_disk:.1f} s, {lost_disk} step(s) "
        "lost |",
        f"| recovery, host-memory snapshot every step{lost_host} | {from_memory:.1f} s, "
        f"{lost_memory} step(s) lost (from {source}) |",
    ]) + "\n"  # fmt: skip
    print(text)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
