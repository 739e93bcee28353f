"""`flatshard sample` and `flatshard chat`: generate from any checkpoint, in one process (a
plain model; DCP reshards the checkpoint into it) or on every rank of a group (a sharded
model).

Text goes through the tokenizer the run recorded (a Hugging Face model's own, rebuilt from
the files its checkpoint keeps, or bytes), through its chat template for `--chat` and
`flatshard chat`, and generation stops at its end-of-text or end-of-turn ids. Text is
printed as it comes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch.distributed as dist
from torch.cuda import is_available as cuda_available

from flatshard import checkpoint
from flatshard.cli import runs
from flatshard.cli.errors import RunError
from flatshard.cli.generate import TextStream, answer_text, generate_with_progress, prompt_ids
from flatshard.cli.launch import init_distributed
from flatshard.cli.model import (
    build_lora_model,
    build_plain,
    build_sharded,
    build_transformers,
    lora_of_checkpoint,
)
from flatshard.cli.saved_model import (
    is_transformers_config,
    max_seq_len,
    saved_model_config,
    vocab_size,
)
from flatshard.data.tokenizer import tokenizer_from_record


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
    chat: bool = False


def saved_tokenizer(path: str):
    """The tokenizer a checkpoint recorded (None: pre-tokenised data)."""
    name = runs.saved_extra(path, "tokenizer") or "none"
    stop = runs.saved_extra(path, "tokenizer_stop_ids")
    files = runs.saved_extra(path, "tokenizer_files")
    return tokenizer_from_record(name, files, json.loads(stop) if stop else ())


class LoadedModel:
    """A checkpoint's model, tokenizer and where it runs, ready to generate from."""

    def __init__(self, request: SampleRequest, sharded: bool):
        ranks = init_distributed(request.device) if sharded else None
        group = dist.group.WORLD if sharded else None
        root, step, self.path, self.cfg = saved_model_config(request.checkpoint, group)
        self.tokenizer = saved_tokenizer(self.path)
        lora = lora_of_checkpoint(self.path)  # (base, adapters): the files hold the adapters
        if sharded:
            self.device, self.is_main = ranks.device, ranks.is_main
            if lora is not None:
                model = build_lora_model(*lora, sharded=True, device=self.device)
            elif is_transformers_config(self.cfg):
                model = build_transformers(self.cfg, sharded=True, device=self.device)
            else:
                model = build_sharded(
                    self.cfg, zero_stage=3, precision="fp32", seed=0, device=self.device
                )
        else:
            use_cuda = request.device == "cuda" or (request.device == "auto" and cuda_available())
            self.device, self.is_main = ("cuda" if use_cuda else "cpu"), True
            if lora is not None:
                model = build_lora_model(*lora, sharded=False, device=self.device)
            elif is_transformers_config(self.cfg):
                model = build_transformers(self.cfg, sharded=False, device=self.device)
            else:
                model = build_plain(self.cfg, self.device)
        checkpoint.load(root, model=model, step=step, verify=False,  # verified above
                        trainable_only=lora is not None)  # fmt: skip
        self.model = model.eval()
        self.request = request

    def generate(self, prompt: list[int], stream: bool) -> list[int]:
        vocab = vocab_size(self.cfg)
        if max(prompt) >= vocab or min(prompt) < 0:
            raise RunError(f"prompt token ids must be in [0, {vocab}) for this model")
        request, tokenizer = self.request, self.tokenizer
        return generate_with_progress(
            self.model, prompt, is_main=self.is_main,
            stream=TextStream(tokenizer) if stream else None,
            new_tokens=request.tokens, max_seq_len=max_seq_len(self.cfg),
            temperature=request.temperature, top_k=request.top_k, seed=request.seed,
            device=self.device, stop_ids=tokenizer.stop_ids if tokenizer else frozenset(),
        )  # fmt: skip


def sample_worker(request: SampleRequest, sharded: bool) -> None:
    loaded = LoadedModel(request, sharded)
    tokenizer = loaded.tokenizer
    if request.prompt_ids:
        new = loaded.generate(list(request.prompt_ids), stream=False)
        if loaded.is_main:
            print(" ".join(map(str, list(request.prompt_ids) + new)))
        return
    if tokenizer is None:
        raise RunError(
            f"{loaded.path} was trained on pre-tokenised data (no tokenizer): pass "
            "--prompt-ids 1,2,3"
        )
    if request.chat and not tokenizer.has_chat_template:
        raise RunError(f"{loaded.path}: its tokenizer has no chat template; drop --chat")
    ids = prompt_ids(tokenizer, request.prompt, chat=request.chat)
    if loaded.is_main and not request.chat:
        print(request.prompt, end="", flush=True)  # the continuation streams after it
    loaded.generate(ids, stream=True)


def chat_worker(request: SampleRequest) -> None:
    """A conversation on the terminal: each line typed is the user's turn, the model's
    answer streams back; the whole conversation is the next prompt. Ends at end of input
    (Ctrl-D) or '/exit'; '/reset' starts over."""
    loaded = LoadedModel(request, sharded=False)
    tokenizer = loaded.tokenizer
    if tokenizer is None or not tokenizer.has_chat_template:
        raise RunError(
            f"{loaded.path}: flatshard chat needs a tokenizer with a chat template (a "
            "fine-tune of a Hugging Face instruct model); use flatshard sample"
        )
    messages: list[dict] = []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tokenizer.chat_ids(messages, add_generation_prompt=True)
        new = loaded.generate(ids, stream=True)
        messages.append({"role": "assistant", "content": answer_text(tokenizer, new)})
