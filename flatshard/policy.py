"""User-facing policies: mixed precision, collectives, optimizer offload and ZeRO stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatshard.errors import OffloadError, WrappingError


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

    def dtypes_for(self, main_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(compute dtype, reduce dtype) of parameters kept in `main_dtype`: as FSDP2, a
        reduce dtype of None reduces in the compute dtype, and a param dtype of None
        computes in the parameters' own."""
        param_dtype = self.param_dtype or main_dtype
        return param_dtype, self.reduce_dtype or param_dtype


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


@dataclass(frozen=True)
class CommPolicy:
    """How a module's collectives move their bytes (opt-in; `module.set_comm_policy`).

    quantize_weights: None (the compute dtype), "int8" or "fp8" (e4m3): the all-gathered
        weights in 8 bits with one fp32 scale per `block_size` elements (ZeRO++'s qwZ);
        only the gathered copy is rounded, the main weights and the step are not.
    quantize_grads: None (the reduce dtype), "int8" or "fp8": the gradients reduce-scattered
        in 8 bits with one fp32 scale per `block_size` elements, summed in fp32 on arrival
        (ZeRO++'s qgZ).
    error_feedback: with quantize_grads, what a step's rounding dropped is added to the next
        step's gradient (costs one unsharded gradient per bucket and rank).
    """

    quantize_weights: str | None = None
    quantize_grads: str | None = None
    block_size: int = 256  # runtime/quantized_gather.BLOCK
    error_feedback: bool = True

    def __post_init__(self):
        for name in ("quantize_weights", "quantize_grads"):
            if getattr(self, name) not in (None, "int8", "fp8"):
                raise WrappingError(
                    f"CommPolicy.{name} must be None, 'int8' or 'fp8', got {getattr(self, name)!r}"
                )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise WrappingError(
                f"CommPolicy.block_size must be a positive int, got {self.block_size!r}"
            )


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep a fraction of each rank's sharded main weights, their gradients and optimizer
    state on the host, and step them there (any `torch.optim` optimizer: it steps tensors
    where they live).

    fraction: of this rank's sharded parameter elements, in [0, 1]; 0 offloads nothing (as
        FSDP2's plain `OffloadPolicy()`), 1 everything (FSDP2's `CPUOffloadPolicy`). The
        layout picks whole per-rank pieces (`layout/offload.py`), so the offloaded share
        lands within a small piece of the fraction.
    pin_memory: page-locked host buffers on CUDA, so copies overlap compute.
    path: a directory: the offloaded optimizer state lives in memory-mapped files there
        (the disk tier), paged in a piece at a time while the optimizer steps.
    """

    fraction: float = 0.0
    pin_memory: bool = True
    path: str | None = None

    def __post_init__(self):
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise OffloadError(f"OffloadPolicy(fraction={fraction!r}) must be a number in [0, 1]")
        if not 0.0 <= fraction <= 1.0:
            raise OffloadError(
                f"OffloadPolicy(fraction={fraction}) must be in [0, 1]: the share of each "
                "rank's optimizer state kept on the host (0 none, 1 all)"
            )

    @property
    def offloads(self) -> bool:
        return self.fraction > 0


def as_offload(policy) -> OffloadPolicy:
    """Accept our policy or PyTorch FSDP2's: its plain `OffloadPolicy()` offloads nothing,
    its `CPUOffloadPolicy(pin_memory)` everything (parameters, gradients, optimizer)."""
    if policy is None or isinstance(policy, OffloadPolicy):
        return policy or OffloadPolicy()
    kind = type(policy).__name__
    if kind == "OffloadPolicy":
        return OffloadPolicy()
    if kind == "CPUOffloadPolicy":
        return OffloadPolicy(fraction=1.0, pin_memory=getattr(policy, "pin_memory", True))
    raise WrappingError(
        f"offload_policy must be a flatshard.OffloadPolicy (or FSDP2's OffloadPolicy / "
        f"CPUOffloadPolicy), got {kind}"
    )


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
