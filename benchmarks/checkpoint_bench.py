"""Checkpoint save/load time: flatshard against PyTorch FSDP2 + DCP, in one run.

    python benchmarks/checkpoint_bench.py [--world 2] [--preset 35m|tiny] [--repeats 3]
        [--out benchmarks/RESULTS-checkpoint.md]

Same model (Llama preset, fp32 AdamW state after one step), same world size, same disk.
Modes are interleaved in every repeat so machine drift hits them alike. Reported: median
save and load seconds and their ratio to FSDP2's, and the blocking time of flatshard's
asynchronous save against its synchronous save.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flatshard  # noqa: E402
from flatshard import checkpoint  # noqa: E402
from flatshard.models import Llama, LlamaConfig  # noqa: E402

PRESETS = {
    "35m": dict(vocab_size=12000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376),
    "tiny": dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48),
}


def build(framework: str, cfg: LlamaConfig):
    torch.manual_seed(0)
    model = Llama(cfg)
    if framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = flatshard.fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():  # one step so the optimizer state exists
        param.grad = torch.ones_like(param)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def dcp_save(model, optimizer, path):
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def dcp_load(model, optimizer, path):
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def one_repeat(base: str, fsdp2, ours) -> dict[str, float]:
    """Every mode once, in the same order each repeat."""
    model, optimizer = ours
    result = {
        "FSDP2 + DCP save": timed(lambda: dcp_save(*fsdp2, base + "-fsdp2")),
        "flatshard save": timed(
            lambda: checkpoint.save(base + "-ours", model=model, optimizer=optimizer, step=1)
        ),
        "flatshard + plain DCP save": timed(lambda: dcp_save(*ours, base + "-plain")),
    }
    handle = checkpoint.save(
        base + "-async", model=model, optimizer=optimizer, step=1, async_save=True
    )
    result["flatshard async save (blocking)"] = handle.blocking_seconds
    handle.wait()
    result["FSDP2 + DCP load"] = timed(lambda: dcp_load(*fsdp2, base + "-fsdp2"))
    result["flatshard load"] = timed(
        lambda: checkpoint.load(base + "-ours", model=model, optimizer=optimizer)
    )
    result["flatshard load, verify=False"] = timed(
        lambda: checkpoint.load(base + "-ours", model=model, optimizer=optimizer, verify=False)
    )
    result["flatshard + plain DCP load"] = timed(lambda: dcp_load(*ours, base + "-plain"))
    return result


def worker(rank: int, world: int, port: int, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = LlamaConfig(max_seq_len=256, **PRESETS[args.preset])
    fsdp2 = build("fsdp2", cfg)
    ours = build("flatshard", cfg)
    times: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        base = os.path.join(args.dir, f"r{repeat}")
        for name, seconds in one_repeat(base, fsdp2, ours).items():
            times.setdefault(name, []).append(seconds)
        dist.barrier()
        if rank == 0:
            for suffix in ("-fsdp2", "-ours", "-plain", "-async"):
                shutil.rmtree(base + suffix, ignore_errors=True)
    if rank == 0:
        queue.put({name: statistics.median(values) for name, values in times.items()})
    dist.destroy_process_group()
    # Skip interpreter teardown, where gloo's threads sometimes abort the process.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="35m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.dir = tempfile.mkdtemp(prefix="flatshard-ckpt-bench-")
    queue = mp.get_context("spawn").SimpleQueue()
    port = 29000 + os.getpid() % 1000
    mp.spawn(worker, args=(args.world, port, args, queue), nprocs=args.world)
    medians = queue.get()
    shutil.rmtree(args.dir, ignore_errors=True)
    report = render(args, medians)
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report)


def render(args, medians: dict[str, float]) -> str:
    def ratio(name, reference):
        return f"{medians[name] / medians[reference]:.2f}"

    rows = [
        ("FSDP2 + DCP save", "1.00"),
        ("flatshard save", ratio("flatshard save", "FSDP2 + DCP save")),
        ("flatshard + plain DCP save", ratio("flatshard + plain DCP save", "FSDP2 + DCP save")),
        ("FSDP2 + DCP load", "1.00"),
        ("flatshard load", ratio("flatshard load", "FSDP2 + DCP load")),
        (
            "flatshard load, verify=False",
            ratio("flatshard load, verify=False", "FSDP2 + DCP load"),
        ),
        ("flatshard + plain DCP load", ratio("flatshard + plain DCP load", "FSDP2 + DCP load")),
    ]
    lines = [
        "# Checkpoint benchmark",
        "",
        f"- command: `python benchmarks/checkpoint_bench.py --world {args.world} "
        f"--preset {args.preset} --repeats {args.repeats}`",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"torch {torch.__version__}",
        f"- model: Llama preset `{args.preset}` with AdamW state, world {args.world} (gloo, CPU); "
        "medians over repeats, each repeat runs every mode",
        "- `flatshard save/load` include the atomic commit (fsync, rename, `latest`), CRC-32 of "
        "every file (computed on save, verified on load unless `verify=False`) and per-rank "
        "RNG state; `plain DCP` is `dcp.save/load` on the same model",
        "- async save: the first one allocates its host staging buffers, later ones refill "
        "them (the median is over repeats, i.e. mostly refills)",
        "",
        "| operation | median s | × FSDP2 + DCP |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {medians[name]:.3f} | {r} |" for name, r in rows]
    blocking = medians["flatshard async save (blocking)"]
    lines += [
        "",
        f"Async save blocks for {blocking:.3f} s = "
        f"{100 * blocking / medians['flatshard save']:.1f}% of a synchronous flatshard save "
        f"({medians['flatshard save']:.3f} s).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
