"""Hugging Face import: bytes read and time per rank, flatshard's row-range loader against a
naive loader (rank 0 reads every tensor whole and broadcasts it; each rank keeps its rows).

    python scripts/hf_import_bench.py [--world 2] [--vocab 8192 --dim 384 --layers 4 ...]

The checkpoint is written by flatshard.hf.save_pretrained from a Llama built from a config
(no download). Both loaders fill the same fully_shard-ed model (blocks, then the root) and
must leave identical shards. Each loader is timed with the checkpoint evicted
from the OS page cache (cold, posix_fadvise DONTNEED) and cached (warm).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flatshard  # noqa: E402
from flatshard import hf  # noqa: E402
from flatshard.dtensor.sharded_param import param_spec  # noqa: E402
from flatshard.hf.checkpoint import checkpoint_tensors  # noqa: E402
from flatshard.hf.load import copy_piece, local_tensor  # noqa: E402
from flatshard.models import Llama, LlamaConfig  # noqa: E402


class _Received(dict):
    """Broadcast tensors, read like a safetensors file."""

    def get_slice(self, name):
        return self[name]


def naive_load(model, path) -> int:
    """Rank 0 reads each HF tensor whole and broadcasts it; returns bytes this rank read."""
    from safetensors import safe_open

    tensors = checkpoint_tensors(path)  # headers only, on every rank: shapes for recv buffers
    mappings, _ = hf.adapter_for(model).plan(model)
    params = dict(model.named_parameters())
    handles, read = {}, 0
    with torch.no_grad():
        for m in mappings:
            info = tensors[m.hf_name]
            if dist.get_rank() == 0:
                if info.file not in handles:
                    handles[info.file] = safe_open(info.file, framework="pt")
                full = handles[info.file].get_tensor(m.hf_name)
                read += full.numel() * full.element_size()
            else:
                full = torch.empty(info.shape, dtype=params[m.param_name].dtype)
            dist.broadcast(full, src=0)
            param = params[m.param_name]
            received = _Received({m.hf_name: full})
            copy_piece(received, m, param_spec(model, m.param_name, param), local_tensor(param))
    flatshard.weights_changed(model)
    return read


def build_sharded(path):
    def shard(model):
        for layer in model.layers:
            flatshard.fully_shard(layer)
        flatshard.fully_shard(model)

    config = hf.hf_to_config(hf.read_hf_config(path))
    with torch.device("meta"):
        model = Llama(config)
    shard(model)
    flatshard.materialize(model)
    return model


def evict_from_page_cache(path):
    """Drop the checkpoint's pages from the OS cache (no root needed), for a cold read."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, path=None):
    if path is not None:
        evict_from_page_cache(path)
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return result, time.perf_counter() - start


def worker(rank, world, port, path, repeats, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ours_model, naive_model = build_sharded(path), build_sharded(path)
    times = {key: [] for key in ("ours cold", "naive cold", "ours warm", "naive warm")}
    for _ in range(repeats):  # alternate, so neither loader always meets a colder cache
        for cache in ("cold", "warm"):
            evict = path if cache == "cold" else None
            stats, seconds = timed(lambda: hf.load_pretrained(ours_model, path), evict)
            times[f"ours {cache}"].append(seconds)
            naive_read, seconds = timed(lambda: naive_load(naive_model, path), evict)
            times[f"naive {cache}"].append(seconds)
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(ours_model.parameters(), naive_model.parameters())
    )
    queue.put((rank, stats.bytes_read, naive_read, times, same))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    config = LlamaConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        n_kv_heads=max(1, args.heads // 3), ffn_dim=args.ffn,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        hf.save_pretrained(Llama(config), path)
        total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        queue = mp.get_context("spawn").SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args.world, port, path, args.repeats, queue), nprocs=args.world)
        rows = sorted(queue.get() for _ in range(args.world))

    tensor_bytes = config.num_params() * 4
    print(
        f"checkpoint: {config.num_params() / 1e6:.1f}M params, {tensor_bytes / 1e6:.1f} MB of "
        f"fp32 tensors ({total / 1e6:.1f} MB on disk with config.json), world {args.world}"
    )
    print(f"{'rank':>4} {'flatshard read MB':>18} {'/ (1/N)':>8} {'naive read MB':>14}")
    for rank, ours_read, naive_read, _, _ in rows:
        share = ours_read / (tensor_bytes / args.world)
        print(f"{rank:>4} {ours_read / 1e6:>18.2f} {share:>8.3f} {naive_read / 1e6:>14.2f}")
    summed = sum(r[1] for r in rows)
    print(f"flatshard, all ranks: {summed / 1e6:.2f} MB (each byte once: {summed == tensor_bytes})")
    for cache in ("cold", "warm"):
        # the slowest rank decides (barriers around each load make all ranks' times ~equal)
        ours, naive = (
            statistics.median(max(r[3][f"{who} {cache}"][i] for r in rows) for i in range(n))
            for who, n in (("ours", args.repeats), ("naive", args.repeats))
        )
        print(
            f"import, {cache} page cache (median of {args.repeats}): flatshard {ours:.3f} s, "
            f"naive rank-0 read + broadcast {naive:.3f} s, naive / flatshard {naive / ours:.2f}x"
        )
    print(f"identical shards from both loaders: {all(r[4] for r in rows)}")


if __name__ == "__main__":
    main()
