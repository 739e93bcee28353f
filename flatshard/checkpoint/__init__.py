"""Checkpoints: DCP save/load of model, optimizer and trainer state that reshards on load,
with atomic commit, asynchronous saving in bounded waves, retention and integrity checks.
Each rank plans a save or a load from the layout alone (global_plan.py): no plan gather."""

from flatshard.checkpoint.full_weights import export_full, load_full
from flatshard.checkpoint.load import LoadResult, load
from flatshard.checkpoint.rank_file import DEFAULT_STAGING_BYTES
from flatshard.checkpoint.save import SaveHandle, save, wait_for_pending_save

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "LoadResult",
    "SaveHandle",
    "export_full",
    "load",
    "load_full",
    "save",
    "wait_for_pending_save",
]
