"""Receiver side of weight sync: the blocks every trainer rank sends are written into the
tensors kept here (whole, or the slice this receiver asked for), so a delta update leaves
the rest as last received; then into the receiving model's tensors of the same names (or
handed to a `load_weights(name, tensor)` callable, as an inference engine takes them).

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

from flatshard.comm.sync_group import SyncGroup, recv_object, send_object
from flatshard.errors import WeightSyncError
from flatshard.hf.stream import hf_tensor
from flatshard.hf.sync_send import (
    ANNOUNCE_TAG,
    CLOSED,
    HEADER_TAG,
    MANIFEST_TAG,
    OPENING_TAG,
    REQUEST_TAG,
)
from flatshard.hf.sync_wire import piece_bytes, unpack
from flatshard.layout.spec import Box

APPLY = ("end", "as_received")
Slices = Callable[[str, tuple[int, ...]], "tuple[tuple[int, ...], tuple[int, ...]] | None"]


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
    """A plan as this receiver sees it: the tensors it keeps (their box in the full tensor),
    every trainer rank's parts and buckets, and the outputs cut from the tensors."""

    def __init__(self, announcement: dict, boxes: dict, manifests: list[dict], device):
        self.senders = manifests
        self.outputs_of: dict[str, list] = {}
        for out_name, tensor_name, cut in announcement["outputs"]:
            shape = announcement["tensors"][tensor_name][0]
            whole = cut is None or _whole(cut, shape)  # else cut from the tensor kept whole
            self.outputs_of.setdefault(tensor_name, []).append((out_name, None if whole else cut))
        self.boxes, self.kept = {}, {}
        for name, (shape, dtype) in announcement["tensors"].items():
            self.boxes[name] = Box(*boxes.get(name, ((0,) * len(shape), shape)))
            self.kept[name] = torch.zeros(self.boxes[name].shape, dtype=dtype, device=device)

    def place(self, piece) -> tuple[slice, ...]:
        """Where a received block lies in the tensor kept for it."""
        return Box(piece.offsets, piece.shape).within(self.boxes[piece.name])


def receive_weights(
    group: SyncGroup,
    target: nn.Module | Callable[[str, torch.Tensor], None],
    *,
    slices: Slices | None = None,
    apply: str = "end",
    expect_version: int | None = None,
) -> ReceiveStats | None:
    """Take one `sync_weights` update from every trainer rank of `group` and write it into
    `target`: a module whose parameters and buffers have the sent names (a `transformers`
    model for names="hf"; written in place, in their own dtype), or a callable taking
    (name, tensor). `slices(name, full shape)` -> (offsets, shape) or None: the block of a
    tensor this receiver keeps (a TP-sharded engine's slice; None: all of it), asked for at
    a model's first sync. Tensors go out in the trainer's dtype (fp32 main weights), rounded
    as the wire rounded them. Raises `WeightSyncError`, applying nothing, when the senders
    disagree on the version or it is not `expect_version`. Returns None once the trainer
    has ended the stream (`end_weight_sync`)."""
    if group.is_trainer:
        raise WeightSyncError("receive_weights runs on a receiver; trainers call sync_weights")
    if apply not in APPLY:
        raise WeightSyncError(f"receive_weights apply={apply!r}: use one of {APPLY}")
    start = time.perf_counter()
    layout = _opening(group, slices)
    if layout is None:
        return None  # the trainer ended the stream (end_weight_sync)
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
            for part in manifest["buckets"][b]:
                name = manifest["parts"][part].name
                pending[name] = pending.get(name, 0) + 1
    changed = list(pending)
    received, nbytes, applied = 0, 0, 0
    for round_ in range(max((len(b) for b in incoming), default=0)):
        posted = []  # one bucket from each sender at a time
        for sender, buckets in enumerate(incoming):
            if round_ < len(buckets):
                b, manifest = buckets[round_]
                blocks = [manifest["parts"][part] for part in manifest["buckets"][b]]
                size = sum(piece_bytes(block, manifest["wire"]) for block in blocks)
                buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
                posted.append((group.data.recv([buffer], sender, b), buffer, blocks, manifest))
        for work, buffer, blocks, manifest in posted:
            work.wait()
            received, nbytes = received + 1, nbytes + buffer.numel()
            for block, value in zip(blocks, unpack(blocks, buffer, manifest["wire"])):
                layout.kept[block.name][layout.place(block)].copy_(value)
                pending[block.name] -= 1
                if apply == "as_received" and refused is None and pending[block.name] == 0:
                    applied += write(block.name)
    if refused:
        raise WeightSyncError(f"refused the weight update: {refused}; nothing was applied")
    if apply == "end":
        applied = sum(write(name) for name in changed)
    full = all(header[1] for header in headers)
    return ReceiveStats(headers[0][0], full, received, nbytes, applied,
                        time.perf_counter() - start)  # fmt: skip


def _opening(group: SyncGroup, slices: Slices | None) -> _Layout | None:
    """The plan this sync uses: known, or set up now (announced by trainer rank 0, this
    receiver's request to every trainer rank, and each one's manifest)."""
    openings = []
    for sender in range(group.trainers):
        opening = torch.zeros(2, dtype=torch.int64)
        group.meta.recv([opening], sender, OPENING_TAG).wait()
        openings.append(tuple(opening.tolist()))
    if len(set(openings)) != 1:
        raise WeightSyncError(f"the trainer's ranks sync different models ({openings})")
    number, new = openings[0]
    if number == CLOSED:
        return None
    if new:
        announcement = recv_object(group, 0, ANNOUNCE_TAG)
        boxes = _request(announcement, slices)
        manifests = []
        for sender in range(group.trainers):
            send_object(group, boxes, sender, REQUEST_TAG)
            manifests.append(recv_object(group, sender, MANIFEST_TAG))
        group.plans[("receiver", number)] = _Layout(announcement, boxes, manifests, group.device)
    return group.plans[("receiver", number)]


def _request(announcement: dict, slices: Slices | None) -> dict:
    """The block of each tensor this receiver keeps, where it keeps less than all: asked
    by the names it receives, so only for outputs that are their tensor whole."""
    if slices is None:
        return {}
    boxes = {}
    for out_name, tensor_name, cut in announcement["outputs"]:
        shape = announcement["tensors"][tensor_name][0]
        box = slices(out_name, shape)
        if box is None:
            continue
        offsets, size = tuple(box[0]), tuple(box[1])
        if cut is not None and not _whole(cut, shape):
            raise WeightSyncError(
                f"{out_name} is cut from {tensor_name} (a fused or regrouped tensor): ask for "
                "it whole (slices returns None for it) or sync with names='model'"
            )
        if len(offsets) != len(shape) or any(
            o < 0 or s < 1 or o + s > n for o, s, n in zip(offsets, size, shape)
        ):
            raise WeightSyncError(f"slices({out_name!r}) = {box} is not a block of {shape}")
        boxes[tensor_name] = (offsets, size)
    return boxes


def _whole(cut, shape) -> bool:
    """Whether a Hugging Face output is its tensor unchanged."""
    mapping = cut[0]
    tile = mapping.tile
    if mapping.component is not None:
        return False
    return tile is None or (
        tile.box.offset == (0,) * len(shape)
        and tuple(tile.box.shape) == tuple(shape)
        and tuple(tile.dims) == tuple(range(len(shape)))
        and tuple(tile.offset) == (0,) * len(shape)
    )


def _writer(target, layout: _Layout) -> Callable[[str], int]:
    """A function writing one kept tensor's outputs into `target`; returns how many."""
    outputs = [name for entries in layout.outputs_of.values() for name, _ in entries]
    if isinstance(target, nn.Module):
        own = {**dict(target.named_parameters()), **dict(target.named_buffers())}
        missing = [name for name in outputs if name not in own]
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
        kept = layout.kept[tensor_name]
        entries = layout.outputs_of.get(tensor_name, [])
        for out_name, cut in entries:
            load(out_name, kept if cut is None else hf_tensor(cut[0], cut[1], kept))
        return len(entries)

    return write
