"""`flatshard train` against one process: the losses and gradient norms its metrics report
for a two-rank run with gradient accumulation equal a plain PyTorch replay of the same
config in this process (the trainer's data order, schedule, optimizer groups and
clipping; an unsharded `Llama`, or `MoE` with its load-balancing loss)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from test_cli_helpers import TINY, check_ok, flatshard, metrics

from flatshard.cli import config as run_config
from flatshard.cli.model import llama_config, reference_model
from flatshard.cli.runs import CONFIG_TOML
from flatshard.cli.schedule import learning_rate
from flatshard.data.sequences import SequenceOrder
from flatshard.data.tokens import load_tokens
from flatshard.models import MoEConfig, load_balancing_loss

STEPS = 5


def _replay(config) -> list[tuple[float, float]]:
    """(loss, gradient norm) per step, trained in this process on the whole global batch."""
    train, data = config.train, config.data
    tokens = load_tokens(data.path, data.format, data.text_field, data.glob)
    order = SequenceOrder(tokens.tokens, data.seq_len, train.seed)
    torch.manual_seed(train.seed)
    model = reference_model(llama_config(config, tokens.vocab_size))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=train.lr,
        betas=(train.beta1, train.beta2),
    )
    per_micro = train.micro_batch * config.run.nproc
    accumulation = train.global_batch // per_micro
    out, position = [], 0
    for step in range(train.steps):
        lr = learning_rate(
            step, peak=train.lr, minimum=train.min_lr, warmup=train.warmup_steps, total=train.steps
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for micro in range(accumulation):
            batch = order.batch(position + micro * per_micro, per_micro)
            loss = _loss(model, batch)
            (loss / accumulation).backward()
            loss_sum += loss.item() / accumulation
        norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        position += train.global_batch
        out.append((loss_sum, float(norm)))
    return out


def _loss(model, batch):
    """Cross-entropy, plus an MoE model's weighted load-balancing loss over the batch (the
    global micro-batch, which the ranks split)."""
    if not isinstance(model.config, MoEConfig):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    logits, stats = model(batch[:, :-1], return_router_stats=True)
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    return loss + model.config.aux_loss_coef * load_balancing_loss(stats)


@pytest.mark.parametrize(
    "model",
    # moe-tiny with a large aux loss weight, so that the comparison sees it
    [["--model", "tiny"], ["--model", "moe-tiny", "--set", "model.aux_loss_coef=0.1"]],
    ids=["tiny", "moe-tiny"],
)
def test_cli_losses_equal_one_process(tmp_path, model):
    run = tmp_path / "run"
    args = [*TINY, *model, "--global-batch", 8, "--steps", STEPS, "--out", run]  # 2 micro
    check_ok(flatshard("train", *args, "--set", "train.grad_clip=0.5"))
    config = run_config.build([os.path.join(run, CONFIG_TOML)])
    assert config.run.nproc == 2 and config.train.global_batch == 8
    reference = _replay(config)
    for record, (loss, norm) in zip(metrics(run), reference, strict=True):
        assert abs(record["loss"] - loss) <= 1e-5 * loss, (record, loss)
        assert abs(record["grad_norm"] - norm) <= 1e-5 * norm, (record, norm)
