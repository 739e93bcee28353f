"""The order units run in, what each prefetches, and what stays gathered into backward.

The first unit to run forward becomes the root of every unit below it; their shared
`RootContext` records the pre-forward order (the next step's forward prefetch order) and
the post-forward order (reversed: this step's backward prefetch order), which pass is
running, the buffers freed during it and the reduce-scatters in flight. Orders are
recorded at run time, so a model whose forward differs from its module order prefetches
what it really runs next. What stays gathered follows gather_policy.py, the rule the
planner and the benchmarks count with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flatshard import comm, registry
from flatshard.runtime.gather_policy import stays_gathered
from flatshard.runtime.grad_sync import ReduceQueue
from flatshard.runtime.states import Pass, check_move


@dataclass
class RootContext:
    """State shared by the units of one model."""

    units: list
    root: object
    pre_forward_order: list = field(default_factory=list)
    previous_pre_forward_order: list = field(default_factory=list)
    post_forward_order: list = field(default_factory=list)
    running: Pass = Pass.IDLE
    buffers: comm.BufferPool = field(default_factory=comm.BufferPool)  # emptied every pass
    reduces: ReduceQueue = field(default_factory=ReduceQueue)

    @property
    def in_backward(self) -> bool:
        return self.running is Pass.BACKWARD

    def pool(self) -> comm.BufferPool | None:
        return None if self.running is Pass.IDLE else self.buffers

    def _move(self, new: Pass) -> None:
        self.running = check_move(self.running, new)

    def start_forward(self) -> None:
        """The root's pre-forward: a new step's order begins."""
        self._move(Pass.FORWARD)
        self.previous_pre_forward_order = self.pre_forward_order
        self.pre_forward_order, self.post_forward_order = [], []

    def end_forward(self) -> None:
        self._move(Pass.IDLE)
        # Buffers the blocks freed would sit idle through the loss and the start of
        # backward, where memory peaks: let them go (backward refills the pool).
        self.buffers.clear()

    def start_backward(self) -> None:
        self._move(Pass.BACKWARD)

    def end_backward(self) -> None:
        self._move(Pass.IDLE)
        self.buffers.clear()

    def reset(self) -> None:
        """A forward or backward that raised: whatever ran has ended."""
        self.running = Pass.IDLE
        self.buffers.clear()

    def ran_pre_forward(self, unit) -> None:
        if unit not in self.pre_forward_order:  # a unit over several modules: once
            self.pre_forward_order.append(unit)

    def ran_post_forward(self, unit) -> None:
        if unit in self.post_forward_order:  # the last call orders backward
            self.post_forward_order.remove(unit)
        self.post_forward_order.append(unit)

    def prefetch_targets(self, unit, forward: bool) -> list:
        """The unit(s) to gather after `unit`: set by the user, else the one after it in the
        order recorded at run time (pre-forward order of the previous step for forward,
        reversed post-forward order of this step for backward)."""
        explicit = unit.forward_prefetch if forward else unit.backward_prefetch
        if explicit is None:
            order = self.previous_pre_forward_order if forward else self.post_forward_order[::-1]
            explicit = order[order.index(unit) + 1 :][:1] if unit in order else []
        return [t for t in explicit if forward or t.unshard_in_backward]

    def stays_gathered(self, unit) -> bool:
        """Whether `unit` stays gathered from forward into backward (gather_policy.py), by
        last step's forward order (before the first step: root parts only)."""
        root_part = lambda u: u.root_part or u is self.root
        order = self.previous_pre_forward_order
        if unit not in order:  # its place is not known yet
            return len(self.units) > 1 and root_part(unit)
        flags = [root_part(u) for u in order]
        return stays_gathered(order.index(unit), flags, len(self.units))


def context_of(unit) -> RootContext:
    """The unit's model context; the first unit to run forward becomes the root of every
    unit below it that has none yet."""
    if unit.context is None:
        units = dict.fromkeys(u for m in unit.modules for u in registry.units_below(m))
        context = RootContext(units=[u for u in units if u.context is None], root=unit)
        for each in context.units:
            each.context = context
    return unit.context
