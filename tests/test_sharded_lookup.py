"""Embeddings looked up from their row shards (sharded_lookup.py) against a single process:
uneven token counts per rank, padding_idx, bf16 compute, no-grad forward, a directly
wrapped embedding, and the table never gathered."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_distributed

import flatshard
from flatshard import registry

VOCAB, DIM, PAD = 257, 8, 3


class TinyLM(nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.block = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.block(self.embed(ids))))


def _tokens(rank: int) -> torch.Tensor:
    """Rank r holds r + 1 sequences of 5 tokens (uneven counts), PAD among them."""
    generator = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, VOCAB, (rank + 1, 5), generator=generator)
    ids[0, 0] = PAD
    return ids


def _loss(model, ids) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _reference_grads(reference: nn.Module, world: int) -> dict[str, torch.Tensor]:
    """Gradients of the mean over ranks of each rank's loss, as data parallelism averages."""
    total = sum(_loss(reference, _tokens(r)) for r in range(world)) / world
    total.backward()
    return {name: p.grad for name, p in reference.named_parameters()}


def _sharded(model: nn.Module, embedding_alone: bool, mp_policy=None) -> nn.Module:
    if embedding_alone:  # wrapped by the user, not a first-use group of the root
        flatshard.fully_shard(model.embed, mp_policy=mp_policy)
    flatshard.fully_shard(model.block, mp_policy=mp_policy)
    return flatshard.fully_shard(model, mp_policy=mp_policy)


def _uneven_tokens_with_padding(embedding_alone: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyLM(padding_idx=PAD)
    model = _sharded(copy.deepcopy(reference), embedding_alone)
    expected = _reference_grads(reference, world)

    unit = registry.unit_of(model.embed)
    loss = _loss(model, _tokens(rank))
    never_gathered = unit.buckets[0].unsharded.untyped_storage().size() == 0
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    errors = {name: ((grads[name] - g).norm() / g.norm()).item() for name, g in expected.items()}
    return unit.looked_up_from_shards(), never_gathered, errors, grads["embed.weight"][PAD]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("embedding_alone", [False, True])
def test_uneven_token_counts_and_padding_idx(world_size, embedding_alone):
    for looked_up, never_gathered, errors, pad_grad in run_distributed(
        _uneven_tokens_with_padding, world_size, embedding_alone
    ):
        assert looked_up and never_gathered
        assert max(errors.values()) <= 1e-6, errors
        assert torch.equal(pad_grad, torch.zeros(DIM))  # padding_idx gets no gradient


def _deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        return _uneven_tokens_with_padding(False)
    finally:
        torch.use_deterministic_algorithms(False)


def test_deterministic_algorithms_sum_rows_with_index_put():
    for looked_up, _, errors, pad_grad in run_distributed(_deterministic, 2):
        assert looked_up and max(errors.values()) <= 1e-6, errors
        assert torch.equal(pad_grad, torch.zeros(DIM))


def _bf16_against_gathered():
    """bf16 compute: the lookup's output equals the gathered table's bit for bit, and the
    gradients agree with the gathered path's to bf16 rounding."""
    rank = dist.get_rank()
    policy = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    base = TinyLM()
    looked = _sharded(copy.deepcopy(base), False, policy)
    gathered = _sharded(copy.deepcopy(base), False, policy)
    registry.unit_of(gathered.embed).lookup = None  # the plain gather path
    ids = _tokens(rank)
    outputs, grads = [], []
    for model in (looked, gathered):
        output = model(ids[:, :-1])
        F.cross_entropy(output.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        outputs.append(output)
        grads.append(model.embed.weight.grad.full_tensor())
    relative = ((grads[0] - grads[1]).norm() / grads[1].norm()).item()
    return registry.unit_of(looked.embed).looked_up_from_shards(), outputs, relative


def test_bf16_compute():
    for looked_up, (ours, gathered), grad_error in run_distributed(_bf16_against_gathered, 2):
        assert looked_up
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, gathered)
        assert grad_error <= 1e-2


def _no_grad_forward():
    torch.manual_seed(0)
    reference = TinyLM()
    model = _sharded(copy.deepcopy(reference), False)
    ids = _tokens(dist.get_rank())
    with torch.no_grad():
        output = model(ids)
    looked_up = registry.unit_of(model.embed).looked_up_from_shards()
    return looked_up, torch.equal(output, reference(ids))


def test_no_grad_forward():
    assert run_distributed(_no_grad_forward, 2) == [(True, True)] * 2


def _rank_without_rows():
    """Vocab 9 at world 4: the layout gives the ranks 3, 3, 3 and 0 rows of the table, and
    8 tokens (2 per rank) are still fewer than 9 rows, so the table is looked up; the rank
    with no rows contributes zeros and still receives its tokens' rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.Embedding(9, DIM)
    model = nn.Sequential(copy.deepcopy(reference))
    with warnings.catch_warnings():  # the warning that a rank holds nothing of it
        warnings.simplefilter("ignore")
        flatshard.fully_shard(model[0])
    flatshard.fully_shard(model)
    ids = [torch.tensor([[(3 * r) % 9, 8 - r]]) for r in range(world)]
    output = model(ids[rank])
    output.pow(2).sum().backward()
    total = sum(reference(i).pow(2).sum() for i in ids) / world
    total.backward()
    unit = registry.unit_of(model[0])
    rows_held = unit.lookup.rows_held
    grad = model[0].weight.grad.full_tensor()
    return (
        unit.looked_up_from_shards(),
        rows_held,
        torch.equal(output, reference(ids[rank])),
        ((grad - reference.weight.grad).norm() / reference.weight.grad.norm()).item(),
    )


def test_rank_holding_no_rows():
    results = run_distributed(_rank_without_rows, 4)
    assert [rows for _, rows, _, _ in results] == [3, 3, 3, 0]
    for looked_up, _, equal_output, grad_error in results:
        assert looked_up and equal_output
        assert grad_error <= 1e-6


def _empty_batch_on_one_rank():
    """Rank 0 has no tokens this step: it still takes part, gets an empty output, and the
    others' gradients equal one process's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyLM()
    model = _sharded(copy.deepcopy(reference), False)
    tokens = [_tokens(r)[:0] if r == 0 else _tokens(r) for r in range(world)]
    output = model(tokens[rank])
    output.pow(2).sum().backward()
    (sum(reference(t).pow(2).sum() for t in tokens) / world).backward()
    expected = reference.embed.weight.grad
    grad = model.embed.weight.grad.full_tensor()
    return (
        registry.unit_of(model.embed).looked_up_from_shards(),
        tuple(output.shape),
        ((grad - expected).norm() / expected.norm()).item(),
    )


def test_empty_batch_on_one_rank():
    results = run_distributed(_empty_batch_on_one_rank, 2)
    assert [shape for _, shape, _ in results] == [(0, 5, VOCAB), (2, 5, VOCAB)]
    for looked_up, _, grad_error in results:
        assert looked_up and grad_error <= 1e-6


def _out_of_range_ids():
    """A token id past the table on rank 1 raises on every rank (none waits alone in a
    collective), as an IndexError like nn.Embedding's."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _sharded(TinyLM(), False)
    ids = _tokens(rank)
    if rank == 1:
        ids[0, 1] = VOCAB
    try:
        model(ids)
    except flatshard.TokenIdError as error:
        return isinstance(error, IndexError), str(error)
    return False, "no error"


def test_out_of_range_ids_raise_on_every_rank():
    for is_index_error, message in run_distributed(_out_of_range_ids, 2):
        assert is_index_error, message
        assert f"outside [0, {VOCAB})" in message and "rank(s) [1]" in message


def _prefetched_table_dropped():
    """An evaluation batch too large for a lookup gathers the table and puts the embedding
    in the recorded order, so the next forward prefetches it; when that forward looks up
    instead, the stray gather is dropped rather than held to the end of backward."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = TinyLM()
    model = _sharded(copy.deepcopy(reference), False)
    unit = registry.unit_of(model.embed)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (40, 5)))  # 2 x 200 tokens >= 257 rows: gathered
    gathered_for_eval = not unit.looked_up_from_shards()
    loss = _loss(model, _tokens(rank))
    table_freed = unit.buckets[0].unsharded.untyped_storage().size() == 0
    loss.backward()
    expected = _reference_grads(reference, dist.get_world_size())["embed.weight"]
    grad = model.embed.weight.grad.full_tensor()
    error = ((grad - expected).norm() / expected.norm()).item()
    return gathered_for_eval, unit.looked_up_from_shards(), table_freed, error


def test_prefetched_table_is_dropped():
    for gathered_for_eval, looked_up, table_freed, grad_error in run_distributed(
        _prefetched_table_dropped, 2
    ):
        assert gathered_for_eval and looked_up and table_freed
        assert grad_error <= 1e-6
