#!/usr/bin/env bash
# Every measurement behind RESULTS.md, one compare.py invocation a section, appended to one
# file (default benchmarks/RESULTS-runs.md; about 80 minutes on 2 cores). Run it on a quiet
# machine, then copy the sections under RESULTS.md's summary and findings.
#   bash benchmarks/run_all.sh [OUT]          (PYTHON=.venv/bin/python to pick the interpreter)
# Timings come from runs with the modes side by side (a step of each in turn), memory from
# runs with one mode at a time and glibc returning every freed block (--exact-memory).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/RESULTS-runs.md}
python=${PYTHON:-python}
rm -f "$out"
run() { "$python" benchmarks/compare.py "$@" --out "$out" --append; }
run --preset 35m --steps 12 --rounds 4 --interleave steps
run --preset 35m --steps 8 --rounds 4 --interleave steps --world 4
# 120m side by side: six models at once would not fit in 24 GiB; the single process and
# ZeRO-1 are timed in the memory run below.
run --preset 120m --steps 8 --rounds 4 --interleave steps --modes ddp,fsdp2,zero3,zero2
run --preset 35m --steps 4 --exact-memory
run --preset 35m --steps 2 --exact-memory --world 4 --modes ddp,fsdp2,zero3
run --preset 120m --steps 2 --exact-memory
# Optimizer offload (issue 21): FSDP2 + CPUOffloadPolicy, flatshard ZeRO-3 at f = 0.5, 1 and
# 1 on the disk tier, with plain FSDP2 and ZeRO-3 as the f = 0 rows: memory (the disk tier's
# peak RSS drop against ZeRO-3), then timings side by side.
offload=fsdp2,fsdp2-cpuoff,zero3,off50,off100,offdisk
run --preset 35m --modes "$offload" --steps 6 --rounds 2 --interleave modes --exact-memory
run --preset 35m --modes "$offload" --steps 6 --rounds 2 --interleave steps
run --preset 35m --modes "$offload" --steps 12 --rounds 4 --interleave steps
# Compiled blocks (issue 32): FSDP2 and flatshard with every block compiled, beside their
# eager rows, and flatshard's full and selective activation checkpointing.
run --preset 35m --modes fsdp2,zero3,fsdp2-compile,compile3,acfull3,acsel3 --steps 6 --rounds 1 \
  --warmup 2 --interleave steps
run --preset 120m --modes fsdp2,zero3,fsdp2-compile,compile3 --steps 4 --rounds 1 --warmup 2 \
  --interleave steps
# Flat optimizers (issue 38): flatshard.optim.AdamW against torch's AdamW on flatshard and
# on FSDP2, on many small parameters, world 2 and 4.
run --preset many-small --modes ddp,fsdp2,zero3,zero3f --steps 6
run --preset many-small --modes ddp,fsdp2,zero3,zero3f --steps 6 --world 4
# Muon (issue 35): flatshard's owner-per-matrix Muon against torch's on FSDP2 and the flat AdamW
run --preset 35m --world 4 --modes fsdp2,zero3f,fsdp2-muon,zero3m --steps 4 --rounds 2 \
  --interleave steps
# Long sequences (issue 61): TP + sequence parallelism under FSDP2 and flatshard, flatshard's
# context parallelism, beside plain FSDP2 / ZeRO-3 and TP
run --preset 35m --modes fsdp2,zero3,fsdp2-tp,tp3,fsdp2-sp,sp3,cp3 --interleave steps
# Host time per step in the unit hooks (issue 38 item 2), one process
"$python" benchmarks/host_profile.py --preset many-small --steps 20 | sed 's/^/    /' >> "$out"
# RL state movement (issue 36): offload/reload and full weights against FSDP2 recipes
"$python" benchmarks/state_movement.py --preset 120m --repeats 3 >> "$out"
# weight sync to a receiver process (issue 63) against the FSDP2 recipe, worlds 2 and 4
"$python" benchmarks/weight_sync.py --preset 120m --world 2 --repeats 3 >> "$out"
"$python" benchmarks/weight_sync.py --preset 120m --world 4 --repeats 3 >> "$out"
# restarts after a SIGKILL, from disk and from host-memory snapshots (issue 60)
"$python" benchmarks/recovery.py --size 35m >> "$out"
"$python" benchmarks/recovery.py --size 120m >> "$out"
"$python" benchmarks/sample_speed.py --repeats 3 >> "$out"  # flatshard sample: KV cache
# a real pretrained model (SmolLM2-135M): `flatshard train --hf` against FSDP2, bf16
for n in 1 2; do
  "$python" benchmarks/hf_finetune.py --steps 8 --seq-len 256 --batch 2 --nproc $n >> "$out"
done
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  run --preset 35m --steps 12 --rounds 4 --interleave steps --param-dtype bf16
  run --preset 35m --steps 4 --exact-memory --param-dtype bf16
else  # bf16 matmuls are emulated (20x+ slower than fp32): bytes, memory and losses only
  run --preset 35m --steps 2 --exact-memory --param-dtype bf16 --modes fsdp2,zero3
fi
