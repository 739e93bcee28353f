"""The tensors of a Hugging Face safetensors checkpoint directory, from headers only.

A directory holds either one `model.safetensors` or `model.safetensors.index.json` plus the
shard files it names (transformers prefers the single file when both exist; so do we).
Opening reads each file's header (names, shapes, dtypes), never tensor data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from flatshard.hf.errors import HFCheckpointError, HFConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "F32", "BF16", ...


def checkpoint_tensors(path: str | Path) -> dict[str, TensorInfo]:
    """name -> where it lives and its shape, for every tensor of the checkpoint at `path`."""
    path = Path(path)
    if (path / SINGLE_FILE).is_file():
        return _read_headers(path / SINGLE_FILE)
    if (path / INDEX_FILE).is_file():
        return _read_index(path)
    raise HFCheckpointError(
        f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}; point at a Hugging Face model "
        "directory saved with safetensors (save_pretrained(..., safe_serialization=True))"
    )


def _read_index(path: Path) -> dict[str, TensorInfo]:
    try:
        with open(path / INDEX_FILE) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise HFCheckpointError(
            f"{path / INDEX_FILE} is not a valid index (needs a 'weight_map' object): {e!r}"
        ) from None
    tensors: dict[str, TensorInfo] = {}
    for file in sorted(set(weight_map.values())):
        if not (path / file).is_file():
            raise HFCheckpointError(
                f"{INDEX_FILE} names shard {file!r}, which is not in {path}; copy the missing "
                "shard or re-download the checkpoint"
            )
        tensors.update(_read_headers(path / file))
    stray = sorted(
        name
        for name, file in weight_map.items()
        if tensors.get(name, None) is None or tensors[name].file.name != file
    )
    if stray:
        raise HFCheckpointError(
            f"{INDEX_FILE} places {len(stray)} tensor(s) in files that do not hold them, e.g. "
            f"{stray[:5]}; the index and the shard files are out of sync"
        )
    return tensors


def _read_headers(file: Path) -> dict[str, TensorInfo]:
    try:
        with safe_open(file, framework="pt") as f:
            return {
                name: TensorInfo(
                    file, tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()
                )
                for name in f.keys()
            }
    except Exception as e:  # safetensors raises its own SafetensorError on a bad header
        raise HFCheckpointError(f"cannot read the safetensors header of {file}: {e}") from None


def read_hf_config(path: str | Path) -> dict:
    """The dict in `path/config.json`."""
    file = Path(path) / "config.json"
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise HFConfigError(
            f"{file} does not exist: a Hugging Face model directory needs its config.json"
        ) from None
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{file} is not valid JSON ({e}); fix or re-download it") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{file} holds a {type(config).__name__}, not a JSON object")
    return config
