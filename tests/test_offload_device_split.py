"""Optimizer offload where the host is not the mesh's device (CUDA in use): the sharded
parameter of an offloaded piece must view its host buffer, so that the optimizer's step is
what the next gather sends.

`DTensor.from_local` moves a local tensor on another device type than its mesh's to the
mesh's device: the parameters (and gradients) of offloaded pieces were device copies,
stepped by the optimizer while every forward gathered the unchanged host buffer (first
step's losses equal, then training silently diverged). On the CPU the host is the device,
so here the units' DTensor mesh is given another device type ("cuda", no backend: no CUDA
is needed) while the buffers stay on the CPU; a copy to it would fail loudly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, config, lm_loss
from torch.distributed.device_mesh import DeviceMesh

import flatshard
from flatshard.runtime.offload import units_below

STEPS = 3


def _other_device_type(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh`'s ranks and names on the "cuda" device type, with no backend behind it."""
    return DeviceMesh("cuda", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)


def _model(cfg, offload_policy=None, split=False):
    """A meta-built Llama through `parallelize` and `materialize`, as scripts/gpu_check.py
    builds it; `split`: its DTensors on a mesh of another device type than its buffers."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = flatshard.models.Llama(cfg)
    dims = flatshard.ParallelDims(dist.get_world_size()).build("cpu")
    flatshard.parallelize(model, dims, offload_policy=offload_policy)
    if split:
        for unit in units_below([model]):
            unit.mesh.param_mesh = _other_device_type(unit.mesh.param_mesh)
    torch.manual_seed(0)
    flatshard.materialize(model, torch.device("cpu"))
    return model


def _host_pieces(model):
    for unit in units_below([model]):
        for managed in unit.params:
            shard = unit.buckets[managed.bucket].shard
            if shard.on_host(managed.index):
                yield managed, shard


def _train_with_split(fraction: float, optimizer: str = "torch"):
    cfg = config()
    data = batches(cfg, STEPS)
    reference = _model(cfg)
    ours = _model(cfg, flatshard.OffloadPolicy(fraction=fraction), split=True)
    pieces = list(_host_pieces(ours))
    assert pieces, "nothing was offloaded"
    for managed, shard in pieces:
        param = managed.sharded
        assert param.device_mesh.device_type == "cuda"
        local = param.to_local().data_
        assert local.device.type == "cpu"
        assert local.untyped_storage().data_ptr() == shard.host_main.untyped_storage().data_ptr()

    models = (reference, ours)
    make = torch.optim.AdamW if optimizer == "torch" else flatshard.optim.AdamW
    optimizers = [make(m.parameters(), lr=1e-3) for m in models]
    losses = ([], [])
    first_step = None
    for step, tokens in enumerate(data):
        for model, optimizer, out in zip(models, optimizers, losses):
            loss = lm_loss(model, tokens)
            loss.backward()
            flatshard.clip_grad_norm_(model.parameters(), 0.5)  # host and device groups
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        if step == 0:
            first_step = [
                torch.equal(a.to_local().data_, b.to_local().data_)
                for a, b in zip(ours.parameters(), reference.parameters())
            ]
    # the steps landed in the host buffers the next forward gathered
    for managed, shard in pieces:
        assert managed.sharded.to_local().data_.data_ptr() == shard.rows(managed.index).data_ptr()
    return first_step, losses


@pytest.mark.parametrize("optimizer", ["torch", "flat"])
def test_offloaded_pieces_are_stepped_where_they_are_gathered(optimizer):
    for fraction in (0.5, 1.0):
        outcome = run_distributed(_train_with_split, 1, fraction, optimizer)[0]
        first_step, (reference, ours) = outcome
        assert all(first_step), fraction
        assert ours == reference, fraction
