"""bf16 compute with fp32 or bf16 gradient reduction, against one process that makes the
same casts and sums in the same order.

The reference emulates the ranks in one process: for every micro-batch and rank, a bf16
copy of the fp32 weights computes that rank's gradient (with the policy's input and output
casts); gradients held over unsynced micro-batches are summed as flatshard sums them (in
place in bf16 when the reduce dtype is bf16, in fp32 otherwise); each sync sums the ranks'
gradients in the reduce dtype and divides (averaging, or pre-scaling by a custom divide
factor in low precision and post-scaling in fp32); the fp32 gradient adds up the syncs.

The embedding looked up from its shards sums its gradient in fp32 where the reference's
bf16 embedding backward sums in bf16: also within the tolerance.

Tolerance: every cast and sum is repeated in the same order, so what differs is kernel
rounding alone (bf16 matmuls split over other thread counts, fp32 sums over other
blockings): at most a couple of bf16 roundings of the gradient, 2^-8 relative each. Per
tensor we allow 2 x 2^-8; a dropped micro-batch or a scale error is 0.2-1.0.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import SEQ, build_model, config, lm_loss, rank_slice, shard
from test_gradients import full_grads, per_tensor_errors

import flatshard
from flatshard import registry

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

BF16 = torch.bfloat16
TOLERANCE = 2 * 2**-8
BATCH = 20  # 5 micro-batches of 4 sequences, 2 per rank at world 2
LOOKUP_VOCAB = 509  # ranks x tokens < rows: the embedding is looked up from its shards
CASES = [
    (reduce, micro, last_only, factor, output, 61)
    for reduce, micro, last_only, factor, output in itertools.product(
        ("fp32", "bf16"), (1, 2, 3, 5), (False, True), (None, 3.0), (None, "fp32", "no-cast")
    )
    if not (micro == 1 and last_only) and (factor is None or output is None)
] + [
    (reduce, micro, last_only, None, None, LOOKUP_VOCAB)
    for reduce, (micro, last_only) in itertools.product(("fp32", "bf16"), ((1, False), (3, True)))
]
DTYPES = {"fp32": torch.float32, "bf16": BF16, None: None}


def _policy(reduce, output):
    """output: None, "fp32" (output_dtype), or "no-cast" (cast_forward_inputs=False)."""
    return flatshard.MixedPrecisionPolicy(
        param_dtype=BF16,
        reduce_dtype=DTYPES[reduce],
        output_dtype=DTYPES.get(output),
        cast_forward_inputs=output != "no-cast",
    )


def _tokens(vocab):
    generator = torch.Generator().manual_seed(11)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=generator)


def backward_micro_batches(model, vocab, microbatches, last_only, rank, world):
    pieces = _tokens(vocab).chunk(microbatches)
    for i, piece in enumerate(pieces):
        if last_only:
            model.set_requires_gradient_sync(i == len(pieces) - 1)
        (lm_loss(model, rank_slice(piece, rank, world)) / microbatches).backward()


def _sharded(cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for reduce, micro, last_only, factor, output, vocab in cases:
        cfg = config(vocab_size=vocab)
        model = shard(build_model(cfg), 3, mp_policy=_policy(reduce, output))
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        backward_micro_batches(model, vocab, micro, last_only, rank, world)
        grads = full_grads(model)  # a collective: every rank gathers
        looked_up = registry.unit_of(model.embed_tokens).looked_up_from_shards()
        out.append((grads, looked_up) if rank == 0 else None)
    return out


# --- the one-process reference --------------------------------------------------------------


def _with_policy_casts(model, policy):
    """model's bf16 copy, with the casts fully_shard's hooks make on every unit."""
    compute = copy.deepcopy(model).to(BF16)

    def cast(tree, dtype):
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree
        )

    # every unit's modules: the blocks, the root's first-use groups, the root
    units = [compute.embed_tokens, *compute.layers, compute.norm, compute.lm_head, compute]
    for module in units:
        if policy.cast_forward_inputs:
            module.register_forward_pre_hook(lambda m, args: cast(args, BF16))
        if policy.output_dtype is not None:
            module.register_forward_hook(lambda m, a, out: cast(out, policy.output_dtype))
    return compute


def _rank_gradients(compute, piece, microbatches, rank, world):
    compute.zero_grad(set_to_none=True)
    (lm_loss(compute, rank_slice(piece, rank, world)) / microbatches).backward()
    return {n: p.grad.clone() for n, p in compute.named_parameters()}


@functools.cache
def _reference(world, reduce, microbatches, last_only, factor, output, vocab):
    reduce_dtype = DTYPES[reduce]
    compute = _with_policy_casts(build_model(config(vocab_size=vocab)), _policy(reduce, output))
    divide = factor or float(world)
    held = [None] * world  # per rank: gradients of unsynced micro-batches
    total: dict[str, torch.Tensor] = {}
    for i, piece in enumerate(_tokens(vocab).chunk(microbatches)):
        for rank in range(world):
            grads = _rank_gradients(compute, piece, microbatches, rank, world)
            if held[rank] is None:
                held[rank] = {n: g.to(reduce_dtype) for n, g in grads.items()}
            else:  # bf16 reduce: autograd adds in place in bf16; fp32: the held fp32 sum
                held[rank] = {n: held[rank][n] + g.to(reduce_dtype) for n, g in grads.items()}
        if last_only and i < microbatches - 1:
            continue
        for name in held[0]:
            flats = [held[rank][name] for rank in range(world)]
            if divide != world and reduce_dtype != torch.float32:
                flats = [flat * (1.0 / divide) for flat in flats]  # pre-scaled, low precision
            reduced = torch.stack(flats).sum(0)
            if divide == world:
                reduced = reduced / world
            elif reduce_dtype == torch.float32:
                reduced = reduced * (1.0 / divide)
            total[name] = reduced.float() if name not in total else total[name] + reduced
        held = [None] * world
    return total


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_gradients_match_a_reference_with_the_same_casts(world_size):
    cases = CASES if world_size == 2 else [c for c in CASES if c[1] in (1, 3)]
    results = run_distributed(_sharded, world_size, cases, timeout=600)[0]
    failures = []
    for case, (grads, looked_up) in zip(cases, results):
        if case[-1] == LOOKUP_VOCAB and not looked_up:  # (small batches of 61 rows may too)
            failures.append(f"{case}: not looked up from the shards")
        reference = _reference(world_size, *case)
        for name, error in per_tensor_errors(grads, reference).items():
            if error > TOLERANCE:
                failures.append(f"{case}: {name} rel {error:.2e}")
    assert not failures, "\n".join(failures)
