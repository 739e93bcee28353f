"""Real third-party FSDP2 clients, run on PyTorch's FSDP2 and on flatshard with only
`torch.distributed.fsdp.fully_shard` swapped: Hugging Face accelerate's FSDP2 plugin
(`Accelerator.prepare`, its auto-wrap policy, `cpu_ram_efficient_loading`'s meta-device
model loaded from rank 0 through `distribute_tensor` and `load_state_dict(assign=True)`).
Losses and weights must agree. (Its flows are also reproduced in tests/fsdp2_dropin.py.)"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from fsdp2_behaviours import close, full_weights, global_mean, inputs, mine, net

pytest.importorskip("accelerate")


@contextlib.contextmanager
def _accelerate_on_cpu(lib):
    """accelerate's process state from the running group; FSDP2's `fully_shard` replaced by
    flatshard's for lib="flatshard" (accelerate imports it from torch at each call)."""
    import torch.distributed.fsdp as torch_fsdp
    from accelerate.state import AcceleratorState

    import flatshard

    env = {"WORLD_SIZE": str(dist.get_world_size()), "RANK": str(dist.get_rank()),
           "LOCAL_RANK": str(dist.get_rank()), "ACCELERATE_USE_FSDP": "true"}  # fmt: skip
    saved = {key: os.environ.get(key) for key in env}
    original = torch_fsdp.fully_shard
    os.environ.update(env)
    if lib == "flatshard":
        torch_fsdp.fully_shard = flatshard.fully_shard
    try:
        yield
    finally:
        torch_fsdp.fully_shard = original
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        AcceleratorState._reset_state(True)


def _accelerate(lib, efficient_loading):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    with _accelerate_on_cpu(lib):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Block"],
            cpu_ram_efficient_loading=efficient_loading,
        )
        accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
        # accelerate chooses its FSDP path on accelerators only; on the CPU, ask for it
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        model = net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        wrapped = [isinstance(block, FSDPModule) for block in model.blocks]
        losses = []
        for x in inputs(3):
            loss = model(mine(x)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(global_mean(loss))
        return {"losses": losses, "weights": full_weights(model), "blocks_wrapped": wrapped}


@pytest.mark.parametrize("efficient_loading", [False, True])
def test_accelerate_fsdp2_plugin(efficient_loading):
    theirs = run_distributed(_accelerate, 2, "fsdp2", efficient_loading)[0]
    for ours in run_distributed(_accelerate, 2, "flatshard", efficient_loading):
        close(ours, theirs, 1e-6, "accelerate")
