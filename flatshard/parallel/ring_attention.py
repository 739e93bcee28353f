"""Ring attention for context parallelism: torch's ring (the one its `context_parallel`
runs) over the SDPA kernel of the tensors' device.

torch's `context_parallel` reaches its ring only through DTensor dispatch of SDPA's CUDA
ops; flatshard calls the ring itself (`_templated_ring_attention` and its backward, the
same functions), so it runs on every device whose kernel returns its log-sum-exp: the
fused CPU kernel, and on CUDA flash attention (half precision). Each rank holds chunks `r`
and `2cp - 1 - r` of the sequence (torch's head-tail load balancing, flatshard's
`sequence_positions`): every step attends this rank's queries to one rank's keys and values,
the blocks merged by their log-sum-exps. Only this rank's keys and values are saved for
backward (the all-gather variant saves the whole sequence's); backward gathers them again
and passes the key/value gradients around the ring (all-to-all).

Grouped-query attention rotates the KV heads only: each kernel call repeats them to the
query heads and sums their gradients back.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from flatshard import compat

aten = torch.ops.aten


def _cpu_forward(query, key, value, is_causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale
    )


def _cpu_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale, saved):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale
    )


def _flash_forward(query, key, value, is_causal, scale):
    return aten._scaled_dot_product_flash_attention(
        query, key, value, 0.0, is_causal, False, scale=scale
    )


def _flash_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale, saved):
    # the forward's sequence lengths and RNG state (what torch's ring passes back too)
    cum_q, cum_k, max_q, max_k, seed, offset = saved[:6]
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, query, key, value, out, logsumexp, cum_q, cum_k, max_q, max_k, 0.0,
        is_causal, seed, offset, scale=scale,
    )  # fmt: skip


def _kernels(query: torch.Tensor):
    """(forward, backward) of the kernel for `query`'s device and dtype, or None."""
    if query.device.type == "cpu":
        return _cpu_forward, _cpu_backward
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16):
        return _flash_forward, _flash_backward
    return None


def ring_runs(query: torch.Tensor) -> bool:
    """Whether the ring runs for tensors like `query` (torch has it, a kernel is known)."""
    return compat.torch_ring_attention() is not None and _kernels(query) is not None


def ring_attention(query, key, value, group, scale=None) -> torch.Tensor:
    """Causal attention of this rank's queries [B, H, L, D] over the whole sequence, of which
    each rank of `group` holds its load-balanced chunks of keys and values [B, H_kv, L, D]."""
    return _Ring.apply(query, key, value, group, scale)


@contextlib.contextmanager
def _load_balanced(ring):
    """torch's ring under head-tail load balancing (its default, set for the call)."""
    options = ring._cp_options
    before = options.enable_load_balance
    options.enable_load_balance = True
    try:
        yield
    finally:
        options.enable_load_balance = before


def _grouped(forward):
    def call(query, key, value, **kwargs):
        return forward(query, *_repeat(query, key, value), **kwargs)

    return call


def _grouped_backward(backward):
    def call(query, key, value, **kwargs):
        repeated_key, repeated_value = _repeat(query, key, value)
        dq, dk, dv = backward(query=query, key=repeated_key, value=repeated_value, **kwargs)[:3]
        return dq, _sum_groups(dk, key), _sum_groups(dv, value)

    return call


def _repeat(query, key, value):
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def _sum_groups(grad, like):
    """The gradient of each KV head: the sum over the query heads it was repeated to."""
    b, heads, length, dim = like.shape
    if grad.shape[1] == heads:
        return grad
    return grad.view(b, heads, grad.shape[1] // heads, length, dim).sum(2)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, scale):
        ring = compat.torch_ring_attention()
        forward, backward = _kernels(query)
        with _load_balanced(ring):
            out, lse, *saved = ring._templated_ring_attention(
                group, 2, _grouped(forward), query, key, value, is_causal=True, scale=scale
            )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.step = (ring, group, partial(backward, scale=scale, saved=saved))
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        ring, group, backward = ctx.step
        with _load_balanced(ring):
            dq, dk, dv = ring._templated_ring_attention_backward(
                group, 2, _grouped_backward(backward), grad.contiguous(), "grad_out",
                query, key, value, out, lse, is_causal=True,
            )[:3]  # fmt: skip
        return dq, dk, dv, None, None
