"""`parallelize(activation_checkpointing="offload")`: every block but the last keeps its saved
activations on the host between forward and backward, and they come back one unit ahead
of their backward. Training equals training without offload bitwise (ZeRO-2/3, EP, TP);
every activation moved was fetched back ahead of autograd's asking for it."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, config, full_state, train
from test_compile import CONFIG
from test_moe_training import moe_loss

import flatshard
from flatshard import registry
from flatshard.models import Llama, MoE, MoEConfig

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

STEPS = 3


def _train(mode, *, zero_stage=3, tp=1, ep=1, compile=False):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MoE(MoEConfig.tiny("mixtral")) if ep > 1 else Llama(config(**CONFIG))
    dims = flatshard.ParallelDims(dist.get_world_size(), tp=tp, ep=ep)
    flatshard.parallelize(
        model, dims, zero_stage=zero_stage, activation_checkpointing=mode, compile=compile
    )
    meshes = dims.build()
    extra = {"loss_fn": partial(moe_loss, group=meshes.dp.get_group())} if ep > 1 else {}
    losses = train(model, batches(model.config, STEPS), rank=meshes.dp_rank, world=dims.dp, **extra)
    offloads = [registry.activation_offload_of(block) for block in model.layers]
    moved = [
        None if o is None else (o.moved_bytes, o.saved, o.fetched_ahead, len(o.waiting))
        for o in offloads
    ]
    return losses, full_state(model), moved


def _offload_and_not(**options):
    return _train("offload", **options), _train(None, **options)


CASES = {
    "zero3": (2, {}),
    "zero2": (2, {"zero_stage": 2}),
    "ep2": (2, {"ep": 2}),
    "tp2": (4, {"tp": 2}),
    "compiled": (2, {"compile": True}),  # the hooks start and stop it outside the graphs
}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_activations_train_bitwise_and_come_back_ahead(case):
    world, options = CASES[case]
    for (losses, weights, moved), (plain_losses, plain_weights, _) in run_distributed(
        _offload_and_not, world, **options
    ):
        assert losses == plain_losses
        assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)
        *offloaded, last = moved
        assert last is None  # the last block's backward comes first: it keeps its own
        for moved_bytes, saved, fetched_ahead, waiting in offloaded:
            assert moved_bytes > 0 and saved > 0
            assert fetched_ahead == saved  # all prefetched one unit ahead
            assert waiting == 0
