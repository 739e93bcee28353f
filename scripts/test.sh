#!/usr/bin/env bash
# The test command: sets up .venv (torch 2.13.0 CPU from the local wheel, never a CUDA
# download), installs flatshard with its dev extras, lints, and runs the whole suite; with
# no arguments, then the training-parity tests again under the NCCL hazard shim
# (flatshard/nccl_shim.py: collectives behave like asynchronous NCCL on CPU tensors).
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
ruff check .
python -m pytest "$@"
if [ $# -eq 0 ]; then
  FLATSHARD_NCCL_SHIM=1 python -m pytest -q -p no:cacheprovider \
    tests/test_training.py tests/test_gradients.py tests/test_mixed_precision.py \
    tests/test_hsdp.py tests/test_sharded_lookup.py tests/test_inflight_write.py \
    tests/test_load_state_dict.py tests/test_checkpoint.py tests/test_offload.py \
    tests/test_compat.py
fi
