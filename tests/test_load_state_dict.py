"""`module.load_state_dict` into a `fully_shard`-ed model, in every form FSDP2 scripts use:
the loaded values must be what forward, backward and the optimizer see afterwards (the
silent failure: `full_tensor()` showing new weights while training used the old ones)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from reference import batches, build_model, config, full_state, rel_diff, shard, train
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from flatshard.errors import UnevenShardError, WrappingError
from flatshard.models import Llama

FORMS = [
    "assign_chunk_dtensor", "assign_replicate", "copy_chunk_dtensor", "plain", "own",
    "data_full", "data_chunk_dtensor",
]  # fmt: skip


def _loaded_weights():
    return {k: v.detach().clone() for k, v in build_model(config(), seed=7).state_dict().items()}


def _state_dict_in(form, model, weights):
    mesh = model.layers[0].mlp_norm.weight.device_mesh
    if form in ("assign_chunk_dtensor", "copy_chunk_dtensor"):
        return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in weights.items()}
    if form == "assign_replicate":
        return {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in weights.items()}
    if form == "own":  # another flatshard model's sharded state dict (its rows, DTensors)
        return _own_state_dict(weights)
    return weights


def _own_state_dict(weights):
    other = Llama(config())
    other.load_state_dict(weights)
    return shard(other).state_dict()


def _train_after_load(form, meta):
    weights = _loaded_weights()
    if meta:  # FSDP2's flow: build on meta, shard, load with assign=True
        with torch.device("meta"):
            model = Llama(config())
    else:
        model = build_model(config(), seed=1)  # other weights, which the load replaces
    shard(model)
    if form.startswith("data_"):  # param.data = ..., per parameter
        mesh = model.layers[0].mlp_norm.weight.device_mesh
        with torch.no_grad():
            for name, param in model.named_parameters():
                value = weights[name]
                if form == "data_chunk_dtensor":
                    value = distribute_tensor(value, mesh, [Shard(0)])
                param.data = value
    else:
        state_dict = _state_dict_in(form, model, weights)
        model.load_state_dict(state_dict, assign=form != "copy_chunk_dtensor")
    loaded = rel_diff(full_state(model), weights)
    losses = train(model, batches(config(), 2), rank=torch.distributed.get_rank(), world=2)
    return loaded, losses, full_state(model)


def _reference(weights):
    model = Llama(config())
    model.load_state_dict(weights)
    return train(model, batches(config(), 2)), full_state(model)


@pytest.mark.parametrize("form", FORMS)
def test_load_state_dict_reaches_training(form):
    ref_losses, ref_weights = _reference(_loaded_weights())
    for meta in (False, True):
        for loaded, losses, weights in run_distributed(_train_after_load, 2, form, meta):
            assert loaded == 0.0, (form, meta)
            assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-6, (form, meta)
            assert rel_diff(weights, ref_weights) < 1e-6, (form, meta)


def _bad_inputs():
    model = shard(build_model(config()))
    mesh = model.norm.weight.device_mesh
    found = {}
    try:
        model.load_state_dict({"norm.weight": torch.ones(31)}, strict=False)
    except RuntimeError as error:
        found["shape"] = str(error)
    before = model.norm.weight.full_tensor()
    model.to(torch.float64)  # as FSDP2: the shards convert (test_fsdp2_dropin trains on)
    after = model.norm.weight.full_tensor()
    found["to"] = (str(after.dtype), torch.equal(after, before.double()))
    model.half()
    found["half"] = sorted({str(p.dtype) for p in model.parameters()})
    model.to(torch.float32)
    try:
        model.to("meta")
    except WrappingError as error:
        found["device"] = str(error)
    try:
        with torch.no_grad():
            model.norm.weight.copy_(distribute_tensor(torch.ones(32), mesh, [Shard(0)]))
    except UnevenShardError as error:
        found["copy"] = str(error)
    with torch.no_grad():
        model.norm.weight.mul_(0)
    found["mul"] = model.norm.weight.full_tensor().abs().sum().item()
    return found


def test_bad_loads_and_conversions_raise_clearly():
    for found in run_distributed(_bad_inputs, 2):
        assert "norm.weight" in found["shape"] and "(31,)" in found["shape"]
        assert found["to"] == ("torch.float64", True)
        assert found["half"] == ["torch.float16"]
        assert "meta" in found["device"] and "before fully_shard" in found["device"]
        assert "row_range" in found["copy"]
        assert found["mul"] == 0.0
