"""flatshard: fully sharded data parallel training on flat, row-aligned buffers."""

from flatshard.api import FlatShardModule, fully_shard
from flatshard.errors import (
    FlatShardError,
    LayoutError,
    MeshError,
    OptimizerOrderError,
    UnevenShardError,
    WrappingError,
)
from flatshard.materialize import materialize
from flatshard.policy import MixedPrecisionPolicy

__all__ = [
    "FlatShardError",
    "FlatShardModule",
    "LayoutError",
    "MeshError",
    "MixedPrecisionPolicy",
    "OptimizerOrderError",
    "UnevenShardError",
    "WrappingError",
    "fully_shard",
    "materialize",
]
