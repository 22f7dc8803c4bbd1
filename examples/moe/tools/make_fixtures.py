#!/usr/bin/env python3
"""Build the Hugging Face reference fixtures of examples/moe.

For each architecture this makes a tiny random-initialised model with
transformers' own classes (Qwen3MoeForCausalLM, MixtralForCausalLM,
DeepseekV2ForCausalLM), saves it with save_pretrained (safetensors, bf16
weights, a few tensors deliberately F32/F16, Mixtral sharded with an index),
reloads it in float32 on the CPU, and runs two ragged prompts greedily for
--new-tokens tokens with the model's own KV cache. It writes, next to the
checkpoint:

  expected.json                prompts, greedy tokens, tolerance, provenance
  expected_logits.safetensors  "logits" F32 [batch][steps][vocab]: the logits
                               that chose each greedy token (step 0 = last
                               prompt position);
                               "logits_bf16_kv": the same run (teacher-forced on
                               those tokens) with the model's KV cache rounded
                               to bf16 as writescope stores it — the prompt
                               attends its own fp32 K/V, every later step reads
                               bf16 K/V (MLA: the latent c_kv and k_pe)

The first isolates nothing: it is transformers as users run it, and the
difference to it is dominated by bf16 KV rounding (--tolerance). The second
removes that rounding, so ws_decode must match it to fp32 noise
(--tolerance-bf16-kv). Seeds are searched so that the bf16-KV run, teacher-forced
on the fp32 greedy tokens, picks the same tokens with a top-1/top-2 gap of at
least --min-margin at every step (so a correct decoder with bf16 KV reproduces
the tokens), and bf16 KV moves no logit by more than --tolerance / 2 (which
rejects seeds where the rounding flips an expert choice).
ws_decode --expect compares against these files.

  pip install torch transformers safetensors numpy
  python3 examples/moe/tools/make_fixtures.py --out examples/moe/fixtures
"""
import argparse
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.1)
NORM_GAIN_SD = 0.1

FIXTURES = {
    # Qwen3-30B-A3B in miniature: GQA 4 q / 1 kv head of 64, per-head q/k norm,
    # softmax top-k router with renormalisation.
    "qwen3_moe": dict(
        cls=Qwen3MoeForCausalLM,
        config=lambda: Qwen3MoeConfig(**COMMON, num_key_value_heads=1, head_dim=64, intermediate_size=64,
                                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        dtypes={}, shard=None),
    # Mixtral-8x7B in miniature: top-2 softmax router; norms stored as F16, the
    # checkpoint sharded with model.safetensors.index.json.
    "mixtral": dict(
        cls=MixtralForCausalLM,
        config=lambda: MixtralConfig(**COMMON, num_key_value_heads=2, head_dim=64, intermediate_size=16,
                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        dtypes={"layernorm.weight": torch.float16, "model.norm.weight": torch.float16}, shard="120KB"),
    # DeepSeek-V2-Lite in miniature: MLA without q LoRA, YaRN (mscale = mscale_all_dim,
    # as V2-Lite), greedy top-k, shared experts, first layer dense; router F32.
    "deepseek_v2": dict(
        cls=DeepseekV2ForCausalLM,
        config=lambda: DeepseekV2Config(**COMMON, num_key_value_heads=4, intermediate_size=64,
                                        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                        n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=128,
                                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16,
                                        topk_method="greedy", routed_scaling_factor=1.0,
                                        max_position_embeddings=64,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 16, "beta_fast": 32,
                                                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
        dtypes={"mlp.gate.weight": torch.float32}, shard=None),
    # DeepSeek-V2 (full) in miniature: q LoRA, group-limited greedy routing,
    # routed_scaling_factor 2, all layers MoE, YaRN with attention_factor != 1.
    "deepseek_v2_qlora": dict(
        cls=DeepseekV2ForCausalLM,
        config=lambda: DeepseekV2Config(**COMMON, num_key_value_heads=4, intermediate_size=64,
                                        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
                                        n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=128,
                                        q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16,
                                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                        routed_scaling_factor=2.0, max_position_embeddings=64,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 16, "beta_fast": 32,
                                                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}),
        dtypes={}, shard=None),
}


def storage_dtype(spec, pname):
    for key, dt in spec["dtypes"].items():
        if key in pname:
            return dt
    return torch.bfloat16


def build(name, spec, seed):
    """A float32 model whose weights hold exactly the values it will be saved with."""
    torch.manual_seed(seed)
    model = spec["cls"](spec["config"]()).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or "layernorm" in pname:
                # HF initialises norms to 1; random gains catch a swapped or missing norm.
                p.copy_(1.0 + NORM_GAIN_SD * torch.randn_like(p))
            p.copy_(p.to(storage_dtype(spec, pname)).float())
    return model


def save(model, spec, out_dir):
    for pname, p in model.named_parameters():
        p.data = p.data.to(storage_dtype(spec, pname))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.save_pretrained(out_dir, **kwargs)
    gen = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)


class bf16_kv_cache:
    """While active, DynamicLayer stores K/V rounded to bf16; a multi-token
    (prefill) call still attends its own fp32 K/V, as ws_decode's prefill does."""

    def __enter__(self):
        from transformers.cache_utils import DynamicLayer
        self.cls, self.orig = DynamicLayer, DynamicLayer.update

        def update(layer, key_states, value_states, *args, **kwargs):
            rk = key_states.to(torch.bfloat16).to(key_states.dtype)
            rv = value_states.to(torch.bfloat16).to(value_states.dtype)
            if not layer.is_initialized:
                layer.lazy_initialization(rk, rv)
            prev_k, prev_v = layer.keys, layer.values
            layer.keys = torch.cat([prev_k, rk], dim=-2)
            layer.values = torch.cat([prev_v, rv], dim=-2)
            if key_states.shape[-2] > 1:
                return torch.cat([prev_k, key_states], dim=-2), torch.cat([prev_v, value_states], dim=-2)
            return layer.keys, layer.values

        DynamicLayer.update = update
        return self

    def __exit__(self, *exc):
        self.cls.update = self.orig


def run(model, prompt, new_tokens, forced=None):
    """Greedy decoding with the model's own cache; `forced` teacher-forces the tokens."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        steps, seq = [], []
        for i in range(new_tokens):
            logits = out.logits[0, -1].float()
            steps.append(logits)
            seq.append(int(logits.argmax()) if forced is None else forced[i])
            if i + 1 == new_tokens:
                break
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            kw = {"cache": cache} if hasattr(out, "cache") else {"past_key_values": cache}
            out = model(input_ids=torch.tensor([[seq[-1]]]), use_cache=True, **kw)
    return seq, torch.stack(steps)


def reference(model, prompts, new_tokens):
    tokens, logits, logits_bf16 = [], [], []
    for prompt in prompts:
        seq, lg = run(model, prompt, new_tokens)
        with bf16_kv_cache():
            _, lg16 = run(model, prompt, new_tokens, forced=seq)
        tokens.append(seq)
        logits.append(lg)
        logits_bf16.append(lg16)
    return tokens, torch.stack(logits).contiguous(), torch.stack(logits_bf16).contiguous()


def margin(logits):
    top2 = logits.topk(2, dim=-1).values
    return float((top2[..., 0] - top2[..., 1]).min())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "fixtures"))
    ap.add_argument("--only", nargs="*", default=list(FIXTURES))
    ap.add_argument("--prompt-lengths", type=int, nargs="*", default=[21, 13])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--min-margin", type=float, default=0.005,
                    help="smallest top-1/top-2 logit gap of the bf16-KV run (vs --tolerance-bf16-kv)")
    ap.add_argument("--tolerance", type=float, default=0.03,
                    help="max |logit - transformers fp32| accepted by ws_decode --expect (docs/DECODERS.md)")
    ap.add_argument("--tolerance-bf16-kv", type=float, default=1e-3,
                    help="max |logit - transformers with bf16 KV| accepted by ws_decode --expect")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tries", type=int, default=200)
    args = ap.parse_args()

    for name in args.only:
        spec = FIXTURES[name]
        out_dir = os.path.join(args.out, name)
        for seed in range(args.seed, args.seed + args.tries):
            g = torch.Generator().manual_seed(10_000 + seed)
            prompts = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in args.prompt_lengths]
            model = build(name, spec, seed)
            model.config._attn_implementation = "eager"
            tokens, logits, logits_bf16 = reference(model, prompts, args.new_tokens)
            kv_effect = float((logits - logits_bf16).abs().max())
            # Greedy decoding with bf16 KV picks the same tokens iff, teacher-forced on them, the
            # bf16-KV logits pick them too; demand a margin there that fp32 noise cannot cross.
            agree = bool((logits_bf16.argmax(-1) == torch.tensor(tokens)).all())
            m = margin(logits_bf16)
            if agree and m >= args.min_margin and kv_effect <= args.tolerance / 2:
                break
            print(f"{name}: seed {seed}: bf16-KV greedy {'agrees' if agree else 'differs'}, margin {m:.4f} "
                  f"(need {args.min_margin}), bf16 KV moves logits by {kv_effect:.4f} (need <= {args.tolerance / 2})",
                  file=sys.stderr)
        else:
            sys.exit(f"{name}: no seed in {args.tries} tries gives a greedy margin >= {args.min_margin}")
        save(model, spec, out_dir)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
        check_tokens, check_logits, _ = reference(reloaded, prompts[:1], 2)
        assert check_tokens[0] == tokens[0][:2] and torch.allclose(check_logits[0], logits[0, :2], rtol=0, atol=1e-5), \
            f"{name}: the saved checkpoint does not reproduce the in-memory model"
        save_file({"logits": logits, "logits_bf16_kv": logits_bf16},
                  os.path.join(out_dir, "expected_logits.safetensors"))
        meta = {
            "model": name,
            "architecture": spec["cls"].__name__,
            "seed": seed,
            "prompts": prompts,
            "greedy_tokens": tokens,
            "logits_file": "expected_logits.safetensors",
            "logit_tolerance": args.tolerance,
            "logit_tolerance_bf16_kv": args.tolerance_bf16_kv,
            "min_greedy_margin_bf16_kv": round(m, 6),
            "bf16_kv_effect": round(kv_effect, 6),
            "max_abs_logit": round(float(logits.abs().max()), 6),
            "reference": "transformers %s, torch %s, float32 on CPU, eager attention, the model's own KV cache; "
                         "weights as saved (bf16, some F32/F16)" % (transformers.__version__, torch.__version__),
            "generated_by": "examples/moe/tools/make_fixtures.py",
        }
        with open(os.path.join(out_dir, "expected.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        size = sum(os.path.getsize(os.path.join(out_dir, x)) for x in os.listdir(out_dir))
        print(f"{name}: seed {seed}, margin {m:.4f}, bf16 KV effect {kv_effect:.4f}, "
              f"max |logit| {meta['max_abs_logit']:.2f}, {size / 1024:.0f} KiB -> {out_dir}")


if __name__ == "__main__":
    main()
