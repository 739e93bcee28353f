"""Instruction and chat records (SFT): token ids with a mask of the tokens that carry loss.

A JSONL record is a conversation, `{"messages": [{"role": ..., "content": ...}, ...]}`, or an
instruction pair, `{"prompt": ..., "completion": ...}` (a user's turn and the assistant's
answer where the tokenizer has a chat template; else the prompt's text followed by the
completion's and the end of text). The ids are what the model's chat template makes of the
whole conversation, as transformers applies it; the loss falls on each assistant turn's
tokens only: the ids the template adds for that turn after the prompt that asks for it
(`add_generation_prompt`), its end-of-turn token included.
"""

from __future__ import annotations

import numpy as np

from flatshard.data.tokenizer import TokenizerError

ROLES = ("system", "user", "assistant", "tool")


def is_chat_record(record: object) -> bool:
    """Whether a JSONL record is a conversation or an instruction pair."""
    return isinstance(record, dict) and (
        "messages" in record or ("prompt" in record and "completion" in record)
    )


def record_ids(tokenizer, record: dict, where: str) -> tuple[list[int], list[int]]:
    """(ids, loss mask: 1 where the token is one the model learns to say) of one record;
    `where` names it in errors ("line 3 of data.jsonl")."""
    if "messages" in record:
        return conversation_ids(tokenizer, _messages(record["messages"], where), where)
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise TokenizerError(f"{where}: 'prompt' and 'completion' must be strings")
    if tokenizer.has_chat_template:
        turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return conversation_ids(tokenizer, turns, where)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    asked = bos + tokenizer.encode(prompt)
    answer = tokenizer.encode(completion) + [tokenizer.eos_id]
    return asked + answer, [0] * len(asked) + [1] * len(answer)


def _messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise TokenizerError(f"{where}: 'messages' must be a non-empty list of turns")
    for turn in messages:
        if not (isinstance(turn, dict) and turn.get("role") in ROLES
                and isinstance(turn.get("content"), str)):  # fmt: skip
            raise TokenizerError(
                f"{where}: each turn needs a 'role' ({', '.join(ROLES)}) and a string "
                f"'content'; got {turn!r:.80}"
            )
    if not any(turn["role"] == "assistant" for turn in messages):
        raise TokenizerError(f"{where}: no assistant turn, so nothing to learn from it")
    return messages


def conversation_ids(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    ids = tokenizer.chat_ids(messages)
    mask = [0] * len(ids)
    for index, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        asked = tokenizer.chat_ids(messages[:index], add_generation_prompt=True) if index else []
        answered = tokenizer.chat_ids(messages[: index + 1])
        if ids[: len(answered)] != answered or answered[: len(asked)] != asked:
            raise TokenizerError(
                f"{where}: the chat template renders the conversation's start differently "
                "once later turns follow, so the assistant's tokens cannot be told apart"
            )
        mask[len(asked) : len(answered)] = [1] * (len(answered) - len(asked))
    return ids, mask


def tokenize_records(tokenizer, records, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, loss mask, start of each record) of (record, where) pairs, concatenated."""
    ids, mask, starts = [], [], []
    total = 0
    for record, where in records:
        record_tokens, record_mask = record_ids(tokenizer, record, where)
        starts.append(total)
        total += len(record_tokens)
        ids.append(np.asarray(record_tokens, dtype=dtype))
        mask.append(np.asarray(record_mask, dtype=np.uint8))
    if not ids:
        return np.zeros(0, dtype), np.zeros(0, np.uint8), np.zeros(0, np.int64)
    return np.concatenate(ids), np.concatenate(mask), np.asarray(starts, dtype=np.int64)
