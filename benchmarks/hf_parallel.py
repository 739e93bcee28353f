"""A transformers Llama under tensor parallelism: flatshard against FSDP2 + torch TP.

Both train the same `LlamaForCausalLM` (random weights saved once with save_pretrained),
on the same data, at (dp, tp) = (world / tp, tp), inside one set of gloo worker
processes:

    fsdp2-tp   transformers' from_pretrained on every rank (the whole checkpoint read by
               each), torch's parallelize_module with Colwise/RowwiseParallel as
               transformers' base_model_tp_plan says, then FSDP2's fully_shard of every
               decoder layer and the root over the data-parallel ranks
    flatshard  flatshard.hf.from_pretrained(path, dims=ParallelDims(world, tp=tp)): built on
               meta, split by transformers' own plan, each rank reading only its slices

Modes alternate step by step (the order reversed every step) so a drift of the shared
machine hits both alike. Printed per rank 0 and per step: median seconds, bytes of each
collective kind, and the import (seconds, bytes read from the checkpoint); the losses of
the two runs must agree (printed as their largest relative difference).

    python benchmarks/hf_parallel.py --world 4 --tp 2 --steps 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))) if p not in sys.path]

from comm_counter import CommCounter  # noqa: E402
from compare import free_port, start_workers, worker_queue  # noqa: E402

import flatshard  # noqa: E402
from flatshard import hf  # noqa: E402

MODES = ("fsdp2-tp", "flatshard")


def build(mode: str, path: str, dims: flatshard.ParallelDims):
    """The model of `mode`, and (seconds, bytes read) of its import."""
    started = time.perf_counter()
    if mode == "flatshard":
        model = hf.from_pretrained(path, dims=dims, adapter=hf.TRANSFORMERS)
        read = hf.load_pretrained(model, path).bytes_read  # what one import reads
        return model, (time.perf_counter() - started, read)
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    read = os.path.getsize(os.path.join(path, "model.safetensors"))
    meshes = dims.build()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in model.config.base_model_tp_plan.items()}
    parallelize_module(model.model, meshes.tp, plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=meshes.fsdp)
    fully_shard(model, mesh=meshes.fsdp)
    return model, (time.perf_counter() - started, read)


def worker(rank: int, world: int, port: int, args, path: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = flatshard.ParallelDims(world, tp=args.tp)
    dp, dp_rank = dims.dp_replicate * dims.dp_shard, dims.build().dp_rank
    counter = CommCounter()
    counter.install()
    runs = {}
    for mode in MODES:
        model, imported = build(mode, path, dims)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[mode] = dict(model=model, opt=optimizer, imported=imported, times=[], losses=[])
        runs[mode]["bytes"] = []
    generator = torch.Generator().manual_seed(0)
    batch = args.micro_batch * dp
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (batch, args.seq + 1), generator=generator)
        mine = tokens[dp_rank * args.micro_batch : (dp_rank + 1) * args.micro_batch]
        for mode in MODES if step % 2 == 0 else MODES[::-1]:
            run = runs[mode]
            counter.reset()
            counter.active = True
            dist.barrier()
            started = time.perf_counter()
            logits = run["model"](mine[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
            loss.backward()
            run["opt"].step()
            run["opt"].zero_grad()
            elapsed = time.perf_counter() - started
            counter.active = False
            value = torch.tensor([loss.item() / world])
            dist.all_reduce(value)
            if step >= args.warmup:
                run["times"].append(elapsed)
                run["bytes"].append(dict(counter.bytes))
            run["losses"].append(value.item())
    if rank == 0:
        out.put({
            mode: dict(
                seconds=statistics.median(run["times"]),
                bytes=run["bytes"][-1],
                imported=run["imported"],
                losses=run["losses"],
            )
            for mode, run in runs.items()
        })  # fmt: skip
    dist.destroy_process_group()


def random_llama_dir(args, prefix: str):
    """A random transformers Llama of args' sizes saved in a new directory: (config, path)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix=prefix)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return config, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    import transformers

    config, path = random_llama_dir(args, "hf-parallel-")
    out = worker_queue()
    start_workers(worker, (args.world, free_port(), args, path, out), args.world)
    result = out.get()
    params = sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()
    )
    reference = result["fsdp2-tp"]
    agree = max(
        abs(a - b) / abs(b) for a, b in zip(result["flatshard"]["losses"], reference["losses"])
    )
    print(f"transformers Llama, {params / 1e6:.1f}M parameters, world {args.world} = "
          f"dp {args.world // args.tp} x tp {args.tp}, micro batch {args.micro_batch} x "
          f"{args.seq} tokens, {args.steps} timed steps (median), torch {torch.__version__}, "
          f"gloo; losses agree to {agree:.1e} (relative)\n")  # fmt: skip
    print("All-gather: bytes gathered (FSDP2); isend: bytes sent (flatshard's all-gather on "
          "gloo, each rank's shard to each peer); reduce-scatter / all-to-all: bytes reduced; "
          "all-reduce: TP's activations. Per rank 0, per step.\n")  # fmt: skip
    print("| mode | s/step | vs FSDP2+TP | all-gather MB | isend MB | reduce-scatter MB "
          "| all-to-all MB | all-reduce MB | import s | import MB read |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in result.items():
        b = {k: v / 1e6 for k, v in r["bytes"].items()}
        print(
            f"| {mode} | {r['seconds']:.3f} | {r['seconds'] / reference['seconds']:.2f} | "
            f"{b['all_gather']:.2f} | {b['send']:.2f} | {b['reduce_scatter']:.2f} | "
            f"{b['all_to_all']:.2f} | {b['all_reduce']:.2f} | {r['imported'][0]:.2f} | "
            f"{r['imported'][1] / 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
