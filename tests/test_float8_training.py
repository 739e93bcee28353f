"""torchao's float8 training with float8 weight all-gathers
(`Float8LinearConfig(enable_fsdp_float8_all_gather=True)`): its weights are trainable tensor
subclasses whose pre hook casts each shard to float8 with the scale of the whole weight (an
amax all-reduce) and whose post hook wraps the gathered bytes. flatshard moves them as bytes,
so it runs on gloo, which has no float8 (FSDP2 fails there: "Invalid scalar type"), and
trains exactly as FSDP2 does with the weights gathered in fp32 and cast after: the same
float8 values reach the matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import run_distributed

import flatshard
from flatshard.comm import collectives

float8 = pytest.importorskip("torchao.float8")

STEPS = 3


def build(float8_gather: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128, bias=False),
        nn.ReLU(),
        nn.Linear(128, 64, bias=False),
        nn.Linear(64, 8),
    )
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=float8_gather)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: fqn != "3"
    )
    return model


def _train(library: str, float8_gather: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    if library == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = flatshard.fully_shard
    model = build(float8_gather)
    for index in (0, 2):
        fully_shard(model[index])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, gathered = [], []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(16, 64, generator=generator)
        y = torch.randint(0, 8, (16,), generator=generator)
        rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
        before = collectives.traffic.all_gather
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        gathered.append(collectives.traffic.all_gather - before)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    weights = {}
    for name, param in model.named_parameters():
        local = param.to_local()
        if not hasattr(local, "_tensor"):
            weights[name] = param.full_tensor()
            continue
        pieces = [torch.empty_like(local._tensor) for _ in range(world)]  # fp32 inside
        dist.all_gather(pieces, local._tensor.contiguous())  # even torch.chunk rows here
        weights[name] = torch.cat(pieces)
    return losses, weights, gathered


def test_float8_gathers_on_flatshard_train_as_fsdp2_with_fp32_gathers():
    ours, weights, gathered = run_distributed(_train, 2, "flatshard", True)[0]
    theirs, their_weights, _ = run_distributed(_train, 2, "fsdp2", False)[0]
    assert ours == theirs
    for name in weights:
        assert torch.equal(weights[name], their_weights[name]), name
    _, _, fp32_gathered = run_distributed(_train, 2, "flatshard", False)[0]
    # each float8 linear (8,192 weights) moves a byte a weight, not four; a step gathers
    # the first in forward and in backward, the last once (it stays gathered into backward)
    saved = 64 * 128 * 3 * 3
    assert [f - o for f, o in zip(fp32_gathered, gathered)][1:] == [saved] * (STEPS - 1)
