#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/moe/tools/device-paper-e2e.sh — the paper's end-to-end experiments at a
# 32 GB budget (issue #18 item 5; paper §7.2, Fig. 8 and 9) on the GPU machine:
# `ws_decode --device cuda --random-weights --config examples/moe/configs/<model>.json
# --vram-budget 29.8` (GiB), every layer, the three models, in named run sets split
# into parts of at most PART_BUDGET estimated seconds, one part per call.
#
#   examples/moe/tools/device-paper-e2e.sh --plan                  # every set and part, estimates; runs nothing
#   SET=prefill PART=1 examples/moe/tools/device-paper-e2e.sh      # on the GPU machine: build, run, table
#   SET=decode8k RUNS='d8k.qwen3.b4.*' examples/moe/tools/device-paper-e2e.sh
#   examples/moe/tools/device-paper-e2e.sh --summarize call1/e2e_*.json call2/e2e_*.json [--json all.json]
#
# Sets (examples/moe/tools/paper_e2e.py has the details, the time model and the host
# memory model):
#   prefill    Fig. 8: 2,000-token prompts x batch 4/8/16/32, 2 new tokens, roofline
#   decode8k   Fig. 9 at 8K: batch 4/16/32 x roofline, gpu_only, cpu_only, fixed:0.5
#   decode32k  Fig. 9 at 32K: the same; shapes whose host memory does not fit are left
#              out of the plan and listed with their numbers
# Fig. 9's points are "prefill to the target then decode a window": --prompt-len
# CTX-WINDOW --max-new-tokens WINDOW (WINDOW 16), the decode rate at the target
# context; the paper decodes from a 2K prompt to the target (cumulative mean), which
# at 0.1-1 s per step does not fit a 10-minute call.
# Run names: pf.<model>.b<batch> and d8k|d32k.<model>.b<batch>.<policy>; models qwen3,
# dsv2lite, mixtral. The four policies of one model, batch and context always share a
# part (one call), so their ratios are same-call ratios; ratios across calls are never
# taken (--summarize lists such runs but does not divide them).
#
# Environment: SET (prefill | decode8k | decode32k | a comma list | all; default
# prefill), PART (a part number of the plan, or all; default all), RUNS (glob patterns
# of run names; default *), OUT (default ./device-out), WS_DECODE (default: built into
# BUILD_DIR by device-budget-decode.sh BUILD_ONLY=1), BUILD_DIR, TOTAL_BUDGET seconds
# for the whole call, the build included (default 540: a run whose estimate does not
# fit what is left is skipped, not started), CALL_ID (default host-UTC time), and the
# plan's knobs read by paper_e2e.py: MODELS, PREFILL_BATCHES, DECODE_BATCHES,
# PREFILL_LEN, PREFILL_NEW, CTX_8K, CTX_32K, WINDOW, POLICIES, FIXED, BUDGET_GIB, LAYERS,
# PART_BUDGET (default 450), HOST_LIMIT_GIB, HOST_OVERHEAD_GIB, ATT_GBPS, EXTRA.
# Each run goes through device-decode.sh (one SPEC line, its own OUT folder and cap).
# Output ($OUT): plan.txt, plan.json, e2e_<set>_p<part>.json (the call's identity and
# every run: plan entry, rc, seconds, command, ws_decode's --json summary, host memory
# peak), e2e_<set>_p<part>.txt (the table, also printed), hostmem.txt (MemTotal and
# MemAvailable every 2 s), runs/<name>/ (device-decode.sh's files), build.log.
# Local smoke test without a GPU (the plumbing, the table, --summarize):
# STANDIN=emulated WS_DECODE=build-host/examples/moe/ws_decode runs every command
# through a wrapper that maps --device cuda to --device emulated, the public configs to
# the tiny fixtures (examples/moe/fixtures) and --vram-budget to STANDIN_BUDGET_GIB
# (default 1) with --max-gpu-experts 3; give it small shapes, e.g. PREFILL_LEN=48
# CTX_8K=96 CTX_32K=160 WINDOW=4.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
tools=$root/examples/moe/tools
py=${PYTHON:-python3}

if [ "${1:-}" = "--summarize" ]; then
  shift
  exec "$py" "$tools/paper_e2e.py" summarize "$@"
fi
plan_only=0
[ "${1:-}" = "--plan" ] && plan_only=1

OUT=${OUT:-./device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export SET=${SET:-prefill}
export PART=${PART:-all}
TOTAL_BUDGET=${TOTAL_BUDGET:-540}
t_start=$(date +%s)

PLAN_JSON=$OUT/plan.json "$py" "$tools/paper_e2e.py" plan >"$OUT/plan.tsv" 2>"$OUT/plan.txt"
rc=$?
cat "$OUT/plan.txt"
(( rc == 0 )) || exit 2
(( plan_only )) && exit 0
if [ ! -s "$OUT/plan.tsv" ]; then
  echo "device-paper-e2e: no run chosen (SET=$SET PART=$PART RUNS=${RUNS:-*})" >&2
  exit 2
fi

if [ -z "${WS_DECODE:-}" ]; then
  WS_DECODE=$(BUILD_ONLY=1 OUT=$OUT "$tools/device-budget-decode.sh" | tail -n 1)
  if [ ! -x "$WS_DECODE" ]; then
    echo "device-paper-e2e: no ws_decode built (see $OUT/build.log)" >&2
    exit 1
  fi
fi
echo "device-paper-e2e: ws_decode $WS_DECODE ($(( $(date +%s) - t_start )) s)"

if [ "${STANDIN:-}" = emulated ]; then
  real=$(cd "$(dirname "$WS_DECODE")" && pwd)/$(basename "$WS_DECODE")
  mkdir -p "$OUT/standin"
  cat >"$OUT/standin/ws_decode" <<EOF
#!/usr/bin/env bash
# device-paper-e2e.sh STANDIN=emulated: the GPU machine's command on the emulated device
a=()
while [ \$# -gt 0 ]; do
  case \$1 in
    cuda) a+=(emulated) ;;
    --layers) a+=(--layers 0); shift ;;
    --vram-budget) a+=(--vram-budget ${STANDIN_BUDGET_GIB:-1} --max-gpu-experts 3 --allow-long-context); shift ;;
    */qwen3_30b_a3b.json) a+=("$root/examples/moe/fixtures/qwen3_moe/config.json") ;;
    */deepseek_v2_lite.json) a+=("$root/examples/moe/fixtures/deepseek_v2/config.json") ;;
    */mixtral_8x7b.json) a+=("$root/examples/moe/fixtures/mixtral/config.json") ;;
    *) a+=("\$1") ;;
  esac
  shift
done
exec "$real" "\${a[@]}"
EOF
  chmod +x "$OUT/standin/ws_decode"
  WS_DECODE=$OUT/standin/ws_decode
fi
export WS_DECODE

# host memory every 2 s: epoch, MemTotal kB, MemAvailable kB
(
  while :; do
    echo "$(date +%s.%N) $(awk '/^MemTotal:/{t=$2} /^MemAvailable:/{a=$2} END{print t, a}' /proc/meminfo)"
    sleep 2
  done
) >"$OUT/hostmem.txt" 2>/dev/null &
sampler=$!

CALL_ID=${CALL_ID:-$(hostname -s 2>/dev/null || echo host)-$(date -u +%Y%m%dT%H%M%SZ)}
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
tag=${SET//,/+}_p$PART
[ -n "${RUNS:-}" ] && tag=${tag}_runs
"$py" - "$OUT/call.json" "$CALL_ID" "$SET" "$PART" "${RUNS:-*}" "$commit" "$WS_DECODE" "${STANDIN:-}" <<'PY'
import json, socket, sys, time
out, cid, s, part, runs, commit, exe, standin = sys.argv[1:9]
json.dump({"id": cid, "set": s, "part": part, "runs_filter": runs, "commit": commit, "ws_decode": exe,
           "standin": standin or None, "host": socket.gethostname(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, open(out, "w"), indent=1)
PY

mkdir -p "$OUT/runs"
while IFS=$'\t' read -r part set_name name model layers batch prompt new est cap args; do
  [ -n "${name:-}" ] || continue
  d=$OUT/runs/$name
  rm -rf "$d"
  mkdir -p "$d"
  left=$(( TOTAL_BUDGET - ($(date +%s) - t_start) ))
  if (( est + 10 > left )); then
    echo "budget: estimated $est s, $left s left" >"$d/skipped"
    echo "device-paper-e2e: $name skipped (estimated $est s, $left s left)"
    continue
  fi
  run_cap=$(( cap < left ? cap : left ))
  s=$(date +%s.%N)
  OUT=$d SPEC="$name $model $layers $batch $args" PROMPT_LEN=$prompt NEW_TOKENS=$new RUN_CAP=$run_cap \
    BUDGET=$left "$tools/device-decode.sh" </dev/null >"$d/stdout" 2>&1
  echo "$s $(date +%s.%N)" >"$d/span"
  echo "device-paper-e2e: $set_name/$part $(grep -m1 '^device-decode: ' "$d/stdout" | sed 's/^device-decode: //') (estimated $est s)"
done <"$OUT/plan.tsv"

sleep 2
kill "$sampler" 2>/dev/null
wait "$sampler" 2>/dev/null
"$py" "$tools/paper_e2e.py" report "$OUT/runs" "$OUT/plan.tsv" "$OUT/call.json" "$OUT/e2e_$tag.json" \
  "$OUT/e2e_$tag.txt" "$OUT/hostmem.txt"
echo "device-paper-e2e: $(( $(date +%s) - t_start )) s; $OUT/e2e_$tag.json"
