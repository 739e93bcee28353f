"""FSDP2's surface beyond fully_shard(module): each behaves as FSDP2 documents it, checked
against one process."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import run_distributed
from reference import (
    adamw,
    batches,
    build_model,
    config,
    full_state,
    lm_loss,
    mean_over_ranks,
    rank_slice,
    rel_diff,
    rel_losses,
    shard,
    train,
)
from torch.distributed.tensor import DTensor, Shard

import flatshard
from flatshard import comm, registry
from flatshard.errors import WrappingError

TOLERANCE = 1e-6


def _reference(steps=3, **cfg):
    model = build_model(config(**cfg))
    return train(model, batches(config(**cfg), steps)), model.state_dict()


# --- a list of modules as one unit ---------------------------------------------------------
def _list_unit():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(config())
    parts = [model.embed_tokens, model.norm, model.lm_head]
    assert flatshard.fully_shard(parts) is parts
    for block in model.layers:
        flatshard.fully_shard(block)
    flatshard.fully_shard(model)
    one_unit = len({registry.unit_of(part) for part in parts}) == 1
    losses = train(model, batches(config(), 3), rank=rank, world=world)
    return one_unit, losses, full_state(model)


def test_list_of_modules_is_one_unit():
    ref_losses, ref_weights = _reference()
    for one_unit, losses, weights in run_distributed(_list_unit, 2):
        assert one_unit
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, ref_weights) <= TOLERANCE


# --- ignored parameters ----------------------------------------------------------------------
def _ignored():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(config())
    ignored = {model.norm.weight}
    for block in model.layers:
        flatshard.fully_shard(block)
    flatshard.fully_shard(model, ignored_params=ignored)
    plain = not isinstance(model.norm.weight, DTensor)
    optimizer = adamw(model.parameters())
    losses = []
    for tokens in batches(config(), 3):
        loss = lm_loss(model, rank_slice(tokens, rank, world))
        loss.backward()
        dist.all_reduce(model.norm.weight.grad, op=dist.ReduceOp.AVG)  # the user's job now
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss.item(), world))
    return plain, losses, full_state(model)


def test_ignored_params_stay_plain_and_unreduced():
    ref_losses, ref_weights = _reference()
    for plain, losses, weights in run_distributed(_ignored, 2):
        assert plain
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, ref_weights) <= TOLERANCE


# --- a forward method other than forward -----------------------------------------------------
class WithGenerate(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)

    def generate(self, x):  # reaches the parameters without forward
        return torch.tanh(self.proj(x)) * 2


def _generate():
    model = WithGenerate()
    flatshard.fully_shard(model)
    flatshard.register_fsdp_forward_method(model, "generate")
    with torch.no_grad():
        return model.generate(torch.ones(2, 8))


def test_register_fsdp_forward_method():
    expected = WithGenerate().generate(torch.ones(2, 8)).detach()
    for output in run_distributed(_generate, 2):
        assert torch.allclose(output, expected, rtol=0, atol=1e-6)


# --- FSDPModule setters ----------------------------------------------------------------------
def _setters():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(build_model(config()))
    model.set_force_sum_reduction_for_comms(True)
    model.set_is_last_backward(True)
    model.set_post_optim_event(None)
    model.embed_tokens.set_unshard_in_backward(False)  # an embedding's backward reads no weight
    losses = train(model, batches(config(), 3), rank=rank, world=world)
    return losses, full_state(model)


def test_setters_keep_single_process_results():
    ref_losses, ref_weights = _reference()
    for losses, weights in run_distributed(_setters, 2):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, ref_weights) <= TOLERANCE


# --- freezing after fully_shard --------------------------------------------------------------
def _freeze_schedule(model, step):
    """Block 0 frozen for step 1 only; the embedding frozen from step 1 on."""
    for p in model.layers[0].parameters():
        p.requires_grad_(step != 1)
    model.embed_tokens.weight.requires_grad_(step == 0)


def _train_with_freezing(model, rank=0, world=1, counted=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step, tokens in enumerate(batches(config(), 3)):
        _freeze_schedule(model, step)
        comm.traffic.take()
        loss = lm_loss(model, rank_slice(tokens, rank, world))
        loss.backward()
        if counted is not None:
            counted.append(comm.traffic.take()[1])  # reduce-scatter bytes this step
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _frozen_after_wrapping():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(build_model(config()))
    counted = []
    _train_with_freezing(model, rank, world, counted)
    return full_state(model), counted


def test_freezing_and_unfreezing_after_fully_shard():
    reference = build_model(config())
    _train_with_freezing(reference)
    results = run_distributed(_frozen_after_wrapping, 2)
    for weights, counted in results:
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE
        assert counted[1] < counted[0] and counted[2] > counted[1]  # frozen: less reduced


# --- clip_grad_norm_ with empty local shards --------------------------------------------------
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.tiny = nn.Linear(1, 1, bias=False)  # one row: empty on every other rank
        self.wide = nn.Linear(1, 16, bias=False)

    def forward(self, x):
        return self.wide(self.tiny(x))


def _norms():
    model = Small()
    reference = copy.deepcopy(model)
    flatshard.fully_shard(model.tiny)
    flatshard.fully_shard(model)
    x = torch.linspace(-1, 1, 6).view(6, 1)
    out = {}
    for norm_type in (float("inf"), 1.0, 2.0):
        for foreach in (None, False):  # False: torch's per-tensor path (linalg.vector_norm)
            for m in (model, reference):
                m.zero_grad()
                m(x).pow(2).sum().backward()
            clip = torch.nn.utils.clip_grad_norm_
            ours = clip(model.parameters(), 1e9, norm_type=norm_type, foreach=foreach)
            theirs = clip(reference.parameters(), 1e9, norm_type=norm_type, foreach=foreach)
            out[(norm_type, foreach)] = (ours.full_tensor().item(), theirs.item())
    return out


def test_clip_grad_norm_with_empty_shards():
    for out in run_distributed(_norms, 4):
        for norm_type, (ours, theirs) in out.items():
            assert abs(ours - theirs) <= 1e-6 * theirs, (norm_type, ours, theirs)


# --- arguments and errors --------------------------------------------------------------------
def _arguments():
    from torch.distributed.fsdp import OffloadPolicy

    found = {}
    model = build_model(config())
    flatshard.fully_shard(
        model.layers[0], shard_placement_fn=lambda p: Shard(0), offload_policy=OffloadPolicy()
    )
    for name, call, error in (
        ("dim1", lambda: flatshard.fully_shard(model.layers[1],
                                               shard_placement_fn=lambda p: Shard(p.dim())),
         NotImplementedError),
        ("offload", lambda: flatshard.fully_shard(model.norm, offload_policy="cpu"),
         ValueError),
        ("container", lambda: flatshard.fully_shard(model.layers), ValueError),
        ("deepcopy", lambda: copy.deepcopy(model.layers[0]), ValueError),
        ("twice", lambda: flatshard.fully_shard(model.layers[0]), ValueError),
    ):  # fmt: skip
        try:
            call()
        except error as caught:
            found[name] = str(caught)
    return found


def test_fsdp2_arguments_and_error_types():
    for found in run_distributed(_arguments, 2):
        assert "Shard(d)" in found["dim1"] and "Shard(dim=1)" in found["dim1"]
        assert "CPUOffloadPolicy" in found["offload"] and "got str" in found["offload"]
        assert "ModuleList" in found["container"]
        assert "deepcopy" in found["deepcopy"]
        assert "already fully_shard-ed" in found["twice"]
    assert issubclass(WrappingError, ValueError)


# --- FSDP2's meta-device flow ------------------------------------------------------------------
def _meta_flow(path):
    """torchtitan's: build on meta, fully_shard, to_empty, init_weights, DCP load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with torch.device("meta"):
        model = flatshard.models.Llama(config())
    shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters") and module is not model:
                module.reset_parameters()
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        return model(torch.arange(8).view(1, 8)), full_state(model)


def _save_reference(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = shard(build_model(config(), seed=5))
    dcp.save(get_model_state_dict(model), checkpoint_id=path)


def test_meta_device_flow_like_fsdp2(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_reference, 2, path)
    expected = build_model(config(), seed=5)
    with torch.no_grad():
        logits = expected(torch.arange(8).view(1, 8))
    for output, weights in run_distributed(_meta_flow, 2, path):
        assert rel_diff(weights, expected.state_dict()) == 0.0
        assert torch.allclose(output, logits, atol=1e-6)
