"""Run directories and the checkpoints in them.

A run directory holds config.toml / config.json (the effective config), metrics.jsonl,
checkpoints/ (flatshard.checkpoint's `step-N/` directories and `latest`), sample.txt and
tensorboard/ when TensorBoard is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time

import torch.distributed.checkpoint as dcp

from flatshard import checkpoint
from flatshard.checkpoint import commit, manifest
from flatshard.cli.errors import RunError
from flatshard.errors import CheckpointError

CHECKPOINTS = "checkpoints"
CONFIG_TOML, CONFIG_JSON = "config.toml", "config.json"
METRICS, SAMPLE = "metrics.jsonl", "sample.txt"


def new_run_dir(template: str) -> str:
    """The directory of a new run; `{time}` becomes the start time."""
    if "{time}" not in template:
        return template
    path = template.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    candidate, n = path, 2
    while os.path.exists(candidate):
        candidate, n = f"{path}-{n}", n + 1
    return candidate


def attempt_run_dir(template: str) -> str:
    """A new run's directory, the same for every attempt of an elastic run: torchrun
    --max-restarts starts the command again for each attempt, so the first picks it and
    leaves a marker named by the run id for the others."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if "{time}" not in template or not run_id or run_id == "none":
        return new_run_dir(template)
    root = runs_root(template)
    marker = os.path.join(root, f".elastic-{run_id}")
    if os.path.exists(marker):
        with open(marker) as handle:
            return handle.read()
    path = new_run_dir(template)
    os.makedirs(root, exist_ok=True)
    with open(marker, "w") as handle:
        handle.write(path)
    return path


def runs_root(template: str) -> str:
    """Where runs made from an out_dir template live ('runs' for 'runs/{time}')."""
    if "{time}" not in template:
        return template
    return os.path.dirname(template) or "."


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def memory_root(run_dir: str) -> str:
    """Where the run's snapshots in host memory live (checkpoint.memory_interval): a
    RAM-backed directory that outlives the processes, one per run directory and host
    (FLATSHARD_HOST_MEMORY names another base: two agents on one machine standing for two
    hosts each get their own)."""
    default = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    base = os.environ.get("FLATSHARD_HOST_MEMORY", default)
    key = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return os.path.join(base, f"flatshard-{key}")


def newest_step(root: str) -> int | None:
    """The step of the newest complete checkpoint under `root`, or None."""
    latest = commit.resolve_latest(root)[0] if os.path.isdir(root) else None
    return commit.step_of(latest) if latest is not None else None


def has_checkpoint(run_dir: str) -> bool:
    """Whether the run holds a complete checkpoint (with or without a `latest` marker)."""
    return commit.resolve_latest(checkpoint_root(run_dir))[0] is not None


def latest_run(root: str) -> str | None:
    """The most recently written run under `root` that has a complete checkpoint."""
    if not os.path.isdir(root):
        return None
    newest: dict[str, float] = {}
    for name in os.listdir(root):
        run = os.path.join(root, name)
        found = commit.resolve_latest(checkpoint_root(run))[0] if os.path.isdir(run) else None
        if found is not None:
            marker = os.path.join(checkpoint_root(run), commit.LATEST)
            written = os.path.getmtime(marker if os.path.exists(marker) else found)
            newest[run] = written
    return max(newest, key=newest.get) if newest else None


def resolve_checkpoint(path: str, warn=None) -> tuple[str, int]:
    """(checkpoint root, step) from a run directory, a checkpoints directory (their
    `latest` step, or the newest complete one if the marker is gone: `warn` is told) or one
    `step-N` directory."""
    path = os.path.normpath(path)
    if not os.path.exists(path):
        raise RunError(f"checkpoint {path!r} does not exist")
    step = commit.step_of(path)
    if step is not None:
        if not os.path.isfile(os.path.join(path, manifest.MANIFEST)):
            raise RunError(
                f"{path!r} is not a complete checkpoint (no {manifest.MANIFEST}: its save was "
                "interrupted); use another step"
            )
        return os.path.dirname(path) or ".", step
    for root in (path, checkpoint_root(path)):
        found, warning = commit.resolve_latest(root)
        if found is not None:
            if warning and warn is not None:
                warn(warning)
            return root, commit.step_of(found)
    raise RunError(
        f"{path!r} holds no committed checkpoint (no 'latest' marker and no complete step-N "
        f"directory in it or in its {CHECKPOINTS}/ directory, and it is not a step-N directory)"
    )


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, commit.step_dir_name(step))


def verified_step_dir(root: str, step: int, group=None) -> tuple[str, dict]:
    """The step directory and its manifest, once every file it lists has its size and CRC
    (the ranks of `group` check a share each). Read nothing else of a checkpoint before."""
    path = step_dir(root, step)
    saved = manifest.read(path)
    manifest.check_intact(path, saved, group)
    return path, saved


def stored_keys(step_path: str) -> dict:
    """DCP metadata of a checkpoint: {flattened key: storage metadata}."""
    return dcp.FileSystemReader(step_path).read_metadata().state_dict_metadata


def saved_extra(step_path: str, name: str):
    """A plain value saved with the checkpoint (`checkpoint.save(..., name=value)`), or None."""
    if f"extra.{name}" not in stored_keys(step_path):
        return None
    state = {"extra": {name: None}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(step_path), no_dist=True)
    return state["extra"][name]


def saved_run_config(step_path: str) -> dict | None:
    """The run config (nested dict) a `flatshard train` checkpoint was saved with, if any."""
    text = saved_extra(step_path, "run_config")
    return json.loads(text) if text else None


def write_config(run_dir: str, config) -> None:
    os.makedirs(run_dir, exist_ok=True)
    for name, text in ((CONFIG_TOML, config.to_toml()), (CONFIG_JSON, config.to_json())):
        with open(os.path.join(run_dir, name), "w") as handle:
            handle.write(text)


def _describe_saved(path: str) -> str:
    """': N MiB saved by W process(es)' from its manifest ('' where that cannot be read:
    the load, on every rank, says what is wrong with it)."""
    try:
        saved = manifest.read(path)
    except CheckpointError:
        return ""
    size = sum(entry.get("size", 0) for entry in saved.get("files", {}).values()) / 2**20
    return f": {size:,.1f} MiB saved by {saved.get('world_size', '?')} process(es),"


def resume(root: str, model, optimizer, step: int, ranks, trainable_only: bool = False,
           host_local: bool = False):  # fmt: skip
    """Load a run's checkpoint `step` into the model and optimizer (the load's result);
    the main rank first removes what an interrupted save left (no save runs yet).
    trainable_only: a LoRA run's checkpoint (its adapters). host_local: a snapshot in the
    hosts' memory."""
    path = os.path.join(root, commit.step_dir_name(step))
    if ranks.is_main:
        for name in commit.remove_partials(root):
            print(f"removed {name} (left by an interrupted or failed save)", flush=True)
        described = _describe_saved(path)
        print(f"loading {path}{described} into {ranks.world_size} process(es)...", flush=True)
    started = time.perf_counter()
    result = checkpoint.load(root, model=model, optimizer=optimizer, step=step,
                             data_position=None, trainable_only=trainable_only,
                             host_local=host_local)  # fmt: skip
    if ranks.is_main:
        print(f"loaded step {step} in {time.perf_counter() - started:.1f} s", flush=True)
    return result
