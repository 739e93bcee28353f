"""QLoRA with torchao's own NF4 tensors (`to_nf4`) as the frozen bases and trainable LoRA
adapters, fully_shard per block and the root: flatshard runs torchao's all-gather protocol
(its one-argument `fsdp_pre_all_gather(mesh)`), trains to the losses and adapters of one
process and of FSDP2 on the same model, and gathers the 4-bit payload."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from lora_model import all_gather_sizes, base_weights, qlora_model, train
from reference import hsdp_mesh

import flatshard
from flatshard import registry

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

nf4_tensor = pytest.importorskip("torchao.quantization")

# NF4 quantizes in blocks of 64 with a scale per 256 blocks: a base needs 16,384-element
# multiples on every rank (up and down are 128 x 256 here: two scale groups, one a rank)
DIM, HIDDEN, BLOCKS, CLASSES, BATCH, STEPS = 128, 256, 2, 5, 8, 4


def build():
    return qlora_model(DIM, HIDDEN, BLOCKS, CLASSES, nf4_tensor.to_nf4)


def one_process():
    return train(build(), 0, 1, STEPS, BATCH)[:2]


def sharded(library: str, hsdp: bool = False):
    rank, world = dist.get_rank(), dist.get_world_size()
    if library == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = flatshard.fully_shard
    mesh = None
    if hsdp:
        mesh = hsdp_mesh(2)
    model = build()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local_types = {type(p.to_local()).__name__ for p in base_weights(model)}
    losses, weights, gathered = train(model, rank, world, STEPS, BATCH)
    return losses, weights, gathered, local_types


@pytest.mark.parametrize("world,hsdp", [(2, False), (4, True)])
def test_nf4_qlora_equals_one_process_and_fsdp2(world, hsdp):
    ref_losses, ref_weights = one_process()
    losses, weights, gathered, types = run_distributed(sharded, world, "flatshard", hsdp)[0]
    assert types == {"NF4Tensor"}
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    theirs, their_weights, their_gathered, *_ = run_distributed(sharded, world, "fsdp2", hsdp)[0]
    torch.testing.assert_close(losses, theirs, rtol=1e-5, atol=0)
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weights[name], their_weights[name], rtol=1e-5, atol=1e-6)


def _block_gathers():
    """Every all-gather rank 0 issued (bytes), a block's bucket bytes, its bases' NF4
    payload (what torchao's pre hook returns, on every rank) and their fp32 bytes."""
    with all_gather_sizes() as calls:
        model = build()
        for block in model.blocks:
            flatshard.fully_shard(block)
        flatshard.fully_shard(model)
        train(model, dist.get_rank(), dist.get_world_size(), STEPS, BATCH)
    block = model.blocks[0]
    bucket = sum(b.layout.padded_size * 4 for b in registry.unit_of(block).buckets)
    bases = base_weights(block)
    inputs = [t for p in bases for t in p.to_local().fsdp_pre_all_gather(p.device_mesh)[0]]
    payload = dist.get_world_size() * sum(t.numel() * t.element_size() for t in inputs)
    return calls, bucket, payload, sum(p.numel() * 4 for p in bases)


def test_nf4_bases_move_their_4_bit_payload_in_the_blocks_gather():
    calls, bucket, payload, fp32 = run_distributed(_block_gathers, 2)[0]
    assert calls.count(bucket + payload) >= STEPS * (BLOCKS + 1)  # ZeRO-3: forward, backward
    assert not any(size in (bucket, payload) for size in calls)  # never apart
    assert 0.125 < payload / fp32 < 0.14  # 4 bits an element, and the block scales
