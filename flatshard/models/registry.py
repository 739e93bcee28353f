"""The model families flatshard knows, keyed by config and model type.

A family is one folder of `flatshard/models/` (its model, config, Hugging Face adapter and
config conversion, parallel plan) that registers one `ModelFamily` here; the trainer, the
planner and `parallelize` ask the registry instead of branching on a family. Adding a
family = one folder + one `register(...)` line in its `__init__.py`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flatshard.api.parallel_plan import ParallelPlan, register_plan


def next_token_loss(
    model: nn.Module, batch: torch.Tensor, group=None, labels=None, divisor=None,
    position_ids=None,
) -> torch.Tensor:  # fmt: skip
    """Cross-entropy of each token's prediction of the next (a transformers model's output
    object included; plus a transformers MoE's load-balancing loss where its config sets
    output_router_logits); see `token_loss` for `labels` and `divisor`. `position_ids`
    [B, T]: packed documents (see `position_kwargs`)."""
    inputs, targets, position_ids = model_inputs(model, batch, labels, position_ids)
    output = model(inputs, **position_kwargs(model, position_ids))
    loss = token_loss(getattr(output, "logits", output), targets, divisor)
    router_logits = getattr(output, "router_logits", None)
    if router_logits:  # a transformers MoE whose config asks for its load-balancing loss
        from flatshard.models.moe.loss import transformers_balancing_loss  # (moe imports us)

        loss = loss + transformers_balancing_loss(model, router_logits, group)
    return loss


def model_inputs(model: nn.Module, batch: torch.Tensor, labels=None, position_ids=None):
    """(inputs, targets, position_ids) of `batch` [B, T + 1] as the model takes them: the
    targets its next tokens, or `labels`; under context parallelism this rank's part of
    each sequence, with its positions."""
    inputs, targets = batch[:, :-1], batch[:, 1:] if labels is None else labels
    context = getattr(model, "context_parallel", None)
    if context is None:
        return inputs, targets, position_ids
    if position_ids is not None:
        raise ValueError(
            "context parallelism and packed documents (data.pack) do not mix yet: each "
            "rank's part of the sequence is masked by its plain positions"
        )
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    return context.split(inputs), context.split(targets), context.split(positions)


def position_kwargs(model: nn.Module, position_ids) -> dict:
    """The keywords that make `model` read packed documents' positions, which restart where
    a document starts, so it attends within documents only. A transformers model does so
    only without a KV cache (given one, even an empty one, it builds a plain causal mask):
    `use_cache=False`. Nothing without positions, so the plain call stays as it was."""
    if position_ids is None:
        return {}
    if _takes_use_cache(type(model)):
        return {"position_ids": position_ids, "use_cache": False}
    return {"position_ids": position_ids}


@functools.cache
def _takes_use_cache(model_type: type) -> bool:
    """Whether a model class's forward takes `use_cache` (read once per class)."""
    return "use_cache" in inspect.signature(model_type.forward).parameters


def token_loss(logits, targets, divisor=None) -> torch.Tensor:
    """The mean cross-entropy of `targets`; with `divisor`, their sum over the labelled
    targets (-100 where a token carries no loss: a chat's prompt) divided by it (the
    trainer's share of the global batch's labelled tokens, so every labelled token of a
    step weighs the same)."""
    logits = logits.float().flatten(0, 1)
    if divisor is None:
        return F.cross_entropy(logits, targets.flatten())
    summed = F.cross_entropy(logits, targets.flatten(), ignore_index=-100, reduction="sum")
    return summed / divisor


@dataclass(frozen=True)
class ModelFamily:
    """name: what `flatshard train` and the docs call it. config_type / model_type: its
    config dataclass and model class (`model_type(config)` builds it). plan: its
    `ParallelPlan` for a model. loss: the training loss of a batch of token ids, averaged
    over `group` where it has terms shared by the ranks (the MoE's balancing loss); with
    `labels=` and `divisor=`, its next-token part as `token_loss` computes it.
    describe: one line for the run header. hf_export: whether `flatshard convert` can write
    it as a Hugging Face checkpoint."""

    name: str
    config_type: type
    model_type: type
    plan: Callable[[nn.Module], ParallelPlan]
    loss: Callable[..., torch.Tensor] = next_token_loss
    describe: Callable[[Any], str] = lambda config: ""
    hf_export: bool = True


_FAMILIES: list[ModelFamily] = []


def register(family: ModelFamily) -> ModelFamily:
    _FAMILIES.append(family)
    register_plan(family.model_type, family.plan)
    return family


def family_of_config(config) -> ModelFamily:
    """The family whose config type `config` is (exactly: an MoEConfig is a LlamaConfig)."""
    for family in _FAMILIES:
        if type(config) is family.config_type:
            return family
    raise TypeError(f"{type(config).__name__} is no registered model family's config")


def family_of_model(model: nn.Module) -> ModelFamily | None:
    """The family of `model` (None: not one of flatshard's, e.g. a transformers model)."""
    return next((f for f in _FAMILIES if isinstance(model, f.model_type)), None)


def training_loss(
    model: nn.Module, batch: torch.Tensor, group=None, labels=None, divisor=None,
    position_ids=None,
) -> torch.Tensor:  # fmt: skip
    family = family_of_model(model)
    loss = family.loss if family else next_token_loss
    extra = {} if position_ids is None else {"position_ids": position_ids}
    if labels is None:
        return loss(model, batch, group, **extra)
    return loss(model, batch, group, labels=labels, divisor=divisor, **extra)


def config_from_dict(values: dict):
    """The config a saved dict of fields describes: of the family with the fewest fields
    that has them all."""
    candidates = [f for f in _FAMILIES if set(values) <= _field_names(f.config_type)]
    if not candidates:
        raise TypeError(f"no model family's config has the fields {sorted(values)}")
    family = min(candidates, key=lambda f: len(_field_names(f.config_type)))
    return family.config_type(**values)


def _field_names(config_type: type) -> set[str]:
    return {f.name for f in fields(config_type)}
