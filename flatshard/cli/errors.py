"""Errors a user of the command line can cause. `main` prints them as one line, no traceback.
Warnings are one line too: `flatshard: warning: ...`."""

import os
import sys

from flatshard.data.errors import DataError  # noqa: F401  (the data layer's, raised here too)
from flatshard.errors import ConfigError, FlatShardError  # noqa: F401  (ConfigError: the CLI's too)


def warn(message: str, per_node: bool = False) -> None:
    """Print `flatshard: warning: MESSAGE` once: on rank 0 (under torchrun every rank runs
    the command), or once per node with `per_node` (what differs between nodes)."""
    variable = "LOCAL_RANK" if per_node else "RANK"
    if int(os.environ.get(variable, 0)) == 0:
        print(f"flatshard: warning: {message}", file=sys.stderr, flush=True)


class RunError(FlatShardError):
    """A run directory or checkpoint cannot be used as asked (e.g. nothing to resume)."""


class TrainingStopped(FlatShardError):
    """Training stopped on its own (a non-finite loss); the last good checkpoint is kept."""
