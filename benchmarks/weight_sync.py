"""Weight sync to a receiver process outside the trainer's job, three ways, in one run.

    python benchmarks/weight_sync.py [--world 2] [--preset 120m|35m|tiny] [--repeats 3]
        [--out FILE]

The trainer (`--world` gloo ranks, a sharded Llama) pushes its full weights to one receiver
process holding the same model unsharded, over a gloo group joining them:
- `sync_weights`: flatshard's, every trainer rank sending its own blocks straight from its
  shards in 64 MiB buckets (fp32 wire, then bf16);
- `full_tensor() loop`: what RL trainers on FSDP2 write: per parameter, every rank gathers
  it (`full_tensor()`) and rank 0 sends it;
- `full_weights + send`: `flatshard.full_weights(to_rank=0)` (bucketed gathers), rank 0
  sending each tensor.
Each is timed from the trainers' start to the receiver's acknowledgement; GB/s counts the
fp32 model's bytes. Then the bytes of a delta sync after one AdamW step of full
fine-tuning and of LoRA (rank 16 on the attention and MLP projections: only the adapters
change). Modes alternate across repeats; medians. CPU and loopback TCP: the ratios are the
point, not the GB/s.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flatshard  # noqa: E402
from benchmarks.checkpoint_bench import PRESETS  # noqa: E402
from benchmarks.compare import free_port  # noqa: E402
from flatshard.comm.sync_group import recv_object, send_object  # noqa: E402
from flatshard.models import Llama, LlamaConfig  # noqa: E402
from flatshard.models.lora import LoRASpec, add_lora  # noqa: E402

MODES = ("sync_weights", "sync_weights bf16", "full_tensor() loop", "full_weights + send")
ACK = 9


def _model(cfg: LlamaConfig, lora: bool, shard: bool):
    torch.manual_seed(0)
    model = Llama(cfg)
    if lora:
        add_lora(model, LoRASpec(rank=16, alpha=32.0))
    if shard:
        for layer in model.layers:
            flatshard.fully_shard(layer)
        flatshard.fully_shard(model)
    return model


def _send_each(group, items) -> None:
    """Rank 0 sends each (name, tensor) to the receiver, in order."""
    for index, (_, tensor) in enumerate(items):
        if group.rank == 0:
            group.data.send([tensor.contiguous()], group.trainers, index).wait()


def _push(mode: str, model, group) -> None:
    if mode.startswith("sync_weights"):
        flatshard.sync_weights(model, group, names="model", wire="bf16" if "bf16" in mode else None)
    elif mode == "full_tensor() loop":
        _send_each(group, ((n, p.full_tensor()) for n, p in model.state_dict().items()))
    else:
        _send_each(group, flatshard.full_weights(model, "model", to_rank=0))


def _take(mode: str, model, group) -> None:
    if mode.startswith("sync_weights"):
        flatshard.receive_weights(group, model)
        return
    with torch.no_grad():
        for index, tensor in enumerate(model.state_dict().values()):
            buffer = torch.empty_like(tensor)
            group.data.recv([buffer], 0, index).wait()
            tensor.copy_(buffer)


def _step(model) -> None:
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 65))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()


def trainer(rank: int, world: int, ports, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = LlamaConfig(max_seq_len=256, **PRESETS[args.preset])
    group = flatshard.weight_sync_group(f"127.0.0.1:{ports[1]}", receivers=1, backend="gloo")
    model = _model(cfg, lora=False, shard=True)
    times: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for mode in MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]:
            dist.barrier()
            start = time.perf_counter()
            _push(mode, model, group)
            if rank == 0:
                recv_object(group, world, ACK)
                times.setdefault(mode, []).append(time.perf_counter() - start)
    deltas = {}
    for kind, lora in (("full fine-tuning", False), ("LoRA r16", True)):
        tuned = model if not lora else _model(cfg, lora=True, shard=True)
        if lora:
            flatshard.sync_weights(tuned, group, names="model", delta=True)  # the first: full
        _step(tuned)
        stats = flatshard.sync_weights(tuned, group, names="model", delta=True)
        size = sum(t.numel() * 4 for t in tuned.state_dict().values())
        sent = torch.tensor([stats.bytes_sent, stats.buckets_sent, stats.buckets])
        dist.all_reduce(sent)
        sent = torch.cat([sent, torch.tensor([size])])
        deltas[kind] = sent.tolist()
    if rank == 0:
        nbytes = sum(t.numel() * 4 for t in model.state_dict().values())
        queue.put({"times": times, "deltas": deltas, "bytes": nbytes})
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip teardown, where gloo's threads sometimes abort the process


def receiver(world: int, ports, args) -> None:
    torch.set_num_threads(1)
    cfg = LlamaConfig(max_seq_len=256, **PRESETS[args.preset])
    group = flatshard.weight_sync_group(
        f"127.0.0.1:{ports[1]}", trainers=world, receiver=0, backend="gloo"
    )
    model = _model(cfg, lora=False, shard=False)
    for repeat in range(args.repeats):
        for mode in MODES[repeat % len(MODES) :] + MODES[: repeat % len(MODES)]:
            _take(mode, model, group)
            send_object(group, "done", 0, ACK)
    flatshard.receive_weights(group, model)  # full fine-tuning's delta
    lora_model = _model(cfg, lora=True, shard=False)
    flatshard.receive_weights(group, lora_model)
    flatshard.receive_weights(group, lora_model)
    os._exit(0)


def report(result: dict, args) -> str:
    nbytes = result["bytes"]
    medians = {mode: statistics.median(ts) for mode, ts in result["times"].items()}
    base = medians["sync_weights"]
    lines = [
        f"### weight sync, preset {args.preset}, world {args.world} -> 1 receiver "
        f"({datetime.now(timezone.utc):%Y-%m-%d})",
        "",
        f"`python benchmarks/weight_sync.py --preset {args.preset} --world {args.world} "
        f"--repeats {args.repeats}`; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, gloo over loopback; "
        f"model {nbytes / 2**20:.0f} MiB fp32",
        "",
        "| mode | seconds (median) | GB/s of the fp32 model | time / sync_weights |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        seconds = medians[mode]
        lines.append(f"| {mode} | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | "
                     f"{seconds / base:.2f}x |")  # fmt: skip
    lines += ["", "| delta sync after one AdamW step | bytes sent | buckets sent |"]
    lines.append("|---|---|---|")
    for kind, (sent, buckets, total, size) in result["deltas"].items():
        lines.append(f"| {kind} | {sent / 2**20:.1f} MiB ({sent / size:.1%} of the model) | "
                     f"{buckets} of {total} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="35m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    ports = (free_port(), free_port())
    procs = [context.Process(target=trainer, args=(r, args.world, ports, args, queue))
             for r in range(args.world)]  # fmt: skip
    procs.append(context.Process(target=receiver, args=(args.world, ports, args)))
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join(timeout=120)
    text = report(result, args)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
