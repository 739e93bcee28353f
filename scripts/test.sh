#!/usr/bin/env bash
# The test command: sets up .venv (torch 2.13.0 CPU from the local wheel, never a CUDA
# download), installs flatshard with its dev extras, lints, and runs the whole suite.
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
