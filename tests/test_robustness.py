"""Corners where sharded training goes wrong in peers: parameters unused on some ranks only,
activation checkpointing, gradients from outside the row layout, changed requires_grad."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import run_distributed
from reference import (
    batches,
    build_model,
    config,
    full_state,
    lm_loss,
    rank_slice,
    rel_diff,
    rel_losses,
    shard,
    train,
)
from torch.utils.checkpoint import checkpoint

import flatshard
from flatshard import registry


# --- an expert that only some ranks use (MoE routing that sent it no tokens) ---------------
class TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.expert = nn.Linear(8, 8)

    def forward(self, x, use_expert):
        x = torch.tanh(self.shared(x))
        return x + self.expert(x) if use_expert else x


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(TwoExperts() for _ in range(3))

    def forward(self, x, use_expert):
        for block in self.blocks:
            x = block(x, use_expert)
        return x


def _unused_on_some_ranks():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Stack()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        flatshard.fully_shard(block)
    flatshard.fully_shard(model)
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(4 * world, 8, generator=generator) for _ in range(4)]
    uses = [r % 2 == 1 for r in range(world)]  # odd ranks route tokens to the expert
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data:
        # reference: the mean over ranks of each rank's loss, in one process
        ref_loss = (
            sum(reference(rank_slice(x, r, world), uses[r]).pow(2).mean() for r in range(world))
            / world
        )
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(rank_slice(x, rank, world), uses[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    return rel_diff(weights, dict(reference.named_parameters()))


def test_parameter_unused_on_some_ranks_does_not_hang():
    for error in run_distributed(_unused_on_some_ranks, 2, timeout=60):
        assert error <= 1e-6


# --- activation checkpointing ------------------------------------------------------------------
class Checkpointed(nn.Module):
    """Recomputes its inner block in backward (torchtitan-style checkpoint wrapper)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return checkpoint(self.inner, *args, use_reentrant=False)


def _activation_checkpointing(where):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    data = batches(cfg, 4)
    reference = build_model(cfg)
    ref_losses = train(reference, data)
    model = build_model(cfg)
    if where == "inside":  # wrapper inside the unit: fully_shard(Checkpointed(block))
        model.layers = nn.ModuleList(Checkpointed(layer) for layer in model.layers)
        shard(model)
    else:  # checkpoint around the unit: Checkpointed(fully_shard(block))
        shard(model)
        model.layers = nn.ModuleList(Checkpointed(layer) for layer in model.layers)
    losses = train(model, data, rank=rank, world=world)
    gathered = sum(
        b.unsharded.untyped_storage().size() > 0
        for m in model.modules()
        if registry.unit_of(m) is not None
        for b in registry.unit_of(m).buckets
    )
    weights = {k.replace(".inner", ""): v for k, v in full_state(model).items()}
    return rel_losses(losses, ref_losses), rel_diff(weights, reference.state_dict()), gathered


@pytest.mark.parametrize("where", ["inside", "around"])
def test_activation_checkpointing(where):
    for loss_error, weight_error, gathered in run_distributed(_activation_checkpointing, 2, where):
        assert loss_error <= 1e-6 and weight_error <= 1e-6
        assert gathered == 0  # ZeRO-3: nothing left gathered after the step


# --- gradients produced outside the row layout -------------------------------------------------
def _grad_through_full_tensor():
    model = flatshard.fully_shard(nn.Linear(5, 3))
    loss = model.weight.full_tensor().pow(2).sum()
    try:
        loss.backward()
        model(torch.ones(2, 5)).sum().backward()
        return "no error"
    except flatshard.UnevenShardError as error:
        return str(error)


def test_gradient_outside_row_layout_is_refused_on_every_rank():
    for message in run_distributed(_grad_through_full_tensor, 2, timeout=60):
        assert "not produced in flatshard's row layout" in message


def _unfreeze_after_wrapping():
    """A parameter frozen when wrapped (its bucket laid out without gradients) trains once
    unfrozen, as in FSDP2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    model = build_model(cfg)
    model.embed_tokens.weight.requires_grad_(False)
    shard(model)
    model.embed_tokens.weight.requires_grad_(True)
    train(model, batches(cfg, 2), rank=rank, world=world)
    return full_state(model)


def test_unfreezing_a_parameter_frozen_when_wrapped():
    reference = build_model(config())
    train(reference, batches(config(), 2))
    for weights in run_distributed(_unfreeze_after_wrapping, 2):
        assert rel_diff(weights, reference.state_dict()) <= 1e-6


def _backward_twice():
    model = flatshard.parallelize(build_model(config()), flatshard.ParallelDims(2))
    loss = lm_loss(model, batches(model.config, 1)[0][: 12 // 2])
    loss.backward()
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "no error"


def test_backward_twice_on_one_forward_is_the_same_error_on_every_rank():
    """autograd's own error, raised on every rank before any collective (no rank is left
    waiting in one: the next call on the pool's group still works)."""
    first, second = run_distributed(_backward_twice, 2)
    assert first == second and "backward through the graph a second time" in first
    assert run_distributed(_backward_twice, 2) == [first, second]
