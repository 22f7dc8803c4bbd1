// SPDX-License-Identifier: Apache-2.0
// writescope/presets.hpp — attention geometry of the three models of the paper
// (§7.1), taken from their public Hugging Face config.json files.
//
//   model              layers  attention                                   KV bytes/token/layer
//   Qwen3-30B-A3B          48  GQA 32 q / 4 kv heads, head_dim 128              2048
//   Mixtral-8x7B           32  GQA 32 q / 8 kv heads, head_dim 128              4096
//   DeepSeek-V2-Lite       27  MLA 16 heads, kv_lora_rank 512, rope 64          1152
//                              (qk_nope 128, v_head_dim 128, YaRN factor 40,
//                               mscale_all_dim 0.707)
#pragma once

#include <cmath>
#include <string_view>

#include "layout.hpp"

namespace writescope::presets {

/// A GQA model of head_dim 128: the geometry the two GQA presets share.
template <int Layers, int QHeads, int KvHeads>
struct gqa128_model {
  using layout_type = gqa_layout<128>;
  static constexpr int num_layers = Layers;
  static constexpr int num_q_heads = QHeads;
  static constexpr int num_kv_heads = KvHeads;
  static layout_type layout() { return layout_type(num_q_heads, num_kv_heads); }
  /// head_dim^-1/2.
  static double softmax_scale() { return 1.0 / std::sqrt(128.0); }
};

/// Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, 32 q / 4 kv heads.
struct qwen3_30b_a3b : gqa128_model<48, 32, 4> {
  static constexpr std::string_view name = "Qwen3-30B-A3B";
};

/// Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 32 layers, 32 q / 8 kv heads.
struct mixtral_8x7b : gqa128_model<32, 32, 8> {
  static constexpr std::string_view name = "Mixtral-8x7B";
};

/// DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json), MLA in absorbed form.
struct deepseek_v2_lite {
  using layout_type = mla_layout<512, 64>;
  static constexpr std::string_view name = "DeepSeek-V2-Lite";
  static constexpr int num_layers = 27;
  static constexpr int num_q_heads = 16;
  static constexpr int qk_nope_head_dim = 128;
  static constexpr int qk_rope_head_dim = 64;
  static constexpr int v_head_dim = 128;
  static constexpr double yarn_factor = 40.0;
  static constexpr double yarn_mscale_all_dim = 0.707;
  static layout_type layout() { return layout_type(num_q_heads); }
  /// YaRN attention-magnitude correction, 0.1·mscale_all_dim·ln(factor) + 1.
  static double yarn_mscale() { return 0.1 * yarn_mscale_all_dim * std::log(yarn_factor) + 1.0; }
  /// (qk_nope + qk_rope)^-1/2 · mscale² — the scale DeepSeek applies to q·k; the
  /// absorbed product q'·row equals q·k, so the same scale applies unchanged.
  static double softmax_scale() {
    return yarn_mscale() * yarn_mscale() / std::sqrt(double(qk_nope_head_dim + qk_rope_head_dim));
  }
};

}  // namespace writescope::presets
