"""What a flat optimizer adds to torch's: `step()` splits each param group into the
parameters a flat step takes (flat_ranges.py) and the rest, which torch's own code steps; the flat
ones are stepped over merged ranges of their buckets' shards (flat_state.py) by the
subclass's `_flat_step`, with the op sequence and scalars of torch's implementation.

A subclass (AdamW, SGD) derives from the torch optimizer and this mixin and says: which
options its flat step implements, the per-element states it keeps and each parameter's
age (what must be equal for two pieces to be stepped as one: Adam's step count, whether
SGD's momentum buffer exists yet).
"""

from __future__ import annotations

import torch

from flatshard.optim.flat_ranges import FlatPlan, SlotCache, split_group
from flatshard.optim.flat_state import FlatStates, Range, merge_ranges


class FlatStepping:
    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)  # the torch optimizer's, as it takes them
        self._flat = FlatStates()
        self._plans: dict[int, FlatPlan] = {}
        self._slots = SlotCache()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._plans.clear()  # the loaded states are adopted into the flat buffers next step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            with_grad = [p for p in group["params"] if p.grad is not None]
            for param in with_grad:  # states in parameter order, as torch's (a state
                self.state[param]  # dict lists them in that order on every rank)
            if self._own_step(group):
                continue
            if not self._flat_options(group) or getattr(self, "grad_scale", None) is not None:
                self._torch_step(group, with_grad)
                continue
            grads: dict = {}  # each shard's gradient parts, looked up once this step
            flat, rest = split_group(group, self._slots, grads)
            if rest:
                self._torch_step(group, rest)
            if flat:
                plan = self._plans.get(index)
                if plan is None or not plan.fits(flat, self._fused(group)):
                    plan = self._plans[index] = self._plan(flat, group)
                self._flat_step(group, plan, grads)
        return loss

    def _own_step(self, group: dict) -> bool:
        """A subclass's own algorithm for this group (Muon's matrices): True once stepped."""
        return False

    def _plan(self, flat: list, group: dict) -> FlatPlan:
        """Each parameter's state adopted into the flat buffers, the pieces merged into
        ranges (by side and age)."""
        triples, steps = [], []
        names = self._state_names(group)
        for param, slot in flat:
            state = self.state[param]
            age = self._age(state)
            if names and not self._flat.holds(state, slot, names):
                self._flat.adopt(param, slot, state, names)
            triples.append((param, slot, age))
            if "step" in state:
                steps.append(state["step"])
        return FlatPlan.of(flat, merge_ranges(triples), steps, self._fused(group))

    @staticmethod
    def _fused(group: dict) -> bool:
        """Whether the group is stepped by torch's fused kernel (one call per device)."""
        return bool(group.get("fused"))

    def _views(self, plan: FlatPlan, index: int, names: tuple[str, ...]) -> list[list]:
        """Batch `index`'s main-weight ranges and those of the states `names`: slices of
        buffers that live as long as the plan, so made once per plan, not per step."""
        key = (index, names)
        views = plan.views.get(key)
        if views is None:
            ranges = plan.batches[index]
            views = [[self._main(r) for r in ranges]]
            views += [[self._state(r, name) for r in ranges] for name in names]
            plan.views[key] = views
        return views

    def _state(self, r: Range, name: str) -> torch.Tensor:
        return self._flat.range(r.first, name, r.start, r.end)

    @staticmethod
    def _main(r: Range) -> torch.Tensor:
        return r.first.main()[r.start : r.end]
