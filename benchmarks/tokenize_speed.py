"""Tokenising a large text file with a model's tokenizer: flatshard's cached token file
(made once, then mapped) against the same tokenizer called directly, in one run.

    python benchmarks/tokenize_speed.py [--model DIR] [--mb 100]

The text: the bundled corpus (the Python documentation) repeated to `--mb` MB in a
temporary folder. Default tokenizer: SmolLM2's (tests/real_model.py). Times: transformers'
tokenizer on the whole text in 1 MB pieces (what a script would do: the floor, no file
written), flatshard's first run (tokenise, write `.tokens.npy`), and a second run (the
cached file mapped). Checks that both give the same ids.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from real_model import model_dir_or_exit  # noqa: E402

from flatshard.data import corpus  # noqa: E402
from flatshard.data.token_cache import split_at_lines  # noqa: E402
from flatshard.data.tokenizer import ModelTokenizer  # noqa: E402
from flatshard.data.tokens import load_tokens  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--mb", type=float, default=100.0)
    args = parser.parse_args()
    path = model_dir_or_exit(args.model)
    tokenizer = ModelTokenizer.from_directory(path)
    text = corpus()[0]
    repeats = max(1, round(args.mb * 1e6 / len(text)))
    with tempfile.TemporaryDirectory() as folder:
        data = os.path.join(folder, "text.txt")
        with open(data, "wb") as handle:
            for _ in range(repeats):
                handle.write(text)
        size = os.path.getsize(data)
        started = time.perf_counter()
        with open(data, encoding="utf-8") as handle:
            whole = handle.read()
        direct = [i for piece_ids in tokenizer.encode_batch(split_at_lines(whole))
                  for i in piece_ids]  # fmt: skip
        direct_s = time.perf_counter() - started
        del whole
        started = time.perf_counter()
        first = load_tokens(data, "auto", "text", "", tokenizer)
        first_s = time.perf_counter() - started
        started = time.perf_counter()
        again = load_tokens(data, "auto", "text", "", tokenizer)
        again_s = time.perf_counter() - started
        same = np.array_equal(
            np.asarray(first.tokens), np.asarray(direct, dtype=first.tokens.dtype)
        )
        print(
            f"# tokenising {size / 1e6:.0f} MB of text ({len(first.tokens):,} tokens), "
            f"{os.path.basename(path.rstrip('/'))}'s tokenizer, {os.cpu_count()} cores"
        )
        print("| how | s | MB/s | x direct |")
        print("|---|---|---|---|")
        for name, seconds in (("transformers' tokenizer, 1 MB pieces", direct_s),
                              ("flatshard, first run (writes the token file)", first_s),
                              ("flatshard, later runs (maps it)", again_s)):  # fmt: skip
            print(
                f"| {name} | {seconds:.2f} | {size / 1e6 / seconds:,.1f} | "
                f"{seconds / direct_s:.3f} |"
            )
        print(f"same ids: {same}; reused: {'reused' in again.source}")


if __name__ == "__main__":
    main()
