"""The per-file time table of tests/README.md, from a run with FLATSHARD_TEST_TIMES set:

    FLATSHARD_TEST_TIMES=/tmp/times.json bash scripts/test.sh
    python scripts/test_times.py /tmp/times.json [--top 25]

Prints a markdown table of the slowest files (seconds summed over setup, call and teardown
of their tests, share of the total, and the share of the machine's cores busy meanwhile where
recorded) and the total.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("times")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.times) as handle:
        times = json.load(handle)
    total = sum(entry["seconds"] for entry in times.values())
    count = sum(entry["tests"] for entry in times.values())
    ranked = sorted(times.items(), key=lambda item: -item[1]["seconds"])
    print("| file | tests | s | share | cores busy |")
    print("|---|---|---|---|---|")
    for name, entry in ranked[: args.top]:
        share = entry["seconds"] / total
        busy = f"{entry['busy']:.0%}" if "busy" in entry else "-"
        print(f"| {name} | {entry['tests']} | {entry['seconds']:.0f} | {share:.1%} | {busy} |")
    rest = ranked[args.top :]
    if rest:
        seconds = sum(entry["seconds"] for _, entry in rest)
        tests = sum(entry["tests"] for _, entry in rest)
        print(f"| {len(rest)} other files | {tests} | {seconds:.0f} | {seconds / total:.1%} | |")
    print(f"| **all {len(times)} files** | {count} | {total:.0f} | 100% | |")


if __name__ == "__main__":
    main()
