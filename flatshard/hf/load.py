"""`load_pretrained`: fill a (sharded or plain) model from a Hugging Face checkpoint.

Each rank reads only the rows it holds: for every HF tensor, the intersection of what it
fills (a whole parameter, or one fused component such as gate_proj inside gate_up_proj)
with this rank's piece, as its `ShardSpec` gives it, through
`safe_open(...).get_slice(name)`. No rank reads another's rows and no weights cross the
network. Everything is checked against the headers first, so a mismatched checkpoint
fails before a single weight is written, with one error listing every problem; the check
is the same on every rank (same files), so all ranks raise alike with no collective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from flatshard.api.fsdp_module import weights_changed
from flatshard.dtensor.sharded_param import param_spec
from flatshard.hf.adapter import StateDictAdapter, adapter_for
from flatshard.hf.checkpoint import TensorInfo, checkpoint_tensors
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.names import NameRule, TensorMapping
from flatshard.hf.tiles import Tile
from flatshard.layout import ShardSpec


@dataclass(frozen=True)
class LoadStats:
    """What this rank read: bytes of tensor data (slices actually read) and wall time."""

    bytes_read: int
    slices_read: int
    seconds: float


def load_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    adapter: StateDictAdapter | None = None,
    rules: tuple[NameRule, ...] | None = None,
    check_config: bool = True,
    whole: nn.Module | None = None,
) -> LoadStats:
    """Load the HF checkpoint at `path` into `model` (strict: every tensor used, every
    parameter filled). Works on a `fully_shard`-ed model at any world size and on a plain one.

    adapter: the model family's naming (default: the model's own, adapter.py).
    rules: other name rules for that adapter.
    check_config: the model and `path/config.json` must describe the same model, where the
        adapter can tell.
    whole: `model` is a pipeline rank's part of `whole` (`Pipeline.model`; `whole` may be on
        the meta device): the checkpoint must match `whole` strictly, and `model` reads its
        own tensors of it.
    """
    started = time.perf_counter()
    path = Path(path)
    adapter = adapter or adapter_for(model)
    if rules is not None:
        adapter = adapter.with_rules(rules)
    checked = model if whole is None else whole
    if check_config:
        adapter.check_config(checked, path)
    tensors = checkpoint_tensors(path)
    mappings, unmapped = adapter.plan_for_checkpoint(checked, set(tensors))
    problem = _mismatch_report(adapter, checked, mappings, unmapped, tensors)
    if problem:
        raise HFCheckpointError(f"checkpoint {path} does not match the model:\n{problem}")
    if whole is not None:  # the part's own: its parameters keep the whole model's names
        mappings, _ = adapter.plan_for_checkpoint(model, set(tensors))

    params = adapter.tensors(model)
    bytes_read = slices = 0
    with torch.no_grad():
        for file, group in _by_file(mappings, tensors).items():
            with safe_open(file, framework="pt") as f:
                for mapping in group:
                    param = params[mapping.param_name]
                    spec = param_spec(model, mapping.param_name, param)
                    read = copy_piece(f, mapping, spec, local_tensor(param))
                    bytes_read += read
                    slices += read > 0
    weights_changed(model)
    return LoadStats(bytes_read, slices, time.perf_counter() - started)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `param` as a writable tensor."""
    return param.to_local() if isinstance(param, DTensor) else param.detach()


def copy_piece(f, mapping: TensorMapping, spec: ShardSpec, local: torch.Tensor) -> int:
    """Copy what this rank holds of HF tensor `mapping` into `local`; returns bytes read."""
    if mapping.tile is not None:
        return _copy_tile(f, mapping.tile, spec, local)
    if mapping.component is None:
        blocks = spec.pieces
    else:
        piece = spec.component(mapping.component)
        blocks = () if piece.stored.empty else ((piece.local, piece.stored),)
    read = 0
    for into, stored in blocks:
        data = f.get_slice(mapping.hf_name)[stored.slices]
        local[into.slices].copy_(data)
        read += data.numel() * data.element_size()
    return read


def _copy_tile(f, tile: Tile, spec: ShardSpec, local: torch.Tensor) -> int:
    """The part of `tile` (a block of the parameter, from one HF tensor) inside each block
    this rank holds: only those elements of the HF tensor are read."""
    read = 0
    for into, piece in spec.pieces:
        mine = tile.clip(piece)
        if mine is None:
            continue
        data = f.get_slice(tile.origin)[mine.box.slices]
        at = tuple(
            slice(i + o - p, i + o - p + n)
            for i, o, p, n in zip(into.offset, mine.offset, piece.offset, mine.shape)
        )
        local[at].copy_(mine.take(data))
        read += data.numel() * data.element_size()
    return read


def _by_file(mappings, tensors: dict[str, TensorInfo]) -> dict[Path, list[TensorMapping]]:
    groups: dict[Path, list[TensorMapping]] = {}
    for mapping in mappings:
        groups.setdefault(tensors[mapping.hf_name].file, []).append(mapping)
    return groups


def _mismatch_report(adapter, model, mappings, unmapped, tensors) -> str:
    expected = {m.hf_name: m for m in mappings}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = [
        f"{name}: checkpoint {list(tensors[name].shape)}, model expects {list(m.shape)} "
        f"({m.component + ' of ' if m.component else ''}{m.param_name})"
        for name, m in sorted(expected.items())
        if name in tensors and tensors[name].shape != m.shape
    ]
    lines = []
    for title, items in (
        ("missing from the checkpoint", missing),
        ("unexpected in the checkpoint", unexpected),
        ("shape mismatches", wrong_shape),
        ("model parameters no name rule maps", sorted(unmapped)),
    ):
        if items:
            lines.append(f"  {title} ({len(items)}):")
            lines.extend(f"    {item}" for item in items)
    if not lines:
        return ""
    lines.extend(adapter.mismatch_hints(model, unexpected))
    lines.append(
        "Check that the model was built from this checkpoint's config.json (e.g. with "
        "flatshard.hf.from_pretrained) and that the checkpoint is complete."
    )
    return "\n".join(lines)
