"""Parallelism applied from outside the model (layer 7): tensor-parallel plans for the
reference models, built on `torch.distributed.tensor.parallel`.

tensor_parallel.py  the Llama plan (attention and MLP split over a TP mesh) and its checks
expert_parallel.py  experts split over an EP mesh, tokens dispatched by all-to-all
"""

from flatshard.parallel.expert_parallel import ExpertParallel
from flatshard.parallel.tensor_parallel import (
    LLAMA_BLOCK_PLAN,
    FusedColwiseParallel,
    check_tp,
    parallelize_llama,
    parallelize_moe,
    tp_local_shape,
)

__all__ = [
    "ExpertParallel",
    "LLAMA_BLOCK_PLAN",
    "FusedColwiseParallel",
    "check_tp",
    "parallelize_llama",
    "parallelize_moe",
    "tp_local_shape",
]
