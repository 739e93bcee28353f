"""Run directories and the checkpoints in them.

A run directory holds config.toml / config.json (the effective config), metrics.jsonl,
checkpoints/ (flatshard.checkpoint's `step-N/` directories and `latest`), sample.txt and
tensorboard/ when TensorBoard is installed.
"""

from __future__ import annotations

import json
import os
import re
import time

import torch.distributed.checkpoint as dcp

from flatshard.checkpoint import commit, manifest
from flatshard.cli.errors import RunError

CHECKPOINTS = "checkpoints"
CONFIG_TOML, CONFIG_JSON = "config.toml", "config.json"
METRICS, SAMPLE = "metrics.jsonl", "sample.txt"
_STEP_DIR = re.compile(r"step-(\d{8})$")


def new_run_dir(template: str) -> str:
    """The directory of a new run; `{time}` becomes the start time."""
    if "{time}" not in template:
        return template
    path = template.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    candidate, n = path, 2
    while os.path.exists(candidate):
        candidate, n = f"{path}-{n}", n + 1
    return candidate


def runs_root(template: str) -> str:
    """Where runs made from an out_dir template live ('runs' for 'runs/{time}')."""
    if "{time}" not in template:
        return template
    return os.path.dirname(template) or "."


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def has_checkpoint(run_dir: str) -> bool:
    return commit.latest_dir(checkpoint_root(run_dir)) is not None


def latest_run(root: str) -> str | None:
    """The most recently written run under `root` that has a committed checkpoint."""
    if not os.path.isdir(root):
        return None
    runs = [os.path.join(root, name) for name in os.listdir(root)]
    runs = [run for run in runs if os.path.isdir(run) and has_checkpoint(run)]
    if not runs:
        return None
    return max(runs, key=lambda run: os.path.getmtime(os.path.join(checkpoint_root(run), "latest")))


def resolve_checkpoint(path: str) -> tuple[str, int | None]:
    """(checkpoint root, step or None for `latest`) from a run directory, a checkpoints
    directory or one `step-N` directory."""
    path = os.path.normpath(path)
    if not os.path.exists(path):
        raise RunError(f"checkpoint {path!r} does not exist")
    match = _STEP_DIR.search(os.path.basename(path))
    if match and os.path.isfile(os.path.join(path, manifest.MANIFEST)):
        return os.path.dirname(path), int(match.group(1))
    for root in (path, checkpoint_root(path)):
        if commit.latest_dir(root) is not None:
            return root, None
    raise RunError(
        f"{path!r} holds no committed checkpoint (no 'latest' marker in it or in its "
        f"{CHECKPOINTS}/ directory, and it is not a step-N directory)"
    )


def step_dir(root: str, step: int | None) -> str:
    if step is None:
        return commit.latest_dir(root)
    return os.path.join(root, commit.step_dir_name(step))


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
