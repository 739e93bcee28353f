"""Errors a user can cause. Each message says what was wrong and how to fix it."""


class FlatShardError(Exception):
    """Base class of every error flatshard raises for bad input."""


class WrappingError(FlatShardError, ValueError):
    """`fully_shard` was called on a module it cannot wrap as asked."""


class ConfigError(FlatShardError):
    """A config file, key or value is wrong (a run's, or what `flatshard plan` is asked to
    size); the message names the key."""


class MeshError(FlatShardError, ValueError):
    """The device mesh does not fit this process or this use."""


class LayoutError(FlatShardError, ValueError):
    """The parameters cannot be laid out in row-aligned, equal shards as asked."""


class UnevenShardError(FlatShardError, NotImplementedError):
    """A DTensor operation that cannot be made correct on flatshard's uneven row shards."""


class TokenIdError(FlatShardError, IndexError):
    """Token ids outside an embedding's rows (an IndexError, as `nn.Embedding` raises)."""


class OptimizerOrderError(FlatShardError):
    """An optimizer was built on parameters before they were sharded."""


class CheckpointError(FlatShardError):
    """A checkpoint is missing, incomplete, corrupted, or does not match the model."""


class StatesOffloadedError(FlatShardError, RuntimeError):
    """The model's or optimizer's states are on the host (`flatshard.offload_states`) and
    something needs them on the device: `flatshard.reload_states` first."""


class OffloadError(FlatShardError, OSError):
    """The optimizer offload cannot hold its state where it was asked to (a fraction out of
    range, a directory that cannot be written, a disk that is full)."""


class PeerFailedError(FlatShardError, RuntimeError):
    """Another rank failed while this one waited for it in a collective: the message names
    that rank and its exception (`flatshard/comm/peer_failure.py`)."""


class WeightSyncError(FlatShardError, RuntimeError):
    """Weights streamed to receivers (`flatshard.sync_weights`) cannot be sent or applied as
    asked: a bad address or rank, names the receiving model lacks, or an update refused
    because its senders disagree on its version (nothing of it is applied)."""
