"""Host (CPU) time per training step spent in flatshard's own bookkeeping (issue 38 item 2).

One process (gloo world 1: the collectives are local copies), so what is timed is the Python
and dispatch work around the math, which on a GPU runs while the device waits if it is
slow: the unit hooks (pre/post forward, pre/post backward, the end of backward; each
timed once even where one calls another), in them the gradient reduction's handing of the
reduced shards to the parameters (`add_reduced`, which builds each parameter's `.grad`), and
the optimizer's `step()` and `zero_grad()`. Printed per step and per unit.

    python benchmarks/host_profile.py --preset many-small --steps 10

It imports flatshard from the checkout it lies in: to compare with another commit, copy it
into a worktree of that commit and run it there.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [BENCHMARKS, os.path.dirname(BENCHMARKS)]  # this checkout's flatshard

from bench_modes import PRESETS, make_config  # noqa: E402

import flatshard  # noqa: E402
from flatshard import registry  # noqa: E402
from flatshard.models.llama import Llama  # noqa: E402
from flatshard.runtime import grad_sync, hooks  # noqa: E402

HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "end_backward")


class Timers:
    """Seconds per named phase; a phase entered while another timed one runs is not
    counted again (post_backward runs inside end_backward)."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self.depth = 0

    def wrap(self, name, fn, nested_counts=False):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth and not nested_counts:
                return fn(*args, **kwargs)
            self.depth += 0 if nested_counts else 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
                self.depth -= 0 if nested_counts else 1

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="many-small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--optimizer", choices=("flat", "torch"), default="flat")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:  # a free port
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)

    cfg = make_config(args.preset)
    torch.manual_seed(0)
    model = Llama(cfg)
    flatshard.parallelize(model, flatshard.ParallelDims(world_size=1))
    optim_cls = flatshard.optim.AdamW if args.optimizer == "flat" else torch.optim.AdamW
    optimizer = optim_cls(model.parameters(), lr=1e-3, weight_decay=0.1)
    seq, batch = PRESETS[args.preset]["seq"], PRESETS[args.preset]["micro_batch"]
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator())

    timers = Timers()
    for name in HOOKS:
        setattr(hooks, name, timers.wrap(name, getattr(hooks, name)))
    add_reduced = grad_sync.GradientSync.add_reduced
    grad_sync.GradientSync.add_reduced = timers.wrap("  add_reduced", add_reduced, True)
    optimizer.step = timers.wrap("optimizer.step", optimizer.step)
    optimizer.zero_grad = timers.wrap("optimizer.zero_grad", optimizer.zero_grad)

    step_seconds = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            timers.seconds.clear()
            timers.calls.clear()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            step_seconds += time.perf_counter() - start

    units = len(registry.units_below(model))
    params = sum(1 for _ in model.parameters())
    ms = 1e3 / args.steps
    print(
        f"preset {args.preset}: {units} units, {params} parameters, {args.optimizer} AdamW, "
        f"{args.steps} steps, torch {torch.__version__}"
    )
    print(f"{'phase':24} {'ms/step':>9} {'ms/unit':>9} {'calls/step':>11}")
    hook_total = sum(timers.seconds[name] for name in HOOKS)
    for name in (*HOOKS, "  add_reduced", "optimizer.step", "optimizer.zero_grad"):
        seconds = timers.seconds[name]
        calls = timers.calls[name] / args.steps
        print(f"{name:24} {seconds * ms:9.2f} {seconds * ms / units:9.3f} {calls:11.1f}")
    print(f"{'hooks in all':24} {hook_total * ms:9.2f} {hook_total * ms / units:9.3f}")
    print(f"{'whole step':24} {step_seconds * ms:9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
