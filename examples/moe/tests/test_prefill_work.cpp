// SPDX-License-Identifier: Apache-2.0
// examples/moe/tests/test_prefill_work.cpp — prefill_work_of (ws_moe/prefill_work.hpp)
// against FLOP counts worked out by hand for two small models (the arithmetic is
// in the comments) and against a brute-force count of the causal (query, key)
// pairs.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <vector>

#include "ws_moe/prefill_work.hpp"

using ws_moe::arch;
using ws_moe::index_t;
using ws_moe::model_config;
using ws_moe::prefill_work_of;

namespace {

model_config small_gqa() {  // Qwen3-MoE-like: every layer MoE
  model_config c;
  c.kind = arch::qwen3_moe;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.num_experts = 8;
  c.experts_per_tok = 2;
  c.moe_intermediate_size = 32;
  c.intermediate_size = 96;
  c.vocab_size = 100;
  c.decoder_sparse_step = 1;
  return c;
}

model_config small_mla() {  // DeepSeek-V2-Lite-like: layer 0 dense, two shared experts
  model_config c;
  c.kind = arch::deepseek_v2;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 16;
  c.kv_lora_rank = 32;
  c.q_lora_rank = 0;
  c.num_experts = 8;
  c.experts_per_tok = 2;
  c.moe_intermediate_size = 32;
  c.intermediate_size = 96;
  c.n_shared_experts = 2;
  c.first_k_dense_replace = 1;
  c.vocab_size = 100;
  return c;
}

}  // namespace

TEST_CASE("prefill_work_of: GQA, two prompts, by hand") {
  const std::vector<index_t> prompts{3, 5};  // 8 tokens; causal pairs 6 + 15 = 21 per head and layer
  const auto w = prefill_work_of(small_gqa(), prompts);
  CHECK(w.tokens == 8);
  CHECK(w.attention_flops == doctest::Approx(2 * 2.0 * 21 * 4 * (16 + 16)));  // 10,752
  // q 64x64, k and v 64x32 each, o 64x64: 12,288 multiply-adds per token and layer
  CHECK(w.projection_flops == doctest::Approx(2 * 2.0 * 8 * 12288));         // 393,216
  CHECK(w.router_flops == doctest::Approx(2 * 2.0 * 8 * 64 * 8));            // 16,384
  CHECK(w.routed_rows == 2 * 8 * 2);
  CHECK(w.routed_expert_flops == doctest::Approx(2 * 2.0 * 16 * 3 * 64 * 32));  // 393,216
  CHECK(w.shared_dense_flops == 0.0);
  CHECK(w.lm_head_flops == doctest::Approx(2.0 * 2 * 64 * 100));
  CHECK(w.total_flops() == doctest::Approx(10752.0 + 393216 + 16384 + 393216 + 25600));
}

TEST_CASE("prefill_work_of: MLA (non-absorbed), a dense first layer and shared experts, by hand") {
  const std::vector<index_t> prompts{4};  // 10 causal pairs
  const auto w = prefill_work_of(small_mla(), prompts);
  CHECK(w.attention_flops == doctest::Approx(2 * 2.0 * 10 * 4 * (24 + 16)));  // 6,400
  // q 64 -> 4x24 (6,144), kv_a 64 -> 32+8 (2,560), kv_b 32 -> 4x(16+16) (4,096), o 64 -> 64 (4,096)
  CHECK(w.projection_flops == doctest::Approx(2 * 2.0 * 4 * 16896));  // 270,336
  CHECK(w.router_flops == doctest::Approx(2.0 * 4 * 64 * 8));          // layer 1 only
  CHECK(w.routed_rows == 4 * 2);
  CHECK(w.routed_expert_flops == doctest::Approx(2.0 * 8 * 3 * 64 * 32));
  // layer 0: dense MLP 2 x 4 x 3 x 64 x 96; layer 1: two shared experts 2 x 4 x 2 x 3 x 64 x 32
  CHECK(w.shared_dense_flops == doctest::Approx(147456.0 + 98304.0));
}

TEST_CASE("prefill_work_of: attention equals a brute-force count of causal pairs; empty prompts do no work") {
  model_config c = small_gqa();
  c.num_layers = 1;
  const std::vector<index_t> prompts{1, 2, 63, 64, 65, 0};
  double pairs = 0;
  for (index_t t : prompts)
    for (index_t q = 0; q < t; ++q)
      for (index_t k = 0; k <= q; ++k) pairs += 1;
  const auto w = prefill_work_of(c, prompts);
  CHECK(w.attention_flops == doctest::Approx(2.0 * pairs * c.num_heads * (c.head_dim + c.head_dim)));
  const auto none = prefill_work_of(c, std::vector<index_t>{});
  CHECK(none.total_flops() == 0.0);
  CHECK(none.tokens == 0);
}
