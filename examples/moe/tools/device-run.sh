#!/usr/bin/env bash
# examples/moe/tools/device-run.sh — the CUDA path of ws_decode checked on the
# GPU machine in one bounded call (~8 minutes by default): build ws_decode,
# run the gpu-labelled ws_decode_cuda.* tests (the transformers fixtures under
# --device cuda: r = 0, r = 1, roofline, mixed CPU/GPU experts, all experts on
# the CPU, bf16), then the scale runs of device-scale.sh with what is left.
#
# On a Debian machine first, when the GPU machine cannot install packages:
#   scripts/stage-deps          # .deps/usr: the header-only dependencies, CLI11, cudnn-frontend
# and copy the tree with .deps to the GPU machine; there:
#   examples/moe/tools/device-run.sh
#
# Environment: OUT (default ./device-out), TOTAL_BUDGET seconds (default 470),
# BUILD_DIR (default build-device), JOBS (default nproc), SKIP_SCALE=1,
# SKIP_TESTS=1, CTEST_REGEX (default ^ws_decode_cuda), CALIBRATE=1 (also build
# bench/calibrate and, before the scale runs, measure A, B, C_CPU, C_GPU of the
# three presets at batch CAL_BATCH (default 16) with nproc-1 CPU engine
# threads — ws_decode's default — in at most CAL_BUDGET seconds (default 40);
# the scale runs then get CALIBRATION=$OUT/calibration.json), and
# device-scale.sh's variables (PEER=1, RUNS, NEW_TOKENS, ...).
# Output ($OUT, 7 files; with CALIBRATE 3 more: calibrate.log calibrate.json
# calibration.json): env.txt build.log ctest.log scale.log scale.txt
# scale.json summary.txt. Exit status 0 when the build and every test passed.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/device-out}
export OUT
mkdir -p "$OUT"
TOTAL_BUDGET=${TOTAL_BUDGET:-470}
BUILD_DIR=${BUILD_DIR:-build-device}
JOBS=${JOBS:-$(nproc)}
CTEST_REGEX=${CTEST_REGEX:-^ws_decode_cuda}
t_start=$(date +%s)
left() { echo $(( TOTAL_BUDGET - ($(date +%s) - t_start) )); }
for d in /usr/local/cuda/bin; do
  [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH=$d:$PATH ;; esac
done
export PATH
summary=()
failed=0

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files"
  echo "host: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
  echo "cpu flags: $(grep -m1 -o -w -E 'avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
  echo "nvcc: $(nvcc --version 2>&1 | tail -1)"
  echo "cmake: $(cmake --version 2>&1 | head -1); ninja: $(ninja --version 2>&1)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# --- build ----------------------------------------------------------------------
s=$(date +%s)
if [ ! -f "$root/.deps/usr/share/cmake/CLI11/CLI11Config.cmake" ]; then
  echo "device-run: .deps/usr lacks CLI11: stage it with scripts/stage-extra-deps and bring .deps along" |
    tee "$OUT/build.log"
  summary+=("build    FAILED  .deps/usr without CLI11")
  failed=1
else
  gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  b=$(( $(left) - 150 ))
  (( b > 300 )) && b=300
  (( b < 60 )) && b=60
  bench=OFF
  targets=ws_decode
  if [ -n "${CALIBRATE:-}" ]; then
    bench=ON
    targets="ws_decode calibrate"
  fi
  timeout --kill-after=10 "$b" bash -c '
    set -o pipefail
    cmake -S . -B "$0" "${@}" -DCMAKE_PREFIX_PATH="$PWD/.deps/usr" -DWRITESCOPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_BENCH='"$bench"' &&
    cmake --build "$0" -j'"$JOBS"' --target '"$targets"'
  ' "$BUILD_DIR" "${gen[@]}" >"$OUT/build.log" 2>&1
  rc=$?
  w=$(grep -c 'warning' "$OUT/build.log")
  summary+=("build    $( ((rc == 0)) && echo ok || echo FAILED)  $(( $(date +%s) - s )) s, rc $rc, $w warning lines")
  ((rc == 0)) || failed=1
  grep -q 'ws_decode CUDA path ON' "$OUT/build.log" || { summary+=("build    CUDA path OFF (see build.log)"); failed=1; }
fi

# --- gpu tests --------------------------------------------------------------------
if [ -n "${SKIP_TESTS:-}" ]; then
  echo "device-run: SKIP_TESTS set, no tests" >"$OUT/ctest.log"
elif ((failed == 0)); then
  s=$(date +%s)
  b=$(( $(left) - 100 ))
  (( b > 200 )) && b=200
  (( b < 30 )) && b=30
  timeout --kill-after=10 "$b" ctest --test-dir "$BUILD_DIR" -L gpu -R "$CTEST_REGEX" --output-on-failure --timeout 120 \
    >"$OUT/ctest.log" 2>&1
  rc=$?
  line=$(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)
  summary+=("tests    $( ((rc == 0)) && echo ok || echo FAILED)  $(( $(date +%s) - s )) s: ${line:-no summary (timeout?)}")
  ((rc == 0)) || failed=1
  grep -E '^check|Failed|\*\*\*' "$OUT/ctest.log" | head -40
else
  echo "device-run: build failed, no tests" >"$OUT/ctest.log"
fi

# --- calibration (CALIBRATE=1) ---------------------------------------------------------
if [ -n "${CALIBRATE:-}" ] && [ -x "$BUILD_DIR/bench/calibrate" ]; then
  s=$(date +%s)
  cb=${CAL_BUDGET:-40}
  timeout --kill-after=5 $(( cb + 30 )) "$BUILD_DIR/bench/calibrate" --presets qwen3,mixtral,dsv2 --batch "${CAL_BATCH:-16}" \
    --lengths 2K,4K,8K,16K --threads $(( $(nproc) - 1 )) --min-time 0.1 --out "$OUT/calibration.json" \
    --json "$OUT/calibrate.json" --budget-seconds "$cb" >"$OUT/calibrate.log" 2>&1
  rc=$?
  grep -v '^\[' "$OUT/calibrate.log" || true
  if [ -s "$OUT/calibration.json" ]; then
    export CALIBRATION="$OUT/calibration.json"
    summary+=("calibrate ok  $(( $(date +%s) - s )) s, rc $rc: $(grep -c '"preset"' "$OUT/calibration.json") entries (calibration.json)")
  else
    summary+=("calibrate FAILED  $(( $(date +%s) - s )) s, rc $rc: no calibration.json; scale runs use the defaults")
    failed=1
  fi
elif [ -n "${CALIBRATE:-}" ]; then
  summary+=("calibrate FAILED  not built (build.log)")
  failed=1
fi

# --- scale runs -------------------------------------------------------------------------
if [ -z "${SKIP_SCALE:-}" ] && [ -x "$BUILD_DIR/examples/moe/ws_decode" ]; then
  s=$(date +%s)
  SCALE_BUDGET=$(( $(left) - 10 )) WS_DECODE="$root/$BUILD_DIR/examples/moe/ws_decode" \
    "$root/examples/moe/tools/device-scale.sh"
  summary+=("scale    done    $(( $(date +%s) - s )) s (scale.txt)")
fi

{
  printf '%s\n' "${summary[@]}"
  echo "total $(( $(date +%s) - t_start )) s"
} | tee "$OUT/summary.txt"
exit $failed
