"""Trainer side of weight sync: every trainer rank sends the blocks of the full weights it
holds (its rows of each parameter, at their global offsets, in the DCP chunks a checkpoint
would write, so each block goes out once however the parameter is replicated over HSDP or
TP) straight to every receiver, packed into buckets of a byte budget. Nothing is gathered:
no rank ever holds more than one bucket's bytes beyond its shards.

The first sync sends each receiver this rank's layout (its pieces and buckets; rank 0 also
the tensors' shapes and how the receiver cuts them into Hugging Face tensors). Each sync
then sends a header (version, which buckets follow) and the buckets. In delta mode a bucket
goes out only if one of its pieces was written since it was last sent (autograd's version
counter of the shard it views: an optimizer step, a load), with everything sent every
`full_every` syncs."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from flatshard import registry
from flatshard.comm.sync_group import SyncGroup, send_object
from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import param_spec
from flatshard.errors import WeightSyncError
from flatshard.hf.adapter import adapter_for
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.stream import NAMES, model_order
from flatshard.hf.sync_wire import Piece, pack, piece_bytes, wire_dtype

MANIFEST_TAG, HEADER_TAG = 0, 1
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class SyncStats:
    """What one `sync_weights` call sent from this rank."""

    version: int
    full: bool  # every bucket sent (not a delta)
    buckets_sent: int
    buckets: int  # this rank's buckets in all
    bytes_sent: int  # to each receiver
    seconds: float


@dataclass
class _Plan:
    tensors: Callable[[], dict[str, torch.Tensor]]  # the tensors sent, by name, as they are now
    pieces: list[Piece]
    buckets: list[list[int]]  # piece indices
    wire: torch.dtype | None
    sent_versions: list[tuple] | None = None
    syncs: int = 0


def sync_weights(
    model: nn.Module,
    group: SyncGroup,
    *,
    names: str = "hf",
    wire: str | torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    delta: bool = False,
    full_every: int | None = None,
    version: int | None = None,
) -> SyncStats:
    """Stream `model`'s full weights to the receivers of `group` (`receive_weights` there).
    Every trainer rank calls it. `names`: "hf" (Hugging Face names and layout, as
    `save_pretrained` writes them) or "model" (the state dict's keys). `wire`: "bf16",
    "fp16", "fp32", "fp8" (e4m3 with one fp32 scale per row) or None (each tensor's own
    dtype: bitwise). `delta`: send only the buckets written since the last sync (and all
    of them every `full_every` syncs). `version` (default: the sync's count from 1) lets
    the receivers refuse an update whose senders disagree."""
    if not group.is_trainer:
        raise WeightSyncError("sync_weights runs on the trainer's ranks; receivers call "
                              "receive_weights")  # fmt: skip
    if names not in NAMES:
        raise WeightSyncError(f"sync_weights names={names!r}: use one of {NAMES}")
    if full_every is not None and full_every < 1:
        raise WeightSyncError(f"sync_weights full_every={full_every}: use a count >= 1")
    start = time.perf_counter()
    for unit in registry.units_below(model):
        unit.check_states_here()  # not while offload_states has them on the host
    key = (id(model), names, wire, bucket_bytes)
    plan = group.plans.get(key)
    if plan is None:
        plan = group.plans[key] = _plan(model, group, names, wire_dtype(wire), bucket_bytes)
    plan.syncs += 1
    version = plan.syncs if version is None else version
    with torch.no_grad():
        values, written = _values(plan, group.rank)
        versions = [tuple(_version(written[i]) for i in bucket) for bucket in plan.buckets]
        full = not delta or plan.sent_versions is None
        full = full or (full_every is not None and (plan.syncs - 1) % full_every == 0)
        send = [full or now != then for now, then in zip(versions, plan.sent_versions or versions)]
        header = torch.tensor([version, int(full), *map(int, send)], dtype=torch.int64)
        for receiver in group.receiver_ranks:
            group.meta.send([header], receiver, HEADER_TAG).wait()
        sent_bytes, in_flight = 0, []
        for index, bucket in enumerate(plan.buckets):
            if not send[index]:
                continue
            pieces = [plan.pieces[i] for i in bucket]
            buffer = pack(pieces, [values[i] for i in bucket], plan.wire, group.device)
            in_flight += [group.data.send([buffer], r, index) for r in group.receiver_ranks]
            in_flight.append(buffer)  # alive until its sends are done
            sent_bytes += buffer.numel()
            while len(in_flight) > 2 * (group.receivers + 1):  # two buckets at a time
                _finish(in_flight.pop(0))
        for item in in_flight:
            _finish(item)
    plan.sent_versions = versions
    return SyncStats(version, full, sum(send), len(plan.buckets), sent_bytes,
                     time.perf_counter() - start)  # fmt: skip


def _values(plan: _Plan, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each piece's current value and the tensor whose version counter its writes bump,
    read from the tensors as they are now (a module may swap its parameters' local tensors
    between steps)."""
    pieces, values, written = [], [], []
    for name, tensor in plan.tensors().items():
        for piece, value, bumped in _pieces(name, tensor, rank):
            pieces.append(piece)
            values.append(value)
            written.append(bumped)
    if pieces != plan.pieces:
        raise WeightSyncError(
            "the model's layout changed since its first sync_weights (other parameters, "
            "shapes or sharding): sync it over a new weight_sync_group"
        )
    return values, written


def _version(value: torch.Tensor) -> tuple[int, int]:
    """What changes when a piece is written: its storage and autograd's version counter."""
    return value.untyped_storage().data_ptr(), value._version


def _finish(item) -> None:
    if not isinstance(item, torch.Tensor):
        item.wait()


def _plan(model, group: SyncGroup, names: str, wire, bucket_bytes: int) -> _Plan:
    """This rank's pieces and buckets, sent to every receiver once."""
    if names == "hf":
        adapter = adapter_for(model)
        mappings, unmapped = adapter.plan(model)
        if unmapped:
            raise HFCheckpointError(
                f"no Hugging Face name for parameter(s) {unmapped}; add a NameRule for them"
            )
        current = functools.partial(adapter.tensors, model)
        tensors = current()
        infos = {name: param_spec(model, name, t).info for name, t in tensors.items()}
        outputs = [(m.hf_name, m.param_name, (m, infos[m.param_name])) for m in mappings]
    else:
        order, tensors = model_order(model)
        outputs = [(key, first, None) for key, first, _ in order]
        current = lambda: model_order(model)[1]  # noqa: E731
    pieces = [piece for name, t in tensors.items() for piece, *_ in _pieces(name, t, group.rank)]
    buckets, size = [], bucket_bytes
    for index, piece in enumerate(pieces):
        nbytes = piece_bytes(piece, wire)
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += nbytes
    manifest = {"pieces": pieces, "buckets": buckets, "wire": wire}
    if group.rank == 0:
        manifest["tensors"] = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
        manifest["outputs"] = outputs
    for receiver in group.receiver_ranks:
        send_object(group, manifest, receiver, MANIFEST_TAG)
    return _Plan(current, pieces, buckets, wire)


def _pieces(name: str, tensor: torch.Tensor, rank: int):
    """(Piece, its value, the tensor whose version an in-place write to it bumps) for each
    block of `tensor` this rank sends (a flatshard piece: its flat buffer's, which every
    write through the DTensor or a flat optimizer bumps)."""
    if not isinstance(tensor, DTensor):
        if rank == 0:  # a tensor flatshard does not shard: every rank has it whole
            piece = Piece(name, (0,) * tensor.dim(), tuple(tensor.shape), tensor.dtype)
            yield piece, tensor.detach(), tensor
        return
    local = tensor._local_tensor
    if isinstance(local, RowShard):  # flatshard's: the chunks its checkpoint writes
        for item in local.__create_write_items__(name, tensor):
            chunk = item.tensor_data.chunk
            piece = Piece(name, tuple(chunk.offsets), tuple(chunk.sizes), tensor.dtype)
            value = local.__get_tensor_shard__(item.index)
            yield piece, value, value if local.version_base is None else local.version_base
        return
    coordinate = tensor.device_mesh.get_coordinate()
    if any(c != 0 for c, p in zip(coordinate, tensor.placements) if isinstance(p, Replicate)):
        return  # another replica sends it
    shape, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    piece = Piece(name, tuple(offsets), tuple(shape), tensor.dtype)
    yield piece, tensor.to_local(), tensor.to_local()
