"""How a run cuts its data into sequences, in a seeded order that depends only on (seed,
number of sequences), so a batch depends only on its position: windows of seq_len + 1
tokens over the token stream (inputs and shifted targets), or one padded record per
sequence for chat data. With a loss mask, `labels` gives the targets that carry loss; chat
data packed into windows gives each token its position in its conversation (`positions`),
so the model attends within conversations only."""

from __future__ import annotations

import numpy as np
import torch

from flatshard.data.errors import DataError
from flatshard.data.tokens import TokenData

IGNORE = -100  # a label that carries no loss (torch's cross_entropy ignore_index)


class EpochOrder:
    """Positions 0, 1, 2, ... of an endless sequence of epochs, each a seeded permutation
    of `count` items: `index(position)` is the item at that position."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._epoch, self._order = -1, None

    def index(self, position: int) -> int:
        epoch, index = divmod(position, self.count)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.count, generator=generator)
        return int(self._order[index])


class SequenceOrder:
    """Windows of seq_len + 1 tokens (inputs and shifted targets), in a seeded order. With a
    loss mask (chat data packed into windows), `labels` masks the targets that carry none."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, loss_mask=None, starts=None):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.loss_mask = loss_mask
        # packed documents (chat records): where each starts, for per-document positions
        self.starts = None if starts is None else np.asarray(starts, dtype=np.int64)
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise DataError(
                f"data: {len(tokens)} tokens are too few for one sequence of data.seq_len="
                f"{seq_len} (+1 target); use more data or a shorter data.seq_len"
            )
        self.order = EpochOrder(self.windows, seed)

    def _start(self, position: int) -> int:
        return self.order.index(position) * self.seq_len

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Window `index` in data order (not shuffled): (tokens, labels or None)."""
        start = index * self.seq_len
        tokens = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if self.loss_mask is None:
            return tokens, None
        keep = np.asarray(self.loss_mask[start + 1 : start + self.seq_len + 1], dtype=bool)
        return tokens, np.where(keep, tokens[1:], IGNORE)

    def row_positions(self, index: int) -> np.ndarray | None:
        """The position ids of window `index`'s inputs (see `positions`)."""
        return self._positions(index * self.seq_len)

    def positions(self, position: int, count: int) -> torch.Tensor | None:
        """The inputs' position ids of `batch(position, count)` [count, seq_len] with packed
        documents: each token's offset from the start of its document (or of the window, for
        one that began before it), so a model attends within documents only. None: one
        stream of text, positions 0..seq_len-1."""
        if self.starts is None:
            return None
        rows = [self._positions(self._start(position + i)) for i in range(count)]
        return torch.from_numpy(np.stack(rows))

    def _positions(self, start: int) -> np.ndarray | None:
        if self.starts is None:
            return None
        where = np.arange(start, start + self.seq_len, dtype=np.int64)
        document = self.starts[np.maximum(np.searchsorted(self.starts, where, "right") - 1, 0)]
        return where - np.maximum(document, start)

    def window(self, position: int) -> np.ndarray:
        """The window at `position` in the endless sequence of epochs."""
        start = self._start(position)
        return self.tokens[start : start + self.seq_len + 1]

    def batch(self, position: int, count: int) -> torch.Tensor:
        """`count` windows from `position` on, as int64 [count, seq_len + 1]."""
        rows = [np.asarray(self.window(position + i), dtype=np.int64) for i in range(count)]
        return torch.from_numpy(np.stack(rows))

    def labels(self, position: int, count: int) -> torch.Tensor | None:
        """The targets of `batch(position, count)` [count, seq_len], IGNORE where the mask
        says no loss (None: every target counts)."""
        if self.loss_mask is None:
            return None
        rows = []
        for i in range(count):
            start = self._start(position + i) + 1
            targets = np.asarray(self.tokens[start : start + self.seq_len], dtype=np.int64)
            keep = np.asarray(self.loss_mask[start : start + self.seq_len], dtype=bool)
            rows.append(np.where(keep, targets, IGNORE))
        return torch.from_numpy(np.stack(rows))


class RecordOrder:
    """One chat record per sequence, in a seeded order: its first seq_len + 1 tokens, padded
    after its end (with the end-of-text id; padded targets carry no loss), so no sequence
    attends across records. The same interface as SequenceOrder."""

    def __init__(self, data: TokenData, seq_len: int, seed: int, pad_id: int):
        self.tokens, self.loss_mask, self.seq_len, self.seed = (
            data.tokens,
            data.loss_mask,
            seq_len,
            seed,
        )
        self.pad_id = pad_id
        self.bounds = np.append(np.asarray(data.starts, dtype=np.int64), len(data.tokens))
        self.windows = len(self.bounds) - 1
        if self.windows < 1:
            raise DataError("data: no conversation in the data")
        lengths = np.diff(self.bounds)
        self.truncated = int((lengths > seq_len + 1).sum())
        self.order = EpochOrder(self.windows, seed)

    def _row(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        return self._record(self.order.index(position))

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Record `index` in data order: (tokens, labels)."""
        tokens, keep = self._record(index)
        return tokens, np.where(keep[1:], tokens[1:], IGNORE)

    def _record(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start = int(self.bounds[index])
        end = min(int(self.bounds[index + 1]), start + self.seq_len + 1)
        tokens = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        keep = np.zeros(self.seq_len + 1, dtype=bool)
        tokens[: end - start] = self.tokens[start:end]
        keep[: end - start] = np.asarray(self.loss_mask[start:end], dtype=bool)
        return tokens, keep

    def batch(self, position: int, count: int) -> torch.Tensor:
        return torch.from_numpy(np.stack([self._row(position + i)[0] for i in range(count)]))

    def positions(self, position: int, count: int) -> None:
        return None  # one record per sequence: plain positions

    def row_positions(self, index: int) -> None:
        return None

    def labels(self, position: int, count: int) -> torch.Tensor:
        rows = []
        for i in range(count):
            tokens, keep = self._row(position + i)
            rows.append(np.where(keep[1:], tokens[1:], IGNORE))
        return torch.from_numpy(np.stack(rows))


def sequence_order(data: TokenData, seq_len: int, seed: int, pack: bool):
    """How a run cuts its data into sequences: windows over the token stream, or for chat
    data (unless `pack`) one padded record per sequence."""
    if data.starts is not None and not pack:
        pad = getattr(data.model_tokenizer, "eos_id", 0)
        return RecordOrder(data, seq_len, seed, pad)
    return SequenceOrder(data.tokens, seq_len, seed, data.loss_mask, data.starts)
