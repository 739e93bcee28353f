"""Sampling text from a model, sharded (every rank runs the same forward passes and rank 0's
choice of each token is broadcast) or plain in one process."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from flatshard import comm
from flatshard.cli import runs
from flatshard.cli.tokenizer import tokenizer_for


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
) -> list[int]:
    """`new_tokens` token ids following `prompt` (which must not be empty)."""
    generator = torch.Generator().manual_seed(seed)
    sharded = dist.is_initialized() and dist.get_world_size() > 1
    ids = list(prompt)
    for _ in range(new_tokens):
        context = torch.tensor([ids[-max_seq_len:]], dtype=torch.long, device=device)
        output = model(context)
        logits = getattr(output, "logits", output)[0, -1].float().cpu()  # transformers: .logits
        chosen = torch.tensor([_choose(logits, temperature, top_k, generator)])
        if sharded:  # rounding may differ across ranks: rank 0's choice is everyone's
            chosen = chosen.to(comm.group_device(None))
            dist.broadcast(chosen, src=0)
        ids.append(int(chosen.item()))
    return ids[len(prompt) :]


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
    new = generate(
        model,
        ids,
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
