"""Shared pieces of the training tests: tiny models, fixed data, a training loop that runs
the same way in one process (the reference) and on every rank of a sharded run."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import flatshard
from flatshard.models import Llama, LlamaConfig

GLOBAL_BATCH = 12  # divisible by every tested world size (1, 2, 3, 4)
SEQ = 9


def config(**overrides) -> LlamaConfig:
    return LlamaConfig.tiny(**overrides)


def build_model(cfg: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg)


def batches(cfg: LlamaConfig, steps: int, batch: int = GLOBAL_BATCH, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=generator) for _ in range(steps)
    ]


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def rank_slice(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = tokens.shape[0] // world
    return tokens[rank * per_rank : (rank + 1) * per_rank]


def train(
    model,
    data,
    *,
    rank=0,
    world=1,
    microbatches=1,
    make_optimizer=adamw,
    sync_last_only=False,
    loss_fn=lm_loss,
):
    """Train on `data` (global batches); returns the global mean loss of every step.

    With microbatches > 1 each global batch is split in that many pieces whose gradients
    accumulate; sync_last_only turns gradient sync off for all but the last piece.
    `loss_fn(model, tokens)` is this rank's loss on its slice (default: `lm_loss`).
    """
    optimizer = make_optimizer(model.parameters())
    losses = []
    for tokens in data:
        step_loss = 0.0
        pieces = tokens.chunk(microbatches)
        for i, piece in enumerate(pieces):
            if sync_last_only:
                model.set_requires_gradient_sync(i == len(pieces) - 1)
            loss = loss_fn(model, rank_slice(piece, rank, world)) / microbatches
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(step_loss, world))
    return losses


def mean_over_ranks(value: float, world: int) -> float:
    if world == 1 or not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return (tensor / world).item()


def shard(model, zero_stage: int = 3, mp_policy=None, mesh=None, offload_policy=None):
    settings = dict(
        zero_stage=zero_stage, mp_policy=mp_policy, mesh=mesh, offload_policy=offload_policy
    )
    for layer in model.layers:
        flatshard.fully_shard(layer, **settings)
    flatshard.fully_shard(model, **settings)
    return model


def hsdp_mesh(replicas: int):
    """(dp_replicate, dp_shard) over every rank: HSDP's 2-D mesh."""
    return flatshard.ParallelDims(dist.get_world_size(), dp_replicate=replicas).build().fsdp


def full_state(model) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every non-scalar optimizer state as a full tensor, keyed "fqn.name"."""
    options = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)["state"]
    return {f"{k}.{n}": v.clone() for k, s in state.items() for n, v in s.items() if v.dim()}


def rel_diff(ours: dict, reference: dict) -> float:
    """Relative difference of two state dicts: ||a - b|| / ||b|| over all tensors."""
    assert ours.keys() == reference.keys(), (sorted(ours), sorted(reference))
    diff = sum(((ours[k].float() - reference[k].float()) ** 2).sum() for k in reference)
    norm = sum((reference[k].float() ** 2).sum() for k in reference)
    return (diff / norm).sqrt().item()


def rel_losses(ours: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, reference))
