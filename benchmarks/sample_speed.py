"""`flatshard sample`'s speed with and without the KV cache, in one run.

    python benchmarks/sample_speed.py [--tokens 200] [--repeats 3]

The trainer's default model (preset small: dim 384, 6 layers, the bundled corpus's 257
byte tokens, 256 positions), one process, greedy. Without the cache every token reruns the
whole context; with it each new token is fed alone. Both choose the same tokens (checked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flatshard.cli.generate import generate  # noqa: E402
from flatshard.models import Llama, LlamaConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, dim=384, n_layers=6, n_heads=6, ffn_dim=1024,
                         max_seq_len=256)  # fmt: skip
    model = Llama(config).eval()
    prompt = list(b"The value of ")
    seconds: dict[bool, list[float]] = {True: [], False: []}
    chosen = {}
    for _ in range(args.repeats):
        for cache in (False, True):  # alternated: machine drift hits both alike
            started = time.perf_counter()
            chosen[cache] = generate(model, prompt, new_tokens=args.tokens, max_seq_len=256,
                                     temperature=0.0, cache=cache)  # fmt: skip
            seconds[cache].append(time.perf_counter() - started)
    plain, cached = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"# sample speed: {args.tokens} tokens, preset small, greedy, 1 process, torch "
          f"{torch.__version__}, {os.cpu_count()} cores")  # fmt: skip
    print("| generation | median s | tokens/s | × without cache |")
    print("|---|---|---|---|")
    print(f"| without cache | {plain:.2f} | {args.tokens / plain:.0f} | 1.00 |")
    print(f"| KV cache | {cached:.2f} | {args.tokens / cached:.0f} | {cached / plain:.3f} |")
    print(f"speed-up: {plain / cached:.1f}x; same tokens: {chosen[True] == chosen[False]}")


if __name__ == "__main__":
    main()
