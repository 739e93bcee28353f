"""`flatshard train --hf` against the same fine-tune under PyTorch FSDP2, in one run.

    python benchmarks/hf_finetune.py [--model DIR] [--random-weights] [--steps 8]
        [--seq-len 256] [--batch 4] [--precision bf16] [--nproc 1]

The model: --model DIR, or SmolLM2-135M-Instruct (tests/real_model.py). --random-weights
trains a copy with freshly drawn weights (the model's config and tokenizer only: for a
machine its weights cannot be carried to). The data: the bundled text (the Python
documentation) through the model's own tokenizer.

flatshard: the command line, `flatshard train --hf DIR` (torch's AdamW, no checkpoint).
FSDP2: transformers' model (`from_pretrained`) with `fully_shard` on every decoder layer and
the root and the same mixed precision; everything else is the trainer's own, read from the
flatshard run's config: its token order, micro-batch loss, optimizer groups and learning-rate
schedule, with torch's `clip_grad_norm_`. Each runs in its own processes after the same
warm-up and is measured alike: every step's loss, the median step seconds after the first,
and the peak memory the trainer reports (the CUDA allocator's; on CPU the anonymous resident
memory above the start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt")


def random_weights_copy(source: str, target: str, seed: int = 0) -> str:
    """`source`'s config and tokenizer files at `target`, with weights drawn afresh."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(source)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        target
    )
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.endswith(WEIGHTS) and not name.endswith(".json.index"):
            if not os.path.exists(os.path.join(target, name)):
                shutil.copy(path, target)
    return target


def flatshard_run(args, model: str, text: str, run_dir: str) -> list[dict]:
    """`flatshard train --hf` as a user runs it; its metrics, a record per step."""
    command = [
        sys.executable, "-m", "flatshard", "train", "--hf", model, "--data", text,
        "--steps", str(args.steps), "--seq-len", str(args.seq_len),
        "--micro-batch", str(args.batch), "--global-batch", str(args.batch * args.nproc),
        "--precision", args.precision, "--optimizer", "torch-adamw", "--lr", str(args.lr),
        "--nproc", str(args.nproc), "--out", run_dir,
        "--set", "checkpoint.at_end=false", "--set", "run.sample_tokens=0",
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT, env=_env())
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [r for r in map(json.loads, handle) if "step" in r and "loss" in r]


def fsdp2_run(args, run_dir: str) -> list[dict]:
    """The same steps under FSDP2, in `args.nproc` processes; rank 0's records."""
    out = os.path.join(run_dir, "fsdp2.jsonl")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(args.nproc), os.path.abspath(__file__), "--peer", run_dir,
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT, env=_env())
    with open(out) as handle:
        return [json.loads(line) for line in handle]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def peer(run_dir: str) -> None:
    """One rank of the FSDP2 run of the flatshard run at `run_dir` (its config.json)."""
    import torch
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flatshard.cli.config import RunConfig
    from flatshard.cli.launch import init_distributed
    from flatshard.cli.meters import MemoryMeter, share_step, warm_up_runtime
    from flatshard.cli.model import DTYPES
    from flatshard.cli.run_data import open_run_data
    from flatshard.cli.schedule import learning_rate
    from flatshard.cli.train import accumulate_gradients, make_optimizer
    from flatshard.data.sequences import sequence_order

    with open(os.path.join(run_dir, "config.json")) as handle:
        nested = json.load(handle)
    config = RunConfig({f"{s}.{k}": v for s, keys in nested.items() for k, v in keys.items()})
    train, data = config.train, config.data
    ranks = init_distributed(config.run.device, config.run.threads)
    order = sequence_order(open_run_data(config).train, data.seq_len, train.seed, data.pack)
    warm_up_runtime(ranks.device)
    memory = MemoryMeter(ranks.device)
    model = transformers.AutoModelForCausalLM.from_pretrained(config.model.hf, dtype=torch.float32)
    model.to(ranks.device)
    policy = MixedPrecisionPolicy()
    if train.precision != "fp32":
        policy = MixedPrecisionPolicy(DTYPES[train.precision], reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = make_optimizer(train, model)
    records, position = [], 0
    for step in range(train.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, peak=train.lr, minimum=train.min_lr,
                                        warmup=train.warmup_steps, total=train.steps)  # fmt: skip
        _sync(ranks.device)
        started = time.perf_counter()
        loss_sum, _ = accumulate_gradients(model, order, position, train, ranks.rank,
                                           ranks.world_size, ranks.device)  # fmt: skip
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip or float("inf"))
        shared = share_step(loss_sum, False, memory.peak(), ranks.world_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(ranks.device)
        position += train.global_batch
        records.append({"step": step + 1, "loss": shared["loss"], "grad_norm": float(norm),
                        "step_s": time.perf_counter() - started,
                        "peak_mem_bytes": shared["peak_mem_bytes"]})  # fmt: skip
    if ranks.is_main:
        with open(os.path.join(run_dir, "fsdp2.jsonl"), "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def report(args, model: str, runs: dict[str, list[dict]]) -> None:
    import torch

    steps = {name: statistics.median(r["step_s"] for r in rs[1:]) for name, rs in runs.items()}
    peaks = {name: max(r["peak_mem_bytes"] for r in rs) for name, rs in runs.items()}
    pairs = zip(runs["flatshard"], runs["fsdp2"])
    loss_rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs)
    device = "cuda " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    weights = "random weights" if args.random_weights else "pretrained weights"
    print(f"# fine-tune of {os.path.basename(model.rstrip('/'))} ({weights}), {args.nproc} "
          f"process(es) on {device}, {args.precision}, {args.batch} x {args.seq_len} tokens "
          f"per process, {args.steps} steps, torch {torch.__version__}")  # fmt: skip
    print("| run | median step s | tokens/s | peak memory MiB | first loss | last loss |")
    print("|---|---|---|---|---|---|")
    tokens = args.batch * args.seq_len * args.nproc
    for name, records in runs.items():
        print(f"| {name} | {steps[name]:.3f} | {tokens / steps[name]:.0f} | "
              f"{peaks[name] / 2**20:.0f} | {records[0]['loss']:.4f} | "
              f"{records[-1]['loss']:.4f} |")  # fmt: skip
    print(f"flatshard / FSDP2: step time {steps['flatshard'] / steps['fsdp2']:.2f}x, "
          f"peak memory {peaks['flatshard'] / max(peaks['fsdp2'], 1):.2f}x; "
          f"losses: largest relative difference {loss_rel:.2e}")  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per process per step")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--keep", default="", help="keep the runs in this folder")
    parser.add_argument("--peer", default="", help=argparse.SUPPRESS)  # an FSDP2 rank
    args = parser.parse_args(argv)
    if args.peer:
        return peer(args.peer)
    from real_model import model_dir_or_exit

    from flatshard.data import corpus

    work = args.keep or tempfile.mkdtemp(prefix="hf-finetune-")
    os.makedirs(work, exist_ok=True)
    source = model = model_dir_or_exit(args.model)
    if args.random_weights:
        model = random_weights_copy(source, os.path.join(work, "model"))
    text = os.path.join(work, "python-docs.txt")
    with open(text, "wb") as handle:
        handle.write(corpus()[0])
    run_dir = os.path.join(work, "run")
    runs = {"flatshard": flatshard_run(args, model, text, run_dir)}
    runs["fsdp2"] = fsdp2_run(args, run_dir)
    report(args, source, runs)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
