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
from flatshard.cli.tokenizer import tokenizer_for
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
) -> list[int]:
    """`new_tokens` token ids following `prompt` (which must not be empty). `cache`: feed
    each new token alone against the keys and values kept of the others (the same tokens as
    without; greedy ones bitwise up to float rounding). `progress(done)`: after each token."""
    generator = torch.Generator().manual_seed(seed)
    sharded = dist.is_initialized() and dist.get_world_size() > 1
    feeder = _Feeder(model, max_seq_len, device, cache)
    ids = list(prompt)
    for done in range(1, new_tokens + 1):
        logits = feeder.next_logits(ids)
        chosen = torch.tensor([_choose(logits, temperature, top_k, generator)])
        if sharded:  # rounding may differ across ranks: rank 0's choice is everyone's
            chosen = chosen.to(comm.group_device(None))
            dist.broadcast(chosen, src=0)
        ids.append(int(chosen.item()))
        if progress is not None:
            progress(done)
    return ids[len(prompt) :]


def generate_with_progress(model, prompt: list[int], *, is_main: bool, **options) -> list[int]:
    """`generate` with a progress bar on rank 0's terminal and, after it, the tokens and
    how long they took (on stderr: a sample of a sharded model can take a while)."""
    bar = tqdm(
        total=options["new_tokens"], desc="sampling", unit="token", leave=False,
        disable=not (is_main and sys.stderr.isatty()),
    )  # fmt: skip
    started = time.perf_counter()
    new = generate(model, prompt, progress=lambda done: bar.update(1), **options)
    bar.close()
    if is_main:
        seconds = time.perf_counter() - started
        rate = len(new) / max(seconds, 1e-9)
        print(f"{len(new)} tokens in {seconds:.1f} s ({rate:,.0f} tokens/s)", file=sys.stderr)
    return new


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


def sample_at_end(model, tokenizer_name, config, max_seq_len, ranks, run_dir: str) -> None:
    """`flatshard train`'s closing sample: `run.sample_tokens` tokens after
    `run.sample_prompt`, printed and written to the run directory by rank 0 (nothing for
    pre-tokenised data, which has no text). `max_seq_len` None: `data.seq_len` (a Hugging
    Face model: what it was trained on)."""
    tokenizer = tokenizer_for(tokenizer_name)
    if tokenizer is None:
        return
    prompt = config.run.sample_prompt
    ids = tokenizer.encode(prompt) or [tokenizer.end_of_text]
    new = generate_with_progress(
        model,
        ids,
        is_main=ranks.is_main,
        new_tokens=config.run.sample_tokens,
        max_seq_len=max_seq_len or config.data.seq_len,
        seed=config.train.seed,
        device=ranks.device,
    )
    if ranks.is_main:
        text = prompt + tokenizer.decode(new)
        with open(os.path.join(run_dir, runs.SAMPLE), "w") as handle:
            handle.write(text + "\n")
        print(f"sample:\n{text}", flush=True)
