"""A Llama-style decoder used as flatshard's reference model.

The module and parameter names are the checkpoint keys, so keep them stable. The layout
follows Hugging Face's Llama/Qwen2/Qwen3 closely enough that their weights load by a
name mapping alone: RoPE uses the rotate-half convention (no permutation of q/k rows),
and the only structural difference is that gate_proj and up_proj are fused into one
`gate_up_proj` whose weight is [gate; up] stacked along dim 0.

Initialisation contract (the meta-device materialisation relies on it): every random
draw happens inside a leaf module's own `reset_parameters()`, which its constructor
calls, in construction order, and construction order equals `modules()` order. Nothing
else touches the RNG, and weight tying happens only after every submodule exists. So
building on the meta device, allocating each module's tensors and calling
`reset_parameters()` in `modules()` order reproduces an eager construction exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flatshard.comm import devices
from flatshard.models.llama.rope import apply_rope, rope_at

# GPT-style init scale. nn.Embedding's default N(0, 1) would give huge logits once the
# embedding is tied to lm_head, so every weight matrix uses the same small normal init.
INIT_STD = 0.02
"""The standard deviation of every weight matrix's normal init (GPT-style)."""


@dataclass(kw_only=True)
class LlamaConfig:
    """Sizes and options of a Llama-style decoder.

    `n_kv_heads` defaults to `n_heads` (plain multi-head attention) and `head_dim` to
    `dim // n_heads`; both are filled in by `__post_init__`, so after construction they
    are always ints.

    RoPE: `rope_type` "default" rotates by `rope_theta` alone; "llama3" (Llama 3.1-3.3)
    also rescales the frequencies: wavelengths longer than `rope_original_max_seq_len /
    rope_low_freq_factor` are divided by `rope_factor`, shorter than `.../
    rope_high_freq_factor` kept, and those between interpolated smoothly.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_positive_int("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}): each kv head serves a whole group of query heads"
            )
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); "
                    "set head_dim explicitly"
                )
            self.head_dim = self.dim // self.n_heads
        check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs of halves"
            )
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type must be 'default' or 'llama3', got {self.rope_type!r}")
        if self.rope_type == "default":
            return
        if not self.rope_factor >= 1.0:
            raise ValueError(
                f"rope_factor must be >= 1 (it divides frequencies), got {self.rope_factor}"
            )
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"rope_low_freq_factor ({self.rope_low_freq_factor}) must be > 0 and below "
                f"rope_high_freq_factor ({self.rope_high_freq_factor})"
            )
        check_positive_int("rope_original_max_seq_len", self.rope_original_max_seq_len)

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """A model small enough for unit tests.

        Row counts are deliberately mixed (vocab 61 is prime, gate_up has 90 rows, q has
        32, k/v 16) so that sharding tests meet rows that do not split evenly.
        """
        # head_dim is left out so that it follows dim and n_heads when those are overridden.
        defaults = dict(
            vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=45, max_seq_len=64
        )
        return cls(**{**defaults, **overrides})

    def num_params(self) -> int:
        """Number of distinct parameters of `Llama(self)` (a tied lm_head counts once)."""
        hd, h, kv, d = self.head_dim, self.n_heads, self.n_kv_heads, self.dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.attention_bias:
            attn += h * hd + 2 * kv * hd
        if self.qk_norm:
            attn += 2 * hd
        mlp = d * 2 * self.ffn_dim + self.ffn_dim * d
        block = attn + mlp + 2 * d  # two RMSNorm weights
        total = self.vocab_size * d + self.n_layers * block + d
        if not self.tie_embeddings:
            total += self.vocab_size * d
        return total


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class Linear(nn.Linear):
    """nn.Linear with a GPT-style init: weight ~ N(0, INIT_STD), bias zero."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding with weight ~ N(0, INIT_STD) (no padding row in this model)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 like HF."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 for accuracy under bf16, cast back, then scale: the same
        # order of operations as HF, so fp32 results agree to rounding.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE (and optional Qwen-style extras)."""

    # set by context parallelism (flatshard/parallel/context_parallel.py): this rank holds
    # part of the sequence and attends over the keys and values of every rank
    context_parallel = None

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.attention_bias  # Qwen2: bias on q, k, v only, never on o
        self.q_proj = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k_proj = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Qwen3: per-head RMSNorm on q and k, shared across heads, applied before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None, layer: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`mask` [B, 1, T, T] (True: attend), for packed documents: in place of causal."""
        b, t, _ = x.shape
        # heads from the projections' widths (-1), not the config: under tensor
        # parallelism each rank's projections hold its share of the heads
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # -> [B, heads, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.context_parallel is not None:  # the sequence split over ranks: causal
            out = self.context_parallel.attention(q, k, v)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        if cache is not None:  # generation: attend to every token seen so far
            k, v = cache.extend(layer, k, v)
            mask = cache.attention_mask(t, k.shape[2], x.device)
        grouped = q.shape[1] != k.shape[1]  # query head i reads kv head i // group
        as_grouped = grouped and devices.attends_grouped_kv(q, k, mask)
        if grouped and not as_grouped:  # (the kernels that take no groups)
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # a Python bool: compiled for a second sequence length, the lengths are symbols whose
        # comparison SDPA refuses; without a cache queries and keys are the same tokens
        causal = mask is None and (cache is None or q.shape[2] == k.shape[2])
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=as_grouped
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused."""

    def __init__(self, cfg: LlamaConfig, ffn_dim: int | None = None) -> None:
        super().__init__()
        # ffn_dim overrides cfg.ffn_dim (an MoE model's shared experts are one such MLP)
        ffn_dim = cfg.ffn_dim if ffn_dim is None else ffn_dim
        # One matmul instead of two; its weight is [gate; up] along dim 0, gate first.
        self.gate_up_proj = Linear(cfg.dim, 2 * ffn_dim, bias=False)
        # Declares how the fused weight splits into the unfused checkpoint tensors:
        # {param name: ((component name, rows), ...)} in dim-0 order. Component names are
        # relative to the parent MLP module (HF's `mlp.gate_proj.weight`, ...).
        self.gate_up_proj.fused_components = {
            "weight": (("gate_proj.weight", ffn_dim), ("up_proj.weight", ffn_dim)),
        }
        self.down_proj = Linear(ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None, layer: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        args, kwargs = attention_extras(cache, layer, mask)
        h = x + self.attn(self.attn_norm(x), cos, sin, *args, **kwargs)
        return h + self.mlp(self.mlp_norm(h))


def indexed_layers(layers: nn.Module):
    """(index in the whole model, block): a pipeline stage keeps its blocks under their
    indices (`flatshard.api.pipeline_split.StageBlocks`), so their names (and checkpoints)
    stay those of the whole model."""
    indices = getattr(layers, "indices", None)
    return list(zip(indices, layers)) if indices is not None else list(enumerate(layers))


def attention_extras(cache, layer: int, mask) -> tuple[tuple, dict]:
    """What a block and its attention take after (x, cos, sin), as (args, kwargs): the cache
    only when generating, a mask (by keyword) only for packed documents, so a TP style on
    `attn` still sees (x, cos, sin) and the default path stays as it was."""
    if cache is not None and mask is not None:
        raise ValueError("a KV cache (generation) and position_ids (packed documents) do not mix")
    return (() if cache is None else (cache, layer)), ({} if mask is None else {"mask": mask})


def attention_mask(model: nn.Module, position_ids: torch.Tensor | None):
    """What a model's attention is masked by: None (causal) without positions and under
    context parallelism (its attention knows each chunk's place); else packed documents'."""
    if getattr(model, "context_parallel", None) is not None:
        if position_ids is None:
            raise ValueError(
                "context parallelism: each rank holds part of the sequence, so the model "
                "needs its tokens' position_ids (flatshard.parallel.split_sequence gives both)"
            )
        return None
    return None if position_ids is None else document_mask(position_ids)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool, True where a token may attend: earlier tokens of its own document.
    A document starts where a position does not follow the one before (as transformers reads
    packed position ids), so packed documents never attend to each other."""
    first = position_ids[:, :1] - 1
    document = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal).unsqueeze(1)


def stage_positions(model: nn.Module, tokens: torch.Tensor, position_ids):
    """`position_ids`, or a pipeline stage's under context parallelism (it takes none: its
    tokens are the CP split's, at the positions of this rank's part)."""
    context = getattr(model, "context_parallel", None)
    if context is not None and position_ids is None and getattr(model, "pipeline_stage", 0):
        return context.positions(tokens.shape[0], tokens.shape[1], tokens.device)
    return position_ids


class Llama(nn.Module):
    """Decoder-only language model: tokens [B, T] -> logits [B, T, vocab_size]."""

    # the decoder layers, named as transformers names them (flatshard.hf.shard_decoder_layers)
    _no_split_modules = ("TransformerBlock",)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        # Submodules are assigned in the order they are built: modules() order must equal
        # construction (and so RNG) order for meta-device replay to match.
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # lm_head draws its own (discarded) init even when tied, so the RNG stream is the
        # same with tying on or off, and replay can re-run it on a throwaway copy.
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # Only after every submodule exists: tying is not part of any reset.
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, cache=None, position_ids=None) -> torch.Tensor:
        """`cache` (a `flatshard.models.KVCache`): `tokens` follow what it holds, and their
        keys and values join it (generation feeds each new token alone). `position_ids`
        [B, T] (as transformers takes them): each token's position in its document; where
        they restart, a new document begins that attends only to itself (packed data)."""
        position_ids = stage_positions(self, tokens, position_ids)
        cos, sin = rope_at(self.config, tokens, cache, position_ids)
        mask = attention_mask(self, position_ids)
        # a pipeline stage (flatshard.parallel.pipeline) holds some of the parts: a later
        # stage takes the previous one's hidden states, an earlier one returns its own
        h = tokens if self.embed_tokens is None else self.embed_tokens(tokens)
        for index, layer in indexed_layers(self.layers):
            args, kwargs = attention_extras(cache, index, mask)
            h = layer(h, cos, sin, *args, **kwargs)
        if cache is not None:
            cache.length += tokens.shape[1]
        return h if self.lm_head is None else self.lm_head(self.norm(h))
