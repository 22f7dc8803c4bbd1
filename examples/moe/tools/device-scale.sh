#!/usr/bin/env bash
# examples/moe/tools/device-scale.sh — scale runs of `ws_decode --device cuda`
# on the GPU machine with --random-weights at the public shapes
# (examples/moe/configs/), a subset of the layers so the whole set fits one
# device call: for each model the same run under roofline / gpu_only / cpu_only
# (paper §7: the split against the GPU-centric and CPU-centric baselines), and
# optionally transformers' generate() with its offloaded KV cache beside
# ws_decode at one shape (PEER=1).
#
#   OUT=/some/dir WS_DECODE=build-device/examples/moe/ws_decode examples/moe/tools/device-scale.sh
#   CALIBRATION=$OUT/calibration.json PEER=1 examples/moe/tools/device-scale.sh
#
# Runs, in order (later ones are skipped when the budget runs out):
#   qwen3.*     Qwen3-30B-A3B, 8 of 48 layers, batch 8 x 32736 tokens (262K aggregate)
#   dsv2lite.*  DeepSeek-V2-Lite, 4 of 27 layers, batch 32 x 32736 (1.05M aggregate)
#   mixtral.*   Mixtral-8x7B, 4 of 32 layers, batch 4 x 32736, roofline only
#   qwen3_8k.roofline, hf.qwen3_8k   (PEER=1, or named in RUNS) Qwen3-30B-A3B, 8 layers,
#               batch 8 x 8160: ws_decode, then examples/moe/tools/hf_peer.py (transformers'
#               Qwen3MoeForCausalLM, random init, bf16, generate() with the offloaded cache)
#   qwen3_spill.roofline  Qwen3-30B-A3B, 8 layers, batch 8 x 992, half of the routed
#               experts (--max-gpu-experts 512) in host memory, run by the CPU
#   dsv2lite.{headroom,headroom03,assist}, mixtral.{gpu_only,cpu_only,headroom}  (only when named in RUNS)
#               the TPOT-tail experiments (docs/DECODERS.md, known limitations): roofline
#               placed 0.05 (0.03) below its balance (--placement-headroom, the GPU the long
#               pole; 0.05 is ws_decode's default on a GPU, so *.headroom
#               repeats *.roofline there), and the adaptive CPU assist (--cpu-assist adaptive)
#   dsv2lite_8k.roofline, hf.dsv2lite_8k, mixtral_peer.roofline, hf.mixtral  (only when named in
#               RUNS) the transformers peer on DeepSeek-V2-Lite (4 layers, 8 x 8160) and Mixtral
#               (4 layers, 4 x 32736), each after ws_decode at the same shape
#   mixtral_full4.{roofline,gpu_only}  (only when named in RUNS; ~65 s each) all 32 layers at
#               batch 4 x 32736, 66 new tokens: the full-depth Mixtral shape of docs/results/h200-2026-11-29-s5
#   mixtral_ram.{roofline,gpu_only}  (only when named in RUNS; ~4 minutes each, RUN_CAP=300)
#               all 32 layers at 16 x 32736 (64 GiB of KV in host memory), 34 new tokens
#   *_full.{roofline,gpu_only,cpu_only}  (only when named in RUNS; each takes 2-4 minutes, so raise
#               RUN_CAP, e.g. 300) every layer of the model: qwen3_full 48 layers x 8 x 32736
#               (24 GiB of KV), dsv2lite_full 27 layers x 32 x 32736 (31 GiB), mixtral_full
#               32 layers x 8 x 32736 (32 GiB; 93 GB of bf16 weights on the GPU)
#   {qwen3,dsv2lite,mixtral}.balance  (only when named in RUNS) roofline at the paper's balance
#               (--placement-headroom 0); ws_decode's default on a GPU places 0.05 below it
# KV plan: block 32, D 64, ping-pong 2 x 64 MiB, GPU splits of ws_decode's default 4 blocks
# (earlier results used 8 or 16; calibrate with --block-tokens 32 --split-blocks 4 to match, since
# B and K depend on both). Prompts of 32736 = 511.5 x 64
# (8160 = 127.5 x 64) tokens leave 32 in each D-window, so every sequence
# evicts at decode steps 32, 96, 160, ...; NEW_TOKENS = 130 gives 129 decode
# steps: the first (reported alone) and 128 steady-state steps = two eviction
# windows, each with its eviction step (TPOT P99 sees them).
#
# Environment: OUT (default ./device-out), WS_DECODE (default
# build-device/examples/moe/ws_decode), SCALE_BUDGET seconds for all runs
# (default 420), RUN_CAP seconds for one ws_decode run (default 100), HF_CAP for
# the transformers run (default 150), RUNS (space-separated names to run,
# default all but the PEER pair), PEER=1 (add the PEER pair), NEW_TOKENS
# (default 130), PEER_NEW_TOKENS (default 66: one eviction window; the
# transformers run is the slow one), CALIBRATION (a bench/calibrate --out file:
# --calibration for every roofline ws_decode run; must be readable), PYTHON (default
# python3), EXTRA (more ws_decode arguments for every run).
# Output: $OUT/scale.txt (table), $OUT/scale.json (every run's --json summary
# in one array, with name/rc/seconds), $OUT/scale.log (each run's output).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
OUT=${OUT:-$root/device-out}
WS_DECODE=${WS_DECODE:-$root/build-device/examples/moe/ws_decode}
SCALE_BUDGET=${SCALE_BUDGET:-420}
RUN_CAP=${RUN_CAP:-100}
HF_CAP=${HF_CAP:-150}
NEW_TOKENS=${NEW_TOKENS:-130}
PEER_NEW_TOKENS=${PEER_NEW_TOKENS:-66}
PYTHON=${PYTHON:-python3}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
if [ ! -x "$WS_DECODE" ]; then
  echo "device-scale: $WS_DECODE not built" | tee "$OUT/scale.txt"
  exit 2
fi
cal=""
if [ -n "${CALIBRATION:-}" ]; then
  if [ ! -r "$CALIBRATION" ]; then
    echo "device-scale: CALIBRATION=$CALIBRATION is not a readable file" | tee "$OUT/scale.txt"
    exit 2
  fi
  cal="--calibration $CALIBRATION"
fi
cfg=$root/examples/moe/configs
kv="--block-tokens 32 --d-window 64 --ping-pong-mib 64 --cpu-task-blocks 16 --no-progress"
long=32736  # with the new tokens past Mixtral's max_position_embeddings 32768: its runs pass --allow-long-context
n=$NEW_TOKENS

# name | kind (ws: ws_decode, hf: hf_peer.py) | optional (1: only with PEER=1 or named in RUNS;
# 2: only named in RUNS) | arguments
declare -a names kinds optional args
add() { names+=("$1"); kinds+=("$2"); optional+=("$3"); args+=("$4"); }
for pol in roofline gpu_only cpu_only; do
  add "qwen3.$pol" ws 0 "--random-weights --config $cfg/qwen3_30b_a3b.json --layers 8 --batch 8 --prompt-len $long --max-new-tokens $n --policy $pol"
done
for pol in roofline gpu_only cpu_only; do
  add "dsv2lite.$pol" ws 0 "--random-weights --config $cfg/deepseek_v2_lite.json --layers 4 --batch 32 --prompt-len $long --max-new-tokens $n --policy $pol"
done
add "mixtral.roofline" ws 0 "--random-weights --config $cfg/mixtral_8x7b.json --layers 4 --batch 4 --prompt-len $long --max-new-tokens $n --policy roofline --allow-long-context"
add "dsv2lite.headroom" ws 2 "--random-weights --config $cfg/deepseek_v2_lite.json --layers 4 --batch 32 --prompt-len $long --max-new-tokens $n --policy roofline --placement-headroom 0.05"
for m in "qwen3:qwen3_30b_a3b.json --layers 8 --batch 8" "dsv2lite:deepseek_v2_lite.json --layers 4 --batch 32" \
         "mixtral:mixtral_8x7b.json --layers 4 --batch 4 --allow-long-context"; do
  add "${m%%:*}.balance" ws 2 "--random-weights --config $cfg/${m#*:} --prompt-len $long --max-new-tokens $n --policy roofline --placement-headroom 0"
done
add "dsv2lite.headroom03" ws 2 "--random-weights --config $cfg/deepseek_v2_lite.json --layers 4 --batch 32 --prompt-len $long --max-new-tokens $n --policy roofline --placement-headroom 0.03"
add "dsv2lite.assist" ws 2 "--random-weights --config $cfg/deepseek_v2_lite.json --layers 4 --batch 32 --prompt-len $long --max-new-tokens $n --policy roofline --cpu-assist adaptive"
for pol in gpu_only cpu_only; do
  add "mixtral.$pol" ws 2 "--random-weights --config $cfg/mixtral_8x7b.json --layers 4 --batch 4 --prompt-len $long --max-new-tokens $n --policy $pol --allow-long-context"
done
add "mixtral.headroom" ws 2 "--random-weights --config $cfg/mixtral_8x7b.json --layers 4 --batch 4 --prompt-len $long --max-new-tokens $n --policy roofline --placement-headroom 0.05 --allow-long-context"
for pol in roofline gpu_only; do
  add "mixtral_full4.$pol" ws 2 "--random-weights --config $cfg/mixtral_8x7b.json --batch 4 --prompt-len $long --max-new-tokens 66 --policy $pol --allow-long-context"
done
add "qwen3_8k.roofline" ws 1 "--random-weights --config $cfg/qwen3_30b_a3b.json --layers 8 --batch 8 --prompt-len 8160 --max-new-tokens $PEER_NEW_TOKENS --policy roofline"
add "hf.qwen3_8k" hf 1 "--config $cfg/qwen3_30b_a3b.json --layers 8 --batch 8 --prompt-len 8160 --new-tokens $PEER_NEW_TOKENS"
# the peer on the other two architectures (only when named in RUNS): DeepSeek-V2-Lite at
# 8 x 8160 (transformers' MLA attention materialises the scores: 32K would not fit), and
# Mixtral at the mixtral.* shape
add "dsv2lite_8k.roofline" ws 2 "--random-weights --config $cfg/deepseek_v2_lite.json --layers 4 --batch 8 --prompt-len 8160 --max-new-tokens $PEER_NEW_TOKENS --policy roofline"
add "hf.dsv2lite_8k" hf 2 "--config $cfg/deepseek_v2_lite.json --layers 4 --batch 8 --prompt-len 8160 --new-tokens $PEER_NEW_TOKENS"
add "mixtral_peer.roofline" ws 2 "--random-weights --config $cfg/mixtral_8x7b.json --layers 4 --batch 4 --prompt-len $long --max-new-tokens $PEER_NEW_TOKENS --policy roofline --allow-long-context"
add "hf.mixtral" hf 2 "--config $cfg/mixtral_8x7b.json --layers 4 --batch 4 --prompt-len $long --new-tokens $PEER_NEW_TOKENS"
add "qwen3_spill.roofline" ws 0 "--random-weights --config $cfg/qwen3_30b_a3b.json --layers 8 --batch 8 --prompt-len 992 --max-new-tokens $n --policy roofline --max-gpu-experts 512"
# Mixtral toward host RAM (only when named in RUNS; about 4 minutes each: prefill of 524K tokens at
# ~3.3K tok/s): all 32 layers at 16 x 32736, 64 GiB of KV in host memory, 34 new tokens
for pol in roofline gpu_only; do
  add "mixtral_ram.$pol" ws 2 "--random-weights --config $cfg/mixtral_8x7b.json --batch 16 --prompt-len $long --max-new-tokens 34 --policy $pol --allow-long-context"
done
for pol in roofline gpu_only cpu_only; do
  add "qwen3_full.$pol" ws 2 "--random-weights --config $cfg/qwen3_30b_a3b.json --batch 8 --prompt-len $long --max-new-tokens $n --policy $pol"
  add "dsv2lite_full.$pol" ws 2 "--random-weights --config $cfg/deepseek_v2_lite.json --batch 32 --prompt-len $long --max-new-tokens $n --policy $pol"
  add "mixtral_full.$pol" ws 2 "--random-weights --config $cfg/mixtral_8x7b.json --batch 8 --prompt-len $long --max-new-tokens $n --policy $pol --allow-long-context"
done

tmp=$(mktemp -d)
t0=$(date +%s)
: >"$OUT/scale.log"
results=()
for i in "${!names[@]}"; do
  name=${names[$i]}
  if [ -n "${RUNS:-}" ]; then
    [[ " $RUNS " == *" $name "* ]] || continue
  elif [ "${optional[$i]}" = 2 ] || { [ "${optional[$i]}" = 1 ] && [ -z "${PEER:-}" ]; }; then
    continue
  fi
  left=$(( SCALE_BUDGET - ($(date +%s) - t0) ))
  if (( left < 25 )); then
    results+=("$name|skipped|0|budget")
    continue
  fi
  s=$(date +%s)
  if [ "${kinds[$i]}" = hf ]; then
    cap=$(( left < HF_CAP ? left : HF_CAP ))
    cmd="$PYTHON $root/examples/moe/tools/hf_peer.py ${args[$i]} --json $tmp/$name.json"
  else
    cap=$(( left < RUN_CAP ? left : RUN_CAP ))
    # --calibration sets roofline costs: ws_decode refuses it under another policy
    # unless an adaptive CPU assist starts from them
    c=$cal
    case "${args[$i]} $EXTRA" in *"--policy roofline"* | *"--cpu-assist adaptive"*) ;; *) c="" ;; esac
    cmd="$WS_DECODE --device cuda ${args[$i]} $kv $c $EXTRA --json $tmp/$name.json"
  fi
  # shellcheck disable=SC2086  # the command string is a word list
  timeout --kill-after=5 "$cap" $cmd >"$tmp/$name.out" 2>&1
  rc=$?
  e=$(( $(date +%s) - s ))
  { echo "===== $name (rc $rc, ${e} s): $cmd"; cat "$tmp/$name.out"; } >>"$OUT/scale.log"
  results+=("$name|$rc|$e|")
  echo "device-scale: $name rc=$rc ${e}s"
done

# One JSON array: {"name", "rc", "seconds", "summary": <ws_decode --json / hf_peer.py JSON or null>} per run.
{
  echo "["
  first=1
  for r in "${results[@]}"; do
    IFS='|' read -r name rc e why <<<"$r"
    [ $first -eq 1 ] || echo ","
    first=0
    printf '{"name": "%s", "rc": "%s", "seconds": %s, "note": "%s", "summary": ' "$name" "$rc" "$e" "$why"
    # hf_peer.py leaves its JSON (with "error") even when it was killed
    if { [ "$rc" = "0" ] || [[ "$name" == hf.* ]]; } && [ -s "$tmp/$name.json" ]; then cat "$tmp/$name.json"; else echo "null"; fi
    echo "}"
  done
  echo "]"
} >"$OUT/scale.json"

# The table (python3 is on the GPU machine's image; without it, scale.json has it all).
if command -v python3 >/dev/null 2>&1; then
  python3 - "$OUT/scale.json" >"$OUT/scale.txt" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
hdr = (f"{'run':22} {'rc':>4} {'s':>4} {'prefill tok/s':>13} {'TPOT P50 ms':>11} {'P99 ms':>8} {'P99/P50':>7} "
       f"{'first ms':>8} {'st P50 ms':>9} {'st P99 ms':>9} {'st P99/P50':>10} {'decode tok/s':>12} {'CPU share':>9} "
       f"{'evict C/G':>9} {'experts GPU/host':>16}")
print(hdr)
def num(s, k, fmt):
    v = s.get(k)
    return format(v, fmt) if isinstance(v, (int, float)) else "-"
for r in runs:
    s = r.get("summary")
    if not s or s.get("error"):
        why = (s or {}).get("error") or r.get("note", "")
        print(f"{r['name']:22} {r['rc']:>4} {r['seconds']:>4} {'-':>13} {why}")
        continue
    ev = s.get("decode_evictions", {})
    ex = s.get("experts", {})
    evs = (str(ev.get('cpu', '-')) + '/' + str(ev.get('gpu', '-'))) if ev else "-"
    exs = (str(ex.get('gpu', '-')) + '/' + str(ex.get('host', '-'))) if ex else "-"
    p50, p99 = s["tpot_p50_ms"], s["tpot_p99_ms"]
    print(f"{r['name']:22} {r['rc']:>4} {r['seconds']:>4} {s['prefill_tok_s']:13.0f} {p50:11.2f} {p99:8.2f} "
          f"{(p99 / p50 if p50 else 0):7.2f} {num(s, 'tpot_first_step_ms', '8.2f'):>8} "
          f"{num(s, 'tpot_steady_p50_ms', '9.2f'):>9} {num(s, 'tpot_steady_p99_ms', '9.2f'):>9} "
          f"{num(s, 'tpot_steady_p99_over_p50', '10.2f'):>10} {s['decode_tok_s']:12.1f} {num(s, 'cpu_share', '9.3f'):>9} "
          f"{evs:>9} {exs:>16}")
print("(first ms: the first decode step; st = steady state, decode steps 2..N; hf.*: transformers generate())")
by = {r["name"]: r.get("summary") for r in runs}
# where the roofline costs came from (ws_decode --json roofline_init)
for name in ("qwen3.roofline", "dsv2lite.roofline", "mixtral.roofline", "qwen3_8k.roofline", "qwen3_full.roofline",
             "dsv2lite_full.roofline", "mixtral_full.roofline", "mixtral_ram.roofline"):
    s = by.get(name)
    ri = (s or {}).get("roofline_init")
    if ri:
        src = (f"{ri['file']} entry {ri['preset']} batch {ri['entry_batch']}" if ri["source"] == "calibration"
               else f"defaults ({ri.get('cpu_bw_gbps')} / {ri.get('h2d_bw_gbps')} GB/s)")
        print(f"{name}: roofline costs from {src}: A {ri['cpu_cost_per_token_seconds'] * 1e9:.1f} ns, "
              f"B {ri['gpu_cost_per_token_seconds'] * 1e9:.1f} ns, "
              f"K {ri.get('launch_cost_per_token_seconds', 0.0) * 1e9:.2f} ns per token, p = {ri['converged_share']:.3f}; "
              f"deployed CPU share {s['cpu_share']:.3f}")
# decode speed-up of roofline over the baselines, per model (all steps; steady state in brackets)
def steady(s):
    return s.get("decode_steady_tok_s") or s["decode_tok_s"]
for m in ("qwen3", "dsv2lite", "mixtral", "qwen3_full", "dsv2lite_full", "mixtral_full", "mixtral_ram"):
    ro, go, co = by.get(m + ".roofline"), by.get(m + ".gpu_only"), by.get(m + ".cpu_only")
    for variant in ("balance", "headroom", "headroom03", "assist"):  # roofline variants beside the same gpu_only run
        v = by.get(m + "." + variant)
        if v and go and go["decode_tok_s"] > 0:
            print(f"{m}.{variant}: decode {v['decode_tok_s']:.1f} tok/s = {v['decode_tok_s'] / go['decode_tok_s']:.2f}x "
                  f"gpu_only, TPOT P99/P50 {v['tpot_p99_over_p50']:.3f}")
    if ro and go and go["decode_tok_s"] > 0:
        line = (f"{m}: roofline decode {ro['decode_tok_s']:.1f} tok/s = {ro['decode_tok_s'] / go['decode_tok_s']:.2f}x "
                f"gpu_only (steady {steady(ro) / steady(go):.2f}x)")
        if co and co["decode_tok_s"] > 0:
            line += f", {ro['decode_tok_s'] / co['decode_tok_s']:.2f}x cpu_only (steady {steady(ro) / steady(co):.2f}x)"
        print(line)
# ws_decode beside transformers at the same shape
for wsn, hfn in (("qwen3_8k.roofline", "hf.qwen3_8k"), ("dsv2lite_8k.roofline", "hf.dsv2lite_8k"),
                 ("mixtral_peer.roofline", "hf.mixtral")):
    ws, hf = by.get(wsn), by.get(hfn)
    if ws and hf and not hf.get("error") and hf.get("decode_tok_s"):
        print(f"{hfn[3:]}: {ws.get('layers')} layers, batch {ws.get('batch')}, {hf.get('new_tokens')} new tokens: "
              f"ws_decode roofline decode {ws['decode_tok_s']:.1f} tok/s, "
              f"prefill {ws['prefill_tok_s']:.0f} tok/s; transformers {hf.get('transformers')} generate() "
              f"({hf.get('cache', {}).get('api')}) decode {hf['decode_tok_s']:.1f} tok/s, prefill {hf['prefill_tok_s']:.0f} tok/s "
              f"-> decode {ws['decode_tok_s'] / hf['decode_tok_s']:.2f}x, prefill {ws['prefill_tok_s'] / hf['prefill_tok_s']:.2f}x")
    elif hf:
        print(f"{hfn}: {hf.get('error', 'no decode figure')}")
PY
else
  echo "python3 not found: see scale.json" >"$OUT/scale.txt"
fi
cat "$OUT/scale.txt"
rm -rf "$tmp"
