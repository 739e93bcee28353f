"""Errors a user of the command line can cause. `main` prints them as one line, no traceback."""

from flatshard.errors import FlatShardError


class ConfigError(FlatShardError):
    """A config file, key or value is wrong; the message names the key."""


class DataError(FlatShardError):
    """The training data is missing, unreadable or does not fit the model."""


class RunError(FlatShardError):
    """A run directory or checkpoint cannot be used as asked (e.g. nothing to resume)."""


class TrainingStopped(FlatShardError):
    """Training stopped on its own (a non-finite loss); the last good checkpoint is kept."""
