"""flatshard against PyTorch FSDP2: same script, same losses; full tensors and full state
dicts exactly the single-process weights; unsupported uneven DTensor ops fail clearly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import (
    batches,
    build_model,
    config,
    full_state,
    lm_loss,
    rank_slice,
    rel_losses,
    shard,
)
from torch.distributed.tensor import Replicate, Shard

import flatshard


def fsdp2_style_script(fully_shard, MixedPrecisionPolicy, param_dtype):
    """A training script written for FSDP2; only the two imported names change."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    model = build_model(cfg)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches(cfg, 4, batch=24):
        step_loss = 0.0
        for i, piece in enumerate(tokens.chunk(2)):
            model.set_requires_gradient_sync(i == 1)
            loss = lm_loss(model, rank_slice(piece, rank, world)) / 2
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses, {k: v.float() for k, v in full_state(model).items()}


def _both(param_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = fsdp2_style_script(torch_fully_shard, TorchPolicy, param_dtype)
    ours = fsdp2_style_script(flatshard.fully_shard, flatshard.MixedPrecisionPolicy, param_dtype)
    weight_error = max(
        ((ours[1][k] - theirs[1][k]).norm() / theirs[1][k].norm()).item() for k in theirs[1]
    )
    return rel_losses(ours[0], theirs[0]), weight_error


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_script_fp32_same_losses(world_size):
    for loss_error, weight_error in run_distributed(_both, world_size, torch.float32):
        assert loss_error <= 1e-6 and weight_error <= 1e-6


def test_fsdp2_script_bf16_same_losses():
    # Identical bf16 compute on identical gathered weights; only reduction order differs.
    for loss_error, weight_error in run_distributed(_both, 2, torch.bfloat16):
        assert loss_error <= 1e-3 and weight_error <= 1e-3


def _full_weights_exact():
    cfg = config(tie_embeddings=True)
    expected = build_model(cfg).state_dict()
    model = flatshard.fully_shard(build_model(cfg))
    from_params = {n: p.full_tensor() for n, p in model.named_parameters()}
    from_state_dict = full_state(model)
    assert from_state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(from_state_dict[name], tensor), name
    for name, tensor in from_params.items():
        assert torch.equal(tensor, expected[name]), name
    return sorted(from_state_dict)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_full_tensor_and_full_state_dict_are_exact(world_size):
    keys = run_distributed(_full_weights_exact, world_size)[0]
    assert "lm_head.weight" in keys and "embed_tokens.weight" in keys


def _unsupported_redistribution():
    model = flatshard.fully_shard(build_model(config()))
    param = model.get_parameter("layers.0.mlp.down_proj.weight")
    errors = []
    for placements in ([Shard(1)], [Replicate()]):
        try:
            value = param.redistribute(placements=placements)
            errors.append(("ok", tuple(value.shape)))
        except flatshard.UnevenShardError as error:
            errors.append(("error", str(error)))
    return errors


def test_unsupported_dtensor_op_fails_clearly_on_every_rank():
    for errors in run_distributed(_unsupported_redistribution, 3):
        kind, message = errors[0]
        assert kind == "error" and "Shard(dim=1)" in message and "full_tensor" in message
        assert errors[1] == ("ok", (32, 45))  # Shard(0) -> Replicate is supported


def _load_full_state_dict(broadcast):
    """Load a full state dict (model and optimizer) the FSDP2 way: exact rows everywhere."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    source = shard(build_model(cfg))
    optimizer = torch.optim.AdamW(source.parameters(), lr=1e-3)
    lm_loss(source, rank_slice(batches(cfg, 1)[0], rank, world)).backward()
    optimizer.step()
    full = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(source, optimizer, options=full)

    target = shard(build_model(cfg, seed=5))
    target_optimizer = torch.optim.AdamW(target.parameters(), lr=1e-3)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    if broadcast and rank > 0:
        model_state, optim_state = {}, {}
    set_model_state_dict(target, model_state, options=options)
    set_optimizer_state_dict(target, target_optimizer, optim_state, options=options)
    ours_model, ours_optim = get_state_dict(target, target_optimizer, options=full)
    expected_model, expected_optim = get_state_dict(source, optimizer, options=full)
    same_model = all(torch.equal(ours_model[k], v) for k, v in expected_model.items())
    same_optim = all(
        torch.equal(ours_optim["state"][k][n], v)
        for k, states in expected_optim["state"].items()
        for n, v in states.items()
    )
    return same_model, same_optim


@pytest.mark.parametrize("broadcast", [False, True])
def test_set_state_dict_with_full_state_dict(broadcast):
    assert run_distributed(_load_full_state_dict, 3, broadcast) == [(True, True)] * 3
