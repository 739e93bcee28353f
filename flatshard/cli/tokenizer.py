"""Byte-level tokenizer: UTF-8 bytes are tokens 0-255, 256 ends a document."""

from __future__ import annotations


class ByteTokenizer:
    name = "bytes"
    vocab_size = 257
    end_of_text = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        data = bytes(i if i < 256 else 10 for i in ids)  # end of text reads as a new line
        return data.decode("utf-8", errors="replace")


def tokenizer_for(name: str) -> ByteTokenizer | None:
    """The tokenizer a run was trained with ("bytes"), or None for pre-tokenised data."""
    return ByteTokenizer() if name == ByteTokenizer.name else None
