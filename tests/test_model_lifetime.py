"""A sharded model that is deleted (with its optimizer) frees everything it held: its units,
its flat buffers, its sharded parameters. flatshard's registry links modules and DTensors to
their units; a link that held the unit strongly kept the whole model alive (on a GPU, its
device memory) for the life of the process."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from reference import batches, build_model, config, shard, train

import flatshard
from flatshard import registry


def _trained(how: str):
    model = build_model(config())
    if how == "parallelize-ac-offload":
        mesh = flatshard.ParallelDims(2).build("cpu")
        flatshard.parallelize(model, mesh, activation_checkpointing="offload")
    else:
        offload = flatshard.OffloadPolicy(fraction=0.5) if how == "optimizer-offload" else None
        shard(model, offload_policy=offload)
    train(model, batches(model.config, 1), rank=dist.get_rank(), world=dist.get_world_size())
    return model


def _freed(how: str) -> list[str]:
    model = _trained(how)
    units = registry.units_below(model)
    watched = {"model": weakref.ref(model)}
    for number, unit in enumerate(units):
        watched[f"unit {number}"] = weakref.ref(unit)
        for index, bucket in enumerate(unit.buckets):
            watched[f"unit {number} bucket {index} shard"] = weakref.ref(bucket.shard.main)
    watched.update({name: weakref.ref(p) for name, p in model.named_parameters()})
    del model, units, unit, bucket
    gc.collect()
    return [name for name, ref in watched.items() if ref() is not None]


@pytest.mark.parametrize("how", ["fully_shard", "optimizer-offload", "parallelize-ac-offload"])
def test_a_deleted_model_is_freed(how):
    for alive in run_distributed(_freed, 2, how):
        assert alive == []


def _links_while_alive() -> bool:
    model = shard(build_model(config()))
    gc.collect()
    layer = model.layers[0]
    unit = registry.unit_of(layer)
    owner = registry.managed_of(next(layer.parameters()))
    tokens = batches(model.config, 1)[0]
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    return unit is not None and owner is not None and owner[0] is unit and loss.item() > 0


def test_the_registry_keeps_its_links_while_the_model_lives():
    # weak links: the unit is still found while only its module holds it
    assert all(run_distributed(_links_while_alive, 2))
