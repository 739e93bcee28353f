"""Optimizer offload at run time: which pieces go to the host, and when their copies land.

`fully_shard(..., offload_policy=OffloadPolicy(fraction=f))` asks for a fraction f of each
rank's sharded main weights (and so of their gradients and optimizer state, which the
optimizer creates next to them) on the host. The layout chooses the pieces over every unit
below the module being sharded (layout/offload.py), so a model root sharded last brings
the whole model to f, not each unit on its own; units already sharded move their pieces
before any optimizer is built on them.

A step then moves: before each all-gather, the host part of the shard up (cast to the
compute dtype first: half the bytes for bf16), asynchronously from pinned memory; after
each reduce-scatter, the host part of the gradient down, overlapping the rest of backward;
at the end of backward the host waits for those copies, so that the optimizer reads
finished gradients (flat_bucket.py holds the two parts, comm/devices.py the copies).
"""

from __future__ import annotations

from torch import nn

from flatshard import comm, registry
from flatshard.dtensor.disk_tier import disk_tier
from flatshard.layout.offload import BucketPieces, offload_cuts
from flatshard.policy import OffloadPolicy
from flatshard.runtime.shard_placement import place_offloaded


def units_below(modules: list[nn.Module]) -> list:
    """The units managing parameters below `modules`, in the order they were created."""
    found = dict.fromkeys(unit for module in modules for unit in registry.units_below(module))
    return sorted(found, key=lambda unit: unit.created)


def place(modules: list[nn.Module], policy: OffloadPolicy) -> None:
    """Choose this rank's offloaded pieces over the units below `modules` sharded with
    `policy`, and move them there."""
    units = [unit for unit in units_below(modules) if unit.offload == policy]
    # the last units created (the root's head, the last blocks) reduce first in backward:
    # their copies to the host have the longest to overlap
    order = [
        (unit, index) for unit in reversed(units) for index in reversed(range(len(unit.buckets)))
    ]
    pieces = [
        BucketPieces.of(unit.buckets[index].specs, unit.buckets[index].layout.shard_size)
        for unit, index in order
    ]
    cuts = {
        (id(unit), index): cut
        for (unit, index), cut in zip(order, offload_cuts(pieces, policy.fraction))
    }
    pin = policy.pin_memory and units[0].mesh.device.type == "cuda" if units else False
    tier = disk_tier(policy.path) if policy.path is not None else None
    for unit in units:
        unit_cuts = [cuts[id(unit), index] for index in range(len(unit.buckets))]
        place_offloaded(unit, unit_cuts, pin, tier)


def wait_for_host_gradients(units) -> None:
    """Once backward has finished its reductions: the gradients copied to the host are
    complete before an optimizer reads them (nothing to wait for on the CPU)."""
    if any(bucket.shard.offloaded for unit in units for bucket in unit.buckets):
        done = comm.host_copies_done()
        if done is not None:
            done.synchronize()


def offloaded_bytes(model: nn.Module, optimizer=None) -> tuple[int, int]:
    """(host, disk): bytes this rank keeps off the device for `model`'s offloaded pieces:
    their main weights and gradients on the host, and `optimizer`'s state of them on the
    host or, paged, in the disk tier's files."""
    host = disk = 0
    held = set()
    for unit in units_below([model]):
        for bucket in unit.buckets:
            if bucket.shard.offloaded:
                host += bucket.shard.host_main.nbytes
                grads = bucket.shard.grad
                host += grads[1].nbytes if grads is not None and grads[1] is not None else 0
        held.update(
            id(p.sharded) for p in unit.params if unit.buckets[p.bucket].shard.on_host(p.index)
        )
    states = optimizer.state.items() if optimizer is not None else ()
    for param, state in states:
        if id(param) not in held:
            continue
        for value in state.values():
            local = getattr(value, "_local_tensor", None)
            if local is None or value.dim() == 0:
                continue
            if getattr(local, "paged", None) is not None:
                disk += local.data_.nbytes
            else:
                host += local.data_.nbytes
    return host, disk
