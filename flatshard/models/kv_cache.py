"""Keys and values of the tokens a model has seen, per layer, so generation feeds each new
token alone (flatshard's Llama and MoE families: `model(tokens, cache=KVCache())`).

A layer's entry grows by what each call adds (RoPE already applied, before the grouped
heads are repeated); `length` is where the next call's positions start.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for generation one token at a
    time: `model(tokens, cache=KVCache())` feeds only the new tokens."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0  # tokens seen: the next call's first position

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """The layer's keys and values [B, heads, T, D] with these appended along T."""
        if layer in self.keys:
            keys = torch.cat([self.keys[layer], keys], dim=2)
            values = torch.cat([self.values[layer], values], dim=2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def attention_mask(self, new: int, total: int, device) -> torch.Tensor | None:
        """Which of `total` keys each of `new` queries (the last ones) may attend to: None
        where is_causal says it (no earlier tokens) or all of them (one new token)."""
        if new == total or new == 1:
            return None
        return torch.ones(new, total, dtype=torch.bool, device=device).tril(total - new)


def positions(cache: KVCache | None, new: int) -> range:
    """The positions of `new` tokens fed after what `cache` holds."""
    start = 0 if cache is None else cache.length
    return range(start, start + new)
