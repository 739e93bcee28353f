"""Tokenizers a run trains with: flatshard's byte tokenizer (the reference Llama's, for the
bundled corpus and any text it is given) or a Hugging Face model's own (transformers'
`AutoTokenizer` on a directory with `tokenizer.json` and its config).

A tokenizer has a `name` that says which one it is ("bytes", or "hf:" and a fingerprint of
its files), so token files, checkpoints and runs can tell whether ids came from the same one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

from flatshard.errors import FlatShardError

# The files that make up a Hugging Face tokenizer (whichever of them a directory has).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip
BYTES = "bytes"


class TokenizerError(FlatShardError, ValueError):
    """A tokenizer cannot be read or does not fit the data or the model."""


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; 256 ends a document."""

    name = BYTES
    vocab_size = 257
    eos_id = 256
    bos_id = None
    stop_ids = frozenset()  # a sample reads on across documents (256 prints as a new line)
    has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        data = bytes(i if i < 256 else 10 for i in ids)  # end of text reads as a new line
        return data.decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def chat_ids(self, messages, add_generation_prompt: bool = False) -> list[int]:
        raise TokenizerError(
            "the byte tokenizer has no chat template: conversations ('messages') need a model's "
            "tokenizer (data.tokenizer=DIR or --hf); instruction pairs ('prompt', 'completion') "
            "work with bytes"
        )


def has_tokenizer(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "tokenizer.json")) or os.path.isfile(
        os.path.join(directory, "tokenizer.model")
    )


def tokenizer_files(directory: str) -> dict[str, bytes]:
    """The tokenizer files of a directory, by name."""
    found = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as handle:
                found[name] = handle.read()
    return found


def fingerprint(files: dict[str, bytes]) -> str:
    """A name for the tokenizer these files make: equal files, equal name."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return "hf:" + digest.hexdigest()[:16]


class ModelTokenizer:
    """A Hugging Face model's tokenizer (transformers' AutoTokenizer), read from its files."""

    has_chat_template: bool

    def __init__(self, files: dict[str, bytes], source: str, stop_ids: tuple[int, ...] = ()):
        try:
            import transformers
        except ImportError:
            raise TokenizerError(
                f"reading the tokenizer of {source} needs transformers (pip install transformers)"
            ) from None
        if "tokenizer.json" not in files and "tokenizer.model" not in files:
            raise TokenizerError(f"{source} has no tokenizer.json (nor tokenizer.model)")
        self.files, self.source, self.name = files, source, fingerprint(files)
        with tempfile.TemporaryDirectory() as folder:  # the very files that were fingerprinted
            for name, data in files.items():
                with open(os.path.join(folder, name), "wb") as handle:
                    handle.write(data)
            try:
                self.hf = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
            except (OSError, ValueError, TypeError) as error:
                message = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise TokenizerError(f"cannot read the tokenizer of {source}: {message}") from None
        self.vocab_size = len(self.hf)
        self.eos_id = self.hf.eos_token_id
        if self.eos_id is None:
            raise TokenizerError(
                f"the tokenizer of {source} has no end-of-text token (eos_token): documents "
                "could not be told apart"
            )
        # the BOS the tokenizer puts before a text of its own accord (Llama 2/3 do, GPT-2 not)
        plain, special = self.encode("a"), self.hf("a")["input_ids"]
        bos = self.hf.bos_token_id
        self.bos_id = bos if bos is not None and special[: -len(plain)] == [bos] else None
        self.stop_ids = frozenset({self.eos_id, *stop_ids})
        self.has_chat_template = bool(self.hf.chat_template)

    @classmethod
    def from_directory(cls, directory: str) -> ModelTokenizer:
        """The tokenizer of a model directory; its generation_config.json's eos_token_id(s)
        also end a generated answer (an instruct model's end of turn)."""
        files = tokenizer_files(directory)
        if not files:
            raise TokenizerError(f"{directory!r} holds no tokenizer files (tokenizer.json)")
        return cls(files, repr(directory), _generation_stop_ids(directory))

    def encode(self, text: str) -> list[int]:
        """Ids of `text` alone: no BOS or EOS added."""
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """`messages` through the model's chat template, as transformers applies it."""
        if not self.has_chat_template:
            raise TokenizerError(
                f"the tokenizer of {self.source} has no chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template): chat data needs one"
            )
        ids = self.hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def record(self) -> str:
        """What a checkpoint keeps of it: its files, as JSON text (latin-1 holds any bytes)."""
        return json.dumps({name: data.decode("latin-1") for name, data in self.files.items()})

    def stop_record(self) -> list[int]:
        return sorted(self.stop_ids)


def _generation_stop_ids(directory: str) -> tuple[int, ...]:
    path = os.path.join(directory, "generation_config.json")
    try:
        with open(path) as handle:
            eos = json.load(handle).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    eos = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in eos if isinstance(i, int))


def tokenizer_from_record(name: str, files_json: str | None, stop_ids=()):
    """The tokenizer a checkpoint recorded: bytes, an HF tokenizer from its saved files, or
    None (pre-tokenised data: no tokenizer)."""
    if name == BYTES:
        return ByteTokenizer()
    if files_json:
        files = {k: v.encode("latin-1") for k, v in json.loads(files_json).items()}
        return ModelTokenizer(files, "the checkpoint", tuple(stop_ids or ()))
    return None


def load_tokenizer(choice: str, model_dir: str = ""):
    """The tokenizer `data.tokenizer` names: "bytes", a directory with tokenizer files, or
    "auto": the Hugging Face model's own (`model_dir`), else bytes."""
    if choice == BYTES:
        return ByteTokenizer()
    if choice != "auto":
        if not os.path.isdir(choice):
            raise TokenizerError(
                f"data.tokenizer {choice!r} is neither 'auto', 'bytes' nor a directory with "
                "tokenizer files"
            )
        return ModelTokenizer.from_directory(choice)
    if not model_dir:
        return ByteTokenizer()
    if not has_tokenizer(model_dir):
        raise TokenizerError(
            f"model.hf {model_dir!r} has no tokenizer (tokenizer.json): its text data cannot "
            "be tokenised as the model was trained. Copy the model's tokenizer files there or "
            "name them with data.tokenizer=DIR (data.tokenizer=bytes trains on raw bytes on "
            "purpose)"
        )
    return ModelTokenizer.from_directory(model_dir)
