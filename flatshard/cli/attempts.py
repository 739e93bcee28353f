"""What each attempt of a restarted run did, per rank, in the run directory: a rank writes
`attempts/<n>/rank-<r>.json` when it starts (status "running") and again when it ends
(its exit status and error). A rank killed outright (SIGKILL, out of memory, a segfault)
never writes the second: after a restart, rank 0 reads the failed attempt's files to say
what failed, and the metrics to say which steps were lost, in one line and in
`restarts.jsonl`."""

from __future__ import annotations

import json
import os
import socket
import time

ATTEMPTS, RESTARTS = "attempts", "restarts.jsonl"
RUNNING = "running"


def _path(run_dir: str, attempt: int, rank: int) -> str:
    return os.path.join(run_dir, ATTEMPTS, str(attempt), f"rank-{rank}.json")


def _write(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + ".partial"
    with open(partial, "w") as handle:
        json.dump(record, handle)
    os.replace(partial, path)


def begin(run_dir: str, attempt: int, rank: int) -> None:
    _write(_path(run_dir, attempt, rank), {
        "status": RUNNING, "pid": os.getpid(), "host": socket.gethostname(), "start": time.time(),
    })  # fmt: skip


def end(run_dir: str, attempt: int, rank: int, status: int, error: str = "") -> None:
    path = _path(run_dir, attempt, rank)
    record = {}
    if os.path.exists(path):
        with open(path) as handle:
            record = json.load(handle)
    record.update(status=status, error=error, end=time.time())
    _write(path, record)


def cause(run_dir: str, attempt: int) -> str:
    """Why `attempt` failed, from its ranks' records: a rank that never recorded its end
    was killed; otherwise the first error that is not a peer's report of another rank."""
    folder = os.path.join(run_dir, ATTEMPTS, str(attempt))
    records = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.startswith("rank-") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as handle:
                records[int(name[5:-5])] = json.load(handle)
    killed = sorted(rank for rank, r in records.items() if r["status"] == RUNNING)
    if killed:
        ranks = ", ".join(map(str, killed))
        return (f"rank {ranks} died without an error (killed by a signal, out of memory, or "
                "a crash in native code)")  # fmt: skip
    errors = [(rank, r["error"]) for rank, r in sorted(records.items()) if r.get("error")]
    first = [e for e in errors if not e[1].startswith("PeerFailedError")] or errors
    if first:
        rank, error = first[0]
        return f"rank {rank} failed: {error}"
    return "a rank exited with an error it did not record"


def note_restart(run_dir: str, attempt: int, resumed_from: int | None, last_logged: int,
                 world: int, source: str = "disk") -> str:  # fmt: skip
    """The line that says a restart happened, what failed and what was lost; also kept in
    restarts.jsonl."""
    why = cause(run_dir, attempt - 1)
    start = resumed_from or 0
    lost = max(0, last_logged - start)
    where = (f"from step {start} ({source})" if resumed_from is not None
             else "from the start (no checkpoint)")  # fmt: skip
    lost_text = f"steps {start + 1}-{last_logged} lost" if lost else "no step lost"
    line = (f"restart {attempt}: attempt {attempt - 1} failed: {why}; resuming {where} on "
            f"{world} process(es), {lost_text}")  # fmt: skip
    with open(os.path.join(run_dir, RESTARTS), "a") as handle:
        handle.write(json.dumps({"restart": attempt, "cause": why, "resumed_from": start,
                                 "lost_steps": lost, "processes": world, "source": source,
                                 "time": time.time()}) + "\n")  # fmt: skip
    return line
