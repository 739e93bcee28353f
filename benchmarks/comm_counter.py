"""Counting the bytes and calls of `torch.distributed`'s Python-level collectives per step,
and the bytes each rank puts on the wire for the algorithms gloo runs."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")
# Bytes each rank sends per counted byte of a collective, as (N-1)/N multiples, for the
# algorithms gloo runs: ring all-gather, all-to-all and ring all-reduce (reduce-scatter +
# all-gather); gloo's reduce-scatter clones its input and all-reduces all of it.
WIRE_FACTOR = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2, "all_to_all": 1}
COUNTED_NAME = {
    "all_gather": "all_gather_single",
    "reduce_scatter": "reduce_scatter_single",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all_single",
    "send": "isend",
}


def wire_bytes(comm: dict, world: int) -> float:
    """Bytes one rank sends per step: the collectives (see WIRE_FACTOR) and its sends."""
    collectives = sum(WIRE_FACTOR[k] * comm[k] for k in WIRE_FACTOR) * (world - 1) / world
    return collectives + comm["send"]


def gathered_bytes(comm: dict, world: int) -> float:
    """All-gathered bytes: by `all_gather_single`, or by point-to-point sends of a shard to
    each of the N-1 peers (flatshard on gloo, see flatshard/comm.py)."""
    return comm["all_gather"] + (comm["send"] * world / (world - 1) if world > 1 else 0)


def reduced_bytes(comm: dict) -> float:
    """Reduce-scattered input bytes: by `reduce_scatter_single`, or by one all-to-all of the
    input and a local sum (flatshard on gloo)."""
    return comm["reduce_scatter"] + comm["all_to_all"]


class CommCounter:
    """Counts calls and bytes of the Python-level collectives while `active`.

    all-gather: bytes of the gathered (output) tensor; reduce-scatter: bytes of the input
    that is reduced; all-reduce: bytes of the tensor; all-to-all: bytes of the input (flatshard
    reduce-scatters that way on gloo); send: bytes of each `isend` (flatshard all-gathers that
    way on gloo). Nested calls (a deprecated name that forwards to its `*_single`
    replacement) count once.
    """

    # name: (kind, position of the counted tensor, its keyword)
    WRAPPED = {
        "all_gather_single": ("all_gather", 0, "output_tensor"),
        "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
        "reduce_scatter_single": ("reduce_scatter", 1, "input"),
        "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
        "all_reduce": ("all_reduce", 0, "tensor"),
        "all_to_all_single": ("all_to_all", 1, "input"),
        "isend": ("send", 0, "tensor"),
    }

    def __init__(self) -> None:
        self.active = False
        self._local = threading.local()
        self.reset()

    def reset(self) -> None:
        self.bytes = dict.fromkeys(COMM_KINDS, 0)
        self.calls = dict.fromkeys(COMM_KINDS, 0)
        # counted bytes of collectives on groups smaller than the world (hpZ's, HSDP's)
        self.narrow_bytes = 0

    def install(self) -> None:
        c10d = dist.distributed_c10d
        for name, spec in self.WRAPPED.items():
            original = getattr(c10d, name)
            wrapper = self._wrap(original, *spec)
            for namespace in (dist, c10d):
                if getattr(namespace, name, None) is original:
                    setattr(namespace, name, wrapper)

    def _wrap(self, original, kind: str, position: int, keyword: str):
        counter = self

        def counted(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if counter.active and depth == 0:
                tensor = args[position] if len(args) > position else kwargs.get(keyword)
                if isinstance(tensor, torch.Tensor):
                    counter.bytes[kind] += nbytes(tensor)
                    group = kwargs.get("group")
                    if group is not None and dist.get_world_size(group) < dist.get_world_size():
                        counter.narrow_bytes += nbytes(tensor)
                counter.calls[kind] += 1
            counter._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.depth = depth

        counted.__wrapped__ = original
        counted.__name__ = original.__name__
        return counted


COUNTER = CommCounter()
