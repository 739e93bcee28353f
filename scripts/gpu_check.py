"""The prepared device check: one run on one GPU (H100/H200) with the machine's own torch.

    PYTHONPATH=. python scripts/gpu_check.py --out "$OUT"          # on the GPU, < 8 minutes
    python scripts/gpu_check.py --cpu-dry-run --out /tmp/gpu-check   # the same, tiny, on gloo

Each section trains flatshard at world 1 (NCCL for the GPU, gloo for the CPU) and compares
it with a reference run in the same process: the CPU run, no offload, eager, FSDP2. A
section that fails is reported (its exception) and the others still run. Writes
`gpu_check.json` (every figure) and `gpu_check.txt` (a summary) to --out.

Sections: env; cpu_parity (ZeRO-3 fp32 on the GPU equals the CPU run); bf16; quantized
(qwZ int8/fp8 weight gathers: losses against fp32 gathers); offload
(f = 0.5 and 1, pinned copies: losses equal no offload, step times); state_offload
(offload_states / reload_states: device memory left, bitwise training, GB/s); compile (blocks
compiled: losses, graph breaks, step times); activation_memory (peak device memory per
--ac mode against `flatshard plan`, and how much of what activation offload moves it
saves); fsdp2_1b (a ~1B Llama in bf16: flatshard vs FSDP2 step time and MFU, side by side);
activation_offload_1b (activation offload where compute is large against the bytes moved);
fused_adamw (the flat AdamW with fused=True against torch's fused AdamW: bitwise, step
times); checkpoint (sync and async saves from the device, a load that trains on bitwise); ac_1b
(step time and peak per activation checkpointing mode at 1b); ac_compiled_1b (the same, blocks
compiled); ring_attention (context parallelism's ring on the device's kernel against SDPA);
scale_8b and scale_8b_compiled (4 layers of Llama-3-8B's shapes at 8192 tokens, flatshard
against FSDP2, eager and compiled: step, MFU, peak memory, host time per phase; the flat
AdamW against torch's fused AdamW).
The sections that compare runs bitwise run with deterministic kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

# gpu_check_setup puts the checkout's flatshard on the path (the GPU machine has none installed)
from gpu_check_setup import (
    SIZES,
    STEPS,
    WARMUP,
    Check,
    _max_rel,
    _profile_step,
)
from gpu_check_speed import (
    ac_1b,
    ac_compiled_1b,
    activation_offload_1b,
    fsdp2_1b,
    scale_8b,
    scale_8b_compiled,
)

# --- sections ---------------------------------------------------------------------------------


def env(check: Check) -> dict:
    import flatshard

    out = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": str(check.device),
    }
    out["flatshard"] = getattr(flatshard, "__version__", "checkout")
    if check.cuda:
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
        out["nccl"] = str(torch.cuda.nccl.version())
    return out


def cpu_parity(check: Check) -> dict:
    """ZeRO-3 fp32 on the device (NCCL) against the same run, from the same weights, on the
    CPU (gloo)."""
    cpu = torch.device("cpu")
    on_cpu = check.sharded("35m", device=cpu)
    weights = {name: value.full_tensor() for name, value in on_cpu.state_dict().items()}
    on_device = check.sharded("35m")
    on_device.load_state_dict({name: value.to(check.device) for name, value in weights.items()})
    reference = check.train(on_cpu, "35m", device=cpu)
    ours = check.train(on_device, "35m")
    rel = _max_rel(ours["losses"], reference["losses"])
    return {**ours, "cpu_losses": reference["losses"], "max_rel": rel, "ok": rel <= 1e-5}


def bf16(check: Check) -> dict:
    import flatshard

    policy = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    low = check.train(check.sharded("35m", mp_policy=policy), "35m")
    full = check.train(check.sharded("35m"), "35m")
    rel = _max_rel(low["losses"], full["losses"])
    return {**low, "fp32_step_s": full["step_s"], "max_rel_vs_fp32": rel, "ok": rel <= 2e-2}


def quantized(check: Check) -> dict:
    """qwZ: the weights gathered in int8 and fp8 (the pack/unpack kernels on the device):
    losses against full-precision gathers, step times."""
    import flatshard

    full = check.train(check.sharded("35m"), "35m")
    out = {"fp32_step_s": full["step_s"], "fp32_losses": full["losses"]}
    for fmt in ("int8", "fp8"):
        model = check.sharded("35m")
        model.set_comm_policy(flatshard.CommPolicy(quantize_weights=fmt))
        run = check.train(model, "35m")
        out[fmt] = {**run, "max_rel_vs_fp32": _max_rel(run["losses"], full["losses"])}
    out["ok"] = all(out[fmt]["max_rel_vs_fp32"] <= 2e-2 for fmt in ("int8", "fp8"))
    return out


def offload(check: Check) -> dict:
    import flatshard

    plain = check.train(check.sharded("35m"), "35m")
    out = {"no_offload_step_s": plain["step_s"], "losses": plain["losses"]}
    for fraction in (0.5, 1.0):
        policy = flatshard.OffloadPolicy(fraction=fraction, pin_memory=True)
        run = check.train(check.sharded("35m", offload_policy=policy), "35m")
        out[f"f{fraction:g}"] = {
            "step_s": run["step_s"],
            "losses": run["losses"],
            "equal_losses": run["losses"] == plain["losses"],
            # the host's AdamW rounds unlike the GPU's kernels: equal to fp32 rounding
            "max_rel": _max_rel(run["losses"], plain["losses"]),
        }
    out["ok"] = all(out[f"f{f:g}"]["max_rel"] <= 1e-5 for f in (0.5, 1.0))
    if check.cuda:  # where a difference comes from: pageable copies, gradients, the step
        policy = flatshard.OffloadPolicy(fraction=1.0, pin_memory=False)
        run = check.train(check.sharded("35m", offload_policy=policy), "35m")
        out["f1_pageable_max_rel"] = _max_rel(run["losses"], plain["losses"])
        out["f1_first_step"] = _first_step_difference(check, flatshard.OffloadPolicy(1.0))
    return out


def _first_step_difference(check: Check, policy) -> dict:
    """Largest relative difference, over the parameters, of the gradients of a first
    backward and of the weights after a first AdamW step: offloaded against not."""
    models = [check.sharded("35m"), check.sharded("35m", offload_policy=policy)]
    tokens = check.data("35m", 1)[0].to(check.device)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in models]
    for model in models:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    def local(tensor):
        return tensor.to_local().detach().to("cpu", copy=True)

    def worst(pairs) -> tuple:
        diffs = [((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in pairs]
        index = max(range(len(diffs)), key=diffs.__getitem__)
        return diffs[index], index

    names = [name for name, _ in models[0].named_parameters()]
    params = [list(model.parameters()) for model in models]
    grad, grad_at = worst((local(a.grad), local(b.grad)) for a, b in zip(params[1], params[0]))
    for optimizer in optimizers:
        optimizer.step()
    weight, at = worst((local(a), local(b)) for a, b in zip(params[1], params[0]))
    return {"grad_max_rel": grad, "grad_worst": names[grad_at], "weight_max_rel": weight,
            "weight_worst": names[at]}  # fmt: skip


def state_offload(check: Check) -> dict:
    """RL state movement: device memory left after `offload_states` (target: <= 2% of the
    model's and AdamW's), training after `reload_states` equal to an uninterrupted run,
    offload/reload and `full_weights` throughput."""

    plain = check.train(check.sharded("35m"), "35m")["losses"]
    repeatable = check.train(check.sharded("35m"), "35m")["losses"] == plain
    model = check.sharded("35m")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, out = [], {}
    for step, tokens in enumerate(check.data("35m")):
        tokens = tokens.to(check.device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step in (1, 2):  # twice: the second reuses the host allocator's pinned blocks
            del logits, loss
            cycle = _away_and_back(check, model, optimizer)
            out.update(cycle if step == 1 else {f"{k}_again": v for k, v in cycle.items()})
    out["repeatable"] = repeatable  # two plain runs equal: bitwise comparison means something
    out["losses"], out["plain_losses"] = losses, plain
    out["equal_losses"] = losses == plain
    left = out["device_bytes_after"] / max(1, out["device_bytes_before"]) if check.cuda else 0
    out["ok"] = out["equal_losses"] and left <= 0.02
    return out


def _away_and_back(check: Check, model, optimizer) -> dict:
    import flatshard

    allocated = torch.cuda.memory_allocated if check.cuda else (lambda: 0)
    check.sync()
    before = allocated()
    start = time.perf_counter()
    moved = flatshard.offload_states(model, optimizer)
    offload_s = time.perf_counter() - start
    after = allocated()
    start = time.perf_counter()
    flatshard.reload_states(model, optimizer)
    check.sync()
    reload_s = time.perf_counter() - start
    start = time.perf_counter()
    streamed = 0
    for _, tensor in flatshard.full_weights(model):
        streamed += tensor.numel() * tensor.element_size()
        del tensor
    check.sync()
    stream_s = time.perf_counter() - start
    return {
        "device_bytes_before": before,
        "device_bytes_after": after,
        "moved_bytes": moved,
        "offload_gb_per_s": moved / 1e9 / offload_s,
        "reload_gb_per_s": moved / 1e9 / reload_s,
        "full_weights_gb_per_s": streamed / 1e9 / stream_s,
    }


def compile_blocks(check: Check) -> dict:
    from torch._dynamo.utils import counters

    eager = check.train(check.sharded("35m"), "35m")
    torch._dynamo.reset()
    counters.clear()
    compiled = check.train(check.sharded("35m", compile=True), "35m")
    breaks = sum(counters["graph_break"].values())
    rel = _max_rel(compiled["losses"], eager["losses"])
    return {
        "backend": check.compile_backend,
        "eager_step_s": eager["step_s"],
        "compiled_step_s": compiled["step_s"],
        "graph_breaks": breaks,
        "graphs": counters["stats"]["unique_graphs"],
        "max_rel_vs_eager": rel,
        "ok": breaks == 0 and rel <= 1e-4,
    }


def activation_memory(check: Check) -> dict:
    """Peak device memory per activation mode against the planner's device estimate, and
    activation offload's saving against the bytes it moved (target: >= 70%)."""
    from flatshard import registry
    from flatshard.models import LlamaConfig
    from flatshard.planner import zoo
    from flatshard.planner.estimate import Setup, plan

    cfg, batch, seq = check.sizes["activations"]
    spec = zoo.from_llama_config(LlamaConfig(**cfg), "gpu-check")
    out = {}
    for mode in ("none", "full", "selective", "offload"):
        model = check.sharded(
            "activations", activation_checkpointing=None if mode == "none" else mode
        )
        check.reset_peak()
        run = check.train(model, "activations")
        offloads = [registry.activation_offload_of(block) for block in model.layers]
        moved = sum(o.moved_bytes for o in offloads if o is not None) // (STEPS + WARMUP)
        setup = Setup(world_size=1, dp_shard=1, zero_stage=3, param_dtype="fp32",
                      reduce_dtype="fp32", micro_batch=batch, seq_len=seq, grad_accum=1,
                      backend="nccl" if check.cuda else "gloo", ac=mode)  # fmt: skip
        out[mode] = {
            "peak_bytes": check.peak(),
            "plan_device_bytes": plan(spec, setup).memory["device"],
            "step_s": run["step_s"],
            "losses": run["losses"],
            "moved_bytes_per_step": moved,
            "step_memory": _step_memory(check, model, "activations"),
        }
        if mode == "offload":
            out[mode]["profile"] = _profile_step(check, model, "activations")
        del model
    for figures in out.values():
        figures["peak_over_plan"] = (figures["peak_bytes"] or 0) / figures["plan_device_bytes"]
    none, offloaded = out["none"], out["offload"]
    # bitwise on the CPU (tests) and in activation_offload_1b; here the GPU's fused
    # attention backward adds atomically, so to fp32 rounding
    out["offload_equal_losses"] = offloaded["losses"] == none["losses"]
    out["offload_max_rel"] = _max_rel(offloaded["losses"], none["losses"])
    if check.cuda:
        saved = none["peak_bytes"] - offloaded["peak_bytes"]
        out["offload_saving_over_moved"] = saved / max(1, offloaded["moved_bytes_per_step"])
        out["ok"] = out["offload_max_rel"] <= 1e-5 and out["offload_saving_over_moved"] >= 0.7
    else:
        out["ok"] = out["offload_equal_losses"]
    return out


def _step_memory(check: Check, model, size: str) -> dict | None:
    """Device bytes allocated over one more step, at its moments (where the plan's model of
    the activations and the head can be told apart from the measured peak)."""
    if not check.cuda:
        return None
    tokens = check.data(size, 1)[0].to(check.device)
    check.reset_peak()
    at = {"start": torch.cuda.memory_allocated()}
    logits = model(tokens[:, :-1])
    at["after_forward"] = torch.cuda.memory_allocated()
    at["forward_peak"] = torch.cuda.max_memory_allocated()
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    at["after_loss"] = torch.cuda.memory_allocated()
    loss.backward()
    at["backward_peak"] = torch.cuda.max_memory_allocated()
    del logits, loss
    at["after_backward"] = torch.cuda.memory_allocated()
    model.zero_grad()
    return at


def fused_adamw(check: Check) -> dict:
    """flatshard's flat AdamW with `fused=True` (torch's fused kernel over the flat ranges)
    against torch's fused AdamW on the same sharded parameters: losses and weights bitwise
    equal, and each one's optimizer step (milliseconds, median of the last steps)."""
    import flatshard

    runs = {}
    for name, make in (("flat", flatshard.optim.AdamW), ("torch", torch.optim.AdamW)):
        model = check.sharded("35m")
        optimizer = make(model.parameters(), lr=1e-3, fused=True)
        losses, step_ms = [], []
        for tokens in check.data("35m"):
            tokens = tokens.to(check.device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            check.sync()
            start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            check.sync()
            step_ms.append(1e3 * (time.perf_counter() - start))
            losses.append(loss.item())
        runs[name] = (model, losses, statistics.median(step_ms[WARMUP:]))
    pairs = zip(runs["flat"][0].parameters(), runs["torch"][0].parameters())
    weights = all(torch.equal(a.to_local(), b.to_local()) for a, b in pairs)
    losses = runs["flat"][1] == runs["torch"][1]
    return {"losses_equal": losses, "weights_equal": weights, "ok": losses and weights,
            "optimizer_ms": {name: run[2] for name, run in runs.items()}}  # fmt: skip


def checkpoint(check: Check) -> dict:
    """Checkpoints from the device: a synchronous and an asynchronous save (the layout-planned
    writer staging through pinned waves), GB/s and host staging held; a load into a fresh
    model and optimizer trains on bitwise like the saved one."""
    import shutil
    import tempfile

    from flatshard import checkpoint as ckpt

    def build():
        model = check.sharded("35m")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, optimizer, tokens) -> float:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    batches = [tokens.to(check.device) for tokens in check.data("35m", 3)]
    saved, saved_optimizer = build()
    step(saved, saved_optimizer, batches[0])
    tensors = [p.to_local() for p in saved.parameters()] + [
        value.to_local() if hasattr(value, "to_local") else value
        for state in saved_optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    ]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    directory = tempfile.mkdtemp(prefix="gpu-check-ckpt-")
    out = {"state_bytes": state_bytes}
    try:
        for index, async_save in enumerate((False, True)):
            check.sync()
            start = time.perf_counter()
            handle = ckpt.save(directory, model=saved, optimizer=saved_optimizer,
                               step=index + 1, async_save=async_save)  # fmt: skip
            blocking = time.perf_counter() - start
            handle.wait()
            total = time.perf_counter() - start
            out["async" if async_save else "sync"] = {
                "blocking_s": blocking, "total_s": total, "gb_per_s": state_bytes / total / 1e9,
                "peak_staging_bytes": handle.peak_staging_bytes}  # fmt: skip
        loaded, loaded_optimizer = build()
        step(loaded, loaded_optimizer, batches[2])  # state to overwrite, unlike the saved
        start = time.perf_counter()
        ckpt.load(directory, model=loaded, optimizer=loaded_optimizer)
        out["load_s"] = time.perf_counter() - start
        out["losses_after"] = [step(m, o, batches[1]) for m, o in
                               ((saved, saved_optimizer), (loaded, loaded_optimizer))]  # fmt: skip
        weights = [[p.to_local() for p in m.parameters()] for m in (saved, loaded)]
        out["equal_weights_after"] = all(torch.equal(a, b) for a, b in zip(*weights))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    losses = out["losses_after"]
    out["ok"] = losses[0] == losses[1] and out["equal_weights_after"]
    return out


def ring_attention(check: Check) -> dict:
    """Context parallelism's ring (torch's, on the device's kernel: CUDA flash attention in
    bf16) over this one rank: output and q/k/v gradients against causal SDPA."""
    from flatshard.parallel.ring_attention import ring_attention as ring
    from flatshard.parallel.ring_attention import ring_runs

    dtype = torch.bfloat16 if check.cuda else torch.float32
    torch.manual_seed(0)
    shape = (2, 8, 256, 64) if check.cuda else (2, 4, 16, 8)
    q = torch.randn(shape, device=check.device, dtype=dtype, requires_grad=True)
    kv_shape = (shape[0], shape[1] // 2, *shape[2:])  # grouped KV heads
    k, v = (torch.randn(kv_shape, device=check.device, dtype=dtype, requires_grad=True)
            for _ in range(2))  # fmt: skip
    grad = torch.randn(shape, device=check.device, dtype=dtype)
    if not ring_runs(q):
        return {"ok": False, "error": "torch's ring does not run here"}
    ours = ring(q, k, v, dist.group.WORLD)
    mine = torch.autograd.grad(ours, (q, k, v), grad)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    reference = torch.autograd.grad(theirs, (q, k, v), grad)
    errors = [
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        for a, b in zip([ours, *mine], [theirs, *reference])
    ]
    tolerance = 2e-2 if check.cuda else 1e-5
    return {"max_rel_out_dq_dk_dv": errors, "ok": max(errors) <= tolerance}


SECTIONS = {
    "env": env,
    "cpu_parity": cpu_parity,
    "bf16": bf16,
    "quantized": quantized,
    "offload": offload,
    "state_offload": state_offload,
    "checkpoint": checkpoint,
    "compile": compile_blocks,
    "activation_memory": activation_memory,
    "fsdp2_1b": fsdp2_1b,
    "fused_adamw": fused_adamw,
    "activation_offload_1b": activation_offload_1b,
    "ac_1b": ac_1b,
    "ac_compiled_1b": ac_compiled_1b,
    "ring_attention": ring_attention,
    "scale_8b": scale_8b,
    "scale_8b_compiled": scale_8b_compiled,
}
# the sections that compare runs bitwise get repeatable kernels
# (not activation_memory: the math attention they need saves the whole attention matrix)
DETERMINISTIC = (
    "cpu_parity",
    "offload",
    "state_offload",
    "checkpoint",
    "activation_offload_1b",
    "fused_adamw",
)


def _write(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    summary = [
        f"{name}: ok={value.get('ok')}" + (f" ({value['error']})" if "error" in value else "")
        for name, value in report.items()
        if isinstance(value, dict)
    ]
    with open(os.path.join(out, "gpu_check.txt"), "w") as handle:
        handle.write("\n".join(summary) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-check"))
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes, gloo, CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_dry_run
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity with the CPU
        torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", rank=0, world_size=1)
    check = Check(device, SIZES["gpu" if cuda else "cpu"])
    started = time.perf_counter()
    for name in args.sections.split(","):
        section_start = time.perf_counter()
        try:
            with check.deterministic() if name in DETERMINISTIC else contextlib.nullcontext():
                check.report[name] = SECTIONS[name](check)
        except Exception as error:  # report it and go on: one run must say as much as it can
            check.report[name] = {"ok": False, "error": f"{type(error).__name__}: {error}",
                                  "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        check.report[name]["seconds"] = round(time.perf_counter() - section_start, 1)
        print(f"gpu_check: {name}: ok={check.report[name].get('ok')} "
              f"({check.report[name]['seconds']} s)", flush=True)  # fmt: skip
        check.report["seconds"] = round(time.perf_counter() - started, 1)
        _write(check.report, args.out)  # after each section: a run cut short still reports
    dist.destroy_process_group()
    return 0 if all(v.get("ok", True) for v in check.report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
