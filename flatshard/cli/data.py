"""Training data: a token stream read from text, JSONL or a token memmap, cut into
fixed-length windows that are visited in a seeded random order, epoch after epoch.

The order depends only on (seed, number of windows), and a batch only on its position in
that order, so a resumed run at any world size reads exactly what an uninterrupted run
would have read: the position (sequences consumed so far) is all the state there is.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from flatshard.cli.errors import DataError
from flatshard.cli.tokenizer import ByteTokenizer

MEMMAP_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_CHUNK = 1 << 26  # tokens per chunk when scanning a memmap for its largest id


@dataclass
class TokenData:
    tokens: np.ndarray  # 1-D token ids
    tokenizer: str  # "bytes" or "none" (pre-tokenised)
    vocab_size: int  # smallest vocabulary that holds every token
    source: str  # what was read, for the log


def load_tokens(path: str, data_format: str, text_field: str, pattern: str) -> TokenData:
    """Read the data `data.path` names (the bundled corpus when it is empty)."""
    if not path:
        from flatshard.data import corpus

        text, source = corpus()
        return _byte_data([text], f"bundled corpus: {source}")
    if not os.path.exists(path):
        raise DataError(f"data.path: no such file or directory: {path!r}")
    kind = _format(path, data_format)
    if kind == "text":
        files = _text_files(path, pattern)
        return _byte_data([_read(file) for file in files], f"{path} ({len(files)} text file(s))")
    if os.path.isdir(path):
        raise DataError(f"data.path: {path!r} is a directory; data.format={kind} needs a file")
    if kind == "jsonl":
        return _byte_data(_jsonl_documents(path, text_field), f"{path} (JSONL)")
    return _memmap(path, kind)


def _format(path: str, data_format: str) -> str:
    if data_format != "auto":
        return data_format
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        return "text"
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".npy":
        return "npy"
    if suffix in (".bin", ".u16", ".u32", ".tokens"):
        raise DataError(
            f"data.format: cannot tell the token dtype of {path!r}; set data.format=uint16 or "
            "data.format=uint32"
        )
    return "text"


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise DataError(f"data.path: cannot read {path!r}: {error.strerror}") from None


def _text_files(path: str, pattern: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    matches = glob.glob(os.path.join(path, pattern), recursive=True)
    files = sorted(f for f in matches if os.path.isfile(f))
    if not files:
        raise DataError(f"data.path: no files match data.glob={pattern!r} in {path!r}")
    return files


def _jsonl_documents(path: str, field: str) -> list[bytes]:
    documents = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"data.path: line {number} of {path!r} is not JSON") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise DataError(
                    f"data.path: line {number} of {path!r} has no string field {field!r} "
                    "(set data.text_field)"
                )
            documents.append(record[field].encode("utf-8"))
    return documents


def _byte_data(documents: list[bytes], source: str) -> TokenData:
    tokenizer = ByteTokenizer()
    pieces = []
    for i, document in enumerate(documents):
        if i:
            pieces.append(np.array([tokenizer.end_of_text], dtype=np.uint16))
        pieces.append(np.frombuffer(document, dtype=np.uint8).astype(np.uint16))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
    return TokenData(tokens, tokenizer.name, tokenizer.vocab_size, source)


def _memmap(path: str, kind: str) -> TokenData:
    try:
        if kind == "npy":
            tokens = np.load(path, mmap_mode="r")
        else:
            tokens = np.memmap(path, dtype=MEMMAP_DTYPES[kind], mode="r")
    except (OSError, ValueError) as error:
        raise DataError(f"data.path: cannot map {path!r} as {kind} tokens: {error}") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise DataError(
            f"data.path: {path!r} holds {tokens.dtype} of shape {tokens.shape}; token data "
            "must be a 1-D array of integer ids"
        )
    chunks = range(0, len(tokens), _CHUNK)
    largest = max((int(tokens[i : i + _CHUNK].max()) for i in chunks), default=0)
    if tokens.dtype.kind == "i" and len(tokens) and int(tokens.min()) < 0:
        raise DataError(f"data.path: {path!r} holds negative token ids")
    return TokenData(tokens, "none", largest + 1, f"{path} ({tokens.dtype} tokens)")


class SequenceOrder:
    """Windows of seq_len + 1 tokens (inputs and shifted targets), in a seeded order."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise DataError(
                f"data: {len(tokens)} tokens are too few for one sequence of data.seq_len="
                f"{seq_len} (+1 target); use more data or a shorter data.seq_len"
            )
        self._epoch, self._order = -1, None

    def window(self, position: int) -> np.ndarray:
        """The window at `position` in the endless sequence of epochs."""
        epoch, index = divmod(position, self.windows)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.windows, generator=generator)
        start = int(self._order[index]) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def batch(self, position: int, count: int) -> torch.Tensor:
        """`count` windows from `position` on, as int64 [count, seq_len + 1]."""
        rows = [np.asarray(self.window(position + i), dtype=np.int64) for i in range(count)]
        return torch.from_numpy(np.stack(rows))
