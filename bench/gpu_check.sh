#!/usr/bin/env bash
# One device call: the GPU test suite, the generate benchmark, then the decode benchmark (the
# session's matrix is bench/decode.py per preset; see bench/NOTES.md). Everything lands in $OUT.
#   bash bench/gpu_check.sh            (on the GPU machine, from the repo root)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD AMK_CACHE_DIR=${AMK_CACHE_DIR:-/tmp/amk-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, cuda.bindings; print(torch.__version__, triton.__version__, cuda.bindings.__version__)" | tee -a "$OUT/gpu.txt"
# four workers: the tests are mostly host work (compiles, the reference VM, transformers); v21 call 6:
# 307 tests in 174 s on four
timeout ${TEST_TIMEOUT:-260} python3 -m pytest -q -p no:cacheprovider -n 4 --timeout 150 \
  --durations=10 ${TESTS:-tests/gpu} > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -25
timeout ${GEN_TIMEOUT:-120} python3 bench/generate.py --backends cuda --json "$OUT/generate.json" \
  > "$OUT/generate.log" 2>&1; tail -12 "$OUT/generate.log"
timeout ${BENCH_TIMEOUT:-150} python3 bench/decode.py --backends cuda triton --json "$OUT/decode.json" \
  ${BENCH_ARGS:---contexts 1024 --compile-peer-at} > "$OUT/decode.log" 2>&1; tail -8 "$OUT/decode.log"
