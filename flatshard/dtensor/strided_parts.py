"""A fused weight's parts split over a one-dim TP mesh (flatshard's TP of gate/up, QKV):
each rank holds `[a_r; b_r; ...]`, placed `_StridedShard(d, split_factor=k)`. torch 2.13
moves that placement to and from `Replicate` itself, but torch 2.11 reads any
`_StridedShard` as a shard order over several mesh dims and raises on a one-dim mesh
(`full_tensor()` failed there). patches.py routes these two moves here on every torch, so
the path the CPU tests run is the one users get; the order is torch's own (the dim chunked
into the parts, each part chunked over the ranks)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from flatshard import compat


def handles(current_spec, target_spec) -> bool:
    """A one-dim mesh going between `_StridedShard` and `Replicate`, either way."""
    if current_spec.mesh.ndim != 1:
        return False
    kinds = {type(current_spec.placements[0]), type(target_spec.placements[0])}
    return kinds == {_StridedShard, Replicate}


def held_indices(placement: _StridedShard, size: int, ranks: int) -> list[torch.Tensor]:
    """Which of the dim's `size` global indices each rank holds, in its local order."""
    parts = torch.arange(size).chunk(int(placement.split_factor))
    held = []
    for rank in range(ranks):
        pieces = [part.chunk(ranks) for part in parts]  # torch.chunk may make fewer
        held.append(torch.cat([p[rank] if rank < len(p) else p[0][:0] for p in pieces]))
    return held


def redistribute(local: torch.Tensor, current_spec, target_spec) -> torch.Tensor:
    mesh = current_spec.mesh
    rank, ranks = mesh.get_local_rank(0), mesh.size(0)
    gathering = isinstance(target_spec.placements[0], Replicate)
    placement = current_spec.placements[0] if gathering else target_spec.placements[0]
    dim, size = placement.dim, current_spec.shape[placement.dim]
    held = held_indices(placement, size, ranks)
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
