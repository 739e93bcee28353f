"""What a checkpoint of a Hugging Face model keeps besides the weights, so that its export is
a complete model directory: the source's config.json (metadata fields included) and
generation_config.json, and the tokenizer's files (with the ids that end a generated answer).
Kept as JSON text: a checkpoint flattens a dict into its keys."""

from __future__ import annotations

import json
from pathlib import Path

from flatshard import hf
from flatshard.data.tokenizer import ModelTokenizer, has_tokenizer


def hf_records(source: str | Path) -> dict[str, str]:
    """config.json and generation_config.json of the model directory `source`."""
    source = Path(source)
    kept = {"hf_config": json.dumps(hf.read_hf_config(source))}
    generation = source / "generation_config.json"
    if generation.is_file():
        kept["hf_generation_config"] = generation.read_text()
    return kept


def tokenizer_records(tokenizer) -> dict[str, str]:
    """A model tokenizer's files and stop ids (nothing for bytes or pre-tokenised data)."""
    if not isinstance(tokenizer, ModelTokenizer):
        return {}
    return {
        "tokenizer": tokenizer.name,
        "tokenizer_files": tokenizer.record(),
        "tokenizer_stop_ids": json.dumps(tokenizer.stop_record()),
    }


def source_tokenizer_records(source: str | Path) -> dict[str, str]:
    """The tokenizer records of a model directory that has a tokenizer."""
    if not has_tokenizer(str(source)):
        return {}
    return tokenizer_records(ModelTokenizer.from_directory(str(source)))


def checkpoint_records(data, model_hf: str) -> dict[str, str]:
    """What a `flatshard train` checkpoint keeps besides the weights: the name of the
    tokenizer its data was made with (a model's own: its files too) and, for a Hugging Face
    model, its config.json and generation_config.json."""
    records = {"tokenizer": data.tokenizer, **tokenizer_records(data.model_tokenizer)}
    return {**records, **(hf_records(model_hf) if model_hf else {})}
