"""`flatshard.optim.SGD`: torch's SGD (same constructor, param groups, state and
`state_dict()`), stepping each bucket's shard as a few flat ranges (see adamw.py).

The momentum buffer is a flat buffer per bucket side; a piece's buffer starts as its
gradient, as torch's starts as a clone of it, so pieces with and without one yet are
stepped as different ranges. Groups with options the flat step does not implement (fused,
differentiable, a tensor lr) go through torch's own code.
"""

from __future__ import annotations

import torch
from torch.optim.sgd import sgd

from flatshard.optim.flat_optimizer import FlatStepping
from flatshard.optim.flat_ranges import FlatPlan

_MOMENTUM = ("momentum_buffer",)


class SGD(FlatStepping, torch.optim.SGD):
    """`torch.optim.SGD` over flatshard's flat shards: torch's constructor, param groups and
    state (`momentum_buffer` placed like its parameter), each step torch's own op sequence
    over a few slices of each shard instead of one parameter at a time; bitwise torch's."""

    @staticmethod
    def _flat_options(group: dict) -> bool:
        return not (
            group["fused"] or group["differentiable"] or isinstance(group["lr"], torch.Tensor)
        )

    @staticmethod
    def _state_names(group: dict) -> tuple[str, ...]:
        return _MOMENTUM if group["momentum"] != 0 else ()

    @staticmethod
    def _age(state: dict) -> int:
        """1 once the piece has a momentum buffer."""
        return int(state.get("momentum_buffer") is not None)

    def _flat_step(self, group: dict, plan: FlatPlan, parts: dict) -> None:
        lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for index, ranges in enumerate(plan.batches):
            params, *states = self._views(plan, index, self._state_names(group))
            grads = plan.grads(ranges, parts)
            if group["maximize"]:
                grads = torch._foreach_neg(grads)
            if decay != 0:
                grads = torch._foreach_add(grads, params, alpha=decay)
            if momentum != 0:
                (buffers,) = states
                started = [i for i, r in enumerate(ranges) if r.age]
                if started:
                    torch._foreach_mul_([buffers[i] for i in started], momentum)
                    torch._foreach_add_(
                        [buffers[i] for i in started],
                        [grads[i] for i in started],
                        alpha=1 - group["dampening"],
                    )
                for i, r in enumerate(ranges):
                    if not r.age:  # torch's first buffer: a clone of the gradient
                        buffers[i].copy_(grads[i])
                        r.age = 1
                if group["nesterov"]:
                    grads = torch._foreach_add(grads, buffers, alpha=momentum)
                else:
                    grads = buffers
            torch._foreach_add_(params, grads, alpha=-lr)

    def _torch_step(self, group: dict, params: list) -> None:
        """torch's own SGD step of `params` (those of `group` a flat step does not take)."""
        if not params:
            return
        grads, buffers = [], []
        has_sparse_grad = self._init_group({**group, "params": params}, [], grads, buffers)
        sgd(
            params,
            grads,
            buffers,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            has_sparse_grad=has_sparse_grad,
            foreach=group["foreach"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
        )
        if group["momentum"] != 0:
            for param, buffer in zip(params, buffers, strict=True):
                self.state[param]["momentum_buffer"] = buffer
