#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# python/bench/device-bench.sh — issue #20's generate() benchmark on a GPU machine in one bounded
# call: python/bench/bench_generate.py per shape (random weights from the HF configs in
# examples/moe/configs, nothing downloaded), each shape in its own process under `timeout`, the
# whole list under a budget; a JSON and a log per shape and one combined table in $OUT.
#
# Needs: python3 with torch 2.11 + transformers 5.17 and the writescope extension installed (as
# scripts/run-python-tests leaves it, e.g. earlier in the same call), a CUDA device. From the
# repository root:
#
#   OUT=/some/dir python/bench/device-bench.sh
#
# Environment:
#   SHAPES        space-separated model:layers:batch:context (model: qwen3, mixtral, dsv2lite, or
#                 the path of an HF config .json); default: the four below
#   NEW_TOKENS    decode tokens per row (default 32: 31 timed decode steps)
#   SHAPE_TIMEOUT_S  the most seconds one shape may take (default 150)
#   BUDGET_S      the most seconds all shapes together may take (default 330); a shape that
#                 would start with less than 45 s left is skipped, the last one gets what is left
#   PYTHON        the interpreter (default python3)
#   BENCH_ARGS    extra arguments for every bench_generate.py run (e.g. "--policies roofline,0.5")
#
# Expected run times on one H200 (estimates from the sizes; each shape runs writescope:roofline,
# DynamicCache(offloading=True) and DynamicCache, each after an untimed 512-token warm-up):
#   shape                     weights (bf16)   KV (bf16)  estimate
#   qwen3:8:4:32768           10.9 GB          2.1 GB     ~45 s   (3 prefills of 4 x 32K, ~2-4 s each;
#                                                                  offloaded decode ~0.1-0.2 s/step)
#   qwen3:8:8:32768           10.9 GB          4.3 GB     ~75 s   (prefills ~4-8 s each; offloaded
#                                                                  decode ~0.2-0.4 s/step)
#   dsv2lite:4:4:32768         3.5 GB          0.6 GB     ~35 s   (MLA latent cache; prefill expands K/V)
#   mixtral:4:4:32736         11.8 GB          2.1 GB     ~45 s   (max_position_embeddings 32768, so
#                                                                  32768 - NEW_TOKENS prompt tokens)
# plus ~15 s per shape for python/torch start-up and the random init on the device: about 4 minutes
# in all, at most BUDGET_S + 15 s. Optional shapes: qwen3:48:4:32768 (full depth, 61 GB of weights,
# KV 12.9 GB: ~3 min), dsv2lite:27:4:32768, mixtral:32:4:32736 (90 GB of weights; DynamicCache fits).
#
# Output in $OUT: bench-<shape>.json (bench_generate.py's JSON: every run, the ratios of the
# targets), bench-<shape>.log, bench-table.txt (the combined table, printed last). Exit status 0
# when every shape finished, 1 otherwise (the table shows what finished).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-$root/build/device-bench}
py=${PYTHON:-python3}
new_tokens=${NEW_TOKENS:-32}
shape_timeout_s=${SHAPE_TIMEOUT_S:-150}
budget_s=${BUDGET_S:-330}
shapes=${SHAPES:-"qwen3:8:4:32768 qwen3:8:8:32768 dsv2lite:4:4:32768 mixtral:4:4:32736"}
mkdir -p "$out"

config_of() {
  case "$1" in
    qwen3) echo "$root/examples/moe/configs/qwen3_30b_a3b.json" ;;
    mixtral) echo "$root/examples/moe/configs/mixtral_8x7b.json" ;;
    dsv2lite) echo "$root/examples/moe/configs/deepseek_v2_lite.json" ;;
    *.json) [ -f "$1" ] && echo "$1" ;;  # any HF config.json (a tiny one tries the script on a CPU)
    *) return 1 ;;
  esac
}

start=$(date +%s)
status=0
jsons=()
echo "[device-bench] shapes: $shapes; $new_tokens new tokens; budget ${budget_s} s, ${shape_timeout_s} s per shape; out $out"
for shape in $shapes; do
  IFS=: read -r model layers batch context <<<"$shape"
  tag="$(basename "$model" .json)-${layers}L-${batch}x${context}"
  if ! config=$(config_of "$model") || [ -z "${context:-}" ]; then
    echo "[device-bench] $shape: not model:layers:batch:context with model in qwen3, mixtral, dsv2lite or a config .json" >&2
    status=1
    continue
  fi
  left=$((budget_s - ($(date +%s) - start)))
  if [ "$left" -lt 45 ]; then
    echo "[device-bench] $tag: skipped, ${left} s of the budget left"
    status=1
    continue
  fi
  limit=$((left < shape_timeout_s ? left : shape_timeout_s))
  t0=$(date +%s)
  # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
  timeout -k 10 "$limit" "$py" "$root/python/bench/bench_generate.py" --config "$config" --random-weights \
    --layers "$layers" --batch "$batch" --context "$context" --new-tokens "$new_tokens" \
    --json "$out/bench-$tag.json" ${BENCH_ARGS:-} >"$out/bench-$tag.log" 2>&1
  rc=$?
  echo "[device-bench] $tag: exit $rc after $(($(date +%s) - t0)) s (limit $limit s)"
  if [ "$rc" -ne 0 ]; then
    status=1
    tail -5 "$out/bench-$tag.log" | sed 's/^/    /'
  fi
  [ -f "$out/bench-$tag.json" ] && jsons+=("$out/bench-$tag.json")
done
echo "[device-bench] all shapes in $(($(date +%s) - start)) s"
echo
if [ "${#jsons[@]}" -gt 0 ]; then
  "$py" "$root/python/bench/bench_generate.py" --summarize "${jsons[@]}" >"$out/bench-table.txt" 2>&1 || status=1
else
  echo "no shape wrote a result" >"$out/bench-table.txt"
fi
echo "decode x off: decode tok/s over DynamicCache(offloading=True)'s (target >= 2.5); attn x off: the"
echo "offloaded cache's attention ms per decode step over writescope's (>= 4); prefill x dyn: prefill"
echo "tok/s over DynamicCache's (>= 0.95); py overhead %: Python outside the ops, share of a decode step (<= 5)"
cat "$out/bench-table.txt"
exit "$status"
