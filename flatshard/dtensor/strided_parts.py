"""A fused weight's parts split over a one-dim TP mesh (flatshard's TP of gate/up, QKV):
each rank holds `[a_r; b_r; ...]`, placed `_StridedShard(d, split_factor=k)`. torch 2.13
moves that placement to and from `Replicate` itself, but torch 2.11 reads any
`_StridedShard` as a shard order over several mesh dims and raises on a one-dim mesh
(`full_tensor()` failed there). patches.py routes these two moves here on every torch, so
the path the CPU tests run is the one users get; the order is torch's own (the dim chunked
into the parts, each part chunked over the ranks).

A placement says how many parts, not their sizes: Phi-3's `[q; k; v]` under GQA has
unequal ones, which torch's chunks would misplace (`full_tensor()` silently wrong). The TP
split registers each fused weight's part sizes by what its gradients and optimizer states
share with it (mesh, dim, part count, global shape); two weights alike in all that but
with other sizes make that key ambiguous, and moving one then raises."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from flatshard import compat
from flatshard.errors import UnevenShardError

_AMBIGUOUS = ()
_part_sizes: dict[tuple, tuple[int, ...]] = {}


def _key(mesh, placement: _StridedShard, shape) -> tuple:
    return (mesh, placement.dim, int(placement.split_factor), tuple(shape))


def register(mesh, placement: _StridedShard, shape, sizes: list[int]) -> None:
    """The sizes of the parts a fused weight of `shape`, placed so, stacks along its dim."""
    key, sizes = _key(mesh, placement, shape), tuple(int(n) for n in sizes)
    known = _part_sizes.setdefault(key, sizes)
    if known != sizes:
        _part_sizes[key] = _AMBIGUOUS


def handles(current_spec, target_spec) -> bool:
    """A one-dim mesh going between `_StridedShard` and `Replicate`, either way."""
    if current_spec.mesh.ndim != 1:
        return False
    kinds = {type(current_spec.placements[0]), type(target_spec.placements[0])}
    return kinds == {_StridedShard, Replicate}


def held_indices(
    placement: _StridedShard, size: int, ranks: int, sizes: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    """Which of the dim's `size` global indices each rank holds, in its local order: of
    parts of `sizes` if given, else torch's equal chunks."""
    indices = torch.arange(size)
    parts = indices.split(list(sizes)) if sizes else indices.chunk(int(placement.split_factor))
    pieces = [part.chunk(ranks) for part in parts]  # torch.chunk may make fewer
    return [
        torch.cat([p[rank] if rank < len(p) else p[0][:0] for p in pieces]) for rank in range(ranks)
    ]


def redistribute(local: torch.Tensor, current_spec, target_spec) -> torch.Tensor:
    mesh = current_spec.mesh
    rank, ranks = mesh.get_local_rank(0), mesh.size(0)
    gathering = isinstance(target_spec.placements[0], Replicate)
    placement = current_spec.placements[0] if gathering else target_spec.placements[0]
    dim, size = placement.dim, current_spec.shape[placement.dim]
    sizes = _part_sizes.get(_key(mesh, placement, current_spec.shape))
    if sizes == _AMBIGUOUS:
        raise UnevenShardError(
            f"two fused TP weights of shape {tuple(current_spec.shape)} declare different "
            f"parts: which {placement} this tensor has is unknown (fully_shard the model, "
            "whose layout keeps each weight's parts, or give them different shapes)"
        )
    held = held_indices(placement, size, ranks, sizes)
    if not gathering:  # every rank has the whole tensor: keep its own indices
        return local.index_select(dim, held[rank].to(local.device))
    longest = max(len(h) for h in held)
    rows = local.movedim(dim, 0)
    send = rows.new_zeros(longest, *rows.shape[1:])  # equal sizes for the all-gather
    send[: rows.shape[0]].copy_(rows)
    received = send.new_empty(ranks * longest, *rows.shape[1:])
    compat.all_gather_single(received, send, group=mesh.get_group(0))
    positions = torch.cat([r * longest + torch.arange(len(h)) for r, h in enumerate(held)])
    whole = received.new_empty(size, *rows.shape[1:])
    whole.index_copy_(
        0, torch.cat(held).to(local.device), received.index_select(0, positions.to(local.device))
    )
    return whole.movedim(0, dim).contiguous()
