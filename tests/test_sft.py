"""Instruction and chat data (SFT): the chat template applied as transformers applies it, the
loss only on the assistant's tokens (an exact count), the trainer's first loss equal to
transformers' with the same labels at world 1 and 2, packing (each conversation attends only
to itself: the packed loss is the sum of the conversations' own), instruction pairs with and
without a chat template. A tiny random model and tokenizer built in the test."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_cli_helpers import check_ok, flatshard, metrics, run_in_process
from tiny_tokenizer import make_llama_dir, make_tokenizer_dir

from flatshard.cli.evaluation import Evaluation
from flatshard.data.chat import record_ids
from flatshard.data.sequences import IGNORE, RecordOrder, SequenceOrder
from flatshard.data.tokenizer import ModelTokenizer
from flatshard.data.tokens import load_tokens
from flatshard.models.llama import Llama, LlamaConfig
from flatshard.models.moe import MoE, MoEConfig
from flatshard.models.registry import next_token_loss

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


def _pieces(positions: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) of each document of a packed row: where its positions restart."""
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    return list(zip(starts, starts[1:]))


def _separate_loss(model, tokens, labels, positions) -> float:
    """The summed loss of packed rows computed document by document, each alone."""
    total = 0.0
    with torch.no_grad():
        for row in range(len(tokens)):
            for start, end in _pieces(positions[row]):
                piece = tokens[row : row + 1, start : end + 1]
                total += next_token_loss(model, piece, labels=labels[row : row + 1, start:end],
                                         divisor=1.0).item()  # fmt: skip
    return total


def test_packed_windows_give_each_token_its_place_in_its_conversation(model_dir, tmp_path):
    tokenizer = ModelTokenizer.from_directory(str(model_dir[0]))
    data = load_tokens(str(_chat_file(tmp_path / "chat.jsonl")), "auto", "text", "", tokenizer)
    packed = SequenceOrder(data.tokens, 16, 0, data.loss_mask, data.starts)
    starts = set(data.starts.tolist())
    for index in range(packed.windows):
        positions = packed.row_positions(index)
        expected, offset = [], 0
        for token in range(index * 16, index * 16 + 16):
            offset = 0 if token in starts or token == index * 16 else offset + 1
            expected.append(offset)
        assert positions.tolist() == expected
    assert SequenceOrder(data.tokens, 16, 0, data.loss_mask).positions(0, 2) is None
    assert RecordOrder(data, 64, 0, tokenizer.eos_id).positions(0, 2) is None


@pytest.mark.parametrize("family", ["llama", "moe", "transformers"])
def test_packed_documents_do_not_attend_to_each_other(model_dir, family):
    """The loss of a packed row with restarting positions equals the sum of its documents'
    losses computed one by one: flatshard's models and a transformers model."""
    sizes = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                 max_seq_len=64)  # fmt: skip
    torch.manual_seed(0)
    if family == "llama":
        model = Llama(LlamaConfig(**sizes))
    elif family == "moe":
        model = MoE(MoEConfig(**sizes, n_experts=4, top_k=2, expert_ffn_dim=32))
    else:
        model = model_dir[1]
    vocab = 64 if family != "transformers" else model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 21))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2],
                              list(range(4)) + list(range(16))])  # fmt: skip
    labels = tokens[:, 1:].clone()
    labels[0, 5] = labels[1, 3] = IGNORE  # a document's last target: the next one's start
    with torch.no_grad():
        packed = next_token_loss(model, tokens, labels=labels, divisor=1.0, position_ids=positions)
        separate = _separate_loss(model, tokens, labels, positions)
        plain = next_token_loss(model, tokens, labels=labels, divisor=1.0).item()
    error, crossed = abs(packed.item() - separate), abs(plain - separate)
    assert error <= 1e-6 * separate
    assert crossed > 100 * error  # without positions they do attend across documents


def test_packed_conversations_train_and_evaluate_each_on_its_own(tmp_path):
    """data.pack=true: the trainer's first loss and the evaluation's loss are the sums of
    each conversation's own (transformers, one at a time) over the labelled tokens. Larger
    initial weights than the default sharpen attention, so attending across conversations
    would change the loss by about 2%."""
    path = tmp_path / "model"
    model, _ = make_llama_dir(path, initializer_range=0.3)
    data_file = _chat_file(tmp_path / "chat.jsonl", CONVERSATIONS * 2)
    out = tmp_path / "run"
    assert run_in_process(
        "train", "--hf", str(path), "--data", str(data_file), "--nproc", "1", "--steps", "1",
        "--seq-len", "32", "--micro-batch", "2", "--global-batch", "4", "--set", "data.pack=true",
        "--set", "run.sample_tokens=0", "--out", str(out),
    ) == 0  # fmt: skip
    (record,) = metrics(out)
    tokenizer = ModelTokenizer.from_directory(str(path))
    data = load_tokens(str(data_file), "auto", "text", "", tokenizer)
    order = SequenceOrder(data.tokens, 32, 0, data.loss_mask, data.starts)
    batch, labels, positions = order.batch(0, 4), order.labels(0, 4), order.positions(0, 4)
    assert (positions == 0).sum() > 4  # the windows do pack several conversations
    labelled = int((labels != IGNORE).sum())
    expected = _separate_loss(model.eval(), batch, labels, positions) / labelled
    with torch.no_grad():
        crossing = next_token_loss(model, batch, labels=labels, divisor=labelled).item()
    assert abs(crossing - expected) > 1e-3 * expected  # the check below can tell
    assert record["loss_tokens"] == labelled
    assert abs(record["loss"] - expected) <= 1e-5 * expected

    evaluation = Evaluation(order, max_sequences=0)  # every window, in data order
    result = evaluation.run(model, micro_batch=2, dp_rank=0, dp_world=1, device=torch.device("cpu"))
    rows = [order.row(i) for i in range(order.windows)]
    tokens = torch.from_numpy(np.stack([t for t, _ in rows]))
    targets = torch.from_numpy(np.stack([t for _, t in rows]))
    row_positions = [order.row_positions(i) for i in range(order.windows)]
    row_positions = torch.from_numpy(np.stack(row_positions))
    count = int((targets != IGNORE).sum())
    expected = _separate_loss(model, tokens, targets, row_positions) / count
    assert result["eval_tokens"] == count
    assert abs(result["eval_loss"] - expected) <= 1e-5 * expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_packed_conversations_through_pipeline_stages(tmp_path, family):
    """data.pack=true under --pp 2: every stage takes the rows' position ids, so each
    conversation attends only to itself there too, and training and evaluation have the
    losses of the run without a pipeline (flatshard's Llama; Phi-3, a transformers model
    whose stages take them as transformers' forward does). Attending across conversations
    changes the loss by about 2% (the test above)."""
    path = tmp_path / "model"
    if family == "llama":
        make_llama_dir(path, initializer_range=0.3)
    else:
        tokenizer = make_tokenizer_dir(path)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.3, pad_token_id=0,
        )).float().save_pretrained(path)  # fmt: skip
    data_file = _chat_file(tmp_path / "chat.jsonl", CONVERSATIONS * 4)
    run = ["train", "--hf", path, "--data", data_file, "--steps", 2, "--seq-len", 32,
           "--micro-batch", 1, "--global-batch", 4, "--set", "data.pack=true",
           "--set", "data.eval=0.25", "--set", "train.eval_interval=2",
           "--set", "run.sample_tokens=0"]  # fmt: skip
    check_ok(flatshard(*run, "--nproc", 2, "--pp", 2, "--out", tmp_path / "piped"))
    check_ok(flatshard(*run, "--nproc", 1, "--out", tmp_path / "straight"))
    piped, straight = metrics(tmp_path / "piped"), metrics(tmp_path / "straight")
    for key in ("loss", "eval_loss"):
        ours = [r[key] for r in piped if key in r]
        theirs = [r[key] for r in straight if key in r]
        assert len(ours) == len(theirs) >= 1
        assert ours == pytest.approx(theirs, rel=1e-5), key
