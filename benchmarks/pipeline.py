"""Pipeline parallelism: flatshard's stages against FSDP2's under torch's own schedules.

Both split the same reference Llama into `pp` stages (`flatshard.stage_modules`: blocks
under their whole-model names), shard each stage over its data-parallel ranks and run it
with the same torch schedule, inside one set of gloo worker processes at
(pp, dp) = (pp, world / pp):

    fsdp2      torch's `fully_shard` on each stage's blocks and root, torch's `PipelineStage`
    flatshard  `flatshard.pipeline(model, ParallelDims(world, pp=pp), ...)`

and, for scale, the same model on the same global batch without a pipeline
(`flatshard.parallelize` over every rank as data-parallel, each rank's rows in micro-batches
of the pipelines' size, accumulated). Modes alternate step by step (the order
reversed every step) so a drift of the shared machine hits all alike. Printed per rank 0
(the first stage): the median seconds per step and the bytes each kind of collective moved
(FSDP2's all-gathers and reduce-scatters as it issues them, flatshard's as its counters
count them); the losses of the two pipelines must agree (their largest relative
difference).

With `--tied` the model's head is its embedding (as SmolLM2's, Llama-3.2-1B's): flatshard's
first stage owns the weight and sends it to the last stage each step, its gradient coming
back (api/pipeline_tie.py). torch's stage split has no such tie, so the FSDP2 peer runs the
model untied (the head a copy of the embedding: the usual workaround, more parameters and
other losses after the first step); flatshard's pipeline must then agree with the same tied
model without a pipeline.

    python benchmarks/pipeline.py --world 4 --pp 2 --schedule 1f1b --steps 6
    python benchmarks/pipeline.py --world 4 --pp 2 --schedule 1f1b --steps 6 --tied
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))) if p not in sys.path]

from comm_counter import CommCounter  # noqa: E402
from compare import free_port, start_workers, worker_queue  # noqa: E402

import flatshard  # noqa: E402
from flatshard.api.pipeline import SCHEDULES  # noqa: E402
from flatshard.models import Llama, LlamaConfig  # noqa: E402

MODES = ("fsdp2", "flatshard", "no pipeline")
SIZES = {  # the reference Llama at the other benchmarks' shapes (byte-level vocabulary)
    "tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=172),
    "35m": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376),
    "120m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),
}


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def fsdp2_pipeline(whole, dims, args):
    """torch's own recipe: each stage FSDP2-sharded, torch's PipelineStage and schedule."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    meshes = dims.build()
    stage = flatshard.stage_modules(whole, args.pp, meshes.pp_rank)
    for block in stage.layers:
        fully_shard(block, mesh=meshes.fsdp)
    fully_shard(stage, mesh=meshes.fsdp)
    runner = PipelineStage(stage, meshes.pp_rank, args.pp, torch.device("cpu"),
                           group=meshes.pp.get_group())  # fmt: skip
    schedule = SCHEDULES[args.schedule](runner, n_microbatches=args.microbatches, loss_fn=loss_fn)
    return stage, schedule, runner


def worker(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = LlamaConfig(vocab_size=257, max_seq_len=args.seq, tie_embeddings=args.tied,
                      **SIZES[args.size])  # fmt: skip
    torch.manual_seed(0)
    whole = Llama(cfg)
    dims = flatshard.ParallelDims(world, pp=args.pp)
    meshes = dims.build()
    counter = CommCounter()
    counter.install()
    peer = copy.deepcopy(whole)
    if args.tied:  # torch's stages cannot share it: the head a copy of its own
        peer.lm_head.weight = torch.nn.Parameter(peer.embed_tokens.weight.detach().clone())
    stage, schedule, runner = fsdp2_pipeline(peer, dims, args)
    pipe = flatshard.pipeline(copy.deepcopy(whole), dims, loss_fn=loss_fn,
                              microbatches=args.microbatches, schedule=args.schedule)  # fmt: skip
    flat = flatshard.parallelize(copy.deepcopy(whole), flatshard.ParallelDims(world))
    runs = {
        "fsdp2": dict(model=stage, step=lambda x, y: _torch_step(schedule, runner, x, y, meshes)),
        "flatshard": dict(model=pipe.model, step=pipe.step),
        "no pipeline": dict(model=flat, step=lambda x, y: _accumulate(flat, x, y, args)),
    }
    for run in runs.values():
        run.update(opt=torch.optim.AdamW(run["model"].parameters(), lr=1e-3), times=[],
                   losses=[], bytes=[])  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    rows = args.micro_batch * args.microbatches  # per data-parallel rank of the pipelines
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, 257, (rows * world, args.seq + 1), generator=generator)
        for mode in MODES if step % 2 == 0 else MODES[::-1]:
            run = runs[mode]
            pipelined = mode != "no pipeline"
            ranks, index = (meshes.dp.size(), meshes.dp_rank) if pipelined else (world, rank)
            mine = tokens[: rows * meshes.dp.size()].chunk(ranks)[index]  # one global batch
            counter.reset()
            counter.active = True
            dist.barrier()
            started = time.perf_counter()
            loss = run["step"](mine[:, :-1], mine[:, 1:])
            run["opt"].step()
            run["opt"].zero_grad()
            elapsed = time.perf_counter() - started
            counter.active = False
            value = loss.detach().reshape(1) / (world if not pipelined else meshes.dp.size())
            dist.all_reduce(value, group=None if not pipelined else meshes.dp.get_group())
            if step >= args.warmup:
                run["times"].append(elapsed)
                run["bytes"].append(dict(counter.bytes))
            run["losses"].append(value.item())
    if rank == 0:
        out.put({mode: dict(seconds=statistics.median(r["times"]), bytes=r["bytes"][-1],
                            losses=r["losses"]) for mode, r in runs.items()})  # fmt: skip
    dist.destroy_process_group()


def _torch_step(schedule, runner, inputs, targets, meshes) -> torch.Tensor:
    losses = []
    if runner.is_first:
        schedule.step(inputs)
    else:
        schedule.step(target=targets, losses=losses)
    loss = torch.stack(losses).mean().detach() if runner.is_last else torch.zeros(())
    dist.all_reduce(loss, group=meshes.pp.get_group())
    return loss


def _accumulate(model, inputs, targets, args) -> torch.Tensor:
    """This rank's rows of the global batch, in micro-batches of the pipelines' size."""
    count = max(1, inputs.shape[0] // args.micro_batch)
    total = torch.zeros(())
    for x, y in zip(inputs.chunk(count), targets.chunk(count)):
        loss = loss_fn(model(x), y) / count
        loss.backward()
        total += loss.detach()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="35m")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tied", action="store_true", help="the head is the embedding")
    args = parser.parse_args()
    out = worker_queue()
    start_workers(worker, (args.world, free_port(), args, out), args.world)
    result = out.get()
    model = Llama(LlamaConfig(vocab_size=257, tie_embeddings=args.tied, **SIZES[args.size]))
    params = sum(p.numel() for p in model.parameters())
    # tied: the peer trains another (untied) model; flatshard's pipeline against its own
    # tied model without one
    other = "no pipeline" if args.tied else "fsdp2"
    ours, theirs = result["flatshard"]["losses"], result[other]["losses"]
    agree = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    dp = args.world // args.pp
    tie = ", tied embeddings (the FSDP2 peer untied)" if args.tied else ""
    print(f"reference Llama {args.size} ({params / 1e6:.1f}M parameters{tie}), world "
          f"{args.world} = pp {args.pp} x dp {dp}, {args.schedule}, {args.microbatches} "
          f"micro-batches of {args.micro_batch} x {args.seq} tokens per data-parallel rank, "
          f"{args.steps} timed steps (median), torch {torch.__version__}, gloo; flatshard's "
          f"pipeline and {other}'s losses agree to {agree:.1e} (relative)\n")  # fmt: skip
    print("Bytes per step on rank 0 (the first stage; `no pipeline`: every block on every "
          "rank); isend: flatshard's collectives on gloo, the stages' activations.\n")  # fmt: skip
    print("| mode | s/step | vs FSDP2 pipeline | all-gather MB | isend MB | reduce-scatter MB "
          "| all-reduce MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    reference = result["fsdp2"]["seconds"]
    for mode, r in result.items():
        b = {k: v / 1e6 for k, v in r["bytes"].items()}
        print(f"| {mode} | {r['seconds']:.3f} | {r['seconds'] / reference:.2f} | "
              f"{b['all_gather']:.2f} | {b['send']:.2f} | {b['reduce_scatter']:.2f} | "
              f"{b['all_reduce']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
