#!/usr/bin/env bash
# The CPU test suite under the GPU machine's own torch (2.11 there, no package index):
# flatshard from the checkout, the GPU hidden (FSDP2's default mesh picks CUDA whenever one is
# visible), spread over the machine's cores by pytest-xdist (preinstalled there). Failures
# come with short tracebacks in $OUT/pytest.log. Arguments: test paths or node ids (default:
# the whole suite, about 8 minutes on 16 cores); WORKERS overrides the process count.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
log="${OUT:-.}/pytest.log"
python3 -m pytest -n "${WORKERS:-15}" -p no:cacheprovider -p no:benchmark --timeout 200 \
  --tb=short -rfE "${@:-tests}" >"$log" 2>&1
status=$?
grep -E "^(FAILED|ERROR)|passed|failed" "$log" | tail -40
exit $status
