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

ARCHS = ("qwen3_moe", "mixtral", "llama", "qwen2")


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
    raise ValueError(arch)


def tiny_model(arch, dtype=torch.float32, device="cpu", seed=0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **over), attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


def _sdpa_bf16_kv(module, query, key, value, attention_mask, **kwargs):
    """The reference for float32 models: SDPA whose decode steps read bf16-rounded K/V, i.e.
    DynamicCache + SDPA with writescope's KV precision (prompts attend the K/V as computed,
    as the "writescope" attention's prefill does)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == 1:
        key = key.to(torch.bfloat16).to(key.dtype)
        value = value.to(torch.bfloat16).to(value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_reference_attention():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("sdpa_bf16_kv", _sdpa_bf16_kv)
    AttentionMaskInterface.register("sdpa_bf16_kv", sdpa_mask)


register_reference_attention()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param
