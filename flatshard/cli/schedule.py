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
