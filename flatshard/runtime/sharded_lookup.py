"""Embedding lookups from the row shards: a unit that is one `nn.Embedding` need not gather
its table.

Gathering an embedding table to look up a few thousand tokens moves the whole table, V x D x
(N-1)/N per rank, in forward and again in its gradient's reduce-scatter, and holds it
unsharded from forward to backward. Each rank already holds whole rows of the table (the
layout is row-aligned), so instead the ranks exchange their token ids, every rank looks up
all ranks' tokens in the rows it holds (zeros elsewhere), and one reduce-scatter sums each
rank's lookups. Backward all-gathers the output gradient and each rank adds the rows it
holds into its gradient shard. That moves (N-1) x T x D per rank each way for T tokens per
rank: cheaper while N x T < V (large vocabularies, small data-parallel groups); otherwise
the unit gathers like any other. Every output element is one row element plus exact zeros,
so the output equals the gathered lookup.

Every forward call first all-gathers each rank's token count and whether its ids fit the
table (one tiny collective and, on CUDA, one host sync), so all ranks decide alike and an
out-of-range id raises on every rank. The gradient is summed over ranks in every backward,
also under `set_requires_gradient_sync(False)`; every rank's backward must reach the lookup
(as every rank's loss does when it depends on the embedding). The gradient rows are summed
with `index_add_`, or, when deterministic algorithms are on, `index_put_(accumulate=True)`
(CUDA's `index_add_` adds in any order).

The plan costs one host sync per forward on CUDA: the counts decide the split sizes of the
exchange and whether to raise, and both must be known on the host before any rank posts a
collective (a rank cannot learn the others' counts without communicating, and guessing
equal counts would hang or abort gloo/NCCL on an uneven last batch).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flatshard import comm, registry
from flatshard.comm import agreement
from flatshard.errors import TokenIdError
from flatshard.runtime.gather_policy import looks_up, lookup_possible


def lookup_capable(modules: list[nn.Module], params: list, stage: int, ranks: int) -> bool:
    """A unit over one plain `nn.Embedding` whose untied weight is its only parameter, at a
    ZeRO stage and rank count where looking up can pay (gather_policy.py)."""
    if len(modules) != 1 or len(params) != 1 or not lookup_possible(stage, ranks):
        return False
    module = modules[0]
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and module.max_norm is None
        and not module.sparse
        and not module.scale_grad_by_freq
        and params[0].occurrences == [(module, "weight")]
        and params[0].tp_placement is None  # a vocab-parallel embedding looks up by TP
        and params[0].shard_dim == 0  # rows of the table, not columns
    )


def embedding_forward(module: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    """`forward` of a fully_shard-ed `nn.Embedding`: from the shards when its unit chose to."""
    lookup = registry.unit_of(module).lookup
    if lookup is not None and lookup.looking_up:
        return lookup(input)
    return nn.Embedding.forward(module, input)


class ShardedLookup:
    """The lookup of one embedding from the rows each rank holds. It talks to its unit only
    through what it is given: the embedding, its parameter and bucket (rows, gradient
    shard views), the group, and the unit's gradient sync (divide factor, and where the
    gradient shard goes)."""

    def __init__(self, module: nn.Embedding, param, bucket, group, grads):
        self.module, self.param, self.bucket, self.group, self.grads = (
            module, param, bucket, group, grads,
        )  # fmt: skip
        self.spec = bucket.specs[param.index]
        self.rows_held = self.spec.local_rows
        self.looking_up = False  # this forward call looks up (set by the pre-forward)
        self._counts: list[int] | None = None  # tokens per rank, for the call being planned
        self.last_counts: list[int] | None = None  # of the last lookup (for byte counts)

    def decide(self, args: tuple, kwargs: dict) -> bool:
        """Whether this forward call looks up from the shards; every rank answers alike (the
        token counts are exchanged first)."""
        self.last_counts = None
        ids = args[0] if args else kwargs.get("input")
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            return False  # nn.Embedding's own error says what is wrong
        rows = self.module.num_embeddings
        out_of_range = ((ids < 0) | (ids >= rows)).any().to(torch.int64)
        count = torch.full((), ids.numel(), dtype=torch.int64, device=ids.device)
        ranks = agreement.all_gather_ints(torch.stack([count, out_of_range]), self.group)
        bad = [rank for rank, (_, out) in enumerate(ranks) if out]
        if bad:  # every rank raises: none is left waiting in a collective
            raise TokenIdError(
                f"token ids outside [0, {rows}) reached a fully_shard-ed embedding of {rows} "
                f"rows on rank(s) {bad}; the tokenizer's vocabulary must fit the model's"
            )
        counts = [count for count, _ in ranks]
        if not looks_up(len(counts), max(counts), rows):
            return False
        self._counts = counts
        return True

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        counts, self._counts = self._counts, None
        self.last_counts = counts
        return _LookupFromShards.apply(self.param.sharded, ids, self, counts)

    def held_positions(self, all_ids: torch.Tensor):
        """For every rank's padded token positions: the row in this rank's shard (row 0
        where another rank holds it) and whether this rank holds it. Masks, not boolean
        indexing: no host sync on CUDA."""
        local = self.spec.to_local_row(all_ids)
        held = (local >= 0) & (local < self.rows_held)
        return torch.where(held, local, 0), held

    def look_up(self, all_ids: torch.Tensor) -> torch.Tensor:
        """Every rank's tokens looked up in this rank's rows: (N x T_max, D), zeros where
        another rank holds the row."""
        bucket, shape = self.bucket, (all_ids.numel(), self.module.embedding_dim)
        if not self.rows_held:  # a rank may hold no rows
            return torch.zeros(shape, dtype=bucket.param_dtype, device=all_ids.device)
        row, held = self.held_positions(all_ids)
        table = bucket.shard.rows(self.param.index)  # on the host when offloaded
        picked = table[row.to(table.device)].to(all_ids.device, bucket.param_dtype)
        return picked.masked_fill_(~held.unsqueeze(1), 0)

    def add_gradient(self, all_ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Sum every rank's output gradients (`grads`, consumed) into the rows this rank
        holds, in the main dtype; divide as a reduce-scatter would; add the result to the
        gradient shard."""
        bucket = self.bucket
        flat = torch.zeros(bucket.layout.shard_size, dtype=bucket.shard.dtype, device=grads.device)
        if self.rows_held:
            row, held = self.held_positions(all_ids)
            if self.module.padding_idx is not None:
                held &= all_ids != self.module.padding_idx
            rows = bucket.shard.piece(flat, self.param.index)
            values = grads.masked_fill_(~held.unsqueeze(1), 0).to(flat.dtype)
            if torch.are_deterministic_algorithms_enabled():
                # CUDA's index_add_ sums a row's gradients in any order
                rows.index_put_((row,), values, accumulate=True)
            else:
                rows.index_add_(0, row, values)
            rows.div_(self.grads.divide_factor)
        self.grads.accumulate(bucket, flat)


class _LookupFromShards(torch.autograd.Function):
    """Output: the embedding of `ids`. `weight` (the sharded parameter) is an input only so
    that autograd runs the backward, which puts the gradient on it itself."""

    @staticmethod
    def forward(ctx, weight, ids, lookup: ShardedLookup, counts: list[int]):
        group, t_max, dim = lookup.group, max(counts), lookup.module.embedding_dim
        flat_ids = ids.reshape(-1)
        padded = torch.full((t_max,), -1, dtype=torch.int64, device=ids.device)  # no row
        padded[: flat_ids.numel()] = flat_ids
        all_ids = torch.empty(len(counts) * t_max, dtype=torch.int64, device=ids.device)
        comm.all_gather(all_ids, padded, group).wait()
        picked = lookup.look_up(all_ids)
        mine = picked.new_empty(t_max, dim)
        comm.reduce_scatter(mine.view(-1), picked.view(-1), group, average=False).wait()
        ctx.save_for_backward(all_ids)
        ctx.lookup, ctx.counts = lookup, counts
        return mine[: flat_ids.numel()].view(*ids.shape, dim)

    @staticmethod
    def backward(ctx, grad_output):
        (all_ids,) = ctx.saved_tensors
        lookup, counts = ctx.lookup, ctx.counts
        dim, t_max = lookup.module.embedding_dim, max(counts)
        mine = grad_output.reshape(-1, dim)
        padded = grad_output.new_zeros(t_max, dim)
        padded[: mine.shape[0]] = mine
        grads = grad_output.new_empty(len(counts) * t_max, dim)
        comm.all_gather(grads.view(-1), padded.view(-1), lookup.group).wait()
        lookup.add_gradient(all_ids, grads)
        return None, None, None, None
