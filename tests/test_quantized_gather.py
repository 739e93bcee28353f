"""Weights all-gathered in 8 bits (`CommPolicy(quantize_weights="int8" | "fp8")`, ZeRO++'s
qwZ): a block's values come back within half a quantization step of its scale, the bytes
gathered per step are at most 0.30x the fp32 run's (0.55x a bf16 run's), and training
stays close to the unquantized run while the main weights stay in full precision."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, build_model, config, rel_losses, shard, train

import flatshard
from flatshard.comm import collectives
from flatshard.errors import WrappingError
from flatshard.runtime.quantized_gather import FORMATS, pack, packed_bytes, unpack

STEPS = 4


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_blocks_come_back_within_their_quantization_step(fmt):
    torch.manual_seed(0)
    shard = torch.randn(1000) * torch.linspace(0.01, 10, 1000)  # blocks of other ranges
    dtype, largest = FORMATS[fmt]
    packed = pack(shard, dtype, largest, 256)
    assert packed.numel() == packed_bytes(1000, 256) == 4 * 256 + 4 * 4
    back = unpack(packed.unsqueeze(0), 1000, dtype, 256)[0]
    for block in range(4):
        part = slice(256 * block, 256 * (block + 1))
        scale = shard[part].abs().max() / largest
        error = (back[part] - shard[part]).abs()
        if fmt == "int8":  # half a step of the block's scale
            assert error.max() <= scale / 2 * (1 + 1e-6)
        else:  # e4m3: 3 mantissa bits, relative to the value (and the subnormal step)
            assert (error <= shard[part].abs() / 16 + scale * 2.0**-9).all()


def _train(quantize: str | None, param_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = flatshard.MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype else None
    model = shard(build_model(config()), 3, mp_policy=policy)
    model.set_comm_policy(flatshard.CommPolicy(quantize_weights=quantize))
    collectives.traffic.take()
    losses = train(model, batches(config(), STEPS), rank=rank, world=world)
    gathered = collectives.traffic.take()[0]
    main = next(model.parameters())._local_tensor
    return losses, gathered, main.dtype


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_gathers_move_a_quarter_of_the_bytes_and_train_close(param_dtype):
    plain, plain_bytes, _ = run_distributed(_train, 2, None, param_dtype)[0]
    bound = 0.30 if param_dtype is None else 0.55
    for fmt in ("int8", "fp8"):
        losses, moved, main_dtype = run_distributed(_train, 2, fmt, param_dtype)[0]
        print(
            f"{fmt}: {moved / plain_bytes:.3f}x the bytes, losses {rel_losses(losses, plain):.1e}"
        )
        assert moved <= bound * plain_bytes, (fmt, moved / plain_bytes)
        assert losses != plain and rel_losses(losses, plain) <= 2e-3, fmt
        assert main_dtype == torch.float32  # only the gathered copy is rounded


def test_an_unknown_format_is_refused():
    with pytest.raises(WrappingError, match="'int8' or 'fp8'"):
        flatshard.CommPolicy(quantize_weights="int4")
