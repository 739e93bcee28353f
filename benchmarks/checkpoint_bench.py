"""Checkpoint save/load time: flatshard against PyTorch FSDP2 + DCP, in one run.

    python benchmarks/checkpoint_bench.py [--world 2] [--preset 120m|35m|tiny] [--repeats 3]
        [--staging-mib 64] [--out benchmarks/RESULTS-checkpoint.md]

Same model (Llama preset, fp32 AdamW state after one step), same world size, same disk.
Modes are interleaved in every repeat so machine drift hits them alike. Reported: median
save and load seconds, GB/s (bytes of the checkpoint over seconds) and their ratio to
FSDP2's and to plain DCP's on the same flatshard model, the blocking time of flatshard's
asynchronous save, and the extra host memory (resident set) that save took against its
staging bound.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flatshard  # noqa: E402
from benchmarks.compare import free_port, start_workers, worker_queue  # noqa: E402
from flatshard import checkpoint  # noqa: E402
from flatshard.models import Llama, LlamaConfig  # noqa: E402

PRESETS = {
    "120m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
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


def directory_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


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


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The most resident memory above the start, sampled every millisecond."""

    def __enter__(self):
        self.start = self.peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.extra = self.peak - self.start


def one_repeat(base: str, fsdp2, ours, staging: int, turn: int) -> dict[str, float]:
    """Every mode once; the saves (and the loads) start with another one each repeat, so no
    mode always follows the same one (a previous write still flushing to disk)."""
    model, optimizer = ours
    saves = {
        "FSDP2 + DCP save": lambda: dcp_save(*fsdp2, base + "-fsdp2"),
        "flatshard save": lambda: checkpoint.save(
            base + "-ours", model=model, optimizer=optimizer, step=1, staging_bytes=staging
        ),
        "flatshard + plain DCP save": lambda: dcp_save(*ours, base + "-plain"),
    }
    loads = {
        "FSDP2 + DCP load": lambda: dcp_load(*fsdp2, base + "-fsdp2"),
        "flatshard load": lambda: checkpoint.load(base + "-ours", model=model, optimizer=optimizer),
        "flatshard load, verify=False": lambda: checkpoint.load(
            base + "-ours", model=model, optimizer=optimizer, verify=False
        ),
        "flatshard + plain DCP load": lambda: dcp_load(*ours, base + "-plain"),
    }
    result = {name: timed(saves[name]) for name in rotated(saves, turn)}
    with PeakResident() as memory:
        handle = checkpoint.save(
            base + "-async", model=model, optimizer=optimizer, step=1, async_save=True,
            staging_bytes=staging,
        )  # fmt: skip
        handle.wait()
    result["flatshard async save (blocking)"] = handle.blocking_seconds
    result["async extra resident bytes"] = memory.extra
    result["async staged bytes"] = handle.peak_staging_bytes
    result["checkpoint bytes"] = directory_bytes(base + "-plain")
    result.update({name: timed(loads[name]) for name in rotated(loads, turn)})
    return result


def rotated(modes: dict, turn: int) -> list[str]:
    names = list(modes)
    turn %= len(names)
    return names[turn:] + names[:turn]


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
        for name, seconds in one_repeat(base, fsdp2, ours, args.staging_mib << 20, repeat).items():
            times.setdefault(name, []).append(seconds)
        dist.barrier()
        if rank == 0:
            for suffix in ("-fsdp2", "-ours", "-plain", "-async"):
                shutil.rmtree(base + suffix, ignore_errors=True)
    if rank == 0:
        # memory: the most of any repeat (the first async save allocates the wave buffers)
        queue.put(
            {
                name: (max if "bytes" in name else statistics.median)(values)
                for name, values in times.items()
            }
        )
    dist.destroy_process_group()
    # Skip interpreter teardown, where gloo's threads sometimes abort the process.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="35m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--staging-mib", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.dir = tempfile.mkdtemp(prefix="flatshard-ckpt-bench-")
    queue = worker_queue()
    port = free_port()
    start_workers(worker, (args.world, port, args, queue), args.world)
    medians = queue.get()
    shutil.rmtree(args.dir, ignore_errors=True)
    report = render(args, medians)
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report)


def render(args, medians: dict[str, float]) -> str:
    size = medians["checkpoint bytes"]

    def row(name, fsdp2, plain):
        seconds = medians[name]
        return (
            f"| {name} | {seconds:.3f} | {size / seconds / 1e9:.2f} | "
            f"{medians[fsdp2] / seconds:.2f} | {medians[plain] / seconds:.2f} |"
        )

    saves = ("FSDP2 + DCP save", "flatshard + plain DCP save")
    loads = ("FSDP2 + DCP load", "flatshard + plain DCP load")
    names = [
        ("FSDP2 + DCP save", *saves),
        ("flatshard + plain DCP save", *saves),
        ("flatshard save", *saves),
        ("FSDP2 + DCP load", *loads),
        ("flatshard + plain DCP load", *loads),
        ("flatshard load", *loads),
        ("flatshard load, verify=False", *loads),
    ]
    lines = [
        "# Checkpoint benchmark",
        "",
        f"- command: `python benchmarks/checkpoint_bench.py --world {args.world} "
        f"--preset {args.preset} --repeats {args.repeats} --staging-mib {args.staging_mib}`",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"torch {torch.__version__}",
        f"- model: Llama preset `{args.preset}` with AdamW state, world {args.world} (gloo, CPU); "
        "medians over repeats, each repeat runs every mode",
        "- `flatshard save/load` include the atomic commit (fsync, rename, `latest`), CRC-32 of "
        "every file (computed on save, verified on load unless `verify=False`) and per-rank "
        "RNG state; `plain DCP` is `dcp.save/load` on the same model",
        "- saves and loads of flatshard plan from the layout (no plan gather); its copies "
        "for the write go in waves within the staging bound; the async save copies the "
        "sharded state in waves after the call (the next optimizer step would wait for them)",
        "",
        f"- checkpoint: {size / 1e6:.0f} MB (model + AdamW state); GB/s = that over the "
        "median seconds; speed-ups are time ratios (> 1: faster); the order of the saves "
        "(and of the loads) rotates by repeat",
        "",
        "| operation | median s | GB/s | speed-up vs FSDP2 + DCP | vs plain DCP, same model |",
        "|---|---|---|---|---|",
    ]
    lines += [row(*names_of) for names_of in names]
    blocking = medians["flatshard async save (blocking)"]
    staging = args.staging_mib << 20
    lines += [
        "",
        f"Async save blocks for {blocking:.3f} s = "
        f"{100 * blocking / medians['flatshard save']:.1f}% of a synchronous flatshard save "
        f"({medians['flatshard save']:.3f} s). During it (the first: it allocates the two wave "
        "buffers that later ones reuse) rank 0's resident memory grew by "
        f"{medians['async extra resident bytes'] / 2**20:.1f} MiB at most (its copies: "
        f"{medians['async staged bytes'] / 2**20:.1f} MiB) against a staging bound of "
        f"{staging / 2**20:.0f} MiB ({medians['async extra resident bytes'] / staging:.2f}x).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
