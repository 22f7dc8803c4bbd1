#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""prefill_bounds.py: a prefill's time split against its lower bound.

Reads ws_decode --json summaries (one summary, or device-prefill.sh's prefill.json
array of {name, rc, summary}) and rates measured on the same machine, and prints,
per run, each phase's measured time beside its lower bound:

  attention + projections  attention FLOPs / --attention-tflops
                           + projection FLOPs / --gemm-tflops
  MoE on the device        (router + shared/dense MLP + the routed expert FLOPs of
                           the rows the device-resident experts got) / --gemm-tflops
  streamed experts         max(streamed bytes / --h2d-gbps,
                               the host experts' routed FLOPs / --gemm-tflops);
                           where they run inside the batched GEMMs
                           (expert_streaming.batched_passes > 0) their FLOPs
                           join the MoE row and this row is the H2D alone
  KV write-out             KV bytes placed in host memory / --d2h-gbps (it overlaps
                           the compute: the bound of a phase off the critical path)
  whole prefill            max(the compute bounds above summed, streamed bytes / H2D)

FLOPs come from the summary's "prefill_work" (ws_moe/prefill_work.hpp: useful work,
no padding), times from "prefill_phases_seconds" (device time between events) and
"prefill_seconds". Rates: --gemm-tflops (a dense bf16 GEMM of the experts' shape:
the "dense" row of ws_moe_bench_expert_gemm, or --expert-gemm-json to read it),
--attention-tflops (the prefill attention's rate at the shape: the cuDNN rows of
ws_moe_bench_flash_prefill), --h2d-gbps and --d2h-gbps (page-locked copies).

  prefill_bounds.py prefill.json --gemm-tflops 700 --attention-tflops 550 \\
      --h2d-gbps 54 --d2h-gbps 54 [--json out.json]

Exit status 0; 2 for unreadable input.
"""
import argparse
import json
import sys


def dense_rate(path, model):
    """The "dense" row's TFLOP/s of ws_moe_bench_expert_gemm's JSON for model
    (the largest token count), else its ceiling."""
    doc = json.load(open(path))
    rows = [r for r in doc.get("rows", []) if r.get("impl") == "dense" and (model is None or r.get("model") == model)]
    if rows:
        best = max(rows, key=lambda r: r.get("rows", 0))
        if "tflops" in best:
            return float(best["tflops"])
        return float(best["flops"]) / float(best["gpu_seconds"]) / 1e12
    return float(doc["ceiling"]["tflops"])


def summaries(doc):
    """(name, summary) pairs of a ws_decode summary or a device-prefill array."""
    if isinstance(doc, dict):
        return [("run", doc)]
    out = []
    for r in doc:
        s = r.get("summary") if isinstance(r, dict) else None
        if isinstance(s, dict) and "prefill_work" in s:
            out.append((r.get("name", "run"), s))
    return out


def bounds(s, gemm_tflops, attention_tflops, h2d_gbps, d2h_gbps):
    """Rows (phase, measured s or None, bound s, what bounds it) of one summary."""
    w = s["prefill_work"]
    ph = s.get("prefill_phases_seconds", {})
    gemm = gemm_tflops * 1e12
    att = attention_tflops * 1e12
    pl = s.get("placement", {})
    routed_rows = pl.get("prefill_routed_rows", 0) or w["routed_rows"]
    device_rows = pl.get("prefill_device_rows", routed_rows)
    device_share = device_rows / routed_rows if routed_rows else 1.0
    streamed_bytes = s.get("expert_streaming", {}).get("bytes", 0)
    layers = s.get("layers", 0)
    placed = sum(q.get("placed_tokens", 0) for q in s.get("sequences", []))
    kv_host_bytes = placed * layers * w.get("token_bytes_per_layer", 0)

    attention_b = w["attention_flops"] / att + w["projection_flops"] / gemm
    moe_dev_b = (w["router_flops"] + w["shared_dense_flops"] + device_share * w["routed_expert_flops"]) / gemm
    host_flops = (1.0 - device_share) * w["routed_expert_flops"]
    streamed_b = max(streamed_bytes / (h2d_gbps * 1e9), host_flops / gemm) if streamed_bytes else 0.0
    kv_b = kv_host_bytes / (d2h_gbps * 1e9)
    head_b = w["lm_head_flops"] / gemm
    total_b = max(attention_b + moe_dev_b + (host_flops / gemm if streamed_bytes else 0.0) + head_b,
                  streamed_bytes / (h2d_gbps * 1e9))
    moe_measured = ph.get("moe")
    streamed_measured = ph.get("moe_streamed_experts")
    # streamed experts run inside the layers' batched GEMMs: their products are
    # in the MoE row (its bound gets their FLOPs), the streamed row is the H2D
    inside = streamed_bytes > 0 and s.get("expert_streaming", {}).get("batched_passes", 0) > 0
    moe_flops = w["router_flops"] + w["shared_dense_flops"] + device_share * w["routed_expert_flops"]
    if inside:
        moe_flops += host_flops
        moe_dev_b += host_flops / gemm
        streamed_b = streamed_bytes / (h2d_gbps * 1e9)
        streamed_measured = None
    elif moe_measured is not None and streamed_measured is not None:
        moe_measured -= streamed_measured
    return [
        ("attention + projections", ph.get("attention"), attention_b,
         "%.3g + %.3g TFLOP" % (w["attention_flops"] / 1e12, w["projection_flops"] / 1e12)),
        ("MoE on the device", moe_measured, moe_dev_b,
         "%.3g TFLOP (%.0f%% of the routed rows%s)" % (
             moe_flops / 1e12, 100 * (1.0 if inside else device_share),
             ": the streamed experts' in the batched GEMMs" if inside else "")),
        ("streamed experts", streamed_measured, streamed_b,
         ("%.3g GB H2D (overlapped; their GEMMs in the MoE row)" % (streamed_bytes / 1e9)) if inside else
         "%.3g GB H2D, %.3g TFLOP" % (streamed_bytes / 1e9, host_flops / 1e12)),
        ("KV write-out (host, overlapped)", ph.get("kv_write_host"), kv_b, "%.3g GB D2H" % (kv_host_bytes / 1e9)),
        ("whole prefill", s.get("prefill_seconds"), total_b, "%.3g TFLOP" % (w["total_flops"] / 1e12)),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary", help="ws_decode --json output or device-prefill.sh's prefill.json")
    ap.add_argument("--gemm-tflops", type=float, help="dense bf16 GEMM rate of the experts' shape")
    ap.add_argument("--expert-gemm-json", help="ws_moe_bench_expert_gemm --json output (its dense row)")
    ap.add_argument("--model", help="with --expert-gemm-json: the bench's model row (qwen3, dsv2, ...)")
    ap.add_argument("--attention-tflops", type=float, required=True)
    ap.add_argument("--h2d-gbps", type=float, required=True)
    ap.add_argument("--d2h-gbps", type=float, required=True)
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args(argv)
    for name, v in (("--attention-tflops", a.attention_tflops), ("--h2d-gbps", a.h2d_gbps), ("--d2h-gbps", a.d2h_gbps)):
        if not v > 0:
            ap.error("%s must be > 0 (got %s)" % (name, v))
    if a.gemm_tflops is None and a.expert_gemm_json is None:
        ap.error("give --gemm-tflops or --expert-gemm-json")
    try:
        doc = json.load(open(a.summary))
        gemm = a.gemm_tflops if a.gemm_tflops is not None else dense_rate(a.expert_gemm_json, a.model)
    except (OSError, ValueError, KeyError) as e:
        print("prefill_bounds: %s" % e, file=sys.stderr)
        return 2
    if not gemm > 0:
        ap.error("the GEMM rate must be > 0 (got %s)" % gemm)
    runs = summaries(doc)
    if not runs:
        print("prefill_bounds: %s holds no summary with prefill_work" % a.summary, file=sys.stderr)
        return 2
    out = []
    print("rates: GEMM %.1f TFLOP/s, attention %.1f TFLOP/s, H2D %.1f GB/s, D2H %.1f GB/s"
          % (gemm, a.attention_tflops, a.h2d_gbps, a.d2h_gbps))
    for name, s in runs:
        rows = bounds(s, gemm, a.attention_tflops, a.h2d_gbps, a.d2h_gbps)
        print("\n%s" % name)
        print("%-34s %10s %10s %8s  %s" % ("phase", "measured s", "bound s", "x bound", "work"))
        for phase, measured, bound, what in rows:
            ratio = measured / bound if measured is not None and bound > 0 else None
            print("%-34s %10s %10.4f %8s  %s" % (phase, "-" if measured is None else "%.4f" % measured, bound,
                                                 "-" if ratio is None else "%.2f" % ratio, what))
        out.append({"name": name, "rows": [{"phase": p, "measured_seconds": m, "bound_seconds": b, "work": w}
                                           for p, m, b, w in rows]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rates": {"gemm_tflops": gemm, "attention_tflops": a.attention_tflops,
                                 "h2d_gbps": a.h2d_gbps, "d2h_gbps": a.d2h_gbps}, "runs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
