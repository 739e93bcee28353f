"""Benchmark flatshard ZeRO-3/2/1 against one process, DDP and PyTorch FSDP2 (CPU, gloo).

One invocation trains the same Llama-style model, from the same seed on the same data, in
every mode, inside one set of worker processes (one gloo process group):

    single   one process, the whole global batch (runs on rank 0; the other ranks wait)
    DDP      torch.nn.parallel.DistributedDataParallel
    FSDP2    torch.distributed.fsdp.fully_shard per block, then the root
    ZeRO-3/2/1  flatshard.fully_shard(..., zero_stage=3|2|1) per block, then the root

and on request (--modes) HSDP, hpZ, and tensor parallelism (`fsdp2-tp`, `tp3`:
flatshard.models.llama.parallelize_llama over 2 ranks, then FSDP2's or flatshard's fully_shard
over the data-parallel dim of a (world / 2, 2) mesh; every rank of a TP group trains on its
data-parallel rank's slice of the same global batch), long-sequence modes (`fsdp2-sp`,
`sp3`: TP with sequence parallelism; `cp3`: flatshard's context parallelism over 2 ranks,
beside `fsdp2`/`zero3` on the same tokens), and with an MoE preset (`tiny-moe`,
`moe-small`) the MoE modes: `fsdp2-moe` and `moe3` (FSDP2's or flatshard's fully_shard per
block and root, no expert parallelism) and `ep3` (flatshard ZeRO-3 with
flatshard.parallel.ExpertParallel over 2 ranks, experts sharded over world / 2); every rank
trains on its own slice, the loss adds the load-balancing loss over all ranks; and
optimizer offload: `fsdp2-cpuoff` (FSDP2 with CPUOffloadPolicy), `off50` and `off100`
(flatshard ZeRO-3 with OffloadPolicy(0.5) / (1.0): that share of each rank's main weights,
gradients and AdamW state on the host) and `offdisk` (OffloadPolicy(1.0, path=a temporary
directory per rank): the AdamW state in memory-mapped files, paged in a piece at a time);
plain `fsdp2` and `zero3` are their f = 0 rows. On a CPU "device" and host are the same
memory: the host tier shows its copy overheads, the disk tier its lower peak RSS (run them
with --exact-memory).

Modes are interleaved so that a drift of a shared machine hits all of them alike; every
other round runs them in reverse order. `--interleave modes` (default): in every round each
mode is built fresh, trained for warm-up + timed steps and freed, so its peak memory is its
own. `--interleave steps`: in every round every mode is built, then they take one step each
in turn (the order reversed every step), so each mode's n-th step runs within seconds of
the others' and the ratios are taken step by step; use it for timings on a noisy machine,
the default for memory. `--steps N` is the number of timed steps per mode in all, spread
over `--rounds` (default 2); every build also runs `--warmup` (default 1) untimed steps
first. Each rank runs torch with one thread.

    python benchmarks/compare.py --preset 35m --steps 6
    python benchmarks/compare.py --preset 35m --steps 12 --rounds 4 --interleave steps
    python benchmarks/compare.py --preset 35m --steps 6 --param-dtype bf16 --append
    python benchmarks/compare.py --world 4 --preset moe-small --modes fsdp2-moe,moe3,ep3
    python benchmarks/compare.py --preset 35m --exact-memory \
        --modes fsdp2,fsdp2-cpuoff,zero3,off50,off100,offdisk

It writes a markdown section (machine, torch version, date, exact command, table, notes)
to --out (default benchmarks/RESULTS-runs.md, not committed; copy sections into RESULTS.md
by hand) and prints it. The modes and model are in bench_modes.py, the counting of
collectives in comm_counter.py, the table and notes in bench_report.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_modes import (
    AC_MODES,
    COMPILE_MODES,
    CP_DEGREE,
    DTYPES,
    EP_DEGREE,
    FLAT_OPTIMIZER_MODES,
    FUSED_OPTIMIZER_MODES,
    HSDP_MODES,
    LONG_MODES,
    MODE_NAMES,
    MODES,
    MOE_MODES,
    MUON_MODES,
    OFFLOAD_MODES,
    PRESETS,
    QUANTIZED_MODES,
    SP_MODES,
    TP_DEGREE,
    TP_MODES,
    is_moe,
    make_config,
    make_data,
)
from bench_report import cpu_model, cpu_vector_isa, git_revision, mem_total_gib, render, summarize
from comm_counter import COUNTER
from mode_run import ModeRun

from flatshard.comm import devices
from flatshard.errors import MeshError
from flatshard.models.llama import check_tp

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT_MEMORY_MMAP_THRESHOLD = 65536


def worker(rank: int, world: int, port: int, opts: dict, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(hours=2),
    )
    try:
        COUNTER.install()
        cfg = make_config(opts["preset"])
        preset = PRESETS[opts["preset"]]
        global_batch = preset["micro_batch"] * world
        data = make_data(cfg, opts["warmup"] + opts["steps_per_round"], global_batch, preset["seq"])
        results: dict[str, list] = {mode: [] for mode in opts["modes"]}
        for round_index in range(opts["rounds"]):
            # A B C ... then ... C B A: a linear drift of the machine cancels out in pairs.
            order = opts["modes"] if round_index % 2 == 0 else opts["modes"][::-1]
            label = f"[round {round_index + 1}/{opts['rounds']}]"
            if opts["interleave"] == "steps":
                for mode, result in _run_side_by_side(order, cfg, data, opts, label).items():
                    results[mode].append(result)
            else:
                for mode in order:
                    results[mode].append(_run_alone(mode, cfg, data, opts, label))
        gathered: list = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            with open(result_path, "w") as out:
                json.dump(gathered, out)
    finally:
        dist.destroy_process_group()
    exit_worker()  # results are on disk


def _run_alone(mode: str, cfg, data: list[torch.Tensor], opts: dict, label: str) -> dict:
    """Build `mode`, train it for every step, free it: its peak memory is its own."""
    t0 = time.perf_counter()
    run = ModeRun(mode, cfg, opts, own_memory=True)
    for index, tokens in enumerate(data):
        run.step(tokens, timed=index >= opts["warmup"], last=index == len(data) - 1)
    result = run.finish()
    _progress(f"{label} {MODE_NAMES[mode]}: {time.perf_counter() - t0:.1f} s")
    return result


def _run_side_by_side(order: list[str], cfg, data, opts: dict, label: str) -> dict[str, dict]:
    """Build every mode, then train one step of each in turn: the same seconds of the
    machine for every mode's n-th step (peak memory is then not any one mode's)."""
    t0 = time.perf_counter()
    runs = {mode: ModeRun(mode, cfg, opts, own_memory=False) for mode in order}
    for index, tokens in enumerate(data):
        # ABC then CBA: the mode that runs first (after the others' frees) takes turns.
        step_order = order if index % 2 == 0 else order[::-1]
        for mode in step_order:
            runs[mode].step(tokens, timed=index >= opts["warmup"], last=index == len(data) - 1)
    results = {mode: runs[mode].finish() for mode in order}
    _progress(f"{label} {len(order)} modes side by side: {time.perf_counter() - t0:.1f} s")
    return results


def _progress(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def exit_worker() -> None:
    """End a worker process without interpreter teardown: gloo's threads sometimes abort
    the process there ("terminate called without an active exception"), failing the run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_workers(worker, args: tuple, world: int, start_method: str | None = None) -> None:
    """worker(rank, *args) on `world` local processes, until all end: started as flatshard's
    launcher starts ranks (forked where that is safe, so torch is imported once, not once
    a rank) unless `start_method` says otherwise."""
    start_method = start_method or devices.process_start_method()
    mp.start_processes(worker, args=args, nprocs=world, join=True, start_method=start_method)


def worker_queue():
    """A queue the workers of `start_workers` put their results in."""
    return mp.get_context(devices.process_start_method()).SimpleQueue()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="35m")
    parser.add_argument(
        "--steps", type=int, help="timed steps per mode in all (spread over the rounds)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per build")
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaving rounds (each rebuilds every mode)"
    )
    parser.add_argument(
        "--interleave",
        choices=("modes", "steps"),
        default="modes",
        help="modes: one mode built and trained at a time (its own peak memory); steps: "
        "every mode built, one step of each in turn (timings on a noisy machine)",
    )
    parser.add_argument("--param-dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument(
        "--modes",
        help="comma-separated subset (default: the Llama modes, or with an MoE preset "
        "single and the MoE modes); also HSDP/hpZ (fsdp2-hsdp, hsdp3, fsdp2-hpz, hpz3), TP "
        "(fsdp2-tp, tp3), optimizer offload (fsdp2-cpuoff, off50, off100, offdisk) and the flat "
        "AdamW (zero3f, zero1f) and fused AdamW on each (fsdp2-fused, zero3ff), Muon "
        "(fsdp2-muon, zero3m, zero3tm)",
    )
    # not RESULTS.md: that file is curated (sections copied in by hand); a run writing
    # to it by default once replaced every earlier section
    parser.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "RESULTS-runs.md"))
    parser.add_argument("--append", action="store_true", help="append to --out")
    parser.add_argument("--note", help="a line to add to the report (e.g. machine sharing)")
    parser.add_argument(
        "--exact-memory",
        action="store_true",
        help="workers run with MALLOC_MMAP_THRESHOLD_=65536, so glibc returns every freed "
        "tensor to the system and peak RSS is the peak of live memory (slower steps)",
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = PRESETS[args.preset]["steps"]
    moe = is_moe(args.preset)
    if args.modes is None:
        args.modes = ",".join(["single", *MOE_MODES] if moe else MODES)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    known = MODES + HSDP_MODES + TP_MODES + LONG_MODES + MOE_MODES + OFFLOAD_MODES + COMPILE_MODES
    known += AC_MODES + FLAT_OPTIMIZER_MODES + FUSED_OPTIMIZER_MODES + MUON_MODES
    known = list(dict.fromkeys(known + list(QUANTIZED_MODES)))  # zero3ff is in two lists
    unknown = sorted(set(modes) - set(known))
    if unknown or not modes:
        parser.error(f"unknown modes {unknown}; choose from {known}")
    moe_ok = {"single", *MOE_MODES}
    if moe and set(modes) - moe_ok:
        parser.error(f"MoE preset {args.preset}: choose --modes from {sorted(moe_ok)}")
    if not moe and set(modes) & set(MOE_MODES):
        parser.error("the MoE modes need an MoE preset (--preset tiny-moe or moe-small)")
    if "ep3" in modes:
        n_experts = make_config(args.preset).n_experts
        if args.world % EP_DEGREE or n_experts % EP_DEGREE:
            parser.error(
                f"ep3 needs --world and the preset's experts ({n_experts}) divisible by "
                f"{EP_DEGREE} (the EP degree)"
            )
    if set(modes) & set(HSDP_MODES) and args.world % 2:
        parser.error("the HSDP and hpZ modes need an even --world (groups of 2)")
    seq = PRESETS[args.preset]["seq"]
    if "cp3" in modes and (args.world % CP_DEGREE or seq % (2 * CP_DEGREE)):
        parser.error(
            f"cp3 needs --world divisible by {CP_DEGREE} (the CP degree) and the preset's "
            f"sequence ({seq}) by {2 * CP_DEGREE} (its load-balanced chunks)"
        )
    if set(modes) & set(TP_MODES + SP_MODES):
        if args.world % TP_DEGREE:
            parser.error(f"the TP modes need a --world divisible by {TP_DEGREE} (the TP degree)")
        try:
            check_tp(make_config(args.preset), TP_DEGREE)
        except MeshError as error:
            parser.error(f"the TP modes: preset {args.preset}: {error} (try --preset tiny-tp)")
    args.modes = [m for m in known if m in modes]
    if args.world < 1 or args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--world, --steps and --rounds must be >= 1, --warmup >= 0")
    args.rounds = min(args.rounds, args.steps)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = {
        "preset": args.preset,
        "world": args.world,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "steps_per_round": math.ceil(args.steps / args.rounds),
        "param_dtype": args.param_dtype,
        "modes": args.modes,
        "interleave": args.interleave,
    }
    argv_shown = sys.argv[1:] if argv is None else list(argv)
    script = os.path.relpath(os.path.abspath(__file__), os.getcwd())
    isa, native_bf16 = cpu_vector_isa()
    meta = {
        "command": shlex.join(["python", script, *argv_shown]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "isa": isa,
        "native_bf16": native_bf16,
        "cores": os.cpu_count(),
        "mem_gib": mem_total_gib(),
        "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "git": git_revision(),
        "note": args.note,
        "exact_memory": EXACT_MEMORY_MMAP_THRESHOLD if args.exact_memory else None,
    }
    if args.exact_memory:  # read by glibc as the (spawned) workers start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(EXACT_MEMORY_MMAP_THRESHOLD)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "results.json")
        # spawned for exact memory: glibc reads MALLOC_MMAP_THRESHOLD_ as a process starts
        start_workers(worker, (args.world, free_port(), opts, result_path), args.world,
                      "spawn" if args.exact_memory else None)  # fmt: skip
        with open(result_path) as results:
            gathered = json.load(results)
    meta["wall_s"] = time.perf_counter() - start
    meta["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    section = render(summarize(gathered, args.modes), opts, meta)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    if args.append and os.path.exists(args.out):
        with open(args.out, "a") as out:
            out.write("\n" + section)
    else:
        with open(args.out, "w") as out:
            out.write("# flatshard benchmark results\n\n" + section)
    print(section)
    losses = [
        loss
        for per_rank in gathered
        for runs in per_rank.values()
        for run in runs
        if not run["idle"]
        for loss in run["losses"]
    ]
    if not all(math.isfinite(loss) for loss in losses):
        print("ERROR: non-finite losses", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
