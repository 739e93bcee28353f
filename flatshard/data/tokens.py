"""Training data: a token stream read from text, JSONL (documents, or conversations with a
loss mask) or a token memmap; text through the run's tokenizer (sequences.py cuts it into
sequences). A resumed run at any world size reads exactly what an uninterrupted run would
have read: the position (sequences consumed so far) is all the state there is.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import numpy as np

from flatshard.data.chat import is_chat_record, tokenize_records
from flatshard.data.errors import DataError
from flatshard.data.token_cache import (
    USER_CACHE,
    array_path,
    cached_arrays,
    cached_tokens,
    data_key,
    read_record,
)
from flatshard.data.tokenizer import ByteTokenizer, TokenizerError

MEMMAP_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_CHUNK = 1 << 26  # tokens per chunk when scanning a memmap for its largest id


@dataclass
class TokenData:
    tokens: np.ndarray  # 1-D token ids
    tokenizer: str  # "bytes", "hf:<fingerprint>" or "none" (pre-tokenised, no record)
    vocab_size: int  # smallest vocabulary that holds every token
    source: str  # what was read, for the log
    model_tokenizer: object = None  # the tokenizer object (None for pre-tokenised data)
    loss_mask: np.ndarray | None = None  # chat data: 1 where a token carries loss
    starts: np.ndarray | None = None  # chat data: where each record starts in `tokens`


def load_tokens(
    path: str, data_format: str, text_field: str, pattern: str, tokenizer=None
) -> TokenData:
    """Read the data `data.path` names (the bundled corpus when it is empty), text through
    `tokenizer` (default: bytes); a model's tokenizer tokenises once into a cached file."""
    tokenizer = tokenizer or ByteTokenizer()
    if not path:
        from flatshard.data import corpus

        text, source = corpus()
        return _text_data(tokenizer, "", lambda: [text], f"bundled corpus: {source}", len(text))
    if not os.path.exists(path):
        raise DataError(f"data.path: no such file or directory: {path!r}")
    kind = _format(path, data_format)
    if kind == "text":
        files = _text_files(path, pattern)
        documents = lambda: (_read(file) for file in files)
        size = sum(os.path.getsize(file) for file in files)
        source = f"{path} ({len(files)} text file(s))"
        return _text_data(tokenizer, path, documents, source, size, files, f"text {pattern}")
    if os.path.isdir(path):
        raise DataError(f"data.path: {path!r} is a directory; data.format={kind} needs a file")
    if kind == "jsonl" and is_chat_record(_first_record(path)):
        return _chat_data(tokenizer, path)
    if kind == "jsonl":
        documents = lambda: _jsonl_documents(path, text_field)
        size, how = os.path.getsize(path), f"jsonl {text_field}"
        return _text_data(tokenizer, path, documents, f"{path} (JSONL)", size, [path], how)
    return _memmap(path, kind)


def _text_data(tokenizer, base, documents, source, size, files=(), how="") -> TokenData:
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_data(list(documents()), source)
    key = data_key(files, how) if base else _bundled_key()
    texts = lambda: (d.decode("utf-8", errors="replace") for d in documents())
    base = base or os.path.join(USER_CACHE, "bundled-corpus")
    tokens, token_file, reused = cached_tokens(base, key, tokenizer, texts, size)
    note = "reused" if reused else "written"
    return TokenData(
        tokens, tokenizer.name, tokenizer.vocab_size,
        f"{source}, tokenised by the model's tokenizer ({note}: {token_file})", tokenizer,
    )  # fmt: skip


def _first_record(path: str):
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None  # _records says where
    return None


def _records(path: str):
    """(record, "line N of PATH") of a JSONL file."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"line {number} of {path!r}"
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"data.path: {where} is not JSON") from None
            if not is_chat_record(record):
                raise DataError(
                    f"data.path: {where} is neither a conversation ('messages') nor an "
                    "instruction pair ('prompt' and 'completion') as the first record is"
                )
            yield record, where


def _chat_data(tokenizer, path: str) -> TokenData:
    """Conversations or instruction pairs: ids through the chat template, a loss mask on the
    assistant's tokens, and where each record starts."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32

    def make():
        try:
            tokens, mask, starts = tokenize_records(tokenizer, _records(path), dtype)
        except TokenizerError as error:
            raise DataError(f"data.path: {error}") from None
        return {"tokens": tokens, "loss_mask": mask, "starts": starts}

    arrays, token_file, reused = cached_arrays(path, data_key([path], "chat"), tokenizer, make)
    note = "reused" if reused else "written"
    count, targets = len(arrays["starts"]), int(np.asarray(arrays["loss_mask"]).sum())
    return TokenData(
        arrays["tokens"], tokenizer.name, tokenizer.vocab_size,
        f"{path} ({count:,} conversations, {targets:,} assistant tokens; chat template of the "
        f"model's tokenizer, {note}: {token_file})", tokenizer,
        loss_mask=arrays["loss_mask"], starts=arrays["starts"],
    )  # fmt: skip


def _bundled_key() -> str:
    import sys

    return "bundled corpus of Python " + ".".join(map(str, sys.version_info[:3]))


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
            documents.append(record[field].encode("utf-8"))  # as text files are read
    return documents


def _byte_data(documents: list[bytes], source: str) -> TokenData:
    tokenizer = ByteTokenizer()
    pieces = []
    for i, document in enumerate(documents):
        if i:
            pieces.append(np.array([tokenizer.eos_id], dtype=np.uint16))
        pieces.append(np.frombuffer(document, dtype=np.uint8).astype(np.uint16))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
    return TokenData(tokens, tokenizer.name, tokenizer.vocab_size, source, tokenizer)


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
    record = read_record(path)  # a token file flatshard wrote records its tokenizer
    name = record["tokenizer"] if record else "none"
    chat = {}
    if record and "loss_mask" in record.get("arrays", ()):  # chat data: its mask and starts
        chat = {k: np.load(array_path(path, k), mmap_mode="r") for k in ("loss_mask", "starts")}
    return TokenData(tokens, name, largest + 1, f"{path} ({tokens.dtype} tokens)", **chat)
