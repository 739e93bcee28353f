"""`flatshard.json`: what a checkpoint holds and how to tell it is intact.

Every data file is listed with its size and CRC-32, so a truncated or corrupted file is
detected before anything is loaded. The model's config is kept to explain mismatches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib

import torch.distributed as dist

from flatshard.comm import agreement
from flatshard.errors import CheckpointError

MANIFEST = "flatshard.json"
FORMAT = 1


def checksum(path: str) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"size": size, "crc32": crc}


def files_of_rank(directory: str, rank: int) -> list[str]:
    """The files one rank wrote: its DCP data files and its RNG state."""
    prefix = f"__{rank}_"
    names = [n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".distcp")]
    rng = os.path.join("rng", f"rank{rank}.pt")
    if os.path.exists(os.path.join(directory, rng)):
        names.append(rng)
    return sorted(names)


def model_config(model) -> dict | None:
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_json_string", None)):
        # a transformers config (also a dataclass in transformers 5): its own JSON, read back
        # so that it compares equal to a saved one (asdict keeps a torch.dtype, which json
        # cannot write, and int keys that come back as strings)
        return json.loads(config.to_json_string(use_diff=False))
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return None


def write(directory: str, *, step: int, world_size: int, files: dict, config: dict | None):
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "model_config": config,
        "files": files,
    }
    with open(os.path.join(directory, MANIFEST), "w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)


def read(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(
            f"{directory} is not a complete flatshard checkpoint (no {MANIFEST}); "
            "it may be from an interrupted save. Load another step."
        )
    try:
        with open(path) as handle:
            return json.load(handle)
    except ValueError as error:
        raise CheckpointError(f"{path} is corrupted: {error}") from error


def verify_files(directory: str, manifest: dict, names: list[str]) -> list[str]:
    """Problems found in the given files (missing, truncated, corrupted)."""
    problems = []
    for name in names:
        expected = manifest["files"][name]
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            problems.append(f"{name} is missing")
            continue
        size = os.path.getsize(path)
        if size != expected["size"]:
            problems.append(f"{name} has {size} bytes, expected {expected['size']} (truncated?)")
        elif checksum(path)["crc32"] != expected["crc32"]:
            problems.append(f"{name} fails its CRC-32 check (corrupted)")
    return problems


def check_intact(directory: str, manifest: dict, group=None, names=None) -> None:
    """Check every file the manifest lists (size, CRC-32) before anything else of the
    checkpoint is read; the ranks of `group` (None: this process alone) each check a share
    (or `names`, each rank its own) and all raise the same CheckpointError, naming each
    missing, truncated or corrupted file."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
    mine = sorted(manifest["files"])[rank::world] if names is None else names
    problems = verify_files(directory, manifest, mine)
    try:
        agreement.agree("; ".join(problems) or None, group, CheckpointError)
    except CheckpointError as error:
        raise CheckpointError(
            f"checkpoint {directory} is corrupt: {error}. Load another step"
        ) from None


def config_differences(saved: dict | None, current: dict | None) -> list[str]:
    if not saved or not current:
        return []
    keys = sorted(set(saved) | set(current))
    return [
        f"{key}: checkpoint {saved.get(key)!r}, model {current.get(key)!r}"
        for key in keys
        if saved.get(key) != current.get(key)
    ]
