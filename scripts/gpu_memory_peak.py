"""What is alive at a CUDA run's peak, by the code that allocated it (a lent GPU's check of
a peak-memory gap between flatshard and a peer, e.g. `benchmarks/hf_finetune.py`'s).

    python scripts/gpu_memory_peak.py [--out DIR] -- COMMAND ...

runs COMMAND with every Python process under it recording the CUDA allocator's history
(a `sitecustomize` on PYTHONPATH; flatshard's launcher leaves by `os._exit`, so the snapshot
is written there too), then replays each process's trace to its peak and prints what was
alive then, grouped by the first frame outside torch. Snapshots stay in DIR."""

from __future__ import annotations

import argparse
import glob
import os
import pickle
import subprocess
import sys
import tempfile
from collections import defaultdict

MAX_ENTRIES = 4_000_000  # the allocator's ring of events: the oldest go once it is full

_SITECUSTOMIZE = """
import atexit, os
_out = os.environ.get("MEMORY_PEAK_OUT")
if _out:
    import torch
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=MAX_ENTRIES)
        _done = []
        def _dump():
            if torch.cuda.is_initialized() and not _done:
                _done.append(1)
                path = os.path.join(_out, f"{os.getpid()}.pickle")
                torch.cuda.memory._dump_snapshot(path)
        _exit = os._exit
        def _exit_after_dump(code):
            _dump()
            _exit(code)
        os._exit = _exit_after_dump
        atexit.register(_dump)
"""


def _in_torch(frame: dict) -> bool:
    """A frame of torch's own code (by its place among the installed packages: a virtual
    environment's path may hold `/torch/` too)."""
    return frame["filename"].split("site-packages/")[-1].startswith("torch/")


def _owner(frames: list[dict]) -> str:
    """The first frame outside torch, with the torch call it made."""
    outside = [f for f in frames if not _in_torch(f) and "<" not in f["filename"]]
    inner = next((f for f in frames if _in_torch(f)), None)
    if not outside:
        return f"torch {inner['name'] if inner else '?'}"
    f = outside[0]
    path = "/".join(f["filename"].split("/")[-2:])
    return f"{path}:{f['line']} {f['name']}" + (f" -> {inner['name']}" if inner else "")


def peak_report(snapshot: dict, top: int = 25) -> list[str]:
    events = [e for trace in snapshot["device_traces"] for e in trace]
    total = peak = peak_at = 0
    for index, event in enumerate(events):  # first pass: where the peak is
        if event["action"] == "alloc":
            total += event["size"]
        elif event["action"] == "free_completed":
            total -= event["size"]
        if total > peak:
            peak, peak_at = total, index
    live: dict[int, dict] = {}
    for event in events[: peak_at + 1]:  # second pass: what is alive there
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        group = groups[_owner(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    lines = [f"peak {peak / 2**20:.0f} MiB at event {peak_at} of {len(events)} (replayed)"]
    if len(events) >= MAX_ENTRIES:
        lines[0] += (
            ": the trace is full, its oldest events dropped, so this may be wrong (fewer steps)"
        )
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / 2**20:9.1f} MiB  {count:5d}  {key}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    out = args.out or tempfile.mkdtemp(prefix="memory-peak-")
    os.makedirs(out, exist_ok=True)
    site = tempfile.mkdtemp(prefix="memory-site-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as handle:
        handle.write(_SITECUSTOMIZE.replace("MAX_ENTRIES", str(MAX_ENTRIES)))
    env = dict(os.environ, MEMORY_PEAK_OUT=out)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    code = subprocess.run(command, env=env).returncode
    for path in sorted(glob.glob(os.path.join(out, "*.pickle")), key=os.path.getmtime):
        with open(path, "rb") as handle:
            print(f"# {os.path.basename(path)}", *peak_report(pickle.load(handle)), sep="\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
