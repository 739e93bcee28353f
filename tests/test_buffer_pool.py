"""The CPU buffer pool: freed flat buffers go to the next one of the same size, never while
something still views them, and nothing stays pooled after a forward or backward pass."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import adamw, batches, build_model, config, lm_loss, rank_slice, shard

from flatshard import comm, compat, registry
from flatshard.comm import nccl_shim
from flatshard.runtime.bucket_grads import BucketGradients

pools = pytest.mark.skipif(
    not compat.storage_memory_moves() or nccl_shim.active(),
    reason="no CPU pool: this torch cannot move a storage's memory, or NCCL is emulated",
)


@pools
def test_a_returned_buffer_is_handed_out_again():
    pool = comm.BufferPool()
    first = pool.empty(1000, torch.float32, torch.device("cpu"))
    address = first.data_ptr()
    pool.give_back(first)
    del first
    again = pool.empty(2000, torch.bfloat16, torch.device("cpu"))  # same bytes, any dtype
    assert again.data_ptr() == address and again.shape == (2000,)
    other = pool.empty(1000, torch.bfloat16, torch.device("cpu"))  # another size: fresh
    assert other.data_ptr() != address


def test_a_viewed_buffer_is_not_taken():
    pool = comm.BufferPool()
    buffer = torch.ones(1000)
    kept = buffer[10:20]  # e.g. a gradient a user kept
    pool.give_back(buffer)
    assert pool.empty(1000, torch.float32, torch.device("cpu")).data_ptr() != buffer.data_ptr()
    assert torch.equal(kept, torch.ones(10))


@pools
def test_freed_storage_memory_moves_to_the_next_buffer():
    pool = comm.BufferPool()
    first, second = torch.empty(1000), torch.empty(1000)
    view = first[:10]  # saved for backward: must stay a valid (empty) object
    comm.free_storage(second)
    address = first.data_ptr()
    comm.free_storage(first, pool)
    assert first.untyped_storage().size() == 0 and view.untyped_storage().size() == 0
    comm.alloc_storage(second, pool)
    assert second.data_ptr() == address
    comm.alloc_storage(first, pool)  # pool empty: fresh memory
    assert first.untyped_storage().size() == 4000 and first.data_ptr() != address


def _reuse_in_one_step():
    """Addresses of every flat gradient buffer handed out in the second step's backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(n_layers=4)
    model = shard(build_model(cfg), 3)
    optimizer = adamw(model.parameters())
    original = BucketGradients.prepare
    addresses = []

    def recording(grads, keep, pool, device):
        original(grads, keep, pool, device)
        addresses.append((grads.padded_size, grads.unsharded.data_ptr()))

    for step, tokens in enumerate(batches(cfg, 2)):
        BucketGradients.prepare = recording if step == 1 else original
        try:
            loss = lm_loss(model, rank_slice(tokens, rank, world))
            pool = registry.unit_of(model).context.buffers
            after_forward = dict(pool._free)  # blocks' buffers must not idle at the peak
            loss.backward()
        finally:
            BucketGradients.prepare = original
        optimizer.step()
        optimizer.zero_grad()
    return addresses, after_forward, dict(pool._free)


@pools
def test_blocks_reuse_gradient_buffers_and_the_pool_ends_empty():
    for addresses, after_forward, left in run_distributed(_reuse_in_one_step, 2):
        assert after_forward == {} and left == {}
        sizes = [size for size, _ in addresses]
        block = max(set(sizes), key=sizes.count)  # 4 blocks of one size
        block_addresses = [address for size, address in addresses if size == block]
        assert len(block_addresses) >= 4
        assert len(set(block_addresses)) < len(block_addresses)  # reused within the step


def _reduce_scatter_returns_its_receive_buffer():
    from flatshard.comm import collectives

    rank = dist.get_rank()
    pool = comm.BufferPool()
    flat = torch.arange(8.0) * (rank + 1)
    output = torch.empty(4)
    collectives.reduce_scatter(output, flat, dist.group.WORLD, average=False, pool=pool).wait()
    return output, {size: len(held) for (size, _), held in pool._free.items()}


@pools
def test_the_reduce_scatter_gives_its_receive_buffer_back():
    results = run_distributed(_reduce_scatter_returns_its_receive_buffer, 2)
    for rank, (output, pooled) in enumerate(results):
        assert torch.equal(output, (torch.arange(8.0) * 3)[4 * rank : 4 * rank + 4])
        assert pooled == {32: 1}  # the all-to-all's 8 received floats, ready for the next unit
