#!/usr/bin/env bash
# A/B of knob settings in one device call: for each argument "NAME=VAL[,NAME=VAL...]" (or "-"
# for the defaults), the cuda decode step (bench/decode.py, cuda only, same process settings)
# with those knobs. One JSON per variant in $OUT, the table lines in $OUT/variants.log.
#   CONTEXTS="1024" bash bench/variants.sh - AMK_GEMV_PIPE=0 AMK_L2_PREFETCH=0,AMK_GEMV_PIPE=2x8
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD AMK_CACHE_DIR=${AMK_CACHE_DIR:-/tmp/amk-cache}
i=0
for v in "$@"; do
  i=$((i + 1))
  envs=()
  [ "$v" != "-" ] && IFS=, read -ra envs <<< "$v"
  echo "== variant $i: $v" | tee -a "$OUT/variants.log"
  env "${envs[@]}" timeout ${VARIANT_TIMEOUT:-90} python3 bench/decode.py --contexts ${CONTEXTS:-1024} \
    --backends cuda --compile-peer-at --iters ${ITERS:-20} --json "$OUT/variant_$i.json" 2>&1 \
    | tail -6 | tee -a "$OUT/variants.log"
done
