"""`flatshard plan`: per-rank memory, padding and communication of a model on a mesh.

The model is a zoo name, a Hugging Face config.json, or (with neither) the model of a
training run config, in which case the mesh and batch default to that run's.
"""

from __future__ import annotations

import json

from flatshard.cli import config as run_config
from flatshard.cli.config_rules import qlora_refused
from flatshard.cli.errors import ConfigError, warn
from flatshard.cli.model import lora_spec
from flatshard.cli.options import BY_KEY
from flatshard.cli.plan_text import format_plan, what_fits
from flatshard.errors import MeshError
from flatshard.mesh import ParallelDims
from flatshard.planner import zoo
from flatshard.planner.estimate import Setup, plan


def add_arguments(parser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"{', '.join(zoo.ZOO)}, or a Hugging Face config.json (default: "
        "the model of the training config)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks (default 8; a training config's run.nproc)",
    )
    parser.add_argument(
        "--dp-shard",
        type=int,
        default=None,
        metavar="N",
        help="ranks a unit is sharded over (default: world size; fewer: HSDP)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor-parallel ranks (innermost; default 1)",
    )
    parser.add_argument(
        "--cp", type=int, default=None, metavar="N",
        help="context-parallel ranks each sequence is split over (within --dp-shard)",
    )  # fmt: skip
    parser.add_argument(
        "--pp", type=int, default=None, metavar="N",
        help="pipeline stages, a rank each (outermost): each rank's memory and bytes, the bubble",
    )  # fmt: skip
    parser.add_argument(
        "--pp-schedule", default=None, metavar="NAME",
        help="gpipe, 1f1b (default), interleaved-1f1b or looped-bfs",
    )  # fmt: skip
    parser.add_argument(
        "--sp", action="store_true", default=None,
        help="with --tp N: sequence parallelism (norms and residual split by sequence)",
    )  # fmt: skip
    parser.add_argument(
        "--ep",
        type=int,
        default=None,
        metavar="N",
        help="expert-parallel ranks for MoE models (default 1)",
    )
    parser.add_argument(
        "--offload",
        type=float,
        default=None,
        metavar="F",
        help="share of each rank's weights, gradients and optimizer state on the host",
    )
    parser.add_argument(
        "--offload-disk",
        action="store_true",
        default=None,
        help="the offloaded optimizer state in memory-mapped files (the disk tier)",
    )
    parser.add_argument("--zero-stage", type=int, default=None, choices=(1, 2, 3))
    parser.add_argument(
        "--write-gbps",
        type=float,
        default=None,
        metavar="GB/S",
        help="how fast each rank writes its checkpoint file, for the save time (default 1)",
    )
    parser.add_argument(
        "--sync-wire",
        default=None,
        choices=("none", "fp32", "bf16", "fp16", "fp8"),
        help="the wire of a weight sync to inference (flatshard.sync_weights), for its "
        "bytes (default: the run's sync.wire, or none: each tensor's own dtype)",
    )
    parser.add_argument(
        "--optimizer",
        default=None,
        choices=("adamw", "adamw-fused", "sgd", "muon", "torch-adamw"),
        help="its state per trained element: AdamW (fused too) two fp32 values, SGD one, Muon "
        "one on the hidden matrices (their Newton-Schulz work per rank and exchange bytes "
        "shown; default adamw)",
    )
    parser.add_argument(
        "--muon-split-fused",
        action="store_true",
        default=None,
        help="with --optimizer muon: orthogonalise SwiGLU's gate and up as two matrices",
    )
    parser.add_argument(
        "--ac",
        default=None,
        choices=("none", "full", "selective", "offload"),
        help="activation checkpointing of every block, or offload (default none)",
    )
    parser.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="memory per device (GiB): say which activation modes fit in it",
    )
    parser.add_argument(
        "--hpz-group",
        type=int,
        default=None,
        metavar="N",
        help="ZeRO-3: after forward, stay sharded over groups of N ranks (hpZ; 0: all)",
    )
    parser.add_argument(
        "--param-dtype",
        default=None,
        choices=("fp32", "bf16"),
        help="compute / all-gather dtype (default bf16)",
    )
    parser.add_argument("--reduce-dtype", default=None, choices=("fp32", "bf16"))
    parser.add_argument(
        "--quantize-weights",
        default=None,
        choices=("none", "int8", "fp8"),
        help="weights all-gathered in 8 bits with a scale per 256 (qwZ)",
    )
    parser.add_argument(
        "--quantize-grads",
        default=None,
        choices=("none", "int8", "fp8"),
        help="gradients reduce-scattered in 8 bits with a scale per 256 (qgZ; error feedback "
        "holds one unsharded fp32 gradient per unit)",
    )
    parser.add_argument(
        "--micro-batch", type=int, default=None, metavar="N", help="sequences per rank"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, metavar="N", help="tokens per sequence"
    )
    parser.add_argument(
        "--grad-accum", type=int, default=None, metavar="N", help="micro-batches per step"
    )
    parser.add_argument(
        "--pack", action="store_const", const=True, default=None,
        help="sequences packed from several documents (train's data.pack): attention masked",
    )  # fmt: skip
    parser.add_argument(
        "--backend",
        default=None,
        choices=("nccl", "gloo"),
        help="collective backend (default nccl; gloo for a CPU training config)",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="training config whose model and batch to plan",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="training config override"
    )
    parser.add_argument(
        "--lora", type=int, default=None, metavar="R",
        help="LoRA adapters of rank R on the projections, the base frozen (train --lora)",
    )  # fmt: skip
    parser.add_argument(
        "--qlora", action="store_true",
        help="with --lora R: the adapted bases in 4-bit NF4 (train --qlora)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="machine-readable output")  # fmt: skip


def plan_command(args) -> int:
    if args.device_memory is not None and not args.device_memory > 0:
        raise ConfigError(f"--device-memory {args.device_memory:g}: it must be > 0 (GiB)")
    spec, defaults = _model_and_defaults(args)
    chosen = {name: getattr(args, name) for name in defaults if getattr(args, name) is not None}
    values = {**defaults, **chosen}
    stages = values["pp"]
    if "dp_shard" not in chosen and values["world_size"] % max(1, values["tp"] * stages):
        given = "" if "world_size" in chosen else " (the default)"
        degrees, product = f"--tp {values['tp']}", values["tp"]
        if stages > 1:
            degrees, product = f"--tp {values['tp']} x --pp {stages}", values["tp"] * stages
        raise ConfigError(
            f"{degrees} does not divide --world-size {values['world_size']}{given}: "
            f"pick --world-size a multiple of {product}, or other degrees"
        )
    if "dp_shard" not in chosen and {"world_size", "tp", "pp"} & set(chosen):
        # a training config's dp_shard was for its own world and tp: keep its replicas
        replicas = 1
        if defaults["dp_shard"]:
            replicas = defaults["world_size"] // (defaults["dp_shard"] * defaults["tp"])
        values["dp_shard"] = values["world_size"] // max(1, replicas * values["tp"] * stages)
    if values["dp_shard"] is None:  # an explicit 0 is an error (Setup), not "all ranks"
        values["dp_shard"] = values["world_size"] // max(1, values["tp"] * stages)
    _check_adapters(spec, values)
    try:
        result = plan(spec, Setup(**values))
    except MeshError as error:  # name the flags that set the degrees
        names = ("world_size", "dp_shard", "tp", "ep", "pp")
        flags = ", ".join(f"--{n.replace('_', '-')} {values[n]}" for n in names if n in chosen)
        raise ConfigError(f"{flags or 'the run config'}: {error}") from None
    text = format_plan(result) + what_fits(result, args.device_memory)
    print(json.dumps(result.to_dict(), indent=1) if args.json else text)
    empty = [unit for unit in result.units if unit.empty_ranks]
    if empty:
        shard = result.setup.dp_shard
        units = ", ".join(f"{u.name}: {u.empty_ranks:,} of {shard:,} ranks" for u in empty)
        warn(
            f"at dp_shard {shard:,} some ranks would hold none of a unit's parameters, only "
            f"padding ({units}). Use fewer ranks per shard group (HSDP: --dp-shard) or "
            "larger units"
        )
    return 0


LORA_TARGETS = BY_KEY["train.lora_targets"].default


def _check_adapters(spec, values: dict) -> None:
    """What train refuses of QLoRA, refused here alike: NF4 bases under TP, CP or stages."""
    if not any(unit.nf4 for unit in spec.units):
        return
    for degree in ("tp", "pp", "cp"):
        if values[degree] > 1:
            raise ConfigError(qlora_refused(f"--{degree}", "--qlora"))


def _model_and_defaults(args):
    defaults = dict(
        world_size=8, dp_shard=None, zero_stage=3, param_dtype="bf16", reduce_dtype="fp32",
        micro_batch=1, seq_len=4096, grad_accum=1, backend="nccl", hpz_group=0, tp=1, sp=False,
        ep=1, cp=1,
        offload=0.0, offload_disk=False, ac="none", optimizer="adamw", write_gbps=1.0,
        quantize_weights="none", quantize_grads="none", muon_split_fused=False, sync_wire="none",
        pp=1, pp_schedule="1f1b", pack=False,
    )  # fmt: skip
    if args.model is not None:
        lora = lora_spec(args.lora or 0, 0.0, 0.0, LORA_TARGETS)
        return zoo.resolve(args.model, lora, args.qlora), defaults
    config = run_config.build(args.config, args.set)
    world = args.world_size or config.run.nproc
    train = config.train
    defaults.update(
        world_size=world,
        dp_shard=ParallelDims(
            world, dp_replicate=train.dp_replicate, tp=train.tp, ep=train.ep, cp=train.cp,
            pp=train.pp,
        ).dp_shard
        * train.cp,  # the ranks a unit is sharded over: dp_shard x cp
        pp=train.pp,
        pp_schedule=train.pp_schedule,
        tp=train.tp,
        sp=train.sp,
        cp=train.cp,
        ep=train.ep,
        offload=train.offload or (1.0 if train.offload_dir else 0.0),
        offload_disk=bool(train.offload_dir),
        zero_stage=train.zero_stage,
        ac=train.ac,
        optimizer=train.optimizer,
        hpz_group=train.hpz_group,
        param_dtype=train.precision,
        quantize_weights=train.quantize_weights,
        quantize_grads=train.quantize_grads,
        muon_split_fused=train.muon_split_fused,
        sync_wire=config.sync.wire,
        micro_batch=train.micro_batch,
        seq_len=config.data.seq_len,
        grad_accum=max(
            1,
            train.global_batch // (train.micro_batch * world // (train.tp * train.cp * train.pp)),
        ),
        backend="nccl" if _uses_cuda(config.run.device) else "gloo",
        pack=config.data.pack,
    )
    if config.model.hf:  # the Hugging Face model train --hf would fine-tune
        rank = train.lora_rank if args.lora is None else args.lora
        lora = lora_spec(rank, train.lora_alpha, train.lora_dropout, train.lora_targets)
        return zoo.resolve(config.model.hf, lora, args.qlora or train.qlora), defaults
    if args.lora or args.qlora:
        raise ConfigError("--lora plans a Hugging Face model: name one, or --set model.hf=DIR")
    return zoo.from_llama_config(_run_model(config), "the training config's model"), defaults


def _uses_cuda(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def _run_model(config):
    from flatshard.cli.model import llama_config
    from flatshard.data.tokenizer import load_tokenizer
    from flatshard.data.tokens import load_tokens

    vocab = config.model.vocab_size
    if not vocab:  # the tokenizer's, or the data's largest id + 1
        if config.data.format in ("uint16", "uint32") or config.data.path.endswith(".npy"):
            data = config.data
            vocab = load_tokens(data.path, data.format, data.text_field, data.glob).vocab_size
        else:
            vocab = load_tokenizer(config.data.tokenizer).vocab_size
    return llama_config(config, vocab)
