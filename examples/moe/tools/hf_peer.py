#!/usr/bin/env python3
"""examples/moe/tools/hf_peer.py — the Hugging Face transformers peer of ws_decode's
scale runs: the same architecture, built with transformers' own classes
(Qwen3MoeForCausalLM, DeepseekV2ForCausalLM, MixtralForCausalLM) from a
config.json of examples/moe/configs with num_hidden_layers overridden, random
initialisation, bf16 on the GPU, generating with model.generate() over
transformers' offloaded KV cache (every layer's KV lives in host memory; each
layer's update prefetches the next layer to the GPU and offloads its own back).

  python3 examples/moe/tools/hf_peer.py --config examples/moe/configs/qwen3_30b_a3b.json \\
      --layers 8 --batch 8 --prompt-len 8160 --new-tokens 66 --json hf.json

Cache (--cache offloaded, the default), first that works:
  1. generate(cache_implementation="offloaded")      transformers >= 4.4x and 5.x
  2. an explicit cache passed as past_key_values:
     DynamicCache(config=..., offloading=True)       transformers 5.x
     OffloadedCache()                                transformers 4.x
The JSON names the one used ("cache.api") and how many layers' KV were in host
memory after the run ("cache.kv_layers_in_host_memory" of "cache.kv_layers"; the
layer prefetched last is on the GPU). --cache dynamic runs
transformers' plain GPU cache (no offloading; for a CPU smoke test).

Timing: prompts are random token ids (--seed), all of --prompt-len tokens
(no padding); greedy; min_new_tokens = new tokens, so a random model's EOS
cannot stop a sequence early. A stopping criterion that never stops records
torch.cuda.synchronize()d timestamps after every generated token: the first
closes prefill (prompt forward + first token, as ws_decode's prefill figure),
each later one a decode step. An untimed warm-up generate() (same batch, 16
prompt tokens, 2 new tokens, same cache) picks the cache variant; a second one
at --warmup-len prompt tokens (default: the timed prompt length, so that the
timed prefill's kernels, GEMM heuristics and allocator pool are in place, as
ws_decode's warm-up layer of the first prefill wave's shape does; 0: none)
follows. Figures use ws_decode's
--json names: prefill_tok_s, tpot_p50_ms / tpot_p99_ms (all decode steps),
tpot_first_step_ms, tpot_steady_* (steps 2..N), decode_tok_s (batch x steps /
their time), step_seconds.

It degrades gracefully: any failure (an import, an unsupported cache, out of
memory) writes the JSON with an "error" field and exits 0, so a scale run
records why the peer has no numbers. The JSON is written first with an error
saying the run did not finish, so a killed run leaves that behind.
"""
import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

ARCH_CLASSES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def percentile(xs, q):
    """Linear interpolation between closest ranks (ws_moe/report.hpp's percentile)."""
    if not xs:
        return 0.0
    v = sorted(xs)
    pos = q / 100.0 * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(len(v) - 1, lo + 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def log(t0, msg):
    sys.stderr.write("[hf_peer %6.1fs] %s\n" % (time.time() - t0, msg))
    sys.stderr.flush()


class Doc:
    def __init__(self, path, doc):
        self.path, self.doc = path, doc

    def write(self):
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, self.path)


def tpot_figures(step_seconds, batch):
    """ws_decode's TPOT figures (report.hpp summarize) from per-step seconds."""
    out = {}
    total = sum(step_seconds)
    out["tpot_p50_ms"] = percentile(step_seconds, 50) * 1e3
    out["tpot_p99_ms"] = percentile(step_seconds, 99) * 1e3
    out["tpot_p99_over_p50"] = out["tpot_p99_ms"] / out["tpot_p50_ms"] if out["tpot_p50_ms"] > 0 else 0.0
    out["decode_tok_s"] = batch * len(step_seconds) / total if total > 0 else 0.0
    steady = step_seconds[1:]
    out["tpot_first_step_ms"] = step_seconds[0] * 1e3 if step_seconds else 0.0
    out["tpot_steady_steps"] = len(steady)
    out["tpot_steady_p50_ms"] = percentile(steady, 50) * 1e3
    out["tpot_steady_p99_ms"] = percentile(steady, 99) * 1e3
    out["tpot_steady_p99_over_p50"] = (out["tpot_steady_p99_ms"] / out["tpot_steady_p50_ms"]
                                       if out["tpot_steady_p50_ms"] > 0 else 0.0)
    ts = sum(steady)
    out["decode_steady_tok_s"] = batch * len(steady) / ts if ts > 0 else 0.0
    return out


def build_model(torch, transformers, a, cfg_dict, dev):
    """The architecture of cfg_dict with transformers' own class, random init, bf16 on dev."""
    d = dict(cfg_dict)
    model_type = d.pop("model_type")
    if model_type not in ARCH_CLASSES:
        raise ValueError("model_type %r is not one of %s" % (model_type, ", ".join(ARCH_CLASSES)))
    for k in ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version"):
        d.pop(k, None)
    d["num_hidden_layers"] = a.layers
    d["use_cache"] = True
    config = transformers.AutoConfig.for_model(model_type, **d)
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = a.attn_implementation
    cls = getattr(transformers, ARCH_CLASSES[model_type])
    torch.manual_seed(a.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):  # parameters allocated and initialised on the device (fast on a GPU)
            model = cls(config)
    finally:
        torch.set_default_dtype(old)
    model = model.to(dtype=torch.bfloat16).eval()
    return model, config, cls.__name__


def offloaded_variants(transformers, config):
    """(label, generate kwargs) of the ways to get an offloaded cache, most direct first."""
    from transformers import cache_utils as cu
    out = [("generate(cache_implementation='offloaded')", lambda: {"cache_implementation": "offloaded"})]
    if hasattr(cu, "OffloadedCache"):  # transformers 4.x
        out.append(("OffloadedCache() as past_key_values", lambda: {"past_key_values": cu.OffloadedCache()}))
    out.append(("DynamicCache(config=..., offloading=True) as past_key_values",
                lambda: {"past_key_values": cu.DynamicCache(config=config, offloading=True)}))
    return out


def cache_of(out):
    for name in ("cache", "past_key_values"):
        c = getattr(out, name, None)
        if c is not None:
            return c
    return None


def kv_device(cache):
    """The cache's class and where its layers' keys live after the run: an
    offloaded cache has all but the prefetched layer(s) in host memory."""
    info = {"class": type(cache).__name__ if cache is not None else None}
    if cache is None:
        return info
    info["offloading_flag"] = bool(getattr(cache, "offloading", False))
    try:
        layers = getattr(cache, "layers", None)
        if layers:  # transformers 5.x: one layer object per layer
            keys = [getattr(l, "keys", None) for l in layers]
        else:  # transformers 4.x: lists of tensors
            keys = list(getattr(cache, "key_cache", []) or [])
        devs = [str(k.device) for k in keys if k is not None and hasattr(k, "device")]
        info["kv_layers"] = len(devs)
        info["kv_layers_in_host_memory"] = sum(d == "cpu" for d in devs)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        info["kv_device_error"] = repr(e)
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="config.json (examples/moe/configs/*.json)")
    ap.add_argument("--layers", type=int, default=8, help="num_hidden_layers override")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8160)
    ap.add_argument("--new-tokens", type=int, default=66, help="generated tokens per sequence (>= 2)")
    ap.add_argument("--cache", choices=("offloaded", "dynamic"), default="offloaded")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke tests: --cache dynamic)")
    ap.add_argument("--attn-implementation", default="sdpa")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--warmup-len", type=int, default=-1,
                    help="prompt tokens of the second untimed warm-up generate() (-1: --prompt-len; 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    t0 = time.time()
    doc = {
        "tool": "hf_peer",
        "peer": "transformers generate() with its %s KV cache" % a.cache,
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "config": {"file": a.config, "layers": a.layers},
        "batch": a.batch,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "error": "did not finish (killed, timed out or crashed before writing its result)",
    }
    out = Doc(a.json, doc)
    out.write()
    try:
        run(a, doc, out, t0)
        doc.pop("error", None)
    except BaseException as e:  # noqa: BLE001 - every failure becomes a JSON error, exit 0
        if isinstance(e, KeyboardInterrupt):
            raise
        msg = "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
        if "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError":
            msg = "out of memory: " + msg
        doc["error"] = msg
        doc["traceback"] = traceback.format_exc().strip().splitlines()[-12:]
        log(t0, "error: " + msg)
    doc["elapsed_seconds"] = time.time() - t0
    out.write()
    if "error" not in doc:
        log(t0, "prefill %.1f tok/s; decode %.1f tok/s, TPOT P50 %.2f ms P99 %.2f ms; steady P50 %.2f ms P99 %.2f ms "
            "(P99/P50 %.2f); cache %s" % (doc["prefill_tok_s"], doc["decode_tok_s"], doc["tpot_p50_ms"], doc["tpot_p99_ms"],
                                           doc["tpot_steady_p50_ms"], doc["tpot_steady_p99_ms"],
                                           doc["tpot_steady_p99_over_p50"], doc["cache"]["api"]))
    return 0


def run(a, doc, out, t0):
    if a.new_tokens < 2:
        raise ValueError("--new-tokens must be >= 2 (one prefill token, then decode steps)")
    if a.warmup_len < -1:
        raise ValueError("--warmup-len %d: must be -1 (the prompt length), 0 (none) or a token count" % a.warmup_len)
    import torch
    import transformers
    doc["torch"] = torch.__version__
    doc["transformers"] = transformers.__version__
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dev = a.device
    cuda = dev.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    if a.cache == "offloaded" and not cuda:
        raise RuntimeError("the offloaded cache streams layers to a GPU; on the CPU use --cache dynamic")
    doc["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with open(a.config) as f:
        cfg_dict = json.load(f)
    log(t0, "torch %s, transformers %s, %s; building %s with %d layers" %
        (torch.__version__, transformers.__version__, doc["device"], cfg_dict.get("model_type"), a.layers))
    ti = time.time()
    model, config, cls_name = build_model(torch, transformers, a, cfg_dict, dev)
    sync()
    doc["init_seconds"] = time.time() - ti
    nparams = sum(p.numel() for p in model.parameters())
    doc["config"].update({"model_type": cfg_dict.get("model_type"), "class": cls_name, "parameters": nparams,
                          "hidden_size": getattr(config, "hidden_size", None),
                          "num_attention_heads": getattr(config, "num_attention_heads", None),
                          "num_key_value_heads": getattr(config, "num_key_value_heads", None),
                          "attn_implementation": a.attn_implementation})
    log(t0, "%s: %.2fB parameters, bf16 on %s, built in %.1f s" % (cls_name, nparams / 1e9, dev, doc["init_seconds"]))
    out.write()

    g = torch.Generator(device="cpu").manual_seed(a.seed + 1)
    ids = torch.randint(0, config.vocab_size, (a.batch, a.prompt_len), generator=g).to(dev)
    mask = torch.ones_like(ids)
    base = dict(do_sample=False, min_new_tokens=a.new_tokens, max_new_tokens=a.new_tokens, pad_token_id=0,
                use_cache=True, return_dict_in_generate=True)

    stamps = []

    class Recorder(transformers.StoppingCriteria):
        """Never stops; records a synchronised timestamp after every generated token."""

        def __call__(self, input_ids, scores, **kwargs):
            sync()
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    variants = offloaded_variants(transformers, config) if a.cache == "offloaded" else [
        ("generate(cache_implementation='dynamic')", lambda: {"cache_implementation": "dynamic"})]
    tried = []
    with torch.inference_mode():
        api = None
        for label, make in variants:  # the first variant whose warm-up generates is the one timed
            try:
                n_w = min(16, a.prompt_len)
                tw = time.time()
                w = model.generate(input_ids=ids[:, :n_w], attention_mask=mask[:, :n_w],
                                   **dict(base, min_new_tokens=2, max_new_tokens=2), **make())
                sync()
                info = kv_device(cache_of(w))
                del w
                if a.cache == "offloaded" and not info.get("offloading_flag") and info.get("kv_layers_in_host_memory", 1) == 0:
                    raise RuntimeError("the cache (%s) kept every layer on the GPU: not offloaded" % info.get("class"))
                doc["warmup_seconds"] = time.time() - tw
                api = label
                break
            except Exception as e:  # noqa: BLE001 - try the next way, report them all if none works
                if "out of memory" in str(e).lower():
                    raise
                tried.append("%s: %s: %s" % (label, type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else ""))
                log(t0, "cache variant failed: " + tried[-1])
        if api is None:
            raise RuntimeError("no %s cache works with transformers %s: %s" % (a.cache, transformers.__version__, " | ".join(tried)))
        doc["cache"] = {"requested": a.cache, "api": api, "failed_variants": tried}
        make = dict(variants)[api]
        n_full = a.prompt_len if a.warmup_len < 0 else min(a.warmup_len, a.prompt_len)
        if n_full > 16:
            tw = time.time()
            w = model.generate(input_ids=ids[:, :n_full], attention_mask=mask[:, :n_full],
                               **dict(base, min_new_tokens=2, max_new_tokens=2), **make())
            sync()
            del w
            doc["warmup_full_seconds"] = time.time() - tw
        doc["warmup_prompt_tokens"] = max(n_full, min(16, a.prompt_len))
        log(t0, "cache: %s; generating %d x (%d prompt + %d new) tokens" % (api, a.batch, a.prompt_len, a.new_tokens))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        res = model.generate(input_ids=ids, attention_mask=mask, stopping_criteria=transformers.StoppingCriteriaList([Recorder()]),
                             **base, **make())
        sync()
        end = time.perf_counter()
        doc["cache"].update(kv_device(cache_of(res)))
        generated = int(res.sequences.shape[1]) - a.prompt_len
        del res
    if len(stamps) != a.new_tokens or generated != a.new_tokens:
        raise RuntimeError("expected %d generated tokens and timestamps, got %d tokens, %d timestamps" %
                           (a.new_tokens, generated, len(stamps)))
    doc["generate_seconds"] = end - start
    doc["prefill_tokens"] = a.batch * a.prompt_len
    doc["prefill_seconds"] = stamps[0] - start
    doc["prefill_tok_s"] = doc["prefill_tokens"] / doc["prefill_seconds"] if doc["prefill_seconds"] > 0 else 0.0
    steps = [b - a_ for a_, b in zip(stamps, stamps[1:])]
    doc["decode_steps"] = len(steps)
    doc["step_seconds"] = steps
    doc.update(tpot_figures(steps, a.batch))
    if cuda:
        doc["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20


if __name__ == "__main__":
    sys.exit(main())
