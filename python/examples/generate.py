#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate with a local HF checkpoint and a WriteScopeCache; print the text, tokens/s and the split.

    python python/examples/generate.py /models/Qwen3-30B-A3B --prompt "Explain PCIe in two lines." \\
        --prompt "What is a KV cache?" --max-new-tokens 128 --policy roofline

The checkpoint directory holds the model's config, weights and tokenizer (nothing is
downloaded: local files only). Prompts go through the tokenizer's chat template and are
left-padded into one batch. --calibration takes a file written by bench/calibrate (the
entry of --preset and the batch, or the nearest batch below it).
"""

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from writescope.hf import WriteScopeCache

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class StepClock(LogitsProcessor):
    """Records when each step's logits are ready (the first: the end of the prefill)."""

    def __init__(self, device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def load_model(path, dtype, device, **kw):
    """from_pretrained onto `device`: through device_map where accelerate is installed, else load and move."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                    attn_implementation="writescope", device_map=str(device), **kw)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                 attn_implementation="writescope", **kw)
    return model.to(device)


def calibration_from(path, preset, batch):
    doc = json.load(open(path))
    entries = [e for e in doc.get("entries", []) if e.get("preset", "").lower() == preset.lower()]
    if not entries:
        sys.exit(f"{path}: no entry for preset {preset!r} (has {sorted({e.get('preset') for e in doc.get('entries', [])})})")
    below = [e for e in entries if e.get("batch", 0) <= batch]
    e = max(below, key=lambda e: e["batch"]) if below else min(entries, key=lambda e: e["batch"])
    keys = ("cpu_cost_per_token_seconds", "gpu_cost_per_token_seconds", "cpu_fixed_seconds", "gpu_fixed_seconds",
            "launch_cost_per_token_seconds")
    return {k: float(e[k]) for k in keys if k in e}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="local directory with config, weights and tokenizer")
    ap.add_argument("--prompt", action="append", help="a user message (repeat for a batch)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--policy", default="roofline", help="roofline, gpu_only, cpu_only, or a CPU share r in [0, 1]")
    ap.add_argument("--calibration", help="calibration file of bench/calibrate (roofline)")
    ap.add_argument("--preset", default="Qwen3-30B-A3B", help="the calibration entry's preset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--d-window", type=int, default=256, help="D: the D-window and eviction batch, tokens")
    ap.add_argument("--max-cache-len", type=int, help="tokens per sequence (default: prompt + new tokens)")
    ap.add_argument("--cpu-threads", type=int, default=0, help="CPU attention threads (0: cores - 1)")
    ap.add_argument("--sample", action="store_true", help="sample (the checkpoint's generation config) instead of greedy")
    args = ap.parse_args()
    prompts = args.prompt or ["Explain in three sentences why a KV cache grows with the context."]
    policy = float(args.policy) if args.policy.replace(".", "", 1).isdigit() else args.policy

    device = torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = load_model(args.checkpoint, DTYPES[args.dtype], device).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    inputs = tok(texts, return_tensors="pt", padding=True).to(device)
    prompt_len = inputs["input_ids"].shape[1]
    calibration = calibration_from(args.calibration, args.preset, len(prompts)) if args.calibration else None
    cache = WriteScopeCache(model, policy=policy, calibration=calibration, max_batch_size=len(prompts),
                            max_cache_len=args.max_cache_len or prompt_len + args.max_new_tokens,
                            block_tokens=args.block_tokens, d_window_tokens=args.d_window, cpu_threads=args.cpu_threads)
    clock = StepClock(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=args.max_new_tokens,
                             do_sample=args.sample, logits_processor=LogitsProcessorList([clock]),
                             pad_token_id=tok.pad_token_id)
    t_end = time.perf_counter()
    for i, p in enumerate(prompts):
        print(f"--- prompt {i}: {p}")
        print(tok.decode(out[i, prompt_len:], skip_special_tokens=True).strip())
    steps = len(clock.times)
    ttft = clock.times[0] - t0 if steps else float("nan")
    decode_s = clock.times[-1] - clock.times[0] if steps > 1 else float("nan")
    batch = len(prompts)
    print("---")
    print(f"prefill: {batch} x {prompt_len} tokens (padded) in {ttft:.3f} s")
    if steps > 1:
        print(f"decode: {steps - 1} steps x {batch} sequences in {decode_s:.3f} s = "
              f"{(steps - 1) * batch / decode_s:.1f} tok/s ({decode_s / (steps - 1) * 1e3:.1f} ms per step)")
    print(f"total: {t_end - t0:.3f} s")
    s = cache.split()
    print(f"split: {s['cpu_tokens']} tokens on the CPU (unpinned), {s['pinned_tokens']} streamed (pinned), "
          f"CPU share {s['cpu_share']:.3f}, policy {cache.policy} target {s['target_share']:.3f}; "
          f"the newest < {args.d_window} tokens of each sequence in the D-window")


if __name__ == "__main__":
    main()
