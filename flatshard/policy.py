"""User-facing policies: mixed precision and ZeRO stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatshard.errors import WrappingError


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Same fields and meaning as PyTorch FSDP2's `MixedPrecisionPolicy`.

    param_dtype: dtype of the unsharded parameters used for forward/backward and sent by the
        all-gather (None: the parameters' own dtype).
    reduce_dtype: dtype gradients are reduce-scattered in (None: param_dtype).
    output_dtype: dtype the module's floating-point outputs are cast to (None: no cast).
    cast_forward_inputs: cast floating-point forward inputs to param_dtype.
    The sharded main weights, their gradients and the optimizer state keep the
    parameters' original dtype (fp32 for an fp32 model).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def as_mixed_precision(policy) -> MixedPrecisionPolicy:
    """Accept our policy or PyTorch FSDP2's (same fields), so FSDP2 scripts port by import."""
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    try:
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
    except AttributeError as error:
        raise WrappingError(
            f"mp_policy must be a flatshard.MixedPrecisionPolicy, got {type(policy).__name__}"
        ) from error


def _is_group_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def forward_group_size(reshard_after_forward, shard_size: int) -> int | None:
    """FSDP2's `reshard_after_forward=<int>` (hpZ): the ranks a unit stays sharded over
    after forward, or None (all of them, or no resharding). 1 keeps everything, as False;
    the shard group's size is plain ZeRO-3, as True."""
    if not _is_group_size(reshard_after_forward):
        return None
    if reshard_after_forward < 1 or shard_size % reshard_after_forward:
        raise WrappingError(
            f"reshard_after_forward={reshard_after_forward} must divide the shard group's "
            f"size ({shard_size}), e.g. the ranks of one node"
        )
    return reshard_after_forward if 1 < reshard_after_forward < shard_size else None


def resolve_zero_stage(zero_stage: int | None, reshard_after_forward: bool | None) -> int:
    """ZeRO-3 reshards parameters after forward, ZeRO-2 keeps them until backward ends,
    ZeRO-1 keeps parameters and gradients unsharded between optimizer steps."""
    if _is_group_size(reshard_after_forward):
        reshard_after_forward = True  # ZeRO-3 in forward; the group size: see forward_group_size
    if reshard_after_forward not in (None, True, False):
        raise WrappingError(
            "reshard_after_forward must be True (ZeRO-3) or False (ZeRO-2); "
            f"got {reshard_after_forward!r}"
        )
    if zero_stage is None:
        return 2 if reshard_after_forward is False else 3
    if zero_stage not in (1, 2, 3):
        raise WrappingError(f"zero_stage must be 1, 2 or 3, got {zero_stage!r}")
    if reshard_after_forward is not None and reshard_after_forward != (zero_stage == 3):
        raise WrappingError(
            f"zero_stage={zero_stage} conflicts with reshard_after_forward="
            f"{reshard_after_forward}; pass only one of them"
        )
    return zero_stage
