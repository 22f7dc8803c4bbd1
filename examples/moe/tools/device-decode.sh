#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/moe/tools/device-decode.sh — decode-step runs of `ws_decode --device cuda
# --random-weights` on the GPU machine, one named configuration per run, side by side
# in one call so that ratios between them are same-run ratios.
#
#   OUT=/some/dir WS_DECODE=build-device/examples/moe/ws_decode \
#   SPEC='q.half.host   qwen3 4 1 --max-gpu-experts 256 --expert-placement layers
#         q.half.dev    qwen3 4 1 --max-gpu-experts 256 --expert-placement layers --decode-routing device' \
#       examples/moe/tools/device-decode.sh
#
# SPEC: one run per line, "name model layers batch [ws_decode arguments...]"; models
# qwen3 (Qwen3-30B-A3B), dsv2lite (DeepSeek-V2-Lite), mixtral (Mixtral-8x7B), their
# public configs in examples/moe/configs. Every run: prompt PROMPT_LEN (default 2048)
# tokens per sequence, NEW_TOKENS (default 32) generated, the roofline policy unless
# the arguments give --policy.
# Environment: OUT (default ./device-out), WS_DECODE, SPEC (required), RUN_CAP seconds
# per run (default 90), BUDGET seconds for everything (default 480), PROMPT_LEN,
# NEW_TOKENS.
# Output: $OUT/decode.json (an array: name, rc, seconds, command, summary), decode.log
# (every run's output), decode.txt (the table below, also printed): decode tok/s,
# steady TPOT P50, and the host thread's per-step phases (means over the steps after
# the first): hybrid attention, router waits, LM head + sampling, CPU experts.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
WS_DECODE=${WS_DECODE:-$root/build-device/examples/moe/ws_decode}
RUN_CAP=${RUN_CAP:-90}
BUDGET=${BUDGET:-480}
PROMPT_LEN=${PROMPT_LEN:-2048}
NEW_TOKENS=${NEW_TOKENS:-32}
: "${SPEC:?give the runs, one per line: name model layers batch [args]}"
cfg=$root/examples/moe/configs

config_of() {
  case $1 in
    qwen3) echo qwen3_30b_a3b.json ;;
    dsv2lite) echo deepseek_v2_lite.json ;;
    mixtral) echo mixtral_8x7b.json ;;
    *) return 1 ;;
  esac
}

tmp=$(mktemp -d)
t0=$(date +%s)
: >"$OUT/decode.log"
entries=()
idx=0
while read -r name model layers batch args; do
  [ -n "${name:-}" ] || continue
  idx=$((idx + 1))
  key=$idx
  if ! config=$(config_of "$model"); then
    echo "device-decode: $name: unknown model $model" >&2
    entries+=("$name|bad|0|$key|unknown model")
    continue
  fi
  left=$(( BUDGET - ($(date +%s) - t0) ))
  if (( left < 15 )); then
    entries+=("$name|skipped|0|$key|budget")
    continue
  fi
  cap=$(( left < RUN_CAP ? left : RUN_CAP ))
  pol="--policy roofline"
  [[ " $args " == *" --policy "* ]] && pol=""
  cmd="$WS_DECODE --device cuda --random-weights --config $cfg/$config --layers $layers --batch $batch --prompt-len $PROMPT_LEN --max-new-tokens $NEW_TOKENS --no-progress $pol $args --json $tmp/$key.json"
  echo "$cmd" >"$tmp/$key.cmd"
  s=$(date +%s)
  # shellcheck disable=SC2086  # the command string is a word list
  timeout --kill-after=5 "$cap" $cmd >"$tmp/$key.out" 2>&1
  rc=$?
  e=$(( $(date +%s) - s ))
  { echo "===== $name (rc $rc, ${e} s): $cmd"; cat "$tmp/$key.out"; } >>"$OUT/decode.log"
  note=""
  [ "$rc" = 0 ] || note=$(tail -n 1 "$tmp/$key.out" | tr -d '|"\\' | cut -c1-200)
  entries+=("$name|$rc|$e|$key|$note")
  echo "device-decode: $name rc=$rc ${e}s"
done <<<"$SPEC"

python3 - "$tmp" "$OUT/decode.json" "${entries[@]}" <<'PY'
import json, os, sys
tmp, out, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = []
for r in rows:
    name, rc, e, key, note = r.split("|", 4)
    p = os.path.join(tmp, key + ".json")
    summary = None
    if rc == "0" and os.path.exists(p) and os.path.getsize(p) > 0:
        summary = json.load(open(p))
    cmdp = os.path.join(tmp, key + ".cmd")
    cmd = open(cmdp).read().strip() if os.path.exists(cmdp) else ""
    runs.append({"name": name, "rc": rc, "seconds": int(e), "note": note, "command": cmd, "summary": summary})
json.dump(runs, open(out, "w"), indent=1)
PY

python3 - "$OUT/decode.json" >"$OUT/decode.txt" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
def mean_ms(s, key):
    v = ((s.get("step_host_phases") or {}).get(key) or [])[1:]
    return sum(v) / len(v) * 1e3 if v else None
def f(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-"
print(f"{'run':22} {'rc':>3} {'decode tok/s':>12} {'TPOT ms':>8} {'attn ms':>8} {'router ms':>9} "
      f"{'head ms':>8} {'CPU exp ms':>10} {'GPU/host':>9} {'dev-routed':>10} {'cpu share':>9}")
for r in runs:
    s = r.get("summary") or {}
    if not s or s.get("error"):
        print(f"{r['name']:22} {r['rc']:>3} {(s.get('error') if s else r.get('note', ''))!s:.90}")
        continue
    dv = s.get("device") or {}
    ex = s.get("experts") or {}
    steps = max(1, len((s.get("step_host_phases") or {}).get("head_seconds") or []))
    cpu_exp = (ex.get("cpu_seconds") or 0) / steps * 1e3 if isinstance(ex, dict) else None
    gh = f"{ex.get('gpu', '-')}/{ex.get('host', '-')}" if isinstance(ex, dict) else "-"
    print(f"{r['name']:22} {r['rc']:>3} {f(s.get('decode_steady_tok_s') or s.get('decode_tok_s'), '.1f'):>12} "
          f"{f(s.get('tpot_steady_p50_ms'), '.3f'):>8} {f(mean_ms(s, 'attention_seconds'), '.3f'):>8} "
          f"{f(mean_ms(s, 'router_wait_seconds'), '.3f'):>9} {f(mean_ms(s, 'head_seconds'), '.3f'):>8} "
          f"{f(cpu_exp, '.3f'):>10} {gh:>9} {f(ex.get('device_routed_passes') if isinstance(ex, dict) else None, 'd'):>10} "
          f"{f(s.get('cpu_share') if not isinstance(s.get('cpu_share'), dict) else None, '.3f'):>9}")
PY
cat "$OUT/decode.txt"
