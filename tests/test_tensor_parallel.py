"""Tensor parallelism of the reference Llama (flatshard.parallel) against one process: every
TP rank trains on the same batch; losses and full weights must equal a single process's,
fused gate/up included (a plain ColwiseParallel on it pairs the wrong rows)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import adamw, batches, build_model, config, lm_loss, rel_diff, rel_losses
from torch.distributed.tensor import DTensor

import flatshard
from flatshard.errors import MeshError, UnevenShardError
from flatshard.models.llama import check_tp, parallelize_llama

CFG = dict(n_heads=8, n_kv_heads=4, dim=32, ffn_dim=48, attention_bias=True)  # divisible by 4


def _full(model) -> dict:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _train_tp(steps):
    tp = torch.distributed.get_world_size()
    model = build_model(config(**CFG))
    parallelize_llama(model, flatshard.ParallelDims(tp, tp=tp).build().tp)
    optimizer = adamw(model.parameters())
    losses = []
    for tokens in batches(config(**CFG), steps):
        loss = lm_loss(model, tokens)  # TP: every rank computes the same batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, _full(model)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_trains_like_one_process(tp):
    reference = build_model(config(**CFG))
    optimizer = adamw(reference.parameters())
    ref_losses = []
    for tokens in batches(config(**CFG), 3):
        loss = lm_loss(reference, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    for losses, weights in run_distributed(_train_tp, tp, 3):
        assert rel_losses(losses, ref_losses) <= 1e-6
        assert rel_diff(weights, dict(reference.named_parameters())) <= 1e-6


def test_tp_config_errors_name_the_dimension():
    with pytest.raises(MeshError, match=r"n_kv_heads \(2\)"):
        check_tp(config(), 4)  # tiny: 4 heads, 2 kv heads, ffn 45
    with pytest.raises(MeshError, match=r"ffn_dim \(45\)"):
        check_tp(config(), 2)


def _strided_parts_moves():
    """Each case: (what strided_parts gathered, the global tensor, this rank's part as
    strided_parts cut it, torch's cut, the gradient `full_tensor()` gave the local part,
    the gradient expected)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from flatshard.dtensor import patches, strided_parts

    patches.install()
    mesh = flatshard.ParallelDims(dist_size(), tp=dist_size()).build("cpu").tp
    out = []
    for shape, dim, parts in [((8, 3), 0, 2), ((9, 3), 0, 2), ((7,), 0, 3), ((2, 11), 1, 2)]:
        whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        placement = _StridedShard(dim, split_factor=parts)
        torch_cut = distribute_tensor(whole, mesh, [placement], src_data_rank=None)  # torch's
        replicated = distribute_tensor(whole, mesh, [Replicate()])
        gathered = strided_parts.redistribute(
            torch_cut.to_local(), torch_cut._spec, replicated._spec
        )
        cut = strided_parts.redistribute(whole, replicated._spec, torch_cut._spec)
        local = torch_cut.to_local().clone().requires_grad_()
        param = DTensor.from_local(
            local, mesh, [placement], run_check=False, shape=whole.shape, stride=whole.stride()
        )
        (param.full_tensor() * whole).sum().backward()  # the gradient is `whole`'s part
        out.append((gathered, whole, cut, torch_cut.to_local(), local.grad, torch_cut.to_local()))
    return out


def dist_size() -> int:
    return torch.distributed.get_world_size()


@pytest.mark.parametrize("world", [2, 4])
def test_fused_parts_gather_and_split_in_torchs_order(world):
    """strided_parts.py (which torch 2.11 needs; patches.py routes it on every torch) puts
    each rank's parts where torch 2.13's `_StridedShard` puts them, uneven sizes and dim 1
    included, through `full_tensor()` and its backward too."""
    for cases in run_distributed(_strided_parts_moves, world):
        for gathered, whole, cut, torch_cut, grad, expected_grad in cases:
            assert torch.equal(gathered, whole)
            assert torch.equal(cut, torch_cut)
            assert torch.equal(grad, expected_grad)


def _unequal_parts():
    """A fused `[q; k; v]` of unequal parts (GQA) split over TP alone: `full_tensor()` of
    the weight and the bias, the gradient it gives the local part; then a second weight of
    the same shape with other parts (which of the two a tensor belongs to is then unknown)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from flatshard.parallel.tensor_parallel import FusedColwiseParallel

    rank, ranks = dist.get_rank(), dist_size()
    mesh = flatshard.ParallelDims(ranks, tp=ranks).build("cpu").tp
    torch.manual_seed(0)
    sizes = [8, 4, 4]
    qkv = torch.nn.Linear(8, 16)
    parts = [(name, rows) for name, rows in zip("qkv", sizes)]
    qkv.fused_components = {"weight": parts, "bias": parts}
    weight, bias = qkv.weight.detach().clone(), qkv.bias.detach().clone()
    parallelize_module(qkv, mesh, FusedColwiseParallel())
    scale = torch.randn(16, 8)
    (qkv.weight.full_tensor() * scale).sum().backward()
    mine = torch.cat([part.chunk(ranks)[rank] for part in scale.split(sizes)])
    found = (
        torch.equal(qkv.weight.full_tensor(), weight),
        torch.equal(qkv.bias.full_tensor(), bias),
        torch.equal(qkv.weight.grad.to_local(), mine),
    )
    other = torch.nn.Linear(8, 16, bias=False)
    other.fused_components = {"weight": [("q", 4), ("k", 6), ("v", 6)]}
    parallelize_module(other, mesh, FusedColwiseParallel())
    try:
        other.weight.full_tensor()
    except UnevenShardError as error:
        return found, str(error)
    return found, None


def test_fused_parts_of_unequal_sizes_gather_in_place():
    """torch's `_StridedShard` knows how many parts, not their sizes: with GQA's unequal
    `[q; k; v]` its chunks put rows in the wrong places (silently). flatshard registers each
    fused weight's parts, and where two weights of one shape disagree it raises."""
    for found, ambiguous in run_distributed(_unequal_parts, 2):
        assert found == (True, True, True)
        assert ambiguous is not None and "declare different parts" in ambiguous
