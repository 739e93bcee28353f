"""Checkpoints planned from the layout: every rank derives the whole DCP plan alone (no
plan gather), the `.metadata` it yields equals DCP's own chunk for chunk, plain DCP and
PyTorch FSDP2 read it, and a save or a load costs the same few collectives at any world
size. Tensors split by TP or EP as well are placed by shifting a rank's pieces to the other
TP/EP ranks' places."""

from __future__ import annotations

import os
import pickle
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from reference import adamw, batches, build_model, config, hsdp_mesh, lm_loss, rank_slice, shard
from test_collectives import CollectiveCounter
from test_expert_parallel import ep_model
from test_moe_training import moe_loss
from test_tp_fsdp import tp_model
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

import flatshard
from flatshard import checkpoint
from flatshard.checkpoint import writing
from flatshard.checkpoint.state import app_state, checkpoint_group

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop


def _trained(layout: str):
    """A model and AdamW after one step, wrapped as `layout` says."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    loss = lm_loss
    if layout.startswith("tp"):  # a TP group's ranks must see the same batch
        model, rank = tp_model(1, ranks // 2, 2)
        ranks //= 2
    elif layout == "ep":  # experts over 2 ranks, sharded over the other 2
        model = ep_model(2)
        loss = partial(moe_loss, group=dist.group.WORLD)
    else:
        mesh = hsdp_mesh(2) if layout == "hsdp" else None
        offload = flatshard.OffloadPolicy(fraction=0.5) if layout == "offload" else None
        stage = 2 if layout == "zero2" else 3
        model = shard(build_model(config()), stage, mesh=mesh, offload_policy=offload)
    optimizer = adamw(model.parameters())
    data = batches(model.config if layout == "ep" else config(), 1)
    loss(model, rank_slice(data[0], rank, ranks)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _chunks(metadata) -> dict:
    out = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        if chunks is None:
            out[fqn] = "bytes"
            continue
        listed = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
        out[fqn] = (tuple(entry.size), str(entry.properties.dtype), listed)
    return out


def _ours_against_dcp(root: str, layout: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = _trained(layout)
    state = app_state(model, optimizer, {"position": 7})
    group = checkpoint_group()
    ours, theirs = os.path.join(root, "ours"), os.path.join(root, "dcp")
    if rank == 0:
        os.makedirs(ours)
    dist.barrier()
    prepared = writing.prepare(state, group, rank, world)
    writing.write_files(ours, prepared, group, rank, staging_bytes=4096)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs), process_group=group)
    dist.barrier()
    same = _chunks(dcp.FileSystemReader(ours).read_metadata()) == _chunks(
        dcp.FileSystemReader(theirs).read_metadata()
    )
    # plain DCP (its own collective planning) reads ours into a zeroed copy of the state
    loaded = app_state(model, optimizer, {"position": 0})
    flat, _ = flatten_state_dict(loaded)
    originals = {k: v.detach().clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    for value in flat.values():
        if isinstance(value, torch.Tensor):
            (value._local_tensor if isinstance(value, DTensor) else value).zero_()
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(ours), process_group=group)
    flat, _ = flatten_state_dict(loaded)
    # every rank compares every tensor (full_tensor is a collective: no early exit)
    unequal = [k for k, v in originals.items() if not torch.equal(_plain(flat[k]), _plain(v))]
    equal = not unequal
    return prepared.planned is not None, same, equal, loaded["extra"]["position"]


def _plain(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


@pytest.mark.parametrize(
    "layout,world",
    [("zero3", 2), ("zero2", 4), ("hsdp", 4), ("offload", 2), ("tp", 4), ("ep", 4)],
)
def test_layout_plan_is_dcps_plan_and_dcp_reads_it(tmp_path, layout, world):
    for planned_locally, same, equal, position in run_distributed(
        _ours_against_dcp, world, str(tmp_path), layout
    ):
        assert planned_locally and same and equal and position == 7


# --- collectives per save and load: constant in the world size ------------------------------
# each object collective and its argument that holds what this rank sends
_SENT = {
    "gather_object": "obj",
    "scatter_object_list": "scatter_object_input_list",
    "broadcast_object_list": "object_list",
}
OBJECT_COLLECTIVES = list(_SENT)


class _Counter(CollectiveCounter):
    """Also the object collectives (DCP plans with them), and the pickled bytes they move."""

    def __enter__(self):
        super().__enter__()
        for name in OBJECT_COLLECTIVES:
            original = self._originals[name] = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[(self.phase, _name)] += 1
                sent = kwargs.get(_SENT[_name], args[0] if args else None)
                self.bytes[(self.phase, "objects")] += len(pickle.dumps(sent))
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self


def _count(root: str):
    model = shard(build_model(config()))
    optimizer = adamw(model.parameters())
    checkpoint.save(root, model=model, optimizer=optimizer, step=0)  # warm-up: groups exist
    with _Counter() as counter:
        counter.phase = "save"
        checkpoint.save(root, model=model, optimizer=optimizer, step=1)
        counter.phase = "load"
        checkpoint.load(root, model=model, optimizer=optimizer)
        counter.phase = "dcp save"
        state = app_state(model, optimizer, {})
        dcp.save(state, checkpoint_id=os.path.join(root, "dcp"), process_group=checkpoint_group())
    totals: dict = {}
    for (phase, _), calls in counter.calls.items():
        totals[phase] = totals.get(phase, 0) + calls
    moved = {phase: size for (phase, kind), size in counter.bytes.items() if kind == "objects"}
    return totals, moved


@pytest.mark.parametrize(
    "worlds",  # world 8 (eight processes on the CI machine's two cores): exhaustive
    [(1, 2, 4), pytest.param((1, 2, 4, 8), marks=pytest.mark.exhaustive, id="to-8")],
)
def test_collectives_per_save_and_load_are_constant_in_the_world_size(tmp_path, worlds):
    counts, moved = {}, {}
    for world in worlds:
        counts[world], moved[world] = run_distributed(_count, world, str(tmp_path / f"{world}"))[0]
    print(counts, moved)
    # a save: the step check, the directory, the plan's fingerprint, the files' checksums to
    # rank 0, the commit; a load: the integrity check's agreement
    assert len({counts[w]["save"] for w in worlds[1:]}) == 1 and counts[2]["save"] <= 5, counts
    assert len({counts[w]["load"] for w in worlds[1:]}) == 1 and counts[2]["load"] <= 1, counts
    # what rank 0 receives is a checksum per file, not every rank's plan as DCP's gather
    assert max(moved[w]["save"] for w in moved) < 200, moved  # rank 0's own (CRCs vary)
    widest = worlds[-1]
    assert moved[widest]["save"] * 10 < moved[widest]["dcp save"], moved


# --- the plan of a run's saves is derived once ----------------------------------------------
def _planned_twice():
    from flatshard.checkpoint import global_plan

    model, optimizer = _trained("zero3")
    flat, _ = flatten_state_dict(app_state(model, optimizer, {"position": 1}))
    first = global_plan.plan(flat, dist.get_world_size())
    with torch.no_grad():  # new values: the same structure
        next(model.parameters()).add_(1.0)
    again, _ = flatten_state_dict(app_state(model, optimizer, {"position": 2}))
    reused = global_plan.plan(again, dist.get_world_size()) is first
    other = shard(build_model(config(n_layers=3)))
    other_flat, _ = flatten_state_dict(app_state(other, adamw(other.parameters()), {}))
    return reused, global_plan.plan(other_flat, dist.get_world_size()) is not first


def test_a_runs_later_saves_reuse_the_plan():
    assert run_distributed(_planned_twice, 2) == [(True, True)] * 2
