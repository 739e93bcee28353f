"""QLoRA: the frozen base weights of LoRA's adapted projections held in 4-bit NormalFloat
(NF4, torchao's `NF4Tensor`), the adapters trained in full precision over them.

A base is quantized whole (blocks of 64 values, each with a scale; the scales quantized
again in groups of blocks), before the model is sharded: fully_shard then splits each
NF4 tensor by rows as FSDP2 does and gathers its 4-bit payload (torchao's all-gather
protocol, `runtime/subclass_params.py`). A rank's rows must hold whole scale groups. The
group depends on the weight's shape alone, so the quantized base is the same at any world
size (a run resumed at another one goes on with the same base): QLoRA's 256 blocks, or
fewer where that keeps the weight splittable 8 ways.
"""

from __future__ import annotations

from torch import nn

from flatshard.models.lora import LoRAError, adapted_modules

BLOCK = 64  # values per NF4 block (QLoRA's)
MOST_BLOCKS_PER_SCALE = 256  # QLoRA's double quantization: a scale per 256 block scales


def scale_group(shape: tuple[int, ...], name: str) -> int:
    """The blocks per quantized scale of an NF4 base of `shape`: the largest power of two up
    to 256 that leaves whole groups on each of up to 8 shards (as many as the blocks allow)."""
    numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
    if len(shape) != 2 or numel % BLOCK:
        raise LoRAError(
            f"{name} {tuple(shape)} cannot be an NF4 base: NF4 quantizes 2-D weights in "
            f"blocks of {BLOCK} values; leave it out of train.lora_targets or run LoRA "
            "without train.qlora"
        )
    blocks = numel // BLOCK
    splits = next(s for s in (8, 4, 2, 1) if blocks % s == 0)
    group = MOST_BLOCKS_PER_SCALE
    while (blocks // splits) % group:
        group //= 2
    return group


def check_split(shape: tuple[int, ...], group: int, shards: int, name: str) -> None:
    """Whether fully_shard can split an NF4 base by rows over `shards` ranks, each whole
    scale groups."""
    blocks = shape[0] * shape[1] // BLOCK
    if shape[0] % shards or (blocks // group) % shards:
        raise LoRAError(
            f"{name} {tuple(shape)} in NF4 ({blocks // group} scale groups of {group} blocks "
            f"of {BLOCK} values) does not split over {shards} ranks: each needs whole rows and "
            "whole groups. Use a data-parallel shard group that divides both (train.dp_shard), "
            "or LoRA without train.qlora"
        )


def nf4_bytes(shape: tuple[int, ...]) -> int:
    """The bytes of an NF4 base of `shape`: 4 bits a value, an int8 scale a block, an fp32
    factor a scale group and the scales' mean (what its all-gather moves, all but the mean)."""
    numel = shape[0] * shape[1]
    blocks = numel // BLOCK
    return numel // 2 + blocks + 4 * (blocks // scale_group(shape, "weight")) + 4


def quantize_bases(model: nn.Module, shards: int) -> dict[str, int]:
    """Every adapted projection's base weight of `model` (unsharded, before fully_shard, its
    adapters added) replaced by its NF4 quantization, frozen. Returns each one's scale
    group (blocks per scale)."""
    from torchao.quantization import to_nf4

    groups = {}
    for name, module in adapted_modules(model).items():
        weight = module.weight
        shape = tuple(weight.shape)
        groups[name] = scale_group(shape, f"{name}.weight")
        check_split(shape, groups[name], shards, f"{name}.weight")
        quantized = to_nf4(weight.detach().contiguous(), BLOCK, groups[name])
        module.weight = nn.Parameter(quantized, requires_grad=False)
    return groups
