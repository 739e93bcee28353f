"""A process group that joins a trainer's ranks and processes outside its job (an inference
engine's workers), for streaming weights to them. It is made from its own TCP store, not
from the default group, so the receivers need not be part of the trainer's world: ranks
`0..trainers-1` are the trainer's (its own rank numbers), `trainers..` the receivers.

Data moves point to point on a group of the chosen backend (NCCL between GPUs, gloo on
CPU); small metadata (the layout handshake, each sync's header) always goes over a gloo
group beside it, so it never needs device memory or a CUDA stream.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from flatshard.errors import WeightSyncError

DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass
class SyncGroup:
    """Trainer ranks and receivers joined for weight sync (`weight_sync_group`)."""

    rank: int  # in this group: a trainer's own rank, or trainers + receiver index
    trainers: int
    receivers: int
    data: dist.ProcessGroup  # tensors: NCCL or gloo
    meta: dist.ProcessGroup  # headers and objects: gloo
    device: torch.device  # where this rank's sent or received tensors live
    store: dist.Store  # kept alive with the groups (rank 0 serves it)
    # what the first sync of each model set up: a sender's plan, a receiver's layout
    plans: dict = field(default_factory=dict)

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainers

    @property
    def receiver_ranks(self) -> range:
        return range(self.trainers, self.trainers + self.receivers)


def weight_sync_group(
    address: str,
    *,
    trainers: int | None = None,
    receivers: int = 1,
    receiver: int | None = None,
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> SyncGroup:
    """Join the weight-sync group at `address` ("host:port", a port no other job uses; the
    trainer's rank 0 serves it). A trainer rank calls it with `receiver=None` (its rank and,
    by default, `trainers` come from its initialised process group); receiver `i` of
    `receivers` passes `receiver=i` and the trainer's world size as `trainers`. Every member
    must call it. `backend`: "nccl" or "gloo" (default: NCCL where CUDA is available)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise WeightSyncError(f"weight sync address {address!r}: give it as host:port")
    if receiver is None:
        if not dist.is_initialized():
            raise WeightSyncError(
                "a trainer joins the weight-sync group after init_process_group (its rank "
                "numbers the group); a receiver passes receiver=<index>"
            )
        trainers = dist.get_world_size() if trainers is None else trainers
        rank = dist.get_rank()
    else:
        if trainers is None or not 0 <= receiver < receivers:
            raise WeightSyncError(
                f"receiver={receiver} of receivers={receivers}: a receiver needs its index "
                "in [0, receivers) and the trainer's world size as trainers="
            )
        rank = trainers + receiver
    if not 0 <= rank < trainers + receivers:
        raise WeightSyncError(f"rank {rank} is outside the trainer's {trainers} ranks")
    size = trainers + receivers
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
    meta = _gloo(dist.PrefixStore("flatshard-sync-meta", store), rank, size, timeout)
    if backend == "gloo":
        data, device = meta, torch.device("cpu")
    elif backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        prefix = dist.PrefixStore("flatshard-sync-data", store)
        data = dist.ProcessGroupNCCL(prefix, rank, size, options)
    else:
        raise WeightSyncError(f"weight sync backend {backend!r}: use 'nccl' or 'gloo'")
    return SyncGroup(rank, trainers, receivers, data, meta, device, store)


def _gloo(store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def send_object(group: SyncGroup, obj, to: int, tag: int) -> None:
    """A picklable object to one member (over the gloo group)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    group.meta.send([torch.tensor([payload.numel()], dtype=torch.int64)], to, tag).wait()
    group.meta.send([payload], to, tag).wait()


def recv_object(group: SyncGroup, source: int, tag: int):
    """What `send_object` sent from `source`."""
    size = torch.zeros(1, dtype=torch.int64)
    group.meta.recv([size], source, tag).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.meta.recv([payload], source, tag).wait()
    return pickle.loads(payload.numpy().tobytes())  # noqa: S301 (our own trainer's layout)
