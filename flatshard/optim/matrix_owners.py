"""Whole-matrix work on row-sharded matrices: each matrix gets one owner rank of its shard
group, chosen so that every rank does about the same work; the owner gathers the matrix
from every rank's rows, transforms it whole (Muon's Newton-Schulz orthogonalisation), and
sends each rank its rows of the result back.

A matrix is a 2-D parameter, or one expert's `(R, C)` of grouped experts `(E, R, C)`. The
rows every rank holds come from the layout (`ShardSpec.row_bounds`), so the split sizes
of both all-to-alls are known on every rank without communication, and each moves every
matrix once: (N-1)/N of the matrices' bytes (in bf16, Muon's working dtype) each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatshard import comm
from flatshard.comm import collectives


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> int:
    """Multiply-adds x 2 of `steps` quintic Newton-Schulz iterations on a (M, N) matrix: per
    step X X^T (k x k from k x K), its square, and that times X, with k = min, K = max."""
    small, large = min(shape), max(shape)
    return steps * (4 * small * small * large + 2 * small**3)


def assign_owners(costs: list[int], ranks: int, holders: list[int | None] | None = None):
    """An owner rank per item: an item one rank holds whole stays there (`holders[i]`: no
    bytes move); the others, costliest first, each to the least-loaded rank (ties to the
    lowest rank; ties in cost by position). The same on every rank: pure arithmetic."""
    holders = holders or [None] * len(costs)
    loads = [0] * ranks
    owners = [0] * len(costs)
    for index, holder in enumerate(holders):
        if holder is not None:
            owners[index] = holder
            loads[holder] += costs[index]
    free = [i for i, holder in enumerate(holders) if holder is None]
    for index in sorted(free, key=lambda i: (-costs[i], i)):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += costs[index]
    return owners


@dataclass(frozen=True)
class Matrix:
    """One matrix of a parameter as the ranks of its shard group hold it: its shape (under
    TP the TP-local block), the rows `[spans[r][0], spans[r][1])` of it rank r holds, and
    where this rank's rows start among the parameter's local rows of `shape[1]` elements."""

    param: int  # which parameter (its index in the group)
    shape: tuple[int, int]
    spans: tuple[tuple[int, int], ...]
    local_start: int
    expert: bool = False  # one of grouped experts (they are balanced by the layout)
    component: str | None = None  # a fused parameter's component taken as its own matrix

    def rows(self, rank: int) -> int:
        return self.spans[rank][1] - self.spans[rank][0]

    def holder(self) -> int | None:
        """The rank that holds all of it, if one does."""
        holding = [r for r in range(len(self.spans)) if self.rows(r)]
        return holding[0] if len(holding) == 1 else None


def matrices_of(spec, param: int, me: int, split_fused: bool = False) -> list[Matrix]:
    """The matrices of a flatshard parameter by its spec: a 2-D parameter is one (with
    `split_fused`, a fused one's components stacked along dim 0 are one each); grouped
    experts `(E, R, C)` are E matrices `(R, C)`, whose rows are the parameter's dim-1 slices
    (whole experts per rank, or a finer row's slices of one expert)."""
    shape, components = tuple(spec.info.shape), spec.info.components
    names: list = [None]
    if len(shape) == 2:
        bounds, ranges = spec.row_bounds, [(0, shape[0])]
        if split_fused and components and all(c.dim == 0 for c in components):
            ranges, names = [(c.start, c.stop) for c in components], [c.name for c in components]
    else:  # rows over the (E * R) slices: scaled from whole experts where rows are experts
        per_matrix, count = shape[1], shape[0]
        scale = per_matrix if spec.info.row_dims == 1 else 1
        bounds = tuple(b * scale for b in spec.row_bounds)
        ranges = [(index * per_matrix, (index + 1) * per_matrix) for index in range(count)]
    out = []
    for index, (first, last) in enumerate(ranges):
        spans = tuple(
            (max(first, lo) - first, max(first, min(last, hi)) - first)
            for lo, hi in zip(bounds, bounds[1:])
        )
        spans = tuple((a, max(a, b)) for a, b in spans)
        local = max(first, bounds[me]) - bounds[me]
        component = names[index] if len(names) > 1 else None
        out.append(
            Matrix(param, (last - first, shape[-1]), spans, local, len(shape) == 3, component)
        )
    return out


class ShardGroup:
    """The row-sharded matrices of one shard group (a mesh dim of one device mesh) and
    their owners."""

    def __init__(self, mesh, mesh_dim: int, matrices: list[Matrix], costs: list[int]):
        self.group = mesh.get_group(mesh_dim)
        self.size = mesh.size(mesh_dim)
        self.me = mesh.get_local_rank(mesh_dim)
        self.device = comm.group_device(self.group)
        self.matrices = matrices
        # an expert held whole by one rank stays there (the layout spreads experts evenly);
        # other matrices go where the Newton-Schulz work is balanced
        holders = [m.holder() if m.expert else None for m in matrices]
        self.owners = assign_owners(costs, self.size, holders)
        self.owned = [i for i, owner in enumerate(self.owners) if owner == self.me]

    def _elements(self, index: int, rank: int) -> int:
        matrix = self.matrices[index]
        return matrix.rows(rank) * matrix.shape[1]

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
            spans = self.matrices[i].spans
            result = fns[i](torch.cat(pieces[i]).view(self.matrices[i].shape))
            for rank in range(self.size):
                back[rank].append(result[spans[rank][0] : spans[rank][1]].reshape(-1))
        from_owners = [
            sum(self._elements(i, self.me) for i, owner in enumerate(self.owners) if owner == rank)
            for rank in range(self.size)
        ]
        returned = self._exchange(back, from_owners)

        mine, offset = [None] * len(self.matrices), 0
        for rank in range(self.size):
            for i, owner in enumerate(self.owners):
                if owner == rank:
                    count = self._elements(i, self.me)
                    shape = (count // self.matrices[i].shape[1], self.matrices[i].shape[1])
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
