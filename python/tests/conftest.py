# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: tiny random models of each supported architecture, built by
transformers from configs (no hub, no network), and the backends to test.

CI runs the host backend (2 cores: one torch thread, one CPU-engine thread besides the
emulated device's worker); on a GPU machine with a CUDA build the same tests also run on
the CUDA backend (WRITESCOPE_TEST_BACKENDS=host,cuda by default there)."""

import os

import pytest
import torch

torch.set_num_threads(1)

import writescope  # noqa: E402

ARCHS = ("qwen3_moe", "mixtral", "llama", "qwen2", "deepseek_v2")


def backends():
    want = os.environ.get("WRITESCOPE_TEST_BACKENDS")
    if want:
        return [b for b in want.split(",") if b]
    have = ["host"]
    if writescope.cuda_built() and torch.cuda.is_available():
        have.append("cuda")
    return have


BACKENDS = backends()


def device_of(backend):
    return torch.device("cuda") if backend == "cuda" else torch.device("cpu")


def tiny_config(arch, **over):
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                  initializer_range=0.1, tie_word_embeddings=False)
    common.update(over)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, **common)
    if arch == "mixtral":
        return tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch in ("deepseek_v2", "deepseek_v2_qlora"):
        # MLA at the instantiated latent size (kv_lora_rank 512, rope 64, as DeepSeek-V2-Lite)
        for k in ("head_dim", "num_key_value_heads"):
            common.pop(k)
        mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                   q_lora_rank=96 if arch.endswith("qlora") else None, n_routed_experts=4, n_shared_experts=1,
                   num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1)
        mla.update({k: common.pop(k) for k in list(common) if k in mla})
        return tf.DeepseekV2Config(**mla, **common)
    raise ValueError(arch)


def tiny_model(arch, dtype=torch.float32, device="cpu", seed=0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **over), attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


def bf16_kv_dynamic_cache():
    """The reference for float32 models: DynamicCache + SDPA whose decode steps read the cached
    K/V rounded to bf16 (GQA: K and V; MLA: the latent rows), i.e. with writescope's KV
    precision; prompts attend the K/V as computed, as the "writescope" attention's prefill does."""
    from transformers import DynamicCache

    class Bf16KVDynamicCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if key_states.shape[2] == 1:
                keys = keys.to(torch.bfloat16).to(keys.dtype)
                values = values.to(torch.bfloat16).to(values.dtype)
            return keys, values

    return Bf16KVDynamicCache()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param
