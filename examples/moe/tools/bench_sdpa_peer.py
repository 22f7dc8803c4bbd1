#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The peer of ws_moe_bench_flash_prefill: PyTorch's
torch.nn.functional.scaled_dot_product_attention (is_causal=True, bf16 in and
out) on the same shapes — Qwen3-30B-A3B (32 query heads over 4 KV heads, d 128),
Mixtral-8x7B (32 over 8, d 128), DeepSeek-V2-Lite's non-absorbed MLA prefill
(16 over 16, dqk 192, dv 128) at 4 x 32768, 8 x 8192 and 32 x 2048 tokens —
one call per shape with the sequences as the batch dimension, tensors in the
decoders' [batch, tokens, heads, d] memory layout (transposed views).

Each case runs with PyTorch's own backend choice ("auto") and with each SDPA
backend forced (flash, efficient, cudnn); a backend that refuses the shape is
recorded with its error. Grouped heads go through enable_gqa=True; where a
backend refuses that, the K/V heads are expanded beforehand (outside the timed
region) and the row says "gqa": "expanded". Timing: CUDA events around each
call, --warmup untimed calls, median and best of --reps. TFLOP/s count the
same causal FLOPs as the C++ benchmark, 2 (dqk + dv) hq sum T (T + 1) / 2. The
ceiling is torch.matmul bf16 8192^3 (bf16 output, as PyTorch does it).

  python3 examples/moe/tools/bench_sdpa_peer.py --json sdpa_peer.json

Writes JSON in the schema of ws_moe_bench_flash_prefill (rows with impl,
model, hq, hkv, dqk, dv, batch, seq_tokens, median_seconds, tflops, ...) and
prints a table last.
"""
import argparse
import json
import math
import sys
import warnings

import torch
import torch.nn.functional as F

MODELS = {"qwen3": (32, 4, 128, 128), "mixtral": (32, 8, 128, 128), "dsv2": (16, 16, 192, 128)}


def time_runs(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3)
    return out


def median(v):
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def backends():
    from torch.nn.attention import SDPBackend
    out = [("auto", None)]
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        if hasattr(SDPBackend, name):
            out.append((name.split("_")[0].lower(), getattr(SDPBackend, name)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="qwen3,mixtral,dsv2")
    ap.add_argument("--shapes", default="4x32768,8x8192,32x2048")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_sdpa_peer: no CUDA device", file=sys.stderr)
        return 1
    from torch.nn.attention import sdpa_kernel
    warnings.filterwarnings("ignore")  # a forced backend that refuses a shape warns before it raises
    dev = torch.device("cuda")
    prop = torch.cuda.get_device_properties(0)
    doc = {"benchmark": "flash_prefill", "peer": "torch.nn.functional.scaled_dot_product_attention",
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": {"name": prop.name, "sm_count": prop.multi_processor_count,
                      "compute_capability": f"{prop.major}.{prop.minor}"},
           "flop_count": "2*(dqk+dv)*hq*sum T(T+1)/2 (causal products only)", "output": "bf16",
           "reps": args.reps, "warmup": args.warmup, "rows": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    s = time_runs(lambda: torch.matmul(a, b), args.warmup, max(args.reps, 5))
    doc["ceiling"] = {"name": f"torch_matmul_bf16_{n}_bf16_out", "m": n, "n": n, "k": n,
                      "median_seconds": median(s), "best_seconds": min(s), "tflops": 2.0 * n ** 3 / median(s) * 1e-12}
    del a, b
    ceiling = doc["ceiling"]["tflops"]
    print(f"device {prop.name}; ceiling torch.matmul bf16 {n}^3: {ceiling:.1f} TFLOP/s", flush=True)
    save()

    for mname in args.models.split(","):
        hq, hkv, dqk, dv = MODELS[mname]
        for shape in args.shapes.split(","):
            batch, T = (int(x) for x in shape.split("x"))
            torch.manual_seed(0)
            # [batch, tokens, heads, d] in memory, viewed as [batch, heads, tokens, d].
            q = torch.randn(batch, T, hq, dqk, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            k = torch.randn(batch, T, hkv, dqk, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            v = torch.randn(batch, T, hkv, dv, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            flops = 2.0 * (dqk + dv) * hq * batch * T * (T + 1) / 2
            scale = 1.0 / math.sqrt(dqk)
            for bname, backend in backends():
                row = {"impl": f"torch_sdpa[{bname}]", "model": mname, "hq": hq, "hkv": hkv, "dqk": dqk, "dv": dv,
                       "batch": batch, "seq_tokens": T, "causal": True, "flops": flops}
                kk, vv, gqa = k, v, "enable_gqa" if hq != hkv else "none"

                def call():
                    if gqa == "enable_gqa":
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=scale)

                def run():
                    if backend is None:
                        return call()
                    with sdpa_kernel([backend]):
                        return call()

                try:
                    try:
                        run()
                    except RuntimeError:
                        if hq == hkv:
                            raise
                        kk = k.repeat_interleave(hq // hkv, dim=1)
                        vv = v.repeat_interleave(hq // hkv, dim=1)
                        gqa = "expanded"
                        run()
                    torch.cuda.synchronize()
                    s = time_runs(run, args.warmup, args.reps)
                    med = median(s)
                    row.update({"gqa": gqa, "median_seconds": med, "best_seconds": min(s),
                                "tflops": flops / med * 1e-12, "fraction_of_ceiling": flops / med * 1e-12 / ceiling})
                    print(f"{mname:8s} {batch:2d}x{T:<6d} {bname:9s} {med * 1e3:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
                          f" ({gqa})", flush=True)
                except RuntimeError as e:
                    row.update({"gqa": gqa, "error": str(e).split("\n")[0][:300]})
                    print(f"{mname:8s} {batch:2d}x{T:<6d} {bname:9s} refused: {row['error'][:120]}", flush=True)
                del kk, vv
                torch.cuda.empty_cache()
                doc["rows"].append(row)
                save()
            del q, k, v
            torch.cuda.empty_cache()

    print(f"\nPyTorch {torch.__version__} SDPA (causal, bf16 in and out) on {prop.name}; "
          f"ceiling torch.matmul bf16 {ceiling:.1f} TFLOP/s")
    print(f"{'model':8s} {'heads':5s} {'d':8s} {'batch':10s} {'backend':22s} {'median ms':>10s} {'TFLOP/s':>9s}")
    for r in doc["rows"]:
        heads, d, bt = f"{r['hq']}/{r['hkv']}", f"{r['dqk']}/{r['dv']}", f"{r['batch']}x{r['seq_tokens']}"
        if "error" in r:
            print(f"{r['model']:8s} {heads:5s} {d:8s} {bt:10s} {r['impl']:22s} {'refused':>10s}")
        else:
            print(f"{r['model']:8s} {heads:5s} {d:8s} {bt:10s} {r['impl']:22s} {r['median_seconds'] * 1e3:10.3f}"
                  f" {r['tflops']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
