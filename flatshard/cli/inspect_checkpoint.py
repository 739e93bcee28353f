"""`flatshard inspect`: what a checkpoint holds, read from its manifest (flatshard.json) and
DCP metadata only; no tensor data is loaded. Every file's size and CRC-32 is checked first:
a corrupt checkpoint is reported as such (naming the file), never half-described."""

from __future__ import annotations

import json
import math
import os
import textwrap

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from flatshard.checkpoint import commit
from flatshard.cli import runs
from flatshard.cli.config import toml_value
from flatshard.cli.errors import warn

SECTIONS = ("model", "optim", "extra")


def describe(path_given: str) -> dict:
    root, step = runs.resolve_checkpoint(path_given, warn=warn)
    path, saved = runs.verified_step_dir(root, step)  # a corrupt checkpoint is an error
    tensors, values = {}, []
    for key, info in sorted(runs.stored_keys(path).items()):
        if isinstance(info, TensorStorageMetadata):
            tensors[key] = {
                "shape": list(info.size),
                "dtype": str(info.properties.dtype).removeprefix("torch."),
            }
        else:
            values.append(key)
    model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    optim = {k: v for k, v in tensors.items() if k.startswith("optim.")}
    extras = {
        key.removeprefix("extra."): runs.saved_extra(path, key.removeprefix("extra."))
        for key in values
        if key.startswith("extra.") and key.count(".") == 1
    }
    run_config = extras.pop("run_config", None)
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    return {
        "path": path,
        "step": saved["step"],
        "world_size": saved["world_size"],
        "committed_steps": commit.committed_steps(root),
        "latest": os.path.basename(commit.resolve_latest(root)[0] or ""),
        "size_bytes": sum(os.path.getsize(f) for f in files),
        "files": len(files),
        "model_config": saved.get("model_config"),
        "run_config": json.loads(run_config) if run_config else None,
        "extras": extras,
        "model_tensors": model,
        "model_params": sum(math.prod(t["shape"]) for t in model.values()),
        "optimizer_tensors": optim,
    }


def inspect_command(args) -> int:
    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        print(format_info(info, all_keys=args.all_keys))
    return 0


def format_info(info: dict, all_keys: bool = False) -> str:
    size = info["size_bytes"]
    lines = [
        f"checkpoint: {info['path']}",
        f"step: {info['step']}  (committed steps here: {_steps(info['committed_steps'])}; "
        f"latest: {info['latest']})",
        f"saved by: {info['world_size']} rank(s)",
        f"size on disk: {size / 2**20:.2f} MiB in {info['files']} files",
    ]
    if info["model_config"]:
        lines.append(_wrapped("model config: ", info["model_config"]))
    if info["extras"]:
        lines.append(_wrapped("saved values: ", info["extras"]))
    if info["run_config"]:
        lines.append("run config (flatshard train):")
        for section, values in info["run_config"].items():
            lines.append(_wrapped(f"  [{section}] ", values))
    model = info["model_tensors"]
    lines.append(f"model tensors: {len(model)}, {info['model_params']:,} parameters")
    width = max((len(k) for k in model), default=0)
    for key, tensor in model.items():
        lines.append(f"  {key:<{width}}  {str(tuple(tensor['shape'])):<16} {tensor['dtype']}")
    optim = info["optimizer_tensors"]
    if optim:
        kinds = sorted({key.rsplit(".", 1)[-1] for key in optim})
        lines.append(f"optimizer tensors: {len(optim)} ({', '.join(kinds)} per parameter)")
        if all_keys:
            for key, tensor in optim.items():
                lines.append(f"  {key}  {tuple(tensor['shape'])} {tensor['dtype']}")
    else:
        lines.append("optimizer tensors: none (a weights-only checkpoint)")
    return "\n".join(lines)


def _wrapped(head: str, values: dict) -> str:
    text = head + ", ".join(f"{k}={toml_value(v)}" for k, v in values.items())
    indent = " " * (len(head) - len(head.lstrip()) + 4)
    return textwrap.fill(text, width=100, subsequent_indent=indent)


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]} ... {steps[-1]}"
