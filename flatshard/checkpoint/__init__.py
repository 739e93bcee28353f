"""Checkpoints: DCP save/load of model, optimizer and trainer state that reshards on load,
with atomic commit, asynchronous saving, retention and integrity checks."""

from flatshard.checkpoint.load import LoadResult, load
from flatshard.checkpoint.save import SaveHandle, save, wait_for_pending_save

__all__ = ["LoadResult", "SaveHandle", "load", "save", "wait_for_pending_save"]
