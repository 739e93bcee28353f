"""What a forward leaves for backward, per token, under each activation memory mode
(`parallelize(activation_checkpointing=...)`, `flatshard train --ac`): the planner's model.

Each layer's saved bytes are counted twice: all of them (no checkpointing) and the part
selective checkpointing keeps (the outputs of matrix products, attention and collectives;
flatshard/api/activation_checkpointing.py). A checkpointed block also keeps its input. The head
(final norm, logits, loss) is never checkpointed.

The peak is the larger of two moments. At the start of backward the head's backward runs on
top of everything saved. Once it is done its tensors are gone, and a block's backward holds
its activations (recomputed where checkpointed) and their gradients, about 3/8 as many
bytes again at any one time (37% measured on the tiny Llama). The head dominates real
models (4 fp32 copies of the vocabulary per token); on small ones the block moment can win.

- none: every layer's activations and the head's (the first moment always wins);
- full: every block's input, and then the head's or one block's recomputed activations;
- selective: what every block kept, and then the head's or one block's recomputed remainder;
- offload: the last block's activations (kept on the device: its backward comes first) with
  the head's, or one block's with the next one's, fetched back from the host meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MODES = ("none", "full", "selective", "offload")
FP32 = 4  # bytes of an fp32 element; main weights are kept in fp32


@dataclass(frozen=True)
class Saved:
    """Bytes per token: all that a piece of a layer saves, and what selective AC keeps; of
    each, the part tensor parallelism splits over its ranks (heads, hidden units: `by_tp`)
    and the part sequence parallelism splits (norms, the residual stream: `by_sp`)."""

    all: int
    kept: int = 0
    by_tp: tuple[int, int] = (0, 0)  # (all, kept)
    by_sp: tuple[int, int] = (0, 0)

    def __add__(self, other: Saved) -> Saved:
        return Saved(self.all + other.all, self.kept + other.kept,
                     _plus(self.by_tp, other.by_tp), _plus(self.by_sp, other.by_sp))  # fmt: skip

    def __rmul__(self, count: int) -> Saved:
        return Saved(count * self.all, count * self.kept, _times(count, self.by_tp),
                     _times(count, self.by_sp))  # fmt: skip

    def on_rank(self, tp: int, sp: bool) -> Saved:
        """What one of `tp` ranks saves (`sp`: with sequence parallelism)."""
        parts = [self.by_tp] + ([self.by_sp] if sp else [])
        less = [sum(part[i] - part[i] // tp for part in parts) for i in (0, 1)]
        return Saved(self.all - less[0], self.kept - less[1])

    @staticmethod
    def split_by_tp(all: int, kept: int = 0) -> Saved:
        return Saved(all, kept, by_tp=(all, kept))

    @staticmethod
    def split_by_sp(all: int, kept: int = 0) -> Saved:
        return Saved(all, kept, by_sp=(all, kept))


def _plus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _times(count: int, a: tuple[int, int]) -> tuple[int, int]:
    return count * a[0], count * a[1]


@dataclass(frozen=True)
class Activations:
    """A model's activation bytes per token: its layer kinds (count, saved), the bytes of a
    block's input, and the head's."""

    layers: tuple[tuple[int, Saved], ...]
    block_input: int
    head: int
    head_norm: int = 0  # of the head's bytes, the final norm's (sequence parallelism splits it)
    # of the head's bytes, what only the loss's backward holds (the log-softmax's and the
    # logits' gradients): once, however many micro-batches a pipeline stage keeps
    head_transient: int = 0

    def on_rank(self, tp: int, sp: bool) -> Activations:
        """What one of `tp` tensor-parallel ranks saves: attention heads and hidden units
        split; with `sp` also the norms, the residual stream and the blocks' inputs. The
        logits stay whole (the head's output is gathered for the loss)."""
        if tp == 1:
            return self
        layers = tuple((count, saved.on_rank(tp, sp)) for count, saved in self.layers)
        if not sp:
            return replace(self, layers=layers)
        head = self.head - self.head_norm + self.head_norm // tp
        return replace(self, layers=layers, block_input=self.block_input // tp, head=head,
                       head_norm=self.head_norm // tp)  # fmt: skip

    def per_token(self, mode: str = "none") -> int:
        if mode not in MODES:
            raise ValueError(f"activation mode {mode!r}: use one of {', '.join(MODES)}")
        blocks = sum(count for count, _ in self.layers)
        largest = max(saved.all for _, saved in self.layers)
        backward = largest * 3 // 8  # a block's activation gradients, at any one time
        if mode == "none":
            return sum(count * saved.all for count, saved in self.layers) + self.head
        if mode == "full":
            return blocks * self.block_input + max(self.head, largest + backward)
        if mode == "offload":
            fetched = largest if blocks > 1 else 0
            return max(self.head + largest, largest + fetched + backward)
        kept = sum(count * saved.kept for count, saved in self.layers)
        remainder = max(saved.all - saved.kept for _, saved in self.layers)
        return blocks * self.block_input + kept + max(self.head, remainder + backward)


# --- the bytes of each piece of a layer, per token (a: the compute dtype's size) ----------


def norm_bytes(dim: int, a: int) -> Saved:
    # RMSNorm keeps its fp32 input (a copy under bf16) and its normalised output; selective
    # AC recomputes it
    return Saved.split_by_sp(FP32 * dim + a * dim)


def head_bytes(dim: int, vocab: int, a: int) -> int:
    # the final norm's; the logits, and while the loss's backward runs three fp32 copies of
    # the vocabulary: the log-softmax it saved, its gradient and the logits' gradient
    # (measured: 16 bytes per vocabulary entry in fp32, 14 in bf16)
    return norm_bytes(dim, a).all + a * vocab + 3 * FP32 * vocab


def attention_bytes(
    heads: int, kv_heads: int, head_dim: int, qk_norm: bool, a: int, grouped_kv: bool = False
) -> Saved:
    # SDPA keeps q, k, v (kv repeated to all heads, or `grouped_kv`: as the KV heads, where
    # the kernel reads them grouped: Setup.kv_grouped), its output and logsumexp; o_proj its
    # input. Selective AC keeps the q, k, v projections' outputs and SDPA's output and
    # logsumexp, and recomputes RoPE (and the head norms)
    kv = kv_heads if grouped_kv else heads
    saved = Saved.split_by_tp(
        a * (3 * heads + 2 * kv) * head_dim + FP32 * heads,
        a * (2 * heads + 2 * kv_heads) * head_dim + FP32 * heads,
    )
    if qk_norm:  # per-head q and k norms: split with the heads
        saved += Saved.split_by_tp(norm_bytes((heads + kv_heads) * head_dim, a).all)
    return saved


def swiglu_bytes(ffn: int, a: int) -> Saved:
    # gate|up output, silu(gate), their product; selective AC keeps the first
    return Saved.split_by_tp(a * 4 * ffn, a * 2 * ffn)


def projection_outputs(dim: int, a: int) -> Saved:
    # o_proj's and down_proj's outputs: only selective AC keeps them (matrix products)
    return Saved.split_by_sp(0, 2 * a * dim)


def layer_activations(layers, dim: int, vocab: int, a: int) -> Activations:
    kinds = tuple((count, saved) for count, saved in layers if count)
    return Activations(kinds, a * dim, head_bytes(dim, vocab, a), norm_bytes(dim, a).all,
                       head_transient=2 * FP32 * vocab)  # fmt: skip
