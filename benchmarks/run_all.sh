#!/usr/bin/env bash
# Every measurement behind RESULTS.md, one compare.py invocation a section, appended to one
# file (default benchmarks/RESULTS-runs.md; about an hour on 2 cores). Run it on a quiet
# machine, then copy the sections under RESULTS.md's summary and findings.
#   bash benchmarks/run_all.sh [OUT]          (PYTHON=.venv/bin/python to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/RESULTS-runs.md}
python=${PYTHON:-python}
rm -f "$out"
run() { "$python" benchmarks/compare.py "$@" --out "$out" --append; }
run --preset 35m --steps 12 --rounds 4
run --preset 35m --steps 8 --rounds 4 --world 4
run --preset 120m --steps 8 --rounds 4
run --preset 35m --steps 4 --exact-memory
run --preset 120m --steps 2 --exact-memory
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  run --preset 35m --steps 12 --rounds 4 --param-dtype bf16
  run --preset 35m --steps 4 --exact-memory --param-dtype bf16
else  # bf16 matmuls are emulated (20x+ slower than fp32): bytes, memory and losses only
  run --preset 35m --steps 2 --exact-memory --param-dtype bf16 --modes fsdp2,zero3
fi
