#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/moe/tools/device-llamacpp.sh — llama.cpp as the peer of ws_decode on the
# same machine and the SAME weights (issue #18 item 6), in one bounded call:
#   1. build llama-bench and llama-batched-bench with CUDA from a source tarball of
#      upstream llama.cpp (carried in the ignored folder .peers/ as llama.cpp-src.tgz, unpacked
#      and built under build-peers/, which .gitignore's build*/ ignores), and ws_decode
#      (BUILD_DIR, as device-run.sh does), both in the background, while
#   2. the first model's random-weight checkpoint is made (make_peer_checkpoint.py:
#      transformers from_config at reduced depth, bf16, save_pretrained) and converted to
#      GGUF bf16 (gguf_none_vocab.py: llama.cpp's convert_hf_to_gguf.py, "none" vocab);
#   3. per model, on that one checkpoint / its GGUF:
#        ws_decode CKPT --device cuda --batch 1|8 --prompt-len 2048 --max-new-tokens 32
#        llama-bench -m GGUF -ngl 99 -ot ... -fa 1 -p 2048 -n 32 -d 0,2048 -o json   (batch 1)
#          and the same with -nkvo 1 (KV in host memory)
#        llama-batched-bench -m GGUF -ngl 99 -ot ... -fa on -npp 2048 -ntg 32 -npl 8 (batch 8)
#          and the same with -nkvo
#      in two placements of the routed experts:
#        all:  every routed expert in host memory: llama.cpp -ot exps=CPU,
#              ws_decode --max-gpu-experts 0;
#        half: llama.cpp -ot 'blk\.(a|b|..)\.ffn_.*_exps\.=CPU' = the expert tensors of the
#              last floor(M/2) of the M MoE layers; ws_decode --max-gpu-experts
#              (M - floor(M/2)) x E with WS_HALF_PLACEMENT (default layers:
#              --expert-placement layers, whole MoE layers' experts on the GPU, first
#              layers first, so the same layers' experts are on the host on both sides;
#              id: the same NUMBER of experts on the host, the upper ids of every layer).
#              With an odd M (DeepSeek-V2-Lite at 8 layers: 7 MoE layers, layer 0
#              dense) "half" is 3 of 7 layers' experts on both sides;
#   4. the checkpoint and GGUF of a model are deleted before the next (64 GiB disk).
# llama-bench's pp figure is pp2048 at depth 0 and its tg figure tg32 at depth 2048 (-d),
# i.e. decoding after a 2048-token prompt, as ws_decode does; tg32 at depth 0 is in the
# JSON too. ws_decode runs its default KV policy (roofline; EXTRA_WS adds options).
#
# Here (development machine), once per checkout:
#   .deps/usr staged as docs/DECODERS.md ("On the GPU machine") says (CLI11, cudnn-frontend)
#   TGZ_SRC=/path/to/llama.cpp-src.tgz examples/moe/tools/device-llamacpp.sh stage
#                                                  # .peers/llama.cpp-src.tgz + .git/info/exclude
# then on the GPU machine, with .deps and .peers copied along:
#   examples/moe/tools/device-llamacpp.sh
# A warm machine keeps build-peers/ and BUILD_DIR between calls: a second call
# (e.g. MODELS="dsv2lite mixtral") skips the builds.
# CPU smoke test (no GPU; a CPU build of llama.cpp in LLAMA_BIN, built with LLAMA_CUDA=OFF):
#   DEVICE=emulated LLAMA_BIN=... MODELS=qwen3 LAYERS_qwen3=2 PROMPT=64 GEN=8 NPL=2 \
#   SETS_qwen3="hidden_size=128 intermediate_size=256 moe_intermediate_size=64 num_experts=8
#     num_experts_per_tok=2 num_attention_heads=4 num_key_value_heads=2 head_dim=64 vocab_size=512
#     bos_token_id=1 eos_token_id=2" examples/moe/tools/device-llamacpp.sh
#
# Environment: OUT (default ./device-out); BUDGET seconds for the whole call (default 560);
# RUN_CAP seconds for one benchmark run (default 150); BUILD_CAP (default 420) and
# PREP_CAP (checkpoint, conversion: each, default 300); MODELS (default "qwen3 dsv2lite
# mixtral"; a model is started only with MODEL_MIN seconds left, default 150); RUNS
# (space-separated globs of run names MODEL.PLACEMENT.SYSTEM, default '*'; e.g.
# 'qwen3.all.*'); PLACEMENTS (default "all half"); LAYERS_qwen3 (default 4),
# LAYERS_dsv2lite (8), LAYERS_mixtral (4); SETS_<model> (make_peer_checkpoint --set
# overrides, space-separated, for smoke tests); PROMPT (2048), GEN (32), NPL (8), REPS
# (llama-bench -r, default 3); DEVICE (ws_decode --device, default cuda; host for a CPU
# smoke test, which also drops --max-gpu-experts; emulated keeps it); NGL (default 99); LLAMA_CUDA (ON);
# LLAMA_BIN (prebuilt llama.cpp bin folder: no llama.cpp build); WS_DECODE (default
# BUILD_DIR/examples/moe/ws_decode; built when missing); BUILD_DIR (build-device); JOBS
# (nproc); PYTHON (python3); EXTRA_WS, EXTRA_LLAMA (more arguments for every run of each);
# SEED (0); WS_HALF_PLACEMENT (layers or id: ws_decode's --expert-placement in the half
# placement); KEEP=1 keeps the last model's checkpoint and GGUF.
# Output ($OUT): llamacpp.json (one array: every step and run with name, rc, seconds,
# command and the parsed figures), llamacpp.txt (the table), llamacpp.log (the steps),
# llamacpp_logs/NAME.log (each step's output), llamacpp_env.txt.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$root" || exit 2
tools=$root/examples/moe/tools

if [ "${1:-}" = stage ]; then
  src=${TGZ_SRC:-}
  [ -n "$src" ] || { echo "device-llamacpp stage: set TGZ_SRC to a llama.cpp source tarball"; exit 2; }
  [ -r "$src" ] || { echo "device-llamacpp stage: TGZ_SRC=$src not found"; exit 2; }
  mkdir -p "$root/.peers"
  cp "$src" "$root/.peers/llama.cpp-src.tgz"
  ex=$(git rev-parse --git-path info/exclude)
  grep -qx '/.peers/' "$ex" 2>/dev/null || echo '/.peers/' >> "$ex"
  ls -l "$root/.peers"
  exit 0
fi

OUT=${OUT:-$root/device-out}
BUDGET=${BUDGET:-560}
RUN_CAP=${RUN_CAP:-150}
BUILD_CAP=${BUILD_CAP:-420}
PREP_CAP=${PREP_CAP:-300}
MODEL_MIN=${MODEL_MIN:-150}
MODELS=${MODELS:-"qwen3 dsv2lite mixtral"}
RUNS=${RUNS:-"*"}
PLACEMENTS=${PLACEMENTS:-"all half"}
LAYERS_qwen3=${LAYERS_qwen3:-4}
LAYERS_dsv2lite=${LAYERS_dsv2lite:-8}
LAYERS_mixtral=${LAYERS_mixtral:-4}
PROMPT=${PROMPT:-2048}
GEN=${GEN:-32}
NPL=${NPL:-8}
REPS=${REPS:-3}
DEVICE=${DEVICE:-cuda}
NGL=${NGL:-99}
LLAMA_CUDA=${LLAMA_CUDA:-ON}
BUILD_DIR=${BUILD_DIR:-build-device}
WS_DECODE=${WS_DECODE:-$root/$BUILD_DIR/examples/moe/ws_decode}
JOBS=${JOBS:-$(nproc)}
PYTHON=${PYTHON:-python3}
EXTRA_WS=${EXTRA_WS:-}
EXTRA_LLAMA=${EXTRA_LLAMA:-}
SEED=${SEED:-0}
WS_HALF_PLACEMENT=${WS_HALF_PLACEMENT:-layers}
TGZ=${TGZ:-$root/.peers/llama.cpp-src.tgz}
PEERS=${PEERS:-$root/build-peers}
SRC=$PEERS/llama.cpp
LLAMA_BIN=${LLAMA_BIN:-}
WORK=${WORK:-$PEERS/work}
for d in /usr/local/cuda/bin; do
  [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH=$d:$PATH ;; esac
done
export PATH PYTHONUNBUFFERED=1
mkdir -p "$OUT/llamacpp_logs" "$WORK"
REC=$OUT/llamacpp_records.jsonl
: > "$REC"
LOG=$OUT/llamacpp.log
: > "$LOG"
t_start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t_start) )); }
say() { echo "[llamacpp $(( $(date +%s) - t_start ))s] $*" | tee -a "$LOG"; }

{
  date -u; uname -a; grep -m1 'model name' /proc/cpuinfo; nproc; free -g | head -2; df -h "$WORK" | tail -1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  git rev-parse HEAD 2>/dev/null; tar xzOf "$TGZ" llama.cpp/SNAPSHOT 2>/dev/null || echo "no $TGZ"
  $PYTHON -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1
} > "$OUT/llamacpp_env.txt" 2>&1

# record NAME RC SECONDS KIND [RESULT_FILE] [COMMAND...]: one JSON line in $REC
record() {
  local name=$1 rc=$2 secs=$3 kind=$4 file=${5:-}
  shift 5 2>/dev/null || shift $#
  "$PYTHON" - "$name" "$rc" "$secs" "$kind" "$file" "$*" >> "$REC" <<'EOF'
import json, sys
name, rc, secs, kind, path, cmd = sys.argv[1:7]
r = {"name": name, "rc": int(rc), "seconds": int(secs), "kind": kind, "command": cmd}
def load(p):
    txt = open(p, errors="replace").read()
    if kind == "llama_bench":      # -o json: one array
        s = txt.find("[")
        return json.loads(txt[s:]) if s >= 0 else None
    if kind == "llama_batched":    # --output-format jsonl: one object per line
        return [json.loads(l) for l in txt.splitlines() if l.startswith("{")]
    return json.loads(txt)
if path:
    try:
        r["result"] = load(path)
    except Exception as e:
        r["parse_error"] = "%s: %s" % (path, e)
print(json.dumps(r))
EOF
}

# wanted NAME: matches one of RUNS' globs
wanted() {
  local g pats
  read -ra pats <<< "$RUNS"  # no pathname expansion of the globs
  for g in "${pats[@]}"; do
    # shellcheck disable=SC2254
    case "$1" in $g) return 0 ;; esac
  done
  return 1
}

# step NAME CAP KIND RESULT_FILE CMD...: run CMD under min(CAP, budget left) with its output
# in llamacpp_logs/NAME.log (stdout to RESULT_FILE when KIND is llama_*), then record it
step() {
  local name=$1 cap=$2 kind=$3 res=$4
  shift 4
  local l; l=$(left)
  if (( l < 20 )); then
    say "$name: skipped (budget: $l s left)"
    record "$name" 124 0 skipped "" "$@"
    return 124
  fi
  (( cap > l )) && cap=$l
  say "$name (cap ${cap}s): $*"
  local s; s=$(date +%s)
  local rc
  if [[ $kind == llama_* ]]; then
    timeout --kill-after=10 "$cap" "$@" > "$res" 2> "$OUT/llamacpp_logs/$name.log"
  else
    timeout --kill-after=10 "$cap" "$@" > "$OUT/llamacpp_logs/$name.log" 2>&1
  fi
  rc=$?
  local secs=$(( $(date +%s) - s ))
  say "$name: rc $rc, ${secs}s"
  ((rc == 0)) || tail -5 "$OUT/llamacpp_logs/$name.log" | sed 's/^/    /' | tee -a "$LOG"
  [ -s "$res" ] || res=""
  record "$name" "$rc" "$secs" "$kind" "$res" "$@"
  return $rc
}

# ---- builds (background) --------------------------------------------------------------
# the snapshot's source (its converter too) under $PEERS
if [ ! -f "$SRC/convert_hf_to_gguf.py" ] || { [ -z "$LLAMA_BIN" ] && [ ! -x "$PEERS/build/bin/llama-bench" ]; }; then
  [ -r "$TGZ" ] || { say "no $TGZ: run '$0 stage' on a machine with the tarball and copy .peers here"; exit 2; }
  rm -rf "$SRC"
  mkdir -p "$PEERS"
  tar xzf "$TGZ" -C "$PEERS" || { say "tar xzf $TGZ failed"; exit 2; }
fi
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
llama_pid="" ws_pid=""
if [ -z "$LLAMA_BIN" ]; then
  LLAMA_BIN=$PEERS/build/bin
  if [ -x "$LLAMA_BIN/llama-bench" ] && [ -x "$LLAMA_BIN/llama-batched-bench" ]; then
    say "llama.cpp: $LLAMA_BIN already built"
  else
    say "llama.cpp $(cat "$SRC/SNAPSHOT" 2>/dev/null): building (background, -j$JOBS, GGML_CUDA=$LLAMA_CUDA)"
    ( s=$(date +%s)
      timeout --kill-after=10 "$BUILD_CAP" bash -c '
        set -o pipefail
        cmake -S "$0" -B "$1" "${@:2}" -DGGML_CUDA='"$LLAMA_CUDA"' -DCMAKE_CUDA_ARCHITECTURES=90 \
          -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF &&
        cmake --build "$1" -j'"$JOBS"' --target llama-bench llama-batched-bench' "$SRC" "$PEERS/build" "${gen[@]}"
      rc=$?; echo "rc $rc $(( $(date +%s) - s ))" > "$OUT/llamacpp_logs/build_llama.rc"; exit $rc
    ) > "$OUT/llamacpp_logs/build_llama.log" 2>&1 &
    llama_pid=$!
  fi
fi
if [ -x "$WS_DECODE" ]; then
  say "ws_decode: $WS_DECODE already built"
else
  if [ ! -f "$root/.deps/usr/share/cmake/CLI11/CLI11Config.cmake" ]; then
    say ".deps/usr lacks CLI11: stage it with scripts/stage-extra-deps and copy .deps here"
    exit 2
  fi
  say "ws_decode: building $BUILD_DIR (background, -j$JOBS)"
  ( s=$(date +%s)
    timeout --kill-after=10 "$BUILD_CAP" bash -c '
      set -o pipefail
      cudnn=$(python3 -c "import nvidia.cudnn as m; print(m.__path__[0])" 2>/dev/null)  # cuDNN prefill attention
      cmake -S . -B "$0" "${@}" -DCMAKE_PREFIX_PATH="$PWD/.deps/usr${cudnn:+;$cudnn}" -DWRITESCOPE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_BUILD_TYPE=Release -DWRITESCOPE_BUILD_BENCH=OFF &&
      cmake --build "$0" -j'"$JOBS"' --target ws_decode' "$BUILD_DIR" "${gen[@]}"
    rc=$?; echo "rc $rc $(( $(date +%s) - s ))" > "$OUT/llamacpp_logs/build_ws.rc"; exit $rc
  ) > "$OUT/llamacpp_logs/build_ws.log" 2>&1 &
  ws_pid=$!
fi

wait_builds() {
  local ok=0 p f
  for p in llama ws; do
    local pid; [ $p = llama ] && pid=$llama_pid || pid=$ws_pid
    [ -n "$pid" ] || continue
    wait "$pid"
    f=$OUT/llamacpp_logs/build_$p.rc
    local rc secs
    read -r _ rc secs < "$f" 2>/dev/null || { rc=1; secs=0; }
    say "build $p: rc $rc, ${secs}s"
    ((rc == 0)) || { tail -20 "$OUT/llamacpp_logs/build_$p.log" | tee -a "$LOG"; ok=1; }
    record "build.$p" "$rc" "$secs" build "" "see llamacpp_logs/build_$p.log"
  done
  llama_pid="" ws_pid=""
  [ -x "$LLAMA_BIN/llama-bench" ] || { say "no $LLAMA_BIN/llama-bench"; ok=1; }
  [ -x "$WS_DECODE" ] || { say "no $WS_DECODE"; ok=1; }
  return $ok
}

# ---- per model ------------------------------------------------------------------------
# prep MODEL: checkpoint + GGUF in $WORK/MODEL; sets CKPT GGUF META
prep() {
  local m=$1 layers_var=LAYERS_$1 sets_var=SETS_$1
  local layers=${!layers_var:-4} sets=() kv
  for kv in ${!sets_var:-}; do sets+=(--set "$kv"); done
  rm -rf "${WORK:?}/$m"
  mkdir -p "$WORK/$m"
  CKPT=$WORK/$m/ckpt GGUF=$WORK/$m/model.gguf META=$OUT/llamacpp_logs/$m.checkpoint.json
  step "$m.checkpoint" "$PREP_CAP" checkpoint "$META" \
    "$PYTHON" "$tools/make_peer_checkpoint.py" --model "$m" --layers "$layers" --seed "$SEED" \
    --out "$CKPT" --meta "$META" "${sets[@]}" || return 1
  step "$m.gguf" "$PREP_CAP" convert "" \
    "$PYTHON" "$tools/gguf_none_vocab.py" --llama-cpp "$SRC" "$CKPT" --outtype bf16 --outfile "$GGUF" || return 1
  say "$m: checkpoint $(du -sh "$CKPT" | cut -f1), GGUF $(du -sh "$GGUF" | cut -f1)"
}

bench_model() {
  local m=$1
  local E n hl host_layers gpu_half
  read -r n E host_layers < <("$PYTHON" - "$META" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
L = m["moe_layers"]; hl = len(L) // 2
print(len(L), m["num_experts"], "|".join(str(l) for l in L[len(L) - hl:]))
EOF
)
  hl=$(( n / 2 ))
  gpu_half=$(( (n - hl) * E ))
  local pl ot gpu_arg ws_dev=(--device "$DEVICE")
  for pl in $PLACEMENTS; do
    if [ "$pl" = all ]; then
      ot='exps=CPU'; gpu_arg=(--max-gpu-experts 0)
    else
      (( hl > 0 )) || { say "$m: $n MoE layers, no half placement"; continue; }
      ot="blk\\.(${host_layers})\\.ffn_.*_exps\\.=CPU"
      gpu_arg=(--max-gpu-experts "$gpu_half" --expert-placement "$WS_HALF_PLACEMENT")
    fi
    [ "$DEVICE" = host ] && gpu_arg=()
    say "$m.$pl: llama.cpp -ot '$ot'; ws_decode ${gpu_arg[*]:-(host path)} ($n MoE layers x $E experts)"
    local b
    for b in 1 "$NPL"; do
      wanted "$m.$pl.ws_b$b" &&
        step "$m.$pl.ws_b$b" "$RUN_CAP" ws_decode "$OUT/llamacpp_logs/$m.$pl.ws_b$b.json" \
          "$WS_DECODE" "$CKPT" "${ws_dev[@]}" "${gpu_arg[@]}" --batch "$b" --prompt-len "$PROMPT" \
          --max-new-tokens "$GEN" --seed "$SEED" --no-progress --json "$OUT/llamacpp_logs/$m.$pl.ws_b$b.json" $EXTRA_WS
      if [ "$b" = 1 ]; then
        local nk
        for nk in 0 1; do
          local nm=$m.$pl.llama_bench; ((nk)) && nm=$nm.nkvo
          wanted "$nm" &&
            step "$nm" "$RUN_CAP" llama_bench "$OUT/llamacpp_logs/$nm.out" \
              "$LLAMA_BIN/llama-bench" -m "$GGUF" -ngl "$NGL" -ot "$ot" -fa 1 -nkvo "$nk" \
              -p "$PROMPT" -n "$GEN" -d "0,$PROMPT" -r "$REPS" -o json $EXTRA_LLAMA
        done
      else
        local nk
        for nk in 0 1; do
          local nm=$m.$pl.llama_batched nkvo=(); ((nk)) && { nm=$nm.nkvo; nkvo=(-nkvo); }
          wanted "$nm" &&
            step "$nm" "$RUN_CAP" llama_batched "$OUT/llamacpp_logs/$nm.out" \
              "$LLAMA_BIN/llama-batched-bench" -m "$GGUF" -ngl "$NGL" -ot "$ot" -fa on "${nkvo[@]}" \
              -c $(( b * (PROMPT + GEN) + 256 )) -b 2048 -ub 512 -npp "$PROMPT" -ntg "$GEN" -npl "$b" \
              --output-format jsonl $EXTRA_LLAMA
        done
      fi
    done
  done
}

first=1
builds_ok=1
for m in $MODELS; do
  case $m in qwen3|dsv2lite|mixtral) ;; *) say "unknown model $m"; continue ;; esac
  l=$(left)
  if (( l < MODEL_MIN )) && [ -z "$llama_pid$ws_pid" ]; then
    say "$m: skipped ($l s left < MODEL_MIN $MODEL_MIN)"
    record "$m" 124 0 skipped "" "budget"
    continue
  fi
  prep "$m"
  prep_rc=$?
  if ((first)); then
    wait_builds || builds_ok=0
    first=0
  fi
  ((builds_ok)) || { say "builds failed: no runs"; break; }
  ((prep_rc == 0)) && bench_model "$m"
  [ "${KEEP:-0}" = 1 ] || rm -rf "${WORK:?}/$m"
done
((first)) && { wait_builds || builds_ok=0; }

# ---- JSON + table ---------------------------------------------------------------------
"$PYTHON" - "$REC" "$OUT/llamacpp.json" "$OUT/llamacpp.txt" "$PROMPT" "$GEN" "$NPL" <<'EOF'
import json, sys
rec, out_json, out_txt, P, G, NPL = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
runs = [json.loads(l) for l in open(rec) if l.strip()]
json.dump(runs, open(out_json, "w"), indent=1)
by = {r["name"]: r for r in runs}

def ws(name):
    r = by.get(name, {}).get("result")
    return (r.get("prefill_tok_s"), r.get("decode_tok_s")) if isinstance(r, dict) else (None, None)

def lb(name):  # pp at depth 0, tg at depth P
    r = by.get(name, {}).get("result")
    pp = tg = None
    for t in r or []:
        if t.get("n_prompt") == P and t.get("n_gen") == 0 and t.get("n_depth", 0) == 0: pp = t.get("avg_ts")
        if t.get("n_gen") == G and t.get("n_prompt") == 0 and t.get("n_depth", 0) == P: tg = t.get("avg_ts")
    return pp, tg

def bb(name):
    r = by.get(name, {}).get("result")
    for t in r or []:
        return t.get("speed_pp"), t.get("speed_tg")
    return None, None

f = lambda x: "%9.1f" % x if isinstance(x, (int, float)) else "%9s" % "-"
q = lambda a, b: "%6.2fx" % (a / b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else "%7s" % "-"
lines = ["llama.cpp peer vs ws_decode: same checkpoint, prompt %d, %d generated; tok/s (batch x tokens / s)" % (P, G),
         "pp: ws_decode prefill_tok_s vs llama pp%d (depth 0) / batched speed_pp; tg: ws_decode decode_tok_s vs llama tg%d at depth %d / batched speed_tg" % (P, G, P),
         "%-14s %5s %9s %9s %9s %7s %7s | %9s %9s %9s %7s %7s" % ("model.place", "batch", "ws pp", "llama pp", "nkvo pp", "ws/ll", "ws/nkvo",
                                                         "ws tg", "llama tg", "nkvo tg", "ws/ll", "ws/nkvo")]
models = []
for r in runs:
    mp = ".".join(r["name"].split(".")[:2])
    if r["name"].count(".") >= 2 and mp not in models: models.append(mp)
for mp in models:
    for b in (1, NPL):
        wpp, wtg = ws("%s.ws_b%d" % (mp, b))
        if b == 1:
            lpp, ltg = lb(mp + ".llama_bench"); npp, ntg = lb(mp + ".llama_bench.nkvo")
        else:
            lpp, ltg = bb(mp + ".llama_batched"); npp, ntg = bb(mp + ".llama_batched.nkvo")
        if all(v is None for v in (wpp, wtg, lpp, ltg, npp, ntg)): continue
        lines.append("%-14s %5d %s %s %s %s %s | %s %s %s %s %s" % (mp, b, f(wpp), f(lpp), f(npp), q(wpp, lpp), q(wpp, npp),
                                                               f(wtg), f(ltg), f(ntg), q(wtg, ltg), q(wtg, ntg)))
lines.append("")
for r in runs:
    if r["rc"] != 0 or r["kind"] in ("checkpoint", "build"):
        extra = ""
        if r["kind"] == "checkpoint" and isinstance(r.get("result"), dict):
            m = r["result"]; extra = " %.2f GiB, %d MoE layers x %d experts" % (m["bytes"] / 2**30, len(m["moe_layers"]), m["num_experts"])
        lines.append("%-34s rc %3d %5d s%s" % (r["name"], r["rc"], r["seconds"], extra))
open(out_txt, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say "done: $OUT/llamacpp.json $OUT/llamacpp.txt"
bad=$("$PYTHON" -c 'import json,sys; print(sum(1 for r in json.load(open(sys.argv[1])) if r["rc"] != 0))' "$OUT/llamacpp.json" 2>/dev/null || echo 1)
[ "$bad" = 0 ]
