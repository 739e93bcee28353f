"""Optimizers that step flatshard's flat shards: torch's constructors, param groups, state
and `state_dict()` (interchangeable with `torch.optim`'s), a few ops per param group."""

from flatshard.optim.adamw import AdamW
from flatshard.optim.muon import Muon, muon_param_groups
from flatshard.optim.sgd import SGD

__all__ = ["SGD", "AdamW", "Muon", "muon_param_groups"]
