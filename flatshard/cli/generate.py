"""Sampling text from a model, sharded (every rank runs the same forward passes and rank 0's
choice of each token is broadcast) or plain in one process."""

from __future__ import annotations

import inspect
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from flatshard import comm
from flatshard.cli import runs
from flatshard.models import KVCache


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    *,
    new_tokens: int,
    max_seq_len: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    device: torch.device | str = "cpu",
    cache: bool = True,
    progress=None,
    stop_ids=frozenset(),
    sharded: bool | None = None,
) -> list[int]:
    """`new_tokens` token ids following `prompt` (which must not be empty), fewer when one
    of `stop_ids` (an end of text or of turn) comes: it ends the list. `cache`: feed each
    new token alone against the keys and values kept of the others (the same tokens as
    without; greedy ones bitwise up to float rounding). `progress(ids)`: after each token,
    with the new ids so far. `sharded` (default: a process group of more than one rank):
    every rank of the group runs the model and takes rank 0's choice of each token."""
    generator = torch.Generator().manual_seed(seed)
    if sharded is None:
        sharded = dist.is_initialized() and dist.get_world_size() > 1
    feeder = _Feeder(model, max_seq_len, device, cache)
    ids = list(prompt)
    for _ in range(new_tokens):
        logits = feeder.next_logits(ids)
        chosen = torch.tensor([_choose(logits, temperature, top_k, generator)])
        if sharded:  # rounding may differ across ranks: rank 0's choice is everyone's
            chosen = chosen.to(comm.group_device(None))
            dist.broadcast(chosen, src=0)
        ids.append(int(chosen.item()))
        if progress is not None:
            progress(ids[len(prompt) :])
        if ids[-1] in stop_ids:
            break
    return ids[len(prompt) :]


def generate_with_progress(
    model, prompt: list[int], *, is_main: bool, stream=None, **options
) -> list[int]:
    """`generate` with, on rank 0, the text streamed as it comes (`stream`: a
    `TextStream`) or else a progress bar on its terminal, and after it the tokens and how
    long they took (on stderr)."""
    show = is_main and stream is None and sys.stderr.isatty()
    bar = tqdm(
        total=options["new_tokens"], desc="sampling", unit="token", leave=False, disable=not show
    )
    started = time.perf_counter()

    def progress(new: list[int]) -> None:
        bar.update(1)
        if is_main and stream is not None:
            stream.show(new)

    new = generate(model, prompt, progress=progress, **options)
    bar.close()
    if is_main:
        if stream is not None:
            stream.end()
        seconds = time.perf_counter() - started
        rate = len(new) / max(seconds, 1e-9)
        print(f"{len(new)} tokens in {seconds:.1f} s ({rate:,.1f} tokens/s)", file=sys.stderr)
    return new


class TextStream:
    """Prints generated text as it comes: each time the text decoded so far has grown, the
    part not yet printed (a character that needs several tokens waits for them all)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out, self.shown = tokenizer, out or sys.stdout, ""

    def show(self, new: list[int]) -> None:
        shown = [i for i in new if i not in self.tokenizer.stop_ids]
        text = self.tokenizer.decode(shown)
        if text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest
            return
        self.out.write(text[len(self.shown) :])
        self.out.flush()
        self.shown = text

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


PLAIN_SAMPLE_PARAMS = 2_000_000_000  # the closing sample gathers a model this small on rank 0


class _Feeder:
    """Feeds the model what it has not seen: flatshard's models keep a `KVCache`,
    transformers' their past_key_values. Once the text outgrows max_seq_len the window of
    the last max_seq_len tokens moves with every token and is fed whole, as without a cache
    (its positions start at 0 again)."""

    def __init__(self, model, max_seq_len: int, device, cache: bool):
        accepted = inspect.signature(model.forward).parameters
        self.kind = None
        if cache and "cache" in accepted:
            self.kind = "flatshard"
        elif cache and "past_key_values" in accepted:
            self.kind = "transformers"
        self.model, self.max_seq_len, self.device = model, max_seq_len, device
        self.state, self.seen = None, 0

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        if self.kind is not None and self.seen and len(ids) <= self.max_seq_len:
            fed = ids[self.seen :]
        else:  # the first token, no cache, or a window that moved: the whole window
            self.state = KVCache() if self.kind == "flatshard" else None
            fed = ids[-self.max_seq_len :]
        tokens = torch.tensor([fed], dtype=torch.long, device=self.device)
        if self.kind == "flatshard":
            output = self.model(tokens, cache=self.state)
        elif self.kind == "transformers":
            output = self.model(tokens, past_key_values=self.state, use_cache=True)
            self.state = output.past_key_values
        else:
            output = self.model(tokens)
        self.seen = len(ids) if len(ids) < self.max_seq_len else 0
        return getattr(output, "logits", output)[0, -1].float().cpu()  # transformers: .logits


def _choose(logits: torch.Tensor, temperature: float, top_k: int, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        threshold = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))


def sample_at_end(
    model, tokenizer, config, max_seq_len, ranks, run_dir: str, chat: bool = False
) -> None:
    """`flatshard train`'s closing sample: up to `run.sample_tokens` tokens after
    `run.sample_prompt` (with `chat`, a run on conversations: the prompt as a user's turn
    through the chat template, and the answer), printed and written to the run directory
    by rank 0 (nothing for pre-tokenised data, which has no text). `max_seq_len` None:
    `data.seq_len` (a Hugging Face model: what it was trained on). A model of up to
    `PLAIN_SAMPLE_PARAMS` is gathered into one plain copy on rank 0, which samples alone on
    every core (no collective per token) while the others wait; a larger one samples
    sharded on every rank."""
    if tokenizer is None:
        return
    prompt = config.run.sample_prompt
    options = dict(
        new_tokens=config.run.sample_tokens, max_seq_len=max_seq_len or config.data.seq_len,
        seed=config.train.seed, stop_ids=tokenizer.stop_ids,
    )  # fmt: skip
    chat = chat and tokenizer.has_chat_template
    ids = prompt_ids(tokenizer, prompt, chat=chat)  # else: text trained on, its continuation
    if sum(p.numel() for p in model.parameters()) <= PLAIN_SAMPLE_PARAMS:
        from flatshard.cli.model import plain_copy

        plain = plain_copy(model, to_rank=0)
        if ranks.is_main:
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or threads)
            new = generate_with_progress(
                plain, ids, is_main=True, device="cpu", sharded=False, **options
            )
            torch.set_num_threads(threads)
        del plain
        dist.barrier()
    else:
        new = generate_with_progress(model, ids, is_main=ranks.is_main, device=ranks.device,
                                     **options)  # fmt: skip
    if ranks.is_main:
        text = (f"{prompt}\n-> " if chat else prompt) + answer_text(tokenizer, new)
        with open(os.path.join(run_dir, runs.SAMPLE), "w") as handle:
            handle.write(text + "\n")
        print(f"sample:\n{text}", flush=True)


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """A prompt's ids: a user's turn through the chat template (with the assistant's turn
    begun), or the text itself after the tokenizer's BOS (its end of text if it is empty)."""
    if chat:
        return tokenizer.chat_ids([{"role": "user", "content": prompt}], add_generation_prompt=True)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    return (bos + tokenizer.encode(prompt)) or [tokenizer.eos_id]


def answer_text(tokenizer, new: list[int]) -> str:
    """Generated ids as text, without the token that stopped them."""
    if new and new[-1] in tokenizer.stop_ids:
        new = new[:-1]
    return tokenizer.decode(new)
