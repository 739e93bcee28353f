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
from flatshard.models import MoEConfig, RouterStats, load_balancing_loss, update_score_bias

STEPS = 5


def _replay(config, bias_update_speed=None) -> list[tuple[float, float]]:
    """(loss, gradient norm) per step, trained in this process on the whole global batch;
    with model.bias_update_speed (or `bias_update_speed`), each MoE router's correction
    bias moved after each step from the step's routing counts (`update_score_bias`)."""
    speed = config.model.bias_update_speed if bias_update_speed is None else bias_update_speed
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
        loss_sum, counts = 0.0, []
        for micro in range(accumulation):
            batch = order.batch(position + micro * per_micro, per_micro)
            loss, stats = _loss(model, batch)
            (loss / accumulation).backward()
            loss_sum += loss.item() / accumulation
            counts.append([s.counts for s in stats])
        norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip or float("inf"))
        optimizer.step()
        if speed:
            summed = [RouterStats(sum(c), None, 0) for c in zip(*counts)]
            update_score_bias(model, summed, speed)
        optimizer.zero_grad(set_to_none=True)
        position += train.global_batch
        out.append((loss_sum, float(norm)))
    return out


def _loss(model, batch):
    """(Cross-entropy, plus an MoE model's weighted load-balancing loss over the batch (the
    global micro-batch, which the ranks split); the MoE layers' routing statistics)."""
    if not isinstance(model.config, MoEConfig):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()), ()
    logits, stats = model(batch[:, :-1], return_router_stats=True)
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    return loss + model.config.aux_loss_coef * load_balancing_loss(stats), stats


@pytest.mark.parametrize(
    "model",
    # moe-tiny with a large aux loss weight, so that the comparison sees it; then balanced
    # by its routers' biases instead (DeepSeek-V3's auxiliary-loss-free way), moved fast
    [["--model", "tiny"], ["--model", "moe-tiny", "--set", "model.aux_loss_coef=0.1"],
     ["--model", "moe-tiny", "--set", "model.aux_loss_coef=0", "--set",
      "model.bias_update_speed=0.05"]],
    ids=["tiny", "moe-tiny", "moe-tiny-bias"],
)  # fmt: skip
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
    if config.model.bias_update_speed:  # the comparison sees the biases move the routing
        unbiased = _replay(config, bias_update_speed=0.0)
        assert max(abs(a[0] - b[0]) / b[0] for a, b in zip(reference, unbiased)) > 1e-4
