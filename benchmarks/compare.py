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
to --out and prints it.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `import flatshard` from a checkout without an install
    sys.path.insert(0, _ROOT)

import flatshard  # noqa: E402
from flatshard.models import Llama, LlamaConfig  # noqa: E402

# --- configuration ---------------------------------------------------------------------

PRESETS = {
    # LlamaConfig.tiny(): mixed row counts (vocab 61, gate_up 90 rows) so padding shows.
    "tiny": dict(
        cfg=dict(
            vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=45, max_seq_len=64
        ),
        seq=16,
        micro_batch=2,
        steps=3,
    ),
    # 35.5M parameters: GQA (8 query / 4 kv heads), SwiGLU 1376, untied 12k vocab.
    "35m": dict(
        cfg=dict(
            vocab_size=12000,
            dim=512,
            n_layers=8,
            n_heads=8,
            n_kv_heads=4,
            ffn_dim=1376,
            max_seq_len=256,
        ),
        seq=256,
        micro_batch=4,
        steps=6,
    ),
    # 124.7M parameters.
    "120m": dict(
        cfg=dict(
            vocab_size=32000,
            dim=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=4,
            ffn_dim=2048,
            max_seq_len=256,
        ),
        seq=256,
        micro_batch=4,
        steps=4,
    ),
}

MODES = ["single", "ddp", "fsdp2", "zero3", "zero2", "zero1"]
MODE_NAMES = {
    "single": "single process",
    "ddp": "DDP",
    "fsdp2": "FSDP2",
    "zero3": "flatshard ZeRO-3",
    "zero2": "flatshard ZeRO-2",
    "zero1": "flatshard ZeRO-1",
}
FLATSHARD_STAGES = {"zero3": 3, "zero2": 2, "zero1": 1}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_SEED, DATA_SEED = 0, 1
LR, WEIGHT_DECAY = 1e-3, 0.1


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


# --- collective accounting ----------------------------------------------------------------


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


EXACT_MEMORY_MMAP_THRESHOLD = 65536
COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")
# Bytes each rank sends per counted byte of a collective, as (N-1)/N multiples, for the
# algorithms gloo runs: ring all-gather, all-to-all and ring all-reduce (reduce-scatter +
# all-gather); gloo's reduce-scatter clones its input and all-reduces all of it.
WIRE_FACTOR = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2, "all_to_all": 1}
COUNTED_NAME = {
    "all_gather": "all_gather_single",
    "reduce_scatter": "reduce_scatter_single",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all_single",
    "send": "isend",
}


def wire_bytes(comm: dict, world: int) -> float:
    """Bytes one rank sends per step: the collectives (see WIRE_FACTOR) and its sends."""
    collectives = sum(WIRE_FACTOR[k] * comm[k] for k in WIRE_FACTOR) * (world - 1) / world
    return collectives + comm["send"]


def gathered_bytes(comm: dict, world: int) -> float:
    """All-gathered bytes: by `all_gather_single`, or by point-to-point sends of a shard to
    each of the N-1 peers (flatshard on gloo, see flatshard/comm.py)."""
    return comm["all_gather"] + (comm["send"] * world / (world - 1) if world > 1 else 0)


def reduced_bytes(comm: dict) -> float:
    """Reduce-scattered input bytes: by `reduce_scatter_single`, or by one all-to-all of the
    input and a local sum (flatshard on gloo)."""
    return comm["reduce_scatter"] + comm["all_to_all"]


class CommCounter:
    """Counts calls and bytes of the Python-level collectives while `active`.

    all-gather: bytes of the gathered (output) tensor; reduce-scatter: bytes of the input
    that is reduced; all-reduce: bytes of the tensor; all-to-all: bytes of the input (flatshard
    reduce-scatters that way on gloo); send: bytes of each `isend` (flatshard all-gathers that
    way on gloo). Nested calls (a deprecated name that forwards to its `*_single`
    replacement) count once.
    """

    # name: (kind, position of the counted tensor, its keyword)
    WRAPPED = {
        "all_gather_single": ("all_gather", 0, "output_tensor"),
        "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
        "reduce_scatter_single": ("reduce_scatter", 1, "input"),
        "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
        "all_reduce": ("all_reduce", 0, "tensor"),
        "all_to_all_single": ("all_to_all", 1, "input"),
        "isend": ("send", 0, "tensor"),
    }

    def __init__(self) -> None:
        self.active = False
        self._local = threading.local()
        self.reset()

    def reset(self) -> None:
        self.bytes = dict.fromkeys(COMM_KINDS, 0)
        self.calls = dict.fromkeys(COMM_KINDS, 0)

    def install(self) -> None:
        c10d = dist.distributed_c10d
        for name, spec in self.WRAPPED.items():
            original = getattr(c10d, name)
            wrapper = self._wrap(original, *spec)
            for namespace in (dist, c10d):
                if getattr(namespace, name, None) is original:
                    setattr(namespace, name, wrapper)

    def _wrap(self, original, kind: str, position: int, keyword: str):
        counter = self

        def counted(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if counter.active and depth == 0:
                tensor = args[position] if len(args) > position else kwargs.get(keyword)
                if isinstance(tensor, torch.Tensor):
                    counter.bytes[kind] += _nbytes(tensor)
                counter.calls[kind] += 1
            counter._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.depth = depth

        counted.__wrapped__ = original
        counted.__name__ = original.__name__
        return counted


COUNTER = CommCounter()


# --- models and training -----------------------------------------------------------------


def make_config(preset: str) -> LlamaConfig:
    return LlamaConfig(**PRESETS[preset]["cfg"])


def make_data(cfg: LlamaConfig, steps: int, global_batch: int, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(DATA_SEED)
    return [
        torch.randint(0, cfg.vocab_size, (global_batch, seq + 1), generator=generator)
        for _ in range(steps)
    ]


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(cfg: LlamaConfig) -> Llama:
    torch.manual_seed(MODEL_SEED)
    return Llama(cfg)


class SingleProcess:
    """The reference: one process, the global batch. With a low param dtype it does what
    FSDP2's MixedPrecisionPolicy does: fp32 main weights (and optimizer), a param-dtype
    compute copy refreshed every step, gradients cast back to fp32."""

    def __init__(self, cfg: LlamaConfig, param_dtype: torch.dtype) -> None:
        self.main = build_model(cfg)
        self.compute = None
        if param_dtype != torch.float32:
            self.compute = copy.deepcopy(self.main).to(param_dtype)
            for param in self.compute.parameters():
                param.grad = None

    def parameters(self):
        return self.main.parameters()

    def forward_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.compute is None:
            return lm_loss(self.main, tokens)
        with torch.no_grad():
            for low, full in zip(self.compute.parameters(), self.main.parameters()):
                low.copy_(full)
        return lm_loss(self.compute, tokens)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.compute is not None:
            for low, full in zip(self.compute.parameters(), self.main.parameters()):
                full.grad = low.grad.float()
                low.grad = None


def build_mode(mode: str, cfg: LlamaConfig, param_dtype: torch.dtype):
    """Returns (model, loss function, backward function)."""
    if mode == "single":
        model = SingleProcess(cfg, param_dtype)
        return model, model.forward_loss, model.backward
    model = build_model(cfg)
    low = param_dtype != torch.float32
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if low:
            # DDP's own `_MixedPrecision` records CUDA events and fails on CPU: use autocast
            # (fp32 weights and gradients, matmuls in param_dtype).
            def autocast_loss(tokens):
                with torch.autocast("cpu", dtype=param_dtype):
                    return lm_loss(model, tokens)

            return model, autocast_loss, (lambda loss: loss.backward())
    elif mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy if low else MixedPrecisionPolicy())
        fully_shard(model, mp_policy=policy if low else MixedPrecisionPolicy())
    else:
        stage = FLATSHARD_STAGES[mode]
        policy = flatshard.MixedPrecisionPolicy(
            param_dtype=param_dtype if low else None, reduce_dtype=torch.float32 if low else None
        )
        for layer in model.layers:
            flatshard.fully_shard(layer, zero_stage=stage, mp_policy=policy)
        flatshard.fully_shard(model, zero_stage=stage, mp_policy=policy)
    return model, (lambda tokens: lm_loss(model, tokens)), (lambda loss: loss.backward())


def _local_nbytes(tensor) -> int:
    to_local = getattr(tensor, "to_local", None)
    return _nbytes(to_local() if to_local is not None else tensor)


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
    the textbook 3 x padded parameter bytes x (N-1)/N."""
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
        "textbook": share * 3 * gathered,
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
            p.numel() * 4 if p.dtype.is_floating_point else _nbytes(p)
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
            result["ddp_bucket_sizes"] = [_nbytes(b.buffer()) for b in buckets]
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


# --- report ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return float("nan")


def _git_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _fmt_ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}" if reference else "n/a"


def _fmt_bytes(n: float) -> str:
    """Bytes with a binary unit and 3 significant digits: 512 B, 75.4 KiB, 137 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1000 or unit == "GiB":
            break
        n /= 1024
    if unit == "B":
        return f"{n:.0f} B"
    return f"{n:.3g} {unit}"


def _fmt_rel(value: float | None) -> str:
    if value is None:
        return "—"
    return "0" if value == 0 else f"{value:.1e}"


def _max_rel(ours: list[list[float]], theirs: list[list[float]]) -> float:
    worst = 0.0
    for a_round, b_round in zip(ours, theirs):
        for a, b in zip(a_round, b_round):
            worst = max(worst, abs(a - b) / abs(b))
    return worst


def summarize(gathered: list[dict], modes: list[str]) -> dict[str, dict]:
    """Per mode: step and phase medians over timed steps (each step: the slowest rank),
    peak RSS per rank, state bytes per rank, collective bytes per step, padding, losses."""
    world = len(gathered)
    out = {}
    for mode in modes:
        per_rank = [gathered[r][mode] for r in range(world)]
        active = [r for r in range(world) if not per_rank[r][0]["idle"]]
        rounds = len(per_rank[active[0]])
        steps, fwd, bwd, opt, round_steps = [], [], [], [], []
        for i in range(rounds):
            for s in range(len(per_rank[active[0]][i]["phases"])):
                rows = [per_rank[r][i]["phases"][s] for r in active]
                steps.append(max(sum(row) for row in rows))
                fwd.append(max(row[0] for row in rows))
                bwd.append(max(row[1] for row in rows))
                opt.append(max(row[2] for row in rows))
            round_steps.append(statistics.median(steps[-len(per_rank[active[0]][i]["phases"]) :]))
        lead = per_rank[active[0]]
        comm_steps = [c for run in lead for c in run["comm"]]
        comm = {
            kind: statistics.mean(c[kind] for c in comm_steps) if comm_steps else 0
            for kind in COMM_KINDS
        }
        calls = {
            kind: statistics.mean(c["calls"][kind] for c in comm_steps) if comm_steps else 0
            for kind in COMM_KINDS
        }
        summary = {
            "step": statistics.median(steps),
            "fwd": statistics.median(fwd),
            "bwd": statistics.median(bwd),
            "opt": statistics.median(opt),
            "timed_steps": len(steps),
            "round_steps": round_steps,
            # Min over rounds: the first round also pays one-time (first use) allocations.
            "peak_rss": [
                None if r not in active else min(run["peak_rss_kib"] for run in per_rank[r]) / 1024
                for r in range(world)
            ],
            "rss_growth": [
                None
                if r not in active
                else min(run["peak_rss_kib"] - run["rss_start_kib"] for run in per_rank[r]) / 1024
                for r in range(world)
            ],
            "peak_reset": all(run["peak_reset"] for r in active for run in per_rank[r]),
            "state": [per_rank[r][0]["state"] if r in active else None for r in range(world)],
            "comm": comm,
            "calls": calls,
            "padding": lead[0]["padding"],
            "zero3_wire": lead[0].get("zero3_wire"),
            "resident": [per_rank[r][0].get("resident") for r in active],
            "losses": [run["losses"] for run in lead],
            "build_s": statistics.median(run["build_s"] for run in lead),
        }
        if mode == "ddp":
            summary["ddp_bucket_sizes"] = lead[0]["ddp_bucket_sizes"]
            summary["ddp_python_all_reduce"] = comm["all_reduce"]
            summary["comm"] = dict(comm, all_reduce=lead[0]["ddp_param_bytes"])
        out[mode] = summary
    return out


def render(summary: dict[str, dict], opts: dict, meta: dict) -> str:
    cfg = make_config(opts["preset"])
    preset = PRESETS[opts["preset"]]
    world = opts["world"]
    fsdp2 = summary.get("fsdp2", {}).get("step")
    ddp = summary.get("ddp", {}).get("step")
    single_losses = summary.get("single", {}).get("losses")
    fsdp2_losses = summary.get("fsdp2", {}).get("losses")
    header = (
        "| mode | step ms (median) | ×FSDP2 | ×DDP | fwd ms | bwd ms | opt ms "
        "| peak RSS MiB per rank (growth) | state per rank (p+g+opt) "
        "| all-gather /step | reduce-scatter /step | all-reduce /step "
        "| sent /step | padding % | loss Δ vs single | loss Δ vs FSDP2 |"
    )
    lines = [header, _rule(header)]
    for mode in opts["modes"]:
        s = summary[mode]
        rss = " / ".join(
            "idle" if peak is None else f"{peak:.0f} (+{growth:.0f})"
            for peak, growth in zip(s["peak_rss"], s["rss_growth"])
        )
        states = [sum(st.values()) for st in s["state"] if st is not None]
        state = " / ".join(_fmt_bytes(v) for v in states)
        padding = s["padding"]
        pad = "—"
        if padding:
            pad = f"{100 * padding['padding'] / padding['used']:.3f} ({padding['padding']:,} el.)"
        comm = s["comm"]
        all_gather = _fmt_bytes(gathered_bytes(comm, world))
        if comm["send"]:
            all_gather += " (send/recv)"
        reduce_scatter = _fmt_bytes(reduced_bytes(comm))
        if comm["all_to_all"]:
            reduce_scatter += " (all-to-all)"
        all_reduce = _fmt_bytes(comm["all_reduce"])
        if mode == "ddp":
            all_reduce += " (analytic)"
        vs_single = None
        if mode != "single" and single_losses:
            vs_single = _max_rel(s["losses"], single_losses)
        vs_fsdp2 = None
        if mode != "fsdp2" and fsdp2_losses:
            vs_fsdp2 = _max_rel(s["losses"], fsdp2_losses)
        lines.append(
            f"| {MODE_NAMES[mode]} | {1000 * s['step']:.1f} | {_fmt_ratio(s['step'], fsdp2)} "
            f"| {_fmt_ratio(s['step'], ddp)} | {1000 * s['fwd']:.1f} | {1000 * s['bwd']:.1f} "
            f"| {1000 * s['opt']:.1f} | {rss} | {state} "
            f"| {all_gather} | {reduce_scatter} | {all_reduce} "
            f"| {_fmt_bytes(wire_bytes(comm, world))} | {pad} "
            f"| {_fmt_rel(vs_single)} | {_fmt_rel(vs_fsdp2)} |"
        )
    table = "\n".join(lines)

    low = opts["param_dtype"] != "fp32"
    n_params = cfg.num_params()
    first_loss = summary[opts["modes"][0]]["losses"][0][0]
    notes = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {meta['cpu']}, {meta['cores']} cores, {meta['mem_gib']:.0f} GiB RAM; "
        f"load average {meta['load_start']} at start, {meta['load_end']} at end",
        f"- software: torch {torch.__version__}, Python {platform.python_version()}, "
        f"flatshard {meta['git']}",
        f"- model: Llama preset `{opts['preset']}` ({n_params:,} parameters: "
        f"dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, "
        f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}); seq {preset['seq']}, micro-batch "
        f"{preset['micro_batch']} per rank (global batch {preset['micro_batch'] * world}, "
        "which the single process runs at once); AdamW "
        f"(lr {LR}, weight decay {WEIGHT_DECAY}) on fp32 weights; param dtype "
        f"{opts['param_dtype']}" + (", gradients reduced in fp32" if low else ""),
        f"- run: world {world} (gloo, CPU, spawned processes, 1 torch thread per rank); "
        f"{opts['rounds']} rounds, each building every mode fresh and running "
        f"{opts['warmup']} warm-up + {opts['steps_per_round']} timed steps of it "
        f"(mode order reversed every other round); "
        f"{summary[opts['modes'][0]]['timed_steps']} timed steps per mode; "
        f"step-0 loss {first_loss:.4f}; wall time {meta['wall_s']:.0f} s",
    ]
    if meta.get("note"):
        notes.append(f"- note: {meta['note']}")
    if meta.get("exact_memory"):
        notes.append(
            f"- exact memory: workers ran with MALLOC_MMAP_THRESHOLD_="
            f"{EXACT_MEMORY_MMAP_THRESHOLD}: glibc maps every block over 64 KiB on its own and "
            "unmaps it when freed, so peak RSS is the peak of live memory rather than of "
            "glibc's heap (whose size depends on allocation order); steps are slower "
            "(more page faults), so read timings from a run without it"
        )
    explain = [
        "",
        "Columns: step/fwd/bwd/opt are medians over timed steps, each step taking the "
        "slowest rank after a barrier (opt = `optimizer.step()` + `zero_grad()`; collectives "
        "a phase waits for count in that phase). ×FSDP2 / ×DDP: step time ratio. Peak RSS: "
        "VmHWM per rank (reset through /proc/self/clear_refs at the start of each mode after "
        "gc + malloc_trim; growth = peak minus the resident set at that point, i.e. roughly "
        "what the mode itself needed; min over rounds, as the first round also pays one-time "
        "allocations). State: bytes this rank holds of parameters + gradients "
        "+ AdamW state, after `optimizer.step()` (DTensors: `to_local()`). Collective bytes "
        "per timed step and rank, counted by wrapping `torch.distributed` at the Python level: "
        "all-gather = gathered output, reduce-scatter = reduced input, all-reduce = tensor. "
        "On gloo flatshard all-gathers by sending its shard to each peer (`isend`/`irecv`, "
        "marked send/recv: gathered = sent x N/(N-1)) and reduce-scatters with one "
        "`all_to_all_single` of the input and a local sum (marked all-to-all), see "
        "flatshard/comm.py. Sent: bytes one rank puts on the wire per step for the algorithms "
        "gloo runs, (N-1)/N x (all-gather + all-to-all + 2 x all-reduce + 2 x reduce-scatter, "
        "as gloo's reduce-scatter all-reduces its whole input) + point-to-point sends. "
        "DDP all-reduces in C++ gradient buckets that Python never sees: its all-reduce bytes "
        "are analytic (= trainable parameter bytes in the reduce dtype, fp32). Padding: "
        "flatshard's layout padding over used elements, all units. Loss Δ: max over steps and "
        "rounds of |loss − reference| / |reference| of the global mean loss.",
    ]
    if low:
        explain.append(
            "\nbf16: FSDP2 and flatshard use `MixedPrecisionPolicy(param_dtype=bf16, "
            "reduce_dtype=fp32)`; the single process does the same by hand (a bf16 compute "
            "copy of its fp32 weights, refreshed every step, gradients cast back to fp32), so "
            "their loss Δ is rounding of bf16 compute in a different reduction order. DDP "
            "runs under `torch.autocast('cpu', bf16)` on fp32 weights and all-reduces fp32 "
            "gradients (DDP's `_MixedPrecision` records CUDA events and fails on CPU): its "
            "numerics differ (norms and elementwise ops in fp32), hence its larger loss Δ."
        )
    ddp_summary = summary.get("ddp")
    if ddp_summary:
        buckets = ddp_summary.get("ddp_bucket_sizes")
        if buckets:
            buckets = (
                f"{len(buckets)} bucket(s) ({', '.join(_fmt_bytes(b) for b in buckets)}), "
                f"{_fmt_bytes(sum(buckets))} in all; analytic: "
                f"{_fmt_bytes(ddp_summary['comm']['all_reduce'])}"
            )
        explain.append(
            f"\nDDP: Python-level all-reduce seen per step: "
            f"{_fmt_bytes(ddp_summary['ddp_python_all_reduce'])}"
            + (f"; its gradient buckets after the run (reducer): {buckets}" if buckets else "")
            + "."
        )
    calls = "; ".join(
        f"{MODE_NAMES[m]} "
        + ", ".join(f"{COUNTED_NAME[k]} {summary[m]['calls'][k]:.0f}" for k in COMM_KINDS)
        for m in opts["modes"]
        if m != "single"
    )
    explain.append(f"\nPython-level collective calls per step: {calls}.")
    zero3 = summary.get("zero3")
    if zero3 and zero3["zero3_wire"]:
        expected = zero3["zero3_wire"]
        sent = wire_bytes(zero3["comm"], world)
        explain.append(
            f"\nflatshard ZeRO-3 bytes sent per rank per step: {_fmt_bytes(sent)} measured; "
            f"{_fmt_bytes(expected['analytic'])} from the layout (every unit gathered in "
            "forward and again in backward, except the model root's parts that stay gathered "
            "through backward as FSDP2 keeps its root, plus one reduce-scatter), measured / "
            f"layout = {sent / expected['analytic']:.4f}; the textbook 3 x padded parameter "
            f"bytes x (N-1)/N is {_fmt_bytes(expected['textbook'])}, "
            f"{_fmt_bytes(expected['kept'])} more: the root parts' second gather."
        )
    spread = _round_ratio_spread(summary, opts["modes"])
    if spread:
        explain.append(
            "\nRatio of each round's median step to the peers' in the same round, lowest to "
            f"highest over {opts['rounds']} rounds (how much drift moved the ratios): {spread}."
        )
    resident = "; ".join(
        f"{MODE_NAMES[m]} " + " / ".join(_fmt_bytes(v) for v in summary[m]["resident"])
        for m in opts["modes"]
        if m in FLATSHARD_STAGES
    )
    if resident:
        explain.append(
            "\nflatshard unsharded parameter + gradient buffers still allocated between steps "
            f"(after `zero_grad`, per rank; not in the state column): {resident}."
        )
    builds = ", ".join(f"{MODE_NAMES[m]} {summary[m]['build_s']:.2f}" for m in opts["modes"])
    explain.append(f"\nBuild + wrap time (s, median): {builds}.")
    if not all(summary[m]["peak_reset"] for m in opts["modes"]):
        explain.append("\nWARNING: could not reset VmHWM; peak RSS is the process peak.")
    title = (
        f"## preset {opts['preset']}, {opts['param_dtype']}, world {world} ({meta['date'][:10]})"
    )
    return "\n".join([title, "", *notes, "", table, *explain, ""])


def _round_ratio_spread(summary: dict[str, dict], modes: list[str]) -> str:
    peers = [p for p in ("fsdp2", "ddp") if p in summary]
    parts = []
    for mode in modes:
        if mode not in FLATSHARD_STAGES or len(summary[mode]["round_steps"]) < 2:
            continue
        ranges = []
        for peer in peers:
            ratios = [
                ours / theirs
                for ours, theirs in zip(summary[mode]["round_steps"], summary[peer]["round_steps"])
            ]
            ranges.append(f"×{MODE_NAMES[peer]} {min(ratios):.2f}–{max(ratios):.2f}")
        if ranges:
            parts.append(f"{MODE_NAMES[mode]} " + ", ".join(ranges))
    return "; ".join(parts)


def _rule(header: str) -> str:
    return "|" + "---|" * (header.count("|") - 1)


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
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "mem_gib": _mem_total_gib(),
        "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "git": _git_revision(),
        "note": args.note,
        "exact_memory": args.exact_memory,
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
