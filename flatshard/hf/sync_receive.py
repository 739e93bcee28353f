"""Receiver side of weight sync: the blocks every trainer rank sends are written into full
tensors kept here (so a delta update leaves the rest as last received), then into the
receiving model's tensors of the same names (or handed to a `load_weights(name, tensor)`
callback, as an inference engine takes them).

`apply="end"` writes nothing until the whole update has arrived and its senders agreed on
its version: an update cut short or disagreeing is never half applied. `apply="as_received"`
writes each tensor as soon as all its blocks are in, so inference can start on the first
layers while the rest still arrive."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from flatshard.comm.sync_group import SyncGroup, recv_object
from flatshard.errors import WeightSyncError
from flatshard.hf.stream import hf_tensor
from flatshard.hf.sync_send import HEADER_TAG, MANIFEST_TAG
from flatshard.hf.sync_wire import piece_bytes, unpack

APPLY = ("end", "as_received")


@dataclass
class ReceiveStats:
    """What one `receive_weights` call took in and applied."""

    version: int
    full: bool
    buckets: int  # received, from all trainer ranks
    bytes: int
    tensors_applied: int
    seconds: float


class _Layout:
    """Every trainer rank's pieces and buckets, the tensors they fill, and the outputs."""

    def __init__(self, manifests: list[dict]):
        self.senders = manifests
        self.tensors = manifests[0]["tensors"]
        self.outputs = manifests[0]["outputs"]
        self.full: dict[str, torch.Tensor] = {}
        self.outputs_of: dict[str, list] = {}
        for out_name, tensor_name, cut in self.outputs:
            self.outputs_of.setdefault(tensor_name, []).append((out_name, cut))


def receive_weights(
    group: SyncGroup,
    target: nn.Module | Callable[[str, torch.Tensor], None],
    *,
    apply: str = "end",
    expect_version: int | None = None,
) -> ReceiveStats:
    """Take one `sync_weights` update from every trainer rank of `group` and write it into
    `target`: a module whose parameters and buffers have the sent names (a `transformers`
    model for names="hf"; written in place, in their own dtype), or a callable taking
    (name, tensor). Tensors go out in the trainer's dtype (fp32 main weights), rounded as
    the wire rounded them. Raises `WeightSyncError`, applying nothing, when the senders
    disagree on the version or it is not `expect_version`."""
    if group.is_trainer:
        raise WeightSyncError("receive_weights runs on a receiver; trainers call sync_weights")
    if apply not in APPLY:
        raise WeightSyncError(f"receive_weights apply={apply!r}: use one of {APPLY}")
    start = time.perf_counter()
    layout = group.plans.get("receiver")
    if layout is None:
        manifests = [recv_object(group, r, MANIFEST_TAG) for r in range(group.trainers)]
        layout = group.plans["receiver"] = _Layout(manifests)
        for name, (shape, dtype) in layout.tensors.items():
            layout.full[name] = torch.zeros(shape, dtype=dtype, device=group.device)
    write = _writer(target, layout)
    headers = []
    for sender, manifest in enumerate(layout.senders):
        header = torch.zeros(2 + len(manifest["buckets"]), dtype=torch.int64)
        group.meta.recv([header], sender, HEADER_TAG).wait()
        headers.append(header.tolist())
    versions = {header[0] for header in headers}
    refused = None
    if len(versions) > 1:
        refused = f"its senders disagree on the version ({sorted(versions)})"
    elif expect_version is not None and versions != {expect_version}:
        refused = f"it is version {versions.pop()}, not {expect_version}"
    incoming = [
        [(b, manifest) for b, sent in enumerate(header[2:]) if sent]
        for header, manifest in zip(headers, layout.senders)
    ]
    pending: dict[str, int] = {}
    for buckets in incoming:
        for b, manifest in buckets:
            for i in manifest["buckets"][b]:
                name = manifest["pieces"][i].name
                pending[name] = pending.get(name, 0) + 1
    changed = list(pending)
    received, nbytes, applied = 0, 0, 0
    for round_ in range(max((len(b) for b in incoming), default=0)):
        posted = []
        for sender, buckets in enumerate(incoming):
            if round_ < len(buckets):
                b, manifest = buckets[round_]
                pieces = [manifest["pieces"][i] for i in manifest["buckets"][b]]
                size = sum(piece_bytes(p, manifest["wire"]) for p in pieces)
                buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
                posted.append((group.data.recv([buffer], sender, b), buffer, pieces, manifest))
        for work, buffer, pieces, manifest in posted:
            work.wait()
            received += 1
            nbytes += buffer.numel()
            for piece, value in zip(pieces, unpack(pieces, buffer, manifest["wire"])):
                layout.full[piece.name][piece.slices()].copy_(value)
                pending[piece.name] -= 1
                if apply == "as_received" and refused is None and pending[piece.name] == 0:
                    applied += write(piece.name)
    if refused:
        raise WeightSyncError(f"refused the weight update: {refused}; nothing was applied")
    if apply == "end":
        applied = sum(write(name) for name in changed)
    full = all(header[1] for header in headers)
    return ReceiveStats(headers[0][0], full, received, nbytes, applied,
                        time.perf_counter() - start)  # fmt: skip


def _writer(target, layout: _Layout) -> Callable[[str], int]:
    """A function writing one full tensor's outputs into `target`; returns how many."""
    if isinstance(target, nn.Module):
        own = {**dict(target.named_parameters()), **dict(target.named_buffers())}
        missing = [name for name, _, _ in layout.outputs if name not in own]
        if missing:
            raise WeightSyncError(
                f"the receiving {type(target).__name__} has no tensors named {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}: sync with the names it has "
                "(names='hf' for a transformers model, 'model' for the trainer's own class)"
            )

        def load(name: str, value: torch.Tensor) -> None:
            with torch.no_grad():
                own[name].copy_(value)
    else:
        load = target

    def write(tensor_name: str) -> int:
        full = layout.full[tensor_name]
        outputs = layout.outputs_of.get(tensor_name, [])
        for out_name, cut in outputs:
            load(out_name, full if cut is None else hf_tensor(cut[0], cut[1], full))
        return len(outputs)

    return write
