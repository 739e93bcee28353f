"""Text tokenised once: a token file beside the data (`NAME.<tokenizer>.tokens.npy`) with a
record (`.tokens.json`) of which tokenizer made it from which data. A run whose data and
tokenizer match the record maps the file; any change of either writes it anew. Where the
data's folder is not writable (the bundled corpus, a read-only mount) the file goes to
`~/.cache/flatshard/tokens/` instead.

Documents are joined with the tokenizer's end-of-text id (each preceded by its BOS where the
tokenizer adds one). Long documents are cut at line starts into pieces tokenised in batches
(with a progress bar on a terminal) where the tokenizer gives the same ids that way, which a
probe checks; otherwise each is tokenised whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable

import numpy as np
from tqdm import tqdm

PIECE_CHARS = 1 << 20  # characters per piece of a long document
BATCH_PIECES = 16  # pieces per call of the tokenizer
USER_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "flatshard", "tokens")


def record_path(token_file: str) -> str:
    """The record beside a token file (`X.tokens.npy` -> `X.tokens.json`)."""
    return os.path.splitext(token_file)[0] + ".json"


def read_record(token_file: str) -> dict | None:
    """The record of a token file flatshard wrote, or None (a file of the user's own)."""
    try:
        with open(record_path(token_file)) as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "tokenizer" in record else None


def data_key(files: Iterable[str], how: str) -> str:
    """What the cache is keyed by besides the tokenizer: each file's path, size and
    modification time (a changed file changes them), and how it was read."""
    digest = hashlib.sha256(how.encode())
    for path in files:
        stat = os.stat(path)
        digest.update(f"\0{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def cache_file(base: str, tokenizer_name: str) -> str:
    """Where the tokens of the data at `base` go: beside it when its folder is writable."""
    tag = tokenizer_name.replace(":", "-")
    folder, name = os.path.split(os.path.abspath(base))
    if folder == USER_CACHE:
        os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK):
        digest = hashlib.sha256(os.path.abspath(base).encode()).hexdigest()[:8]
        folder, name = USER_CACHE, f"{name}-{digest}"
    return os.path.join(folder, f"{name}.{tag}.tokens.npy")


def cached_tokens(
    base: str, key: str, tokenizer, documents: Callable[[], Iterable[str]], size_hint: int
) -> tuple[np.ndarray, str, bool]:
    """(tokens, token file, reused) of the data at `base` (`key`: data_key) as `tokenizer`
    makes them; `documents()` yields the texts (called only when the file is made)."""
    make = lambda: {"tokens": tokenize_documents(tokenizer, documents(), size_hint)}
    arrays, path, reused = cached_arrays(base, key, tokenizer, make)
    return arrays["tokens"], path, reused


def cached_arrays(
    base: str, key: str, tokenizer, make: Callable[[], dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], str, bool]:
    """(arrays, token file, reused): `make()`'s arrays ("tokens" and any others of the same
    data, such as a loss mask) from the cache, or made and cached."""
    path = cache_file(base, tokenizer.name)
    record = read_record(path)
    if record and record.get("data") == key and record.get("tokenizer") == tokenizer.name:
        arrays = _load(path, record.get("arrays", ["tokens"]))
        if arrays is not None and len(arrays["tokens"]) == record.get("tokens"):
            return arrays, path, True
    arrays = make()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for name, array in arrays.items():
        target = array_path(path, name)
        partial = f"{target}.{os.getpid()}.partial"
        with open(partial, "wb") as handle:
            np.save(handle, array)
        os.replace(partial, target)  # a reader sees the old file or the whole new one
    _write_json(record_path(path), {
        "tokenizer": tokenizer.name, "data": key, "tokens": int(len(arrays["tokens"])),
        "vocab_size": tokenizer.vocab_size, "source": os.path.abspath(base),
        "arrays": sorted(arrays),
    })  # fmt: skip
    return _load(path, sorted(arrays)), path, False


def array_path(token_file: str, name: str) -> str:
    """Where an array beside the tokens goes (`X.tokens.npy` -> `X.loss_mask.npy`)."""
    return token_file if name == "tokens" else token_file[: -len("tokens.npy")] + name + ".npy"


def _load(path: str, names) -> dict[str, np.ndarray] | None:
    try:
        return {name: np.load(array_path(path, name), mmap_mode="r") for name in names}
    except (OSError, ValueError):
        return None


def _write_json(path: str, value: dict) -> None:
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as handle:
        json.dump(value, handle, indent=1)
    os.replace(partial, path)


def tokenize_documents(tokenizer, documents: Iterable[str], size_hint: int = 0) -> np.ndarray:
    """Every document's ids, documents joined by end-of-text (a BOS before each where the
    tokenizer adds one), as the smallest unsigned dtype that holds the vocabulary."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    separable = cuts_at_lines_exactly(tokenizer)
    bar = tqdm(
        total=size_hint, unit="B", unit_scale=True, desc="tokenising", leave=False,
        disable=size_hint < 4 * PIECE_CHARS or not sys.stderr.isatty(),
    )  # fmt: skip
    out: list[np.ndarray] = []
    for index, document in enumerate(documents):
        if index:
            out.append(np.array([tokenizer.eos_id], dtype=dtype))
        if tokenizer.bos_id is not None:
            out.append(np.array([tokenizer.bos_id], dtype=dtype))
        pieces = split_at_lines(document) if separable else [document]
        for start in range(0, len(pieces), BATCH_PIECES):
            batch = pieces[start : start + BATCH_PIECES]
            for ids in tokenizer.encode_batch(batch):
                out.append(np.asarray(ids, dtype=dtype))
            bar.update(sum(len(piece) for piece in batch))
    bar.close()
    return np.concatenate(out) if out else np.zeros(0, dtype=dtype)


def split_at_lines(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`text` in pieces of about `piece_chars`, each cut after a single line break between
    two characters that are not white space (where byte-level BPE's pre-tokenizer splits
    anyway; a run of white space may be one token)."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        cut = start + piece_chars
        while cut < len(text) and not _clean_line_start(text, cut):
            cut += 1
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return [piece for piece in pieces if piece]


def _clean_line_start(text: str, at: int) -> bool:
    return text[at - 1] == "\n" and not text[at - 2].isspace() and not text[at].isspace()


_PROBE = "The end.\nNext line, said she.\n\nA new paragraph:\n  indented\nlast"


def cuts_at_lines_exactly(tokenizer) -> bool:
    """Whether tokenising a text cut at line starts gives the ids of the whole text."""
    whole = tokenizer.encode(_PROBE)
    pieces = split_at_lines(_PROBE, piece_chars=1)
    return [i for ids in tokenizer.encode_batch(pieces) for i in ids] == whole
