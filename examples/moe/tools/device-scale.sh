#!/usr/bin/env bash
# examples/moe/tools/device-scale.sh — scale runs of `ws_decode --device cuda`
# on the GPU machine with --random-weights at the public shapes
# (examples/moe/configs/), a subset of the layers so the whole set fits
# ~4 minutes: for each model the same run under roofline / gpu_only / cpu_only
# (paper §7: the split against the GPU-centric and CPU-centric baselines).
#
#   OUT=/some/dir WS_DECODE=build-device/examples/moe/ws_decode examples/moe/tools/device-scale.sh
#
# Runs, in order (later ones are skipped when the budget runs out):
#   qwen3.*     Qwen3-30B-A3B, 8 of 48 layers, batch 8 x 32736 tokens (262K aggregate)
#   dsv2lite.*  DeepSeek-V2-Lite, 4 of 27 layers, batch 32 x 32736 (1.05M aggregate)
#   mixtral.*   Mixtral-8x7B, 4 of 32 layers, batch 4 x 32736, roofline only
#   qwen3_spill.roofline  Qwen3-30B-A3B, 8 layers, batch 8 x 992, half of the routed
#               experts (--max-gpu-experts 512) in host memory, run by the CPU
# KV plan: block 32, D 64, ping-pong 2 x 64 MiB; prompts of 32736 = 511.5 x 64
# tokens leave 32 in each D-window, so the 39 decode steps include one eviction
# of every sequence (TPOT P99 sees it).
#
# Environment: OUT (default ./device-out), WS_DECODE (default
# build-device/examples/moe/ws_decode), SCALE_BUDGET seconds for all runs
# (default 240), RUN_CAP seconds for one run (default 80), RUNS (space-separated
# names to run, default all), EXTRA (more ws_decode arguments for every run).
# Output: $OUT/scale.txt (table), $OUT/scale.json (every run's --json summary
# in one array, with name/rc/seconds), $OUT/scale.log (each run's summary).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
OUT=${OUT:-$root/device-out}
WS_DECODE=${WS_DECODE:-$root/build-device/examples/moe/ws_decode}
SCALE_BUDGET=${SCALE_BUDGET:-240}
RUN_CAP=${RUN_CAP:-80}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
if [ ! -x "$WS_DECODE" ]; then
  echo "device-scale: $WS_DECODE not built" | tee "$OUT/scale.txt"
  exit 2
fi
cfg=$root/examples/moe/configs
kv="--block-tokens 32 --d-window 64 --ping-pong-mib 64 --gpu-split-blocks 16 --cpu-task-blocks 16 --no-progress"
long=32736

declare -a names args
add() { names+=("$1"); args+=("$2"); }
for pol in roofline gpu_only cpu_only; do
  add "qwen3.$pol" "--random-weights --config $cfg/qwen3_30b_a3b.json --layers 8 --batch 8 --prompt-len $long --max-new-tokens 40 --policy $pol"
done
for pol in roofline gpu_only cpu_only; do
  add "dsv2lite.$pol" "--random-weights --config $cfg/deepseek_v2_lite.json --layers 4 --batch 32 --prompt-len $long --max-new-tokens 40 --policy $pol"
done
add "mixtral.roofline" "--random-weights --config $cfg/mixtral_8x7b.json --layers 4 --batch 4 --prompt-len $long --max-new-tokens 40 --policy roofline"
add "qwen3_spill.roofline" "--random-weights --config $cfg/qwen3_30b_a3b.json --layers 8 --batch 8 --prompt-len 992 --max-new-tokens 40 --policy roofline --max-gpu-experts 512"

tmp=$(mktemp -d)
t0=$(date +%s)
: >"$OUT/scale.log"
results=()
for i in "${!names[@]}"; do
  name=${names[$i]}
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then continue; fi
  left=$(( SCALE_BUDGET - ($(date +%s) - t0) ))
  if (( left < 25 )); then
    results+=("$name|skipped|0|budget")
    continue
  fi
  cap=$(( left < RUN_CAP ? left : RUN_CAP ))
  s=$(date +%s)
  # shellcheck disable=SC2086  # the argument strings are word lists
  timeout --kill-after=5 "$cap" "$WS_DECODE" --device cuda ${args[$i]} $kv $EXTRA --json "$tmp/$name.json" \
    >"$tmp/$name.out" 2>&1
  rc=$?
  e=$(( $(date +%s) - s ))
  { echo "===== $name (rc $rc, ${e} s): ws_decode --device cuda ${args[$i]} $kv $EXTRA"; cat "$tmp/$name.out"; } >>"$OUT/scale.log"
  results+=("$name|$rc|$e|")
  echo "device-scale: $name rc=$rc ${e}s"
done

# One JSON array: {"name", "rc", "seconds", "summary": <ws_decode --json or null>} per run.
{
  echo "["
  first=1
  for r in "${results[@]}"; do
    IFS='|' read -r name rc e why <<<"$r"
    [ $first -eq 1 ] || echo ","
    first=0
    printf '{"name": "%s", "rc": "%s", "seconds": %s, "note": "%s", "summary": ' "$name" "$rc" "$e" "$why"
    if [ "$rc" = "0" ] && [ -s "$tmp/$name.json" ]; then cat "$tmp/$name.json"; else echo "null"; fi
    echo "}"
  done
  echo "]"
} >"$OUT/scale.json"

# The table (python3 is on the GPU machine's image; without it, scale.json has it all).
if command -v python3 >/dev/null 2>&1; then
  python3 - "$OUT/scale.json" >"$OUT/scale.txt" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
hdr = f"{'run':22} {'rc':>4} {'s':>4} {'prefill tok/s':>13} {'TPOT P50 ms':>11} {'P99 ms':>8} {'P99/P50':>7} {'decode tok/s':>12} {'CPU share':>9} {'evict C/G':>9} {'experts GPU/host':>16}"
print(hdr)
for r in runs:
    s = r.get("summary")
    if not s:
        print(f"{r['name']:22} {r['rc']:>4} {r['seconds']:>4} {'-':>13} {r.get('note','')}")
        continue
    p50, p99 = s["tpot_p50_ms"], s["tpot_p99_ms"]
    ev = s.get("decode_evictions", {})
    ex = s.get("experts", {})
    print(f"{r['name']:22} {r['rc']:>4} {r['seconds']:>4} {s['prefill_tok_s']:13.0f} {p50:11.2f} {p99:8.2f} "
          f"{(p99 / p50 if p50 else 0):7.2f} {s['decode_tok_s']:12.1f} {s['cpu_share']:9.3f} "
          f"{str(ev.get('cpu', '-')) + '/' + str(ev.get('gpu', '-')):>9} {str(ex.get('gpu', '-')) + '/' + str(ex.get('host', '-')):>16}")
# decode speed-up of roofline over the baselines, per model
by = {r["name"]: r.get("summary") for r in runs}
for m in ("qwen3", "dsv2lite"):
    ro, go, co = by.get(m + ".roofline"), by.get(m + ".gpu_only"), by.get(m + ".cpu_only")
    if ro and go and go["decode_tok_s"] > 0:
        line = f"{m}: roofline decode {ro['decode_tok_s']:.1f} tok/s = {ro['decode_tok_s'] / go['decode_tok_s']:.2f}x gpu_only"
        if co and co["decode_tok_s"] > 0:
            line += f", {ro['decode_tok_s'] / co['decode_tok_s']:.2f}x cpu_only"
        print(line)
PY
else
  echo "python3 not found: see scale.json" >"$OUT/scale.txt"
fi
cat "$OUT/scale.txt"
rm -rf "$tmp"
