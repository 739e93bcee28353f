"""Which parameters of a param group a flat step takes, and its ranges, kept between steps.

A parameter is taken when it is flatshard's (flat_state.slot_of) and its gradient is the
view of its bucket's reduced gradient shard that flatshard set (a gradient someone else
put there is stepped by torch's code). The ranges are rebuilt when the taken parameters
change (one got its first gradient, or none this step), when a shard was reallocated, or
after `load_state_dict`.
"""

from __future__ import annotations

import torch

from flatshard import compat
from flatshard.dtensor.row_shard import RowShard
from flatshard.optim.flat_state import Range, Slot, slot_of


class SlotCache:
    """Each parameter's slot, looked up once (slot_of walks the registry and the layout):
    valid while its shard keeps its buffer, which every re-layout (an offload placement, a
    dtype conversion) allocates anew."""

    def __init__(self):
        self._slots: dict[int, tuple[object, Slot, torch.Tensor]] = {}

    def __call__(self, param) -> Slot | None:
        held = self._slots.get(id(param))
        if held is not None and held[0] is param and held[1].storage.main is held[2]:
            return held[1]
        slot = slot_of(param)
        if slot is not None:
            self._slots[id(param)] = (param, slot, slot.storage.main)
        return slot


def split_group(
    group: dict, slots: SlotCache, grads: dict
) -> tuple[list[tuple[object, Slot]], list]:
    """(the (param, slot) a flat step takes, the other parameters with gradients). `grads`
    collects each shard's kept gradient parts, looked up once per step (FlatPlan.grads
    reads them)."""
    flat, rest = [], []
    for param in group["params"]:
        grad = param.grad
        if grad is None:
            continue
        slot = slots(param)
        if slot is None or not _is_the_reduced_view(grad, slot, grads):
            rest.append(param)
        else:
            flat.append((param, slot))
    return flat, rest


def _is_the_reduced_view(grad, slot: Slot, grads: dict) -> bool:
    local = getattr(grad, "_local_tensor", None)
    if not isinstance(local, RowShard):
        return False
    if id(slot.storage) not in grads:  # read once a shard a step (FlatPlan.grads too)
        grads[id(slot.storage)] = slot.storage.grad
    return slot.home.holds_flat_grad(local.data_, grads[id(slot.storage)])


# Elements stepped by one run of the ops. On a GPU: bounds the temporaries a step makes
# (Adam's denominator, a decayed gradient) whatever the shard's size (2**24 fp32: 64 MiB). On
# the CPU a step is memory-bound: run over 2**17 elements (512 KiB per fp32 tensor), the
# ~10 ops of Adam find their operands in the cache, not in RAM (2.2x faster than one run
# over a 9.4M-element shard, results bit for bit the same: every op is elementwise).
BATCH_ELEMENTS = 2**24
CPU_BATCH_ELEMENTS = 2**17


def batch_elements(device: torch.device) -> int:
    return CPU_BATCH_ELEMENTS if device.type == "cpu" else BATCH_ELEMENTS


class FlatPlan:
    """A group's ranges in batches (one device each, at most `batch_elements` elements: a
    longer range is cut; the ops are elementwise), and the step counters of its
    parameters. For a fused kernel (`slots` given: each parameter's piece) the ranges are
    cut at the pieces' scalar tails instead (fused_pieces), one batch per device."""

    def __init__(self, ids: tuple, mains: dict, ranges: list[Range], steps: list, slots=None):
        self.ids, self.mains, self.steps, self.fused = ids, mains, steps, slots is not None
        self.views: dict = {}  # per batch: slices of the weights and states (flat_optimizer)
        by_device: dict[torch.device, list[Range]] = {}
        for r in ranges:
            main = r.first.main()
            if self.fused:
                unit = compat.fused_tail_unit(main.device, main.dtype)
                pieces = fused_pieces(r, [slots[id(p)] for p in r.params], unit)
                by_device.setdefault(main.device, []).extend(pieces)
                continue
            limit = batch_elements(main.device)
            for start in range(r.start, r.end, limit):
                end = min(start + limit, r.end)
                piece = Range(r.first, start, end, r.age, r.params)
                by_device.setdefault(main.device, []).append(piece)
        self.batches: list[list[Range]] = []
        for device, pieces in by_device.items():
            if self.fused:
                self.batches.append(pieces)
                continue
            limit = batch_elements(device)
            batch, size = [], 0
            for piece in pieces:
                if batch and size + piece.end - piece.start > limit:
                    self.batches.append(batch)
                    batch, size = [], 0
                batch.append(piece)
                size += piece.end - piece.start
            self.batches.append(batch)

    @classmethod
    def of(cls, flat: list, ranges: list[Range], steps: list, fused: bool) -> FlatPlan:
        mains = {slot.side: slot.main() for _, slot in flat}
        slots = {id(param): slot for param, slot in flat} if fused else None
        return cls(tuple(id(param) for param, _ in flat), mains, ranges, steps, slots)

    def fits(self, flat: list[tuple[object, Slot]], fused: bool) -> bool:
        """Still the plan of these parameters on the same buffers, for the same kernels."""
        if fused != self.fused or tuple(id(param) for param, _ in flat) != self.ids:
            return False
        return all(self.mains.get(slot.side) is slot.main() for _, slot in flat)

    @staticmethod
    def grads(ranges: list[Range], parts: dict) -> list[torch.Tensor]:
        """The ranges of this step's reduced gradient shards (`parts`: each shard's gradient
        parts, as split_group found them)."""
        return [
            parts[id(r.first.storage)][1 if r.first.host else 0][r.start : r.end] for r in ranges
        ]


def fused_pieces(r: Range, slots: list[Slot], unit: int | None) -> list[Range]:
    """`r` cut so that a fused kernel steps each parameter's piece as it does when it steps
    that piece alone: its first numel - numel % unit elements in vectors, the rest in scalar
    code (compat.fused_tail_unit). A cut goes around each such tail, and before a piece that
    padding put off the vector grid of the cut it is in (padding steps as either: zeros).
    An unknown unit (None): every piece on its own."""
    pieces, start = [], r.start

    def cut(begin: int, end: int) -> None:
        if end > begin:
            pieces.append(Range(r.first, begin, end, r.age, r.params))

    if unit is None:
        for slot in sorted(slots, key=lambda s: s.start):
            cut(slot.start, slot.start + slot.numel)
        return pieces

    for slot in sorted(slots, key=lambda s: s.start):
        if (slot.start - start) % unit:
            cut(start, slot.start)
            start = slot.start
        tail = slot.numel % unit
        if tail:
            end = slot.start + slot.numel
            cut(start, end - tail)
            cut(end - tail, end)
            start = end
    cut(start, r.end)
    return pieces
