"""Processes: run a command's worker on every rank.

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) the worker runs in this
process with the launcher's rank and world size, on one node or many. Otherwise this
process starts `nproc` local workers itself and supervises them: it forwards Ctrl-C and
SIGTERM to them once (they save a checkpoint and exit), kills them on a second Ctrl-C or
when one of them fails, and prints each distinct user error once.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from flatshard.cli.errors import RunError, warn
from flatshard.comm import devices, peer_failure
from flatshard.errors import FlatShardError

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FAILURE_GRACE_S = 10.0  # after one worker fails, how long the others get to finish
# Exit statuses: 0 done, 1 a crash (traceback), EXIT_USER_ERROR a user error (one line),
# EXIT_STOPPED stopped by SIGINT/SIGTERM after saving a checkpoint (resume it; 75 is
# sysexits' EX_TEMPFAIL: "try again later"), EXIT_INTERRUPTED stopped without saving
# (a second Ctrl-C), 128 + N a worker killed by signal N.
EXIT_USER_ERROR, EXIT_STOPPED, EXIT_INTERRUPTED = 2, 75, 130


def under_launcher() -> bool:
    return all(name in os.environ for name in LAUNCHER_VARS)


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class _DimByDimNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_reduce operations" not in record.getMessage()


def _drop_dim_by_dim_note() -> None:
    """torch's DTensor logs, on every rank, a 5-line note each time it reduces a value
    partial over two mesh dims (the gradient norm under TP or EP): a scalar's cost, which
    would bury the run's own one-line messages."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _DimByDimNote) for f in logger.filters):
        logger.addFilter(_DimByDimNote())


def init_distributed(device_choice: str = "auto", threads: int = 0) -> Ranks:
    """Join the process group torchrun (or `run`) described in the environment: NCCL on
    CUDA, gloo on CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _drop_dim_by_dim_note()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RunError("run.device=cuda but no CUDA device is available; use run.device=cpu")
    if use_cuda:
        if local_world > torch.cuda.device_count():  # the same answer on every local rank
            raise RunError(
                f"{local_world} processes on this node but only {torch.cuda.device_count()} "
                "GPU(s) visible: two ranks would share a GPU. Start at most one process per "
                "GPU (torchrun --nproc-per-node) or set CUDA_VISIBLE_DEVICES"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cores = available_cores()
        per_rank = threads or max(1, cores // local_world)
        torch.set_num_threads(per_rank)
        if local_world * per_rank > cores:
            fix = (
                f"start at most {cores} (--nproc, or torchrun --nproc-per-node)"
                if local_world > cores
                else f"set run.threads to at most {max(1, cores // local_world)}"
            )
            warn(
                f"{local_world} processes on this node share {cores} CPU core(s) with "
                f"{per_rank} thread(s) per process: they compete for the cores and every "
                f"step is slower than it would be with fewer; {fix}",
                per_node=True,
            )
    if not dist.is_initialized():
        # on CUDA, gloo beside NCCL: the pieces optimizer offload keeps on the host (their
        # gradient norms, their full tensors for a checkpoint) are reduced where they are
        backend = "cuda:nccl,cpu:gloo" if use_cuda else "gloo"
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart != "0":
            # torchrun's store outlives an attempt: keys of the dead one (its ranks'
            # addresses) would be read again (pytorch#135712); each attempt its own prefix
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  world, is_master=False)  # fmt: skip
            store = dist.PrefixStore(f"flatshard/attempt-{restart}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, init_method="env://")
    return Ranks(rank, world, local_rank, local_world, device)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's
    limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run(worker: Callable, args: tuple, nproc: int, max_restarts: int = 0,
        failure: Callable[[int], str] | None = None, sizes: list[int] | None = None) -> int:
    """Run `worker(*args)` on every rank; returns the exit code for the command. With
    `max_restarts`, local ranks run under torch's elastic agent, which restarts them all
    after a failure (`failure(attempt)` says why an attempt failed), going on with the next
    of `sizes` processes once the restarts are spent."""
    if under_launcher():
        return _call(worker, args, error_dir=None)
    if max_restarts:
        from flatshard.cli.elastic import run_elastic

        return run_elastic(
            worker, args, sizes or [nproc], max_restarts, free_port=_free_port,
            start_method=_elastic_start_method(), call=_call, stopped=EXIT_STOPPED,
            failure=failure or (lambda attempt: "see the workers' output above"),
        )  # fmt: skip
    if nproc == 1:
        _set_launcher_env(0, 1, _free_port())
        return _call(worker, args, error_dir=None)
    return _supervise(worker, args, nproc)


def _elastic_start_method() -> str:
    """How the elastic agent starts ranks, each attempt: forked from a server that imported
    the trainer once (seconds saved a rank and a restart), not from the agent itself, whose
    rendezvous store runs threads (a fork of it can deadlock); spawned where there is no
    fork."""
    return "forkserver" if devices.process_start_method() == "fork" else "spawn"


def _set_launcher_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(worker: Callable, args: tuple, error_dir: str | None, leave_on_error=False) -> int:
    """Run the worker; user errors become one line (on rank 0, or in `error_dir` for the
    supervisor to print once), anything else a traceback. `leave_on_error`: after a failure
    exit without taking the process group down (a peer's death can hang that; an elastic
    agent restarts every rank anyway)."""
    rank = int(os.environ.get("RANK", 0))
    failed = False
    try:
        code = worker(*args)
        return code if isinstance(code, int) else 0
    except FlatShardError as error:
        failed = True
        message = str(error).strip()
        if error_dir is not None:
            with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as handle:
                handle.write(message)
        elif rank == 0:  # user errors are the same on every rank (flatshard agrees on them)
            print(f"flatshard: error: {message}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BaseException as error:
        failed = True
        peer_failure.record(error)  # a peer waiting for this rank then names it
        print(f"[rank {rank}] " + traceback.format_exc(), file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized() and not (failed and leave_on_error):
            dist.destroy_process_group()


# --- local supervisor ----------------------------------------------------------------------


def _supervise(worker: Callable, args: tuple, nproc: int) -> int:
    context = mp.get_context(devices.process_start_method())
    error_dir = tempfile.mkdtemp(prefix="flatshard-errors-")
    port = _free_port()
    procs = [
        context.Process(
            target=_child_main,
            args=(worker, args, rank, nproc, port, error_dir, os.getpid()),
            name=f"flatshard-rank{rank}",
        )
        for rank in range(nproc)
    ]
    signals = None
    try:
        for proc in procs:
            proc.start()
        signals = _Forwarder(procs)  # after the starts: forked workers must not inherit it
        code = _wait_all(procs, signals)
    finally:
        if signals is not None:
            signals.restore()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        _print_errors(error_dir)
        shutil.rmtree(error_dir, ignore_errors=True)
    return code


def _wait_all(procs: list, signals: _Forwarder) -> int:
    codes: dict[int, int] = {}
    deadline = None
    while len(codes) < len(procs):
        if signals.killed:
            return EXIT_INTERRUPTED
        timeout = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        wait([p.sentinel for i, p in enumerate(procs) if i not in codes], timeout=timeout)
        for i, proc in enumerate(procs):
            if i not in codes and proc.exitcode is not None:
                codes[i] = proc.exitcode
                if proc.exitcode not in (0, EXIT_STOPPED) and deadline is None:
                    deadline = time.monotonic() + FAILURE_GRACE_S
        if deadline is not None and time.monotonic() >= deadline:
            break  # the others are stuck waiting for the failed rank: the finally kills them
    failed = [code for code in codes.values() if code not in (0, EXIT_STOPPED)]
    if not failed and len(codes) < len(procs):
        return 1
    if failed:
        return _exit_code(failed[0])
    return EXIT_STOPPED if EXIT_STOPPED in codes.values() else 0


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N -> 128 + N


def _print_errors(error_dir: str) -> None:
    seen = []
    for name in sorted(os.listdir(error_dir)):
        with open(os.path.join(error_dir, name)) as handle:
            message = handle.read()
        if message not in seen:
            seen.append(message)
            print(f"flatshard: error: {message}", file=sys.stderr, flush=True)


class _Forwarder:
    """Ctrl-C / SIGTERM to this process: forward once (workers save and stop); a second
    Ctrl-C kills them."""

    def __init__(self, procs: list):
        self.procs, self.killed, self.forwarded = procs, False, False
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def _handle(self, signum, frame) -> None:
        if self.forwarded and signum == signal.SIGINT:
            print("\nflatshard: interrupted again; stopping without saving", file=sys.stderr)
            self.killed = True
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
            return
        if not self.forwarded:
            print(
                "\nflatshard: stopping after this step (saving a checkpoint); press Ctrl-C "
                "again to stop without saving",
                file=sys.stderr,
                flush=True,
            )
        self.forwarded = True
        for proc in self.procs:
            if proc.is_alive() and proc.pid:
                os.kill(proc.pid, signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _child_main(worker, args, rank, world, port, error_dir, parent_pid) -> None:
    os.setpgrp()  # Ctrl-C reaches the supervisor only; it forwards the signal exactly once
    _die_with_parent(parent_pid)
    _set_launcher_env(rank, world, port)
    code = _call(worker, args, error_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written; skip the interpreter's slow teardown


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this worker if the supervisor dies, so no orphan is left waiting."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)
