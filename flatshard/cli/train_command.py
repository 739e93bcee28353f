"""`flatshard train` on the command line: its flags (each shorthand for a config key), the
run it starts or resumes (which directory, which step), and the processes it runs on:
local ones, restarted ones (`--max-restarts`, going on with fewer: `--min-nproc`), or
torchrun's."""

from __future__ import annotations

import os

from flatshard.checkpoint import commit
from flatshard.cli import config as run_config
from flatshard.cli import elastic, launch, runs
from flatshard.cli.errors import ConfigError, RunError, warn

# flag -> config key; each flag is shorthand for --set key=value
TRAIN_FLAGS = {
    "model": ("model.preset", "NAME", "model preset: tiny, small (~11M), medium (~26M), moe-tiny"),
    "data": ("data.path", "PATH", "text file or directory, .jsonl, or token memmap (.npy/.bin)"),
    "seq_len": ("data.seq_len", "N", "tokens per sequence"),
    "tokenizer": ("data.tokenizer", "T", "auto (a --hf model's own), bytes, or a tokenizer DIR"),
    "eval": ("data.eval", "PATH|F", "held-out data: a file, or a fraction of the data"),
    "eval_interval": ("train.eval_interval", "N", "evaluate every N steps (0: at the end)"),
    "steps": ("train.steps", "N", "optimizer steps"),
    "micro_batch": ("train.micro_batch", "N", "sequences per process per forward"),
    "global_batch": ("train.global_batch", "N", "sequences per optimizer step"),
    "lr": ("train.lr", "LR", "peak learning rate"),
    "optimizer": (
        "train.optimizer",
        "NAME",
        "adamw (default), adamw-fused, sgd, muon or torch-adamw",
    ),
    "zero_stage": ("train.zero_stage", "N", "ZeRO stage 1, 2 or 3"),
    "hf": ("model.hf", "PATH", "fine-tune this Hugging Face model directory"),
    "dp_replicate": ("train.dp_replicate", "N", "HSDP: replicas of the sharded model"),
    "tp": ("train.tp", "N", "tensor parallelism over N ranks (innermost)"),
    "ep": ("train.ep", "N", "expert parallelism over N ranks (MoE models)"),
    "cp": ("train.cp", "N", "context parallelism: each sequence split over N ranks"),
    "pp": ("train.pp", "N", "pipeline parallelism: the blocks in N stages (outermost)"),
    "pp_schedule": ("train.pp_schedule", "NAME", "gpipe, 1f1b, interleaved-1f1b, looped-bfs, "
                    "interleaved-zb, zbv or dualpipev"),
    "microbatches": ("train.microbatches", "M", "micro-batches per step per data-parallel rank"),
    "offload": ("train.offload", "F", "keep and step this share of the optimizer on the host"),
    "offload_dir": ("train.offload_dir", "DIR", "optimizer state in memory-mapped files here"),
    "hpz_group": ("train.hpz_group", "N", "ZeRO-3: backward gathers inside groups of N (hpZ)"),
    "precision": ("train.precision", "P", "fp32 or bf16 compute"),
    "quantize_weights": ("train.quantize_weights", "F", "all-gather weights as int8 or fp8 (qwZ)"),
    "quantize_grads": ("train.quantize_grads", "F", "reduce-scatter gradients in int8/fp8 (qgZ)"),
    "ac": ("train.ac", "MODE", "activation checkpointing: none, full, selective or offload"),
    "lora": ("train.lora_rank", "R", "LoRA adapters of rank R, the base frozen (with --hf)"),
    "seed": ("train.seed", "N", "seed of the weights and the data order"),
    "checkpoint_interval": ("checkpoint.interval", "N", "save every N steps (0: only at the end)"),
    "sync_to": ("sync.address", "HOST:PORT", "push the weights to `flatshard receive` there"),
    "sync_interval": ("sync.interval", "N", "steps between weight syncs (0: only at the end)"),
    "out": ("run.out_dir", "DIR", "run directory (default runs/{time})"),
    "nproc": ("run.nproc", "N", "local processes when not under torchrun"),
    "max_restarts": ("run.max_restarts", "N", "restart from the newest checkpoint after a "
                     "failure, up to N times"),
    "min_nproc": ("run.min_nproc", "M", "with --max-restarts: once the restarts are spent, "
                  "go on with fewer processes, down to M"),
}


def train_command(args) -> int:
    """`flatshard train`: the config from files, flags and overrides; a new run or a resume;
    the processes (local, restarted, or torchrun's)."""
    if args.help_config:
        print(run_config.describe_options())
        return 0
    overrides = (
        [
            f"{key}={getattr(args, flag)}"
            for flag, (key, _, _) in TRAIN_FLAGS.items()
            if getattr(args, flag) is not None
        ]
        + (["train.compile=true"] if args.compile else [])
        + (["train.muon_split_fused=true"] if args.muon_split_fused else [])
        + (["train.qlora=true"] if args.qlora else [])
        + (["train.sp=true"] if args.sp else [])
        + args.set
    )
    config = run_config.build(args.config, overrides)
    resume_step = None  # the step to continue from (None: a new run)
    if args.resume is not None:
        run_dir, resume_step = _resume_target(args.resume, config.run.out_dir)
        saved = os.path.join(run_dir, runs.CONFIG_TOML)
        base = run_config.read_file(saved) if os.path.exists(saved) else None
        conflicts = run_config.resume_conflicts(base, args.config, overrides) if base else []
        if conflicts:
            raise ConfigError(
                f"--resume {run_dir}: a run's model and data cannot change, but "
                + "; ".join(conflicts)
                + ". Drop these settings to continue the run, or start a new one (--out DIR); "
                "on resume only train.* (except train.seed and train.lora_*), checkpoint.* and "
                "run.* may change"
            )
        config = run_config.build(args.config, overrides, base=base)
        config = config.replace(run__out_dir=run_dir)
    else:
        run_dir = config.run.out_dir
        if runs.has_checkpoint(run_dir) and not elastic.attempt():  # (a restart's own run)
            raise RunError(
                f"run.out_dir {run_dir!r} already holds a run; continue it with --resume or "
                "choose another --out"
            )
    world = int(os.environ["WORLD_SIZE"]) if launch.under_launcher() else config.run.nproc
    run_config.check(config, world)
    restarts = 0 if launch.under_launcher() else config.run.max_restarts
    if restarts and resume_step is None:
        run_dir = runs.new_run_dir(run_dir)  # every attempt trains in the same directory
        os.makedirs(run_dir, exist_ok=True)
    if not launch.under_launcher():
        _check_data(config)  # before starting processes: a bad path fails fast, once
        if world > 1:
            print(f"flatshard train: starting {world} local processes", flush=True)
    from flatshard.cli import attempts
    from flatshard.cli.train import train_worker

    return launch.run(
        train_worker, (config.flat(), run_dir, resume_step), world, max_restarts=restarts,
        failure=lambda attempt: attempts.cause(run_dir, attempt),
        sizes=_process_counts(config, world),
    )  # fmt: skip


def _process_counts(config, world: int) -> list[int]:
    """The process counts a restarted run may go on with, largest first: `world` down to
    run.min_nproc, those the run's degrees and batch split over."""
    sizes = [world]
    for size in range(world - 1, (config.run.min_nproc or world) - 1, -1):
        try:
            run_config.check(config, size)
        except ConfigError:
            continue
        sizes.append(size)
    return sizes


def _check_data(config) -> None:
    """Read (and tokenise, into the cache the ranks then map) the data and check it fits."""
    from flatshard.cli.model import llama_config
    from flatshard.cli.run_data import open_run_data
    from flatshard.cli.saved_model import check_hf_vocab
    from flatshard.data.sequences import SequenceOrder

    data = open_run_data(config).train
    SequenceOrder(data.tokens, config.data.seq_len, config.train.seed)
    if config.model.hf:
        check_hf_vocab(config.model.hf, data.vocab_size)
    else:
        llama_config(config, data.vocab_size)


def _resume_target(given: str, template: str) -> tuple[str, int]:
    """(run directory, step) that `--resume [GIVEN]` continues: a run directory (its
    `latest` checkpoint, or the newest complete one if the marker is gone), its checkpoints/
    directory, or one step-N directory in it; nothing given: the newest run."""
    if given:
        where = given
    elif "{time}" not in template:
        where = template
    else:
        root = runs.runs_root(template)
        where = runs.latest_run(root)
        if where is None:
            raise RunError(f"nothing to resume: no run with a checkpoint under {root!r}")
    if not os.path.exists(where):
        raise RunError(f"nothing to resume: {where!r} does not exist")
    try:
        root, step = runs.resolve_checkpoint(where, warn=warn)
    except RunError as error:
        raise RunError(f"nothing to resume: {error}") from None
    if os.path.basename(root) != runs.CHECKPOINTS:
        raise RunError(
            f"--resume {where!r}: {root!r} is not the {runs.CHECKPOINTS}/ directory of a run; "
            "pass the run directory (or a step-N directory in its checkpoints/)"
        )
    newer = [n for n in commit.committed_steps(root) if n > step]
    if newer:
        raise RunError(
            f"--resume {where!r}: {root} holds checkpoints newer than step {step} "
            f"({', '.join(map(str, newer))}), which continuing from step {step} would write "
            "over; move them out of the directory to go back, or resume from the newest"
        )
    return os.path.dirname(root) or ".", step
