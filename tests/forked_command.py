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
import subprocess
import sys
import tempfile

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


def _child(command: list[str], cwd: str, out_path: str, err_path: str) -> None:
    """In the forked process: a session of its own, output to the files, then the command
    and an exit without the interpreter's teardown (as `flatshard`'s own entry point)."""
    os.setsid()
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


def run_forked(command: list[str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `flatshard ARGS` (command[0] == "flatshard") or `python SCRIPT ARGS` forked from
    the server; the same result as subprocess.run(..., capture_output=True, text=True)."""
    with tempfile.TemporaryDirectory(prefix="flatshard-forked-") as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        args = (list(command), str(cwd), out_path, err_path)
        proc = preloaded_context().Process(target=_child, args=args)
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.join()
            raise subprocess.TimeoutExpired(command, timeout)
        try:  # ranks the command started and left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        with open(out_path) as out, open(err_path) as err:
            return subprocess.CompletedProcess(command, proc.exitcode, out.read(), err.read())
