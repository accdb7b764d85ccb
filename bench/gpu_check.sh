#!/usr/bin/env bash
# One device call: the GPU test suite, then the decode benchmark. Everything lands in $OUT.
#   bash bench/gpu_check.sh            (on the GPU machine, from the repo root)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD AMK_CACHE_DIR=${AMK_CACHE_DIR:-/tmp/amk-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, cuda.bindings; print(torch.__version__, triton.__version__, cuda.bindings.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
timeout ${BENCH_TIMEOUT:-300} python3 bench/decode.py --json "$OUT/decode.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -30
