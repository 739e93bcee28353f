"""Reference models for flatshard's tests and examples."""

from flatshard.models import plans  # noqa: F401  (registers the reference models' plans)
from flatshard.models.llama import Llama, LlamaConfig
from flatshard.models.moe import MoE
from flatshard.models.moe_balance import update_score_bias
from flatshard.models.moe_config import MoEConfig
from flatshard.models.moe_loss import load_balancing_loss
from flatshard.models.router import RouterStats

__all__ = [
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "RouterStats",
    "load_balancing_loss",
    "update_score_bias",
]
