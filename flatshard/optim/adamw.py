"""`flatshard.optim.AdamW`: torch's AdamW (same constructor, param groups, state and
`state_dict()`), stepping each bucket's shard as a few flat ranges.

torch's AdamW steps every parameter as its own tensor: on flatshard each one is a DTensor
over a `RowShard`, so each of its ~10 ops per parameter dispatches twice in Python. Here
the moments are flat buffers per bucket side (flat_state.py) and each op runs once per
group and device over a handful of plain slices, in the order and with the scalars torch's
AdamW uses, so the results are torch's bit for bit. A group with `fused=True` goes to
torch's fused kernel once per device over the same slices (cut where torch's CPU kernel
switches to scalar code for a piece's tail: plan.fused_pieces), so it equals torch's fused
AdamW on the same pieces bit for bit, at several times the speed. Parameters a flat step
cannot take (not flatshard's, state in the disk tier, a gradient that is not the reduced
shard's view) and groups with options it does not implement (amsgrad, capturable,
differentiable, a tensor lr or betas) go through torch's own code. On a CPU of unknown
vector width the fused kernel gets each piece on its own (torch's fused AdamW exactly).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from flatshard.optim.flat_optimizer import FlatStepping
from flatshard.optim.flat_ranges import FlatPlan

_MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamW(FlatStepping, torch.optim.AdamW):
    """`torch.optim.AdamW` over flatshard's flat shards: torch's constructor, param groups
    and state (`step`, `exp_avg`, `exp_avg_sq` placed like their parameter), each step
    torch's own op sequence over a few slices of each shard (`fused=True`: torch's fused
    kernel over them); bitwise torch's results at any world size, stage, TP or EP."""

    @staticmethod
    def _flat_options(group: dict) -> bool:
        return not (
            group["amsgrad"]
            or group["capturable"]
            or group["differentiable"]
            or any(isinstance(v, torch.Tensor) for v in (group["lr"], *group["betas"]))
        )

    @staticmethod
    def _state_names(group: dict) -> tuple[str, ...]:
        return _MOMENTS

    @staticmethod
    def _age(state: dict) -> int:
        """The step count (torch keeps it per parameter, a float32 tensor on the CPU)."""
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
        return int(state["step"].item())

    def _flat_step(self, group: dict, plan: FlatPlan, parts: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        torch._foreach_add_(plan.steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
        if plan.fused:
            return self._fused_step(group, plan, parts)
        for index, ranges in enumerate(plan.batches):
            params, exp_avgs, exp_avg_sqs = self._views(plan, index, _MOMENTS)
            grads = plan.grads(ranges, parts)
            for r in ranges:
                r.age += 1
            if group["maximize"]:
                grads = torch._foreach_neg(grads)
            if decay != 0:
                torch._foreach_mul_(params, 1 - lr * decay)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            del grads
            step_size = [(lr / (1 - beta1 ** float(r.age))) * -1 for r in ranges]
            bias_correction2_sqrt = [(1 - beta2 ** float(r.age)) ** 0.5 for r in ranges]
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

    def _fused_step(self, group: dict, plan: FlatPlan, parts: dict) -> None:
        """torch's fused AdamW kernel, one call per device over every piece of the plan."""
        beta1, beta2 = group["betas"]
        for index, ranges in enumerate(plan.batches):
            params, exp_avgs, exp_avg_sqs = self._views(plan, index, _MOMENTS)
            device = ranges[0].first.main().device
            ages: dict[int, torch.Tensor] = {}  # the kernel reads a step count per tensor
            for r in ranges:
                r.age += 1
                if r.age not in ages:  # float32, as torch's fused AdamW keeps its steps
                    ages[r.age] = torch.tensor(float(r.age), dtype=torch.float32, device=device)
            torch._fused_adamw_(
                params,
                plan.grads(ranges, parts),
                exp_avgs,
                exp_avg_sqs,
                [],
                [ages[r.age] for r in ranges],
                amsgrad=False,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )

    def _torch_step(self, group: dict, params: list) -> None:
        """torch's own AdamW step of `params` (those of `group` a flat step does not take)."""
        if not params:
            return
        lists = ([], [], [], [], [], [])
        has_complex = self._init_group({**group, "params": params}, *lists)
        beta1, beta2 = group["betas"]
        adam(
            *lists,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )
