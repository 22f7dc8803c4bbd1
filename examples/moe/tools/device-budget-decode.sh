#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/moe/tools/device-budget-decode.sh — issue #18's decode at the paper's 32 GB
# budget on the GPU machine, in one bounded call: Qwen3-30B-A3B at full depth (48
# layers, random weights) under `--vram-budget 29.8`, 2000-token prompts, batch 4, 16
# and 32, each decode step's CPU experts against their bound (host expert bytes read
# per step / the DRAM read ceiling ws_decode measures at setup) and the whole step
# against that bound plus the GPU work outside the CPU experts' windows
# (docs/DECODER-INTERNALS.md, "CPU experts against their bound").
#
#   examples/moe/tools/device-budget-decode.sh            # OUT=./device-out
#
# Builds ws_decode into BUILD_DIR (default build-device; CUDA, sm_90, .deps/usr as the
# prefix, like device-run.sh) unless WS_DECODE names a built one, then runs the
# batches through device-decode.sh (one run each, RUN_CAP seconds at most) and prints
# one table.
# Environment: OUT, WS_DECODE, BUILD_DIR, JOBS (default nproc), BATCHES (default
# "4 16 32"), LAYERS (default 48), BUDGET_GIB (default 29.8), PROMPT_LEN (default
# 2000), NEW_TOKENS (default 16: 15 decode steps, the means over the last 14),
# RUN_CAP seconds per run (default 150), TOTAL_BUDGET seconds for everything
# (default 420), EXTRA (more ws_decode arguments for every run), ARMS (one arm a line,
# "label [ws_decode arguments...]": every batch runs once per arm, named
# qwen3.full.b<batch>.<label>; default one unnamed arm), BUILD_ONLY=1 (build
# ws_decode, print its path and stop: device-paper-e2e.sh builds through this).
# Time (estimated from the full-depth runs of docs/results/h200-2026-12-02-s13:
# random-weight init of the 61 GB model 33 s): build ~2 min; per run ~35 s of setup
# (weights, the ~1 s ceiling), prefill 1-6 s, 15 steps of 0.1-0.7 s, teardown ~5 s:
# ~45-60 s; the default set ~5 minutes.
# Output ($OUT): build.log, decode.{json,log,txt} (device-decode.sh's), budget_decode.txt
# (the tables below, also printed: the bound, then the overlap windows' phases) and
# budget_decode.json (per run: batch, rc, the summary's cpu_expert_bound object, decode
# tok/s, the NVML peak and the budget).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/device-out}
export OUT
mkdir -p "$OUT"
BUILD_DIR=${BUILD_DIR:-build-device}
JOBS=${JOBS:-$(nproc)}
BATCHES=${BATCHES:-4 16 32}
LAYERS=${LAYERS:-48}
BUDGET_GIB=${BUDGET_GIB:-29.8}
TOTAL_BUDGET=${TOTAL_BUDGET:-420}
EXTRA=${EXTRA:-}
export PROMPT_LEN=${PROMPT_LEN:-2000}
export NEW_TOKENS=${NEW_TOKENS:-16}
export RUN_CAP=${RUN_CAP:-150}
t_start=$(date +%s)
for d in /usr/local/cuda/bin; do
  [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH=$d:$PATH ;; esac
done
export PATH

if [ -z "${WS_DECODE:-}" ]; then
  WS_DECODE=$root/$BUILD_DIR/examples/moe/ws_decode
  s=$(date +%s)
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  {
    cmake -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_PREFIX_PATH="$root/.deps/usr" -DWRITESCOPE_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release &&
      cmake --build "$BUILD_DIR" -j"$JOBS" --target ws_decode
  } >"$OUT/build.log" 2>&1
  rc=$?
  echo "device-budget-decode: build rc=$rc in $(( $(date +%s) - s )) s"
  if (( rc != 0 )) || ! grep -q 'ws_decode CUDA path ON' "$OUT/build.log"; then
    tail -n 30 "$OUT/build.log"
    exit 1
  fi
fi
export WS_DECODE
if [ "${BUILD_ONLY:-0}" = 1 ]; then
  echo "$WS_DECODE"
  exit 0
fi

spec=""
for b in $BATCHES; do
  if [ -z "${ARMS:-}" ]; then
    spec+="qwen3.full.b$b qwen3 $LAYERS $b --vram-budget $BUDGET_GIB $EXTRA"$'\n'
  else
    while read -r label args; do
      [ -n "${label:-}" ] || continue
      spec+="qwen3.full.b$b.$label qwen3 $LAYERS $b --vram-budget $BUDGET_GIB $EXTRA ${args:-}"$'\n'
    done <<<"$ARMS"
  fi
done
left=$(( TOTAL_BUDGET - ($(date +%s) - t_start) ))
SPEC="$spec" BUDGET=$left "$root/examples/moe/tools/device-decode.sh" >/dev/null

python3 - "$OUT/decode.json" "$OUT/budget_decode.json" >"$OUT/budget_decode.txt" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
rows = []
def f(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-"
print(f"{'run':<22} {'batch':>5} {'rc':>3} {'host exp':>8} {'GB/step':>8} {'ceil GB/s':>9} {'CPU exp ms':>10} {'bound ms':>8} "
      f"{'CPU x':>6} {'step ms':>8} {'step bd ms':>10} {'step x':>6} {'outside ms':>10} {'trips ms':>8} "
      f"{'tok/s':>7} {'NVML GiB':>8} {'budget':>7}")
for r in runs:
    s = r.get("summary") or {}
    batch = s.get("batch") or r["name"].rsplit(".b", 1)[-1]
    b = s.get("cpu_expert_bound") or {}
    ex = s.get("experts") or {}
    dv = s.get("device") or {}
    peak = dv.get("peak_process_bytes")
    peak_gib = peak / 2**30 if isinstance(peak, (int, float)) and peak >= 0 else None
    budget = dv.get("budget_bytes")
    row = {"name": r["name"], "batch": batch, "rc": r["rc"], "seconds": r["seconds"], "command": r["command"],
           "host_experts": ex.get("host"), "cpu_expert_bound": b,
           "decode_steady_tok_s": s.get("decode_steady_tok_s"), "peak_process_bytes": peak, "budget_bytes": budget,
           "error": s.get("error") or (r.get("note") if r["rc"] != "0" else None)}
    rows.append(row)
    if not s or s.get("error"):
        print(f"{r['name']:<22} {batch!s:>5} {r['rc']:>3} {str(row['error'])[:110]}")
        continue
    ms = lambda k: b.get(k) * 1e3 if isinstance(b.get(k), (int, float)) else None
    gb = b.get("host_read_bytes_per_step")
    print(f"{r['name']:<22} {batch!s:>5} {r['rc']:>3} {f(ex.get('host'), 'd'):>8} {f(gb / 1e9 if gb is not None else None, '.2f'):>8} "
          f"{f(b.get('dram_read_gbps'), '.1f'):>9} {f(ms('cpu_expert_seconds_per_step'), '.1f'):>10} "
          f"{f(ms('cpu_bound_seconds_per_step'), '.1f'):>8} {f(b.get('cpu_ratio'), '.2f'):>6} "
          f"{f(ms('step_seconds_per_step'), '.1f'):>8} {f(ms('step_bound_seconds_per_step'), '.1f'):>10} "
          f"{f(b.get('step_ratio'), '.2f'):>6} {f(ms('gpu_outside_seconds_per_step'), '.1f'):>10} "
          f"{f(ms('routing_trip_seconds_per_step'), '.1f'):>8} {f(s.get('decode_steady_tok_s'), '.1f'):>7} "
          f"{f(peak_gib, '.2f'):>8} {f(budget / 2**30 if budget else None, '.2f'):>7}")
json.dump(rows, open(sys.argv[2], "w"), indent=1)
print("means over the decode steps after the first; CPU x = CPU expert ms / bound ms (bound = GB/step / ceiling);")
print("step x = step ms / (bound + outside), outside = the GPU timeline outside the CPU experts' overlap windows and")
print("the routing round trips (trips: shown, not in the bound); NVML GiB = this process's device memory peak")
print()
cols = [("layers", "layers", "d"), ("GPU win", "gpu_window", ".1f"), ("GPU dev", "gpu_device_experts", ".1f"),
        ("host win", "host_window", ".1f"), ("dev issue", "device_issue", ".1f"), ("in wait", "input_wait", ".1f"),
        ("CPU exp", "cpu_experts", ".1f"), ("setup", "cpu_setup", ".2f"), ("wake", "cpu_wake", ".2f"),
        ("in D2H iss", "stage_issue", ".2f"), ("out iss", "output_issue", ".2f"), ("GPU out", "gpu_output", ".2f")]
print(f"{'run':<22} {'issue':>6} {'per-exp':>7} " + " ".join(f"{c[0]:>10}" for c in cols))
for r, row in zip(runs, rows):
    s = r.get("summary") or {}
    b = s.get("cpu_expert_bound") or {}
    w = b.get("window_phases_ms_per_step") or {}
    ex = s.get("experts") or {}
    print(f"{r['name']:<22} {str(b.get('device_experts_issue', '-')):>6} {f(ex.get('per_expert_passes'), 'd'):>7} " +
          " ".join(f"{f(w.get(c[1]), c[2]):>10}" for c in cols))
print("overlap windows' phases, ms per step (docs/DECODER-INTERNALS.md, \"The overlap window's phases\"): GPU win =")
print("the windows on the GPU timeline, GPU dev = their start to the device experts done; host win = dev issue")
print("(before) + in wait + CPU exp (setup and wake inside it); per-exp = MoE passes with one cuBLAS product per expert")
PY
cat "$OUT/budget_decode.txt"
echo "device-budget-decode: $(( $(date +%s) - t_start )) s"
