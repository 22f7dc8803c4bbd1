// SPDX-License-Identifier: Apache-2.0
// ws_moe/weights.hpp — model weights in fp32 host memory, loaded by Hugging
// Face tensor name from a checkpoint (widened from bf16/f16 at load, shapes
// checked against the config) or generated from the config alone
// (--random-weights: approximately N(0, initializer_range) matrices, unit
// norms, zero biases, as HF initialises; seeded per tensor name, so a tensor's
// values do not depend on load order or thread count).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "gpu/kernel_math.hpp"
#include "model_config.hpp"
#include "ops.hpp"

namespace ws_moe {

/// A SiLU-gated MLP: down(silu(gate(x)) * up(x)).
struct mlp_weights {
  linear gate, up, down;
};

/// A routed-expert block: router [E][hidden], experts, optional shared experts.
struct moe_weights {
  linear router;
  std::vector<mlp_weights> experts;
  std::optional<mlp_weights> shared;
};

struct ffn_weights {
  bool is_moe = false;
  mlp_weights dense;
  moe_weights moe;
};

/// Qwen3-MoE / Mixtral attention projections (q_norm/k_norm empty for Mixtral).
struct gqa_attention_weights {
  linear q, k, v, o;
  std::vector<float> q_norm, k_norm;
};

/// DeepSeek-V2 MLA projections (q: q_proj, or q_a -> q_a_norm -> q_b when q_lora_rank > 0).
struct mla_attention_weights {
  linear q, q_a, q_b;
  std::vector<float> q_a_norm;
  linear kv_a;                 ///< [kv_lora_rank + rope][hidden]
  std::vector<float> kv_a_norm;
  linear kv_b;                 ///< [H*(nope+v)][kv_lora_rank]: W_UK ‖ W_UV per head
  linear o;                    ///< [hidden][H*v]
};

template <class AttnWeights>
struct layer_weights {
  std::vector<float> input_norm, post_norm;
  AttnWeights attn;
  ffn_weights ffn;
};

template <class AttnWeights>
struct model_weights {
  std::vector<float> embed;  ///< [vocab][hidden]
  std::vector<layer_weights<AttnWeights>> layers;
  std::vector<float> final_norm;
  linear lm_head;            ///< [vocab][hidden] (a copy of embed when tied)
};

/// Where weights come from: a checkpoint, or seeded random values.
class weight_source {
 public:
  /// Reads from `ckpt` (which must outlive this object).
  explicit weight_source(const checkpoint& ckpt) : ckpt_(&ckpt) {}
  /// Random weights: ~N(0, stddev) matrices, ones for norms, zeros for biases.
  weight_source(std::uint64_t seed, double stddev) : seed_(seed), stddev_(stddev) {}

  [[nodiscard]] bool is_random() const noexcept { return ckpt_ == nullptr; }

  /// A [rows][cols] matrix.
  std::vector<float> matrix(const std::string& name, std::int64_t rows, std::int64_t cols) const {
    if (ckpt_) return ckpt_->load_f32(name, {rows, cols});
    return random_normal(name, rows * cols);
  }
  /// A norm weight vector [n] (random mode: ones).
  std::vector<float> norm(const std::string& name, std::int64_t n) const {
    if (ckpt_) return ckpt_->load_f32(name, {n});
    return std::vector<float>(std::size_t(n), 1.0f);
  }
  /// A linear layer "<prefix>.weight" [out][in] (+ "<prefix>.bias" [out] when `bias`).
  linear make_linear(const std::string& prefix, int out, int in, bool bias = false) const {
    linear l;
    l.out = out;
    l.in = in;
    l.weight = matrix(prefix + ".weight", out, in);
    if (bias) l.bias = ckpt_ ? ckpt_->load_f32(prefix + ".bias", {std::int64_t(out)}) : std::vector<float>(std::size_t(out), 0.0f);
    return l;
  }
  mlp_weights make_mlp(const std::string& prefix, const char* gate, const char* up, const char* down, int hidden,
                       int inter) const {
    return {make_linear(prefix + "." + gate, inter, hidden), make_linear(prefix + "." + up, inter, hidden),
            make_linear(prefix + "." + down, hidden, inter)};
  }

 /// The checkpoint (null in random mode).
  [[nodiscard]] const checkpoint* ckpt() const noexcept { return ckpt_; }

  /// Random mode: the counter-based generator's key of tensor `name`; element
  /// i of the tensor is gpu::random_weight(name_hash(name), i, random_scale()),
  /// the same function the CUDA path evaluates on the device.
  [[nodiscard]] std::uint64_t name_hash(const std::string& name) const noexcept {
    std::uint64_t h = seed_ ^ 0x5eedull;
    for (unsigned char c : name) h = gpu::mix64(h ^ c);
    return h;
  }
  /// Random mode: scale of the Irwin-Hall sum (sum of 4 U(0,1): mean 2, variance 4/12).
  [[nodiscard]] float random_scale() const noexcept { return float(stddev_) * std::sqrt(3.0f) / 65536.0f; }

 private:
  // Counter-based: element i depends only on (seed, name, i). Approximately
  // normal: the Irwin-Hall sum of four 16-bit uniforms of one 64-bit hash,
  // scaled to standard deviation `stddev_` (cheap enough for billions of weights).
  std::vector<float> random_normal(const std::string& name, std::int64_t n) const {
    std::vector<float> v(static_cast<std::size_t>(n));
    const std::uint64_t h = name_hash(name);
    const float scale = random_scale();
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) v[std::size_t(i)] = gpu::random_weight(h, i, scale);
    return v;
  }

  const checkpoint* ckpt_ = nullptr;
  std::uint64_t seed_ = 0;
  double stddev_ = 0.02;
};

namespace detail {

inline std::string layer_prefix(int l) { return "model.layers." + std::to_string(l); }

inline ffn_weights load_ffn(const model_config& c, const weight_source& src, int l) {
  ffn_weights f;
  const std::string p = layer_prefix(l);
  const int h = c.hidden_size;
  f.is_moe = c.is_moe_layer(l);
  if (c.kind == arch::mixtral) {
    const std::string m = p + ".block_sparse_moe";
    f.moe.router = src.make_linear(m + ".gate", c.num_experts, h);
    for (int e = 0; e < c.num_experts; ++e)
      f.moe.experts.push_back(src.make_mlp(m + ".experts." + std::to_string(e), "w1", "w3", "w2", h, c.moe_intermediate_size));
    return f;
  }
  const std::string m = p + ".mlp";
  if (!f.is_moe) {
    f.dense = src.make_mlp(m, "gate_proj", "up_proj", "down_proj", h, c.intermediate_size);
    return f;
  }
  f.moe.router = src.make_linear(m + ".gate", c.num_experts, h);
  for (int e = 0; e < c.num_experts; ++e)
    f.moe.experts.push_back(
        src.make_mlp(m + ".experts." + std::to_string(e), "gate_proj", "up_proj", "down_proj", h, c.moe_intermediate_size));
  if (c.kind == arch::deepseek_v2 && c.n_shared_experts > 0)
    f.moe.shared = src.make_mlp(m + ".shared_experts", "gate_proj", "up_proj", "down_proj", h,
                                c.moe_intermediate_size * c.n_shared_experts);
  return f;
}

inline gqa_attention_weights load_attention(const model_config& c, const weight_source& src, int l,
                                            gqa_attention_weights*) {
  gqa_attention_weights a;
  const std::string p = layer_prefix(l) + ".self_attn";
  const int h = c.hidden_size, d = c.head_dim;
  a.q = src.make_linear(p + ".q_proj", c.num_heads * d, h, c.attention_bias);
  a.k = src.make_linear(p + ".k_proj", c.num_kv_heads * d, h, c.attention_bias);
  a.v = src.make_linear(p + ".v_proj", c.num_kv_heads * d, h, c.attention_bias);
  a.o = src.make_linear(p + ".o_proj", h, c.num_heads * d, c.attention_bias);
  if (c.kind == arch::qwen3_moe) {
    a.q_norm = src.norm(p + ".q_norm.weight", d);
    a.k_norm = src.norm(p + ".k_norm.weight", d);
  }
  return a;
}

inline mla_attention_weights load_attention(const model_config& c, const weight_source& src, int l,
                                            mla_attention_weights*) {
  mla_attention_weights a;
  const std::string p = layer_prefix(l) + ".self_attn";
  const int h = c.hidden_size;
  const int qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  if (c.q_lora_rank > 0) {
    a.q_a = src.make_linear(p + ".q_a_proj", c.q_lora_rank, h, c.attention_bias);
    a.q_a_norm = src.norm(p + ".q_a_layernorm.weight", c.q_lora_rank);
    a.q_b = src.make_linear(p + ".q_b_proj", c.num_heads * qk, c.q_lora_rank);
  } else {
    a.q = src.make_linear(p + ".q_proj", c.num_heads * qk, h);
  }
  a.kv_a = src.make_linear(p + ".kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, h, c.attention_bias);
  a.kv_a_norm = src.norm(p + ".kv_a_layernorm.weight", c.kv_lora_rank);
  a.kv_b = src.make_linear(p + ".kv_b_proj", c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
  a.o = src.make_linear(p + ".o_proj", h, c.num_heads * c.v_head_dim, c.attention_bias);
  return a;
}

}  // namespace detail

/// Loads (or generates) every weight of the model described by `c`. Calls
/// `on_layer(l)` after each layer (progress). Throws checkpoint_error for a
/// missing tensor or a wrong shape/dtype, naming the file and the tensor.
template <class AttnWeights>
model_weights<AttnWeights> load_model_weights(const model_config& c, const weight_source& src,
                                              const std::function<void(int)>& on_layer = {}) {
  model_weights<AttnWeights> w;
  const int h = c.hidden_size;
  w.embed = src.matrix("model.embed_tokens.weight", c.vocab_size, h);
  w.layers.resize(std::size_t(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    auto& L = w.layers[std::size_t(l)];
    const std::string p = detail::layer_prefix(l);
    L.input_norm = src.norm(p + ".input_layernorm.weight", h);
    L.post_norm = src.norm(p + ".post_attention_layernorm.weight", h);
    L.attn = detail::load_attention(c, src, l, static_cast<AttnWeights*>(nullptr));
    L.ffn = detail::load_ffn(c, src, l);
    if (on_layer) on_layer(l);
  }
  w.final_norm = src.norm("model.norm.weight", h);
  if (c.tie_word_embeddings) {
    w.lm_head.out = c.vocab_size;
    w.lm_head.in = h;
    w.lm_head.weight = w.embed;
  } else {
    w.lm_head = src.make_linear("lm_head", c.vocab_size, h);
  }
  return w;
}

}  // namespace ws_moe
