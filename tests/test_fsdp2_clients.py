"""Real third-party FSDP2 clients, run on PyTorch's FSDP2 and on flatshard with only
`fully_shard` swapped: Hugging Face accelerate's FSDP2 plugin (`Accelerator.prepare`, its
auto-wrap policy, `cpu_ram_efficient_loading`'s meta-device model loaded from rank 0
through `distribute_tensor` and `load_state_dict(assign=True)`), and Lightning Fabric's
`ModelParallelStrategy` (a meta-device model materialised by Lightning with `to_empty` and
`reset_parameters`, accumulation under `no_backward_sync`, which finds the units by
`isinstance(m, FSDPModule)`, and its single-file checkpoint of full model and optimizer
state saved, loaded into a fresh model and trained on). Losses and weights must agree.
(Their flows are also reproduced in tests/fsdp2_dropin.py.)"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from fsdp2_behaviours import close, full_weights, global_mean, inputs, mine, net


@contextlib.contextmanager
def _environment(env):
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rank_environment(**extra) -> dict:
    """What a launcher sets for each process (the workers' group is already running)."""
    rank = str(dist.get_rank())
    return {"WORLD_SIZE": str(dist.get_world_size()), "RANK": rank, "LOCAL_RANK": rank, **extra}


@contextlib.contextmanager
def _accelerate_on_cpu(lib):
    """accelerate's process state from the running group; FSDP2's `fully_shard` replaced by
    flatshard's for lib="flatshard" (accelerate imports it from torch at each call)."""
    import torch.distributed.fsdp as torch_fsdp
    from accelerate.state import AcceleratorState

    import flatshard

    original = torch_fsdp.fully_shard
    if lib == "flatshard":
        torch_fsdp.fully_shard = flatshard.fully_shard
    try:
        with _environment(_rank_environment(ACCELERATE_USE_FSDP="true")):
            yield
    finally:
        torch_fsdp.fully_shard = original
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
    pytest.importorskip("accelerate")
    theirs = run_distributed(_accelerate, 2, "fsdp2", efficient_loading)[0]
    for ours in run_distributed(_accelerate, 2, "flatshard", efficient_loading):
        close(ours, theirs, 1e-6, "accelerate")


def _lightning(lib, checkpoint):
    """Lightning Fabric's ModelParallelStrategy, as its FSDP2 examples use it: the user's
    `parallelize_fn` shards each block and the root over the data-parallel mesh."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import flatshard

    fully_shard = flatshard.fully_shard if lib == "flatshard" else torch_fully_shard

    def parallelize(model, device_mesh):
        mesh = device_mesh["data_parallel"]
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def fresh(fabric):
        with fabric.init_module(empty_init=True):  # meta; Lightning materialises it
            model = net()
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        return model, optimizer

    def train(fabric, model, optimizer, batches):
        losses = []
        for x in batches:
            first, second = mine(x).chunk(2)
            with fabric.no_backward_sync(model, enabled=True):
                fabric.backward(model(first).pow(2).mean() / 2)
            # Lightning turned sync off on every FSDPModule: nothing reduced yet
            held.append(all(p.grad is None for p in model.parameters()))
            loss = model(second).pow(2).mean() / 2
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(global_mean(loss))
        return losses

    held = []
    with _environment(_rank_environment()):
        strategy = ModelParallelStrategy(
            parallelize, data_parallel_size=dist.get_world_size(), tensor_parallel_size=1,
            save_distributed_checkpoint=False,  # one file: full model and optimizer state
        )  # fmt: skip
        fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
        fabric.launch()
        model, optimizer = fresh(fabric)
        initial = full_weights(model)
        batches = inputs(4)
        losses = train(fabric, model, optimizer, batches[:2])
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
        model, optimizer = fresh(fabric)
        fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
        losses += train(fabric, model, optimizer, batches[2:])
        weights = full_weights(model)
        return {"initial": initial, "losses": losses, "weights": weights, "held": held}


def test_lightning_model_parallel_strategy(tmp_path):
    pytest.importorskip("lightning")
    theirs = run_distributed(_lightning, 2, "fsdp2", str(tmp_path / "fsdp2.ckpt"))[0]
    assert theirs["held"] == [True] * 4
    for ours in run_distributed(_lightning, 2, "flatshard", str(tmp_path / "flatshard.ckpt")):
        close(ours, theirs, 1e-6, "lightning")
