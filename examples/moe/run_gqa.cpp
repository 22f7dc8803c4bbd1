// SPDX-License-Identifier: Apache-2.0
// GQA instantiations of the decoder (Qwen3-MoE, Mixtral): head_dim 64, 128, 256.
#include "ws_moe/run.hpp"

namespace ws_moe {

generation_result run_gqa(const model_config& c, const weight_source& src, const std::vector<std::vector<int>>& prompts,
                          runtime_policy policy, const run_options& o, const load_hooks& hooks) {
  return writescope::dispatch_head_dim(c.head_dim, [&](auto d) {
    return detail::load_and_generate<gqa_attention<decltype(d)::value>>(c, src, prompts, std::move(policy), o, hooks);
  });
}

}  // namespace ws_moe
