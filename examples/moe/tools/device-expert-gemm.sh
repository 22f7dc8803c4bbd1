#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/moe/tools/device-expert-gemm.sh — a prefill MoE layer's expert GEMMs
# on the GPU machine, in one call: ws_moe_bench_expert_gemm (dense, batched,
# grouped, per expert; uniform routing and Zipf 0.8) and, on the same routed
# rows, PyTorch's torch._grouped_mm (bench_grouped_mm_peer.py: the kernel
# transformers' grouped_mm experts run). The target (issue "prefill at the
# GPU's speed", item 2): a layer's expert GEMMs at >= 0.8 of the dense rate of
# the same FLOPs, measured in the same run.
#
#   OUT=/some/dir examples/moe/tools/device-expert-gemm.sh
#
# Needs a build with WRITESCOPE_BUILD_BENCH=ON (BUILD_DIR, default
# build-device; configured and built here when the bench is missing, against
# .deps/usr as scripts/stage-deps leaves it). Environment: OUT (default
# ./device-out), BUILD_DIR, MODELS (default qwen3,mixtral,dsv2), TOKENS
# (default 32768,8192,2048), ZIPF (default "0 0.8"), PYTHON (python3).
# Output: $OUT/expert_gemm.zipf<S>.json, $OUT/grouped_mm_peer.zipf<S>.json,
# $OUT/expert_gemm.txt (the tables, also printed).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
OUT=${OUT:-./device-out}
BUILD_DIR=${BUILD_DIR:-$root/build-device}
MODELS=${MODELS:-qwen3,mixtral,dsv2}
TOKENS=${TOKENS:-32768,8192,2048}
ZIPF=${ZIPF:-0 0.8}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
bench=$BUILD_DIR/examples/moe/ws_moe_bench_expert_gemm
if [ ! -x "$bench" ]; then
  export PATH=/usr/local/cuda/bin:$PATH
  cmake -S "$root" -B "$BUILD_DIR" -G Ninja -DCMAKE_PREFIX_PATH="$root/.deps/usr" -DWRITESCOPE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_BENCH=ON >"$OUT/expert_gemm.build.log" 2>&1 &&
    cmake --build "$BUILD_DIR" -j"$(nproc)" --target ws_moe_bench_expert_gemm >>"$OUT/expert_gemm.build.log" 2>&1 ||
    { echo "device-expert-gemm: build failed ($OUT/expert_gemm.build.log)"; tail -20 "$OUT/expert_gemm.build.log"; exit 1; }
fi
: >"$OUT/expert_gemm.txt"
rc=0
for z in $ZIPF; do
  "$bench" --models "$MODELS" --tokens "$TOKENS" --zipf "$z" --json "$OUT/expert_gemm.zipf$z.json" \
    >"$OUT/expert_gemm.zipf$z.log" 2>&1 || rc=1
  sed -n '/^prefill MoE expert GEMMs/,$p' "$OUT/expert_gemm.zipf$z.log" >>"$OUT/expert_gemm.txt"
  if [ -s "$OUT/expert_gemm.zipf$z.json" ]; then
    "$PYTHON" "$root/examples/moe/tools/bench_grouped_mm_peer.py" --bench "$OUT/expert_gemm.zipf$z.json" \
      --json "$OUT/grouped_mm_peer.zipf$z.json" >"$OUT/grouped_mm_peer.zipf$z.log" 2>&1 || rc=1
    sed -n '/^torch._grouped_mm/,$p' "$OUT/grouped_mm_peer.zipf$z.log" >>"$OUT/expert_gemm.txt"
  fi
done
cat "$OUT/expert_gemm.txt"
exit $rc
