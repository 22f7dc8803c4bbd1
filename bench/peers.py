#!/usr/bin/env python3
"""bench/peers.py — the peers of docs/BENCHMARKS.md, on the same attention shapes
as ws_bench (batch, tokens per sequence, heads, head dims), in the same run:

  torch_gpu_stream    KV in page-locked host memory; every step each layer's K and V
                      go `.to("cuda", non_blocking=True)`, then SDPA on the GPU
                      (the GPU-centric way: FlexGen / SolidAttention style)
  hf_offloaded_cache  Hugging Face transformers' offloaded cache
                      (DynamicCache(offloading=True) in transformers 5.x,
                      OffloadedCache in 4.x) driven with the same shapes: every
                      layer's update prefetches the next layer to the GPU, concatenates
                      the new token and offloads the layer back; SDPA over its output
  torch_cpu_sdpa      torch.nn.functional.scaled_dot_product_attention on the CPU over
                      bf16 K/V in pageable memory (enable_gqa), --threads threads
                      (the CPU-centric way: FastDecode style)
  torch_gpu_resident  the HBM-only engine: every layer's K and V already in GPU memory
                      ([batch, kv heads, tokens, dim] bf16, one query token); the fastest
                      of three PyTorch paths, chosen per shape and recorded as "path":
                      SDPA with enable_gqa, SDPA with each KV head's query heads folded
                      into the query length (flash/efficient kernels read every K/V row
                      once), and matmul-softmax(fp32)-matmul. A step (every layer) is
                      captured in a CUDA graph (launch overhead out, as an engine
                      would) and timed with CUDA events; the eager step is recorded too.
                      Not in the default --peers (bench/context-sweep.sh runs it).

DeepSeek-V2-Lite is run in the absorbed MLA form writescope uses: one shared KV "head"
whose row is c_kv[512] ‖ k_pe[64] (K = the row, V = its first 512 elements), 16 query
heads of 576 — 1152 bytes per token and layer, the bytes writescope moves.

Timing: a decode step runs every layer once and ends with torch.cuda.synchronize()
(torch_gpu_resident: CUDA events around a graph replay of the step);
step_ms is a decode step divided by its layers, median over --steps timed steps
after --warmup. Layers are added until a step reads --rotation-mib of KV (as in
ws_bench). Output: JSON (rewritten after every row), progress on stderr.
"""
import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

PRESETS = {
    # name, q heads, kv heads, k dim, v dim, bytes per token (bf16, K+V), softmax scale
    "qwen3": dict(name="Qwen3-30B-A3B", hq=32, hkv=4, dk=128, dv=128, mla=False, scale=1 / math.sqrt(128)),
    "mixtral": dict(name="Mixtral-8x7B", hq=32, hkv=8, dk=128, dv=128, mla=False, scale=1 / math.sqrt(128)),
    "dsv2": dict(name="DeepSeek-V2-Lite", hq=16, hkv=1, dk=576, dv=512, mla=True,
                 scale=(0.1 * 0.707 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)),
}


def token_bytes(p):
    return 2 * p["hkv"] * (p["dk"] if p["mla"] else p["dk"] + p["dv"])


def parse_len(s):
    s = s.strip()
    if s[-1] in "kK":
        return int(s[:-1]) * 1024
    return int(s)


def log(t0, msg):
    sys.stderr.write("[%6.1fs] %s\n" % (time.time() - t0, msg))
    sys.stderr.flush()


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return 0.0
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class Writer:
    def __init__(self, path, doc):
        self.path, self.doc = path, doc

    def write(self):
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(tmp, self.path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="qwen3,mixtral,dsv2")
    ap.add_argument("--batch", default="16")
    ap.add_argument("--lengths", default="32K,8K")
    ap.add_argument("--peers", default="torch_gpu_stream,torch_cpu_sdpa,hf_offloaded_cache")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cpu-steps", type=int, default=3, help="timed steps of torch_cpu_sdpa (slow)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rotation-mib", type=float, default=640)
    ap.add_argument("--row-seconds", type=float, default=3.0, help="timed seconds per row at most (slow peers get fewer steps)")
    ap.add_argument("--budget-seconds", type=float, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    t0 = time.time()

    import torch
    import torch.nn.functional as F

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    cuda = torch.cuda.is_available()
    try:
        import transformers
        tf_version = transformers.__version__
    except Exception as e:  # noqa: BLE001 - any import failure means no HF peer
        transformers, tf_version = None, "unavailable (%s)" % e

    doc = {
        "tool": "peers",
        "machine": {
            "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown"),
            "logical_cpus": os.cpu_count(),
            "hostname": platform.node(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join(sys.argv),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": tf_version,
            "torch_threads": torch.get_num_threads(),
        },
        "device": {"gpu": torch.cuda.get_device_name(0) if cuda else "none", "backend": "torch",
                   "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else 0},
        "options": vars(a),
        "units": {"step_ms": "one layer: median decode step (every layer, then a sync) / layers",
                  "kv_gbps": "KV bytes of one layer (batch x tokens x bytes per token) / step_ms"},
        "rows": [],
        "skipped": [],
        "complete": True,
    }
    out = Writer(a.json, doc)
    out.write()
    log(t0, "peers: torch %s, transformers %s, %s, %d CPU threads" % (torch.__version__, tf_version, doc["device"]["gpu"], torch.get_num_threads()))

    presets = [p.strip() for p in a.presets.split(",") if p.strip()]
    batches = [int(b) for b in a.batch.split(",")]
    lengths = [parse_len(x) for x in a.lengths.split(",")]
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]

    def spent():
        return a.budget_seconds > 0 and time.time() - t0 > a.budget_seconds

    def skip(what, why):
        doc["skipped"].append({"what": what, "why": why})
        log(t0, "skip %s: %s" % (what, why))
        out.write()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(step, layers, steps, warmup):
        # The first step is a warm-up and a probe: a peer slower than
        # --row-seconds allows gets fewer timed steps (at least one).
        s = time.perf_counter()
        step()
        sync()
        probe = time.perf_counter() - s
        for _ in range(warmup - 1):
            step()
        sync()
        steps = max(1, min(steps, int(a.row_seconds / max(probe, 1e-6))))
        ts = []
        for _ in range(steps):
            s = time.perf_counter()
            step()
            sync()
            ts.append((time.perf_counter() - s) / layers * 1e3)
        return ts

    # One page-locked arena (and one pageable copy) holds every shape's KV: pinning
    # once (cudaHostAlloc ~0.4 s/GiB) instead of per shape.
    need = 0
    for pk in presets:
        p = PRESETS[pk]
        for b in batches:
            for L in lengths:
                lb = b * L * token_bytes(p)
                layers = max(1, math.ceil(a.rotation_mib * 2 ** 20 / lb))
                need = max(need, layers * lb)
    elems = need // 2
    pinned = pageable = None

    def arena(pin):
        nonlocal pinned, pageable
        if pin and pinned is None:
            pinned = torch.empty(elems, dtype=torch.bfloat16, pin_memory=cuda)
            chunk = 1 << 28
            for off in range(0, elems, chunk):
                n = min(chunk, elems - off)
                if cuda:
                    pinned[off:off + n].copy_(torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_(-2, 2))
                else:
                    pinned[off:off + n].uniform_(-2, 2)
        if not pin and pageable is None:
            arena(True)
            pageable = torch.empty(elems, dtype=torch.bfloat16)  # not page-locked
            pageable.copy_(pinned)
        return pinned if pin else pageable

    def kv_views(buf, p, b, L, layers):
        """Per layer (K, V) views of the arena: [b, hkv, L, dk] and [b, hkv, L, dv]."""
        per = b * p["hkv"] * L
        res, off = [], 0
        for _ in range(layers):
            k = buf[off:off + per * p["dk"]].view(b, p["hkv"], L, p["dk"])
            off += per * p["dk"]
            if p["mla"]:
                v = None  # V = K[..., :512], made where it is used
            else:
                v = buf[off:off + per * p["dv"]].view(b, p["hkv"], L, p["dv"])
                off += per * p["dv"]
            res.append((k, v))
        return res

    def sdpa(q, k, v, p):
        if p["mla"]:
            v = k[..., :p["dv"]]
        return F.scaled_dot_product_attention(q, k, v, scale=p["scale"], enable_gqa=p["hkv"] != p["hq"])

    for L in lengths:
        for pk in presets:
            p = PRESETS[pk]
            for b in batches:
                lb = b * L * token_bytes(p)
                layers = max(1, math.ceil(a.rotation_mib * 2 ** 20 / lb))
                base = {"preset": p["name"], "batch": b, "tokens_per_sequence": L, "layers": layers,
                        "bytes_per_layer": lb, "threads": torch.get_num_threads()}
                for peer in peers:
                    what = "%s %s b=%d L=%d" % (peer, p["name"], b, L)
                    if spent():
                        doc["complete"] = False
                        skip(what, "budget spent")
                        continue
                    try:
                        if peer == "torch_gpu_stream":
                            if not cuda:
                                skip(what, "no CUDA device")
                                continue
                            kv = kv_views(arena(True), p, b, L, layers)
                            q = torch.randn(b, p["hq"], 1, p["dk"], device="cuda", dtype=torch.bfloat16)

                            def step():
                                for k, v in kv:
                                    kd = k.to("cuda", non_blocking=True)
                                    vd = v.to("cuda", non_blocking=True) if v is not None else None
                                    sdpa(q, kd, vd, p)
                            ts = timed(step, layers, a.steps, a.warmup)
                            extra = {}
                        elif peer == "torch_cpu_sdpa":
                            kv = kv_views(arena(False), p, b, L, layers)
                            q = torch.randn(b, p["hq"], 1, p["dk"], dtype=torch.bfloat16)
                            # Probe one layer at L/8 (the cost is linear in L): a peer far
                            # slower than --row-seconds runs one full layer-step only, or is
                            # extrapolated from the probe (flagged) when even that is too slow.
                            k0, v0 = kv[0]
                            n8 = max(1, L // 8)
                            sdpa(q, k0[:, :, :n8], None if v0 is None else v0[:, :, :n8], p)
                            s0 = time.perf_counter()
                            sdpa(q, k0[:, :, :n8], None if v0 is None else v0[:, :, :n8], p)
                            est = (time.perf_counter() - s0) * L / n8
                            extra = {"probe_layer_ms_extrapolated": est * 1e3}
                            if est > 3 * a.row_seconds:
                                ts = [est * 1e3]
                                extra["extrapolated"] = True
                                extra["note"] = "one layer at L/8 scaled by 8: a full step would take %.1f s" % est
                            elif est * layers > a.row_seconds:
                                s0 = time.perf_counter()
                                sdpa(q, k0, v0, p)
                                ts = [(time.perf_counter() - s0) * 1e3]
                                extra["note"] = "a single full layer-step (slow peer)"
                            else:
                                def step():
                                    for k, v in kv:
                                        sdpa(q, k, v, p)
                                ts = timed(step, layers, a.cpu_steps, 1)
                        elif peer == "torch_gpu_resident":
                            if not cuda:
                                skip(what, "no CUDA device (the KV is resident in GPU memory)")
                                continue
                            ts, extra = gpu_resident(torch, F, p, b, L, layers, a)
                        elif peer == "hf_offloaded_cache":
                            if not cuda:
                                skip(what, "no CUDA device (the offloaded cache streams to a GPU)")
                                continue
                            if transformers is None:
                                skip(what, "transformers not importable")
                                continue
                            ts, extra = hf_offloaded(torch, sdpa, p, b, L, max(2, layers), a, transformers)
                            base_layers = max(2, layers)
                            extra["layers"] = base_layers
                        else:
                            skip(what, "unknown peer")
                            continue
                    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the others
                        skip(what, "%s: %s" % (type(e).__name__, e))
                        if cuda:
                            torch.cuda.empty_cache()
                        continue
                    row = dict(base)
                    row.update(extra)
                    row["peer"] = peer
                    row["step_ms"] = median(ts)
                    row["step_ms_mean"] = sum(ts) / len(ts)
                    row["step_ms_all"] = ts
                    row["kv_gbps"] = lb / (row["step_ms"] * 1e-3) / 1e9
                    doc["rows"].append(row)
                    out.write()
                    log(t0, "%-20s %-17s b=%d L=%6d: %.3f ms/layer, %.1f GB/s" % (peer, p["name"], b, L, row["step_ms"], row["kv_gbps"]))
                    print("%-20s %-17s %3d %6d %9.3f ms %8.1f GB/s" % (peer, p["name"], b, L, row["step_ms"], row["kv_gbps"]), flush=True)
                if cuda:
                    torch.cuda.empty_cache()
    doc["elapsed_seconds"] = time.time() - t0
    out.write()
    log(t0, "done")


def gpu_resident(torch, F, p, b, L, layers, a, dev="cuda"):
    """The HBM-only engine: every layer's KV in GPU memory; returns (timings, extra).

    Three PyTorch paths are checked against an fp32 reference on the first
    layer and timed; the fastest is timed for the row (CUDA graph of a whole step, CUDA
    events, median of the replays / layers)."""
    hq, hkv, dk, dv = p["hq"], p["hkv"], p["dk"], p["dv"]
    g = hq // hkv
    kv = []
    for _ in range(layers):
        k = torch.empty(b, hkv, L, dk, device=dev, dtype=torch.bfloat16).uniform_(-2, 2)
        v = None if p["mla"] else torch.empty(b, hkv, L, dv, device=dev, dtype=torch.bfloat16).uniform_(-2, 2)
        kv.append((k, v))
    q = torch.randn(b, hq, 1, dk, device=dev, dtype=torch.bfloat16)
    qg = q.view(b, hkv, g, dk)  # query heads h = kv head h // g (enable_gqa's grouping)
    qs = (qg.float() * p["scale"]).to(torch.bfloat16)

    def vof(k, v):
        return k[..., :dv] if v is None else v  # MLA: V is the first dv elements of the K row

    def sdpa_gqa(k, v):
        return F.scaled_dot_product_attention(q, k, vof(k, v), scale=p["scale"], enable_gqa=hkv != hq)

    def sdpa_folded(k, v):
        # Each KV head's g query heads as g query rows (no mask: one decode token),
        # so the fused kernels read every K/V row once; no enable_gqa needed.
        return F.scaled_dot_product_attention(qg, k, vof(k, v), scale=p["scale"]).reshape(b, hq, 1, dv)

    def matmul(k, v):
        # bf16 GEMMs (fp32 accumulation); softmax over bf16 scores accumulates in fp32.
        s = torch.matmul(qs, k.transpose(-1, -2))  # [b, hkv, g, L]
        return torch.matmul(torch.softmax(s, dim=-1), vof(k, v)).reshape(b, hq, 1, dv)

    paths = {"matmul_softmax_matmul": matmul, "sdpa_folded_gqa": sdpa_folded}
    if not p["mla"]:
        # enable_gqa with a 576-wide K has no fused kernel: the math path repeats K/V per query head.
        paths["sdpa_enable_gqa"] = sdpa_gqa
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def event_ms(run, n):
        ts = []
        for _ in range(n):
            e0.record()
            run()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / layers)
        return ts

    def stepper(fn):
        def step():
            for k, v in kv:
                fn(k, v)
        return step

    def graphed(step):
        """A CUDA graph of the step (None when capture fails: timed eagerly then)."""
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
                step()
            torch.cuda.current_stream().wait_stream(s)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                step()
            gr.replay()
            torch.cuda.synchronize()
            return gr
        except Exception:  # noqa: BLE001 - an uncapturable path is timed eagerly
            torch.cuda.synchronize()
            return None

    k0, v0 = kv[0]
    # fp32 reference on the first layer (a check of every path, not timed)
    ref = torch.matmul(torch.softmax(torch.matmul(qg.float(), k0.float().transpose(-1, -2)) * p["scale"], dim=-1),
                       vof(k0, v0).float()).reshape(b, hq, 1, dv)
    tol = 3e-2 * float(ref.abs().max()) + 1e-6
    tried, best = {}, None
    for name, fn in paths.items():
        try:
            err = float((fn(k0, v0).float() - ref).abs().max())
            if not err <= tol:
                tried[name] = {"error": "differs from the fp32 reference by %.3g (tolerance %.3g)" % (err, tol)}
                continue
            step = stepper(fn)
            gr = graphed(step)
            run = gr.replay if gr is not None else step
            run()
            ms = median(event_ms(run, 3))
            tried[name] = {"probe_ms": ms, "graph": gr is not None, "max_abs_diff": err}
            if best is None or ms < best[1]:
                best = (name, ms, step, gr)
            else:
                del gr
        except Exception as e:  # noqa: BLE001 - e.g. out of memory on one path
            tried[name] = {"error": "%s: %s" % (type(e).__name__, str(e)[:200])}
            torch.cuda.synchronize()
    if best is None:
        raise RuntimeError("no resident attention path ran: %s" % tried)
    name, probe, step, gr = best
    run = gr.replay if gr is not None else step
    n = max(1, min(max(a.steps, 10), int(a.row_seconds / max(probe * layers * 1e-3, 1e-6))))
    for _ in range(max(1, a.warmup)):
        run()
    ts = event_ms(run, n)
    step()
    eager = event_ms(step, n)
    del gr, best
    return ts, {"path": name, "graph": tried[name]["graph"], "paths": tried, "step_ms_eager": median(eager),
                "timing": "CUDA events around %s of a whole step (every layer) / layers" %
                          ("a CUDA graph replay" if tried[name]["graph"] else "the eager step"),
                "note": "whole KV resident in GPU memory (HBM-only engine); no token append"}


def hf_offloaded(torch, sdpa, p, b, L, layers, a, transformers):
    """transformers' offloaded cache with the given shapes; returns (timings, extra)."""
    from transformers import cache_utils as cu
    if hasattr(cu, "OffloadedCache"):  # transformers 4.x
        cache = cu.OffloadedCache()
        api = "OffloadedCache()"
    else:  # transformers 5.x: offloading is a DynamicCache option
        cache = cu.DynamicCache(offloading=True)
        api = "DynamicCache(offloading=True)"
    dev = "cuda"
    # Prefill: L tokens per layer (written on the GPU, offloaded by the cache itself).
    for l in range(layers):
        k = torch.empty(b, p["hkv"], L, p["dk"], device=dev, dtype=torch.bfloat16).uniform_(-2, 2)
        v = torch.empty(b, p["hkv"], L, p["dv"], device=dev, dtype=torch.bfloat16).uniform_(-2, 2) if not p["mla"] else k[..., :p["dv"]].contiguous()
        cache.update(k, v, l)
        del k, v
    torch.cuda.synchronize()
    q = torch.randn(b, p["hq"], 1, p["dk"], device=dev, dtype=torch.bfloat16)
    kn = torch.randn(b, p["hkv"], 1, p["dk"], device=dev, dtype=torch.bfloat16)
    vn = torch.randn(b, p["hkv"], 1, p["dv"], device=dev, dtype=torch.bfloat16)

    def attend(q, k, v):
        import torch.nn.functional as F
        return F.scaled_dot_product_attention(q, k, v, scale=p["scale"], enable_gqa=p["hkv"] != p["hq"])

    def step():
        for l in range(layers):
            k, v = cache.update(kn, vn, l)
            attend(q, k, v)
    s = time.perf_counter()
    step()
    torch.cuda.synchronize()
    probe = time.perf_counter() - s
    for _ in range(a.warmup - 1):
        step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(max(1, min(a.steps, int(a.row_seconds / max(probe, 1e-6))))):
        s = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - s) / layers * 1e3)
    del cache
    torch.cuda.empty_cache()
    return ts, {"hf_api": api, "transformers": transformers.__version__,
                "note": "per layer: prefetch next layer H2D, cat, SDPA, offload D2H (DynamicCache offloading)"}


if __name__ == "__main__":
    main()
