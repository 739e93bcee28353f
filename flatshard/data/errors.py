"""The error of the data layer: training data that is missing, unreadable or does not fit
the model (`flatshard train` prints it as one line)."""

from flatshard.errors import FlatShardError


class DataError(FlatShardError):
    """The training data is missing, unreadable or does not fit the model."""
