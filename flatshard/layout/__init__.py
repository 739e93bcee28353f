"""The layout: the only place that computes offsets (DESIGN.md, "coordinates").

params.py   what the layout knows of a parameter: shape, global placement, components
packing.py  packing a unit's parameters into row-aligned, equally sharded buckets
bucket.py   the buckets and the translations between param, bucket, shard and global
spec.py     `ShardSpec`: what one rank holds of one parameter, read by everything else
tensor_parallel.py  a TP rank's local parameter in its global tensor
"""

from flatshard.layout.bucket import BucketLayout, ParamSlot, UnitLayout
from flatshard.layout.packing import MERGE_TOLERANCE, plan_unit_layout, single_lcm_padded_size
from flatshard.layout.params import (
    Component,
    ParamInfo,
    declared_components,
    describe_param,
    stacked_components,
)
from flatshard.layout.spec import (
    Box,
    ComponentPiece,
    ShardSpec,
    contiguous_strides,
    whole_param_spec,
)
from flatshard.layout.tensor_parallel import tp_block_info, tp_split_info

__all__ = [
    "MERGE_TOLERANCE",
    "Box",
    "BucketLayout",
    "Component",
    "ComponentPiece",
    "ParamInfo",
    "ParamSlot",
    "ShardSpec",
    "UnitLayout",
    "contiguous_strides",
    "declared_components",
    "describe_param",
    "plan_unit_layout",
    "single_lcm_padded_size",
    "stacked_components",
    "tp_block_info",
    "tp_split_info",
    "whole_param_spec",
]
