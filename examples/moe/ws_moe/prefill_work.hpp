// SPDX-License-Identifier: Apache-2.0
// examples/moe/ws_moe/prefill_work.hpp — the arithmetic a prefill must do, by
// phase, from the model's shapes and the prompts' lengths.
//
// A phase's lower bound is its work at the rate the GPU reaches for that kind
// of work, measured in the same run (examples/moe/tools/prefill_bounds.py reads
// these figures from ws_decode --json). FLOPs count one multiply-add as 2.
// Useful work only: the padding rows of the batched expert GEMMs, the masked
// half of causal attention tiles and recomputation are not counted.
// The attention is the CUDA path's prefill form: GQA with head_dim for q·k and
// p·v; MLA in its non-absorbed form (q·k over qk_nope + qk_rope, p·v over
// v_head_dim), its K/V expanded from the latent by kv_b (counted with the
// projections).
#pragma once

#include <span>

#include <writescope/config.hpp>

#include "model_config.hpp"

namespace ws_moe {

using writescope::index_t;

struct prefill_work {
  double attention_flops = 0.0;      ///< causal q·k and p·v of every head, layer and prompt
  double projection_flops = 0.0;     ///< q, k, v, o (MLA: q or q_a + q_b, kv_a, kv_b, o) of every token and layer
  double router_flops = 0.0;         ///< the MoE layers' router products
  double routed_expert_flops = 0.0;  ///< routed experts at tokens x top-k rows (gate, up, down)
  double shared_dense_flops = 0.0;   ///< shared experts of the MoE layers and the dense MLP layers
  double lm_head_flops = 0.0;        ///< the LM head of each prompt's last token (its first generated token)
  index_t tokens = 0;                ///< prompt tokens
  index_t routed_rows = 0;           ///< tokens x top-k over the MoE layers

  [[nodiscard]] double total_flops() const noexcept {
    return attention_flops + projection_flops + router_flops + routed_expert_flops + shared_dense_flops + lm_head_flops;
  }
};

/// The prefill work of prompts of the given lengths (tokens each, >= 0) on
/// model c at c.num_layers layers.
inline prefill_work prefill_work_of(const model_config& c, std::span<const index_t> prompt_tokens) {
  prefill_work w;
  const double H = c.hidden_size, hq = c.num_heads;
  double pairs = 0.0;  // causal (query, key) pairs of one head and layer, summed over the prompts
  for (const index_t t : prompt_tokens) {
    w.tokens += t;
    pairs += double(t) * double(t + 1) / 2.0;
  }
  const double T = double(w.tokens);
  const bool mla = c.kind == arch::deepseek_v2;
  const double qk = mla ? double(c.qk_nope_head_dim) + c.qk_rope_head_dim : double(c.head_dim);
  const double vd = mla ? double(c.v_head_dim) : double(c.head_dim);
  double proj = 0.0;  // multiply-adds per token and layer
  if (mla) {
    const double rank = c.kv_lora_rank;
    proj += c.q_lora_rank > 0 ? H * c.q_lora_rank + double(c.q_lora_rank) * hq * qk : H * hq * qk;
    proj += H * (rank + c.qk_rope_head_dim);              // kv_a
    proj += rank * hq * (double(c.qk_nope_head_dim) + vd);  // kv_b: per-head K (nope) and V from the latent
    proj += hq * vd * H;                                   // o
  } else {
    proj += H * hq * qk + 2.0 * H * c.num_kv_heads * qk + hq * qk * H;
  }
  const double expert_macs = 3.0 * H * c.moe_intermediate_size;  // gate, up, down of one row
  for (int l = 0; l < c.num_layers; ++l) {
    w.attention_flops += 2.0 * pairs * hq * (qk + vd);
    w.projection_flops += 2.0 * T * proj;
    if (c.is_moe_layer(l)) {
      w.router_flops += 2.0 * T * H * c.num_experts;
      w.routed_rows += w.tokens * c.experts_per_tok;
      w.routed_expert_flops += 2.0 * T * c.experts_per_tok * expert_macs;
      w.shared_dense_flops += 2.0 * T * c.n_shared_experts * expert_macs;
    } else {
      w.shared_dense_flops += 2.0 * T * 3.0 * H * c.intermediate_size;
    }
  }
  w.lm_head_flops = 2.0 * double(prompt_tokens.size()) * H * c.vocab_size;
  return w;
}

}  // namespace ws_moe
