"""Moving the training state for RL: flatshard against PyTorch FSDP2, in one run.

    python benchmarks/state_movement.py [--world 2] [--preset 120m|35m|tiny] [--repeats 3]
        [--out FILE]

Same model (Llama preset, AdamW state after one step, gradients held), same world size.
Offload + reload: flatshard's `offload_states` / `reload_states` (one copy per storage: a
bucket's shard, its gradient, each optimizer state) against what FSDP2 users write (each
parameter's local shard, gradient and optimizer state copied to the host and its device
storage freed, then back). Full weights: `flatshard.full_weights` (HF names, 1 GiB groups)
against FSDP2's `get_model_state_dict(full_state_dict=True)` and a `full_tensor()` loop.
Modes alternate in every repeat; medians. On the CPU "host" and "device" are both RAM: the
offload figures are the copies' cost, not PCIe's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flatshard  # noqa: E402
from benchmarks.bench_modes import PRESETS  # noqa: E402
from benchmarks.checkpoint_bench import build as checkpoint_model  # noqa: E402
from benchmarks.checkpoint_bench import timed  # noqa: E402
from flatshard.models import LlamaConfig  # noqa: E402


def build(framework: str, cfg: LlamaConfig):
    """checkpoint_bench's model with its AdamW state, and gradients held, as between a
    backward and its optimizer step."""
    model, optimizer = checkpoint_model(framework, cfg)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    return model, optimizer


def _fsdp2_tensors(model, optimizer) -> list[torch.Tensor]:
    found = []
    for param in model.parameters():
        found += [param._local_tensor, param.grad._local_tensor]  # FSDP2 users do this
        for value in optimizer.state[param].values():
            if value.dim() > 0:
                found.append(getattr(value, "_local_tensor", value))
    return found


def fsdp2_offload(model, optimizer) -> list:
    moved = []
    for tensor in _fsdp2_tensors(model, optimizer):
        moved.append((tensor, tensor.to("cpu", copy=True)))
        tensor.untyped_storage().resize_(0)
    return moved


def fsdp2_reload(moved) -> None:
    for tensor, host in moved:
        tensor.untyped_storage().resize_(host.numel() * host.element_size())
        with torch.no_grad():
            tensor.copy_(host)


def state_bytes(model, optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in _fsdp2_tensors(model, optimizer))


def consume(stream) -> None:
    for _, tensor in stream:
        del tensor


def one_repeat(fsdp2, ours) -> dict[str, float]:
    result = {}
    moved = []
    result["FSDP2 per-tensor offload"] = timed(lambda: moved.append(fsdp2_offload(*fsdp2)))
    result["FSDP2 per-tensor reload"] = timed(lambda: fsdp2_reload(moved.pop()))
    result["flatshard offload_states"] = timed(lambda: flatshard.offload_states(*ours))
    result["flatshard reload_states"] = timed(lambda: flatshard.reload_states(*ours))
    options = StateDictOptions(full_state_dict=True)
    result["FSDP2 get_model_state_dict(full)"] = timed(
        lambda: get_model_state_dict(fsdp2[0], options=options)
    )
    result["FSDP2 full_tensor() loop"] = timed(
        lambda: consume((n, p.full_tensor()) for n, p in fsdp2[0].named_parameters())
    )
    result["flatshard full_weights"] = timed(lambda: consume(flatshard.full_weights(ours[0])))
    return result


def worker(rank: int, world: int, port: int, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = LlamaConfig(**PRESETS[args.preset]["cfg"])
    fsdp2 = build("fsdp2", cfg)
    ours = build("flatshard", cfg)
    sizes = {
        "state": state_bytes(*fsdp2),
        "weights": sum(p.numel() * p.element_size() for p in ours[0].parameters()),
    }
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, seconds in one_repeat(fsdp2, ours).items():
            times.setdefault(name, []).append(seconds)
    # On the CPU the host copies take the freed storages' place: the resident set should not
    # grow by the state's size (it would if the "device" storages were not freed).
    before = _resident()
    flatshard.offload_states(*ours)
    sizes["rss_growth"] = _resident() - before
    flatshard.reload_states(*ours)
    if rank == 0:
        queue.put(({name: statistics.median(v) for name, v in times.items()}, sizes))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown, where gloo's threads sometimes abort


def _resident() -> int:
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--preset", choices=("120m", "35m", "tiny"), default="120m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    port = 29000 + os.getpid() % 1000
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the workers' freed buffers go back at once
    mp.spawn(worker, args=(args.world, port, args, queue), nprocs=args.world)
    medians, sizes = queue.get()
    report = render(args, medians, sizes)
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report)


def render(args, medians: dict[str, float], sizes: dict[str, int]) -> str:
    gb_state, gb_weights = sizes["state"] / 1e9, sizes["weights"] / 1e9
    pairs = [
        ("offload", "FSDP2 per-tensor offload", "flatshard offload_states", gb_state),
        ("reload", "FSDP2 per-tensor reload", "flatshard reload_states", gb_state),
        ("full weights", "FSDP2 get_model_state_dict(full)", "flatshard full_weights", gb_weights),
        ("full weights", "FSDP2 full_tensor() loop", "flatshard full_weights", gb_weights),
    ]
    lines = [
        "# State movement benchmark (RL: offload/reload, full weights)",
        "",
        f"- command: `python benchmarks/state_movement.py --world {args.world} "
        f"--preset {args.preset} --repeats {args.repeats}`",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"torch {torch.__version__}",
        f"- per rank: {gb_state:.3f} GB of weights, gradients and AdamW state moved; "
        f"{gb_weights:.3f} GB of full weights streamed (fp32)",
        f"- resident set growth at offload_states on rank 0: {sizes['rss_growth'] / 1e6:.1f} MB "
        f"(the state moved: {sizes['state'] / 1e6:.1f} MB; its host copies replace the freed "
        "storages)",
        "",
        "| what | peer | peer s | flatshard s | flatshard GB/s | × peer |",
        "|---|---|---|---|---|---|",
    ]
    for what, peer, ours, gb in pairs:
        lines.append(
            f"| {what} | {peer} | {medians[peer]:.3f} | {medians[ours]:.3f} | "
            f"{gb / medians[ours]:.2f} | {medians[ours] / medians[peer]:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
