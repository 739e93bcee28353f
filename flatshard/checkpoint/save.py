"""`save`: model, optimizer, step, per-rank RNG and any extra state, written with DCP into a
directory that is committed atomically; optionally asynchronous."""

from __future__ import annotations

import os
import shutil
import threading
import time

import torch
import torch.distributed.checkpoint as dcp

from flatshard import comm
from flatshard.checkpoint import commit, manifest
from flatshard.checkpoint.state import (
    app_state,
    barrier,
    checkpoint_group,
    gather_to_rank0,
    rank_and_world,
    rng_state,
    stage,
)
from flatshard.errors import CheckpointError


class SaveHandle:
    """Returned by `save`. `wait()` returns the committed directory (re-raising any error of
    an asynchronous write); `blocking_seconds` is how long `save` held up the caller."""

    def __init__(self, blocking_seconds: float, thread: threading.Thread | None, result: dict):
        self.blocking_seconds = blocking_seconds
        self._thread = thread
        self._result = result

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        if self._thread is not None:
            self._thread.join()
        if "error" in self._result:
            raise self._result["error"]
        return self._result["path"]


_in_flight: SaveHandle | None = None
_staged = None  # host copy of the last async save, refilled by the next one


def save(
    directory: str,
    *,
    model,
    step: int,
    optimizer=None,
    async_save: bool = False,
    keep_last: int | None = None,
    **extra,
) -> SaveHandle:
    """Save a checkpoint of `step` under `directory` (call on every rank).

    extra: more state to keep, by name: `Stateful` objects (their state_dict() is saved and
        load_state_dict() restores them) or plain values (a data position, a config...).
    async_save: copy the state now and write it in the background; training may go on.
    keep_last: after committing, delete all but the newest `keep_last` checkpoints.
    """
    wait_for_pending_save()
    group = checkpoint_group()
    rank, world = rank_and_world(group)
    comm.agree(
        f"step {step} is already saved in {directory}; pick a new step or delete it"
        if commit.exists(directory, step)
        else None,
        group,
        CheckpointError,
    )
    partial = commit.partial_dir(directory, step)
    if rank == 0:
        if os.path.exists(partial):
            shutil.rmtree(partial)  # left by an interrupted save of this step
        os.makedirs(os.path.join(partial, "rng"))
    barrier(group)

    started = time.perf_counter()
    state = app_state(model, optimizer, extra)
    copied = None
    if async_save:
        global _staged
        state = _staged = stage(state, _staged)
        copied = comm.host_copies_done()
    enter_device = comm.thread_device_setter()
    torch.save(rng_state(), os.path.join(partial, "rng", f"rank{rank}.pt"))
    config = manifest.model_config(model)

    def write_and_commit(result: dict) -> None:
        try:
            enter_device()  # a new thread starts on GPU 0: use this rank's device
            if copied is not None:
                copied.synchronize()  # the staged host copies have landed
            writer = dcp.FileSystemWriter(partial, sync_files=True)
            dcp.save(state, storage_writer=writer, process_group=group)
            mine = {
                name: manifest.checksum(os.path.join(partial, name))
                for name in manifest.files_of_rank(partial, rank)
            }
            everyone = gather_to_rank0(mine, group)
            if rank == 0:
                files = {name: info for per_rank in everyone for name, info in per_rank.items()}
                files[".metadata"] = manifest.checksum(os.path.join(partial, ".metadata"))
                manifest.write(partial, step=step, world_size=world, files=files, config=config)
                commit.commit(directory, step)
                if keep_last:
                    commit.prune(directory, keep_last)
            barrier(group)
            result["path"] = os.path.join(directory, commit.step_dir_name(step))
        except BaseException as error:  # surfaced by SaveHandle.wait()
            result["error"] = error

    result: dict = {}
    if not async_save:
        write_and_commit(result)
        handle = SaveHandle(time.perf_counter() - started, None, result)
        handle.wait()
        return handle
    thread = threading.Thread(target=write_and_commit, args=(result,), daemon=True)
    thread.start()
    global _in_flight
    _in_flight = SaveHandle(time.perf_counter() - started, thread, result)
    return _in_flight


def wait_for_pending_save() -> None:
    """One save at a time: finish the previous asynchronous save first."""
    global _in_flight
    if _in_flight is not None:
        handle, _in_flight = _in_flight, None
        handle.wait()
