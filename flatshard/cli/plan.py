"""`flatshard plan`: per-rank memory, padding and communication of a model on a mesh.

The model is a zoo name, a Hugging Face config.json, or (with neither) the model of a
training run config, in which case the mesh and batch default to that run's.
"""

from __future__ import annotations

import json

from flatshard.cli import config as run_config
from flatshard.cli.errors import ConfigError, warn
from flatshard.cli.model import lora_spec
from flatshard.cli.options import BY_KEY
from flatshard.errors import MeshError
from flatshard.mesh import ParallelDims
from flatshard.planner import zoo
from flatshard.planner.estimate import Plan, Setup, plan
from flatshard.planner.muon_cost import muon_lines

GIB = 1 << 30


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
    if "dp_shard" not in chosen and values["world_size"] % max(1, values["tp"]):
        given = "" if "world_size" in chosen else " (the default)"
        raise ConfigError(
            f"--tp {values['tp']} does not divide --world-size {values['world_size']}{given}: "
            f"pick --world-size a multiple of {values['tp']}, or another --tp"
        )
    if "dp_shard" not in chosen and {"world_size", "tp"} & set(chosen):
        # a training config's dp_shard was for its own world and tp: keep its replicas
        replicas = 1
        if defaults["dp_shard"]:
            replicas = defaults["world_size"] // (defaults["dp_shard"] * defaults["tp"])
        values["dp_shard"] = values["world_size"] // max(1, replicas * values["tp"])
    if values["dp_shard"] is None:  # an explicit 0 is an error (Setup), not "all ranks"
        values["dp_shard"] = values["world_size"] // max(1, values["tp"])
    try:
        result = plan(spec, Setup(**values))
    except MeshError as error:  # name the flags that set the degrees
        names = ("world_size", "dp_shard", "tp", "ep")
        flags = ", ".join(f"--{n.replace('_', '-')} {values[n]}" for n in names if n in chosen)
        raise ConfigError(f"{flags or 'the run config'}: {error}") from None
    text = format_plan(result) + _what_fits(result, args.device_memory)
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


def _model_and_defaults(args):
    defaults = dict(
        world_size=8, dp_shard=None, zero_stage=3, param_dtype="bf16", reduce_dtype="fp32",
        micro_batch=1, seq_len=4096, grad_accum=1, backend="nccl", hpz_group=0, tp=1, sp=False,
        ep=1, cp=1,
        offload=0.0, offload_disk=False, ac="none", optimizer="adamw", write_gbps=1.0,
        quantize_weights="none", quantize_grads="none", muon_split_fused=False,
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
            world, dp_replicate=train.dp_replicate, tp=train.tp, ep=train.ep, cp=train.cp
        ).dp_shard
        * train.cp,  # the ranks a unit is sharded over: dp_shard x cp
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
        micro_batch=train.micro_batch,
        seq_len=config.data.seq_len,
        grad_accum=max(
            1, train.global_batch // (train.micro_batch * world // (train.tp * train.cp))
        ),
        backend="nccl" if _uses_cuda(config.run.device) else "gloo",
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


def _size(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(int(count))


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:10.3f} GiB"


def _offload_lines(setup, memory) -> list[str]:
    if not setup.offload:
        return []
    share = (
        f"{100 * memory['offloaded_share']:.2f}% of the shards (asked: {100 * setup.offload:g}%)"
    )
    lines = [
        f"    offloaded                       {share}",
        f"      device (peak)                 {_gib(memory['device'])}",
        f"      host                          {_gib(memory['host'])}",
    ]
    if setup.offload_disk:
        lines.append(f"      disk (optimizer state)        {_gib(memory['disk'])}")
    return lines


def _what_fits(result: Plan, device_gib: float | None) -> str:
    """The device's peak under each activation mode, and which fit in `device_gib`."""
    peaks = result.device_peak_by_ac
    line = ", ".join(f"{mode} {peaks[mode] / 2**30:.1f}" for mode in peaks)
    out = f"\n  device peak per activation mode (--ac), GiB: {line}"
    if device_gib is not None:
        fits = [mode for mode in peaks if peaks[mode] <= device_gib * 2**30]
        verdict = ", ".join(fits) if fits else "none of them: shard over more ranks"
        out += f"\n  fits in {device_gib:g} GiB: {verdict}"
    return out


def _nf4_line(result: Plan) -> list[str]:
    """QLoRA: the part of the parameters' memory that its NF4 bases take."""
    nf4 = sum(u.nf4 * u.count for u in result.units) // result.setup.dp_shard
    return [f"      of which NF4 bases (QLoRA)    {_gib(nf4)}"] if nf4 else []


def format_plan(result: Plan) -> str:
    s, m, c = result.setup, result.memory, result.communication
    mesh = f"{s.world_size} ranks (dp_shard {s.dp_shard // s.cp}"
    mesh += f", dp_replicate {s.dp_replicate}" if s.dp_replicate > 1 else ""
    mesh += f", tp {s.tp}" + (" + SP" if s.sp else "") if s.tp > 1 else ""
    mesh += f", cp {s.cp}" if s.cp > 1 else ""
    mesh += f", ep {s.ep})" if s.ep > 1 else ")"
    lines = [
        f"flatshard plan: {result.model}, {_size(result.num_params)} parameters, on {mesh}",
        f"  ZeRO-{s.zero_stage} ({s.backend}), {s.param_dtype} compute, {s.reduce_dtype} "
        f"gradient reduction, fp32 weights and {s.optimizer_name} state; micro batch "
        f"{s.micro_batch} x {s.seq_len} tokens, {s.grad_accum} micro-batch(es) per step"
        + (
            f"; each sequence split over {s.cp} ranks ({s.seq_len // s.cp} tokens each), the "
            f"units over dp_shard x cp = {s.dp_shard}"
            if s.cp > 1
            else ""
        ),
        "",
        f"  {'unit (one fully_shard call)':<32}{'params':>10}{'per rank':>11}{'padding':>10}"
        f"{'buckets':>9}",
    ]
    for unit in result.units:
        name = unit.name + (f" (x{unit.count})" if unit.count > 1 else "")
        padding = 100 * unit.padding / unit.numel if unit.numel else 0.0
        lines.append(
            f"  {name:<32}{_size(unit.numel):>10}{_size(unit.shard):>11}{padding:>9.3f}%"
            f"{unit.buckets:>9}"
        )
    largest = max(result.units, key=lambda u: u.padded).name
    lines += [
        "",
        "  per-rank memory",
        f"    parameters (fp32 shards)        {_gib(m['params'])}",
        *_nf4_line(result),
        f"    gradients (fp32 shards)         {_gib(m['grads'])}",
        f"    {'optimizer state (' + s.optimizer_name + ')':<32}{_gib(m['optimizer'])}",
        *(
            [f"    qgZ error feedback (fp32)       {_gib(m['error_feedback'])}"]
            if m["error_feedback"]
            else []
        ),
        f"    largest unsharded unit          {_gib(m['largest_unsharded_unit'])}  ({largest})",
        f"    unsharded working set           {_gib(m['unsharded_working_set'])}",
        f"    {'activations (AC ' + result.setup.ac + ')':<32}{_gib(m['activations'])}",
        f"    total (peak estimate)           {_gib(m['total'])}",
        *_offload_lines(s, m),
        f"    offload_states frees (RL)       {_gib(m['offload_states'])}  (between steps)",
        "",
        f"  padding: {100 * result.padding_fraction:.4f}% of parameter elements",
        "  communication per step, per rank (collective payload)",
        f"    all-gather                      {_gib(c['all_gather'])}"
        + (f"  (weights in {s.quantize_weights})" if s.quantize_weights != "none" else "")
        + (f"  (gradients in {s.quantize_grads})" if s.quantize_grads != "none" else ""),
    ]
    if c["all_gather_in_hpz_groups"]:
        in_groups = _gib(c["all_gather_in_hpz_groups"])
        lines.append(f"      of which in hpZ groups of {s.hpz_group:<4}{in_groups}")
    lines.append(f"    reduce-scatter                  {_gib(c['reduce_scatter'])}")
    if c["replica_all_reduce"]:
        lines.append(f"    replica all-reduce (HSDP)       {_gib(c['replica_all_reduce'])}")
    if c["tp_all_reduce"]:
        lines.append(f"    TP all-reduce (activations)     {_gib(c['tp_all_reduce'])}")
    if c["tp_all_gather"]:
        lines.append(f"    TP all-gather (SP activations)  {_gib(c['tp_all_gather'])}")
        lines.append(f"    TP reduce-scatter (SP)          {_gib(c['tp_reduce_scatter'])}")
    if c["cp_all_gather"]:
        lines.append(f"    CP all-gather (keys, values)    {_gib(c['cp_all_gather'])}")
        lines.append(f"    CP reduce-scatter (their grads) {_gib(c['cp_reduce_scatter'])}")
    if c["ep_all_to_all"]:
        lines.append(f"    EP all-to-all (tokens)          {_gib(c['ep_all_to_all'])}")
    wire = c["wire_per_rank"] + c["tp_wire_per_rank"] + c["ep_wire_per_rank"]
    wire += c["cp_wire_per_rank"]
    lines.append(f"    on the wire (ring algorithms)   {_gib(wire)}")
    k = result.checkpoint
    total, each = _gib(k["bytes"]).strip(), _gib(k["bytes_per_writer"]).strip()
    lines += [
        "",
        f"  checkpoint: {total} (fp32 weights and {s.optimizer_name} state) in {k['files']:,} "
        f"files: {k['writers']:,} ranks write {each} each, about {k['save_seconds']:.1f} s at "
        f"{s.write_gbps:g} GB/s per rank (--write-gbps)",
    ]
    if result.muon is not None:
        lines += ["", *muon_lines(result.muon)]
    return "\n".join(lines)
