"""DTensor redistribution of a row shard (patches.py routes DTensor's here): `Shard(0) ->
Replicate` (what `full_tensor()` and full state dicts use) gathers by the true row
bounds, then torch gathers any TP dim by its own placement; any other redistribution
raises `UnevenShardError` on every rank alike, before any collective."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from flatshard import compat
from flatshard.dtensor.row_shard import RowShard, unsupported
from flatshard.errors import UnevenShardError


def gather_rows(shard: RowShard, group: dist.ProcessGroup) -> torch.Tensor:
    """All ranks' rows, concatenated in rank order (the local parameter: its rows are in
    row-major order, dim-1 slices of grouped experts too): one all-gather padded to the
    longest piece."""
    spec = shard.spec
    counts, row_shape = spec.global_row_counts, spec.row_shape
    longest = max(counts)
    send = torch.zeros(longest * spec.row_size, dtype=shard.dtype, device=shard.device)
    d = spec.info.shard_dim  # rows along d > 0: sent in the buffers' order, d first
    send[: spec.numel].copy_((shard.data_.movedim(d, 0) if d else shard.data_).reshape(-1))
    received = torch.empty(
        longest * spec.row_size * len(counts), dtype=shard.dtype, device=shard.device
    )
    compat.all_gather_single(received, send, group=group)
    received = received.view(len(counts), longest, *row_shape)
    if all(n == longest for n in counts):
        rows = received.view(-1, *row_shape)  # no padding to squeeze out: no copy
    else:
        rows = torch.cat([received[r, :n] for r, n in enumerate(counts)])
    if d:
        return rows.view(spec.info.stored_shape).movedim(0, d).contiguous()
    return rows.view(spec.info.shape) if spec.info.row_dims > 1 else rows


def redistribute_rows(local_tensor: RowShard, current_spec, target_spec) -> torch.Tensor:
    """DTensor redistribution of a row shard (patches.py routes it here): `Shard(0) ->
    Replicate` on the mesh dim that holds the rows gathers by the true rows, then a TP
    dim after it (if it changes too, to `Replicate`) gathers the TP pieces by their TP
    placement; anything else raises on every rank alike."""
    current, target = tuple(current_spec.placements), tuple(target_spec.placements)
    if current == target:
        return local_tensor
    mesh, rows_dim = current_spec.mesh, local_tensor.mesh_dim
    changed = [dim for dim, (a, b) in enumerate(zip(current, target)) if a != b]
    tp_dims = [dim for dim in changed if dim > rows_dim]
    if changed[0] != rows_dim or any(
        not isinstance(target[dim], Replicate) for dim in changed
    ):  # fmt: skip
        raise UnevenShardError(unsupported(f"redistributing {current} -> {target}"))
    gathered = gather_rows(local_tensor, mesh.get_group(rows_dim))
    for dim in tp_dims:  # the TP-local tensor, gathered by torch's own TP placement
        tp_mesh = mesh[mesh.mesh_dim_names[dim]]
        if local_tensor.spec.info.split_by_components:  # parts of unequal sizes, maybe
            gathered = gather_components(gathered, tp_mesh.get_group(), local_tensor.spec.info)
            continue
        gathered = DTensor.from_local(
            gathered,
            tp_mesh,
            [current[dim]],
            run_check=False,
            shape=current_spec.shape,
            stride=current_spec.stride,
        ).full_tensor()
    return gathered


def gather_components(local: torch.Tensor, group: dist.ProcessGroup, info) -> torch.Tensor:
    """The global tensor of a parameter split by components over TP (each TP rank holds
    `[a_r; b_r; ...]`, `info` being this rank's): every rank's share of every component put
    at the component's place, by the layout's components (torch's `_StridedShard` assumes
    equal ones; Phi-3's `[q; k; v]` are not)."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    out = local.new_empty(info.global_shape)
    for c in info.components:
        part = c.stop - c.start
        for rank, piece in enumerate(pieces):
            into = out.narrow(c.dim, c.fused_start + rank * part, part)
            into.copy_(piece.narrow(c.dim, c.start, part))
    return out
