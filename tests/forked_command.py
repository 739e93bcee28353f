"""Helpers (no tests): run a `flatshard` command or a script in a process forked from a
server that has already imported torch, flatshard and transformers, instead of a fresh
interpreter that imports them again (about two seconds a command, most of the CLI tests'
time). The child is a new process all the same: its own working directory, its own output
files, its own process group (a timeout kills the ranks it started too), its own exit code.

The server is multiprocessing's forkserver with those modules preloaded; it never runs a
tensor operation itself, so the children fork from a process whose thread pools were never
started (as `flatshard train` forks its local ranks). tests/distributed.py starts its gloo
workers from it too."""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time

_PRELOAD = ["torch", "flatshard", "flatshard.cli.main", "flatshard.cli.train", "transformers"]
_context = None


def preloaded_context():
    """multiprocessing's forkserver context, its server having imported _PRELOAD: a Process
    of it starts by a fork of that server (milliseconds) instead of a fresh interpreter."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


EXACT_MEMORY_MMAP_THRESHOLD = 65536


def _child(command: list[str], cwd: str, out_path: str, err_path: str, env: dict,
           exact_memory: bool) -> None:  # fmt: skip
    """In the forked process: a session of its own, `env` set, output to the files, then the
    command and an exit without the interpreter's teardown (as `flatshard`'s own entry
    point). `exact_memory`: glibc's mmap threshold set as MALLOC_MMAP_THRESHOLD_=65536 sets
    it at a process's start, so freed buffers leave the resident set at once (a measured
    peak is the live one)."""
    os.setsid()
    os.environ.update(env)
    if exact_memory:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, EXACT_MEMORY_MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    code = 1
    try:
        if command[0] == "flatshard":
            from flatshard.cli.main import main

            sys.argv = ["flatshard", *command[1:]]
            code = main(command[1:])
        else:  # a script: python SCRIPT ARGS
            sys.argv = list(command)
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
            runpy.run_path(command[0], run_name="__main__")
            code = 0
    except SystemExit as stop:  # argparse's --help and usage errors, a script's sys.exit
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_forked(command: list[str], cwd: str, timeout: float, exact_memory: bool = False):
    """Run `flatshard ARGS` (command[0] == "flatshard") or `python SCRIPT ARGS` forked from
    the server; the same result as subprocess.run(..., capture_output=True, text=True)."""
    return _run_children(command, cwd, timeout, [{}], exact_memory)


def torchrun_forked(script: str, nproc: int, args: list, cwd, timeout: float,
                    exact_memory: bool = False):  # fmt: skip
    """`torchrun --standalone --nproc-per-node NPROC SCRIPT ARGS` with each rank forked from
    the server, the launcher's variables set (RANK, WORLD_SIZE, MASTER_PORT, ...); stdout
    and stderr are the ranks' in rank order, the exit code the first failing rank's."""
    port = free_port()
    ranks = [
        dict(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nproc),
             LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
             OMP_NUM_THREADS="1")
        for rank in range(nproc)
    ]  # fmt: skip
    return _run_children([script, *map(str, args)], cwd, timeout, ranks, exact_memory)


def _run_children(command: list[str], cwd, timeout: float, envs: list[dict], exact_memory):
    with tempfile.TemporaryDirectory(prefix="flatshard-forked-") as tmp:
        outputs, procs = [], []
        for index, env in enumerate(envs):
            out_path, err_path = os.path.join(tmp, f"out{index}"), os.path.join(tmp, f"err{index}")
            args = (list(command), str(cwd), out_path, err_path, env, exact_memory)
            procs.append(preloaded_context().Process(target=_child, args=args))
            procs[-1].start()
            outputs.append((out_path, err_path))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        late = any(proc.exitcode is None for proc in procs)
        for proc in procs:  # the hung ones, and ranks a command started and left behind
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.join()
        if late:
            raise subprocess.TimeoutExpired(command, timeout)
        code = next((proc.exitcode for proc in procs if proc.exitcode), 0)
        out, err = ("".join(open(paths[i]).read() for paths in outputs) for i in (0, 1))
        return subprocess.CompletedProcess(command, code, out, err)


def free_port() -> int:
    """A TCP port free on this host now (a rendezvous's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
