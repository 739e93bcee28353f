"""Context parallelism: every sequence split over the `cp` ranks, attention over the whole.

Each rank holds two of the sequence's `2 x cp` equal chunks, chunk `r` and chunk
`2cp - 1 - r`, so under a causal mask every rank has the same attention work (torchtitan's
and Megatron's load balancing). Everything but attention is per token and runs on the
local tokens as it is; attention gathers the keys and values of every rank (an all-gather
whose backward reduce-scatters their gradients), puts them in sequence order, and each of
the rank's two query chunks attends to the keys up to its end (chunk_attention.py: the
fused kernel, no mask). The model learns its tokens' places from `position_ids` (RoPE at
those positions).

Where torch's ring attention runs (ring_attention.py: torch's ring, the one its
`context_parallel` runs, over the fused CPU kernel or CUDA flash attention) `attention` takes
it: only this rank's keys and values are saved for backward. Elsewhere (a torch without it,
CUDA in float32) it all-gathers the keys and values (`gather`) and attends to them
(`attend`).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from flatshard import compat
from flatshard.errors import MeshError
from flatshard.parallel.chunk_attention import chunk_attention
from flatshard.parallel.ring_attention import ring_attention, ring_runs


def sequence_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions of the tokens rank `rank` of `cp` holds of a `length`-token sequence:
    chunks `rank` and `2cp - 1 - rank` of `2cp` equal ones."""
    if length % (2 * cp):
        raise MeshError(
            f"context parallelism over {cp} ranks splits each sequence into {2 * cp} equal "
            f"chunks: the model's input of {length} tokens is not a multiple of {2 * cp}; "
            f"pick a sequence length whose input (data.seq_len) is one"
        )
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def split_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `tensor` (token ids, labels, positions: [B, T, ...] with the
    sequence along `dim`)."""
    positions = sequence_positions(tensor.shape[dim], cp_mesh.size(), cp_mesh.get_local_rank())
    return tensor.index_select(dim, positions.to(tensor.device))


class ContextParallel:
    """What a model's attention needs under context parallelism: the keys and values of
    every rank in sequence order (`gather`), and the attention of this rank's queries over
    them (`attend`). Set on the model and its attention modules by
    `apply_context_parallel`."""

    def __init__(self, cp_mesh: DeviceMesh, ring: bool = True):
        if cp_mesh.ndim != 1:
            raise MeshError(f"context parallelism takes a 1-D mesh, got {cp_mesh.ndim}-D")
        self.mesh = cp_mesh
        self.size = cp_mesh.size()
        self.ring = ring  # torch's ring where it runs; False: always the all-gather
        self._order: dict[tuple[int, torch.device], torch.Tensor] = {}

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `tensor` (see `split_sequence`)."""
        return split_sequence(tensor, self.mesh, dim)

    def positions(self, batch: int, local_length: int, device=None) -> torch.Tensor:
        """[batch, local_length]: the positions of this rank's tokens (see `split_sequence`)."""
        rank = self.mesh.get_local_rank()
        held = sequence_positions(local_length * self.size, self.size, rank, device)
        return held.expand(batch, -1)

    def attention(self, query, key, value, scale=None) -> torch.Tensor:
        """Causal attention of this rank's queries [B, H, T_local, D] over the whole
        sequence, of which this rank holds keys and values [B, H_kv, T_local, D] (`scale`:
        of the scores)."""
        if self.ring and ring_runs(query):
            return ring_attention(query, key, value, self.mesh.get_group(), scale)
        key, value = self.gather(key, value)
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        return self.attend(query, key, value, scale)

    def gather(self, key: torch.Tensor, value: torch.Tensor):
        """[B, H, T_local, D] each -> [B, H, T, D], the whole sequence in order."""
        length = key.shape[2] * self.size
        order = self._sequence_order(length, key.device)
        both = torch.cat([key, value], dim=1).movedim(2, 0)  # one collective, by sequence
        gathered = compat.all_gather_autograd(both.contiguous(), self.mesh.get_group())
        gathered = gathered.index_select(0, order).movedim(0, 2)
        return gathered.split(key.shape[1], dim=1)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale=None):
        """Causal attention of this rank's queries [B, H, T_local, D] (its two chunks) over
        the whole sequence's keys and values [B, H, T, D] (`scale`: of the scores)."""
        chunk = query.shape[2] // 2
        rank = self.mesh.get_local_rank()
        outputs = []
        for index, part in zip((rank, 2 * self.size - 1 - rank), query.split(chunk, dim=2)):
            end = (index + 1) * chunk  # the keys it sees: those up to its own end
            outputs.append(chunk_attention(part, key[:, :, :end], value[:, :, :end], scale))
        return torch.cat(outputs, dim=2)

    def _sequence_order(self, length: int, device) -> torch.Tensor:
        """Where each position sits in the gathered ranks' chunks (rank order)."""
        key = (length, device)
        if key not in self._order:
            held = [sequence_positions(length, self.size, r) for r in range(self.size)]
            self._order[key] = torch.argsort(torch.cat(held)).to(device)
        return self._order[key]


def apply_context_parallel(model, attention_modules, cp_mesh: DeviceMesh) -> None:
    """Split `model`'s sequence over `cp_mesh`: the model reads its mask from it, each
    attention module gathers keys and values through it."""
    context = ContextParallel(cp_mesh)
    model.context_parallel = context
    for module in attention_modules:
        module.context_parallel = context
