"""Communication per ZeRO-3 step: one all-gather per bucket in forward, one per bucket in
backward (the model root and its first-use groups keep their parameters through backward,
as FSDP2 keeps its root, and so does the last block, whose backward comes next), one
reduce-scatter per trainable bucket, nothing else; bytes equal the layout's padded sizes.
On gloo an all-gather is N-1 `isend`s of the shard (and N-1 `irecv`s into the output) and a
reduce-scatter one `all_to_all_single` of the flat gradient (see comm/collectives.py). A
unit over one embedding first all-gathers every rank's token count to decide whether to look
up from its shards (sharded_lookup.py; at this vocabulary it gathers). Order: each unit is gathered
where it is first used and reduced as soon as its gradient is complete (the output head
first, the embedding last)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import adamw, batches, build_model, config, lm_loss, rank_slice, shard

from flatshard import compat, registry

COUNTED = [
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all_single",
    "all_gather_object",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
]
_NEW_NAMES = {
    "all_gather_into_tensor": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single",
}


class CollectiveCounter:
    def __init__(self):
        self.calls = collections.Counter()
        self.bytes = collections.Counter()
        self.phase = "idle"
        self._originals = {}

    def __enter__(self):
        for attribute in COUNTED:
            if not hasattr(dist, attribute):
                continue
            original = getattr(dist, attribute)
            self._originals[attribute] = original
            # before torch 2.13 only the older names exist (flatshard calls them): counted
            # under the new, so the expected counts hold on every torch
            new = _NEW_NAMES.get(attribute, attribute)
            name = attribute if hasattr(dist, new) else new

            def counted(*args, _name=name, _original=original, **kwargs):
                key = (self.phase, _name)
                self.calls[key] += 1
                if _name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single"):
                    big = args[0] if _name == "all_gather_single" else args[1]
                    self.bytes[key] += big.numel() * big.element_size()
                if _name == "isend":
                    self.bytes[key] += args[0].numel() * args[0].element_size()
                return _original(*args, **kwargs)

            setattr(dist, attribute, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _count_one_step(param_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    policy = None
    if param_dtype is not None:
        from flatshard import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model = shard(build_model(cfg), 3, mp_policy=policy)
    optimizer = adamw(model.parameters())
    data = batches(cfg, 2)
    for step, tokens in enumerate(data):
        counter = CollectiveCounter() if step == 1 else None  # step 0 records the order
        with counter or _null():
            if counter:
                counter.phase = "forward"
            loss = lm_loss(model, rank_slice(tokens, rank, world))
            if counter:
                counter.phase = "backward"
            loss.backward()
            if counter:
                counter.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad()
    units = list(dict.fromkeys(registry.unit_of(m) for m in model.modules() if _is_unit(m)))
    # stay gathered from forward into backward: the root, its first-use groups and the
    # last block (its backward comes right after theirs)
    kept = [u for u in units if u.root_part or u is registry.unit_of(model)]
    kept.append(registry.unit_of(model.layers[-1]))
    assert [u.kept_for_backward for u in units] == [u in kept for u in units]
    element = 2 if param_dtype == torch.bfloat16 else 4
    peers = world - 1  # an all-gather sends this rank's shard to each peer, receives theirs
    gathered = {
        "forward": [b for u in units for b in u.buckets],
        "backward": [b for u in units if u not in kept for b in u.buckets],
    }
    expected_calls = {
        (phase, op): peers * len(buckets)
        for phase, buckets in gathered.items()
        for op in ("isend", "irecv")
    }
    expected_calls[("backward", "all_to_all_single")] = sum(
        b.layout.requires_grad for u in units for b in u.buckets
    )
    expected_bytes = {
        (phase, "isend"): element * peers * sum(b.layout.shard_size for b in buckets)
        for phase, buckets in gathered.items()
    }
    expected_bytes[("backward", "all_to_all_single")] = 4 * sum(
        b.layout.padded_size for u in units for b in u.buckets if b.layout.requires_grad
    )
    deciding = [u for u in units if u.lookup is not None]
    assert deciding == [registry.unit_of(model.embed_tokens)]
    assert not deciding[0].looked_up_from_shards()
    expected_calls[("forward", "all_gather_single")] = 1
    # each rank's token count and whether its ids fit the table: two int64s
    expected_bytes[("forward", "all_gather_single")] = 2 * 8 * world
    return dict(counter.calls), dict(counter.bytes), expected_calls, expected_bytes


def _is_unit(module) -> bool:
    return registry.unit_of(module) is not None


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_zero3_collectives_per_step(world_size, param_dtype):
    for calls, sizes, expected_calls, expected_bytes in run_distributed(
        _count_one_step, world_size, param_dtype
    ):
        assert calls == expected_calls
        assert sizes == expected_bytes


def _order_one_step():
    """Which unit each all-gather / reduce-scatter of the second step belongs to, in order."""
    from flatshard.runtime.flat_bucket import FlatBucket

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config()
    model = shard(build_model(cfg), 3)
    names = {}
    for name, module in model.named_modules():
        for bucket in registry.unit_of(module).buckets if _is_unit(module) else ():
            names.setdefault(id(bucket), name or "root")
    log = []
    gather, reduce = FlatBucket.start_all_gather, FlatBucket.start_reduce_scatter

    def logged(original, kind):
        def call(bucket, *args):
            log.append((kind, names[id(bucket)]))
            return original(bucket, *args)

        return call

    optimizer = adamw(model.parameters())
    for step, tokens in enumerate(batches(cfg, 2)):
        if step == 1:
            FlatBucket.start_all_gather = logged(gather, "gather")
            FlatBucket.start_reduce_scatter = logged(reduce, "reduce")
        try:
            loss = lm_loss(model, rank_slice(tokens, rank, world))
            if step == 1:
                log.append(("backward", ""))
            loss.backward()
        finally:
            FlatBucket.start_all_gather, FlatBucket.start_reduce_scatter = gather, reduce
        optimizer.step()
        optimizer.zero_grad()
    return (
        log,
        registry.unit_of(model).params,
        registry.unit_of(model.norm) is registry.unit_of(model.lm_head),
    )


def test_root_parameters_are_gathered_and_reduced_where_used():
    for log, root_params, head_grouped in run_distributed(_order_one_step, 2):
        assert root_params == [] and head_grouped  # [embed_tokens] and [norm, lm_head]
        backward = log.index(("backward", ""))
        forward_gathers = list(dict.fromkeys(name for kind, name in log[:backward]))
        assert forward_gathers == ["embed_tokens", "layers.0", "layers.1", "norm"]
        reduces = list(dict.fromkeys(name for kind, name in log if kind == "reduce"))
        assert reduces == ["norm", "layers.1", "layers.0", "embed_tokens"]
        # the head's gradient is on its way while the blocks' backward still runs
        in_backward = log[backward:]
        assert in_backward.index(("reduce", "norm")) < in_backward.index(("gather", "layers.0"))


def _reduce_scatter_errors(dtype):
    """Largest error of flatshard's and of gloo's reduce-scatter against the exact result."""
    from flatshard import comm

    rank, world = dist.get_rank(), dist.get_world_size()

    def contribution(r):
        return torch.randn(world * 37, generator=torch.Generator().manual_seed(r)).to(dtype)

    exact_sum = sum(contribution(r).double() for r in range(world))[rank * 37 : (rank + 1) * 37]
    errors = []
    for average in (False, True):
        exact = exact_sum / world if average else exact_sum
        ours = torch.empty(37, dtype=dtype)
        comm.reduce_scatter(ours, contribution(rank), None, average=average).wait()
        gloo = torch.empty(37, dtype=dtype)
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        compat.reduce_scatter_single(gloo, contribution(rank), op=op)  # (torch < 2.13 too)
        scale = exact.abs().max().item()
        errors.append(
            (
                (ours.double() - exact).abs().max().item() / scale,
                (gloo.double() - exact).abs().max().item() / scale,
            )
        )
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gloo_reduce_scatter_is_exact(world_size, dtype):
    """flatshard's all-to-all reduce-scatter (gloo) sums and averages to within one rounding
    of the exact result, as gloo's own reduce-scatter does."""
    rounding = torch.finfo(dtype).eps
    for errors in run_distributed(_reduce_scatter_errors, world_size, dtype):
        for ours, gloo in errors:
            assert ours <= rounding and gloo <= rounding, errors


def _all_gathers_in_flight():
    """flatshard's gloo all-gather (point-to-point sends) on a subgroup whose ranks are not
    the global ones, with several gathers in flight at once, as prefetching does."""
    from flatshard import comm

    rank = dist.get_rank()
    group = dist.new_group([1, 2, 3])  # group ranks 0, 1, 2 are global ranks 1, 2, 3
    if rank == 0:
        return None
    me, world = dist.get_rank(group), dist.get_world_size(group)
    assert me == rank - 1

    def shard_of(member, gather):
        return torch.arange(5, dtype=torch.float32) + 100 * member + 10_000 * gather

    outputs = [torch.empty(5 * world) for _ in range(3)]
    works = [comm.all_gather(out, shard_of(me, g), group) for g, out in enumerate(outputs)]
    for work in reversed(works):  # waited on in any order
        work.wait()
    expected = [torch.cat([shard_of(m, g) for m in range(world)]) for g in range(3)]
    return all(torch.equal(out, exp) for out, exp in zip(outputs, expected))


def test_gloo_all_gather_on_a_subgroup_with_gathers_in_flight():
    results = run_distributed(_all_gathers_in_flight, 4)
    assert results[0] is None and results[1:] == [True, True, True]
