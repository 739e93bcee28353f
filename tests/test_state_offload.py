"""`flatshard.offload_states` / `reload_states`: the parameters, gradients and optimizer
state leave the device between steps (and between a backward and its optimizer step) and
come back into the same tensors; training then equals an uninterrupted run bitwise (ZeRO-1/2/3,
optimizer offload, HSDP, TP, EP). While away, what needs them refuses with one line."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import adamw, batches, config, full_state, lm_loss, mean_over_ranks, rank_slice
from test_compile import CONFIG
from test_moe_training import moe_loss
from torch.distributed.tensor import DTensor

import flatshard
from flatshard import registry
from flatshard.dtensor.sharded_param import local_data
from flatshard.models import Llama, MoE, MoEConfig
from flatshard.planner import zoo
from flatshard.planner.estimate import Setup, plan

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

STEPS = 7  # 5 more after the first reload


def _device_bytes(model, optimizer) -> tuple[int, int]:
    """(bytes of the storages behind the parameters, their gradients and AdamW state that
    live next to the device pieces; bytes of those on the host by optimizer offload)."""
    device, host = {}, {}
    for param in model.parameters():
        owner = registry.managed_of(param)
        on_host = owner is not None and owner[0].buckets[owner[1].bucket].shard.on_host(
            owner[1].index
        )
        tensors = [param, param.grad, *optimizer.state.get(param, {}).values()]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                local = local_data(tensor) if isinstance(tensor, DTensor) else tensor
                storage = local.untyped_storage()
                (host if on_host else device)[storage.data_ptr()] = storage.nbytes()
    return sum(device.values()), sum(host.values())


def _refusals(model, optimizer, tokens) -> list[str]:
    refused = []
    for attempt in (
        lambda: model(tokens),
        optimizer.step,
        model.state_dict,
        optimizer.state_dict,
    ):
        try:
            attempt()
        except flatshard.StatesOffloadedError as error:
            assert "reload_states" in str(error)
            refused.append(type(error).__name__)
    return refused


def _train(interrupt, *, zero_stage=3, tp=1, ep=1, replicate=1, offload=0.0, flat=False):
    torch.manual_seed(0)
    model = MoE(MoEConfig.tiny("mixtral")) if ep > 1 else Llama(config(**CONFIG))
    dims = flatshard.ParallelDims(dist.get_world_size(), dp_replicate=replicate, tp=tp, ep=ep)
    policy = flatshard.OffloadPolicy(fraction=offload) if offload else None
    flatshard.parallelize(model, dims, zero_stage=zero_stage, offload_policy=policy)
    meshes = dims.build()
    loss_fn = partial(moe_loss, group=meshes.dp.get_group()) if ep > 1 else lm_loss
    optimizer = (
        flatshard.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        if flat  # its state: views of one flat buffer per bucket side
        else adamw(model.parameters())
    )
    losses, seen = [], []
    for step, tokens in enumerate(batches(model.config, STEPS)):
        loss = loss_fn(model, rank_slice(tokens, meshes.dp_rank, dims.dp))
        loss.backward()
        if interrupt and step in (1, 3):  # between backward and step: gradients held
            seen.append(_away_and_back(model, optimizer, tokens))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss.item(), dims.dp))
        if interrupt and step == 2:  # between steps
            seen.append(_away_and_back(model, optimizer, tokens))
    return losses, full_state(model), seen


def _away_and_back(model, optimizer, tokens):
    before = _device_bytes(model, optimizer)
    moved = flatshard.offload_states(model, optimizer)
    after = _device_bytes(model, optimizer)
    refused = _refusals(model, optimizer, tokens)
    back = flatshard.reload_states(model, optimizer)
    return before, after, moved, back, refused, _device_bytes(model, optimizer)


def _interrupted_and_not(**options):
    return _train(True, **options), _train(False, **options)


CASES = {
    "zero3": (2, {}),
    "zero2": (2, {"zero_stage": 2}),
    "zero1": (2, {"zero_stage": 1}),  # gathered weights and gradient buffers kept
    "offload-half": (2, {"offload": 0.5}),
    "hsdp": (4, {"replicate": 2}),
    "tp2": (2, {"tp": 2}),
    "ep2": (2, {"ep": 2}),
    "flat-adamw": (2, {"flat": True, "offload": 0.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_after_offload_and_reload_is_bitwise_uninterrupted(case):
    world, options = CASES[case]
    for (losses, weights, seen), (plain_losses, plain_weights, _) in run_distributed(
        _interrupted_and_not, world, **options
    ):
        assert losses == plain_losses
        assert weights.keys() == plain_weights.keys()
        assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)
        assert len(seen) == 3
        for before, after, moved, back, refused, restored in seen:
            (device, host) = before
            assert device > 0 and after[0] <= 0.01 * device  # the device holds ~nothing
            assert after[1] == host  # optimizer offload's host pieces stay
            assert moved == back >= device
            assert refused == ["StatesOffloadedError"] * 4
            assert restored == before
        if options.get("offload"):
            assert seen[0][0][1] > 0
        if case in PLANNED:  # `flatshard plan`'s figure, with gradients held; the plan
            # also counts the shards' padding for AdamW's state, which holds none
            planned = _planned(world, options)
            with_grads = seen[0][2]
            assert with_grads == seen[2][2] <= planned <= 1.01 * with_grads
            assert seen[1][2] < with_grads  # between steps: no gradients


PLANNED = ("zero3", "zero2", "offload-half", "hsdp")


def _planned(world: int, options: dict) -> int:
    """What `flatshard plan` says offload_states frees per rank."""
    spec = zoo.from_llama_config(config(**CONFIG), "test")
    replicate = options.get("replicate", 1)
    setup = Setup(world_size=world, dp_shard=world // replicate,
                  zero_stage=options.get("zero_stage", 3), param_dtype="fp32",
                  reduce_dtype="fp32", micro_batch=1, seq_len=8, grad_accum=1,
                  backend="gloo", offload=options.get("offload", 0.0))  # fmt: skip
    return plan(spec, setup).memory["offload_states"]


def _misuse():
    torch.manual_seed(0)
    model = Llama(config(**CONFIG))
    flatshard.parallelize(model, flatshard.ParallelDims(dist.get_world_size()))
    optimizer = adamw(model.parameters())
    errors = []
    for call in (
        lambda: flatshard.offload_states(model, include=("params", "weights")),
        lambda: flatshard.offload_states(model, include="optimizer"),
        lambda: flatshard.offload_states(torch.nn.Linear(2, 2)),
    ):
        try:
            call()
        except (ValueError, flatshard.FlatShardError) as error:
            errors.append(str(error))
    flatshard.offload_states(model, optimizer, include="params")
    try:
        flatshard.offload_states(model, optimizer)
    except flatshard.StatesOffloadedError as error:
        errors.append(str(error))
    assert flatshard.reload_states(model) > 0 and flatshard.reload_states(model) == 0
    return errors


def test_bad_requests_are_refused_in_one_line():
    for errors in run_distributed(_misuse, 2):
        assert len(errors) == 4 and all("\n" not in e for e in errors)
        assert "'weights'" in errors[0] and "needs the optimizer" in errors[1]
        assert "sharded" in errors[2] and "already" in errors[3]
