"""flatshard: fully sharded data parallel training on flat, row-aligned buffers."""

# The rest of `torch.distributed.fsdp`'s FSDP2 names, so a script ports by its import line:
# flatshard's modules are FSDPModules, its unshard handles UnshardHandles, and
# `fully_shard` takes FSDP2's CPUOffloadPolicy and DataParallelMeshDims as they are.
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, UnshardHandle

from flatshard import checkpoint, hf, models, optim
from flatshard.api.fsdp_module import (
    FlatShardModule,
    register_fsdp_forward_method,
    share_comm_ctx,
    weights_changed,
)
from flatshard.api.materialize import materialize
from flatshard.api.parallel_plan import ParallelPlan, StageParts, register_plan
from flatshard.api.parallelize import parallelize
from flatshard.api.pipeline import Pipeline, PipelineStage, pipeline
from flatshard.api.pipeline_split import stage_modules
from flatshard.api.sharding import fully_shard
from flatshard.api.state_movement import offload_states, reload_states
from flatshard.comm.sync_group import SyncGroup, weight_sync_group
from flatshard.compat import DataParallelMeshDims
from flatshard.dtensor.clip import clip_grad_norm_
from flatshard.dtensor.sharded_param import row_range
from flatshard.errors import (
    FlatShardError,
    LayoutError,
    MeshError,
    OffloadError,
    OptimizerOrderError,
    PeerFailedError,
    StatesOffloadedError,
    TokenIdError,
    UnevenShardError,
    WeightSyncError,
    WrappingError,
)
from flatshard.hf.stream import full_weights
from flatshard.hf.sync_receive import ReceiveStats, receive_weights
from flatshard.hf.sync_send import SyncStats, end_weight_sync, sync_weights
from flatshard.mesh import Meshes, ParallelDims
from flatshard.policy import CommPolicy, MixedPrecisionPolicy, OffloadPolicy
from flatshard.registry import unit_of as state
from flatshard.registry import units_below as units

# flatshard.hf's names for the transformers family, which lives above it (models/): the face
# hands them down, so `flatshard.hf.shard_decoder_layers` keeps working
hf.TRANSFORMERS = models.TRANSFORMERS
hf.build_causal_lm = models.build_causal_lm
hf.shard_decoder_layers = models.shard_decoder_layers

__all__ = [
    "CommPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "UnshardHandle",
    "FlatShardError",
    "FlatShardModule",
    "LayoutError",
    "MeshError",
    "Meshes",
    "MixedPrecisionPolicy",
    "OffloadError",
    "OffloadPolicy",
    "OptimizerOrderError",
    "PeerFailedError",
    "StatesOffloadedError",
    "ParallelDims",
    "ParallelPlan",
    "Pipeline",
    "PipelineStage",
    "ReceiveStats",
    "StageParts",
    "SyncGroup",
    "SyncStats",
    "TokenIdError",
    "UnevenShardError",
    "WeightSyncError",
    "WrappingError",
    "checkpoint",
    "clip_grad_norm_",
    "end_weight_sync",
    "full_weights",
    "fully_shard",
    "hf",
    "materialize",
    "models",
    "offload_states",
    "optim",
    "parallelize",
    "pipeline",
    "register_plan",
    "register_fsdp_forward_method",
    "receive_weights",
    "reload_states",
    "row_range",
    "share_comm_ctx",
    "stage_modules",
    "state",
    "sync_weights",
    "units",
    "weight_sync_group",
    "weights_changed",
]
