#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/moe/tools/device-cpu-experts.sh — the CPU expert kernels
# (ws_moe/cpu_experts.hpp) on the GPU machine's Xeon in one bounded call:
# configure and build ws_moe_test_cpu_experts and ws_moe_bench_cpu_experts,
# run the test (every ISA the CPU has: scalar, AVX2, AVX-512, AVX512-BF16),
# then the benchmark pinned with OMP_PROC_BIND=close OMP_PLACES=cores.
#
# From the repository root, with .deps staged as device-run.sh describes:
#   examples/moe/tools/device-cpu-experts.sh
#
# Environment: OUT (default ./device-out), BUILD_DIR (default build-device),
# JOBS (default nproc), THREADS (default 16), MIN_SECONDS (default 0.2),
# BENCH_BUDGET seconds (default 60), TEST_TIMEOUT seconds (default 90),
# SKIP_BUILD=1 (use an existing build).
# Output ($OUT): cpu_experts_env.txt cpu_experts_build.log test_cpu_experts.log
# bench_cpu_experts.log cpu_experts.json cpu_experts_summary.txt. Exit status 0
# when the build, the test and the benchmark succeeded.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/device-out}
mkdir -p "$OUT"
BUILD_DIR=${BUILD_DIR:-build-device}
JOBS=${JOBS:-$(nproc)}
THREADS=${THREADS:-16}
MIN_SECONDS=${MIN_SECONDS:-0.2}
BENCH_BUDGET=${BENCH_BUDGET:-60}
TEST_TIMEOUT=${TEST_TIMEOUT:-90}
for d in /usr/local/cuda/bin; do
  [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH=$d:$PATH ;; esac
done
export PATH

{
  date -u
  uname -a
  grep -m1 'model name' /proc/cpuinfo
  nproc
  grep -o -w 'avx2\|avx512f\|avx512bw\|avx512vl\|avx512_bf16\|amx_bf16\|amx_tile' /proc/cpuinfo | sort | uniq -c
  git rev-parse HEAD 2>/dev/null
} > "$OUT/cpu_experts_env.txt" 2>&1

status=0
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  if ! { cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_PREFIX_PATH="$root/.deps/usr" -DWRITESCOPE_CUDA=ON \
           -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_BENCH=ON \
           -DWRITESCOPE_BUILD_TESTS=ON -DWRITESCOPE_BUILD_EXAMPLES=ON &&
         cmake --build "$BUILD_DIR" -j"$JOBS" --target ws_moe_test_cpu_experts ws_moe_bench_cpu_experts; } \
       > "$OUT/cpu_experts_build.log" 2>&1; then
    echo "build failed: see $OUT/cpu_experts_build.log" | tee "$OUT/cpu_experts_summary.txt"
    tail -30 "$OUT/cpu_experts_build.log"
    exit 1
  fi
fi

bin=$BUILD_DIR/examples/moe
timeout "$TEST_TIMEOUT" "$bin/ws_moe_test_cpu_experts" > "$OUT/test_cpu_experts.log" 2>&1
test_rc=$?
[ $test_rc -ne 0 ] && status=1

OMP_PROC_BIND=close OMP_PLACES=cores timeout $((BENCH_BUDGET + 60)) "$bin/ws_moe_bench_cpu_experts" \
  --threads "$THREADS" --min-seconds "$MIN_SECONDS" --budget "$BENCH_BUDGET" --json "$OUT/cpu_experts.json" \
  > "$OUT/bench_cpu_experts.log" 2>&1
bench_rc=$?
[ $bench_rc -ne 0 ] && status=1

{
  echo "test exit $test_rc: $(grep -E '^\[doctest\] (test cases|assertions)' "$OUT/test_cpu_experts.log" | tr '\n' ' ')"
  grep -o 'MESSAGE: .*' "$OUT/test_cpu_experts.log" | sort -u | head -8
  echo "bench exit $bench_rc"
  sed -n '/^ws_moe_bench_cpu_experts:/,$p' "$OUT/bench_cpu_experts.log"
} > "$OUT/cpu_experts_summary.txt"
cat "$OUT/cpu_experts_summary.txt"
exit $status
