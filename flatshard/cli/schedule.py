"""Learning rate: linear warmup to the peak, then cosine decay to the minimum."""

from __future__ import annotations

import math


def learning_rate(step: int, *, peak: float, minimum: float, warmup: int, total: int) -> float:
    """The rate for optimizer step `step` (0-based) of `total`; warmup is cut at `total`."""
    warmup = min(warmup, total)
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return minimum + (peak - minimum) * 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULE_KEYS = ("steps", "lr", "min_lr", "warmup_steps")


def schedule_change(saved_train: dict, train, step: int) -> str | None:
    """What a resume with other schedule settings (`train`, against the run's `saved_train`)
    does to the rate of the next step, `step` (0-based); None when nothing changed."""
    changed = [k for k in SCHEDULE_KEYS if saved_train.get(k) != getattr(train, k)]
    if not changed or any(k not in saved_train for k in SCHEDULE_KEYS):
        return None

    def rate(values) -> float:
        return learning_rate(step, peak=values["lr"], minimum=values["min_lr"],
                             warmup=values["warmup_steps"], total=values["steps"])  # fmt: skip

    now = rate({k: getattr(train, k) for k in SCHEDULE_KEYS})
    what = ", ".join(f"train.{k} {saved_train[k]:g} -> {getattr(train, k):g}" for k in changed)
    return (
        f"{what}: the learning-rate schedule is recomputed; step {step + 1} runs at "
        f"{now:.3g} (the run's schedule: {rate(saved_train):.3g})"
    )
