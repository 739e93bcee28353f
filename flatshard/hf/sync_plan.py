"""What one trainer rank sends in a weight sync: its blocks of the full tensors (the DCP
chunks its checkpoint would write, so each block goes out once however a tensor is
replicated over HSDP or TP), cut to the part each receiver asks for (a TP-sharded receiver
asks for its slices), grouped into buckets of a byte budget that never mix two flat
buffers, so a delta sync sends just the buffers written since the last one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import param_spec
from flatshard.errors import WeightSyncError
from flatshard.hf.adapter import adapter_for
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.stream import model_order
from flatshard.hf.sync_wire import Piece, piece_bytes
from flatshard.layout.spec import Box

Wanted = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) a receiver keeps


@dataclass
class Route:
    """What goes to one receiver: parts (a piece of this rank, the block of it sent, where
    that block lies in the piece) and the buckets of parts."""

    parts: list[tuple[int, Piece, tuple[slice, ...]]]
    buckets: list[list[int]]
    sent_versions: list[tuple] | None = None


@dataclass
class SendPlan:
    """One model's sync from this rank: its pieces, the tensors they are cut from as they
    are now, what rank 0 tells the receivers, and a route per receiver."""

    number: int  # the same on every trainer rank: plans are made in the same order
    tensors: Callable[[], dict[str, torch.Tensor]]
    pieces: list[Piece]
    announcement: dict  # the tensors' shapes and dtypes, and the outputs cut from them
    routes: dict[int, Route] = field(default_factory=dict)
    syncs: int = 0
    # {weight name: its update as a function of a block} of modules whose weight the model
    # computes with is more than the parameter (LoRA's base + scale * B @ A), made anew
    # every sync (a collective); empty for most models
    updates: Callable[[], dict[str, Callable]] = dict


def make_plan(model: nn.Module, names: str, rank: int, number: int) -> SendPlan:
    """This rank's pieces of `model`'s tensors, named as `names` says."""
    if names == "hf":
        adapter = adapter_for(model)
        mappings, unmapped = adapter.plan(model)
        if unmapped:
            raise HFCheckpointError(
                f"no Hugging Face name for parameter(s) {unmapped}; add a NameRule for them"
            )
        current = functools.partial(adapter.tensors, model)
        tensors = current()
        infos = {name: param_spec(model, name, t).info for name, t in tensors.items()}
        outputs = [(m.hf_name, m.param_name, (m, infos[m.param_name])) for m in mappings]
    else:
        order, tensors = model_order(model)
        outputs = [(key, first, None) for key, first, _ in order]
        current = lambda: model_order(model)[1]  # noqa: E731
    # Hugging Face names hold no adapters: a LoRA model's weights go out merged ("model"
    # names send its parameters as they are, adapters apart, to a model built alike)
    updated = [] if names != "hf" else [
        name for name, module in model.named_modules() if hasattr(module, "weight_update")
    ]  # fmt: skip
    pieces = [piece for name, t in tensors.items() for piece, *_ in pieces_of(name, t, rank)]
    announcement = _whole_model({
        "tensors": {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()},
        "outputs": outputs,
    })  # fmt: skip
    return SendPlan(number, current, pieces, announcement, updates=functools.partial(
        _weight_updates, model, sorted(updated)))  # fmt: skip


def _whole_model(announcement: dict) -> dict:
    """On rank 0, the tensors and outputs of every trainer rank (a pipeline stage holds
    some of the model's; rank 0 announces them all), in rank order: a collective of the
    trainers (the default group's ranks, as `weight_sync_group` numbers them)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return announcement
    rank = dist.get_rank()
    every: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(announcement, every, dst=0)
    if rank != 0:
        return announcement  # only rank 0 sends it
    tensors, outputs, named = {}, [], set()
    for one in every:
        tensors.update(one["tensors"])
        for output in one["outputs"]:
            if output[0] not in named:
                named.add(output[0])
                outputs.append(output)
    return {"tensors": tensors, "outputs": outputs}


def _weight_updates(model: nn.Module, modules: list[str]) -> dict[str, Callable]:
    """{weight name: its update} of `modules` (in the same order on every rank)."""
    return {f"{name}.weight": model.get_submodule(name).weight_update() for name in modules}


@dataclass(frozen=True)
class Rewritten:
    """What a piece recomputed at every sync (a weight with its update merged) counts as
    written by: its source tensor, and the sync's number as its version, so a delta sync
    always sends it."""

    source: torch.Tensor
    sync: int


def make_route(plan: SendPlan, request: dict[str, Wanted], written, wire, bucket_bytes) -> Route:
    """The parts of this rank's pieces inside what a receiver asked for (the whole of a
    tensor it names no box for), in buckets of `bucket_bytes` that keep to one flat buffer."""
    parts, sources = [], []
    for index, piece in enumerate(plan.pieces):
        cut = _intersect(piece, request.get(piece.name))
        if cut is not None:
            parts.append((index, *cut))
            sources.append(version_of(written[index])[0])
    buckets, size, source = [], bucket_bytes, None
    for part, (_, block, _) in enumerate(parts):
        nbytes = piece_bytes(block, wire)
        if size + nbytes > bucket_bytes or sources[part] != source:
            buckets.append([])
            size, source = 0, sources[part]
        buckets[-1].append(part)
        size += nbytes
    return Route(parts, buckets)


def _intersect(piece: Piece, wanted: Wanted | None):
    """(the block of `piece` inside `wanted`, its slices within the piece), or None if none."""
    held = Box(piece.offsets, piece.shape)
    block = held if wanted is None else held.intersection(Box(*wanted))
    if block is None:
        return None
    return Piece(piece.name, block.offset, block.shape, piece.dtype), block.within(held)


def current_values(plan: SendPlan, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each piece's value and the tensor whose version counter its writes bump, read from
    the tensors as they are now (a module may swap its parameters' local tensors)."""
    pieces, values, written = [], [], []
    updates = plan.updates()
    for name, tensor in plan.tensors().items():
        update = updates.get(name)
        for piece, value, bumped in pieces_of(name, tensor, rank):
            if update is not None:
                value = value + update(piece.offsets, piece.shape).to(value)
                bumped = Rewritten(bumped, plan.syncs)
            pieces.append(piece)
            values.append(value)
            written.append(bumped)
    if pieces != plan.pieces:
        raise WeightSyncError(
            "the model's layout changed since its first sync_weights (other parameters, "
            "shapes or sharding): sync it over a new weight_sync_group"
        )
    return values, written


def version_of(tensor: torch.Tensor | Rewritten) -> tuple[int, int]:
    """What changes when a piece is written: its storage, and autograd's version counter
    (a new count for a piece recomputed at every sync)."""
    if isinstance(tensor, Rewritten):
        return tensor.source.untyped_storage().data_ptr(), -1 - tensor.sync
    return tensor.untyped_storage().data_ptr(), tensor._version


def pieces_of(name: str, tensor: torch.Tensor, rank: int):
    """(Piece, its value, the tensor whose version an in-place write to it bumps) for each
    block of `tensor` this rank sends (a flatshard piece: its flat buffer's, which every
    write through the DTensor or a flat optimizer bumps)."""
    if not isinstance(tensor, DTensor):
        if rank == 0:  # a tensor flatshard does not shard: every rank has it whole
            piece = Piece(name, (0,) * tensor.dim(), tuple(tensor.shape), tensor.dtype)
            yield piece, tensor.detach(), tensor
        return
    local = tensor._local_tensor
    if isinstance(local, RowShard):  # flatshard's: the chunks its checkpoint writes
        for item in local.__create_write_items__(name, tensor):
            chunk = item.tensor_data.chunk
            piece = Piece(name, tuple(chunk.offsets), tuple(chunk.sizes), tensor.dtype)
            value = local.__get_tensor_shard__(item.index)
            yield piece, value, value if local.version_base is None else local.version_base
        return
    coordinate = tensor.device_mesh.get_coordinate()
    if any(c != 0 for c, p in zip(coordinate, tensor.placements) if isinstance(p, Replicate)):
        return  # another replica sends it
    shape, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    piece = Piece(name, tuple(offsets), tuple(shape), tensor.dtype)
    yield piece, tensor.to_local(), tensor.to_local()
