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

from flatshard.cli import config as run_config
from flatshard.cli import launch, runs
from flatshard.cli.errors import RunError
from flatshard.cli.train_command import TRAIN_FLAGS, train_command
from flatshard.errors import FlatShardError


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
            "train": train_command,
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


def _receive(args) -> int:
    from flatshard.cli.receive import receive

    return receive(args)


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
