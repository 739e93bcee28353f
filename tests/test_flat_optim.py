"""`flatshard.optim.AdamW` / `SGD` against torch's on the same sharded model: losses,
weights and every optimizer state bitwise, over ZeRO stages, world sizes, weight-decay
groups, a frozen parameter, optimizer offload and the disk tier; a checkpoint of either
loads into the other."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, build_model, config, full_optimizer_state, full_state, shard
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import flatshard
from flatshard import optim

STEPS = 3


def _groups(model, frozen: bool):
    """Weight decay on matrices, none on norms (torchtitan's split); optionally a frozen
    norm inside a bucket."""
    if frozen:
        model.layers[0].attn_norm.weight.requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


OPTIMIZERS = {  # name: (flatshard's, torch's, keywords)
    "adamw": (optim.AdamW, torch.optim.AdamW, dict(lr=1e-3, betas=(0.9, 0.95))),
    "adamw-fused": (optim.AdamW, torch.optim.AdamW, dict(lr=1e-3, betas=(0.9, 0.95), fused=True)),
    "sgd": (optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    "sgd-nesterov": (optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd-plain": (optim.SGD, torch.optim.SGD, dict(lr=0.1, maximize=True)),
}


def _train(kind: str, zero_stage: int, offload, frozen: bool, foreach, name="adamw", dim=32):
    rank = dist.get_rank()
    policy = None
    if offload == "half":
        policy = flatshard.OffloadPolicy(0.5)
    elif offload == "disk":
        policy = flatshard.OffloadPolicy(1.0, path=tempfile.mkdtemp(prefix=f"tier-{rank}-"))
    model = shard(build_model(config(dim=dim)), zero_stage=zero_stage, offload_policy=policy)
    ours, theirs, keywords = OPTIMIZERS[name]
    make = ours if kind == "flat" else theirs
    extra = {} if kind == "flat" else {"foreach": foreach}
    optimizer = make(_groups(model, frozen), **keywords, **extra)
    losses = []
    for tokens in batches(model.config, STEPS):
        losses.append(_step(model, optimizer, tokens))
    flat = sum(len(plan.ids) for plan in getattr(optimizer, "_plans", {}).values())
    trainable = sum(p.requires_grad for p in model.parameters())
    return losses, full_state(model), full_optimizer_state(model, optimizer), (flat, trainable)


def _bitwise(ours: dict, theirs: dict) -> list[str]:
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    return [k for k in theirs if not torch.equal(ours[k], theirs[k])]


CASES = [  # (world, zero stage, offload, frozen)
    (1, 3, None, False),
    (2, 3, None, True),
    (2, 2, None, False),
    (2, 1, None, False),
    (4, 3, None, False),
    (2, 3, "half", True),
    (2, 3, "disk", False),
]


@pytest.mark.parametrize("world, zero_stage, offload, frozen", CASES, ids=str)
def test_flat_adamw_equals_torch_adamw_bitwise(world, zero_stage, offload, frozen):
    _assert_equal(world, (zero_stage, offload, frozen), "adamw")


FUSED_CASES = [(1, 3, None, False), (2, 3, None, True), (2, 2, "half", False), (4, 3, None, False)]
SGD_CASES = [("sgd", 2, 3, None), ("sgd-nesterov", 2, 1, "half"), ("sgd-plain", 2, 3, None)]


@pytest.mark.parametrize("name, world, zero_stage, offload", SGD_CASES, ids=str)
def test_flat_sgd_equals_torch_sgd_bitwise(name, world, zero_stage, offload):
    _assert_equal(world, (zero_stage, offload, True), name)


@pytest.mark.parametrize("world, zero_stage, offload, frozen", FUSED_CASES, ids=str)
def test_flat_fused_adamw_equals_torch_fused_adamw_bitwise(world, zero_stage, offload, frozen):
    """`fused=True`: torch's fused kernel over the flat ranges equals torch's fused AdamW on
    the same pieces bit for bit. At dim 24 most pieces end in a part the CPU kernel steps in
    scalar code (a norm's piece is all of it), which the ranges must keep apart."""
    args = (zero_stage, offload, frozen, None, "adamw-fused", 24)
    ours = run_distributed(_train, world, "flat", *args)[0]
    theirs = run_distributed(_train, world, "torch", *args)[0]
    assert ours[3][0] == ours[3][1]  # every parameter stepped flat
    assert ours[0] == theirs[0]
    assert _bitwise(ours[1], theirs[1]) == [] and _bitwise(ours[2], theirs[2]) == []


def _assert_equal(world, args, name):
    ours = run_distributed(_train, world, "flat", *args, None, name)[0]
    flat, trainable = ours[3]  # every parameter stepped flat (the disk tier: by torch's code)
    assert flat == (0 if args[1] == "disk" else trainable), (flat, trainable)
    for foreach in (True, False):
        theirs = run_distributed(_train, world, "torch", *args, foreach, name)[0]
        assert ours[0] == theirs[0], (foreach, ours[0], theirs[0])
        assert _bitwise(ours[1], theirs[1]) == [], foreach
        assert _bitwise(ours[2], theirs[2]) == [], foreach


def _step(model, optimizer, tokens) -> float:
    """One step on this rank's slice of `tokens`; its loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = tokens.shape[0] // world
    mine = tokens[rank * per_rank : (rank + 1) * per_rank]
    logits = model(mine[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _checkpoint_across(first: str):
    """Two steps with one optimizer, its state into the other (DCP's state-dict API), two
    more steps (first None: four steps with torch's)."""
    makes = {"flat": optim.AdamW, "torch": torch.optim.AdamW, None: torch.optim.AdamW}
    second = {"flat": "torch", "torch": "flat", None: None}[first]
    data = batches(config(), 4)
    model = shard(build_model(config()))
    optimizer = makes[first](model.parameters(), lr=1e-3, weight_decay=0.1)
    for tokens in data[:2]:
        _step(model, optimizer, tokens)
    if first is not None:
        saved = get_optimizer_state_dict(model, optimizer)
        optimizer = makes[second](model.parameters(), lr=1e-3, weight_decay=0.1)
        set_optimizer_state_dict(model, optimizer, saved)
    for tokens in data[2:]:
        _step(model, optimizer, tokens)
    return full_state(model), full_optimizer_state(model, optimizer)


@pytest.mark.parametrize("first", ["flat", "torch"])
def test_a_checkpoint_of_one_loads_into_the_other(first):
    expected = run_distributed(_checkpoint_across, 2, None)[0]
    weights, states = run_distributed(_checkpoint_across, 2, first)[0]
    assert _bitwise(weights, expected[0]) == [] and _bitwise(states, expected[1]) == []


# --- tensor and expert parallelism: parameters on other meshes, experts in their own units --
COMPOSED = {  # name: (world, ParallelDims keywords, MoE)
    "tp2": (2, dict(tp=2), False),
    "ep2": (2, dict(ep=2), True),
    "tp2-ep2": (4, dict(tp=2, ep=2), True),
}


def _train_composed(kind: str, dims_keywords: dict, moe: bool):
    from test_full_state_paths import build_case_model, case_loss

    world = dist.get_world_size()
    dims = flatshard.ParallelDims(world, **dims_keywords)
    model = flatshard.parallelize(build_case_model("moe" if moe else "llama", seed=0), dims)
    make = optim.AdamW if kind == "flat" else torch.optim.AdamW
    optimizer = make(model.parameters(), lr=1e-3, weight_decay=0.1)
    data_rank, data_world = dims.build().dp_rank, dims.dp
    for tokens in batches(model.config, STEPS):
        per_rank = tokens.shape[0] // data_world
        case_loss(model, tokens[data_rank * per_rank : (data_rank + 1) * per_rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
    flat = sum(len(plan.ids) for plan in getattr(optimizer, "_plans", {}).values())
    trainable = sum(p.requires_grad for p in model.parameters())
    return full_state(model), full_optimizer_state(model, optimizer), (flat, trainable)


@pytest.mark.parametrize("case", list(COMPOSED))
def test_flat_adamw_under_tensor_and_expert_parallelism(case):
    world, dims_keywords, moe = COMPOSED[case]
    ours = run_distributed(_train_composed, world, "flat", dims_keywords, moe)
    theirs = run_distributed(_train_composed, world, "torch", dims_keywords, moe)
    flat, trainable = ours[0][2]
    assert flat == trainable  # every parameter stepped flat
    for rank in range(world):
        assert _bitwise(ours[rank][0], theirs[rank][0]) == []
        assert _bitwise(ours[rank][1], theirs[rank][1]) == []


def _train_in_batches(elements: int):
    from flatshard.optim import flat_ranges as plan

    default, plan.CPU_BATCH_ELEMENTS = plan.CPU_BATCH_ELEMENTS, elements
    try:
        return _train("flat", 3, None, False, None)
    finally:
        plan.CPU_BATCH_ELEMENTS = default


def test_long_ranges_are_stepped_in_bounded_batches():
    """With batches of 100 elements (every range cut, the temporaries bounded) the results
    are still torch's, bitwise."""
    reference = run_distributed(_train, 2, "torch", 3, None, False, True)[0]
    ours = run_distributed(_train_in_batches, 2, 100)[0]
    assert ours[0] == reference[0]
    assert _bitwise(ours[1], reference[1]) == [] and _bitwise(ours[2], reference[2]) == []


def _fused_adamw(tensors: list[list[torch.Tensor]], steps: list[torch.Tensor]) -> None:
    params, grads, exp_avgs, exp_avg_sqs = tensors
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=1e-3, beta1=0.9,
        beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False,
    )  # fmt: skip


@pytest.mark.parametrize("width", ["known", "unknown"])
def test_fused_pieces_step_each_parameter_as_torch_steps_it_alone(width):
    """Pieces of every size modulo the vector width, some off the grid after padding: the
    fused kernel over plan.fused_pieces gives each piece the bits of a call on that piece
    alone (one run over the whole range would not: its vector code rounds a piece's tail
    unlike the scalar code a piece alone gets there). A CPU of unknown width: each piece
    on its own."""
    from types import SimpleNamespace

    from flatshard import compat
    from flatshard.optim.flat_ranges import fused_pieces
    from flatshard.optim.flat_state import Range

    unit = compat.fused_tail_unit(torch.device("cpu"), torch.float32)
    if width == "unknown":
        unit = None
    elif unit is None:
        pytest.skip("torch's CPU vector width is not known on this machine")
    generator = torch.Generator().manual_seed(0)
    slots, start = [], 0
    for numel in torch.randint(1, 200, (120,), generator=generator).tolist():
        start += int(torch.randint(0, 3, (), generator=generator))  # padding before it
        slots.append(SimpleNamespace(start=start, numel=numel))
        start += numel
    used = torch.zeros(start, dtype=torch.bool)
    for s in slots:
        used[s.start : s.start + s.numel] = True

    def buffers():
        values = [torch.randn(start, generator=generator) for _ in range(3)]
        values.append(torch.rand(start, generator=generator))
        return [v * used for v in values]  # padding holds zeros, as in a shard

    whole = Range(None, 0, start, 0, [])
    pieces = fused_pieces(whole, slots, unit)
    alone = buffers()
    at_once = [b.clone() for b in alone]
    steps_alone = [torch.tensor(0.0) for _ in slots]
    steps_at_once = [torch.tensor(0.0) for _ in pieces]
    for _ in range(3):
        grads = torch.randn(start, generator=generator) * used
        for state in (alone, at_once):
            state[1].copy_(grads)
        views = [[b[s.start : s.start + s.numel] for s in slots] for b in alone]
        _fused_adamw(views, steps_alone)
        _fused_adamw([[b[p.start : p.end] for p in pieces] for b in at_once], steps_at_once)
    for ours, theirs in zip(at_once, alone):
        assert torch.equal(ours, theirs)


def _cached_slots_after_a_relayout():
    from flatshard import registry
    from flatshard.optim.flat_ranges import SlotCache, slot_of

    model = shard(build_model(config(dim=32)), zero_stage=3)
    cache, params = SlotCache(), list(model.parameters())
    before = [cache(p) for p in params]
    assert all(cache(p) is slot for p, slot in zip(params, before))  # looked up once
    for unit in registry.units_below(model):
        for bucket in unit.buckets:
            bucket.shard.place(0, pin_memory=False)  # every piece to the host
    after = [cache(p) for p in params]
    assert after == [slot_of(p) for p in params]
    return sum(b.host != a.host for b, a in zip(before, after))


def test_a_cached_slot_follows_its_shard_to_a_new_layout():
    """An offload placement (or a dtype conversion) reallocates a shard: the optimizer's
    cached slots are looked up again, not left pointing at the old side and offset."""
    moved = run_distributed(_cached_slots_after_a_relayout, 1)[0]
    assert moved > 0
