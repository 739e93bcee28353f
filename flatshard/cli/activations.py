"""What a forward leaves for backward, per token, under each activation memory mode
(`parallelize(activation_checkpointing=...)`, `flatshard train --ac`): the planner's model.

Each layer's saved bytes are counted twice: all of them (no checkpointing) and the part
selective checkpointing keeps (the outputs of matrix products, attention and collectives;
flatshard/activation_checkpointing.py). A checkpointed block also keeps its input. The head
(final norm, logits, loss) is never checkpointed. At the peak, backward has reached a block:

- none: every layer's activations and the head's;
- full: every block's input, the head's, and one block's activations recomputed;
- selective: what every block kept, the head's, and one block's recomputed remainder;
- offload: the head's, the last block's (kept on the device: its backward comes first) and
  one more block's, fetched back from the host while the one after it runs backward.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("none", "full", "selective", "offload")


@dataclass(frozen=True)
class Saved:
    """Bytes per token: all that a piece of a layer saves, and what selective AC keeps."""

    all: int
    kept: int = 0

    def __add__(self, other: Saved) -> Saved:
        return Saved(self.all + other.all, self.kept + other.kept)

    def __rmul__(self, count: int) -> Saved:
        return Saved(count * self.all, count * self.kept)


@dataclass(frozen=True)
class Activations:
    """A model's activation bytes per token: its layer kinds (count, saved), the bytes of a
    block's input, and the head's."""

    layers: tuple[tuple[int, Saved], ...]
    block_input: int
    head: int

    def per_token(self, mode: str = "none") -> int:
        if mode not in MODES:
            raise ValueError(f"activation mode {mode!r}: use one of {', '.join(MODES)}")
        blocks = sum(count for count, _ in self.layers)
        if mode == "none":
            return sum(count * saved.all for count, saved in self.layers) + self.head
        if mode == "full":
            recomputed = max(saved.all for _, saved in self.layers)
            return blocks * self.block_input + self.head + recomputed
        if mode == "offload":
            return self.head + min(blocks, 2) * max(saved.all for _, saved in self.layers)
        kept = sum(count * saved.kept for count, saved in self.layers)
        recomputed = max(saved.all - saved.kept for _, saved in self.layers)
        return blocks * self.block_input + kept + self.head + recomputed
