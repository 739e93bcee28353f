"""Run a test function on W gloo ranks (CPU processes) and collect each rank's return value.

Starting a process costs seconds where it imports torch again, so workers fork from a server
that has imported it (tests/forked_command.py), and they are pooled: one pool per world size,
created on first use, initialised once with a gloo process group and reused by every later
test. Any failure (an exception, a hang, a dead worker) discards the pool, so a broken process
group is never reused; the next call starts a fresh one.

    from distributed import run_distributed, world_sizes

    def _sum_ranks():                      # module level: sent to workers by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    @world_sizes
    def test_sum(world_size):
        assert run_distributed(_sum_ranks, world_size) == [sum(range(world_size))] * world_size
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait

import pytest
from forked_command import free_port, preloaded_context

__all__ = [
    "DistributedError",
    "DistributedTimeout",
    "run_distributed",
    "shutdown_pools",
    "spawn_fresh",
    "world_sizes",
]

world_sizes = pytest.mark.parametrize("world_size", [1, 2, 3, 4])

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

GRACE_S = 3.0  # after one rank fails, how long the others get to report before being killed
STARTUP_TIMEOUT_S = 180.0  # spawning + importing torch + init_process_group, all ranks
STACK_DUMP_WAIT_S = 0.5  # time given to faulthandler to write stacks after SIGUSR1

_pools: dict[int, _Pool] = {}
_lock = threading.Lock()  # one task at a time: pools are not safe to share between threads


class DistributedError(RuntimeError):
    """A rank raised, died, or a worker could not start. The message has every rank's report."""


class DistributedTimeout(DistributedError):
    """The call ran past its timeout. The message has every rank's Python stack."""


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


MAX_WORKER_THREADS = 40  # ~11 process groups' gloo threads: then a fresh pool (_crowded)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """Run fn(*args, **kwargs) on every rank of a gloo group of `world_size` processes; return
    the results in rank order.

    `fn` must be a module-level function (it is pickled by reference); args and results are
    pickled (copied). `timeout` covers the run of fn, not the start of a new pool. Raises
    DistributedError (DistributedTimeout for a hang) with every rank's traceback or stack.
    """
    # Pickle first: an unpicklable fn (lambda, closure) fails here, before any worker is touched.
    task = pickle.dumps((fn, args, kwargs))
    with _lock:
        pool = _pools.get(world_size)
        if pool is None or not pool.healthy():
            if pool is not None:
                pool.kill()
            pool = _pools[world_size] = _Pool.start(world_size)
        try:
            return pool.run(task, _describe(fn), timeout)
        except BaseException:
            # Whatever went wrong (even Ctrl-C), the group may be mid-collective: never reuse it.
            _pools.pop(world_size, None)
            pool.kill()
            raise


def spawn_fresh(fn, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """Like run_distributed, but in brand-new processes that are shut down afterwards."""
    task = pickle.dumps((fn, args, kwargs))
    with _lock:
        pool = _Pool.start(world_size)
        try:
            return pool.run(task, _describe(fn), timeout)
        finally:
            pool.kill()


def shutdown_pools() -> None:
    """Stop every pooled worker (called at the end of the pytest session and at exit)."""
    with _lock:
        while _pools:
            _, pool = _pools.popitem()
            pool.kill()


atexit.register(shutdown_pools)


def _describe(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class _Pool:
    """`world_size` worker processes sharing one gloo process group."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.procs: list = []
        self.conns: list = []
        self.stack_dir = tempfile.mkdtemp(prefix=f"flatshard-w{world_size}-")

    @classmethod
    def start(cls, world_size: int) -> _Pool:
        # A second try covers the rare case where the chosen port got taken before rank 0 bound it.
        for attempt in range(2):
            pool = cls(world_size)
            try:
                pool._spawn()
                return pool
            except DistributedError:
                pool.kill()
                if attempt == 1:
                    raise
            except BaseException:
                pool.kill()
                raise
        raise AssertionError("unreachable")

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self.stack_dir, f"rank{rank}.txt")

    def _spawn(self) -> None:
        port = free_port()
        for rank in range(self.world_size):
            context = preloaded_context()
            parent_conn, child_conn = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, child_conn, self._stack_file(rank), os.getpid()),
                name=f"flatshard-w{self.world_size}-rank{rank}",
                daemon=True,  # multiprocessing also kills them at exit, should atexit not run
            )
            proc.start()
            child_conn.close()  # so the parent sees EOF if the child dies
            self.procs.append(proc)
            self.conns.append(parent_conn)
        # Each worker says "ready" once init_process_group has returned on it.
        replies = self._collect(STARTUP_TIMEOUT_S)
        if any(r is None or r[0] != "ready" for r in replies):
            raise self._failure(
                f"starting {self.world_size} gloo workers failed", replies, DistributedError
            )

    def healthy(self) -> bool:
        return all(p.is_alive() for p in self.procs) and not self._crowded()

    def _crowded(self) -> bool:
        """Whether a worker holds more than MAX_WORKER_THREADS threads (Linux; elsewhere
        never): every process group a task makes (each mesh dim, new_group) keeps gloo
        threads, one polling every 10 ms, for the worker's life (a world-4 worker's 30 groups
        take a third of a core while idle; left to grow, one held 287 groups and used ~400 s
        of CPU over a CI run). A fresh pool costs a fork and a gloo handshake, so a crowded
        one is replaced. (Destroying a task's groups instead leaves DTensor's sharding caches
        handing later tasks meshes of dead groups.)"""
        for proc in self.procs:
            try:
                threads = len(os.listdir(f"/proc/{proc.pid}/task"))
            except OSError:
                return False
            if threads > MAX_WORKER_THREADS:
                return True
        return False

    def run(self, task: bytes, name: str, timeout: float) -> list:
        """Run one pickled (fn, args, kwargs) on every rank; raise on any failure."""
        for conn in self.conns:
            conn.send_bytes(task)
        replies = self._collect(timeout)
        if all(r is not None and r[0] == "ok" for r in replies):
            return [r[1] for r in replies]
        if all(r is None or r[0] == "ok" for r in replies):
            what = f"timed out after {timeout:g} s"
            kind = DistributedTimeout
        else:
            bad = [rank for rank, r in enumerate(replies) if r is not None and r[0] != "ok"]
            what = f"failed on rank {', '.join(map(str, bad))}"
            kind = DistributedError
        raise self._failure(f"{name} on world_size={self.world_size} {what}", replies, kind)

    def _collect(self, timeout: float) -> list:
        """One reply per rank: ("ok"|"ready", value), ("error", traceback), ("died", exitcode),
        or None for a rank still busy when the deadline (or the grace after a failure) ran out."""
        replies: list = [None] * self.world_size
        deadline = time.monotonic() + timeout
        while any(r is None for r in replies):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            busy = [rank for rank, r in enumerate(replies) if r is None]
            # Wait on pipes and on process sentinels: a dead worker is noticed at once.
            ready = wait(
                [self.conns[i] for i in busy] + [self.procs[i].sentinel for i in busy],
                timeout=remaining,
            )
            for rank in busy:
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready or proc.sentinel in ready:
                    replies[rank] = self._read(conn, proc)
            if any(r is not None and r[0] in ("error", "died") for r in replies):
                # Others may be stuck in a collective with the failed rank: short grace only.
                deadline = min(deadline, time.monotonic() + GRACE_S)
        return replies

    @staticmethod
    def _read(conn, proc):
        # Read before looking at the exit code: a reply may be in the pipe of a dead process.
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        proc.join(timeout=1.0)  # reap it, so exitcode is set
        return ("died", proc.exitcode)

    def _failure(self, headline: str, replies: list, kind: type) -> DistributedError:
        """Build the error: one section per rank, with the Python stack of every rank that
        never answered (asked for through faulthandler, which works even inside a C call)."""
        alive = [p.is_alive() for p in self.procs]
        stuck = [rank for rank, r in enumerate(replies) if r is None and alive[rank]]
        for rank in stuck:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if stuck:
            time.sleep(STACK_DUMP_WAIT_S)
        sections = []
        for rank, reply in enumerate(replies):
            pid = self.procs[rank].pid
            if reply is None:
                status = "no reply (still running); its Python stack:"
                body = self._read_stack(rank) if rank in stuck else "(process not running)"
            elif reply[0] in ("ok", "ready"):
                status, body = "finished normally", ""
            elif reply[0] == "error":
                status, body = "raised:", reply[1]
            else:
                code = reply[1]
                signame = f" ({signal.Signals(-code).name})" if code and code < 0 else ""
                status, body = f"died with exit code {code}{signame}", ""
            sections.append(f"----- rank {rank} (pid {pid}) {status}\n{body}".rstrip())
        return kind(headline + "\n" + "\n".join(sections))

    def _read_stack(self, rank: int) -> str:
        try:
            with open(self._stack_file(rank)) as f:
                return f.read().strip() or "(no stack written)"
        except OSError as e:
            return f"(could not read stack: {e})"

    def kill(self) -> None:
        # SIGKILL, even at a normal shutdown: workers hold nothing worth a clean exit, and
        # destroy_process_group + interpreter exit would cost ~0.5 s per pool.
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.stack_dir, ignore_errors=True)
        self.procs, self.conns = [], []


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this worker if its parent, the fork server, dies: it does when
    pytest dies (e.g. killed while a task hangs)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: workers still exit on EOF once the parent is gone
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:  # pytest died before prctl took effect
        os._exit(1)


def _worker_main(rank, world_size, port, conn, stack_file, parent_pid) -> None:
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group: let the parent handle it and kill the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The usual launcher variables, which code under test may read (torch is loaded already,
    # in the fork server: its threads are set below).
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Test modules are imported by name when a task is unpickled; tests/ is not a package.
    for path in (REPO_ROOT, TESTS_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)

    import faulthandler

    # On SIGUSR1 from the parent, write every thread's Python stack to this rank's file.
    # (The file stays open for the life of the process.)
    stack_out = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # 2 cores shared by up to 4 (or 8) ranks
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    except BaseException:
        _reply(conn, ("error", traceback.format_exc()))
        return
    _reply(conn, ("ready", os.getpid()))

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone (pools are stopped with SIGKILL, never by message)
        try:
            fn, args, kwargs = pickle.loads(message)
            # Every task starts from the same global state, whatever the previous one left.
            torch.manual_seed(0)
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
            torch.set_num_threads(1)
            outcome = ("ok", fn(*args, **kwargs))
        except BaseException:
            outcome = ("error", traceback.format_exc())
        _reply(conn, outcome)


def _reply(conn, outcome) -> None:
    try:
        data = pickle.dumps(outcome)
    except BaseException:  # e.g. an unpicklable return value: report it instead of hanging
        error = "the result could not be pickled:\n" + traceback.format_exc()
        data = pickle.dumps(("error", error))
    conn.send_bytes(data)
