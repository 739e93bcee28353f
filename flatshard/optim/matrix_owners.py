"""Whole-matrix work on row-sharded matrices: each matrix gets one owner rank of its shard
group, chosen so that every rank does about the same work; the owner gathers the matrix
from every rank's rows, transforms it whole (Muon's Newton-Schulz orthogonalisation), and
sends each rank its rows of the result back.

The rows every rank holds come from the layout (`ShardSpec.row_bounds`), so the split sizes
of both all-to-alls are known on every rank without communication, and each moves every
matrix once: (N-1)/N of the matrices' bytes (in bf16, Muon's working dtype) each way.
"""

from __future__ import annotations

import torch

from flatshard import collectives, comm


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> int:
    """Multiply-adds x 2 of `steps` quintic Newton-Schulz iterations on a (M, N) matrix: per
    step X X^T (k x k from k x K), its square, and that times X, with k = min, K = max."""
    small, large = min(shape), max(shape)
    return steps * (4 * small * small * large + 2 * small**3)


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """An owner rank per item: the costliest first, each to the least-loaded rank (ties to the
    lowest rank; ties in cost by position). The same on every rank: pure arithmetic."""
    loads = [0] * ranks
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += costs[index]
    return owners


class ShardGroup:
    """The row-sharded matrices of one shard group (a mesh dim of one device mesh) and
    their owners."""

    def __init__(self, mesh, mesh_dim: int, specs: list, ns_steps: int):
        self.group = mesh.get_group(mesh_dim)
        self.size = mesh.size(mesh_dim)
        self.me = mesh.get_local_rank(mesh_dim)
        self.device = comm.group_device(self.group)
        self.specs = specs
        costs = [newton_schulz_flops(spec.global_shape, ns_steps) for spec in specs]
        self.owners = assign_owners(costs, self.size)
        self.owned = [i for i, owner in enumerate(self.owners) if owner == self.me]

    def _elements(self, index: int, rank: int) -> int:
        bounds = self.specs[index].row_bounds
        return (bounds[rank + 1] - bounds[rank]) * self.specs[index].row_size

    def transform(self, local_rows: list[torch.Tensor], fns: list) -> list[torch.Tensor]:
        """`fns[i](matrix i)` of every matrix, run by its owner; returns this rank's rows of
        each result (bf16). `local_rows[i]`: this rank's rows of matrix i. A matrix is what
        this rank's module holds (under TP, its TP-local block: `fns[i]` may join the TP
        group's blocks; the owners of a TP group's ranks are the same)."""
        to_owner = [[] for _ in range(self.size)]
        for index, rows in enumerate(local_rows):
            to_owner[self.owners[index]].append(rows.to(self.device, torch.bfloat16).reshape(-1))
        from_ranks = [sum(self._elements(i, rank) for i in self.owned) for rank in range(self.size)]
        received = self._exchange(to_owner, from_ranks)

        pieces, offset = {i: [] for i in self.owned}, 0
        for rank in range(self.size):  # from each rank, its rows of every matrix owned here
            for i in self.owned:
                count = self._elements(i, rank)
                pieces[i].append(received[offset : offset + count])
                offset += count
        back = [[] for _ in range(self.size)]
        for i in self.owned:
            bounds = self.specs[i].row_bounds
            result = fns[i](torch.cat(pieces[i]).view(self.specs[i].info.shape))
            for rank in range(self.size):
                back[rank].append(result[bounds[rank] : bounds[rank + 1]].reshape(-1))
        from_owners = [
            sum(self._elements(i, self.me) for i, owner in enumerate(self.owners) if owner == rank)
            for rank in range(self.size)
        ]
        returned = self._exchange(back, from_owners)

        mine, offset = [None] * len(self.specs), 0
        for rank in range(self.size):
            for i, owner in enumerate(self.owners):
                if owner == rank:
                    count = self._elements(i, self.me)
                    shape = (count // self.specs[i].row_size, self.specs[i].row_size)
                    mine[i] = returned[offset : offset + count].view(shape)
                    offset += count
        return mine

    def _exchange(self, to_ranks: list[list[torch.Tensor]], from_ranks: list[int]):
        """All-to-all of bf16 pieces, moved as bytes (gloo has no 16-bit integer or bf16
        all-to-all; the bits are what matter)."""
        sizes = [sum(piece.numel() for piece in pieces) for pieces in to_ranks]
        flat = [piece for pieces in to_ranks for piece in pieces]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.bfloat16, device=self.device)
        if self.size == 1:
            return send
        received = collectives.exchange(
            send.view(torch.uint8), [2 * n for n in from_ranks], [2 * n for n in sizes], self.group
        )
        return received.view(torch.bfloat16)
