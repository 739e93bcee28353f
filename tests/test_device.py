"""Where buffers live: the device comes from the mesh / process group's backend, never from
whether a GPU is visible (a gloo run on a GPU machine stays on the CPU)."""

from __future__ import annotations

import torch
from distributed import run_distributed
from reference import build_model, config

import flatshard
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
        units = {m._flatshard_unit for m in model.modules() if hasattr(m, "_flatshard_unit")}
        buffers = {b.main.device.type for u in units for b in u.buckets}
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
