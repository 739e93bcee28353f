"""Parallel styles applied from outside a model (layer 7), built on
`torch.distributed.tensor.parallel`; a model family's plan (flatshard/models/<family>/
parallel.py) puts them together.

tensor_parallel.py  fused column parallelism (components kept whole per rank), head norms
expert_parallel.py  experts split over an EP mesh, tokens dispatched by all-to-all
latent_attention.py  DeepSeek's MLA split by heads
gated_deltanet.py  Qwen3-Next's Gated DeltaNet split by heads
transformers_plan.py  transformers' own base_model_tp_plan / base_model_ep_plan, applied
transformers_sequence.py  that plan with the sequence split between the blocks (SP)
context_parallel.py  the sequence split over a CP mesh, attention over all of it
chunk_attention.py  a query chunk's causal attention over the keys up to its end, maskless
"""

from flatshard.parallel.context_parallel import (
    ContextParallel,
    apply_context_parallel,
    sequence_positions,
    split_sequence,
)
from flatshard.parallel.expert_parallel import ExpertParallel
from flatshard.parallel.tensor_parallel import FusedColwiseParallel, HeadNormParallel

__all__ = [
    "ContextParallel",
    "ExpertParallel",
    "FusedColwiseParallel",
    "HeadNormParallel",
    "apply_context_parallel",
    "sequence_positions",
    "split_sequence",
]
