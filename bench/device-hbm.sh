#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/device-hbm.sh — the HBM-resident tier on the GPU machine in one bounded call:
#
#   build   the targets below (Release, sm_90) into build-device/ (~3 min cold on 16 cores)
#   test    test_cuda_resident (the split-K resident kernels against fp64), test_cuda_hbm
#           (the HBM tier's shared bodies on both resident paths), under `timeout`
#   kernel  resident_bench: the resident kernels against the engine's default path over an
#           HBM-resident KV, both models, GB/s and the fraction of the same-run HBM read rate
#   step    ws_bench --mode hbm --hbm-resident-kernel --hbm-compare: the decode step from
#           inside the region to past it, default path / resident kernels / region off
#
# Run from the repository root with .deps staged (scripts/stage-deps) and carried:
#   OUT=$OUT bench/device-hbm.sh
# Environment: OUT (default build/device-hbm), STAGES (default "build test kernel step"),
# HBM_GIB (default 8), PRESETS (default "qwen3 dsv2"), STEP_BUDGET (seconds per preset, default 40),
# HBM_SWEEP (fixed host shares for ws_bench --hbm-sweep past the region; default none).
# Output in $OUT: build.log, tests.log, resident.json, hbm_<preset>.json, hbm.txt, summary.txt.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
OUT=${OUT:-build/device-hbm}
mkdir -p "$OUT"
STAGES=${STAGES:-build test kernel step}
HBM_GIB=${HBM_GIB:-8}
PRESETS=${PRESETS:-qwen3 dsv2}
STEP_BUDGET=${STEP_BUDGET:-40}
want() { [[ " $STAGES " == *" $1 "* ]]; }
t0=$(date +%s)
say() { echo "[device-hbm $(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/summary.txt"; }
b=build-device
if want build; then
  cmake -S . -B $b -G Ninja -DCMAKE_PREFIX_PATH="$root/.deps/usr" -DWRITESCOPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build $b -j"$(nproc)" --target test_cuda_resident test_cuda_hbm resident_bench ws_bench >>"$OUT/build.log" 2>&1
  say "build rc=$?"
fi
if want test; then
  for t in test_cuda_resident test_cuda_hbm; do
    timeout 120 "$b/tests/cuda/$t" >>"$OUT/tests.log" 2>&1
    say "$t rc=$? ($(grep -E 'test cases:' "$OUT/tests.log" | tail -1))"
  done
fi
if want kernel; then
  timeout 90 "$b/bench/resident_bench" --presets qwen3,dsv2 --batch 16 --lengths 1K,8K,64K --item-tokens 256,1024 \
    --json "$OUT/resident.json" >>"$OUT/summary.txt" 2>"$OUT/resident.err"
  say "resident_bench rc=$?"
fi
if want step; then
  for p in $PRESETS; do
    timeout $((STEP_BUDGET + 25)) "$b/bench/ws_bench" --mode hbm --hbm-presets "$p" --hbm-gib "$HBM_GIB" \
      --hbm-fill 0.25,0.5,0.9,1.1,1.5,2,4 --hbm-resident-kernel --hbm-compare ${HBM_SWEEP:+--hbm-sweep "$HBM_SWEEP"} \
      --budget-seconds "$STEP_BUDGET" \
      --json "$OUT/hbm_$p.json" >>"$OUT/hbm.txt" 2>>"$OUT/hbm.err"
    say "ws_bench hbm $p rc=$?"
  done
  cat "$OUT/hbm.txt" >>"$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
