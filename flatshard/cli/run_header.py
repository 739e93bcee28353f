"""The lines `flatshard train` prints before its first step: the processes and mesh, the
model, the data, the batch split, the run directory and the effective config."""

from __future__ import annotations

import os
import textwrap

import torch.distributed as dist

from flatshard.api.fsdp_module import own_class
from flatshard.cli import runs
from flatshard.cli.config import toml_value
from flatshard.cli.options import FINE_TUNE_LORA_LR, FINE_TUNE_LR, FINE_TUNE_MIN_LR_SHARE
from flatshard.models import family_of_config


def run_header(trainer) -> str:
    """What `trainer` (a cli.train.Trainer) is about to run, as lines of text."""
    config, ranks = trainer.config, trainer.ranks
    tokens_per_step = config.train.global_batch * config.data.seq_len
    effective = "\n".join(
        textwrap.fill(
            f"[{section}] " + ", ".join(f"{k}={toml_value(v)}" for k, v in values.items()),
            width=100, initial_indent="  ", subsequent_indent="      ",
        )
        for section, values in _shown(config).items()
    )  # fmt: skip
    lines = [
        f"flatshard train: {ranks.world_size} process(es), {dist.get_backend()} on "
        f"{ranks.device.type}, ZeRO-{config.train.zero_stage}, {config.train.precision}"
        + _describe_mesh(config.train)
        + _describe_activations(config.train.ac)
        + (", compiled blocks" if config.train.compile else "")
        + _describe_offload(config.train),
        _describe_model(trainer),
        f"data: {trainer.data.source}: {len(trainer.data.tokens):,} tokens, "
        f"{trainer.order.windows:,} sequences of {config.data.seq_len}",
        *_describe_eval(trainer),
        f"batch: {config.train.global_batch} sequences = {tokens_per_step:,} tokens per step "
        f"(micro batch {config.train.micro_batch} x {trainer.dp_world} data-parallel "
        f"rank(s) x {trainer.accumulation} accumulation)",
        _describe_schedule(config),
        f"run directory: {trainer.run_dir}",
        f"effective config (saved as {os.path.join(trainer.run_dir, runs.CONFIG_TOML)}):",
        effective.rstrip(),
    ]
    if trainer.resumed is not None:
        lines.append(f"resuming from step {trainer.step} ({trainer.resumed.path})")
        if trainer.resumed.schedule_note:
            lines.append(trainer.resumed.schedule_note)
    return "\n".join(lines)


def _shown(config) -> dict:
    """The effective config as printed: a Hugging Face model's [model] is its path (the
    reference model's sizes do not apply to it)."""
    nested = config.nested()
    if config.model.hf:
        nested["model"] = {"hf": config.model.hf}
    return nested


def _describe_eval(trainer) -> list[str]:
    evaluation = trainer.evaluation
    if evaluation is None:
        return []
    interval = trainer.config.train.eval_interval
    when = f"every {interval} steps and at the end" if interval else "at the end"
    source = trainer.run_data.eval.source
    return [f"eval: {source}, {evaluation.windows:,} sequences, {when}"]


def _describe_schedule(config) -> str:
    train = config.train
    line = (
        f"schedule: peak lr {train.lr:g}, {train.warmup_steps} warmup step(s), cosine to "
        f"{train.min_lr:g} over {train.steps} steps, weight decay {train.weight_decay:g}"
    )
    if config.model.hf:
        lr = FINE_TUNE_LORA_LR if train.lora_rank else FINE_TUNE_LR
        line += (
            f" (a fine-tune's defaults for model.hf where not set: lr {lr:g}, "
            f"min_lr {FINE_TUNE_MIN_LR_SHARE:.0%} of it, no weight decay)"
        )
    return line


def _describe_mesh(train) -> str:
    parts = []
    if train.dp_replicate > 1:
        parts.append(f"HSDP over {train.dp_replicate} replicas")
    if train.tp > 1:
        parts.append(f"tensor parallel over {train.tp}" + (" (+ sequence)" if train.sp else ""))
    if train.cp > 1:
        parts.append(f"each sequence split over {train.cp} (context parallel)")
    if train.ep > 1:
        parts.append(f"experts split over {train.ep}")
    return "".join(", " + part for part in parts)


def _describe_activations(ac: str) -> str:
    if ac == "offload":
        return ", activations offloaded to the host"
    return f", {ac} activation checkpointing" if ac != "none" else ""


def _describe_offload(train) -> str:
    if not train.offload and not train.offload_dir:
        return ""
    share = f", {100 * (train.offload or 1.0):g}% of the optimizer on the host"
    return share + (f", its state paged in {train.offload_dir}" if train.offload_dir else "")


def _describe_model(trainer) -> str:
    model = trainer.model_config
    if model is None:
        kind = own_class(trainer.model).__name__  # not fully_shard's subclass
        count = sum(p.numel() for p in trainer.model.parameters())
        line = f"model: {kind} from {trainer.config.model.hf}, {count:,} parameters"
        config = getattr(trainer.model, "config", None)
        if getattr(config, "output_router_logits", False) and config.router_aux_loss_coef:
            line += f", its load-balancing loss x{config.router_aux_loss_coef:g} in the loss"
        train = trainer.config.train
        if train.lora_rank:
            trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
            alpha = train.lora_alpha or 2 * train.lora_rank
            kind = "QLoRA" if train.qlora else "LoRA"
            line += (
                f"; {kind} rank {train.lora_rank} (alpha {alpha:g}) on {train.lora_targets}: "
                f"{trained:,} trained, the rest frozen"
            )
            if train.qlora:
                line += " (the adapted bases in 4-bit NF4)"
        return line
    return (
        f"model: {_kind(model)}, {model.num_params() / 1e6:.1f}M parameters (dim "
        f"{model.dim}, {model.n_layers} layers, {model.n_heads} heads, ffn {model.ffn_dim}, "
        f"vocab {model.vocab_size})"
    )


def _kind(model_config) -> str:
    return family_of_config(model_config).describe(model_config)
