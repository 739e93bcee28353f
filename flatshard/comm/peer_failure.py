"""When one rank fails, every rank says which one and why.

A rank that raises in a step (its model rejects an empty batch, an out-of-memory error, a
bug in a loss) leaves its peers waiting in a collective; on gloo they see only "Connection
closed by peer" once its process exits. So a process that dies of an exception records
it in the process group's store first (the first failure wins: later ones are its
consequences), and a peer whose flatshard collective then fails raises `PeerFailedError`
naming that rank and its exception. (On NCCL a peer waits on the device, not in Python: its
watchdog ends the job after its timeout.)
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch.distributed as dist

from flatshard.errors import PeerFailedError

_RECORD_WAIT_S = 2.0  # a peer's error can reach us a moment before its record does


def _key() -> str:
    # a torchrun restart reuses the store: a record of an earlier attempt is not this one's
    return f"flatshard/first_failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store():
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a torch without the default store, or one already torn down
        return None


def describe(error: BaseException, tb=None) -> str:
    """One line: the rank, the exception's type and first line, where it was raised."""
    lines = str(error).strip().splitlines() or [""]
    where = ""
    frames = traceback.extract_tb(tb if tb is not None else error.__traceback__)
    if frames:
        where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
    return f"rank {dist.get_rank()} failed: {type(error).__name__}: {lines[0]}{where}"


def record(error: BaseException, tb=None) -> None:
    """Put this rank's failure in the store unless a peer's came first."""
    store = _store()
    if store is None or isinstance(error, PeerFailedError):  # that one is a consequence
        return
    try:
        store.compare_set(_key(), "", describe(error, tb))
    except Exception:  # the store went with its host (the rank hosting it failed)
        pass


def first_failure(wait_s: float = 0.0) -> str | None:
    """The first failure a rank recorded, waiting up to `wait_s` for one to appear."""
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    try:
        while not store.check([_key()]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return store.get(_key()).decode()
    except Exception:
        return None


def raise_for(error: Exception, collective: str):
    """Called with the error of a flatshard collective: raise `PeerFailedError` if a peer
    recorded a failure, else the error itself."""
    failure = first_failure(wait_s=_RECORD_WAIT_S)
    if failure is None or failure.startswith(f"rank {dist.get_rank()} "):
        raise error
    raise PeerFailedError(
        f"{failure}; rank {dist.get_rank()} stopped in {collective} that rank had not joined. "
        "Fix that rank's error (its own traceback has the details)"
    ) from error


_previous_hook = None


def install() -> None:
    """Chain our hook before the interpreter's report of an uncaught exception (once)."""
    global _previous_hook
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(kind, error, tb) -> None:
    record(error, tb)
    _previous_hook(kind, error, tb)
