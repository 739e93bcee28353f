"""`flatshard sample`: generate from any checkpoint, in one process (a plain model; DCP
reshards the checkpoint into it) or on every rank of a group (a sharded model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.cuda import is_available as cuda_available

from flatshard import checkpoint
from flatshard.cli import runs
from flatshard.cli.errors import RunError
from flatshard.cli.generate import generate_with_progress
from flatshard.cli.launch import init_distributed
from flatshard.cli.model import (
    build_plain,
    build_sharded,
    build_transformers,
    is_transformers_config,
    max_seq_len,
    saved_model_config,
    vocab_size,
)
from flatshard.cli.tokenizer import tokenizer_for


@dataclass(frozen=True)
class SampleRequest:
    checkpoint: str
    prompt: str
    prompt_ids: tuple[int, ...]
    tokens: int
    temperature: float
    top_k: int
    seed: int
    device: str


def sample_worker(request: SampleRequest, sharded: bool) -> None:
    ranks = init_distributed(request.device) if sharded else None
    group = dist.group.WORLD if sharded else None
    root, step, path, cfg = saved_model_config(request.checkpoint, group)  # verified
    tokenizer = tokenizer_for(runs.saved_extra(path, "tokenizer") or "none")
    if request.prompt_ids:
        prompt = list(request.prompt_ids)
    elif tokenizer is None:
        raise RunError(
            f"{path} was trained on pre-tokenised data (no tokenizer): pass --prompt-ids 1,2,3"
        )
    else:
        prompt = tokenizer.encode(request.prompt) or [tokenizer.end_of_text]
    vocab = vocab_size(cfg)
    if max(prompt) >= vocab or min(prompt) < 0:
        raise RunError(f"prompt token ids must be in [0, {vocab}) for this model")
    if sharded:
        device, is_main = ranks.device, ranks.is_main
        if is_transformers_config(cfg):
            model = build_transformers(cfg, sharded=True, device=device)
        else:
            model = build_sharded(cfg, zero_stage=3, precision="fp32", seed=0, device=device)
    else:
        use_cuda = request.device == "cuda" or (request.device == "auto" and cuda_available())
        device, is_main = ("cuda" if use_cuda else "cpu"), True
        plain = is_transformers_config(cfg)
        model = (
            build_transformers(cfg, sharded=False, device=device)
            if plain
            else build_plain(cfg, device)
        )
    checkpoint.load(root, model=model, step=step, verify=False)  # verified above
    new = generate_with_progress(
        model,
        prompt,
        is_main=is_main,
        new_tokens=request.tokens,
        max_seq_len=max_seq_len(cfg),
        temperature=request.temperature,
        top_k=request.top_k,
        seed=request.seed,
        device=device,
    )
    if is_main:
        if tokenizer is None or request.prompt_ids:
            print(" ".join(map(str, prompt + new)))
        else:
            print(request.prompt + tokenizer.decode(new))
