#!/usr/bin/env bash
# bench/context-sweep.sh — "when it pays off": per-layer decode step time against
# tokens per sequence for gpu_only, cpu_only and roofline (KV in host memory) and an
# HBM-only engine (the whole KV resident in GPU memory, bench/peers.py
# torch_gpu_resident), one preset and batch, in one bounded call on the GPU machine.
#
#   calibrate  bench/calibrate for the preset and batch (A, B, C_CPU, C_GPU; 1K-16K):
#              the roofline rows start from it, as deployed (~4 s on the H200)
#   policies   ws_bench --mode policies --policies gpu_only,cpu_only,roofline at every
#              length (same-run ceilings before each length's rows; 12 timed steps
#              after 2 warm-up steps; layers added up to 640 MiB of KV per step)
#              (~35-45 s: ~3 s per length up to 16K, ~4 s at 32K, ~7 s at 64K, ~13 s
#              at 128K, where one layer's KV is 4 GiB and gpu_only streams it in ~80 ms)
#   resident   bench/peers.py --peers torch_gpu_resident at the same shapes (~6 s of
#              torch import and CUDA start, then < 1 s per length)
#   report     bench/plot.py merge + context: the JSON, the figure, the table (~3 s)
#
# Expected on the H200 machine (16 cores, build-device/ already built): ~55-65 s.
# Hard bound: every stage runs under `timeout` with a share of TOTAL_BUDGET (default
# 115 s), and every tool stops starting rows before its share ends and keeps its
# JSON valid after every row, so a cut run still plots every finished row.
#
# Run from the repository root on the GPU machine:
#
#   OUT=$OUT/sweep bench/context-sweep.sh
#
# Output in $OUT (3 files): context_sweep.json (every row of every tool with its
# machine, date and command, plus meta: date, commit, GPU, CPU, this command),
# fig_context_sweep.png, context_sweep.md (the table). Intermediate files in $WORK.
#
# Environment:
#   OUT, WORK        output / scratch folders (default build/context-sweep, $BUILD_DIR/context-sweep)
#   BUILD_DIR        default build-device when configured, else build-bench
#   PRESET, BATCH    default qwen3, 16 (qwen3, mixtral or dsv2)
#   LENGTHS          tokens per sequence (default 1K,2K,4K,8K,16K,32K,64K,128K)
#   THREADS          CPU engine threads (default nproc - 1)
#   TOTAL_BUDGET     seconds for everything (default 115)
#   STAGES           comma list (default calibrate,policies,resident,report)
#   CALIBRATE_ARGS POLICIES_ARGS RESIDENT_ARGS   extra arguments (later flags win)
#   BIN_SUFFIX=_host a dry run with the host-backend builds (no GPU; the numbers
#                    describe no GPU; the resident stage is skipped without CUDA)
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/build/context-sweep}
if [ -z "${BUILD_DIR:-}" ]; then
  BUILD_DIR=build-device
  [ -f build-device/CMakeCache.txt ] || BUILD_DIR=build-bench
fi
WORK=${WORK:-$root/$BUILD_DIR/context-sweep}
PRESET=${PRESET:-qwen3}
BATCH=${BATCH:-16}
LENGTHS=${LENGTHS:-1K,2K,4K,8K,16K,32K,64K,128K}
THREADS=${THREADS:-$(( $(nproc) - 1 ))}
(( THREADS < 1 )) && THREADS=1
TOTAL_BUDGET=${TOTAL_BUDGET:-115}
STAGES=${STAGES:-calibrate,policies,resident,report}
sfx=${BIN_SUFFIX:-}
bin=$BUILD_DIR/bench
mkdir -p "$OUT" "$WORK"
rm -f "$WORK"/calibrate.json "$WORK"/calibration.json "$WORK"/ws_policies.json "$WORK"/peers.json
LOG=$WORK/context-sweep.log
: >"$LOG"
t_start=$(date +%s)
[ -d /usr/local/cuda/bin ] && case ":$PATH:" in *":/usr/local/cuda/bin:"*) ;; *) PATH=/usr/local/cuda/bin:$PATH ;; esac
export PATH

# Planned seconds per stage: each stage's timeout is its plan, scaled down when the
# stages before it ran long (the remaining plans shrink together).
declare -A plan=([calibrate]=15 [policies]=68 [resident]=24 [report]=8)
order=(calibrate policies resident report)
has_stage() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
elapsed() { echo $(( $(date +%s) - t_start )); }
say() { echo "[context-sweep $(printf '%4d' "$(elapsed)")s] $*" | tee -a "$LOG"; }
budget() {
  local s=$1 rem=0 found=0 x left b
  for x in "${order[@]}"; do
    [ "$x" = "$s" ] && found=1
    (( found )) && has_stage "$x" && rem=$(( rem + plan[$x] ))
  done
  left=$(( TOTAL_BUDGET - $(elapsed) - 2 ))
  b=${plan[$s]}
  (( rem > left )) && b=$(( plan[$s] * left / rem ))
  (( b < 5 )) && b=0
  echo "$b"
}
# The tool's own --budget-seconds: stop starting rows early enough for the last row
# (up to ~13 s at 128K in the policies stage) to end inside the stage's timeout.
inner() { local g=$(( $1 / 4 )); (( g < 3 )) && g=3; (( $1 >= 40 && g < 14 )) && g=14; echo $(( $1 - g > 2 ? $1 - g : 2 )); }
declare -a stages_done=()
run_stage() {
  local name=$1 b=$2 s rc e
  shift 2
  s=$(date +%s)
  say "stage $name (timeout ${b}s): $*"
  timeout --kill-after=3 "$b" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  e=$(( $(date +%s) - s ))
  stages_done+=("$(printf '%-10s rc=%-3s %4s s%s' "$name" "$rc" "$e" "$( ((rc == 124 || rc == 137)) && echo '  timeout (partial JSON kept)')")")
  say "stage $name done: rc $rc in ${e}s"
}

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
commit="$(git rev-parse --short HEAD 2>/dev/null)$( [ -n "$(git status --porcelain 2>/dev/null)" ] && echo '+dirty')"
cmdline="OUT=$OUT PRESET=$PRESET BATCH=$BATCH LENGTHS=$LENGTHS THREADS=$THREADS TOTAL_BUDGET=$TOTAL_BUDGET STAGES=$STAGES${sfx:+ BIN_SUFFIX=$sfx} bench/context-sweep.sh"
say "context-sweep: ${gpu:-no GPU}, $(nproc) cores, $PRESET batch $BATCH, L $LENGTHS, $THREADS threads, budget ${TOTAL_BUDGET}s, commit $commit"
bind=(env OMP_PROC_BIND=close OMP_PLACES=cores)
cal=$WORK/calibration.json

if has_stage calibrate; then
  b=$(budget calibrate)
  if (( b == 0 )); then stages_done+=("calibrate  skipped (no time)"); else
    # shellcheck disable=SC2086
    run_stage calibrate "$b" "${bind[@]}" "$bin/calibrate$sfx" --presets "$PRESET" --batch "$BATCH" \
      --lengths 1K,2K,4K,8K,16K --threads "$THREADS" --min-time 0.15 --out "$cal" --json "$WORK/calibrate.json" \
      --budget-seconds "$(inner "$b")" ${CALIBRATE_ARGS:-}
  fi
fi

if has_stage policies; then
  b=$(budget policies)
  if (( b == 0 )); then stages_done+=("policies   skipped (no time)"); else
    # Without a calibration ws_bench takes the roofline's A and B from the gpu_only
    # and cpu_only rows of the same length (no fixed costs): noted in each row's costs.source.
    cal_args=()
    [ -s "$cal" ] && cal_args=(--calibration "$cal")
    # shellcheck disable=SC2086
    run_stage policies "$b" "${bind[@]}" "$bin/ws_bench$sfx" --mode policies --presets "$PRESET" --batch "$BATCH" \
      --lengths "$LENGTHS" --policies gpu_only,cpu_only,roofline --threads "$THREADS" "${cal_args[@]}" \
      --json "$WORK/ws_policies.json" --budget-seconds "$(inner "$b")" ${POLICIES_ARGS:-}
  fi
fi

if has_stage resident; then
  b=$(budget resident)
  if (( b == 0 )); then stages_done+=("resident   skipped (no time)");
  else
    # shellcheck disable=SC2086
    run_stage resident "$b" python3 bench/peers.py --peers torch_gpu_resident --presets "$PRESET" --batch "$BATCH" \
      --lengths "$LENGTHS" --threads "$THREADS" --json "$WORK/peers.json" --budget-seconds "$(inner "$b")" \
      ${RESIDENT_ARGS:-}
  fi
fi

if has_stage report; then
  printf '%s\n' "${stages_done[@]}" >"$WORK/stages.txt"
  python3 - "$WORK/meta.json" "$WORK/stages.txt" "$(date -u '+%Y-%m-%dT%H:%M:%SZ')" "$commit" "$(hostname)" "$gpu" \
    "$cpu" "$THREADS" "$TOTAL_BUDGET" "$(elapsed)" "$cmdline" "$PRESET" "$BATCH" "$LENGTHS" <<'PY'
import json, sys
a = sys.argv
json.dump({"date_utc": a[3], "commit": a[4], "host": a[5], "gpu": a[6], "cpu": a[7], "threads": int(a[8]),
           "total_budget_seconds": int(a[9]), "elapsed_seconds_before_report": int(a[10]), "command": a[11],
           "sweep": {"preset": a[12], "batch": int(a[13]), "lengths": a[14]},
           "stages": [l for l in open(a[2]).read().splitlines() if l.strip()]}, open(a[1], "w"), indent=1)
PY
  python3 bench/plot.py merge --out "$OUT/context_sweep.json" --meta "$WORK/meta.json" "$WORK/calibrate.json" "$cal" \
    "$WORK/ws_policies.json" "$WORK/peers.json" 2>&1 | tee -a "$LOG"
  png=()
  if python3 -c 'import matplotlib' 2>/dev/null; then
    png=(--png "$OUT/fig_context_sweep.png")
  else
    say "matplotlib not importable: no PNG (python3 bench/plot.py context --results context_sweep.json --png F elsewhere)"
  fi
  b=$(budget report)
  (( b < 6 )) && b=6
  timeout "$b" python3 bench/plot.py context --results "$OUT/context_sweep.json" "${png[@]}" \
    --table "$OUT/context_sweep.md" 2>&1 | tee -a "$LOG"
fi

echo
echo "== context-sweep, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $commit, $(elapsed) s, ${gpu:-no GPU}"
printf '%s\n' "${stages_done[@]}"
[ -s "$OUT/context_sweep.md" ] && cat "$OUT/context_sweep.md"
ls -l "$OUT"
exit 0
