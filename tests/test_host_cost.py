"""Per-step host work that grows with the number of parameters (issue 38): after the first
step, a training step with flatshard's flat AdamW builds no DTensor spec at all (each
gradient shares its parameter's; the optimizer steps flat buffers), with or without
accumulation, ZeRO-3 and ZeRO-2, at world 2. torch's AdamW on the same model builds one per
state per parameter per step (its own code), which shows the count sees them."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from reference import batches, build_model, config, lm_loss, rank_slice, shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import flatshard


class _CountSpecs:
    def __init__(self):
        self.count = 0

    def __enter__(self):
        self.original = DTensorSpec.__post_init__

        def counting(spec):
            self.count += 1
            return self.original(spec)

        DTensorSpec.__post_init__ = counting
        return self

    def __exit__(self, *exc):
        DTensorSpec.__post_init__ = self.original


def _specs_per_step(zero_stage: int, microbatches: int, flat: bool) -> list[int]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    model = shard(build_model(cfg), zero_stage=zero_stage)
    optim_cls = flatshard.optim.AdamW if flat else torch.optim.AdamW
    optimizer = optim_cls(model.parameters(), lr=1e-3, weight_decay=0.1)
    counts = []
    for step, tokens in enumerate(batches(cfg, 3)):
        with _CountSpecs() as specs:
            for piece in tokens.chunk(microbatches):
                lm_loss(model, rank_slice(piece, rank, world)).backward()
            optimizer.step()
            optimizer.zero_grad()
        if step:  # the first step builds the optimizer's states
            counts.append(specs.count)
    return counts


@pytest.mark.parametrize("zero_stage, microbatches", [(3, 1), (2, 2)])
def test_a_flat_step_builds_no_dtensor_spec(zero_stage, microbatches):
    results = run_distributed(_specs_per_step, 2, zero_stage, microbatches, True)
    assert results == [[0, 0], [0, 0]]


def test_the_count_sees_torch_adamw_build_specs():
    counts = run_distributed(_specs_per_step, 2, 3, 1, False)[0]
    params = sum(1 for _ in build_model(config()).parameters())
    assert min(counts) >= params
