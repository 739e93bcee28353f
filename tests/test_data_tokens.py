"""Text through a model's own tokenizer: documents joined with its EOS (after its BOS where
it adds one), tokenised once into a cached token file that is reused and invalidated, long
texts cut where the ids stay the same; token ids that cannot be the model's are refused;
a fine-tune's defaults; config.json metadata never stops an import. Tiny tokenizers built
in the test (tiny_tokenizer.py), no processes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from tiny_tokenizer import make_tokenizer_dir  # noqa: E402

from flatshard.cli import config as run_config  # noqa: E402
from flatshard.cli.errors import DataError  # noqa: E402
from flatshard.cli.run_data import open_run_data  # noqa: E402
from flatshard.data import corpus, token_cache  # noqa: E402
from flatshard.data.tokenizer import ModelTokenizer, TokenizerError  # noqa: E402
from flatshard.data.tokens import load_tokens  # noqa: E402
from flatshard.hf import HFConfigError  # noqa: E402
from flatshard.models.llama import hf_to_config  # noqa: E402

DOCUMENTS = ["The quick brown fox.", "A class is defined with class.", "Paris, France."]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(directory, transformers tokenizer) of a tokenizer without and one with a BOS."""
    root = tmp_path_factory.mktemp("tokenizers")
    plain = make_tokenizer_dir(root / "plain")
    with_bos = make_tokenizer_dir(root / "bos", bos=True)
    return {"plain": (root / "plain", plain), "bos": (root / "bos", with_bos)}


def _jsonl(path, documents):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return path


@pytest.mark.parametrize("kind", ["plain", "bos"])
def test_documents_are_joined_with_eos_after_the_tokenizers_bos(tokenizers, tmp_path, kind):
    folder, reference = tokenizers[kind]
    tokenizer = ModelTokenizer.from_directory(str(folder))
    data = load_tokens(str(_jsonl(tmp_path / "d.jsonl", DOCUMENTS)), "auto", "text", "", tokenizer)
    expected = []
    for index, document in enumerate(DOCUMENTS):
        if index:
            expected.append(reference.eos_token_id)
        expected += reference(document)["input_ids"]  # its own BOS, if it adds one
    assert data.tokens.tolist() == expected
    assert data.tokenizer == tokenizer.name and data.vocab_size == len(reference)
    assert (tokenizer.bos_id is not None) == (kind == "bos")


def test_the_token_cache_is_reused_and_invalidated(tokenizers, tmp_path):
    tokenizer = ModelTokenizer.from_directory(str(tokenizers["plain"][0]))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps.\n")
    first = load_tokens(str(text), "auto", "text", "", tokenizer)
    cached = token_cache.cache_file(str(text), tokenizer.name)
    assert "written" in first.source and os.path.dirname(cached) == str(tmp_path)
    written = os.stat(cached).st_mtime_ns
    again = load_tokens(str(text), "auto", "text", "", tokenizer)
    assert "reused" in again.source and os.stat(cached).st_mtime_ns == written
    assert again.tokens.tolist() == first.tokens.tolist()
    # a changed file is tokenised anew (its size and time changed)
    text.write_text("Paris is the capital of France, said the lazy dog.\n")
    changed = load_tokens(str(text), "auto", "text", "", tokenizer)
    assert "written" in changed.source
    assert changed.tokens.tolist() == tokenizer.encode(text.read_text())
    # another tokenizer has a file of its own beside it
    other = ModelTokenizer.from_directory(str(tokenizers["bos"][0]))
    assert token_cache.cache_file(str(text), other.name) != cached


def test_a_long_text_cut_at_lines_gives_the_ids_of_the_whole(tokenizers, monkeypatch):
    tokenizer = ModelTokenizer.from_directory(str(tokenizers["plain"][0]))
    text = corpus()[0].decode()[:20_000]
    monkeypatch.setattr(token_cache, "PIECE_CHARS", 500)
    pieces = token_cache.split_at_lines(text, 500)
    assert len(pieces) > 20 and "".join(pieces) == text
    assert token_cache.cuts_at_lines_exactly(tokenizer)
    tokens = token_cache.tokenize_documents(tokenizer, [text])
    assert tokens.tolist() == tokenizer.encode(text)


def _config(**values):
    return run_config.build(overrides=[f"{k.replace('__', '.')}={v}" for k, v in values.items()])


def _model_dir(path, tokenizer_from=None):
    path.mkdir()
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32)  # fmt: skip
    (path / "config.json").write_text(config.to_json_string())
    if tokenizer_from is not None:
        for name in os.listdir(tokenizer_from):
            (path / name).write_bytes((tokenizer_from / name).read_bytes())
    return path


def test_tokens_that_cannot_be_the_models_are_refused(tokenizers, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox.\n" * 50)
    # a model without a tokenizer: its text would silently be bytes
    bare = _model_dir(tmp_path / "bare")
    with pytest.raises(TokenizerError, match="has no tokenizer.*data.tokenizer=DIR"):
        open_run_data(_config(model__hf=bare, data__path=text))
    bytes_run = open_run_data(_config(model__hf=bare, data__path=text, data__tokenizer="bytes"))
    assert bytes_run.train.tokenizer == "bytes"  # named on purpose
    # a token file another tokenizer made
    model = _model_dir(tmp_path / "model", tokenizer_from=tokenizers["plain"][0])
    made = open_run_data(_config(model__hf=model, data__path=text)).train
    assert made.model_tokenizer is not None and "written" in made.source
    token_file = token_cache.cache_file(str(text), made.tokenizer)
    other = _model_dir(tmp_path / "other", tokenizer_from=tokenizers["bos"][0])
    with pytest.raises(DataError, match="made by hf:.*Pass the text itself"):
        open_run_data(_config(model__hf=other, data__path=token_file))
    reused = open_run_data(_config(model__hf=model, data__path=token_file)).train
    assert np.array_equal(reused.tokens, made.tokens) and reused.model_tokenizer is not None


def test_a_held_out_fraction_is_the_last_whole_sequences(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("abcdefghij" * 100)  # 1000 byte tokens: 62 windows of 16
    data = open_run_data(_config(data__path=text, data__seq_len=16, data__eval=0.1))
    assert len(data.eval.tokens) == 6 * 16 + 8 and len(data.train.tokens) == 56 * 16 + 1
    assert data.train.tokens[-1] == data.eval.tokens[0]  # the last target is the first input


def test_a_fine_tune_takes_fine_tuning_defaults(tmp_path):
    model = _model_dir(tmp_path / "model")
    tuned = _config(model__hf=model, train__steps=100)
    assert (tuned.train.lr, tuned.train.min_lr, tuned.train.warmup_steps) == (2e-5, 2e-6, 3)
    assert tuned.train.weight_decay == 0.0
    given = _config(model__hf=model, train__lr=1e-4, train__warmup_steps=0)
    assert (given.train.lr, given.train.min_lr, given.train.warmup_steps) == (1e-4, 1e-5, 0)
    scratch = _config()
    assert (scratch.train.lr, scratch.train.warmup_steps) == (3e-3, 15)


def test_config_metadata_never_stops_an_import():
    config = json.loads(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, num_attention_heads=2
        ).to_json_string()
    )
    config.update(architectures=["LlamaForCausalLM"], _model_name_or_path="Smollm2 135M",
                  unk_token_id=0, gguf_version="3")  # fmt: skip
    assert hf_to_config(config).vocab_size == 64
    with pytest.raises(HFConfigError, match="'sliding_scale'"):
        hf_to_config({**config, "sliding_scale": 2})


def test_the_chat_template_is_applied_as_transformers_applies_it(tokenizers):
    folder, reference = tokenizers["plain"]
    tokenizer = ModelTokenizer.from_directory(str(folder))
    messages = [{"role": "user", "content": "What is the capital?"},
                {"role": "assistant", "content": "Paris."}]  # fmt: skip
    for prompt in (False, True):
        expected = reference.apply_chat_template(messages, add_generation_prompt=prompt)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert tokenizer.chat_ids(messages, add_generation_prompt=prompt) == list(expected)
