"""Instruction and chat data (SFT): the chat template applied as transformers applies it, the
loss only on the assistant's tokens (an exact count), the trainer's first loss equal to
transformers' with the same labels at world 1 and 2, packing, instruction pairs with and
without a chat template. A tiny random model and tokenizer built in the test."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_cli_helpers import check_ok, flatshard, metrics, run_in_process
from tiny_tokenizer import make_llama_dir, make_tokenizer_dir

from flatshard.data.chat import record_ids
from flatshard.data.sequences import IGNORE, RecordOrder, SequenceOrder
from flatshard.data.tokenizer import ModelTokenizer
from flatshard.data.tokens import load_tokens

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And a list in Python?"},
     {"role": "assistant", "content": "A mutable sequence."}],
    [{"role": "user", "content": "Name a fox."},
     {"role": "assistant", "content": "The quick one."}],
    [{"role": "user", "content": "def or class?"}, {"role": "assistant", "content": "def f."}],
    [{"role": "user", "content": "Lazy dog?"}, {"role": "assistant", "content": "It jumps."}],
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with a ChatML tokenizer: (directory, transformers model, tokenizer)."""
    path = tmp_path_factory.mktemp("chat-model")
    model, tokenizer = make_llama_dir(path)
    return path, model, tokenizer


def _chat_file(path, conversations=CONVERSATIONS):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def test_loss_falls_on_the_assistants_tokens_only(model_dir):
    path, _, reference = model_dir
    tokenizer = ModelTokenizer.from_directory(str(path))
    messages = CONVERSATIONS[0]
    ids, mask = record_ids(tokenizer, {"messages": messages}, "test")
    assert ids == list(reference.apply_chat_template(messages)["input_ids"])
    end = reference.convert_tokens_to_ids("<|im_end|>")
    answers = [reference.encode(m["content"]) + [end] + reference.encode("\n")
               for m in messages if m["role"] == "assistant"]  # fmt: skip
    assert sum(mask) == sum(len(a) for a in answers)  # exact: each answer and its end of turn
    labelled = [i for i, keep in zip(ids, mask) if keep]
    assert labelled == [i for a in answers for i in a]


def test_instruction_pairs_with_and_without_a_chat_template(model_dir, tmp_path):
    make_tokenizer_dir(tmp_path / "plain", chat=False)
    plain = ModelTokenizer.from_directory(str(tmp_path / "plain"))
    record = {"prompt": "Name a fox.", "completion": " The quick one."}
    ids, mask = record_ids(plain, record, "test")
    answer = plain.encode(" The quick one.") + [plain.eos_id]
    assert ids == plain.encode("Name a fox.") + answer
    assert mask == [0] * (len(ids) - len(answer)) + [1] * len(answer)
    chat = ModelTokenizer.from_directory(str(model_dir[0]))
    chat_ids, chat_mask = record_ids(chat, record, "test")
    turns = [{"role": "user", "content": record["prompt"]},
             {"role": "assistant", "content": record["completion"]}]  # fmt: skip
    assert chat_ids == chat.chat_ids(turns) and 0 < sum(chat_mask) < len(chat_ids)


def test_packed_and_padded_sequences_keep_the_mask(model_dir, tmp_path):
    path, _, _ = model_dir
    tokenizer = ModelTokenizer.from_directory(str(path))
    data = load_tokens(str(_chat_file(tmp_path / "chat.jsonl")), "auto", "text", "", tokenizer)
    assert data.starts.tolist()[0] == 0 and len(data.starts) == len(CONVERSATIONS)
    padded = RecordOrder(data, 64, 0, tokenizer.eos_id)
    tokens, labels = padded.row(1)
    ids, mask = record_ids(tokenizer, {"messages": CONVERSATIONS[1]}, "test")
    assert tokens[: len(ids)].tolist() == ids and (tokens[len(ids) :] == tokenizer.eos_id).all()
    expected = [i if keep else IGNORE for i, keep in zip(ids[1:], mask[1:])]
    assert labels.tolist() == expected + [IGNORE] * (64 - len(expected))
    packed = SequenceOrder(data.tokens, 16, 0, data.loss_mask)
    window = packed.batch(3, 1)[0].numpy()
    start = next(s for s in range(0, len(data.tokens), 16)
                 if np.array_equal(data.tokens[s : s + 17], window))  # fmt: skip
    keep = np.asarray(data.loss_mask[start + 1 : start + 17], dtype=bool)
    assert packed.labels(3, 1)[0].tolist() == np.where(keep, window[1:], IGNORE).tolist()


def _first_loss(model_dir, tmp_path, nproc: int) -> tuple[float, int]:
    path = model_dir[0]
    data = _chat_file(tmp_path / "chat.jsonl")
    out = tmp_path / f"run{nproc}"
    args = ["train", "--hf", str(path), "--data", str(data), "--nproc", str(nproc),
            "--steps", "1", "--seq-len", "128", "--micro-batch", "1", "--global-batch", "4",
            "--set", f"run.sample_tokens={4 if nproc == 1 else 0}", "--set",
            "run.sample_prompt=Name a fox.", "--out", str(out)]  # fmt: skip
    if nproc == 1:
        assert run_in_process(*args) == 0
    else:
        check_ok(flatshard(*args))
    (record,) = metrics(out)
    if nproc == 1:  # a run on conversations answers its closing prompt as a user's turn
        assert (out / "sample.txt").read_text().startswith("Name a fox.\n-> ")
    return record["loss"], record["loss_tokens"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_first_loss_is_transformers_with_the_same_labels(model_dir, tmp_path, nproc):
    path, model, _ = model_dir
    loss, loss_tokens = _first_loss(model_dir, tmp_path, nproc)
    tokenizer = ModelTokenizer.from_directory(str(path))
    data = load_tokens(str(tmp_path / "chat.jsonl"), "auto", "text", "", tokenizer)
    order = RecordOrder(data, 128, 0, tokenizer.eos_id)
    assert order.truncated == 0
    batch, labels = order.batch(0, 4), order.labels(0, 4)
    full_labels = torch.cat([torch.full((4, 1), IGNORE), labels], dim=1)  # HF shifts them
    with torch.no_grad():
        expected = model.eval()(input_ids=batch, labels=full_labels).loss.item()
    assert loss_tokens == int((labels != IGNORE).sum()) == int(data.loss_mask.sum())
    assert abs(loss - expected) <= 1e-5 * expected
