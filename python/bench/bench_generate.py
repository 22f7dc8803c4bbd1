#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""generate() with WriteScopeCache against DynamicCache (GPU-resident) and DynamicCache(offloading=True).

    python python/bench/bench_generate.py --config /models/Qwen3-30B-A3B --layers 8 --random-weights \\
        --batch 8 --context 32768 --new-tokens 64 --json out/qwen3-8L-8x32k.json

One process, the same model and prompts for every cache. Prompts are random token ids,
batch x context, no padding. Per run: prefill (time to first token, prefill tok/s), decode
tok/s over the decode steps, TPOT P50/P99, the attention part of a decode step (every
layer's cache update and attention, between CUDA events), the writescope split, and the
Python overhead per decode step (host time in WriteScopeCache.update and the decode
attention outside the library's ops). A run that runs out of device memory is recorded as "oom". Writes a JSON
(--json) and prints a table.
"""

import argparse
import gc
import json
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList

import writescope
from writescope import hf as wshf

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StepClock(LogitsProcessor):
    def __init__(self, device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize(self.device) if self.device.type == "cuda" else None
        self.times.append(time.perf_counter())
        return scores


class OverheadMeter:
    """Host seconds in WriteScopeCache.update/_decode (total) and in the KVCache ops they call."""

    def __init__(self):
        self.total = self.ops = 0.0
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
        for op in ("append", "attention", "flush", "append_prefill"):
            self._wrap(writescope.KVCache, op, "ops")
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


def build_model(args, device):
    dtype = DTYPES[args.dtype]
    if args.random_weights:
        cfg = AutoConfig.from_pretrained(args.config, local_files_only=True)
        if args.layers:
            cfg.num_hidden_layers = args.layers
        torch.manual_seed(0)
        with torch.device(device):  # initialized where it runs (a full-depth model's random init on the host is slow)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="writescope")
    else:
        kw = {"num_hidden_layers": args.layers} if args.layers else {}
        model = load_model(args.config, dtype, device, **kw)
    return model.eval()


def run_one(model, ids, args, name, make_cache, device):
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
    rec = {"cache": name}
    try:
        cache = make_cache()
        clock = StepClock(device)
        with OverheadMeter() as meter, AttentionTimer(cache, device) as attn, torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    except torch.OutOfMemoryError as e:
        rec["oom"] = str(e).splitlines()[0]
        return rec
    b, p = ids.shape
    steps = [b2 - a for a, b2 in zip(clock.times, clock.times[1:])]
    rec.update(prefill_s=clock.times[0] - t0, prefill_tok_s=b * p / (clock.times[0] - t0),
               decode_steps=len(steps), decode_tok_s=b * len(steps) / sum(steps) if steps else None,
               tpot_p50_ms=statistics.median(steps) * 1e3 if steps else None,
               tpot_p99_ms=sorted(steps)[min(len(steps) - 1, int(0.99 * len(steps)))] * 1e3 if steps else None)
    if steps:
        rec["attention_ms_per_step"] = attn.seconds() / len(steps) * 1e3
    if device.type == "cuda":
        rec["peak_device_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if isinstance(cache, wshf.WriteScopeCache):
        rec["split"] = cache.split()
        rec["python_overhead_s"] = meter.total - meter.ops
        rec["python_overhead_per_step_ms"] = (meter.total - meter.ops) / max(1, len(steps) + 1) * 1e3
        if steps:
            rec["python_overhead_share"] = rec["python_overhead_per_step_ms"] / rec["tpot_p50_ms"]
    del cache
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="checkpoint or config directory (local)")
    ap.add_argument("--random-weights", action="store_true", help="build from the config with random weights")
    ap.add_argument("--layers", type=int, help="reduced depth (num_hidden_layers)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--caches", default="writescope,offloaded,dynamic",
                    help="comma list of writescope, offloaded, dynamic")
    ap.add_argument("--policies", default="roofline", help="comma list for writescope: roofline, gpu_only, cpu_only, r")
    ap.add_argument("--calibration", help="JSON of roofline costs (cpu_cost_per_token_seconds, ...)")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--d-window", type=int, default=64)
    ap.add_argument("--cpu-threads", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args, device)
    cfg = model.config
    torch.manual_seed(1)
    ids = torch.randint(10, cfg.vocab_size, (args.batch, args.context), device=device)
    calibration = json.load(open(args.calibration)) if args.calibration else None
    results = []
    for name in args.caches.split(","):
        if name == "writescope":
            for pol in args.policies.split(","):
                p = float(pol) if pol.replace(".", "", 1).isdigit() else pol

                def make(p=p):
                    return wshf.WriteScopeCache(model, policy=p, calibration=calibration if p == "roofline" else None,
                                                max_batch_size=args.batch,
                                                max_cache_len=args.context + args.new_tokens,
                                                block_tokens=args.block_tokens, d_window_tokens=args.d_window,
                                                cpu_threads=args.cpu_threads, pinned_initial_tokens=-1)
                results.append(run_one(model, ids, args, f"writescope:{pol}", make, device))
        elif name == "dynamic":
            results.append(run_one(model, ids, args, "DynamicCache", lambda: DynamicCache(config=cfg), device))
        elif name == "offloaded" and device.type != "cuda":
            results.append({"cache": "DynamicCache(offloading=True)", "skipped": "offloading needs a CUDA device"})
        elif name == "offloaded":
            results.append(run_one(model, ids, args, "DynamicCache(offloading=True)",
                                   lambda: DynamicCache(config=cfg, offloading=True), device))
        else:
            raise SystemExit(f"unknown cache {name!r}")
        print(json.dumps(results[-1]), flush=True)

    doc = {"model": type(model).__name__, "config": args.config, "layers": cfg.num_hidden_layers,
           "batch": args.batch, "context": args.context, "new_tokens": args.new_tokens, "dtype": args.dtype,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "writescope_build": writescope.build_info(), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    base = {r["cache"]: r for r in results}
    off = base.get("DynamicCache(offloading=True)", {}).get("decode_tok_s")
    off_attn = base.get("DynamicCache(offloading=True)", {}).get("attention_ms_per_step")
    print(f"\n{doc['model']}, {doc['layers']} layers, {args.batch} x {args.context}, {args.new_tokens} new tokens, "
          f"{doc['device']}")
    print(f"{'cache':34} {'prefill tok/s':>14} {'decode tok/s':>13} {'x offloaded':>12} {'TPOT P50 ms':>12} "
          f"{'P99/P50':>8} {'attn ms/step':>13} {'attn x off':>11} {'CPU share':>10} {'py ms/step':>11}")
    for r in results:
        if "oom" in r or "skipped" in r:
            print(f"{r['cache']:34} {'out of memory' if 'oom' in r else r['skipped']}")
            continue
        d = r["decode_tok_s"] or float("nan")
        ratio = f"{d / off:.2f}" if off else "-"
        share = f"{r['split']['cpu_share']:.3f}" if "split" in r else "-"
        py = f"{r['python_overhead_per_step_ms']:.2f}" if "python_overhead_per_step_ms" in r else "-"
        am = r.get("attention_ms_per_step")
        attn_ratio = f"{off_attn / am:.2f}" if off_attn and am else "-"
        print(f"{r['cache']:34} {r['prefill_tok_s']:14.0f} {d:13.1f} {ratio:>12} {r['tpot_p50_ms']:12.2f} "
              f"{r['tpot_p99_ms'] / r['tpot_p50_ms']:8.3f} {am if am is not None else float('nan'):13.3f} "
              f"{attn_ratio:>11} {share:>10} {py:>11}")


if __name__ == "__main__":
    main()
