"""Trainable parameters whose tensor subclass decides its all-gather (torchao's float8
training weights; here fp32 weights that cast themselves to bf16 for the gather,
cast_weight.py): gathered through the protocol, their gradients reduce-scattered in FSDP2's
chunks, stepped by torch's AdamW on the subclass shards. flatshard and FSDP2 train the same
model (bf16 compute) to the same losses and weights, with plain data parallelism, HSDP and
gradient accumulation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from cast_weight import CastingWeight
from distributed import run_distributed
from lora_model import Model
from reference import hsdp_mesh

import flatshard
from flatshard import checkpoint

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

DIM, HIDDEN, BLOCKS, STEPS = 12, 24, 2, 4


def build() -> Model:
    torch.manual_seed(0)
    model = Model(DIM, HIDDEN, BLOCKS, 3, lambda d_in, d_out: nn.Linear(d_in, d_out))
    for block in model.blocks:
        for linear in (block.up, block.down):
            linear.weight = nn.Parameter(CastingWeight(linear.weight.detach().clone()))
    return model


def _train(library: str, hsdp: bool = False, accumulate: bool = False):
    if library == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from flatshard import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = None
    if hsdp:
        mesh = hsdp_mesh(2)
    model = build()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = steps(model, optimizer, range(STEPS), accumulate)
    weights = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if not isinstance(param.to_local(), CastingWeight) else None
        if full is None:  # gathered as DCP would: the chunks of every rank
            local = param.to_local()._tensor.contiguous()
            pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(pieces, local)
            full = torch.cat(pieces[: len(pieces) // (2 if hsdp else 1)])
        weights[name] = full
    types = {type(p.to_local()).__name__ for p in model.parameters()}
    return losses, weights, types


def steps(model, optimizer, numbers, accumulate: bool = False):
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in numbers:
        generator = torch.Generator().manual_seed(100 + step)
        rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
        x = torch.randn(2, 12, DIM, generator=generator)[:, rows]
        y = torch.randint(0, 3, (2, 12), generator=generator)[:, rows]
        micro = [(x[0], y[0]), (x[1], y[1])] if accumulate else [(x.flatten(0, 1), y.flatten())]
        total = 0.0
        for index, (xs, ys) in enumerate(micro):
            model.set_requires_gradient_sync(index == len(micro) - 1)
            loss = nn.functional.cross_entropy(model(xs), ys) / len(micro)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("hsdp,accumulate", [(False, False), (True, False), (False, True)])
def test_trainable_subclass_weights_train_as_under_fsdp2(hsdp, accumulate):
    world = 4 if hsdp else 2
    ours, weights, types = run_distributed(_train, world, "flatshard", hsdp, accumulate)[0]
    theirs, their_weights, _ = run_distributed(_train, world, "fsdp2", hsdp, accumulate)[0]
    assert "CastingWeight" in types  # the stepped shards stay the subclass
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    assert weights.keys() == their_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], their_weights[name], rtol=1e-5, atol=1e-6)


def _resumed(directory: str):
    """Two steps, a checkpoint (model and AdamW state), two more; a fresh model loads the
    checkpoint and takes the same two steps."""

    def sharded(shift: float):
        model = build()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(shift)  # a different start, overwritten by the load
        for block in model.blocks:
            flatshard.fully_shard(block, mp_policy=flatshard.MixedPrecisionPolicy(torch.bfloat16))
        flatshard.fully_shard(model, mp_policy=flatshard.MixedPrecisionPolicy(torch.bfloat16))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    model, optimizer = sharded(0.0)
    steps(model, optimizer, range(2))
    checkpoint.save(directory, model=model, optimizer=optimizer, step=2).wait()
    expected = steps(model, optimizer, range(2, 4))
    model, optimizer = sharded(0.5)
    checkpoint.load(directory, model=model, optimizer=optimizer)
    return expected, steps(model, optimizer, range(2, 4))


def test_a_checkpoint_of_trainable_subclass_weights_resumes_bitwise(tmp_path):
    expected, resumed = run_distributed(_resumed, 2, str(tmp_path))[0]
    assert resumed == expected
