#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/moe/tools/device-prefill.sh — prefill runs of `ws_decode --device cuda
# --random-weights` on the GPU machine at the public shapes (examples/moe/configs),
# beside transformers (examples/moe/tools/hf_peer.py --cache dynamic: its plain GPU
# cache, the fastest prefill it has) at the same shape, and under a VRAM budget
# that leaves routed experts in host memory (streamed to the GPU for the prefill).
#
#   OUT=/some/dir WS_DECODE=build-device/examples/moe/ws_decode RUNS="qwen3.4x32k hf.qwen3.4x32k" \
#       examples/moe/tools/device-prefill.sh
#
# Run names: <model>.<shape>[.<variant>], hf.<model>.<shape> for the peer.
#   models   qwen3 (Qwen3-30B-A3B, 8 of 48 layers), dsv2lite (DeepSeek-V2-Lite, 4 of 27),
#            mixtral (Mixtral-8x7B, 4 of 32); *_full: every layer
#   shapes   4x32k (Mixtral: 4 x 32000, inside its 32,768 positions), 8x8k, 32x2k, 4x2k
#   variants half (a --vram-budget below the model so that at least half of the
#            routed experts are in host memory), b298 (--vram-budget 29.8 GiB: the
#            paper's 32 GB), cpu (the same with --stream-experts off: host experts on
#            the CPU), grouped (--prefill-expert-gemm grouped; half_grouped,
#            b298_grouped), noflash, nowarm (--no-warmup), ladder (--prefill-expert-groups
#            ladder), half_ring1 (Qwen3: half with a one-layer staging ring), third
#            (DeepSeek-V2-Lite: 64 of 192 on the host)... see the table below
# Every ws_decode run generates NEW_TOKENS (default 2) tokens: prefill (the first
# token) and one decode step; prefill_tok_s and prefill_seconds (TTFT) come from
# its --json summary, with the prefill phases.
#
# Environment: OUT (default ./device-out), WS_DECODE, RUNS (required: names to
# run, in order), RUN_CAP seconds per ws_decode run (default 150), HF_CAP (default
# 200), BUDGET seconds for everything (default 540), NEW_TOKENS, PYTHON, EXTRA
# (more ws_decode arguments for every ws run).
# Output: $OUT/prefill.json (one array: name, rc, seconds, summary), $OUT/prefill.log,
# $OUT/prefill.txt (the table, also printed).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
WS_DECODE=${WS_DECODE:-$root/build-device/examples/moe/ws_decode}
RUN_CAP=${RUN_CAP:-150}
HF_CAP=${HF_CAP:-200}
BUDGET=${BUDGET:-540}
NEW_TOKENS=${NEW_TOKENS:-2}
PYTHON=${PYTHON:-python3}
EXTRA=${EXTRA:-}
cfg=$root/examples/moe/configs
: "${RUNS:?name the runs, e.g. RUNS=\"qwen3.4x32k hf.qwen3.4x32k\"}"

config_of() {  # model -> "config layers"
  case $1 in
    qwen3) echo "qwen3_30b_a3b.json 8" ;;
    dsv2lite) echo "deepseek_v2_lite.json 4" ;;
    mixtral) echo "mixtral_8x7b.json 4" ;;
    qwen3_full) echo "qwen3_30b_a3b.json 48" ;;
    dsv2lite_full) echo "deepseek_v2_lite.json 27" ;;
    mixtral_full) echo "mixtral_8x7b.json 32" ;;
    *) return 1 ;;
  esac
}
shape_of() {  # model shape -> "batch prompt_len"
  local long=32768
  [[ $1 == mixtral* ]] && long=32000
  case $2 in
    4x32k) echo "4 $long" ;;
    8x8k) echo "8 8192" ;;
    32x2k) echo "32 2048" ;;
    4x2k) echo "4 2000" ;;
    *) return 1 ;;
  esac
}
variant_args() {  # model variant -> extra ws_decode arguments
  case $2 in
    "") echo "" ;;
    # half of the routed experts in host memory (the 8/4-layer cuts): Qwen3 8 L 512 of
    # 1,024 (9.7 GB of experts); DeepSeek-V2-Lite 4 L (3 MoE layers) 96 of 192;
    # Mixtral 4 L 16 of 32 (11.3 GB). third: DeepSeek-V2-Lite with 64 of 192 on the host
    half) case $1 in
            qwen3) echo "--max-gpu-experts 512" ;;
            dsv2lite) echo "--max-gpu-experts 96" ;;
            mixtral) echo "--max-gpu-experts 16" ;;
            *) echo "--vram-budget 16" ;;
          esac ;;
    third) case $1 in
             dsv2lite) echo "--max-gpu-experts 128" ;;
             *) return 1 ;;
           esac ;;
    half_cpu) echo "$(variant_args "$1" half) --stream-experts off" ;;
    b298) echo "--vram-budget 29.8" ;;
    b298_cpu) echo "--vram-budget 29.8 --stream-experts off" ;;
    b16) echo "--vram-budget 16" ;;
    noflash) echo "--flash-prefill off" ;;
    nowarm) echo "--no-warmup" ;;
    ladder) echo "--prefill-expert-groups ladder" ;;
    # half with a staging ring of one layer's host experts (Qwen3 8 L: 64 x 9 MiB):
    # the streamed experts then run one at a time instead of in the batched GEMMs
    half_ring1) case $1 in
                  qwen3) echo "--max-gpu-experts 512 --expert-staging-mib 576" ;;
                  *) return 1 ;;
                esac ;;
    grouped) echo "--prefill-expert-gemm grouped" ;;
    half_grouped) echo "$(variant_args "$1" half) --prefill-expert-gemm grouped" ;;
    b298_grouped) echo "--vram-budget 29.8 --prefill-expert-gemm grouped" ;;
    *) return 1 ;;
  esac
}

tmp=$(mktemp -d)
t0=$(date +%s)
: >"$OUT/prefill.log"
results=()
idx=0
for name in $RUNS; do
  idx=$((idx + 1))
  key=$idx.$name  # the files of this run: a name given twice runs twice, each with its own summary
  kind=ws
  n=$name
  if [[ $n == hf.* ]]; then kind=hf; n=${n#hf.}; fi
  IFS=. read -r model shape variant <<<"$n"
  if ! cm=$(config_of "$model") || ! bs=$(shape_of "$model" "$shape") || ! va=$(variant_args "$model" "${variant:-}"); then
    echo "device-prefill: unknown run $name" >&2
    results+=("$name|bad|0|unknown run name|$key")
    continue
  fi
  read -r config layers <<<"$cm"
  read -r batch plen <<<"$bs"
  left=$(( BUDGET - ($(date +%s) - t0) ))
  if (( left < 20 )); then
    results+=("$name|skipped|0|budget|$key")
    continue
  fi
  if [ $kind = hf ]; then
    cap=$(( left < HF_CAP ? left : HF_CAP ))
    cmd="$PYTHON $root/examples/moe/tools/hf_peer.py --config $cfg/$config --layers $layers --batch $batch --prompt-len $plen --new-tokens 2 --cache dynamic --json $tmp/$key.json"
  else
    cap=$(( left < RUN_CAP ? left : RUN_CAP ))
    cmd="$WS_DECODE --device cuda --random-weights --config $cfg/$config --layers $layers --batch $batch --prompt-len $plen --max-new-tokens $NEW_TOKENS --policy roofline --no-progress $va $EXTRA --json $tmp/$key.json"
  fi
  s=$(date +%s)
  # shellcheck disable=SC2086  # the command string is a word list
  timeout --kill-after=5 "$cap" $cmd >"$tmp/$key.out" 2>&1
  rc=$?
  e=$(( $(date +%s) - s ))
  { echo "===== $name (rc $rc, ${e} s): $cmd"; cat "$tmp/$key.out"; } >>"$OUT/prefill.log"
  results+=("$name|$rc|$e||$key")
  echo "device-prefill: $name rc=$rc ${e}s"
done

{
  echo "["
  first=1
  for r in "${results[@]}"; do
    IFS='|' read -r name rc e why key <<<"$r"
    [ $first -eq 1 ] || echo ","
    first=0
    printf '{"name": "%s", "rc": "%s", "seconds": %s, "note": "%s", "summary": ' "$name" "$rc" "$e" "$why"
    if { [ "$rc" = "0" ] || [[ "$name" == hf.* ]]; } && [ -s "$tmp/$key.json" ]; then cat "$tmp/$key.json"; else echo "null"; fi
    echo "}"
  done
  echo "]"
} >"$OUT/prefill.json"

python3 - "$OUT/prefill.json" >"$OUT/prefill.txt" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
by = {r["name"]: r for r in runs}
def sub(s, key):  # a nested object of the summary, {} where the peer writes none (or a string)
    v = s.get(key)
    return v if isinstance(v, dict) else {}
def f(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-"
print(f"{'run':28} {'rc':>4} {'prefill tok/s':>13} {'TTFT s':>7} {'x hf':>6} {'attn s':>7} {'MoE s':>7} {'CPU exp s':>9} "
      f"{'KV wr s':>7} {'experts GPU/host':>16} {'streamed GB':>11} {'peak GiB':>8} {'budget GiB':>10}")
for r in runs:
    s = r.get("summary") or {}
    if s.get("error") or not s:
        print(f"{r['name']:28} {r['rc']:>4} {'-':>13} {(s.get('error') or r.get('note',''))[:80]}")
        continue
    tok = s.get("prefill_tok_s")
    ratio = "-"
    if not r["name"].startswith("hf."):
        base = r["name"].split(".")
        peer = by.get("hf." + ".".join(base[:2]))
        ps = (peer or {}).get("summary") or {}
        if isinstance(ps.get("prefill_tok_s"), (int, float)) and tok:
            ratio = f"{tok / ps['prefill_tok_s']:.2f}"
    ph = sub(s, "prefill_phases_seconds")
    ex = sub(s, "experts")
    st = sub(s, "expert_streaming")
    dv = sub(s, "device")
    gh = f"{ex.get('gpu','-')}/{ex.get('host','-')}" if ex else "-"
    print(f"{r['name']:28} {r['rc']:>4} {f(tok, '.0f'):>13} {f(s.get('prefill_seconds'), '.2f'):>7} {ratio:>6} "
          f"{f(ph.get('attention'), '.2f'):>7} {f(ph.get('moe'), '.2f'):>7} {f(ph.get('cpu_experts'), '.2f'):>9} "
          f"{f(ph.get('kv_write_host'), '.2f'):>7} {gh:>16} {f((st.get('bytes') or 0) / 1e9, '.1f'):>11} "
          f"{f((dv.get('peak_used_bytes') or 0) / 2**30, '.2f'):>8} {f((dv.get('budget_bytes') or 0) / 2**30, '.2f'):>10}")
PY
cat "$OUT/prefill.txt"
