"""Why flatshard reduce-scatters with an all-to-all and all-gathers with sends on gloo: time
the ways to reduce-scatter and all-gather one flat bucket between CPU processes.

gloo's `reduce_scatter_single` clones its whole input, all-reduces the clone and copies
this rank's piece out: it sends twice the bytes a reduce-scatter needs. An all-to-all sends
each rank only its own piece of every other rank's buffer ((N-1)/N of the buffer, as a ring
reduce-scatter does) and the N pieces are summed locally (flatshard.comm).

gloo's `all_gather_single` gathers into a temporary buffer it allocates per call and copies
that into the output. flatshard sends its shard to each peer and receives each peer's
shard straight into its place in the output: the same bytes, no temporary, no copy.

The shared-memory rows measure what a transport for ranks on one host could save (not
used by flatshard yet): each rank writes its piece into a segment of /dev/shm that every
rank maps, one small gloo all-reduce says all are written, each rank reads what it needs,
and a second says all have read (before the segment is written again). "In place": the
ranks would compute from the gathered segment itself (no copy out).

    python benchmarks/gloo_collectives.py --world 2 4 --elements 3400000

Prints the median wall time and the process CPU time (all threads, gloo's included) per
call on rank 0, and summed over the ranks.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from compare import exit_worker, free_port, start_workers  # noqa: E402

from flatshard import comm, compat  # noqa: E402


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _worker(rank: int, world: int, port: int, elements: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    shard_elements = elements // world
    flat = torch.randn(shard_elements * world)
    shard = torch.randn(shard_elements)
    out_shard = torch.empty(shard_elements)
    out_full = torch.empty(shard_elements * world)

    def gloo_reduce_scatter():
        compat.reduce_scatter_single(out_shard, flat)

    def all_reduce_then_copy():
        dist.all_reduce(flat)
        out_shard.copy_(flat[rank * shard_elements : (rank + 1) * shard_elements])

    def flatshard_reduce_scatter():
        comm.reduce_scatter(out_shard, flat, None, average=False).wait()

    def gloo_all_gather():
        compat.all_gather_single(out_full, shard)

    def flatshard_all_gather():
        comm.all_gather(out_full, shard, None).wait()

    # one segment every rank maps: world x the bucket (the reduce-scatter's inputs)
    path = f"/dev/shm/flatshard-gloo-collectives-{port}"
    if rank == 0:
        with open(path, "wb") as handle:
            handle.truncate(4 * world * shard_elements * world)
    dist.barrier()
    segment = torch.from_file(path, shared=True, size=world * shard_elements * world)
    dist.barrier()
    if rank == 0:
        os.unlink(path)  # mapped by every rank: the memory lives until the last unmaps it
    flag = torch.zeros(1)

    def shared_all_gather(copy_out: bool = True):
        segment[rank * shard_elements : (rank + 1) * shard_elements].copy_(shard)
        dist.all_reduce(flag)  # every rank's piece is written
        if copy_out:
            out_full.copy_(segment[: world * shard_elements])
        dist.all_reduce(flag)  # every rank has read

    def shared_reduce_scatter():
        full = shard_elements * world
        segment[rank * full : (rank + 1) * full].copy_(flat)
        dist.all_reduce(flag)
        pieces = segment.view(world, world, shard_elements)[:, rank]
        torch.sum(pieces, dim=0, out=out_shard)
        dist.all_reduce(flag)

    cases = [
        ("reduce-scatter: gloo reduce_scatter_single", gloo_reduce_scatter),
        ("reduce-scatter: all_reduce + copy", all_reduce_then_copy),
        ("reduce-scatter: flatshard (all-to-all + sum)", flatshard_reduce_scatter),
        ("all-gather: gloo all_gather_single", gloo_all_gather),
        ("all-gather: flatshard (send/recv)", flatshard_all_gather),
        ("reduce-scatter: shared memory (write, sum own piece)", shared_reduce_scatter),
        ("all-gather: shared memory (write, copy out)", shared_all_gather),
        ("all-gather: shared memory, in place", lambda: shared_all_gather(copy_out=False)),
    ]
    for name, call in cases:
        walls, cpus = [], []
        for i in range(repeats + 2):
            dist.barrier()
            wall, cpu = time.perf_counter(), _cpu_seconds()
            call()
            if i >= 2:  # the first calls set up gloo's buffers
                walls.append(time.perf_counter() - wall)
                cpus.append(_cpu_seconds() - cpu)
        every = torch.tensor([statistics.median(cpus)], dtype=torch.float64)
        dist.all_reduce(every)
        if rank == 0:
            print(
                f"world {world}  {name:54s} wall {1e3 * statistics.median(walls):7.2f} ms  "
                f"cpu {1e3 * statistics.median(cpus):7.2f} ms  "
                f"all ranks {1e3 * every.item():7.2f} ms",
                flush=True,
            )
    flatshard_all_gather()  # the shared-memory ways move the same values
    gathered = out_full.clone()
    shared_all_gather()
    flatshard_reduce_scatter()
    reduced = out_shard.clone()
    shared_reduce_scatter()
    assert torch.equal(out_full, gathered) and torch.allclose(out_shard, reduced)
    dist.barrier()
    dist.destroy_process_group()
    exit_worker()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--elements", type=int, default=3_400_000, help="fp32 bucket size")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args(argv)
    print(f"bucket: {args.elements:,} fp32 elements ({args.elements * 4 / 2**20:.1f} MiB)")
    for world in args.world:
        start_workers(_worker, (world, free_port(), args.elements, args.repeats), world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
