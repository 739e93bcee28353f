"""Trainer side of weight sync: every trainer rank sends its own blocks of the full weights
straight from its shards to every receiver, packed into buckets of a byte budget (the plan
and routes: `sync_plan.py`). Nothing is gathered: no rank holds more than two buckets'
bytes beyond its shards.

Each sync opens with the number of its plan (a model, names, wire and bucket size). The
first sync of a plan also sets it up: rank 0 announces the tensors and how the receivers
cut them into their outputs, each receiver answers every trainer rank with the blocks it
wants (all, or its TP slices), and each trainer rank sends each receiver the layout of what
it will get. Then every sync sends a header (version, which buckets follow) and the
buckets. In delta mode a bucket goes out only if its flat buffer was written since it was
last sent (autograd's version counter: an optimizer step, a load), with everything sent
every `full_every` syncs."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from flatshard import registry
from flatshard.comm.sync_group import SyncGroup, recv_object, send_object
from flatshard.errors import WeightSyncError
from flatshard.hf.stream import NAMES
from flatshard.hf.sync_plan import SendPlan, current_values, make_plan, make_route, version_of
from flatshard.hf.sync_wire import pack, wire_dtype

OPENING_TAG, ANNOUNCE_TAG, REQUEST_TAG, MANIFEST_TAG, HEADER_TAG = range(5)
CLOSED = -1  # the plan number of an opening that ends the stream
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class SyncStats:
    """What one `sync_weights` call sent from this rank."""

    version: int
    full: bool  # every bucket sent (not a delta)
    buckets_sent: int  # to all receivers
    buckets: int  # this rank's buckets in all, over all receivers
    bytes_sent: int  # to all receivers
    seconds: float


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
    `save_pretrained` writes them; a LoRA model's projections with their adapters merged,
    recomputed at every sync) or "model" (the state dict's keys, adapters apart). `wire`: "bf16",
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
    wire = wire_dtype(wire)
    key = (id(model), names, wire, bucket_bytes)
    plan = group.plans.get(key)
    new = plan is None
    if new:
        plan = group.plans[key] = make_plan(model, names, group.rank, len(group.plans))
    opening = torch.tensor([plan.number, int(new)], dtype=torch.int64)
    for receiver in group.receiver_ranks:
        group.meta.send([opening], receiver, OPENING_TAG).wait()
    with torch.no_grad():
        values, written = current_values(plan, group.rank)
        if new:
            _set_up(plan, group, written, wire, bucket_bytes)
        plan.syncs += 1
        version = plan.syncs if version is None else version
        full = not delta or plan.syncs == 1
        full = full or (full_every is not None and (plan.syncs - 1) % full_every == 0)
        sent, sent_bytes, in_flight = 0, 0, []
        for receiver, route in plan.routes.items():
            versions = [tuple(version_of(written[route.parts[p][0]]) for p in bucket)
                        for bucket in route.buckets]  # fmt: skip
            last = route.sent_versions or versions
            send = [full or now != then for now, then in zip(versions, last)]
            header = torch.tensor([version, int(full), *map(int, send)], dtype=torch.int64)
            group.meta.send([header], receiver, HEADER_TAG).wait()
            for index, bucket in enumerate(route.buckets):
                if not send[index]:
                    continue
                blocks = [route.parts[p] for p in bucket]
                buffer = pack([block for _, block, _ in blocks],
                              [values[i][where] for i, _, where in blocks], wire, group.device)
                in_flight += [group.data.send([buffer], receiver, index), buffer]
                sent, sent_bytes = sent + 1, sent_bytes + buffer.numel()
                while len(in_flight) > 4:  # two buckets in flight (a buffer lives till sent)
                    _finish(in_flight.pop(0))
            route.sent_versions = versions
        for item in in_flight:
            _finish(item)
    buckets = sum(len(route.buckets) for route in plan.routes.values())
    return SyncStats(version, full, sent, buckets, sent_bytes, time.perf_counter() - start)


def end_weight_sync(group: SyncGroup) -> None:
    """Tell the receivers no more updates come: their `receive_weights` returns None. Every
    trainer rank calls it once, after its last `sync_weights`."""
    if not group.is_trainer:
        raise WeightSyncError("end_weight_sync runs on the trainer's ranks")
    closing = torch.tensor([CLOSED, 0], dtype=torch.int64)
    for receiver in group.receiver_ranks:
        group.meta.send([closing], receiver, OPENING_TAG).wait()


def _set_up(plan: SendPlan, group: SyncGroup, written, wire, bucket_bytes: int) -> None:
    """A new plan's first sync: announce it, take each receiver's request, route it."""
    for receiver in group.receiver_ranks:
        if group.rank == 0:
            send_object(group, plan.announcement, receiver, ANNOUNCE_TAG)
        request = recv_object(group, receiver, REQUEST_TAG)
        route = plan.routes[receiver] = make_route(plan, request, written, wire, bucket_bytes)
        manifest = {"parts": [block for _, block, _ in route.parts], "buckets": route.buckets,
                    "wire": wire}  # fmt: skip
        send_object(group, manifest, receiver, MANIFEST_TAG)


def _finish(item) -> None:
    if not isinstance(item, torch.Tensor):
        item.wait()
