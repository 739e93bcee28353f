"""flatshard: fully sharded data parallel training on flat, row-aligned buffers."""

from flatshard import checkpoint, hf
from flatshard.api import FlatShardModule, fully_shard, weights_changed
from flatshard.errors import (
    FlatShardError,
    LayoutError,
    MeshError,
    OptimizerOrderError,
    TokenIdError,
    UnevenShardError,
    WrappingError,
)
from flatshard.materialize import materialize
from flatshard.policy import MixedPrecisionPolicy
from flatshard.row_shard import row_range

__all__ = [
    "FlatShardError",
    "FlatShardModule",
    "LayoutError",
    "MeshError",
    "MixedPrecisionPolicy",
    "OptimizerOrderError",
    "TokenIdError",
    "UnevenShardError",
    "WrappingError",
    "checkpoint",
    "fully_shard",
    "hf",
    "materialize",
    "row_range",
    "weights_changed",
]
