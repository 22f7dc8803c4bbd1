#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The peer of ws_moe_bench_expert_gemm: PyTorch's grouped GEMM
(torch._grouped_mm, the kernel transformers' "grouped_mm" experts run) on the
same routed rows.

Reads the JSON that ws_moe_bench_expert_gemm wrote (its rows carry each
case's rows_per_expert), and for every (model, tokens) case times

  grouped_mm   gate, up: X [rows][H] @ W_eᵀ (W [E][I][H]) with offs (the
               experts' cumulative row ends); down: A [rows][I] @ W_eᵀ
               (W [E][H][I]); bf16 in, bf16 out, weights in PyTorch's linear
               layout passed transposed, as transformers calls it
  dense_mm     torch.mm of the same three shapes on one expert's weights

with CUDA events (median of --reps after --warmup). TFLOP/s count the same
useful FLOPs, 6 H I sum(rows). Writes JSON (rows with impl, model, tokens,
gpu_seconds, tflops, fraction_of_dense) and prints a table last.

  ws_moe_bench_expert_gemm --json expert_gemm.json
  python3 examples/moe/tools/bench_grouped_mm_peer.py --bench expert_gemm.json --json grouped_mm_peer.json
"""
import argparse
import json
import statistics
import sys

import torch

from bench_sdpa_peer import time_runs  # CUDA events around each call, same directory


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True, help="ws_moe_bench_expert_gemm's JSON")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.reps < 1 or args.warmup < 0:
        sys.exit("--reps must be >= 1 and --warmup >= 0")
    if not hasattr(torch, "_grouped_mm"):
        sys.exit(f"torch {torch.__version__} has no torch._grouped_mm")
    with open(args.bench) as f:
        bench = json.load(f)
    cases = {}
    for r in bench["rows"]:
        cases.setdefault((r["model"], r["tokens"]), r)
    dev = torch.device("cuda")
    doc = {"benchmark": "expert_gemm_peer", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "flop_count": "6 * hidden * inter * sum(rows_e)", "rows": []}
    lines = []
    for (model, tokens), c in cases.items():
        E, H, I = c["experts"], c["hidden"], c["inter"]
        rows = c["rows_per_expert"]
        n = sum(rows)
        flops = 6.0 * H * I * n
        g = torch.Generator(device=dev).manual_seed(5)
        x = torch.randn(n, H, device=dev, dtype=torch.bfloat16, generator=g)
        a = torch.randn(n, I, device=dev, dtype=torch.bfloat16, generator=g)
        # PyTorch's linear layout [out][in] per expert, passed transposed as transformers does
        w_gate = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16, generator=g).transpose(-2, -1)
        w_up = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16, generator=g).transpose(-2, -1)
        w_down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g).transpose(-2, -1)
        offs = torch.tensor(rows, device=dev, dtype=torch.int64).cumsum(0).to(torch.int32)

        def grouped():
            torch._grouped_mm(x, w_gate, offs=offs)
            torch._grouped_mm(x, w_up, offs=offs)
            torch._grouped_mm(a, w_down, offs=offs)

        def dense():
            torch.mm(x, w_gate[0])
            torch.mm(x, w_up[0])
            torch.mm(a, w_down[0])

        # correctness of one expert's slice against torch.mm
        e = max(range(E), key=lambda i: rows[i])
        lo, hi = int(offs[e - 1]) if e > 0 else 0, int(offs[e])
        ref = torch.mm(x[lo:hi].float(), w_gate[e].float())
        got = torch._grouped_mm(x, w_gate, offs=offs)[lo:hi].float()
        err = float((got - ref).abs().max() / ref.abs().max())
        res = {}
        for name, fn in (("dense_mm", dense), ("grouped_mm", grouped)):
            s = statistics.median(time_runs(fn, args.warmup, args.reps))
            res[name] = s
            tf = flops / s * 1e-12
            row = {"impl": name, "model": model, "tokens": tokens, "rows": n, "gpu_seconds": s, "tflops": tf,
                   "fraction_of_dense": res["dense_mm"] / s if "dense_mm" in res else None}
            if name == "grouped_mm":
                row["check_max_rel_err"] = err
            doc["rows"].append(row)
            lines.append(f"{model:8s} {tokens:6d} {name:11s} {s * 1e3:8.3f} ms  {tf:6.1f} TFLOP/s  "
                         f"{res['dense_mm'] / s:5.2f} of dense" + (f"  check {err:.1e}" if name == "grouped_mm" else ""))
            print(lines[-1], flush=True)
        del x, a, w_gate, w_up, w_down
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    print(f"\ntorch._grouped_mm (bf16 in and out) on {doc['device']}, torch {torch.__version__}")
    for l in lines:
        print(l)
    return 0


if __name__ == "__main__":
    sys.exit(main())
