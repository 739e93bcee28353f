"""Checkpoints: DCP save/load of model, optimizer and trainer state that reshards on load,
with atomic commit, asynchronous saving, retention and integrity checks."""

from flatshard.checkpoint.full_weights import export_full, load_full
from flatshard.checkpoint.load import LoadResult, load
from flatshard.checkpoint.save import SaveHandle, save, wait_for_pending_save

__all__ = [
    "LoadResult",
    "SaveHandle",
    "export_full",
    "load",
    "load_full",
    "save",
    "wait_for_pending_save",
]
