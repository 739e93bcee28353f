"""Optimizers that step flatshard's flat shards: torch's constructors, param groups, state
and `state_dict()` (interchangeable with `torch.optim`'s), a few ops per bucket."""

from flatshard.optim.adamw import AdamW

__all__ = ["AdamW"]
