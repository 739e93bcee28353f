"""`save`: model, optimizer, step, per-rank RNG and any extra state, written with DCP into a
directory that is committed atomically; optionally asynchronous."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from flatshard import comm
from flatshard.checkpoint import commit, host_memory, manifest, writing
from flatshard.checkpoint.rank_file import DEFAULT_STAGING_BYTES
from flatshard.checkpoint.state import (
    app_state,
    barrier,
    checkpoint_group,
    gather_to_rank0,
    rank_and_world,
    rng_state,
    stage,
)
from flatshard.checkpoint.step_guard import StepGuard
from flatshard.comm import agreement
from flatshard.errors import CheckpointError


class SaveHandle:
    """Returned by `save`. `wait()` returns the committed directory (re-raising any error of
    an asynchronous write); `blocking_seconds` is how long `save` held up the caller."""

    def __init__(
        self,
        blocking_seconds: float,
        thread: threading.Thread | None,
        result: dict,
        guard: StepGuard | None = None,
    ):
        self.blocking_seconds = blocking_seconds
        self._thread = thread
        self._result = result
        self._guard = guard

    @property
    def peak_staging_bytes(self) -> int | None:
        """The most bytes of host copies this rank held at once (None: DCP wrote it)."""
        return self._result.get("peak_staging_bytes")

    def wait_staged(self) -> None:
        """Until the state is copied: from then on it may change (the next optimizer step
        waits for this by itself)."""
        if self._guard is not None:
            self._guard.wait()

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
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    trainable_only: bool = False,
    host_local: bool = False,
    **extra,
) -> SaveHandle:
    """Save a checkpoint of `step` under `directory` (call on every rank).

    extra: more state to keep, by name: `Stateful` objects (their state_dict() is saved and
        load_state_dict() restores them) or plain values (a data position, a config...).
    async_save: write in the background; training goes on. Values and unsharded tensors
        are copied now; the sharded weights and optimizer state are copied in waves while
        forward and backward run, and the next optimizer step waits for the last wave.
    staging_bytes: the most host memory that copies for the write hold at once (each wave
        half of it, the write of one overlapping the copy of the next; a larger tensor
        piece is a wave of its own).
    keep_last: after committing, delete all but the newest `keep_last` checkpoints.
    trainable_only: leave the frozen parameters out (a LoRA run saves its adapters; its
        base comes from the pretrained files); load with the same.
    host_local: `directory` is each host's own (host memory such as /dev/shm, a local disk):
        each host keeps its ranks' files and a copy of the previous host's (a ring, see
        `host_memory.py`); load with the same.

    A failed write (a full disk: "no space left on device while saving step N") raises one
    `CheckpointError` on every rank, removes the partial directory and leaves `latest` and
    the checkpoint it names untouched.
    """
    wait_for_pending_save()
    group = checkpoint_group()
    rank, world = rank_and_world(group)
    agreement.agree(
        f"step {step} is already saved in {directory}; pick a new step or delete it"
        if commit.exists(directory, step)
        else None,
        group,
        CheckpointError,
    )
    partial = commit.partial_dir(directory, step)
    failure = None
    hosts = host_memory.hosts_of(directory, group) if host_local else None
    makes_directory = hosts.leads(rank) if hosts else rank == 0  # on its host
    if makes_directory:
        try:
            if os.path.exists(partial):
                shutil.rmtree(partial)  # left by an interrupted save of this step
            os.makedirs(os.path.join(partial, "rng"))
        except OSError as error:
            failure = (_describe_failure(error, rank, directory), error)
    _agree_on_failure(failure, group, directory, step)  # also the barrier: the directory exists

    started = time.perf_counter()
    state = app_state(model, optimizer, extra, trainable_only)
    prepared = writing.prepare(state, group, rank, world)
    copied = guard = None
    if async_save and prepared.planned is None:  # DCP writes it: one whole host copy now
        global _staged
        prepared.state = _staged = stage(state, _staged)
        copied = comm.host_copies_done()
    elif async_save:
        prepared.copy_small_values()
        guard = StepGuard()
    enter_device = comm.thread_device_setter()
    rng = rng_state()  # taken now; written with the rest
    config = manifest.model_config(model)

    def write_and_commit(result: dict) -> None:
        try:
            enter_device()  # a new thread starts on GPU 0: use this rank's device
            if copied is not None:
                copied.synchronize()  # the staged host copies have landed
            failure = None  # (kind, text) of what went wrong on this rank, and the error
            mine = None
            try:
                written = writing.write_files(
                    partial,
                    prepared,
                    group,
                    rank,
                    staging_bytes=staging_bytes,
                    copy_always=async_save,
                    staged=guard and guard.release,
                )
                result["peak_staging_bytes"], mine = written or (None, {})
                torch.save(rng, os.path.join(partial, "rng", f"rank{rank}.pt"))
                mine = {  # CRCs of what the layout-planned writer wrote: taken as it wrote
                    name: mine.get(name) or manifest.checksum(os.path.join(partial, name))
                    for name in manifest.files_of_rank(partial, rank)
                }
            except (Exception, CheckpointException) as error:  # DCP's raises on every rank
                failure = (_describe_failure(error, rank, directory), error)
            everyone = gather_to_rank0((mine, failure and failure[0]), group)
            if rank == 0:
                failed = [described for _, described in everyone if described is not None]
                if failed:
                    failure = (failed[0], failure and failure[1])
                else:
                    try:
                        _write_manifest_and_commit(  # host-local: pruned once spread
                            directory, step, world, everyone, config, hosts is None and keep_last
                        )
                    except Exception as error:
                        failure = (_describe_failure(error, rank, directory), error)
            _agree_on_failure(failure, group, directory, step)  # also the barrier
            if hosts is not None:
                host_memory.spread(directory, step, group, hosts, rank, keep_last)
            result["path"] = os.path.join(directory, commit.step_dir_name(step))
        except BaseException as error:  # surfaced by SaveHandle.wait()
            result["error"] = error
        finally:
            if guard is not None:
                guard.release()

    result: dict = {}
    if not async_save:
        write_and_commit(result)
        handle = SaveHandle(time.perf_counter() - started, None, result)
        handle.wait()
        return handle
    thread = threading.Thread(target=write_and_commit, args=(result,), daemon=True)
    thread.start()
    global _in_flight
    _in_flight = SaveHandle(time.perf_counter() - started, thread, result, guard)
    return _in_flight


def _write_manifest_and_commit(directory, step, world, everyone, config, keep_last) -> None:
    """Rank 0: list every file's size and CRC, publish the step and move `latest`."""
    partial = commit.partial_dir(directory, step)
    files = {name: info for per_rank, _ in everyone for name, info in per_rank.items()}
    files[".metadata"] = manifest.checksum(os.path.join(partial, ".metadata"))
    manifest.write(partial, step=step, world_size=world, files=files, config=config)
    commit.commit(directory, step)
    if keep_last:
        commit.prune(directory, keep_last)


def _agree_on_failure(failure: tuple | None, group, directory: str, step: int) -> None:
    """Every rank learns whether any rank failed to save `step` (one small all-reduce, which
    is also a barrier). `failure`: this rank's ((kind, text), exception) or None. On a
    failure, rank 0 removes what this save wrote and every rank raises the same error: a
    `CheckpointError` for the file system's errors (a full disk, a read-only directory),
    naming the checkpoint that stays intact; a RuntimeError for anything else."""
    mine, cause = failure if failure is not None else (None, None)
    everyone = [mine]
    if group is not None:
        flag = torch.tensor([0 if mine is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not flag.item():
            return
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    found = [described for described in everyone if described is not None]
    if not found:
        return
    if rank_and_world(group)[0] == 0:
        commit.discard(directory, step)
    barrier(group)  # nobody looks at the directory before it is clean
    latest = commit.latest_dir(directory)
    kept = (
        f"the last complete checkpoint {os.path.basename(latest)} is intact"
        if latest
        else "no earlier checkpoint was saved"
    )
    full = [text for kind, text in found if kind == "enospc"]
    if full:
        raise CheckpointError(
            f"no space left on device while saving step {step}; {kept} ({full[0]}). Free "
            "some space (or keep fewer checkpoints) and resume"
        ) from cause
    if all(kind == "os" for kind, _ in found):
        raise CheckpointError(f"saving step {step} failed ({found[0][1]}); {kept}") from cause
    texts = "; ".join(text for _, text in found)
    raise RuntimeError(f"saving step {step} to {directory} failed: {texts}") from cause


def _describe_failure(failure: BaseException, rank: int, directory: str) -> tuple[str, str]:
    """(kind, text): kind "enospc" for a full disk, "os" for another file-system error,
    "other" otherwise; DCP wraps each rank's error in a CheckpointException. torch's own
    serializer (torch.save's zip writer) reports a failed write as a RuntimeError ("unexpected
    pos 704 vs 598"): a file-system error too, a full disk when `directory`'s is."""
    stack, seen = [(rank, failure)], set()
    while stack:
        where, error = stack.pop(0)
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError):
            kind = "enospc" if error.errno == errno.ENOSPC else "os"
            return kind, f"rank {where}: {error}"
        if isinstance(error, RuntimeError) and any(s in str(error) for s in _WRITER_FAILED):
            kind = "enospc" if _disk_full(directory) else "os"
            first_line = str(error).strip().splitlines()[0]
            return kind, f"rank {where}: torch's serializer could not write ({first_line})"
        failures = getattr(error, "failures", None)  # DCP: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for other, wrapped in sorted(failures.items()):
                stack.append((other, wrapped[0] if isinstance(wrapped, tuple) else wrapped))
        stack += [(where, error.__cause__), (where, error.__context__)]
    return "other", f"rank {rank}: {type(failure).__name__}: {failure}"


# what torch's zip writer (inline_container.cc) says when a write comes up short
_WRITER_FAILED = ("unexpected pos", "PytorchStreamWriter failed writing", "inline_container")


def _disk_full(directory: str) -> bool:
    try:
        return shutil.disk_usage(directory).free < (1 << 20)
    except OSError:
        return False


def wait_for_pending_save() -> None:
    """One save at a time: finish the previous asynchronous save first."""
    global _in_flight
    if _in_flight is not None:
        handle, _in_flight = _in_flight, None
        handle.wait()
