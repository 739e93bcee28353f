"""Benchmark flatshard ZeRO-3/2/1 against one process, DDP and PyTorch FSDP2 (CPU, gloo).

One invocation trains the same Llama-style model, from the same seed on the same data, in
every mode, inside one set of spawned worker processes (one gloo process group):

    single   one process, the whole global batch (runs on rank 0; the other ranks wait)
    DDP      torch.nn.parallel.DistributedDataParallel
    FSDP2    torch.distributed.fsdp.fully_shard per block, then the root
    ZeRO-3/2/1  flatshard.fully_shard(..., zero_stage=3|2|1) per block, then the root

Modes are interleaved: in every round each mode is built fresh, trained for warm-up +
timed steps and freed, and every other round runs the modes in reverse order, so a drift
of a shared machine hits all modes alike. `--steps N` is the number of timed steps per mode in all,
spread over `--rounds` (default 2); every build also runs `--warmup` (default 1) untimed
steps first. Each rank runs torch with one thread.

    python benchmarks/compare.py --preset 35m --steps 6
    python benchmarks/compare.py --preset 35m --steps 6 --param-dtype bf16 --append

It writes a markdown section (machine, torch version, date, exact command, table, notes)
to --out and prints it. The modes and model are in bench_modes.py, the counting of
collectives in comm_counter.py, the table and notes in bench_report.py.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
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
    DTYPES,
    FLATSHARD_STAGES,
    LR,
    MODE_NAMES,
    MODES,
    PRESETS,
    WEIGHT_DECAY,
    LlamaConfig,
    build_mode,
    make_config,
    make_data,
)
from bench_report import cpu_model, cpu_vector_isa, git_revision, mem_total_gib, render, summarize
from comm_counter import COUNTER, nbytes

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT_MEMORY_MMAP_THRESHOLD = 65536

# --- memory ----------------------------------------------------------------------------


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _release_free_memory() -> None:
    """Collect garbage and hand freed malloc memory back to the OS, so the resident set at
    the start of a mode is what is really alive (glibc keeps freed heap pages otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _local_nbytes(tensor) -> int:
    to_local = getattr(tensor, "to_local", None)
    return nbytes(to_local() if to_local is not None else tensor)


def state_bytes(optimizer) -> dict[str, int]:
    """Bytes this rank holds of the optimizer's parameters, their gradients and its state."""
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}.values()
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for param in params:
        out["params"] += _local_nbytes(param)
        if param.grad is not None:
            out["grads"] += _local_nbytes(param.grad)
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor):
                out["optimizer"] += _local_nbytes(value)
    return out


def _units(model) -> list:
    """flatshard's units, once each (a first-use group spans several modules)."""
    found = (getattr(m, "_flatshard_unit", None) for m in model.modules())
    return list(dict.fromkeys(u for u in found if u is not None))


def padding_info(model) -> dict | None:
    units = _units(model)
    if not units:
        return None
    padding = sum(u.layout.padding for u in units)
    used = sum(u.layout.used_size for u in units)
    return {"padding": padding, "used": used, "units": len(units)}


def zero3_wire_bytes(model, world: int) -> dict:
    """What one ZeRO-3 step sends per rank, from the layout: (N-1)/N x (every bucket
    gathered in forward, again in backward unless its unit stays gathered through backward
    (the model root's parts, as FSDP2 keeps its root), every trainable bucket reduced), and
    the textbook count: every bucket gathered twice and reduced once (in fp32: 3 x padded
    parameter bytes x (N-1)/N)."""
    gathered = kept = reduced = 0
    for unit in _units(model):
        stays = unit.kept_through_backward or unit is unit.context.root
        for bucket in unit.buckets:
            size = bucket.layout.padded_size * bucket.param_dtype.itemsize
            gathered += size
            kept += size if stays else 0
            if bucket.layout.requires_grad:
                reduced += bucket.layout.padded_size * bucket.reduce_dtype.itemsize
    share = (world - 1) / world
    return {
        "analytic": share * (2 * gathered - kept + reduced),
        "textbook": share * (2 * gathered + reduced),
        "kept": share * kept,
    }


def resident_unsharded_bytes(model) -> int:
    """Bytes of flatshard's unsharded parameter and gradient buffers still allocated
    between steps (after `zero_grad`): ZeRO-1/2 keep some, ZeRO-3 none."""
    total = 0
    for module in model.modules():
        unit = getattr(module, "_flatshard_unit", None)
        for bucket in getattr(unit, "buckets", ()):
            for buffer in (
                getattr(bucket, "unsharded", None),
                getattr(bucket, "unsharded_grad", None),
            ):
                if isinstance(buffer, torch.Tensor):
                    total += buffer.untyped_storage().nbytes()
    return total


def run_mode(mode: str, cfg: LlamaConfig, data: list[torch.Tensor], opts: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    warmup = opts["warmup"]
    _release_free_memory()
    dist.barrier()
    if mode == "single" and rank != 0:
        dist.barrier()  # rank 0 trains alone meanwhile
        return {"idle": True}
    peak_reset = _reset_peak_rss()
    rss_start = _proc_status_kib("VmRSS")
    t_build = time.perf_counter()
    model, forward_loss, backward = build_mode(mode, cfg, DTYPES[opts["param_dtype"]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    build_s = time.perf_counter() - t_build
    if mode == "ddp":
        param_bytes = sum(
            p.numel() * 4 if p.dtype.is_floating_point else nbytes(p)
            for p in model.parameters()
            if p.requires_grad
        )
    losses, phases, comm, sizes = [], [], [], None
    for step, tokens in enumerate(data):
        local = tokens if mode == "single" else _rank_slice(tokens, rank, world)
        if mode != "single":
            dist.barrier()  # every rank starts the step together
        timed = step >= warmup
        COUNTER.reset()
        COUNTER.active = timed
        t0 = time.perf_counter()
        loss = forward_loss(local)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if step == len(data) - 1:
            sizes = state_bytes(optimizer)  # after the step, before the gradients go
        t4 = time.perf_counter()
        optimizer.zero_grad()
        t5 = time.perf_counter()
        COUNTER.active = False
        losses.append(loss.item())
        if timed:
            phases.append((t1 - t0, t2 - t1, (t3 - t2) + (t5 - t4)))
            comm.append(dict(COUNTER.bytes) | {"calls": dict(COUNTER.calls)})
    peak_kib = _proc_status_kib("VmHWM")
    result = {
        "idle": False,
        "losses": losses,
        "phases": phases,
        "comm": comm,
        "state": sizes,
        "peak_rss_kib": peak_kib,
        "rss_start_kib": rss_start,
        "peak_reset": peak_reset,
        "build_s": build_s,
        "padding": padding_info(model) if mode in FLATSHARD_STAGES else None,
        "zero3_wire": zero3_wire_bytes(model, world) if mode == "zero3" else None,
        "resident": resident_unsharded_bytes(model) if mode in FLATSHARD_STAGES else None,
    }
    if mode == "ddp":
        result["ddp_param_bytes"] = param_bytes
        # After the run (and after reading the peak RSS): DDP uses one bucket for its first
        # step, then rebuilds buckets in backward order. Private API, hence the fallback.
        try:
            buckets = model.reducer._get_zeros_like_grad_buckets()
            result["ddp_bucket_sizes"] = [nbytes(b.buffer()) for b in buckets]
        except (AttributeError, RuntimeError):
            result["ddp_bucket_sizes"] = None
    del model, optimizer, forward_loss, backward, loss
    if mode == "single":
        dist.barrier()  # release the waiting ranks
    else:
        # Global mean loss of every step (outside the counted window).
        total = torch.tensor(result["losses"], dtype=torch.float64)
        dist.all_reduce(total)
        result["losses"] = (total / world).tolist()
    return result


def _rank_slice(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = tokens.shape[0] // world
    return tokens[rank * per_rank : (rank + 1) * per_rank]


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
            for mode in order:
                t0 = time.perf_counter()
                results[mode].append(run_mode(mode, cfg, data, opts))
                if rank == 0:
                    print(
                        f"[round {round_index + 1}/{opts['rounds']}] {MODE_NAMES[mode]}: "
                        f"{time.perf_counter() - t0:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        gathered: list = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            with open(result_path, "w") as out:
                json.dump(gathered, out)
    finally:
        dist.destroy_process_group()
    exit_worker()  # results are on disk


def exit_worker() -> None:
    """End a worker process without interpreter teardown: gloo's threads sometimes abort
    the process there ("terminate called without an active exception"), failing the run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    parser.add_argument("--param-dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "RESULTS.md"))
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
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        parser.error(f"unknown modes {unknown}; choose from {MODES}")
    args.modes = [m for m in MODES if m in modes]
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
    }
    argv_shown = sys.argv[1:] if argv is None else list(argv)
    script = os.path.relpath(os.path.abspath(__file__), os.getcwd())
    meta = {
        "command": shlex.join(["python", script, *argv_shown]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        **dict(zip(("isa", "native_bf16"), cpu_vector_isa())),
        "cores": os.cpu_count(),
        "mem_gib": mem_total_gib(),
        "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "git": git_revision(),
        "note": args.note,
        "exact_memory": EXACT_MEMORY_MMAP_THRESHOLD if args.exact_memory else None,
    }
    if args.exact_memory:  # read by glibc when the spawned workers start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(EXACT_MEMORY_MMAP_THRESHOLD)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "results.json")
        mp.start_processes(
            worker,
            args=(args.world, free_port(), opts, result_path),
            nprocs=args.world,
            join=True,
            start_method="spawn",
        )
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
