"""Where a flat optimizer finds each parameter's piece, and the flat state it keeps.

A flatshard parameter's piece on this rank is a range of its bucket's shard (on the device
up to the offload cut, on the host after it), and so is its gradient (a view of the
bucket's reduced gradient shard). A flat optimizer keeps each state (Adam's moments, SGD's
momentum) as one buffer per bucket side, the same size as that side of the shard, and gives
each parameter a DTensor view of its rows: `optimizer.state[param]` is what torch's own
optimizer would hold (the same keys, shapes and placements), so `state_dict()`, DCP and
`get_optimizer_state_dict` see no difference.

A step then runs over ranges: consecutive parameters of one bucket side, one param group
and one age (Adam's step count), merged across the padding between them (zero weights, gradients and
states: an update leaves them zero), so a bucket is a few slices, not one tensor per
parameter. Every offset comes from the parameters' `ShardSpec`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import dtensor_viewing, rows_in_layout
from flatshard.runtime.managed_param import ParamHome, home_of
from flatshard.runtime.shard_storage import ShardStorage, as_param


@dataclass(frozen=True)
class Slot:
    """One parameter's piece: `[start, start + numel)` of one side of a bucket's shard."""

    storage: ShardStorage
    host: bool  # after the offload cut
    start: int
    numel: int
    spec: object  # its ShardSpec
    home: ParamHome

    @property
    def side(self) -> tuple[int, bool]:
        return id(self.storage), self.host

    def main(self) -> torch.Tensor:
        return self.storage.host_main if self.host else self.storage.main


def slot_of(param) -> Slot | None:
    """Where `param`'s piece lives, or None for a parameter a flat step does not take: not
    flatshard's, or one whose optimizer state goes to the disk tier (paged piece by piece
    by the tier's own ops)."""
    home = home_of(param)
    if home is None or home.managed.sharded is not param or home.tier is not None:
        return None
    host, start = home.side_offset()
    return Slot(home.storage, host, start, home.spec.numel, home.spec, home)


def side_intervals(storage: ShardStorage, host: bool) -> list[tuple[int, int]]:
    """The `[start, end)` of every parameter's piece on one side of a shard, in order."""
    out = []
    for index, spec in enumerate(storage.specs):
        on_host, start = storage.side_offset(index)
        if spec.numel and on_host == host:
            out.append((start, start + spec.numel))
    return sorted(out)


def only_padding(intervals: list[tuple[int, int]], start: int, end: int) -> bool:
    """No parameter's piece lies in `[start, end)`."""
    return all(e <= start or s >= end for s, e in intervals)


class FlatStates:
    """Flat buffers of one optimizer's per-element states (e.g. 'exp_avg'), one per bucket
    side and state, and each parameter's DTensor view of its rows."""

    def __init__(self):
        self.buffers: dict[tuple[int, bool], tuple[torch.Tensor, dict]] = {}

    def buffer(self, slot: Slot) -> dict[str, torch.Tensor]:
        """The side's buffers by state name, made (zeroed) at first use, or again if the
        shard was reallocated (an offload placement, a dtype conversion)."""
        main = slot.main()
        held = self.buffers.get(slot.side)
        if held is None or held[0] is not main:
            held = self.buffers[slot.side] = (main, {})
        return held[1]

    def _named(self, slot: Slot, name: str) -> torch.Tensor:
        buffers = self.buffer(slot)
        if name not in buffers:
            buffers[name] = torch.zeros_like(slot.main())
        return buffers[name]

    def view(self, param: DTensor, slot: Slot, name: str) -> DTensor:
        """`param`'s rows of state `name`: a DTensor placed as `param` is."""
        flat = self._named(slot, name)
        rows = as_param(flat[slot.start : slot.start + slot.numel], slot.spec)
        local = param._local_tensor
        return dtensor_viewing(  # on the host when offloaded: no device copy
            RowShard(rows, slot.spec, flat, local.mesh_dim),
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
        )

    def range(self, slot: Slot, name: str, start: int, end: int) -> torch.Tensor:
        return self._named(slot, name)[start:end]

    def adopt(self, param: DTensor, slot: Slot, state: dict, names: tuple[str, ...]) -> None:
        """Make `state`'s entries `names` views of the flat buffers, keeping their values (a
        state torch made, or one `load_state_dict` put there; zeros where there is none)."""
        for name in names:
            view = self.view(param, slot, name)
            value = state.get(name)
            if value is not None:
                with torch.no_grad():
                    view.to_local().copy_(rows_in_layout(value, slot.spec))
            state[name] = view

    def holds(self, state: dict, slot: Slot, names: tuple[str, ...]) -> bool:
        """Whether `state`'s entries `names` are this side's views (nothing to adopt)."""
        buffers = self.buffers.get(slot.side)
        if buffers is None or buffers[0] is not slot.main():
            return False
        for name in names:
            value = state.get(name)
            local = getattr(value, "_local_tensor", None)
            if not isinstance(local, RowShard) or local.version_base is not buffers[1].get(name):
                return False
        return True


@dataclass
class Range:
    """Consecutive elements of one side stepped as one: `[start, end)`, the parameters in it
    and their (common) age."""

    first: Slot
    start: int
    end: int
    age: int  # what pieces stepped as one share: a step count, a buffer made or not
    params: list = field(default_factory=list)


def merge_ranges(slots: list[tuple[object, Slot, int]]) -> list[Range]:
    """Ranges of (param, slot, age) triples: consecutive pieces of one side with the same
    age, joined across gaps that hold no other parameter's piece."""
    ranges: list[Range] = []
    intervals: dict[tuple[int, bool], list] = {}
    ordered = sorted(slots, key=lambda t: (t[1].side, t[1].start))
    for param, slot, age in ordered:
        if slot.numel == 0:
            continue
        last = ranges[-1] if ranges else None
        if last is not None and last.first.side == slot.side and last.age == age:
            known = intervals.setdefault(slot.side, side_intervals(slot.storage, slot.host))
            if only_padding(known, last.end, slot.start):
                last.end = slot.start + slot.numel
                last.params.append(param)
                continue
        ranges.append(Range(slot, slot.start, slot.start + slot.numel, age, [param]))
    return ranges
