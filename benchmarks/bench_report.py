"""The benchmark's report: per-mode medians over the workers' raw results and the markdown
section (machine, command, table, notes) written to RESULTS.md."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess

import torch
from bench_modes import (
    AC_MODES,
    COMPILE_MODES,
    EP_DEGREE,
    FLATSHARD_STAGES,
    HSDP_REPLICAS,
    LR,
    MODE_NAMES,
    MOE_MODES,
    OFFLOAD_FRACTIONS,
    OFFLOAD_MODES,
    PRESETS,
    TP_DEGREE,
    TP_MODES,
    WEIGHT_DECAY,
    make_config,
)
from comm_counter import COMM_KINDS, COUNTED_NAME, gathered_bytes, reduced_bytes, wire_bytes

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_vector_isa() -> tuple[str, bool]:
    """torch's CPU kernel level (AVX2, AVX512, ...) and whether the CPU multiplies bf16
    natively (avx512_bf16 / amx_bf16): without it bf16 matmuls are emulated and 20x or more
    slower than fp32, so a bf16 run times the emulation, not the sharding."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability(), bool(flags & {"avx512_bf16", "amx_bf16"})


def mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return float("nan")


def git_revision() -> str:
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


def _paired_ratio(
    summary: dict[str, dict], mode: str, peer: str, times: str = "step_times"
) -> float | None:
    """Median over timed steps of this mode's step time (or CPU time) over the peer's step
    of the same round and index: the nearest in time the run has (side by side: seconds
    apart)."""
    if peer not in summary:
        return None
    pairs = zip(summary[mode][times], summary[peer][times])
    return statistics.median(ours / theirs for ours, theirs in pairs)


def _fmt_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}"


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
        steps, fwd, bwd, opt, round_steps, cpu, faults = [], [], [], [], [], [], []
        for i in range(rounds):
            for s in range(len(per_rank[active[0]][i]["phases"])):
                rows = [per_rank[r][i]["phases"][s] for r in active]
                cpu.append(sum(per_rank[r][i]["cpu_seconds"][s] for r in active))
                faults.append(sum(per_rank[r][i]["page_faults"][s] for r in active))
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
        narrow = statistics.mean(c["narrow"] for c in comm_steps) if comm_steps else 0
        for key in ("ep_offrank", "ep_rows", "ep_traffic"):  # expert parallelism's
            comm[key] = statistics.mean(c.get(key, 0) for c in comm_steps) if comm_steps else 0
        # bytes by the size of the group they went over (JSON made the sizes strings)
        comm["group_sizes"] = {
            kind: {
                int(n): statistics.mean(c["group_sizes"][kind].get(n, 0) for c in comm_steps)
                for n in {n for c in comm_steps for n in c["group_sizes"][kind]}
            }
            for kind in COMM_KINDS
        }
        own_memory = lead[0]["peak_rss_kib"] is not None  # modes run one at a time
        summary = {
            "step": statistics.median(steps),
            "step_times": steps,  # in (round, step) order: paired with the peers' below
            "cpu": statistics.median(cpu),
            "cpu_times": cpu,  # CPU seconds of all ranks, per step, in the same order
            "page_faults": statistics.median(faults),  # all ranks, per step
            "fwd": statistics.median(fwd),
            "bwd": statistics.median(bwd),
            "opt": statistics.median(opt),
            "timed_steps": len(steps),
            "round_steps": round_steps,
            # Min over rounds: the first round also pays one-time (first use) allocations.
            "peak_rss": [
                None if r not in active else min(run["peak_rss_kib"] for run in per_rank[r]) / 1024
                for r in range(world)
            ]
            if own_memory
            else None,
            "rss_growth": [
                None
                if r not in active
                else min(run["peak_rss_kib"] - run["rss_start_kib"] for run in per_rank[r]) / 1024
                for r in range(world)
            ]
            if own_memory
            else None,
            "peak_reset": all(run["peak_reset"] for r in active for run in per_rank[r]),
            "state": [per_rank[r][0]["state"] if r in active else None for r in range(world)],
            "comm": comm,
            "calls": calls,
            "narrow": narrow,
            "padding": lead[0]["padding"],
            "zero3_wire": lead[0].get("zero3_wire"),
            "resident": [per_rank[r][0].get("resident") for r in active],
            "offloaded": [per_rank[r][0].get("offloaded") for r in active],
            "losses": [run["losses"] for run in lead],
            "build_s": statistics.median(run["build_s"] for run in lead),
        }
        if mode == "ddp":
            summary["ddp_bucket_sizes"] = lead[0]["ddp_bucket_sizes"]
            summary["ddp_python_all_reduce"] = comm["all_reduce"]
            # analytic, over the world (_by_group_size finds no counted split that matches)
            summary["comm"] = dict(comm, all_reduce=lead[0]["ddp_param_bytes"])
        out[mode] = summary
    return out


def render(summary: dict[str, dict], opts: dict, meta: dict) -> str:
    cfg = make_config(opts["preset"])
    preset = PRESETS[opts["preset"]]
    world = opts["world"]
    single_losses = summary.get("single", {}).get("losses")
    # the ×FSDP2 columns: FSDP2, or over the MoE model FSDP2 (no EP)
    fsdp2 = "fsdp2-moe" if "fsdp2" not in summary and "fsdp2-moe" in summary else "fsdp2"
    fsdp2_losses = summary.get(fsdp2, {}).get("losses")
    # expert parallelism's all-to-alls get their own column when an EP mode ran
    with_ep = "ep3" in opts["modes"]
    kinds = [k for k in COMM_KINDS if (with_ep or k != "ep_all_to_all")
             and ("cp3" in opts["modes"] or k != "cp_all_to_all")]  # fmt: skip
    header = (
        "| mode | step ms (median) | ×FSDP2 | ×DDP | fwd ms | bwd ms | opt ms "
        "| CPU s/step (all ranks) | CPU ×FSDP2 | CPU ×DDP "
        "| peak RSS MiB per rank (growth) | state per rank (p+g+opt) "
        "| all-gather /step | reduce-scatter /step | all-reduce /step "
        + ("| EP all-to-all /step " if with_ep else "")
        + "| sent /step | padding % | loss Δ vs single | loss Δ vs FSDP2 |"
    )
    lines = [header, _rule(header)]
    for mode in opts["modes"]:
        s = summary[mode]
        rss = "— (side by side)"
        if s["peak_rss"] is not None:
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
        if with_ep:
            all_reduce += f" | {_fmt_bytes(comm['ep_all_to_all'])}"
        vs_single = None
        if mode != "single" and single_losses:
            vs_single = _max_rel(s["losses"], single_losses)
        vs_fsdp2 = None
        if mode != fsdp2 and fsdp2_losses:
            vs_fsdp2 = _max_rel(s["losses"], fsdp2_losses)
        lines.append(
            f"| {MODE_NAMES[mode]} | {1000 * s['step']:.1f} "
            f"| {_fmt_ratio(_paired_ratio(summary, mode, fsdp2))} "
            f"| {_fmt_ratio(_paired_ratio(summary, mode, 'ddp'))} "
            f"| {1000 * s['fwd']:.1f} | {1000 * s['bwd']:.1f} "
            f"| {1000 * s['opt']:.1f} | {s['cpu']:.2f} "
            f"| {_fmt_ratio(_paired_ratio(summary, mode, fsdp2, 'cpu_times'))} "
            f"| {_fmt_ratio(_paired_ratio(summary, mode, 'ddp', 'cpu_times'))} "
            f"| {rss} | {state} "
            f"| {all_gather} | {reduce_scatter} | {all_reduce} "
            f"| {_fmt_bytes(wire_bytes(comm, world))} | {pad} "
            f"| {_fmt_rel(vs_single)} | {_fmt_rel(vs_fsdp2)} |"
        )
    table = "\n".join(lines)

    low = opts["param_dtype"] != "fp32"
    n_params = cfg.num_params()
    if opts["modes"] and set(opts["modes"]) <= set(MOE_MODES) | {"single"}:
        moe_layers = cfg.n_layers - cfg.first_k_dense
        inactive = moe_layers * (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.expert_ffn_dim
        model_line = (
            f"- model: MoE preset `{opts['preset']}` ({n_params:,} parameters, "
            f"{n_params - inactive:,} active per token: dim {cfg.dim}, {cfg.n_layers} layers, "
            f"{cfg.n_heads}/{cfg.n_kv_heads} heads, {cfg.n_experts} experts top-{cfg.top_k} "
            f"of ffn {cfg.expert_ffn_dim}, vocab {cfg.vocab_size}; loss = LM + "
            f"{cfg.aux_loss_coef} x load-balancing loss)"
        )
    else:
        model_line = (
            f"- model: Llama preset `{opts['preset']}` ({n_params:,} parameters: "
            f"dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, "
            f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size})"
        )
    first_loss = summary[opts["modes"][0]]["losses"][0][0]
    steps = f"{opts['warmup']} warm-up + {opts['steps_per_round']} timed steps"
    schedule = (
        f"each building every mode fresh and running {steps} of it (mode order reversed "
        "every other round)"
        if opts["interleave"] == "modes"
        else f"each building every mode, then running {steps} of them side by side, one "
        "step of each mode in turn (order reversed every step)"
    )
    notes = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {meta['cpu']} ({meta['isa']}, bf16 matmul "
        f"{'native' if meta['native_bf16'] else 'emulated'}), {meta['cores']} cores, "
        f"{meta['mem_gib']:.0f} GiB RAM; "
        f"load average {meta['load_start']} at start, {meta['load_end']} at end",
        f"- software: torch {torch.__version__}, Python {platform.python_version()}, "
        f"flatshard {meta['git']}",
        f"{model_line}; seq {preset['seq']}, micro-batch "
        f"{preset['micro_batch']} per rank (global batch {preset['micro_batch'] * world}, "
        "which the single process runs at once); AdamW "
        f"(lr {LR}, weight decay {WEIGHT_DECAY}) on fp32 weights; param dtype "
        f"{opts['param_dtype']}" + (", gradients reduced in fp32" if low else ""),
        f"- run: world {world} (gloo, CPU, local processes, 1 torch thread per rank); "
        f"{opts['rounds']} rounds, {schedule}; "
        f"{summary[opts['modes'][0]]['timed_steps']} timed steps per mode; "
        f"step-0 loss {first_loss:.4f}; wall time {meta['wall_s']:.0f} s",
    ]
    if set(opts["modes"]) & set(TP_MODES):
        dp = world // TP_DEGREE
        notes.append(
            f"- TP modes: a ({dp} dp_shard, {TP_DEGREE} tp) mesh; "
            "`flatshard.models.llama.parallelize_llama` over tp (q/k/v colwise, o rowwise, "
            "gate_up `FusedColwiseParallel` placed `_StridedShard(0, 2)`, down rowwise), then "
            "FSDP2's or flatshard's `fully_shard` per block and on the root over dp_shard; "
            f"each data-parallel rank trains on {preset['micro_batch'] * TP_DEGREE} sequences "
            f"(global batch / {dp}), the same on both ranks of its TP group, so the global "
            "batch, and the loss, are those of every other mode"
        )
    if set(opts["modes"]) & set(MOE_MODES):
        efsdp = world // EP_DEGREE
        notes.append(
            "- MoE modes: every rank trains on its own slice of the global batch (EP ranks "
            "see different tokens); the load-balancing loss sums the router counts over all "
            f"{world} ranks (`load_balancing_loss(stats, group=WORLD)`), so the mean loss and "
            "gradient are the global batch's, as in one process. FSDP2 (no EP) and flatshard "
            "ZeRO-3 (no EP): `fully_shard` per block and on the root over all ranks (each "
            f"block's experts sharded with it). flatshard EP ZeRO-3: a ({efsdp} efsdp, "
            f"{EP_DEGREE} ep) mesh; each block's experts `parallelize_module(experts, "
            "mesh['ep'], ExpertParallel())` (each EP rank owns "
            f"{cfg.n_experts // EP_DEGREE} of {cfg.n_experts} experts, tokens travel by "
            "all-to-all) and `flatshard.fully_shard(experts, mesh=mesh['efsdp'])`, then "
            "`fully_shard` per block and on the root over all ranks"
        )
    if set(opts["modes"]) & set(OFFLOAD_MODES):
        notes.append(
            "- offload modes: FSDP2 + CPUOffloadPolicy: `fully_shard(..., offload_policy="
            "CPUOffloadPolicy(pin_memory=False))` per block and on the root (no pinned memory "
            "without an accelerator); flatshard ZeRO-3 offload f: `flatshard.fully_shard(..., "
            "offload_policy=OffloadPolicy(f))`, the same policy object per block and on the "
            "root (f < 1: a bucket per parameter); (disk): `OffloadPolicy(1.0, path=<a "
            "temporary directory per rank>)`, the AdamW state in memory-mapped files there. "
            "On a CPU the device and the host are the same memory: the host tier costs its "
            "copies and moves no bytes off anything; the disk tier moves the optimizer state "
            "out of the resident set"
        )
    if meta.get("note"):
        notes.append(f"- note: {meta['note']}")
    if low and not meta["native_bf16"]:
        notes.append(
            "- WARNING: this CPU has no native bf16 matmul (no avx512_bf16 / amx_bf16): "
            "bf16 compute is emulated and dominates every mode's time; read the bytes, memory "
            "and losses of this run, not its timings"
        )
    if meta.get("exact_memory"):
        notes.append(
            f"- exact memory: workers ran with MALLOC_MMAP_THRESHOLD_="
            f"{meta['exact_memory']}: glibc maps every block over 64 KiB on its own and "
            "unmaps it when freed, so peak RSS is the peak of live memory rather than of "
            "glibc's heap (whose size depends on allocation order); steps are slower "
            "(more page faults), so read timings from a run without it"
        )
    explain = [
        "",
        "Columns: step/fwd/bwd/opt are medians over timed steps, each step taking the "
        "slowest rank after a barrier (opt = `optimizer.step()` + `zero_grad()`; collectives "
        "a phase waits for count in that phase). ×FSDP2 / ×DDP: median over timed steps of "
        "the step time over the peer's step of the same round and index. CPU s/step: "
        "median over timed steps of the CPU time (user + system, every thread: compute, "
        "gloo's transfers, copies) all ranks spent in the step; CPU ×FSDP2 / ×DDP: its "
        "step-paired ratios as above. On this machine the ranks share its cores, so CPU "
        "time is the work a step costs, and unlike wall time it does not move with other "
        "tenants' load. Peak RSS: "
        "VmHWM per rank (reset through /proc/self/clear_refs at the start of each mode after "
        "gc + malloc_trim; growth = peak minus the resident set at that point, i.e. roughly "
        "what the mode itself needed; min over rounds, as the first round also pays one-time "
        "allocations; not measured when modes run side by side). State: bytes this rank "
        "holds of parameters + gradients "
        "+ AdamW state, after `optimizer.step()` (DTensors: `to_local()`). Collective bytes "
        "per timed step and rank, counted by wrapping `torch.distributed` at the Python level: "
        "all-gather = gathered output, reduce-scatter = reduced input, all-reduce = tensor. "
        "On gloo flatshard all-gathers by sending its shard to each peer (`isend`/`irecv`, "
        "marked send/recv: gathered = sent x N/(N-1)) and reduce-scatters with one "
        "`all_to_all_single` of the input and a local sum (marked all-to-all), see "
        "flatshard/comm/collectives.py. Sent: bytes one rank puts on the wire per step for the "
        "algorithms gloo runs, (N-1)/N x (all-gather + all-to-all + 2 x all-reduce + 2 x "
        "reduce-scatter, as gloo's reduce-scatter all-reduces its whole input) + "
        "point-to-point sends, N the size of the group each collective went over (the "
        "world, or an HSDP, hpZ, TP or data-parallel group), + expert parallelism's "
        "all-to-all bytes bound for other ranks "
        "(EP all-to-all: input bytes of its token rows and per-expert counts). DTensor's "
        "collectives (TP's all-reduces) are counted at "
        "`torch.distributed._functional_collectives`. "
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
        + ", ".join(f"{COUNTED_NAME[k]} {summary[m]['calls'][k]:.0f}" for k in kinds)
        for m in opts["modes"]
        if m != "single"
    )
    explain.append(f"\nPython-level collective calls per step: {calls}.")
    narrow = [m for m in opts["modes"] if summary[m].get("narrow")]
    if narrow:
        parts = ", ".join(
            f"{MODE_NAMES[m]} {_fmt_bytes(summary[m]['narrow'])} of "
            f"{_fmt_bytes(sum(summary[m]['comm'][k] for k in COMM_KINDS))}"
            for m in narrow
        )
        explain.append(
            f"\nCounted bytes per step on groups smaller than all {world} ranks (hpZ's node "
            f"groups, HSDP's replica and shard groups, TP's data-parallel and tensor-parallel "
            f"groups, EP's efsdp and ep groups): {parts}."
        )
    if "hsdp3" in summary and "fsdp2-hsdp" in summary:
        wall = _paired_ratio(summary, "hsdp3", "fsdp2-hsdp")
        cpu = _paired_ratio(summary, "hsdp3", "fsdp2-hsdp", "cpu_times")
        explain.append(
            f"\nHSDP ({HSDP_REPLICAS} replicas x {world // HSDP_REPLICAS} shards): flatshard "
            f"HSDP ZeRO-3 step x FSDP2 HSDP {_fmt_ratio(wall)} (CPU {_fmt_ratio(cpu)}), "
            "step-paired medians as above."
        )
    if "tp3" in summary and "fsdp2-tp" in summary:
        wall = _paired_ratio(summary, "tp3", "fsdp2-tp")
        cpu = _paired_ratio(summary, "tp3", "fsdp2-tp", "cpu_times")
        explain.append(
            f"\nTP ({world // TP_DEGREE} data-parallel x {TP_DEGREE} tensor-parallel): "
            f"flatshard TP ZeRO-3 vs FSDP2 TP: step x {_fmt_ratio(wall)} "
            f"(CPU {_fmt_ratio(cpu)}), step-paired medians as above."
        )
    long = [
        f"{MODE_NAMES[ours]} vs {MODE_NAMES[peer]}: step x "
        f"{_fmt_ratio(_paired_ratio(summary, ours, peer))} "
        f"(CPU {_fmt_ratio(_paired_ratio(summary, ours, peer, 'cpu_times'))})"
        for ours, peer in (("sp3", "fsdp2-sp"), ("sp3", "fsdp2-tp"), ("cp3", "fsdp2"))
        if ours in summary and peer in summary
    ]
    if "cp3" in summary:
        ring = summary["cp3"]["comm"]["cp_all_to_all"]
        long.append(f"{MODE_NAMES['cp3']} passes {_fmt_bytes(ring)} of key and value "
                    "gradients around the ring per step (in its sent bytes)")  # fmt: skip
    if long:
        explain.append(f"\nLong sequences: {'; '.join(long)}, step-paired medians as above.")
    if "fsdp2-moe" in summary:
        pairs = [
            f"{MODE_NAMES[m]} vs FSDP2 (no EP): step x "
            f"{_fmt_ratio(_paired_ratio(summary, m, 'fsdp2-moe'))} "
            f"(CPU {_fmt_ratio(_paired_ratio(summary, m, 'fsdp2-moe', 'cpu_times'))})"
            for m in ("ep3", "moe3")
            if m in summary
        ]
        if pairs:
            explain.append(f"\nMoE: {'; '.join(pairs)}, step-paired medians as above.")
    ep = summary.get("ep3")
    if ep:
        c = ep["comm"]
        explain.append(
            f"\nflatshard EP ZeRO-3 all-to-all per rank per step (ep {EP_DEGREE}): "
            f"{_fmt_bytes(c['ep_all_to_all'])} of input, of which token rows "
            f"{_fmt_bytes(c['ep_rows'])} (forward rows out and back, backward their "
            f"gradients; flatshard.comm.traffic.all_to_all counts "
            f"{_fmt_bytes(c['ep_traffic'])}) and per-expert counts "
            f"{_fmt_bytes(c['ep_all_to_all'] - c['ep_rows'])}; "
            f"{_fmt_bytes(c['ep_offrank'])} of it bound for the other EP rank (in sent); "
            f"{summary['ep3']['calls']['ep_all_to_all']:.0f} calls."
        )
    zero3 = summary.get("zero3")
    if zero3 and zero3["zero3_wire"]:
        expected = zero3["zero3_wire"]
        sent = wire_bytes(zero3["comm"], world)
        explain.append(
            f"\nflatshard ZeRO-3 bytes sent per rank per step: {_fmt_bytes(sent)} measured; "
            f"{_fmt_bytes(expected['analytic'])} from the layout (every unit gathered in "
            "forward and again in backward, except the model root's parts, which stay gathered "
            "through backward as FSDP2 keeps its root, and the last block, whose backward "
            "comes next; plus one reduce-scatter; an embedding "
            "looked up from its shards: its lookups' bytes), measured / "
            f"layout = {sent / expected['analytic']:.4f}; the textbook count (every bucket "
            "gathered twice and reduced once: 3 x padded parameter bytes x (N-1)/N in fp32) "
            f"is {_fmt_bytes(expected['textbook'])}: "
            f"{_fmt_bytes(expected['kept'])} more for the second gather of the root parts "
            "and the last block"
            + (
                f", and the embedding, looked up from its shards, sends "
                f"{_fmt_bytes(expected['lookups'])} (token ids, rows and row gradients) "
                f"instead of its table's {_fmt_bytes(expected['table'])}."
                if expected.get("lookups")
                else "."
            )
        )
    explain.extend(_offload_notes(summary, opts["modes"]))
    explain.extend(_compile_and_ac_notes(summary, opts["modes"]))
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
    faults = ", ".join(f"{MODE_NAMES[m]} {summary[m]['page_faults']:,.0f}" for m in opts["modes"])
    explain.append(
        "\nMinor page faults per step, all ranks (median; each is a 4 KiB page of fresh memory "
        f"the kernel zeroes: CPU time in the step): {faults}."
    )
    if not all(summary[m]["peak_reset"] for m in opts["modes"]):
        explain.append("\nWARNING: could not reset VmHWM; peak RSS is the process peak.")
    title = (
        f"## preset {opts['preset']}, {opts['param_dtype']}, world {world} ({meta['date'][:10]})"
    )
    return "\n".join([title, "", *notes, "", table, *explain, ""])


def _compile_and_ac_notes(summary: dict[str, dict], modes: list[str]) -> list[str]:
    """Compiled blocks: flatshard's step (and CPU) time over compiled FSDP2's and over eager
    flatshard's, losses against eager; activation checkpointing: step time and peak RSS
    against no checkpointing (zero3), losses against it."""
    out = []
    compiled = summary.get("compile3")
    if compiled:
        ratios = [
            f"×{MODE_NAMES[peer]} {_fmt_ratio(_paired_ratio(summary, 'compile3', peer))} "
            f"(CPU {_fmt_ratio(_paired_ratio(summary, 'compile3', peer, 'cpu_times'))})"
            for peer in ("fsdp2-compile", "zero3", "fsdp2")
            if peer in summary
        ]
        out.append(f"\nCompiled blocks, step-paired medians: {MODE_NAMES['compile3']} "
                   + ", ".join(ratios) + ".")  # fmt: skip
    zero3 = summary.get("zero3")
    if not zero3:
        return out
    rows = []
    for mode in [m for m in (*COMPILE_MODES, *AC_MODES) if m in summary]:
        row = f"{MODE_NAMES[mode]} max rel {_max_rel(summary[mode]['losses'], zero3['losses']):.1e}"
        if mode in AC_MODES:
            row += f", step ×{_fmt_ratio(_paired_ratio(summary, mode, 'zero3'))}"
            peaks, base = summary[mode]["peak_rss"], zero3["peak_rss"]
            if peaks and base:
                row += ", peak RSS " + " / ".join(
                    f"{ours - theirs:+.0f} MiB"
                    for ours, theirs in zip(peaks, base)
                    if ours is not None and theirs is not None
                )
        rows.append(row)
    if rows:
        out.append("\nAgainst eager flatshard ZeRO-3 (losses every step, every round): "
                   + "; ".join(rows) + ".")  # fmt: skip
    return out


def _offload_notes(summary: dict[str, dict], modes: list[str]) -> list[str]:
    """Offload: step ratios against FSDP2 + CPUOffloadPolicy and FSDP2, the bytes each
    flatshard offload mode keeps off the device, losses against ZeRO-3, and the disk tier's
    peak RSS drop against ZeRO-3's as a share of the optimizer bytes it pages."""
    if not set(modes) & set(OFFLOAD_MODES):
        return []
    out = []
    peers = [p for p in ("fsdp2-cpuoff", "fsdp2") if p in summary]
    ratios = []
    for mode in [m for m in ("fsdp2-cpuoff", "zero3", *OFFLOAD_FRACTIONS) if m in summary]:
        parts = [
            f"×{MODE_NAMES[p]} {_fmt_ratio(_paired_ratio(summary, mode, p))} "
            f"(CPU {_fmt_ratio(_paired_ratio(summary, mode, p, 'cpu_times'))})"
            for p in peers
            if p != mode
        ]
        if parts:
            ratios.append(f"{MODE_NAMES[mode]} " + ", ".join(parts))
    if ratios:
        out.append(f"\nOffload, step-paired medians as above: {'; '.join(ratios)}.")
    held = []
    for mode in [m for m in OFFLOAD_FRACTIONS if m in summary]:
        per_rank = [o for o in summary[mode]["offloaded"] if o]
        if not per_rank:
            continue
        held.append(
            f"{MODE_NAMES[mode]} host "
            + " / ".join(_fmt_bytes(o["host"]) for o in per_rank)
            + ", disk "
            + " / ".join(_fmt_bytes(o["disk"]) for o in per_rank)
            + " (AdamW state of the whole shard: "
            + " / ".join(_fmt_bytes(o["adamw_state"]) for o in per_rank)
            + ")"
        )
    if held:
        out.append(
            "\nOffloaded bytes per rank (`flatshard.runtime.offload.offloaded_bytes` after "
            "the last step, before `zero_grad`; host: main weights, gradients and optimizer "
            "state on the host; disk: optimizer state in the disk tier's files): "
            + "; ".join(held)
            + "."
        )
    zero3 = summary.get("zero3")
    if zero3:
        losses = [
            f"{MODE_NAMES[m]} " + ("bitwise equal" if d == 0 else f"max rel {d:.1e}")
            for m in OFFLOAD_MODES
            if m in summary
            for d in [_max_rel(summary[m]["losses"], zero3["losses"])]
        ]
        out.append(
            f"\nLosses against flatshard ZeRO-3 (every step, every round): {'; '.join(losses)}."
        )
    disk = summary.get("offdisk")
    if zero3 and disk and zero3["peak_rss"] is not None and disk["peak_rss"] is not None:
        per_rank = []
        for r, (ours, base) in enumerate(zip(disk["peak_rss"], zero3["peak_rss"])):
            offloaded = disk["offloaded"][r] if r < len(disk["offloaded"]) else None
            if ours is None or base is None or not offloaded or not offloaded["disk"]:
                continue
            drop = (base - ours) * 1024 * 1024
            per_rank.append(
                f"{_fmt_bytes(drop)} of {_fmt_bytes(offloaded['disk'])} "
                f"({100 * drop / offloaded['disk']:.0f}%)"
            )
        if per_rank:
            out.append(
                "\nDisk tier: peak RSS drop against flatshard ZeRO-3 per rank, as a share of "
                "the optimizer state bytes it pages (target >= 80%): " + " / ".join(per_rank) + "."
            )
    return out


def _round_ratio_spread(summary: dict[str, dict], modes: list[str]) -> str:
    peers = [p for p in ("fsdp2", "fsdp2-moe", "ddp") if p in summary]
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
