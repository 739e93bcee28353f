"""The `flatshard` command: train, sample, plan, inspect, convert, receive.

User errors (a bad config value, a missing file, an unusable checkpoint) print one line
`flatshard: error: ...` and exit with status 2; there is no traceback for them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from flatshard.checkpoint import commit
from flatshard.cli import config as run_config
from flatshard.cli import elastic, launch, runs
from flatshard.cli.errors import ConfigError, RunError, warn
from flatshard.errors import FlatShardError

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flatshard", description="Fully sharded data-parallel training: the command line."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = commands.add_parser(
        "train",
        help="train the reference Llama (default: 2 local CPU processes, bundled corpus)",
        description="Train. Config sources, later wins: defaults, --config files, flags and "
        "--set overrides. Under torchrun, rank and world size come from the launcher.",
    )
    train.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="TOML, YAML or JSON config file (repeatable)",
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set model.dim=256 (repeatable)",
    )
    for flag, (key, metavar, text) in TRAIN_FLAGS.items():
        train.add_argument(
            "--" + flag.replace("_", "-"), dest=flag, metavar=metavar, help=f"{text} [{key}]"
        )
    train.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="RUN_DIR",
        help="continue a run from its latest checkpoint (default: the newest run)",
    )
    train.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each block [train.compile]",
    )
    train.add_argument(
        "--muon-split-fused",
        action="store_true",
        default=None,
        help="with --optimizer muon: each fused component its own matrix [train.muon_split_fused]",
    )
    train.add_argument(
        "--sp",
        action="store_true",
        default=None,
        help="with --tp N: sequence parallelism (norms and residual split by sequence) [train.sp]",
    )
    train.add_argument(
        "--qlora",
        action="store_true",
        default=None,
        help="with --lora R: the adapted projections' frozen bases in 4-bit NF4 [train.qlora]",
    )
    train.add_argument("--help-config", action="store_true", help="list every config key")

    sample = commands.add_parser("sample", help="generate text from a checkpoint")
    _add_generation_arguments(sample, tokens=200, temperature=0.8, per="tokens to generate")
    sample.add_argument("--prompt", default="The ")
    sample.add_argument(
        "--prompt-ids",
        default="",
        metavar="IDS",
        help="comma-separated token ids (for pre-tokenised data)",
    )
    sample.add_argument("--nproc", type=int, default=1, help="local processes (sharded model)")
    sample.add_argument(
        "--chat", action="store_true", help="the prompt is a user's turn (the chat template)"
    )
    chat = commands.add_parser(
        "chat", help="talk to a fine-tuned model (its chat template, one process)"
    )
    _add_generation_arguments(chat, tokens=256, temperature=0.7, per="most tokens per answer")

    from flatshard.cli.plan import add_arguments as add_plan_arguments

    add_plan_arguments(commands.add_parser(
        "plan", help="per-rank memory, padding and communication of a model on a mesh",
        description="Build the model on the meta device, lay out its units as fully_shard "
        "would, and estimate per-rank memory and per-step communication.",
    ))  # fmt: skip

    receive = commands.add_parser(
        "receive", help="hold a Hugging Face model and take a run's weights as it trains",
        description="Join a run's weight-sync group (flatshard train --sync-to HOST:PORT) "
        "with the model directory the run fine-tunes, apply every update it pushes, and "
        "save the model when the run ends.",
    )  # fmt: skip
    receive.add_argument("--address", required=True, metavar="HOST:PORT")
    receive.add_argument("--hf", required=True, metavar="DIR", help="the model the run trains")
    receive.add_argument("--trainers", type=int, required=True, help="the run's process count")
    receive.add_argument("--receivers", type=int, default=1)
    receive.add_argument("--index", type=int, default=0, help="this receiver's index")
    receive.add_argument("--out", default=None, metavar="DIR", help="save the model at the end")

    inspect = commands.add_parser("inspect", help="what a checkpoint holds")
    inspect.add_argument("path", metavar="CHECKPOINT", help="run, checkpoints or step-N directory")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument("--all-keys", action="store_true", help="list optimizer keys too")

    convert = commands.add_parser("convert", help="Hugging Face <-> flatshard checkpoint")
    directions = convert.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_ckpt = directions.add_parser("hf-to-checkpoint", help="HF model directory -> checkpoint")
    to_ckpt.add_argument("source", metavar="HF_DIR")
    to_ckpt.add_argument("target", metavar="CHECKPOINT_DIR")
    to_ckpt.add_argument("--step", type=int, default=0, help="step number to save it as")
    to_hf = directions.add_parser("checkpoint-to-hf", help="checkpoint -> HF model directory")
    to_hf.add_argument("source", metavar="CHECKPOINT")
    to_hf.add_argument("target", metavar="HF_DIR")
    to_hf.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"))
    to_hf.add_argument("--max-shard-size", default="5GB")
    to_hf.add_argument(
        "--overwrite", action="store_true", help="replace a previous export in HF_DIR"
    )
    to_hf.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA run: write its adapters as a PEFT adapter directory (default: the base "
        "with the adapters merged in)",
    )
    return parser


def _add_generation_arguments(parser, *, tokens: int, temperature: float, per: str) -> None:
    """The options `sample` and `chat` share: which checkpoint and how to decode."""
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="run, checkpoints or step-N directory (default: the newest run)",
    )
    parser.add_argument("--tokens", type=int, default=tokens, help=per)
    parser.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def entry() -> None:
    """The `flatshard` command (and `python -m flatshard`): `main`, then exit without the
    interpreter's teardown, as the local worker processes do. A finished single-process
    run otherwise rarely aborts there ("terminate called without an active exception"):
    torch's gloo threads racing the interpreter's finalisation (pytorch#190489). Every
    file is written and closed by then; stdout and stderr are flushed here."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # sample, inspect and convert read checkpoints in one process, which DCP warns about
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    # transformers imports torchao wherever it is installed, and that import logs torchao's
    # missing GPU kernels and a torch deprecation: noise about a package the command does
    # not use, before the one line a user error prints
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        return {
            "train": _train,
            "sample": _sample,
            "chat": _chat,
            "plan": _plan,
            "inspect": _inspect,
            "receive": _receive,
            "convert": _convert,
        }[args.command](args)
    except FlatShardError as error:
        if int(os.environ.get("RANK", 0)) == 0:  # under torchrun every rank finds the same
            print(f"flatshard: error: {error}", file=sys.stderr)
        return launch.EXIT_USER_ERROR
    except KeyboardInterrupt:
        return launch.EXIT_INTERRUPTED


# --- commands -------------------------------------------------------------------------------


def _train(args) -> int:
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


def _receive(args) -> int:
    from flatshard.cli.receive import receive

    return receive(args)


def _check_data(config) -> None:
    """Read (and tokenise, into the cache the ranks then map) the data and check it fits."""
    from flatshard.cli.model import check_hf_vocab, llama_config
    from flatshard.cli.run_data import open_run_data
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


def _checkpoint_or_latest(path: str | None) -> str:
    if path is None:
        path = runs.latest_run(runs.runs_root(run_config.BY_KEY["run.out_dir"].default))
        if path is None:
            raise RunError("no run with a checkpoint under 'runs'; pass --checkpoint DIR")
    return path


def _chat(args) -> int:
    from flatshard.cli.sample import SampleRequest, chat_worker

    if args.tokens < 1 or args.top_k < 0:
        raise RunError("--tokens must be >= 1 and --top-k >= 0")
    path = _checkpoint_or_latest(args.checkpoint)
    request = SampleRequest(path, "", (), args.tokens, args.temperature, args.top_k, args.seed,
                            args.device, chat=True)  # fmt: skip
    chat_worker(request)
    return 0


def _sample(args) -> int:
    from flatshard.cli.sample import SampleRequest, sample_worker

    path = _checkpoint_or_latest(args.checkpoint)
    try:
        prompt_ids = tuple(int(i) for i in args.prompt_ids.replace(",", " ").split())
    except ValueError:
        raise RunError(f"--prompt-ids {args.prompt_ids!r}: give integers, e.g. 1,2,3") from None
    if args.tokens < 0 or args.top_k < 0 or args.nproc < 1:
        raise RunError("--tokens and --top-k must be >= 0 and --nproc >= 1")
    request = SampleRequest(
        path, args.prompt, prompt_ids, args.tokens, args.temperature, args.top_k, args.seed,
        args.device, chat=args.chat,
    )  # fmt: skip
    sharded = launch.under_launcher() or args.nproc > 1
    if not sharded:
        sample_worker(request, sharded=False)
        return 0
    return launch.run(sample_worker, (request, True), args.nproc)


def _plan(args) -> int:
    from flatshard.cli.plan import plan_command

    return plan_command(args)


def _inspect(args) -> int:
    from flatshard.cli.inspect_checkpoint import inspect_command

    return inspect_command(args)


def _convert(args) -> int:
    from flatshard.cli.convert import convert_command

    return convert_command(args)


if __name__ == "__main__":
    sys.exit(main())
