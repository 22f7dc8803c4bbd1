// SPDX-License-Identifier: Apache-2.0
// ws_moe/run.hpp — load a model (checkpoint or random weights) and generate,
// with the attention layout picked at run time from the config (docs/ARCHITECTURE.md §6):
//   GQA head_dim in {64, 128, 256}                  (run_gqa.cpp)
//   MLA (kv_lora_rank, rope) in {(512, 64), (128, 32)}  (run_mla.cpp)
// Each instantiation lives in its own translation unit (compile time).
#pragma once

#include <functional>
#include <vector>

#include "decoder.hpp"
#include "model_config.hpp"
#include "runtime_policy.hpp"
#include "weights.hpp"

namespace ws_moe {

/// Hooks for the caller's progress display.
struct load_hooks {
  std::function<void(int layer)> on_layer_loaded;  ///< after each layer's weights
  std::function<void()> on_loaded;                 ///< all weights in memory
};

generation_result run_gqa(const model_config& c, const weight_source& src, const std::vector<std::vector<int>>& prompts,
                          runtime_policy policy, const run_options& o, const load_hooks& hooks);
generation_result run_mla(const model_config& c, const weight_source& src, const std::vector<std::vector<int>>& prompts,
                          runtime_policy policy, const run_options& o, const load_hooks& hooks);

/// Bytes of one token's KV in one layer (bf16), for the roofline defaults.
inline writescope::index_t kv_token_bytes(const model_config& c) {
  if (c.kind == arch::deepseek_v2) return writescope::index_t(c.kv_lora_rank + c.qk_rope_head_dim) * 2;
  return writescope::index_t(2) * c.num_kv_heads * c.head_dim * 2;
}

inline generation_result run_model(const model_config& c, const weight_source& src,
                                   const std::vector<std::vector<int>>& prompts, runtime_policy policy,
                                   const run_options& o, const load_hooks& hooks = {}) {
  return c.kind == arch::deepseek_v2 ? run_mla(c, src, prompts, std::move(policy), o, hooks)
                                     : run_gqa(c, src, prompts, std::move(policy), o, hooks);
}

namespace detail {
template <class Attn>
generation_result load_and_generate(const model_config& c, const weight_source& src,
                                    const std::vector<std::vector<int>>& prompts, runtime_policy policy,
                                    const run_options& o, const load_hooks& hooks) {
  auto w = load_model_weights<typename Attn::weights_type>(c, src, hooks.on_layer_loaded);
  if (hooks.on_loaded) hooks.on_loaded();
  decoder<Attn> d(c, std::move(w));
  generation_result r = d.generate(prompts, std::move(policy), o);
  if constexpr (Attn::layout_type::is_mla)
    r.layout = "mla_layout<" + std::to_string(Attn::layout_type::kv_lora_rank) + ", " +
               std::to_string(Attn::layout_type::rope_dim) + ">";
  else
    r.layout = "gqa_layout<" + std::to_string(Attn::q_dim) + ">";
  return r;
}
}  // namespace detail

}  // namespace ws_moe
