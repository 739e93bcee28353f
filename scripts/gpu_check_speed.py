"""The device check's timed sections: flatshard against FSDP2 where compute dominates (a ~1B
Llama; 4 layers of Llama-3-8B's shapes at 8192 tokens, eager and compiled), activation
checkpointing and offload at that size, and each phase's device and host time."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from gpu_check_setup import STEPS, WARMUP, Check, _max_rel, _profile_step


def activation_offload_1b(check: Check) -> dict:
    """Activation offload where a block's compute is large against its activations (the 1b
    Llama in bf16): step time and peak against no offload, losses equal."""
    import flatshard

    policy = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for mode in ("none", "offload"):
        ac = None if mode == "none" else mode
        model = check.sharded("1b", mp_policy=policy, activation_checkpointing=ac)
        check.reset_peak()
        run = check.train(model, "1b", steps=WARMUP + 2)
        out[mode] = {"step_s": run["step_s"], "losses": run["losses"], "peak_bytes": check.peak()}
        if mode == "offload":
            out[mode]["profile"] = _profile_step(check, model, "1b")
        del model
    out["step_ratio"] = out["offload"]["step_s"] / out["none"]["step_s"]
    out["equal_losses"] = out["offload"]["losses"] == out["none"]["losses"]
    out["ok"] = out["equal_losses"]
    return out


def ac_1b(check: Check, compile: bool = False) -> dict:
    """Step time and peak per activation checkpointing mode where matrix products dominate
    (the 1b Llama in bf16, fused attention): selective should fall between none and full."""
    import flatshard

    policy = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for mode in ("none", "full", "selective"):
        ac = None if mode == "none" else mode
        options = dict(mp_policy=policy, activation_checkpointing=ac, compile=compile)
        model = check.sharded("1b", **options)
        check.reset_peak()
        run = check.train(model, "1b", steps=WARMUP + 3)
        out[mode] = {"step_s": run["step_s"], "peak_bytes": check.peak()}
        del model
    for mode in ("none", "full", "selective"):  # the peer: the same AC and compile on FSDP2
        model = check.fsdp2(ac=None if mode == "none" else mode, compile=compile)
        check.reset_peak()
        run = check.train(model, "1b", steps=WARMUP + 3)
        out[f"fsdp2_{mode}"] = {"step_s": run["step_s"], "peak_bytes": check.peak()}
        del model
    steps = [out[mode]["step_s"] for mode in ("none", "selective", "full")]
    out["selective_between"] = steps[0] <= steps[1] <= steps[2]
    out["ok"] = True  # a measurement: what it shows is in the report
    return out


def ac_compiled_1b(check: Check) -> dict:
    """ac_1b with every block compiled: selective's policy then runs inside the graphs (in
    eager, torch's dispatch mode costs host time per op: slower than full on an H200)."""
    return ac_1b(check, compile=True)


def fsdp2_1b(check: Check) -> dict:
    """A ~1B Llama in bf16 at world 1: flatshard (torch's AdamW and flatshard's flat AdamW) and
    FSDP2 step times, taken in rotation, and each one's phases timed alone."""

    import flatshard

    policy = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    ours = check.sharded("1b", mp_policy=policy)
    theirs = check.fsdp2("1b")
    flat = check.sharded("1b", mp_policy=policy)
    runs = {"flatshard": ours, "fsdp2": theirs, "flatshard_flat_adamw": flat}
    times = {name: [] for name in runs}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in runs.items()}
    optimizers["flatshard_flat_adamw"] = flatshard.optim.AdamW(flat.parameters(), lr=1e-4)
    cfg, batch, seq = check.sizes["1b"]
    for index, tokens in enumerate(check.data("1b", 2 * STEPS + 3 * WARMUP)):
        tokens = tokens.to(check.device)
        for name in list(runs)[index % len(runs) :] + list(runs)[: index % len(runs)]:
            check.sync()
            start = time.perf_counter()
            logits = runs[name](tokens[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            check.sync()
            times[name].append(time.perf_counter() - start)
    step = {name: statistics.median(t[3 * WARMUP :]) for name, t in times.items()}
    params = sum(p.numel() for p in ours.parameters())
    out = {"params": params, "step_s": step, "ratio": step["flatshard"] / step["fsdp2"],
           "ratio_flat_adamw": step["flatshard_flat_adamw"] / step["fsdp2"]}  # fmt: skip
    out["phases_ms"] = {name: _phases(check, runs[name], optimizers[name]) for name in runs}
    peak = check.peak_flops()
    if peak:
        flops = 6 * params * batch * seq
        out["mfu"] = {n: flops / s / peak for n, s in step.items()}
    out["ok"] = True
    return out


def scale_8b(check: Check, compile: bool = False) -> dict:
    """Llama-3-8B's shapes (4 layers, 8192 tokens, bf16 with fp32 reduction) at world 1, one
    run at a time: flatshard with torch's fused AdamW and with its own flat AdamW on that
    kernel, against FSDP2 with torch's fused AdamW; step time, MFU, peak memory, losses and
    each phase's device and host time."""
    import flatshard

    policy = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    flatshard_model = lambda: check.sharded("8b", mp_policy=policy, compile=compile)  # noqa: E731
    runs = {
        "flatshard": (flatshard_model, torch.optim.AdamW),
        "flatshard_flat_adamw": (flatshard_model, flatshard.optim.AdamW),
        "fsdp2": (lambda: check.fsdp2("8b", compile=compile), torch.optim.AdamW),
    }
    cfg, batch, seq = check.sizes["8b"]
    out = {}
    for name, (build, make) in runs.items():
        model = build()
        optimizer = make(model.parameters(), lr=1e-4, fused=True)
        check.reset_peak()
        run = check.train(model, "8b", steps=WARMUP + 3, optimizer=optimizer)
        out[name] = {**run, "peak_bytes": check.peak(),
                     "phases_ms": _phases(check, model, optimizer, size="8b")}  # fmt: skip
        params = sum(p.numel() for p in model.parameters())
        del model, optimizer
    # per token: 6 x the parameters the tokens multiply (all but the embedding lookup) and the
    # attention's 12 x layers x dim x sequence (torchtitan's count)
    flops = batch * seq * (6 * (params - cfg["vocab_size"] * cfg["dim"])
                           + 12 * cfg["n_layers"] * cfg["dim"] * seq)  # fmt: skip
    peak = check.peak_flops()
    for name in runs:
        out[name]["mfu"] = flops / out[name]["step_s"] / peak if peak else None
    out["params"] = params
    out["step_ratio"] = {n: out[n]["step_s"] / out["fsdp2"]["step_s"] for n in runs}
    out["loss_max_rel_fsdp2"] = _max_rel(out["flatshard"]["losses"], out["fsdp2"]["losses"])
    out["ok"] = out["loss_max_rel_fsdp2"] < 2e-2  # the same model and data: close losses
    return out


def scale_8b_compiled(check: Check) -> dict:
    """scale_8b with every block compiled (flatshard's and FSDP2's alike)."""
    return scale_8b(check, compile=True)


def _phases(check: Check, model, optimizer, steps: int = 3, size: str = "1b") -> dict:
    """Median milliseconds of forward, backward and optimizer step, each timed alone (the
    device synchronized between them), and the host time of each: until its calls return,
    before the device is waited for."""
    tokens = check.data(size, 1)[0].to(check.device)
    phases = ("forward", "backward", "optimizer")
    timed = {key: [] for phase in phases for key in (phase, phase + "_host")}

    def forward():
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def step(_):
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(steps):
        check.sync()
        result = None
        for phase, call in zip(phases, (lambda _: forward(), lambda loss: loss.backward(), step)):
            start = time.perf_counter()
            result = call(result)  # the loss, for the backward
            timed[phase + "_host"].append(time.perf_counter() - start)
            check.sync()
            timed[phase].append(time.perf_counter() - start)
    return {key: 1e3 * statistics.median(values) for key, values in timed.items()}
