"""Ops that keep a flatshard parameter's rows but change its shape (a reduction or a
softmax along another dim, a matrix product, a transpose) give DTensors that gather by
flatshard's rows: `full_tensor()` equals the op on the full tensor. Before, DTensor
gathered them by `torch.chunk` sizes: `p.sum(dim=1).full_tensor()` hung, and where the
sizes happened to pass, rows were wrong."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from reference import build_model, config, shard
from torch.distributed.tensor import DTensor, Replicate

CASES = {
    "sum over dim 1": (lambda p, x: p.sum(dim=1), lambda f, x: f.sum(dim=1)),
    "norm over dim 1": (lambda p, x: p.norm(dim=1), lambda f, x: f.norm(dim=1)),
    "amax, keepdim": (lambda p, x: p.amax(1, keepdim=True), lambda f, x: f.amax(1, keepdim=True)),
    "softmax": (lambda p, x: torch.softmax(p, dim=1), lambda f, x: torch.softmax(f, dim=1)),
    "p @ x": (lambda p, x: p @ x, lambda f, x: f @ x.full_tensor()),
    "p.T": (lambda p, x: p.T, lambda f, x: f.T),
    "p @ p.T": (lambda p, x: p @ p.T, lambda f, x: f @ f.T),
    "p.T @ p": (lambda p, x: p.T @ p, lambda f, x: f.T @ f),
    "sum over dim 0": (lambda p, x: p.sum(dim=0), lambda f, x: f.sum(dim=0)),
    "p.T.sum(0)": (lambda p, x: p.T.sum(dim=0), lambda f, x: f.T.sum(dim=0)),
    "p.T.sum(0, keepdim)": (lambda p, x: p.T.sum(0, keepdim=True), lambda f, x: f.T.sum(0, True)),
    "p.T.T": (lambda p, x: p.T.T, lambda f, x: f),
    "softmax of p.T": (lambda p, x: torch.softmax(p.T, 0), lambda f, x: torch.softmax(f.T, 0)),
    "p[:, 1:4]": (lambda p, x: p[:, 1:4], lambda f, x: f[:, 1:4]),
    "p[:, 2]": (lambda p, x: p[:, 2], lambda f, x: f[:, 2]),
}


def _compare():
    model = shard(build_model(config()))  # rows split unevenly, unlike torch.chunk
    wrong = []
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        full = p.full_tensor()
        x = torch.randn(p.shape[1], 5, generator=torch.Generator().manual_seed(0))
        x = DTensor.from_local(x, p.device_mesh, [Replicate()], run_check=False)
        for case, (ours, reference) in CASES.items():
            got = ours(p, x).full_tensor()
            if not torch.allclose(got, reference(full, x), atol=1e-5):
                wrong.append((name, case))
    return wrong


@pytest.mark.parametrize("world", [2, 3])
def test_shape_changing_ops_keep_flatshard_rows(world):
    assert run_distributed(_compare, world, timeout=60) == [[]] * world
