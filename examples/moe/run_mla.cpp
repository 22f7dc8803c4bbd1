// SPDX-License-Identifier: Apache-2.0
// MLA instantiations of the decoder (DeepSeek-V2): (kv_lora_rank, rope) =
// (512, 64) — DeepSeek-V2 and V2-Lite — and (128, 32) for small test models.
#include "ws_moe/run.hpp"

namespace ws_moe {

generation_result run_mla(const model_config& c, const weight_source& src, const std::vector<std::vector<int>>& prompts,
                          runtime_policy policy, const run_options& o, const load_hooks& hooks) {
  if (c.kv_lora_rank == 512 && c.qk_rope_head_dim == 64)
    return detail::load_and_generate<mla_attention<512, 64>>(c, src, prompts, std::move(policy), o, hooks);
  if (c.kv_lora_rank == 128 && c.qk_rope_head_dim == 32)
    return detail::load_and_generate<mla_attention<128, 32>>(c, src, prompts, std::move(policy), o, hooks);
  throw writescope::config_error("MLA kv_lora_rank " + std::to_string(c.kv_lora_rank) + " with qk_rope_head_dim " +
                                 std::to_string(c.qk_rope_head_dim) +
                                 " is not supported; supported: 512/64 (DeepSeek-V2, V2-Lite), 128/32 (small test models)");
}

}  // namespace ws_moe
