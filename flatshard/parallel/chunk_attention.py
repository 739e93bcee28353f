"""Causal attention of a chunk of queries over the keys up to its end, with no mask.

Context parallelism gives each rank chunks of queries from the middle of the sequence: the
queries at positions [s, s + L) see every key before s and, causally, the L keys of their
own chunk. Attention of the two parts runs on the fused kernel (the first unmasked, the
second causal: a square), and the parts are merged by their log-sum-exps, as ring
attention merges its blocks; backward runs the kernel's backward on each part with the
merged output and log-sum-exp, which gives each part exactly its share of the gradients. No
[L, s + L] mask is ever made: memory stays that of the kernel (a dense mask at 128k tokens
would be gigabytes per layer).

The kernel here is the CPU one (`_scaled_dot_product_flash_attention_for_cpu`); on other
devices the chunk is attended with a lower-right causal mask by torch's SDPA (correct, the
mask's memory included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale=None):
    """query [B, H, L, D] at the last L positions of key/value [B, H, P, D] (P >= L):
    each query sees the keys at or before its position. `scale`: of the scores (None:
    1/sqrt(D), SDPA's)."""
    if query.device.type != "cpu":
        mask = causal_lower_right(query.shape[2], key.shape[2])
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return _ChunkAttention.apply(query, key, value, scale)


def _parts(key: torch.Tensor, value: torch.Tensor, length: int):
    """(keys, values, causal) of each part: the prefix before the chunk, the chunk itself."""
    start = key.shape[2] - length
    parts = [(key[:, :, start:], value[:, :, start:], True)]
    if start:
        parts.insert(0, (key[:, :, :start], value[:, :, :start], False))
    return parts


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale):
        outputs, lses = [], []
        for k, v, causal in _parts(key, value, query.shape[2]):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, k, v, 0.0, causal, scale=scale
            )
            outputs.append(out.float())
            lses.append(lse)
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        merged = sum(out * (part - lse).exp().unsqueeze(-1) for out, part in zip(outputs, lses))
        merged = merged.to(query.dtype)
        ctx.save_for_backward(query, key, value, merged, lse)
        ctx.scale = scale
        return merged

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        grad_query = torch.zeros_like(query)
        grad_keys, grad_values = [], []
        for k, v, causal in _parts(key, value, query.shape[2]):
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad.contiguous(), query, k, v, out, lse, 0.0, causal, scale=ctx.scale
            )
            grad_query += dq
            grad_keys.append(dk)
            grad_values.append(dv)
        return grad_query, torch.cat(grad_keys, dim=2), torch.cat(grad_values, dim=2), None
