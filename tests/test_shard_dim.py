"""FSDP2's `shard_placement_fn` returning `Shard(1)`: parameters split along dim 1 (kept in
the flat buffers with that dim first, so each rank's piece stays contiguous there). Trains
as FSDP2 does (tests/test_fsdp2_port.py, `shard_dim1`); its DCP checkpoints hold the same
global tensors, load at world 1, 2 and 4, into rows (`Shard(0)`) and into FSDP2, and
FSDP2's load into it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from fsdp2_behaviours import full_weights, net, plain_loss, shard_net, train
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import Shard

import flatshard

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop


def _by_dim(dim):
    return lambda param: Shard(dim) if param.dim() == 2 else None


def _trained(lib, dim, steps=2):
    model = shard_net(net(), lib, shard_placement_fn=_by_dim(dim))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, plain_loss, steps=steps, optimizer=optimizer)
    return model, optimizer


def _save(path, lib, dim):
    model, optimizer = _trained(lib, dim)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, checkpoint_id=path)
    return full_weights(model)


def _load(path, lib, dim):
    model, optimizer = _trained(lib, dim, steps=1)  # other values, optimizer state made
    placements = sorted({str(p.placements) for p in model.parameters()})
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    weights = full_weights(model)
    losses = train(model, plain_loss, steps=2, optimizer=optimizer)["losses"]
    return weights, losses, placements


@pytest.mark.parametrize("saved_by", ["flatshard", "fsdp2"])
def test_dim1_checkpoint_reshards(tmp_path, saved_by):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, path, saved_by, 1)[0]
    cases = [(1, "flatshard", 1), (2, "flatshard", 0), (4, "flatshard", 1), (2, "fsdp2", 0)]
    if saved_by == "flatshard":
        cases.append((2, "fsdp2", 1))
    resumed = {}
    for world, lib, dim in cases:
        for weights, losses, placements in run_distributed(_load, world, path, lib, dim):
            assert weights.keys() == saved.keys()
            for key in saved:
                assert torch.equal(weights[key], saved[key]), (world, lib, dim, key)
            assert f"Shard(dim={dim})" in " ".join(placements)
            resumed.setdefault(world, losses)
            # the same model and optimizer state: the same next steps at every layout
            assert max(abs(a - b) / b for a, b in zip(losses, resumed[world])) <= 1e-6


def _refused():
    model = net()
    try:
        flatshard.fully_shard(model.blocks[0], shard_placement_fn=lambda p: Shard(p.dim()))
    except NotImplementedError as error:
        return str(error)
    return None


def test_a_dim_the_parameter_lacks_is_refused():
    for message in run_distributed(_refused, 2):
        assert message is not None and "Shard(d)" in message and "lin1" in message
