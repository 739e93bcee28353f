"""Every rank's share of a checkpoint, computed alone on each rank from the layout.

DCP plans a save by gathering every rank's plan to rank 0 and scattering it back: its cost
grows with the world size (hours at thousands of ranks). flatshard already knows where
every row of every tensor lives on every rank (`ShardSpec.row_bounds`), so each rank
derives the whole plan itself: which rank writes which chunk (the lowest rank holding it),
in which order, and how many bytes each takes in its file. Rank 0 turns it into DCP's
`.metadata`, which plain DCP and PyTorch FSDP2 read as if DCP had written it.

A flatshard piece also split by tensor or expert parallelism is placed by shifting this
rank's piece to each TP/EP rank's place (their layouts are this one when the splits are
even). A tensor whose chunks on other ranks cannot be derived here (an uneven split, a
tensor subclass) makes `plan` return None: the save then takes DCP's own planning.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from flatshard.comm.agreement import fingerprint
from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import local_data


@dataclass(frozen=True)
class PlannedItem:
    """One chunk (or one non-tensor value) of the checkpoint and the rank that writes it."""

    item: WriteItem
    rank: int
    length: int  # bytes in the writer's file (torch.save of the chunk); 0 for values


@dataclass
class GlobalPlan:
    items: list[PlannedItem]  # in file order, rank by rank
    world: int

    def of_rank(self, rank: int) -> list[PlannedItem]:
        return [p for p in self.items if p.rank == rank]

    def only(self, rank: int) -> GlobalPlan:
        """The plan as `rank` keeps it when it does not write the metadata: its own items
        and the whole plan's fingerprint (at a thousand ranks the rest is ~100 MB)."""
        kept = GlobalPlan(self.of_rank(rank), self.world)
        kept.__dict__["fingerprint"] = self.fingerprint
        return kept

    @functools.cached_property
    def fingerprint(self) -> int:
        """The same on every rank that planned the same checkpoint."""
        return fingerprint(
            [
                (p.rank, p.item.index.fqn, tuple(p.item.index.offset or ()), p.length)
                + _tensor_key(p.item)
                for p in self.items
            ]
        )

    def state_dict_metadata(self) -> dict:
        metadata: dict = {}
        for planned in self.items:
            item = planned.item
            if item.type == WriteItemType.BYTE_IO:
                metadata[item.index.fqn] = BytesStorageMetadata()
                continue
            data = item.tensor_data
            entry = metadata.setdefault(
                item.index.fqn, TensorStorageMetadata(data.properties, data.size, [])
            )
            entry.chunks.append(data.chunk)
        return metadata


def file_name(rank: int) -> str:
    """The one file each rank writes (DCP's naming, so tools that list them still work)."""
    return f"__{rank}_0.distcp"


_last: dict = {}  # the structure of the last planned state, and its plan


def plan(flat_state: dict, world: int, keep_rank: int | None = None) -> GlobalPlan | None:
    """The whole checkpoint's plan from `flat_state` (DCP's flattened state dict: dotted
    names to DTensors, tensors and values); None when a tensor's chunks on other ranks are
    not known here. `keep_rank`: keep only that rank's items (and the fingerprint). The
    plan of the last state is kept: a later save of the same structure (every save of a
    run, but the first) only compares it."""
    key = (world, keep_rank, [_structure(fqn, value) for fqn, value in flat_state.items()])
    if _last.get("key") != key:
        derived = _derive(flat_state, world)
        if derived is not None and keep_rank is not None:
            derived = derived.only(keep_rank)
        _last.update(key=key, plan=derived)
    return _last["plan"]


def _structure(fqn: str, value) -> tuple:
    """What a tensor's chunks and their metadata depend on (its spec is shared by every
    state of a parameter, so comparing it is mostly an identity check)."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        where = local.spec if isinstance(local, RowShard) else tuple(local.shape)
        return (fqn, id(value.device_mesh), tuple(value.placements), tuple(value.shape), where,
                TensorProperties.create_from_tensor(local_data(value)))  # fmt: skip
    if isinstance(value, torch.Tensor):
        return (fqn, tuple(value.shape), TensorProperties.create_from_tensor(value))
    return (fqn,)


def _derive(flat_state: dict, world: int) -> GlobalPlan | None:
    per_rank: list[list[PlannedItem]] = [[] for _ in range(world)]
    values = []
    lowest: dict = {}  # per (mesh, dim): the same for every tensor on that mesh
    for fqn, value in flat_state.items():
        if isinstance(value, DTensor):
            chunks = dtensor_chunks(value, lowest)
            if chunks is None:
                return None
            properties = TensorProperties.create_from_tensor(local_data(value))
            for offsets, sizes, rank in chunks:
                if rank >= world:
                    return None
                per_rank[rank].append(_planned(fqn, offsets, sizes, value, properties, rank))
        elif isinstance(value, torch.Tensor):
            if _subclass(value):
                return None
            properties = TensorProperties.create_from_tensor(value)
            shape = tuple(value.shape)
            per_rank[0].append(_planned(fqn, (0,) * len(shape), shape, value, properties, 0))
        else:
            values.append(PlannedItem(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO), 0, 0))
    per_rank[0].extend(values)  # after rank 0's tensors: nobody else needs their lengths
    return GlobalPlan([p for items in per_rank for p in items], world)


def dtensor_chunks(value: DTensor, lowest: dict) -> list[tuple[tuple, tuple, int]] | None:
    """(offsets, sizes, writer rank) of every distinct chunk of `value` across its mesh; a
    chunk held by several ranks (HSDP replicas, Replicate) is written by the lowest.
    `lowest`: a cache of `lowest_ranks` by (mesh, dim)."""
    mesh, placements = value.device_mesh, value.placements
    ranks = mesh.mesh
    local = value._local_tensor
    if isinstance(local, RowShard):
        split = local.mesh_dim
        inner = [
            (d, p) for d, p in enumerate(placements) if d != split and type(p) is not Replicate
        ]
        if not inner:
            key = (id(mesh), split)
            if key not in lowest:
                lowest[key] = lowest_ranks(ranks, split)
            return row_shard_chunks(local.spec, lowest[key])
        if len(inner) > 1:
            return None
        return _split_row_shard_chunks(local.spec, ranks, split, *inner[0])
    if any(type(p) not in (Shard, Replicate) for p in placements) or _subclass(local):
        return None
    chunks: dict[tuple, tuple] = {}
    for rank in sorted(ranks.flatten().tolist()):
        coordinate = (ranks == rank).nonzero()[0].tolist()
        sizes, offsets = _compute_local_shape_and_global_offset(
            value.shape, ranks.shape, coordinate, placements
        )
        chunks.setdefault((tuple(offsets), tuple(sizes)), rank)
    return [(offsets, sizes, rank) for (offsets, sizes), rank in chunks.items()]


def _subclass(tensor: torch.Tensor) -> bool:
    """A tensor subclass (a QLoRA base's NF4 shard): what torch.save writes of it is the
    subclass's business, so DCP plans its writes."""
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def _split_row_shard_chunks(spec, ranks, split: int, dim: int, placement):
    """Every rank's chunks of a tensor split by TP or EP along mesh dim `dim` and, inside
    each piece, into flatshard's rows along mesh dim `split`. The other TP/EP ranks' pieces
    are this rank's shifted to their place: their unit layouts are this one when every
    split is even (a layout that differs makes the ranks' plans, and so their
    fingerprints, differ: the save then takes DCP's planning)."""
    chunks = []
    for index in range(ranks.shape[dim]):
        info = _info_at(spec.info, placement, index, ranks.shape[dim])
        if info is None:
            return None
        lowest = lowest_ranks(ranks.select(dim, index), split - (dim < split))
        chunks += row_shard_chunks(dataclasses.replace(spec, info=info), lowest)
    return chunks


def _info_at(info, placement, index: int, count: int):
    """`info` (a TP/EP rank's piece of its global tensor) as rank `index` of `count` along
    `placement` holds it; None where that is not a shift of this rank's piece."""
    if info.split_by_components:  # [gate_r; up_r]: each component's 1/count at r
        components = tuple(_shifted(c, c.dim, index * c.size) for c in info.components)
        return dataclasses.replace(info, components=components)
    if type(placement) is not Shard or info.global_shape[placement.dim] % count:
        return None
    dim = placement.dim
    offset = list(info.global_offset)
    offset[dim] = index * info.shape[dim]
    components = tuple(_shifted(c, dim, offset[dim]) for c in info.components)
    return dataclasses.replace(info, global_offset=tuple(offset), components=components)


def _shifted(component, dim: int, start: int):
    offset = list(component.global_offset)
    if offset:
        offset[dim] = start
    return dataclasses.replace(component, global_offset=tuple(offset))


def lowest_ranks(ranks: torch.Tensor, split: int) -> list[int]:
    """For each index along dim `split` of the mesh `ranks`, the lowest rank there (its
    other dims are replicas of the same rows)."""
    return ranks.movedim(split, -1).reshape(-1, ranks.shape[split]).min(0).values.tolist()


def row_shard_chunks(spec, lowest: list[int]) -> list[tuple[tuple, tuple, int]]:
    """Every rank's chunks of a tensor whose rows `spec`'s layout splits, each with the
    lowest rank that holds it (`lowest_ranks`)."""
    return [
        (box.offset, box.shape, lowest[index])
        for index in range(len(lowest))
        for _, box in dataclasses.replace(spec, rank=index).pieces
    ]


def chunk_item(fqn, offsets, sizes, global_size, properties, rank, sharded=True) -> PlannedItem:
    """The planned write of one chunk of tensor `fqn`."""
    offsets, sizes = torch.Size(offsets), torch.Size(sizes)
    item = WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD if sharded else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets, sizes),
            properties=properties,
            size=torch.Size(global_size),
        ),
    )
    return PlannedItem(item, rank, serialized_size(tuple(sizes), properties.dtype))


def _planned(fqn, offsets, sizes, value, properties, rank) -> PlannedItem:
    return chunk_item(
        fqn, offsets, sizes, value.shape, properties, rank, isinstance(value, DTensor)
    )


def _tensor_key(item: WriteItem) -> tuple:
    data = item.tensor_data
    if data is None:
        return ()
    return (tuple(data.chunk.sizes), tuple(data.size), str(data.properties.dtype))


@functools.lru_cache(maxsize=4096)
def serialized_size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes that `torch.save` of a compact tensor of `shape` takes (what DCP's reader
    `torch.load`s): measured once per shape with an untouched buffer, so no rank needs
    another rank's write results to place its chunks."""
    counter = _ByteCounter()
    torch.save(torch.empty(shape, dtype=dtype), counter)
    return counter.count


class _ByteCounter(io.RawIOBase):
    def __init__(self):
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.count += size
        return size
