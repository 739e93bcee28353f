"""Where buffers live: the device comes from the mesh / process group's backend, never from
whether a GPU is visible (a gloo run on a GPU machine stays on the CPU)."""

from __future__ import annotations

import torch
from distributed import run_distributed
from reference import build_model, config

import flatshard
from flatshard import registry
from flatshard.models import Llama


def _shard_with_cuda_visible():
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # what a GPU machine reports
    try:
        model = build_model(config())
        for block in model.layers:
            flatshard.fully_shard(block)
        flatshard.fully_shard(model)
        devices = {p.to_local().device.type for p in model.parameters()}
        units = registry.units_below(model)
        buffers = {b.shard.main.device.type for u in units for b in u.buckets}
        with torch.device("meta"):  # materialize's default device follows the units
            meta = Llama(config())
        flatshard.fully_shard(meta)
        flatshard.materialize(meta)
        return devices, buffers, {p.to_local().device.type for p in meta.parameters()}
    finally:
        torch.cuda.is_available = real


def test_gloo_stays_on_cpu_when_cuda_is_visible():
    for devices, buffers, materialized in run_distributed(_shard_with_cuda_visible, 2):
        assert devices == buffers == materialized == {"cpu"}


def test_root_moves_forward_inputs_to_the_parameters_device():
    """The root's pre-forward moves every tensor input (token ids included) to the mesh's
    device, leaving other values alone; `meta` stands in for a GPU here."""
    from flatshard.runtime.hooks import inputs_to_device

    args = (torch.arange(4), {"mask": torch.ones(2, dtype=torch.bool), "n": 3})
    moved_args, moved_kwargs = inputs_to_device((args, {"x": torch.zeros(1)}), torch.device("meta"))
    assert moved_args[0].device.type == "meta" and moved_args[1]["mask"].device.type == "meta"
    assert moved_args[1]["n"] == 3 and moved_kwargs["x"].device.type == "meta"
    same = torch.zeros(2)
    assert inputs_to_device(same, torch.device("cpu")) is same  # already there: no copy


def test_nccl_beside_gloo_is_a_cuda_group(monkeypatch):
    # the trainer's backend on CUDA: "cuda:nccl,cpu:gloo" (host pieces reduce over gloo)
    from flatshard import comm

    for backend, expected in (("cuda:nccl,cpu:gloo", "cuda"), ("nccl", "cuda"), ("gloo", "cpu")):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None, b=backend: b)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert comm.group_device(None).type == expected
