#!/usr/bin/env python3
"""bench/plot.py — merges the JSON of one bench-all run, draws its figures and
writes the Markdown tables of docs/BENCHMARKS.md, so that filling the document
is mechanical.

  plot.py merge    --out results.json [--meta meta.json] FILE...
                   one results.json from the tools' JSON files (each names its tool)
  plot.py plots    --results results.json --out-dir DIR
                   fig_throughput.png  policies vs peers vs same-run ceilings, calibration
                   fig_tracking.png    deployed share R(L) vs swept optimum (paper Fig. 12)
                   fig_ablation.png    ablations (Fig. 10) and two-tenant contention (Table 3)
                   fig_micro.png       the §3 microbenchmarks
  plot.py markdown --results results.json   the tables of docs/BENCHMARKS.md (stdout)
  plot.py context  --results context_sweep.json [--png F] [--table F]
                   bench/context-sweep.sh: per-layer step time against tokens per
                   sequence, three policies and the HBM-resident engine (figure, table)
  plot.py summary  --results results.json   the headline targets, one line each (stdout)

Only `plots` needs matplotlib (and numpy); the rest is the standard library.
"""
import argparse
import json
import math
import os
import sys

POLICY_ORDER = ["gpu_only", "cpu_only", "fixed:0.5", "fixed:cal", "roofline"]
PEER_ORDER = ["torch_gpu_stream", "hf_offloaded_cache", "torch_cpu_sdpa"]
ARM_ORDER = ["full", "fixed_share", "per_block_dma", "per_slice_dma", "per_step_alloc", "pageable_source", "monolithic_rebuild"]
ARM_LABEL = {
    "full": "full system",
    "fixed_share": "fixed r (converged)",
    "per_block_dma": "per-block DMA",
    "per_slice_dma": "per-slice (strided) DMA",
    "per_step_alloc": "per-step ping-pong alloc",
    "pageable_source": "unpinned source",
    "monolithic_rebuild": "monolithic rebuild",
}
TARGETS = {
    "ceiling": 0.8,      # roofline step >= 0.8 of the concurrent ceiling at L >= 32K
    "gpu_stream": 1.8,   # >= 1.8x the PyTorch GPU-streaming peer
    "cpu_sdpa": 8.0,     # >= 8x PyTorch CPU SDPA
    "tracking": 1.05,    # deployed share's step within 5% of the best swept share at L >= 8K
}


def load(path):
    with open(path) as f:
        return json.load(f)


def fmt(x, nd=3):
    if x is None:
        return "–"
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return "–"
        return ("%." + str(nd) + "f") % x
    return str(x)


def klen(n):
    return "%dK" % (n // 1024) if n % 1024 == 0 else str(n)


# ---------------------------------------------------------------------------
# merge
# ---------------------------------------------------------------------------

def merge(files, meta):
    res = {"suite": "writescope bench-all", "meta": meta, "ws_bench": {"policies": [], "track": [], "ablate": [], "contend": [], "runs": []},
           "calibrate": None, "calibration": None, "micro": None, "peers": None, "inputs": []}
    for path in files:
        if not os.path.exists(path):
            res["inputs"].append({"path": path, "missing": True})
            continue
        try:
            d = load(path)
        except Exception as e:  # noqa: BLE001 - a truncated file is reported, not fatal
            res["inputs"].append({"path": path, "error": str(e)})
            continue
        tool = d.get("tool") or ("calibration" if d.get("format") == "writescope-calibration" else "unknown")
        res["inputs"].append({"path": path, "tool": tool, "complete": d.get("complete")})
        if tool == "ws_bench":
            for k in ("policies", "track", "ablate", "contend"):
                res["ws_bench"][k].extend(d.get(k, []))
            res["ws_bench"]["runs"].append({k: d.get(k) for k in ("machine", "device", "options", "complete", "elapsed_seconds")})
        elif tool == "calibrate":
            res["calibrate"] = d
        elif tool == "calibration":
            res["calibration"] = d
        elif tool == "micro_bench":
            res["micro"] = d
        elif tool == "peers":
            res["peers"] = d
    return res


# ---------------------------------------------------------------------------
# headline targets
# ---------------------------------------------------------------------------

def policy_rows(res, policy=None):
    rows = res.get("ws_bench", {}).get("policies", [])
    return [r for r in rows if policy is None or r.get("policy") == policy]


def peer_row(res, peer, preset, batch, L):
    for r in (res.get("peers") or {}).get("rows", []):
        if r.get("peer") == peer and r.get("preset") == preset and r.get("batch") == batch and r.get("tokens_per_sequence") == L:
            return r
    return None


def headline(res):
    """[(target, subject, value, threshold, passed, note)]"""
    out = []
    for r in policy_rows(res, "roofline"):
        L, p, b = r["tokens_per_sequence"], r["preset"], r["batch"]
        subj = "%s b%d %s" % (p, b, klen(L))
        if L >= 32768 and r.get("ratio_to_ceiling"):
            v = r["ratio_to_ceiling"]
            out.append(("roofline / concurrent ceiling (L>=32K)", subj, v, TARGETS["ceiling"], v >= TARGETS["ceiling"],
                        "ceiling %.1f GB/s, achieved %.1f GB/s" % (r["ceilings"]["concurrent_total_gbps"], r["kv_gbps"])))
        for peer, key in (("torch_gpu_stream", "gpu_stream"), ("torch_cpu_sdpa", "cpu_sdpa")):
            pr = peer_row(res, peer, p, b, L)
            if pr and r.get("step_ms"):
                v = pr["step_ms"] / r["step_ms"]
                out.append(("speedup vs %s" % peer, subj, v, TARGETS[key], v >= TARGETS[key],
                            "%.3f vs %.3f ms/layer%s" % (pr["step_ms"], r["step_ms"], " (peer extrapolated from L/8)" if pr.get("extrapolated") else "")))
    for t in res.get("ws_bench", {}).get("track", []):
        if t.get("deployed_over_best") is None:
            continue
        L = t["tokens_per_sequence"]
        subj = "%s b%d %s" % (t["preset"], t["batch"], klen(L))
        v = t["deployed_over_best"]
        ok = v <= TARGETS["tracking"] if L >= 8192 else None
        out.append(("deployed / best swept step" + ("" if L >= 8192 else " (L<8K, no target)"), subj, v, TARGETS["tracking"], ok,
                    "R=%.3f, r_opt=%.2f (placed %.3f)" % (t["deployed_share"], t["best_share"], t["best_placed_share"])))
    for c in res.get("ws_bench", {}).get("contend", []):
        subj = "%s %dx%s" % (c["preset"], c["batch"], klen(c["tokens_per_sequence"]))
        v = c.get("adaptive_over_frozen")
        if v is not None:
            out.append(("adaptive / frozen latency under contention", subj, v, 1.0, v < 1.0,
                        "solo %.3f, frozen %.3f, adaptive %.3f ms/layer" % (c["solo_ms"], c["frozen"]["mean_ms"], c["adaptive"]["mean_ms"])))
        for kind in ("cpu", "pcie"):
            nb = c.get("neighbour_" + kind)
            if nb:
                v = nb["adaptive_over_frozen"]
                out.append(("adaptive / frozen latency, %s neighbour" % kind, subj, v, 1.0, v < 1.0,
                            "solo %.3f (r %.3f), frozen %.3f, adaptive %.3f ms/layer (r %.3f)"
                            % (c["solo_ms"], c["solo_share"], nb["frozen_ms"], nb["adaptive_ms"], nb["adaptive_share"])))
    return out


def summary(res):
    lines = []
    for name, subj, v, thr, ok, note in headline(res):
        mark = "n/a " if ok is None else ("PASS" if ok else "MISS")
        cmp_ = "<=" if "deployed" in name or "adaptive" in name else ">="
        if "adaptive" in name:
            cmp_ = "<"
        lines.append("%s  %-46s %-30s %7.3f (target %s %.2f)  %s" % (mark, name, subj, v, cmp_, thr, note))
    if not lines:
        lines.append("no headline rows (did the ws_bench/peers stages run?)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------

def md_table(header, rows):
    s = "| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|\n"
    for r in rows:
        s += "| " + " | ".join(fmt(x) if not isinstance(x, str) else x for x in r) + " |\n"
    return s


def markdown(res):
    m = res.get("meta") or {}
    out = []
    out.append("<!-- generated by bench/plot.py markdown from results.json -->\n")
    out.append("**Run:** %s, commit `%s`, %s; GPU %s; CPU %s.\n" % (
        m.get("date_utc", "?"), m.get("commit", "?"), m.get("host", "?"), m.get("gpu", "?"), m.get("cpu", "?")))
    out.append("**Command:** `%s`\n" % m.get("command", "scripts/bench-all"))

    out.append("\n### Headline targets\n")
    out.append(md_table(["target", "configuration", "value", "threshold", "result", "detail"],
                        [[n, s, v, t, "n/a" if ok is None else ("pass" if ok else "**miss**"), note]
                         for n, s, v, t, ok, note in headline(res)]))

    cal = res.get("calibration")
    if cal:
        out.append("\n### Calibration (bench/calibrate)\n")
        rows = []
        for e in cal.get("entries", []):
            rows.append([e["preset"], e["batch"], e.get("cpu_threads", 0), e["cpu_cost_per_token_seconds"] * 1e9,
                         e["gpu_cost_per_token_seconds"] * 1e9, e["cpu_fixed_seconds"] * 1e6, e["gpu_fixed_seconds"] * 1e6,
                         e["gpu_cost_per_token_seconds"] / (e["cpu_cost_per_token_seconds"] + e["gpu_cost_per_token_seconds"])])
        out.append(md_table(["preset", "batch", "threads", "A ns/token", "B ns/token", "C_CPU µs", "C_GPU µs", "p = B/(A+B)"], rows))

    pol = policy_rows(res)
    if pol:
        out.append("\n### Policies, peers and same-run ceilings (ms per layer; GB/s of spilled KV)\n")
        rows = []
        groups = []
        for r in pol:
            g = (r["preset"], r["batch"], r["tokens_per_sequence"])
            if g not in groups:
                groups.append(g)
        for g in groups:
            rs = {r["policy"]: r for r in pol if (r["preset"], r["batch"], r["tokens_per_sequence"]) == g}
            ce = next(iter(rs.values()))["ceilings"]
            for name in POLICY_ORDER + [k for k in rs if k not in POLICY_ORDER]:
                if name in rs:
                    r = rs[name]
                    rows.append([g[0], g[1], klen(g[2]), name, r["cpu_share"], r["step_ms"], r["kv_gbps"], r.get("ratio_to_ceiling")])
            for peer in PEER_ORDER:
                pr = peer_row(res, peer, *g)
                if pr:
                    rows.append([g[0], g[1], klen(g[2]), peer + (" (extrapolated from L/8)" if pr.get("extrapolated") else ""),
                                 "–", pr["step_ms"], pr["kv_gbps"], "–"])
            rows.append([g[0], g[1], klen(g[2]), "*ceiling: CPU %.1f, H2D %.1f, together %.1f+%.1f GB/s*" % (
                ce["cpu_read_gbps"], ce["h2d_gbps"], ce["concurrent_cpu_read_gbps"], ce["concurrent_h2d_gbps"]), "", "", ce["concurrent_total_gbps"], 1.0])
        out.append(md_table(["preset", "batch", "L", "policy / peer", "CPU share", "ms/layer", "GB/s", "of ceiling"], rows))

    tr = res.get("ws_bench", {}).get("track", [])
    if tr:
        out.append("\n### Share tracking (paper Fig. 12)\n")
        rows = [[t["preset"], t["batch"], klen(t["tokens_per_sequence"]), t.get("initial_share"), t.get("deployed_share"),
                 (t.get("deployed_policy") or {}).get("target_share"), t.get("best_share"), t.get("best_placed_share"),
                 (t.get("deployed") or {}).get("step_ms"), t.get("best_step_ms"), t.get("deployed_over_best")] for t in tr]
        out.append(md_table(["preset", "batch", "L", "R admitted", "R deployed", "r(L) target", "best swept r", "its placed share",
                             "deployed ms", "best ms", "deployed / best"], rows))

    ab = res.get("ws_bench", {}).get("ablate", [])
    if ab:
        out.append("\n### Ablations (paper Fig. 10; normalised throughput = full / arm)\n")
        groups = []
        for r in ab:
            g = (r["preset"], r["batch"], r["tokens_per_sequence"])
            if g not in groups:
                groups.append(g)
        arms = [a for a in ARM_ORDER if any(r["arm"] == a for r in ab)]
        rows = []
        for g in groups:
            rs = {r["arm"]: r for r in ab if (r["preset"], r["batch"], r["tokens_per_sequence"]) == g}
            rows.append([g[0], g[1], klen(g[2])] + [("%.3f (%.2f ms)" % (rs[a]["normalized_throughput"], rs[a]["step_ms"])) if a in rs else "–" for a in arms])
        out.append(md_table(["preset", "batch", "L"] + [ARM_LABEL.get(a, a) for a in arms], rows))

    ct = res.get("ws_bench", {}).get("contend", [])
    if ct:
        out.append("\n### Two tenants at once (paper Table 3; ms per layer)\n")
        rows = [[c["preset"], "%dx%s" % (c["batch"], klen(c["tokens_per_sequence"])), c["tenant_threads"], c["solo_share"],
                 "%.3f / %.3f" % tuple(c["adaptive"]["tenant_share"]), c["solo_ms"], c["frozen"]["mean_ms"], c["adaptive"]["mean_ms"],
                 c["frozen_over_solo"], c["adaptive_over_solo"], c["adaptive_over_frozen"]] for c in ct]
        out.append(md_table(["preset", "request", "threads/tenant", "solo r", "adaptive r", "solo", "fixed r", "adaptive",
                             "fixed/solo", "adaptive/solo", "adaptive/fixed"], rows))
        nrows = []
        for c in ct:
            for kind in ("cpu", "pcie"):
                nb = c.get("neighbour_" + kind)
                if nb:
                    nrows.append([c["preset"], "%dx%s" % (c["batch"], klen(c["tokens_per_sequence"])), kind,
                                  c["solo_share"], nb["adaptive_share"], c["solo_ms"], nb["frozen_ms"], nb["adaptive_ms"],
                                  nb["adaptive_over_frozen"]])
        if nrows:
            out.append("")
            out.append("One tenant beside a neighbour that loads one resource (MoE expert work: CPU-side memory streaming "
                       "on half the tenant's cores, or back-to-back pinned H2D copies):")
            out.append("")
            out.append(md_table(["preset", "request", "neighbour", "solo r", "adaptive r", "solo ms", "frozen ms",
                                 "adaptive ms", "adaptive/frozen"], nrows))

    mi = res.get("micro")
    if mi:
        out.append("\n### §3 microbenchmarks\n")
        tr_rows = [r for r in mi.get("transfer", []) if r.get("kind") == "layer_buffer"]
        if tr_rows:
            out.append("\nPinned vs pageable H2D of one layer's KV (DeepSeek-V2-Lite, batch 16):\n\n")
            out.append(md_table(["L", "MiB", "pinned GB/s", "pageable GB/s", "pinned / pageable"],
                                [[klen(r["tokens_per_sequence"]), r["bytes"] / 2 ** 20, r["pinned_gbps"], r["pageable_gbps"], r["pinned_over_pageable"]] for r in tr_rows]))
        cs = [r for r in mi.get("transfer", []) if r.get("kind") == "copy_size"]
        if cs:
            out.append("\nPinned H2D by copy size:\n\n")
            out.append(md_table(["copy", "GB/s", "µs per copy"], [["%d KiB" % (r["copy_bytes"] // 1024), r["pinned_gbps"], r["us_per_copy"]] for r in cs]))
        st = mi.get("strided", [])
        if st:
            out.append("\nStrided vs contiguous (Qwen3-30B-A3B, batch 16, capacity 32K, 128 segments):\n\n")
            out.append(md_table(["L", "segment KiB", "2-D copy GB/s", "per-segment loop GB/s", "exact contiguous GB/s", "256-B rows (2-D) GB/s"],
                                [[klen(r["tokens_per_sequence"]), r["segment_bytes"] / 1024, r["copy2d_gbps"], r["segment_loop_gbps"], r["exact_gbps"], r["rows256_2d_gbps"]] for r in st]))
        pn = mi.get("pin", [])
        if pn:
            out.append("\nPinning cost (ms per GiB):\n\n")
            out.append(md_table(["size GiB", "cudaHostAlloc", "cudaFreeHost", "cudaHostRegister (touched)", "(untouched)", "unregister", "cuda_host_register allocator"],
                                [[r["bytes"] / 2 ** 30, r["host_alloc_ms_per_gib"], r["free_host_ms_per_gib"], r["register_touched_ms_per_gib"],
                                  r["register_untouched_ms_per_gib"], r["unregister_ms_per_gib"], r["cuda_host_register_allocator_ms_per_gib"]] for r in pn]))
        cr = mi.get("cpu_read", [])
        if cr:
            out.append("\nCPU streaming read, 1 GiB:\n\n")
            out.append(md_table(["threads", "pageable GB/s", "pinned GB/s", "pinned / pageable"],
                                [[r["threads"], r["pageable_gbps"], r["pinned_gbps"], r["pinned_over_pageable"]] for r in cr]))
        rb = mi.get("rebuild", [])
        if rb:
            out.append("\nPer-step monolithic rebuild vs partitioned format (DeepSeek-V2-Lite, batch 16; ms per layer and step):\n\n")
            out.append(md_table(["L", "MiB", "monolithic", "alloc+pin", "splice", "H2D", "free", "partitioned", "ratio"],
                                [[klen(r["tokens_per_sequence"]), r["bytes"] / 2 ** 20, r["monolithic_ms"], r["monolithic"]["alloc_pin_ms"],
                                  r["monolithic"]["splice_ms"], r["monolithic"]["h2d_ms"], r["monolithic"]["release_ms"], r["partitioned_ms"],
                                  r["monolithic_over_partitioned"]] for r in rb]))
    pe = res.get("peers") or {}
    if pe.get("skipped"):
        out.append("\nPeers not run: " + "; ".join("%s (%s)" % (s["what"], s["why"]) for s in pe["skipped"]) + "\n")
    return "".join(out)


# ---------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------

def plots(res, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    made = []
    stamp = "%s  %s  commit %s" % ((res.get("meta") or {}).get("date_utc", ""), (res.get("meta") or {}).get("gpu", ""), (res.get("meta") or {}).get("commit", ""))

    # 1. throughput: policies + peers + ceilings; calibration r(L)
    pol = policy_rows(res)
    cal = res.get("calibration")
    if pol or cal:
        groups = []
        for r in pol:
            g = (r["preset"], r["batch"], r["tokens_per_sequence"])
            if g not in groups:
                groups.append(g)
        n = max(1, len(groups))
        fig, axes = plt.subplots(2, 1, figsize=(max(10, 2.2 * n), 10))
        ax = axes[0]
        names = POLICY_ORDER + PEER_ORDER
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs, ys = [], []
            for gi, g in enumerate(groups):
                if name in PEER_ORDER:
                    pr = peer_row(res, name, *g)
                    v = pr["kv_gbps"] if pr else None
                else:
                    rr = [r for r in pol if (r["preset"], r["batch"], r["tokens_per_sequence"]) == g and r["policy"] == name]
                    v = rr[0]["kv_gbps"] if rr else None
                if v is not None:
                    xs.append(gi + (i - len(names) / 2 + 0.5) * width)
                    ys.append(v)
            if xs:
                ax.bar(xs, ys, width, label=name, hatch="//" if name in PEER_ORDER else None)
        for gi, g in enumerate(groups):
            ce = [r for r in pol if (r["preset"], r["batch"], r["tokens_per_sequence"]) == g][0]["ceilings"]
            ax.hlines(ce["concurrent_total_gbps"], gi - 0.45, gi + 0.45, colors="k", linestyles="-", label="concurrent ceiling" if gi == 0 else None)
            ax.hlines(ce["h2d_gbps"], gi - 0.45, gi + 0.45, colors="tab:blue", linestyles=":", label="H2D alone" if gi == 0 else None)
            ax.hlines(ce["cpu_read_gbps"], gi - 0.45, gi + 0.45, colors="tab:orange", linestyles=":", label="CPU read alone" if gi == 0 else None)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(["%s\nb%d %s" % (g[0], g[1], klen(g[2])) for g in groups])
        ax.set_ylabel("spilled KV GB/s (one layer / step time)")
        ax.set_title("Decode attention: writescope policies vs peers vs same-run ceilings")
        ax.legend(fontsize=7, ncol=4)
        ax = axes[1]
        if cal:
            for e in cal.get("entries", []):
                A, B = e["cpu_cost_per_token_seconds"], e["gpu_cost_per_token_seconds"]
                d = e["gpu_fixed_seconds"] - e["cpu_fixed_seconds"]
                Ls = [2 ** k for k in range(9, 17)]
                rs = [min(1, max(0, B / (A + B) + d / ((A + B) * L * e["batch"]))) for L in Ls]
                ax.plot([L / 1024 for L in Ls], rs, marker="o", label="%s b%d (p=%.2f)" % (e["preset"], e["batch"], B / (A + B)))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per sequence (K)")
            ax.set_ylabel("r(L), eq. 2")
            ax.set_ylim(0, 1)
            ax.set_title("Roofline optimum from the calibration (A, B, Δ)")
            ax.legend(fontsize=7, ncol=2)
        fig.suptitle(stamp, fontsize=8)
        fig.tight_layout()
        p = os.path.join(out_dir, "fig_throughput.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)

    # 2. tracking (Fig. 12)
    tr = res.get("ws_bench", {}).get("track", [])
    if tr:
        presets = []
        for t in tr:
            if t["preset"] not in presets:
                presets.append(t["preset"])
        fig, axes = plt.subplots(2, len(presets), figsize=(5 * len(presets), 8), squeeze=False)
        for j, p in enumerate(presets):
            ts = [t for t in tr if t["preset"] == p]
            ax = axes[0][j]
            Ls = [t["tokens_per_sequence"] / 1024 for t in ts]
            ax.plot(Ls, [t.get("deployed_share") for t in ts], "-o", label="deployed R(L)")
            ax.plot(Ls, [(t.get("deployed_policy") or {}).get("target_share") for t in ts], "--", label="r(L) target (online A, B)")
            ax.plot(Ls, [t.get("best_share") for t in ts], "s", label="measured optimal r (sweep)")
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("L (K tokens per sequence)")
            ax.set_ylabel("CPU share")
            ax.set_title("%s, batch %d" % (p, ts[0]["batch"]))
            ax.legend(fontsize=7)
            ax = axes[1][j]
            for t in ts:
                sw = sorted(t.get("sweep", []), key=lambda s: s["fixed_share"])
                if sw:
                    line, = ax.plot([s["cpu_share"] for s in sw], [s["step_ms"] for s in sw], "-o", ms=3, label="L=%s" % klen(t["tokens_per_sequence"]))
                    ax.plot([t["deployed_share"]], [t["deployed"]["step_ms"]], "*", ms=12, color=line.get_color())
            ax.set_xlabel("placed CPU share (sweep: dots; deployed: star)")
            ax.set_ylabel("ms per layer")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        fig.suptitle("Deployed share vs swept optimum (paper Fig. 12)   " + stamp, fontsize=9)
        fig.tight_layout()
        p = os.path.join(out_dir, "fig_tracking.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)

    # 3. ablations + contention
    ab = res.get("ws_bench", {}).get("ablate", [])
    ct = res.get("ws_bench", {}).get("contend", [])
    if ab or ct:
        fig, axes = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 1]})
        ax = axes[0]
        groups = []
        for r in ab:
            g = (r["preset"], r["batch"], r["tokens_per_sequence"])
            if g not in groups:
                groups.append(g)
        arms = [a for a in ARM_ORDER if any(r["arm"] == a for r in ab)]
        width = 0.8 / max(1, len(arms))
        for i, a in enumerate(arms):
            xs, ys = [], []
            for gi, g in enumerate(groups):
                rr = [r for r in ab if (r["preset"], r["batch"], r["tokens_per_sequence"]) == g and r["arm"] == a]
                if rr:
                    xs.append(gi + (i - len(arms) / 2 + 0.5) * width)
                    ys.append(rr[0]["normalized_throughput"])
            ax.bar(xs, ys, width, label=ARM_LABEL.get(a, a))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(["%s\nb%d %s" % (g[0], g[1], klen(g[2])) for g in groups], fontsize=8)
        ax.set_ylabel("normalised throughput (full = 1)")
        ax.set_title("Ablations (paper Fig. 10)")
        ax.legend(fontsize=7, ncol=2)
        ax = axes[1]
        if ct:
            labels = ["%dx%s" % (c["batch"], klen(c["tokens_per_sequence"])) for c in ct]
            x = range(len(ct))
            ax.bar([i - 0.27 for i in x], [c["solo_ms"] for c in ct], 0.27, label="solo")
            ax.bar([i for i in x], [c["frozen"]["mean_ms"] for c in ct], 0.27, label="fixed r (solo)")
            ax.bar([i + 0.27 for i in x], [c["adaptive"]["mean_ms"] for c in ct], 0.27, label="adaptive")
            ax.set_xticks(list(x))
            ax.set_xticklabels(labels)
            ax.set_ylabel("ms per layer")
            ax.set_title("Two tenants (Table 3), %s" % ct[0]["preset"])
            ax.legend(fontsize=7)
        fig.suptitle(stamp, fontsize=8)
        fig.tight_layout()
        p = os.path.join(out_dir, "fig_ablation.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)

    # 4. micro
    mi = res.get("micro")
    if mi:
        fig, axes = plt.subplots(2, 3, figsize=(16, 9))
        tr_rows = [r for r in mi.get("transfer", []) if r.get("kind") == "layer_buffer"]
        ax = axes[0][0]
        if tr_rows:
            Ls = [klen(r["tokens_per_sequence"]) for r in tr_rows]
            ax.plot(Ls, [r["pinned_gbps"] for r in tr_rows], "-o", label="pinned")
            ax.plot(Ls, [r["pageable_gbps"] for r in tr_rows], "-o", label="pageable")
            ax.set_title("H2D of one layer's KV (DSv2 b16)")
            ax.set_ylabel("GB/s")
            ax.legend()
        ax = axes[0][1]
        cs = [r for r in mi.get("transfer", []) if r.get("kind") == "copy_size"]
        if cs:
            ax.plot([r["copy_bytes"] / 1024 for r in cs], [r["pinned_gbps"] for r in cs], "-o")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("copy size (KiB)")
            ax.set_ylabel("GB/s")
            ax.set_title("Pinned H2D by copy size")
        ax = axes[0][2]
        st = mi.get("strided", [])
        if st:
            Ls = [klen(r["tokens_per_sequence"]) for r in st]
            for k, lab in (("exact_gbps", "exactly allocated"), ("copy2d_gbps", "2-D copy (strided)"),
                           ("segment_loop_gbps", "per-segment loop"), ("rows256_2d_gbps", "256-B rows, 2-D")):
                ax.plot(Ls, [r[k] for r in st], "-o", label=lab)
            ax.set_title("Strided vs contiguous (Qwen3 b16, cap 32K)")
            ax.set_ylabel("GB/s")
            ax.legend(fontsize=7)
        ax = axes[1][0]
        pn = mi.get("pin", [])
        if pn:
            keys = [("host_alloc_ms_per_gib", "cudaHostAlloc"), ("register_touched_ms_per_gib", "register (touched)"),
                    ("register_untouched_ms_per_gib", "register (untouched)"), ("cuda_host_register_allocator_ms_per_gib", "allocator (touch+register)")]
            for i, (k, lab) in enumerate(keys):
                ax.bar([j + (i - 1.5) * 0.2 for j in range(len(pn))], [r[k] for r in pn], 0.2, label=lab)
            ax.set_xticks(range(len(pn)))
            ax.set_xticklabels(["%.2f GiB" % (r["bytes"] / 2 ** 30) for r in pn])
            ax.set_ylabel("ms per GiB")
            ax.set_title("Pinning cost")
            ax.legend(fontsize=7)
        ax = axes[1][1]
        cr = mi.get("cpu_read", [])
        if cr:
            ax.plot([r["threads"] for r in cr], [r["pageable_gbps"] for r in cr], "-o", label="pageable")
            ax.plot([r["threads"] for r in cr], [r["pinned_gbps"] for r in cr], "-o", label="pinned")
            ax.set_xlabel("threads")
            ax.set_ylabel("GB/s")
            ax.set_title("CPU read: pinned vs pageable (1 GiB)")
            ax.legend()
        ax = axes[1][2]
        rb = mi.get("rebuild", [])
        if rb:
            Ls = [r["tokens_per_sequence"] / 1024 for r in rb]
            ax.plot(Ls, [r["monolithic_ms"] for r in rb], "-o", label="monolithic rebuild (total)")
            ax.plot(Ls, [r["monolithic"]["alloc_pin_ms"] for r in rb], ":", label="  alloc + pin")
            ax.plot(Ls, [r["monolithic"]["splice_ms"] for r in rb], ":", label="  splice")
            ax.plot(Ls, [r["partitioned_ms"] for r in rb], "-o", label="partitioned (stream pinned blocks)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("L (K tokens per sequence)")
            ax.set_ylabel("ms per layer and step")
            ax.set_title("Per-step rebuild vs partitioned (DSv2 b16)")
            ax.legend(fontsize=7)
        fig.suptitle("§3 microbenchmarks   " + stamp, fontsize=9)
        fig.tight_layout()
        p = os.path.join(out_dir, "fig_micro.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    return made


# ---------------------------------------------------------------------------
# context sweep (bench/context-sweep.sh): step time against context
# ---------------------------------------------------------------------------

# Per model: decoder layers, parameters (billions; bf16 weights = 2 bytes each),
# KV bytes per token and layer as writescope stores it (bf16; DeepSeek-V2-Lite:
# absorbed MLA, c_kv 512 + k_pe 64). For the "whole cache + weights in HBM" line.
MODEL_FACTS = {
    "Qwen3-30B-A3B": dict(layers=48, params_b=30.5, token_bytes=2048),
    "Mixtral-8x7B": dict(layers=32, params_b=46.7, token_bytes=4096),
    "DeepSeek-V2-Lite": dict(layers=27, params_b=15.7, token_bytes=1152),
}
SWEEP_POLICIES = [("gpu_only", "gpu_only (stream all over PCIe)", "tab:blue", "o"),
                  ("cpu_only", "cpu_only (attend all on the CPU)", "tab:orange", "s"),
                  ("roofline", "roofline (split, LSE merge)", "tab:green", "^")]
RESIDENT = "torch_gpu_resident"


def fmt_bytes(n):
    for unit, f in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= f:
            v = n / f
            return ("%.0f %s" if v >= 10 or v == int(v) else "%.1f %s") % (v, unit)
    return "%d B" % n


def sweep_data(res):
    """The sweep's rows: (preset, batch, {L: {policy|resident: row}}, token_bytes)."""
    m = res.get("meta") or {}
    pol = policy_rows(res)
    peers = [r for r in (res.get("peers") or {}).get("rows", []) if r.get("peer") == RESIDENT]
    first = (pol or peers or [None])[0]
    if first is None:
        return None
    preset = first["preset"]
    batch = (m.get("sweep") or {}).get("batch") or first["batch"]
    by_L = {}
    for r in pol:
        if r["preset"] == preset and r["batch"] == batch:
            by_L.setdefault(r["tokens_per_sequence"], {})[r["policy"]] = r
    for r in peers:
        if r["preset"] == preset and r["batch"] == batch:
            by_L.setdefault(r["tokens_per_sequence"], {})[RESIDENT] = r
    tb = (MODEL_FACTS.get(preset) or {}).get("token_bytes")
    for L, d in by_L.items():
        if RESIDENT in d and d[RESIDENT].get("bytes_per_layer"):
            tb = d[RESIDENT]["bytes_per_layer"] / (batch * L)
    return preset, batch, dict(sorted(by_L.items())), tb


def gpu_memory_bytes(res):
    for run in res.get("ws_bench", {}).get("runs", []):
        g = (run.get("device") or {}).get("gpu_memory_gib")
        if g:
            return g * 2 ** 30
    return ((res.get("peers") or {}).get("device") or {}).get("gpu_memory_bytes") or 0


def hbm_fit_tokens(res, preset, batch, tb):
    """Tokens per sequence beyond which the model's bf16 weights and its whole KV
    cache (every layer, the batch) exceed the GPU's memory (None if unknown)."""
    f, mem = MODEL_FACTS.get(preset), gpu_memory_bytes(res)
    if not f or not mem or not tb:
        return None
    free = mem - f["params_b"] * 1e9 * 2
    return free / (f["layers"] * batch * tb) if free > 0 else 0.0


def sweep_machine(res):
    m = res.get("meta") or {}
    threads = m.get("threads")
    for run in res.get("ws_bench", {}).get("runs", []):
        threads = threads or (run.get("options") or {}).get("threads")
    return m.get("gpu") or "?", m.get("cpu") or "?", threads, (m.get("date_utc") or "?")[:10]


def context_markdown(res):
    d = sweep_data(res)
    if d is None:
        return "no context-sweep rows\n"
    preset, batch, by_L, tb = d
    m = res.get("meta") or {}
    gpu, cpu, threads, date = sweep_machine(res)
    out = ["<!-- generated by bench/plot.py context from context_sweep.json -->\n",
           "**Run:** %s, commit `%s`; GPU %s; CPU %s, %s engine threads. %s, batch %d.\n" % (
               m.get("date_utc", "?"), m.get("commit", "?"), gpu, cpu, threads, preset, batch),
           "**Command:** `%s`\n\n" % m.get("command", "bench/context-sweep.sh"),
           "Milliseconds per layer (median decode step / layers). Host ceiling = spilled KV / (concurrent "
           "CPU read + H2D GB/s, same run). HBM-resident = the whole KV in GPU memory (%s).\n\n" % RESIDENT]
    rows = []
    for L, r in by_L.items():
        g, c, ro, h = (r.get(k) for k in ("gpu_only", "cpu_only", "roofline", RESIDENT))
        ms = lambda x: x["step_ms"] if x else None  # noqa: E731
        ceil = next((x["ceiling_ms"] for x in (ro, g, c) if x and x.get("ceiling_ms")), None)
        ratio = lambda a, b: (a / b) if a and b else None  # noqa: E731
        rows.append([klen(L), fmt_bytes(batch * L * tb) if tb else "?", ms(g), ms(c),
                     ("%.3f (%.2f)" % (ro["step_ms"], ro["cpu_share"])) if ro else "–", ceil,
                     ("%.3f (%s)" % (h["step_ms"], h.get("path", "?"))) if h else "–",
                     ratio(ms(g), ms(ro)), ratio(ms(c), ms(ro)), ratio(ms(ro), ms(h))])
    out.append(md_table(["L", "KV / layer", "gpu_only", "cpu_only", "roofline (CPU share)", "host ceiling",
                         "HBM-resident (path)", "gpu_only / roofline", "cpu_only / roofline", "roofline / HBM-resident"],
                        rows))
    fit = hbm_fit_tokens(res, preset, batch, tb)
    if fit is not None:
        f = MODEL_FACTS[preset]
        out.append("\nAll %d layers' KV at batch %d plus %.1f GB of bf16 weights exceed the GPU's %.1f GiB beyond "
                   "L ≈ %s tokens per sequence (activations and workspace not counted).\n" % (
                       f["layers"], batch, f["params_b"] * 2, gpu_memory_bytes(res) / 2 ** 30,
                       "%.1fK" % (fit / 1024)))
    src = next((r["roofline"]["costs"]["source"] for r in by_L.values() if r.get("roofline", {}).get("costs")), None)
    if src:
        out.append("\nRoofline costs: %s.\n" % src)
    return "".join(out)


def context_plot(res, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    d = sweep_data(res)
    if d is None:
        raise SystemExit("plot.py context: no policies or %s rows in the results" % RESIDENT)
    preset, batch, by_L, tb = d
    m = res.get("meta") or {}
    gpu, cpu, threads, date = sweep_machine(res)
    Ls = list(by_L)
    fig, ax = plt.subplots(figsize=(9, 6.2))
    for key, label, color, marker in SWEEP_POLICIES:
        pts = [(L, by_L[L][key]["step_ms"]) for L in Ls if key in by_L[L]]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, color=color, label=label,
                    lw=2.4 if key == "roofline" else 1.6, ms=6)
        if key == "roofline":
            for L in Ls:
                r = by_L[L].get("roofline")
                if r:
                    ax.annotate("%.2f" % r["cpu_share"], (L, r["step_ms"]), textcoords="offset points", xytext=(0, -13),
                                ha="center", fontsize=7, color=color)
    pts = [(L, next((by_L[L][k]["ceiling_ms"] for k in ("roofline", "gpu_only", "cpu_only")
                     if k in by_L[L] and by_L[L][k].get("ceiling_ms")), None)) for L in Ls]
    pts = [(x, y) for x, y in pts if y]
    if pts:
        ax.plot([x for x, _ in pts], [y for _, y in pts], ls="--", lw=1, color="0.45",
                label="host-memory limit (concurrent CPU read + H2D, same run)")
    pts = [(L, by_L[L][RESIDENT]) for L in Ls if RESIDENT in by_L[L]]
    paths = sorted({r.get("path", "?") for _, r in pts})
    if pts:
        ax.plot([x for x, _ in pts], [r["step_ms"] for _, r in pts], marker="D", color="k", lw=1.6, ms=5,
                label="HBM-only engine (whole KV in GPU memory; PyTorch %s)" % ", ".join(paths))
    fit = hbm_fit_tokens(res, preset, batch, tb)
    if fit is not None and Ls and fit < Ls[-1] * 1.5:
        f = MODEL_FACTS[preset]
        ax.axvline(fit, color="tab:red", ls=":", lw=1.4)
        ax.axvspan(fit, Ls[-1] * 1.5, color="tab:red", alpha=0.06)
        ax.text(fit / 1.04, 0.02, "right of the line: %d layers' KV (batch %d)\n+ %.0f GB bf16 weights > %.0f GiB:\n"
                "the cache does not fit this GPU" % (f["layers"], batch, f["params_b"] * 2, gpu_memory_bytes(res) / 2 ** 30),
                transform=ax.get_xaxis_transform(), va="bottom", ha="right", fontsize=7, color="tab:red")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(Ls[0] / 1.3, Ls[-1] * 1.3)
    ax.set_xticks(Ls)
    ax.set_xticklabels([klen(L) for L in Ls])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("tokens per sequence (batch %d)" % batch)
    ax.set_ylabel("decode attention step per layer (ms, log)")
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", axis="y", alpha=0.1)
    if tb:
        per = batch * tb
        sec = ax.secondary_xaxis("top", functions=(lambda x: x * per, lambda y: y / per))
        sec.set_xticks([L * per for L in Ls])
        sec.set_xticklabels([fmt_bytes(L * per) for L in Ls], fontsize=8)
        sec.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        sec.set_xlabel("KV of one layer, whole batch (%d B per token)" % tb, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("Decode attention per layer against context: %s, batch %d\n%s + %s (%s CPU threads), %s" % (
        preset, batch, gpu, cpu, threads, date), fontsize=10)
    fig.text(0.01, 0.005, "writescope rows: KV in host memory; median decode step (append + attention per layer, flush, "
             "sync) / layers; the numbers under roofline are its CPU share.\nHBM-only engine: the whole KV in GPU memory, no "
             "append, a CUDA graph of the step timed with CUDA events. %s, commit %s." % (
                 m.get("date_utc", "?"), m.get("commit", "?")), fontsize=6.5, color="0.3", va="bottom")
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main():
    # `plot.py --markdown [--results FILE]` (and --plots / --summary / --merge) = the subcommands.
    for flag in ("--markdown", "--plots", "--summary", "--merge"):
        if flag in sys.argv[1:]:
            sys.argv.remove(flag)
            sys.argv.insert(1, flag[2:])
            if flag != "--merge" and "--results" not in sys.argv:
                sys.argv += ["--results", "results.json"]
            break
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("--out", required=True)
    m.add_argument("--meta", default="")
    m.add_argument("files", nargs="*")
    c = sub.add_parser("context")
    c.add_argument("--results", required=True)
    c.add_argument("--png", default="")
    c.add_argument("--table", default="", help="the Markdown table (default: stdout)")
    for name in ("plots", "markdown", "summary"):
        s = sub.add_parser(name)
        s.add_argument("--results", required=True)
        if name == "plots":
            s.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    if a.cmd == "merge":
        meta = load(a.meta) if a.meta and os.path.exists(a.meta) else {}
        res = merge(a.files, meta)
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.out)
        return 0
    res = load(a.results)
    if a.cmd == "context":
        md = context_markdown(res)
        if a.table:
            with open(a.table, "w") as f:
                f.write(md)
        else:
            sys.stdout.write(md)
        if a.png:
            print(context_plot(res, a.png))
        return 0
    if a.cmd == "plots":
        for p in plots(res, a.out_dir):
            print(p)
    elif a.cmd == "markdown":
        sys.stdout.write(markdown(res))
    else:
        print(summary(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
