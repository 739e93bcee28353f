"""FSDP2's tensor-subclass all-gather protocol (`fsdp_pre_all_gather` /
`fsdp_post_all_gather`) on flatshard: QLoRA on a tiny model whose frozen base linears are
int8 tensors with row scales (int8_weight.py, shaped like torchao's NF4, which
test_qlora_nf4.py runs), with trainable LoRA adapters, fully_shard per block and the root.
Losses and adapters equal one process and FSDP2 on the same model; the gathered bytes are
the quantized ones, in one collective a unit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import run_distributed
from int8_weight import Int8Weight
from lora_model import LoRALinear, all_gather_sizes, base_weights, batch, qlora_model, train
from reference import hsdp_mesh

import flatshard
from flatshard import checkpoint, registry
from flatshard.errors import WrappingError

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

# DIM and HIDDEN rows split evenly at worlds 2 and 3: FSDP2 (and so the protocol) asks a
# subclass whose inputs are not the padded shard's size (here the scales) for even chunks
DIM, HIDDEN, BLOCKS, CLASSES, BATCH, STEPS = 12, 24, 2, 3, 12, 5


def build():
    return qlora_model(DIM, HIDDEN, BLOCKS, CLASSES, Int8Weight.quantize)


def one_process():
    return train(build(), 0, 1, STEPS, BATCH)


def sharded(library: str, bases_alone: bool = False, hsdp: bool = False, bf16: bool = False):
    """Trained at this world: fully_shard per block and the root (with `bases_alone`, each
    base linear its own unit first: units of subclass parameters only; with `hsdp`, over a
    (2, world / 2) mesh; with `bf16`, computing in bf16)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if library == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from flatshard import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    mesh = None
    if hsdp:
        mesh = hsdp_mesh(2)
    model = build()
    if bases_alone:
        for module in model.modules():
            if isinstance(module, LoRALinear):
                fully_shard(module.base, mesh=mesh, mp_policy=mp)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    local_types = {type(p.to_local()).__name__ for p in base_weights(model)}
    losses, weights, gathered = train(model, rank, world, STEPS, BATCH)
    return losses, weights, gathered, local_types


def _close(a: dict, b: dict, tolerance: float):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize(
    "world,bases_alone,hsdp",
    [(2, False, False), (3, False, False), (2, True, False), (4, False, True)],
)
def test_qlora_equals_one_process_and_fsdp2(world, bases_alone, hsdp):
    ref_losses, ref_weights, _ = one_process()
    run = run_distributed(sharded, world, "flatshard", bases_alone, hsdp)[0]
    losses, weights, gathered, types = run
    assert types == {"Int8Weight"}  # the shards stay the subclass
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    _close(weights, ref_weights, 1e-5)
    theirs, their_weights, *_ = run_distributed(sharded, world, "fsdp2", bases_alone, hsdp)[0]
    torch.testing.assert_close(losses, theirs, rtol=1e-5, atol=0)
    _close(weights, their_weights, 1e-5)


def test_qlora_in_bf16_equals_fsdp2():
    losses, weights, *_ = run_distributed(sharded, 2, "flatshard", False, False, True)[0]
    theirs, their_weights, *_ = run_distributed(sharded, 2, "fsdp2", False, False, True)[0]
    torch.testing.assert_close(losses, theirs, rtol=1e-5, atol=0)
    _close(weights, their_weights, 1e-5)
    ref_losses, *_ = one_process()
    assert losses != ref_losses  # bf16 compute did happen


def _gathers(zero3: bool):
    """The bytes of every all-gather rank 0 issued over the training, and what the layout
    says a block's should be: its bucket in fp32 plus its bases as int8 rows and an fp32
    scale a row."""
    with all_gather_sizes() as calls:
        model = build()
        for block in model.blocks:
            flatshard.fully_shard(block, reshard_after_forward=zero3)
        flatshard.fully_shard(model, reshard_after_forward=zero3)
        train(model, dist.get_rank(), dist.get_world_size(), STEPS, BATCH)
    bases = base_weights(model.blocks[0])
    block = sum(b.layout.padded_size * 4 for b in registry.unit_of(model.blocks[0]).buckets)
    head_unit = registry.managed_of(model.head.weight)[0]
    head = sum(b.layout.padded_size * 4 for b in head_unit.buckets)
    quantized = sum(p.numel() + p.shape[0] * 4 for p in bases)
    fp32 = sum(p.numel() * 4 for p in bases)
    return calls, (block, quantized, fp32, head)


@pytest.mark.parametrize("zero3", [True, False])
def test_the_gathered_bytes_are_the_quantized_ones_in_one_collective_a_unit(zero3):
    calls, (block, quantized, fp32, head) = run_distributed(_gathers, 2, zero3)[0]
    # a block's bases ride in its bucket's all-gather: no call of their own
    assert set(calls) == {block + quantized, head}
    gathers_a_step = BLOCKS + (1 if zero3 else 0)  # ZeRO-3: again in backward (not the last)
    assert calls.count(block + quantized) >= STEPS * gathers_a_step
    assert quantized / fp32 == pytest.approx((2 + 4 / DIM + 4 / HIDDEN) / 8)
    assert quantized < fp32 / 3  # a quarter, plus a scale a row of 12-24 elements


def _resumed(directory: str):
    """Train 2 steps, save, train 3 more; a fresh model (other base values) loads the
    checkpoint and trains the same 3 steps: the same losses and weights, bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def sharded_model(seed_shift: int):
        model = build()
        if seed_shift:  # other bases and adapters, to be overwritten by the load
            for module in model.modules():
                if isinstance(module, LoRALinear):
                    module.base.weight.qdata.mul_(-1)
                    module.lora_a.data.add_(1.0)
        for block in model.blocks:
            flatshard.fully_shard(block)
        flatshard.fully_shard(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(trainable, lr=1e-2)

    def steps(model, optimizer, first, count):
        losses = []
        for step in range(first, first + count):
            x, y = batch(step, rank, world, BATCH, DIM, CLASSES)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    model, optimizer = sharded_model(0)
    steps(model, optimizer, 0, 2)
    checkpoint.save(directory, model=model, optimizer=optimizer, step=2).wait()
    expected = steps(model, optimizer, 2, 3)
    bases = [p.to_local().dequantize() for p in base_weights(model)]
    model, optimizer = sharded_model(1)
    checkpoint.load(directory, model=model, optimizer=optimizer)
    loaded = [p.to_local().dequantize() for p in base_weights(model)]
    return expected, steps(model, optimizer, 2, 3), bases, loaded


def test_a_qlora_checkpoint_resumes_bitwise(tmp_path):
    expected, resumed, bases, loaded = run_distributed(_resumed, 2, str(tmp_path))[0]
    assert resumed == expected
    for before, after in zip(bases, loaded):
        assert torch.equal(before, after)


def _refused_on_meta():
    with torch.device("meta"):
        model = build()
    try:
        flatshard.fully_shard(model.blocks[0])
    except WrappingError as error:
        return str(error)
    return None


def test_a_subclass_parameter_on_meta_is_refused_by_name():
    message = run_distributed(_refused_on_meta, 2)[0]
    assert "'up.base.weight' is a Int8Weight on the meta device" in message
