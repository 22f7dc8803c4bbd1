#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""generate() with WriteScopeCache against DynamicCache (GPU-resident) and DynamicCache(offloading=True).

    python python/bench/bench_generate.py --config examples/moe/configs/qwen3_30b_a3b.json --layers 8 \\
        --random-weights --batch 8 --context 32768 --new-tokens 32 --json out/qwen3-8L-8x32k.json
    python python/bench/bench_generate.py --summarize out/*.json      # one table of several runs

--config is a checkpoint directory, a directory with a config.json, or an HF config.json file
itself (with --random-weights: nothing but the config is read; the weights are random, built on
the device). One process, the same model and prompts for every cache. Prompts are random token
ids, batch x context, no padding; context + new tokens must fit the config's
max_position_embeddings. Before the measured runs, every cache runs one short untimed generate
(--warmup-context tokens per row, 4 new tokens: CUDA context, kernels, cuBLAS handles, the
extension's threads). Per run: prefill (time to first token, prefill tok/s), decode tok/s over
the decode steps, TPOT P50/P99, the attention part of a decode step (every layer's cache update
and attention, between CUDA events on the current stream), the writescope split, and the
Python overhead per decode step (host time in WriteScopeCache.update and the decode attention
outside the library's ops, decode steps only). A run that fails (out of device memory, or any
other error) is recorded with its error and the next cache runs. The JSON (--json) is rewritten
after every run, so a run cut short by a timeout keeps what finished; it holds the ratios of the
issue's targets per writescope run (decode and attention against the offloaded cache, prefill
against DynamicCache, the overhead's share of the step).
"""

import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList

import writescope
from writescope import hf as wshf

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StepClock(LogitsProcessor):
    """Records when each step's logits are ready (the first: the end of the prefill), after a device
    sync; at the first, snapshots the overhead meter so that its decode part can be told apart."""

    def __init__(self, device, meter=None):
        self.device, self.times, self.meter, self.at_prefill = device, [], meter, None

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        if len(self.times) == 1 and self.meter is not None:
            self.at_prefill = (self.meter.total, self.meter.ops, self.meter.completion)
        return scores


class OverheadMeter:
    """Host seconds in WriteScopeCache.update/_decode (total) and in the KVCache ops they call."""

    def __init__(self):
        self.total = self.ops = self.completion = 0.0
        self._patched = []

    def _wrap(self, owner, name, field):
        orig = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t)

        setattr(owner, name, timed)
        self._patched.append((owner, name, orig))

    def __enter__(self):
        self._wrap(wshf.WriteScopeCache, "update", "total")
        self._wrap(wshf.WriteScopeCache, "_decode", "total")
        for op in ("append", "attention", "mla_attention", "flush", "append_prefill", "append_prefill_batch"):
            self._wrap(writescope.KVCache, op, "ops")
        self._wrap(writescope.KVCache, "complete_writes", "completion")  # from a forward hook, outside update
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._patched):
            setattr(owner, name, orig)


class AttentionTimer:
    """Per decode step, the time of its attention part: each layer's cache update and attention call,
    between two CUDA events on the current stream (host clock on the CPU). Every cache runs through
    the "writescope" attention here (plain SDPA for the DynamicCache runs), so one wrapper serves all."""

    def __init__(self, cache, device):
        self.cache, self.device, self.pairs = cache, device, []
        self._orig_attention = wshf.writescope_attention
        self._orig_update = cache.update

    def _mark(self):
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def __enter__(self):
        def update(key_states, value_states, layer_idx, *a, **k):
            if key_states.shape[2] == 1:
                self._start = self._mark()
            return self._orig_update(key_states, value_states, layer_idx, *a, **k)

        def attention(module, query, *a, **k):
            out = self._orig_attention(module, query, *a, **k)
            if query.shape[2] == 1 and getattr(self, "_start", None) is not None:
                self.pairs.append((self._start, self._mark()))
                self._start = None
            return out

        self.cache.update = update
        wshf.AttentionInterface.register(wshf.ATTN_IMPLEMENTATION, attention)
        return self

    def __exit__(self, *exc):
        wshf.AttentionInterface.register(wshf.ATTN_IMPLEMENTATION, self._orig_attention)
        del self.cache.update

    def seconds(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return sum(a.elapsed_time(b) for a, b in self.pairs) * 1e-3
        return sum(b - a for a, b in self.pairs)


def load_model(path, dtype, device, **kw):
    """from_pretrained onto `device`: through device_map where accelerate is installed, else load and move."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                    attn_implementation="writescope", device_map=str(device), **kw)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                 attn_implementation="writescope", **kw)
    return model.to(device)


def load_config(path, layers=None):
    """The HF config of `path`: a checkpoint directory, a directory with a config.json, or a config
    .json file (AutoConfig reads either); `layers` replaces num_hidden_layers."""
    kw = {"num_hidden_layers": layers} if layers else {}
    return AutoConfig.from_pretrained(path, local_files_only=True, **kw)


def build_model(args, device):
    dtype = DTYPES[args.dtype]
    if args.random_weights:
        cfg = load_config(args.config, args.layers)
        torch.manual_seed(0)
        # Built and initialized on the device in its dtype: no host copy of the weights (a full-depth
        # Qwen3-30B-A3B is 61 GB in bf16) and its random init runs as device kernels.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="writescope")
    else:
        kw = {"num_hidden_layers": args.layers} if args.layers else {}
        model = load_model(args.config, dtype, device, **kw)
    return model.eval()


def free_device_memory(device):
    wshf._active.state = None  # a decode step cut short by an error must not reach the next run's attention
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def generate(model, ids, cache, new_tokens, processors=()):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          logits_processor=LogitsProcessorList(list(processors)), pad_token_id=0)


def shape_warm_up(model, ids, device) -> float:
    """One forward over the measured prompts without a cache (the last position's logits only), before
    any measured run: the first forward at a new shape pays one-time costs (the SDPA backend's plan
    for that sequence length, GEMM and grouped-GEMM selections, host allocations) that would
    otherwise fall on whichever cache is measured first. Returns its seconds."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
    free_device_memory(device)
    return time.perf_counter() - t0


def warm_up(model, ids, name, make_cache, device, context):
    """One short untimed generate with this kind of cache (context tokens per row, 4 new tokens)."""
    rec = {"cache": name, "context": min(context, ids.shape[1])}
    t = time.perf_counter()
    try:
        with torch.inference_mode():
            cache = make_cache(rec["context"] + 4)
            generate(model, ids[:, :rec["context"]].contiguous(), cache, 4)
            del cache
        rec["seconds"] = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001  (recorded; the measured run reports it again)
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    free_device_memory(device)
    return rec


def device_gaps(prof, top: int = 12) -> str:
    """The device's busy time (the union of its kernel and copy intervals) against the span from the
    first to the last of them, and the longest idle gaps with the device work on either side and the
    host operators running during the gap: where the device waited for the host."""
    from torch.autograd import DeviceType

    evs = prof.events()
    dev = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs
                 if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not dev:
        return "device: no device events"
    busy, gaps = 0.0, []
    cur_s, cur_e, cur_n = dev[0]
    for s0, e0, n0 in dev[1:]:
        if s0 > cur_e:
            busy += cur_e - cur_s
            gaps.append((s0 - cur_e, cur_e, s0, cur_n, n0))
            cur_s, cur_e, cur_n = s0, e0, n0
        elif e0 > cur_e:
            cur_e, cur_n = e0, n0
    busy += cur_e - cur_s
    span = dev[-1][1] - dev[0][0]
    host = [(e.time_range.start, e.time_range.end, e.name) for e in evs
            if e.device_type == DeviceType.CPU and e.name.startswith(("writescope::", "aten::nonzero", "aten::item",
                                                                       "cudaStreamSynchronize", "cudaEventSynchronize",
                                                                       "aten::_local_scalar_dense"))]
    lines = [f"device busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span ({busy / span:.3f}); "
             f"idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps"]
    by_host = {}
    for g, a, b, _, _ in gaps:
        for hs, he, hn in host:
            ov = min(b, he) - max(a, hs)
            if ov > 0:
                by_host[hn] = by_host.get(hn, 0.0) + ov
    lines.append("idle time overlapping host operators: " +
                 ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted(by_host.items(), key=lambda kv: -kv[1])[:8]))
    for g, a, b, before, after in sorted(gaps, reverse=True)[:top]:
        during = sorted({hn for hs, he, hn in host if min(b, he) - max(a, hs) > 0})
        lines.append(f"  gap {g / 1e3:8.2f} ms after {before[:50]!r} before {after[:50]!r}; host: {', '.join(during)[:120]}")
    return "\n".join(lines)


def profile_prefill(model, ids, name, make_cache, device, path):
    """One prefill (generate with one new token) under torch.profiler; appends the top operators by
    device time and by host time to ``path``. Untimed: the profiler slows what it watches."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    cache = None
    try:
        with torch.inference_mode():
            cache = make_cache(ids.shape[1] + 1)
            with profile(activities=acts) as prof:
                generate(model, ids, cache, 1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        ka = prof.key_averages()
        with open(path, "a") as f:
            f.write(f"==== {name}: prefill of {ids.shape[0]} x {ids.shape[1]} tokens\n")
            if device.type == "cuda":
                f.write(ka.table(sort_by="self_cuda_time_total", row_limit=25) + "\n")
                try:
                    f.write(device_gaps(prof) + "\n")
                except Exception as e:  # noqa: BLE001  (a diagnostic of a diagnostic)
                    f.write(f"device gaps failed: {type(e).__name__}: {e}\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
    except Exception as e:  # noqa: BLE001  (a diagnostic: never loses the measured results)
        with open(path, "a") as f:
            f.write(f"==== {name}: profile failed: {type(e).__name__}: {e}\n")
    del cache
    free_device_memory(device)


def run_one(model, ids, args, name, make_cache, device):
    free_device_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rec = {"cache": name}
    cache = None
    try:
        t = time.perf_counter()
        cache = make_cache(args.context + args.new_tokens)
        rec["cache_setup_s"] = time.perf_counter() - t  # not in prefill: regions reserved, pinned memory locked
        with OverheadMeter() as meter, AttentionTimer(cache, device) as attn, torch.inference_mode():
            clock = StepClock(device, meter)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            generate(model, ids, cache, args.new_tokens, [clock])
            attn_s = attn.seconds()
    except Exception as e:  # noqa: BLE001  (one cache's failure must not lose the others' results)
        kind = "oom" if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower() else "error"
        rec[kind] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        del cache
        free_device_memory(device)
        return rec
    b, p = ids.shape
    steps = [b2 - a for a, b2 in zip(clock.times, clock.times[1:])]
    rec.update(prefill_s=clock.times[0] - t0, prefill_tok_s=b * p / (clock.times[0] - t0),
               decode_steps=len(steps), decode_tok_s=b * len(steps) / sum(steps) if steps else None,
               tpot_p50_ms=statistics.median(steps) * 1e3 if steps else None,
               tpot_p99_ms=sorted(steps)[min(len(steps) - 1, int(0.99 * len(steps)))] * 1e3 if steps else None)
    if steps:
        rec["attention_ms_per_step"] = attn_s / len(steps) * 1e3
        rec["attention_share_of_step"] = rec["attention_ms_per_step"] / (sum(steps) / len(steps) * 1e3)
    if device.type == "cuda":
        rec["peak_device_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if isinstance(cache, wshf.WriteScopeCache):
        rec["split"] = cache.split()
        if cache.policy == "roofline" and steps:
            rec["learned_calibration"] = cache.learned_calibration()
        usage = cache.kv.usage()
        # device-to-host pieces of the KV writes (prefill and evictions) and the CUDA calls issuing them
        rec["host_copies"] = {k: usage[k] for k in ("host_copy_submissions", "host_copy_pieces",
                                                     "host_copy_api_calls") if k in usage}
        total0, ops0, completion0 = clock.at_prefill or (0.0, 0.0, 0.0)
        decode_overhead = (meter.total - total0) - (meter.ops - ops0)
        rec["python_overhead_prefill_s"] = total0 - ops0
        # host seconds inside the library's prefill ops (the batched writes, and completing the deferred
        # pageable writes of the last layer at the end of the prefill forward): time the host thread
        # could not enqueue model work
        rec["prefill_ops_s"] = ops0 + completion0
        rec["prefill_completion_s"] = completion0
        if steps:
            # host seconds outside the library's ops in the decode steps' update and attention calls
            rec["python_overhead_per_step_ms"] = decode_overhead / len(steps) * 1e3
            rec["python_overhead_share"] = decode_overhead / sum(steps)
    del cache
    free_device_memory(device)
    return rec


OFFLOADED, DYNAMIC = "DynamicCache(offloading=True)", "DynamicCache"


def ratios(results):
    """Per writescope run, the ratios of issue #20's targets (None where a side is missing):
    decode tok/s over the offloaded cache's (>= 2.5), the offloaded cache's attention ms per step over
    writescope's (>= 4), prefill tok/s over DynamicCache's (>= 0.95), the Python overhead's share
    of the decode step (<= 0.05), and decode tok/s over DynamicCache's."""
    base = {r["cache"]: r for r in results}

    def get(name, key):
        return base.get(name, {}).get(key)

    def div(a, b):
        return a / b if a is not None and b else None

    out = {}
    for r in results:
        if not r["cache"].startswith("writescope") or "decode_tok_s" not in r:
            continue
        out[r["cache"]] = {
            "decode_x_offloaded": div(r.get("decode_tok_s"), get(OFFLOADED, "decode_tok_s")),
            "attention_x_offloaded": div(get(OFFLOADED, "attention_ms_per_step"), r.get("attention_ms_per_step")),
            "prefill_x_dynamic": div(r.get("prefill_tok_s"), get(DYNAMIC, "prefill_tok_s")),
            "decode_x_dynamic": div(r.get("decode_tok_s"), get(DYNAMIC, "decode_tok_s")),
            "python_overhead_share": r.get("python_overhead_share"),
        }
    return out


def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(doc):
    results = doc["results"]
    print(f"\n{doc['model']}, {doc['layers']} layers, {doc['batch']} x {doc['context']}, {doc['new_tokens']} new "
          f"tokens, {doc['device']}")
    print(f"{'cache':34} {'prefill tok/s':>14} {'decode tok/s':>13} {'TPOT P50 ms':>12} {'P99/P50':>8} "
          f"{'attn ms/step':>13} {'CPU share':>10} {'py ms/step':>11} {'peak GiB':>9}")
    for r in results:
        if "decode_tok_s" not in r:
            print(f"{r['cache']:34} " + (f"out of memory: {r['oom']}" if "oom" in r else
                                         r.get("error") or r.get("skipped") or "no result"))
            continue
        p50, p99 = r.get("tpot_p50_ms"), r.get("tpot_p99_ms")
        print(f"{r['cache']:34} {fmt(r['prefill_tok_s'], '14.0f')} {fmt(r['decode_tok_s'], '13.1f')} "
              f"{fmt(p50, '12.2f'):>12} {fmt(p99 / p50 if p50 and p99 else None, '8.3f'):>8} "
              f"{fmt(r.get('attention_ms_per_step'), '13.3f'):>13} "
              f"{fmt(r['split']['cpu_share'] if 'split' in r else None, '10.3f'):>10} "
              f"{fmt(r.get('python_overhead_per_step_ms'), '11.2f'):>11} {fmt(r.get('peak_device_gib'), '9.1f'):>9}")
    for name, q in doc.get("ratios", {}).items():
        print(f"{name}: decode x offloaded {fmt(q['decode_x_offloaded'], '.2f')} (target >= 2.5), attention x "
              f"offloaded {fmt(q['attention_x_offloaded'], '.2f')} (>= 4), prefill x DynamicCache "
              f"{fmt(q['prefill_x_dynamic'], '.3f')} (>= 0.95), Python overhead "
              f"{fmt(None if q['python_overhead_share'] is None else 100 * q['python_overhead_share'], '.2f')} % of "
              f"the step (<= 5), decode x DynamicCache {fmt(q['decode_x_dynamic'], '.2f')}")


def summarize(paths):
    """One table of several JSONs of this script: a row per writescope run with the target ratios."""
    print(f"{'model':24} {'L':>3} {'batch x context':>16} {'cache':22} {'decode tok/s':>13} {'dec x off':>10} "
          f"{'attn x off':>11} {'prefill x dyn':>14} {'py overhead %':>14} {'dec x dyn':>10}")
    for path in paths:
        try:
            doc = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"{path}: unreadable ({e})")
            continue
        head = f"{doc['model'][:24]:24} {doc['layers']:>3} {str(doc['batch']) + ' x ' + str(doc['context']):>16}"
        q = doc.get("ratios") or ratios(doc["results"])
        shown = False
        for r in doc["results"]:
            if r["cache"] in q:
                x = q[r["cache"]]
                share = x["python_overhead_share"]
                print(f"{head} {r['cache'][:22]:22} {fmt(r['decode_tok_s'], '13.1f')} "
                      f"{fmt(x['decode_x_offloaded'], '10.2f'):>10} {fmt(x['attention_x_offloaded'], '11.2f'):>11} "
                      f"{fmt(x['prefill_x_dynamic'], '14.3f'):>14} "
                      f"{fmt(None if share is None else 100 * share, '14.2f'):>14} "
                      f"{fmt(x['decode_x_dynamic'], '10.2f'):>10}")
                shown = True
            elif r["cache"].startswith("writescope") or "decode_tok_s" not in r:
                what = r.get("oom") or r.get("error") or r.get("skipped") or "no result"
                print(f"{head} {r['cache'][:22]:22} {what[:90]}")
                shown = True
        if not shown:
            print(f"{head} (no writescope run)")
        if not doc.get("complete", True):
            print(f"{head} (incomplete: cut short after {len(doc['results'])} runs)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="checkpoint directory, or (with --random-weights) a config directory or "
                                     "config .json file; local files only")
    ap.add_argument("--random-weights", action="store_true", help="build from the config with random weights")
    ap.add_argument("--layers", type=int, help="reduced depth (num_hidden_layers)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--caches", default="writescope,offloaded,dynamic",
                    help="comma list of writescope, offloaded, dynamic (run in this order)")
    ap.add_argument("--policies", default="roofline",
                    help="comma list for writescope: roofline, gpu_only, cpu_only, r, or learned (the roofline started "
                         "from the costs the latest roofline run before it learned, WriteScopeCache."
                         "learned_calibration(): how a second request on the same machine starts)")
    ap.add_argument("--calibration", help="JSON of roofline costs (cpu_cost_per_token_seconds, ...)")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--d-window", type=int, default=64)
    ap.add_argument("--cpu-threads", type=int, default=0)
    ap.add_argument("--hbm-tokens", type=int, default=0,
                    help="writescope's HBM-resident KV region, tokens per layer over all rows (a multiple of "
                         "--d-window; 0: none; -1: the whole planned cache, batch x (context + new tokens), "
                         "rounded up to eviction batches)")
    ap.add_argument("--resident-kernel", action="store_true",
                    help="attend the HBM-resident region (--hbm-tokens) with the split-K resident kernels "
                         "(the KVCache option resident_kernel; CUDA)")
    ap.add_argument("--warmup-context", type=int, default=512, help="prompt tokens per row of the warm-up runs "
                                                                    "(0: no warm-up)")
    ap.add_argument("--shape-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one cache-less forward over the measured prompts before the measured runs, so that the "
                         "first cache measured does not pay the new shape's one-time costs (default on)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the results here (rewritten after every run)")
    ap.add_argument("--profile-prefill", metavar="TXT",
                    help="after the measured runs, profile one prefill per cache (torch.profiler) and append the "
                         "top operators by device and host time to this file")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="print one table of these result files and exit")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if not args.config:
        ap.error("--config is required")
    pols = args.policies.split(",")
    if "learned" in pols and ("roofline" not in pols or pols.index("roofline") > pols.index("learned")):
        ap.error("--policies: learned needs a roofline run before it (e.g. roofline,learned)")

    device = torch.device(args.device)
    caches = [c for c in args.caches.split(",") if c]
    unknown = sorted(set(caches) - {"writescope", "offloaded", "dynamic"})
    if unknown:
        ap.error(f"unknown caches {unknown}; known: writescope, offloaded, dynamic")
    cfg = load_config(args.config, args.layers)
    max_pos = getattr(cfg.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_pos and args.context + args.new_tokens > max_pos:
        ap.error(f"--context {args.context} + --new-tokens {args.new_tokens} exceeds the config's "
                 f"max_position_embeddings {max_pos}")

    t = time.perf_counter()
    model = build_model(args, device)
    build_s = time.perf_counter() - t
    cfg = model.config
    print(f"[bench] {type(model).__name__}, {cfg.num_hidden_layers} layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} G parameters, built in {build_s:.1f} s", flush=True)
    torch.manual_seed(1)
    ids = torch.randint(10, cfg.vocab_size, (args.batch, args.context), device=device)
    calibration = json.load(open(args.calibration)) if args.calibration else None

    hbm_tokens = args.hbm_tokens
    if hbm_tokens < 0:  # the whole planned cache: every row's eviction batches
        per_row = -(-(args.context + args.new_tokens) // args.d_window) * args.d_window
        hbm_tokens = args.batch * per_row
    runs = []  # (name, make_cache(max_cache_len)) in order
    learned = {}  # the costs the latest roofline run learned (run_one fills it)
    for name in caches:
        if name == "writescope":
            for pol in pols:
                p = float(pol) if pol.replace(".", "", 1).isdigit() else pol

                def make(max_len, p=p):
                    if p == "learned":
                        if not learned:
                            raise RuntimeError("no roofline run learned costs before this run")
                        return wshf.WriteScopeCache(model, policy="roofline", calibration=dict(learned),
                                                    max_batch_size=args.batch, max_cache_len=max_len,
                                                    block_tokens=args.block_tokens, d_window_tokens=args.d_window,
                                                    cpu_threads=args.cpu_threads, pinned_initial_tokens=-1,
                                                    cpu_prefault_tokens=-1, hbm_capacity_tokens=hbm_tokens,
                                                    resident_kernel=int(args.resident_kernel))
                    return wshf.WriteScopeCache(model, policy=p, calibration=calibration if p == "roofline" else None,
                                                max_batch_size=args.batch, max_cache_len=max_len,
                                                block_tokens=args.block_tokens, d_window_tokens=args.d_window,
                                                cpu_threads=args.cpu_threads, pinned_initial_tokens=-1,
                                                cpu_prefault_tokens=-1, hbm_capacity_tokens=hbm_tokens,
                                                resident_kernel=int(args.resident_kernel))
                runs.append((f"writescope:{pol}", make))
        elif name == "dynamic":
            runs.append((DYNAMIC, lambda max_len: DynamicCache(config=cfg)))
        elif device.type != "cuda":
            runs.append((OFFLOADED, None))
        else:
            runs.append((OFFLOADED, lambda max_len: DynamicCache(config=cfg, offloading=True)))

    doc = {"model": type(model).__name__, "config": args.config, "layers": cfg.num_hidden_layers,
           "batch": args.batch, "context": args.context, "new_tokens": args.new_tokens, "dtype": args.dtype,
           "hbm_tokens": hbm_tokens, "resident_kernel": bool(args.resident_kernel),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "writescope_build": writescope.build_info(),
           "model_build_s": build_s, "warmup": [], "results": [], "complete": False}

    def save():
        doc["ratios"] = ratios(doc["results"])
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(doc, f, indent=1)
            import os
            os.replace(args.json + ".tmp", args.json)

    if args.warmup_context > 0:
        for name, make in runs:
            if make is not None and name != "writescope:learned":  # its code is the roofline run's, warmed there
                doc["warmup"].append(warm_up(model, ids, name, make, device, args.warmup_context))
                print(f"[bench] warm-up {json.dumps(doc['warmup'][-1])}", flush=True)
    if args.shape_warmup:
        doc["shape_warmup_s"] = shape_warm_up(model, ids, device)
        print(f"[bench] shape warm-up: one cache-less forward over the measured prompts in "
              f"{doc['shape_warmup_s']:.2f} s", flush=True)
    for name, make in runs:
        if make is None:
            doc["results"].append({"cache": name, "skipped": "offloading needs a CUDA device"})
        else:
            doc["results"].append(run_one(model, ids, args, name, make, device))
            if name == "writescope:roofline" and "learned_calibration" in doc["results"][-1]:
                learned.clear()
                learned.update(doc["results"][-1]["learned_calibration"])
        print(json.dumps(doc["results"][-1]), flush=True)
        save()
    doc["complete"] = True
    save()
    if args.profile_prefill:
        for name, make in runs:
            if make is not None:
                profile_prefill(model, ids, name, make, device, args.profile_prefill)
    print_table(doc)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
