"""Rotary position embeddings of the reference Llama: the frequencies (scaled as the
config's rope_type says), the cos/sin tables and the rotation, in transformers' float32
operations so the tables agree bitwise."""

from __future__ import annotations

import math

import torch

from flatshard.models.kv_cache import positions


def rope_inv_freq(cfg, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2], scaled as `cfg.rope_type` says (the
    same float32 operations as transformers, so the tables agree bitwise)."""
    head_dim = cfg.head_dim
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    inv_freq = 1.0 / cfg.rope_theta ** (steps / head_dim)
    if cfg.rope_type == "default":
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, inv_freq=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] for rotate-half RoPE (`inv_freq`: scaled
    frequencies from `rope_inv_freq`; default plain RoPE with base `theta`).

    Computed on the fly from positions rather than stored in a buffer: it is cheap, and
    it leaves nothing to re-create when the model was built on the meta device.
    """
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        )
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    # Frequencies repeat over the two halves (not interleaved), matching HF's layout.
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by position; cos/sin [T, D] broadcast over batch and heads
    ([B, T, D] with a position per token: packed documents)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def rope_at(cfg, tokens: torch.Tensor, cache, position_ids=None):
    """cos and sin for `tokens` [B, T], at the positions after what `cache` holds (None:
    from 0): [T, head_dim] each; with `position_ids` [B, T], at those: [B, T, head_dim].
    The sequence, seen tokens included, must fit max_seq_len."""
    if position_ids is not None:
        length = int(position_ids.max()) + 1
        if length > cfg.max_seq_len:
            raise ValueError(f"position {length - 1} exceeds max_seq_len ({cfg.max_seq_len})")
        inv_freq = rope_inv_freq(cfg, tokens.device)
        cos, sin = rope_cos_sin(length, cfg.head_dim, cfg.rope_theta, tokens.device, inv_freq)
        return cos[position_ids], sin[position_ids]
    where = positions(cache, tokens.shape[1])
    if where.stop > cfg.max_seq_len:
        raise ValueError(f"sequence length {where.stop} exceeds max_seq_len ({cfg.max_seq_len})")
    inv_freq = rope_inv_freq(cfg, tokens.device)  # rope_type "llama3" rescales it
    cos, sin = rope_cos_sin(where.stop, cfg.head_dim, cfg.rope_theta, tokens.device, inv_freq)
    return cos[where.start :], sin[where.start :]
