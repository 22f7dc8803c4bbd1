// SPDX-License-Identifier: Apache-2.0
// ws_moe/attention.hpp — the model side of attention for the two layouts:
// everything before the KV cache (projections, norms, RoPE; what the cache
// stores and what the query is) and after it (output projection).
//
// Both blocks reduce a layer's attention to the form the cache attends:
//
//   project  h[n][hidden] -> q[n][Hq][Layout::q_dim] and the KV planes of the
//            layout, token-major [n][kv_heads][Layout::row_elems] (fp32)
//   attend   softmax(scale · q·k) v over the cache (decode: hybrid_attention;
//            prefill: causal_attention over the fp32 planes)
//   output   a[n][Hq][Layout::v_dim] -> y[n][hidden]
//
// GQA (Qwen3-MoE, Mixtral): q = rope(q_norm(q_proj h)), K = rope(k_norm(k_proj h)),
// V = v_proj h; output = o_proj(a). Qwen3's q/k norms are per-head RMSNorms
// over head_dim before RoPE (rotate-half convention).
//
// MLA (DeepSeek-V2) in absorbed form (paper §6.1; docs/ARCHITECTURE.md §1):
//   c      = kv_a_layernorm(kv_a_proj(h)[:rank])      latent, [rank]
//   k_pe   = rope(kv_a_proj(h)[rank:])                shared by all heads, [rope]
//   row    = c ‖ k_pe                                 the one cache row per token
//   q_h    = (q_proj h)_h = q_nope_h ‖ q_pe_h         per head, [nope + rope]
//   q'_h   = q_nope_h · W_UK_h ‖ rope(q_pe_h)          [rank + rope]
//   scores = q'_h · row = q_nope_h·(W_UK_h c) + q_pe_h·k_pe — exactly HF's q·k
//   a_h    = Σ p · c  (the value is the latent)        [rank]
//   out    = o_proj( concat_h W_UV_h a_h )
// with W_UK_h, W_UV_h the [nope][rank] and [v][rank] row blocks of head h in
// kv_b_proj.weight [H·(nope+v)][rank]. The softmax scale is HF's:
// (nope+rope)^-1/2 · mscale(factor, mscale_all_dim)² under YaRN. RoPE is the
// interleaved (complex) convention of HF's DeepseekV2.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <writescope/layout.hpp>

#include "model_config.hpp"
#include "ops.hpp"
#include "weights.hpp"

namespace ws_moe {

/// GQA attention of Qwen3-MoE (with per-head q/k norm) and Mixtral.
template <int HeadDim>
class gqa_attention {
 public:
  using layout_type = writescope::gqa_layout<HeadDim>;
  using weights_type = gqa_attention_weights;
  static constexpr int q_dim = HeadDim;
  static constexpr int v_dim = HeadDim;
  static constexpr int planes = 2;

  explicit gqa_attention(const model_config& c)
      : c_(&c), rope_(c.rope, HeadDim, rotary::style::half), scale_(c.softmax_scale()) {
    if (c.head_dim != HeadDim)
      throw writescope::config_error("gqa_attention<" + std::to_string(HeadDim) + ">: config head_dim " +
                                     std::to_string(c.head_dim));
  }

  [[nodiscard]] layout_type layout() const { return layout_type(c_->num_heads, c_->num_kv_heads); }
  [[nodiscard]] double scale() const noexcept { return scale_; }
  [[nodiscard]] int q_heads() const noexcept { return c_->num_heads; }
  [[nodiscard]] int kv_heads() const noexcept { return c_->num_kv_heads; }

  /// h[n][hidden], pos[n] -> q[n][Hq][D]; planes[0] = K, planes[1] = V, [n][Hkv][D].
  void project(const weights_type& w, const float* h, std::int64_t n, const std::int64_t* pos, float* q,
               float* const* kv) const {
    const int hq = c_->num_heads, hkv = c_->num_kv_heads;
    w.q.forward(h, n, q);
    w.k.forward(h, n, kv[0]);
    w.v.forward(h, n, kv[1]);
    if (!w.q_norm.empty()) {
      rms_norm(q, w.q_norm.data(), n * hq, HeadDim, c_->rms_norm_eps, q);
      rms_norm(kv[0], w.k_norm.data(), n * hkv, HeadDim, c_->rms_norm_eps, kv[0]);
    }
    for (std::int64_t t = 0; t < n; ++t) {
      rope_.apply(q + t * hq * HeadDim, hq, HeadDim, pos[t]);
      rope_.apply(kv[0] + t * hkv * HeadDim, hkv, HeadDim, pos[t]);
    }
  }

  /// Causal attention over a prompt's own fp32 planes: a[T][Hq][D].
  void prefill_attend(const float* q, const float* const* kv, std::int64_t T, float* a) const {
    causal_attention(q, c_->num_heads, HeadDim, kv[0], kv[1], c_->num_kv_heads, std::int64_t(c_->num_kv_heads) * HeadDim,
                     HeadDim, HeadDim, T, scale_, a);
  }

  /// a[n][Hq][D] -> y[n][hidden].
  void output(const weights_type& w, const float* a, std::int64_t n, float* y) const { w.o.forward(a, n, y); }

 private:
  const model_config* c_;
  rotary rope_;
  double scale_;
};

/// DeepSeek-V2 multi-head latent attention in absorbed form.
template <int KvLoraRank, int RopeDim>
class mla_attention {
 public:
  using layout_type = writescope::mla_layout<KvLoraRank, RopeDim>;
  using weights_type = mla_attention_weights;
  static constexpr int q_dim = KvLoraRank + RopeDim;
  static constexpr int v_dim = KvLoraRank;
  static constexpr int planes = 1;

  explicit mla_attention(const model_config& c)
      : c_(&c), rope_(c.rope, RopeDim, rotary::style::interleaved), scale_(c.softmax_scale()) {
    if (c.kv_lora_rank != KvLoraRank || c.qk_rope_head_dim != RopeDim)
      throw writescope::config_error("mla_attention<" + std::to_string(KvLoraRank) + ", " + std::to_string(RopeDim) +
                                     ">: config kv_lora_rank " + std::to_string(c.kv_lora_rank) + ", rope " +
                                     std::to_string(c.qk_rope_head_dim));
  }

  [[nodiscard]] layout_type layout() const { return layout_type(c_->num_heads); }
  [[nodiscard]] double scale() const noexcept { return scale_; }
  [[nodiscard]] int q_heads() const noexcept { return c_->num_heads; }
  [[nodiscard]] int kv_heads() const noexcept { return 1; }

  /// h[n][hidden], pos[n] -> q'[n][H][rank+rope]; planes[0] = rows [n][rank+rope].
  void project(const weights_type& w, const float* h, std::int64_t n, const std::int64_t* pos, float* q,
               float* const* kv) const {
    const int H = c_->num_heads;
    const int nope = c_->qk_nope_head_dim;
    const int qk = nope + RopeDim;
    const int vh = c_->v_head_dim;
    // full queries [n][H][nope+rope]
    std::vector<float>& qf = scratch_q_;
    qf.resize(std::size_t(n * H * qk));
    if (c_->q_lora_rank > 0) {
      std::vector<float>& qa = scratch_a_;
      qa.resize(std::size_t(n * c_->q_lora_rank));
      w.q_a.forward(h, n, qa.data());
      rms_norm(qa.data(), w.q_a_norm.data(), n, c_->q_lora_rank, c_->rms_norm_eps, qa.data());
      w.q_b.forward(qa.data(), n, qf.data());
    } else {
      w.q.forward(h, n, qf.data());
    }
    // absorbed q' = q_nope·W_UK ‖ rope(q_pe)
    using stride_map = Eigen::Map<const row_matrix, 0, Eigen::OuterStride<>>;
    using out_map = Eigen::Map<row_matrix, 0, Eigen::OuterStride<>>;
    for (int hd = 0; hd < H; ++hd) {
      const stride_map qn(qf.data() + std::int64_t(hd) * qk, n, nope, Eigen::OuterStride<>(std::int64_t(H) * qk));
      const cmap wuk(w.kv_b.weight.data() + std::int64_t(hd) * (nope + vh) * KvLoraRank, nope, KvLoraRank);
      out_map qo(q + std::int64_t(hd) * q_dim, n, KvLoraRank, Eigen::OuterStride<>(std::int64_t(H) * q_dim));
      qo.noalias() = qn * wuk;
      for (std::int64_t t = 0; t < n; ++t)
        std::copy_n(qf.data() + (t * H + hd) * qk + nope, RopeDim, q + (t * H + hd) * q_dim + KvLoraRank);
    }
    // cache rows c ‖ rope(k_pe)
    float* rows = kv[0];
    w.kv_a.forward(h, n, rows);
    rms_norm_rows(w.kv_a_norm.data(), rows, n);
    for (std::int64_t t = 0; t < n; ++t) {
      rope_.apply(q + t * H * q_dim + KvLoraRank, H, q_dim, pos[t]);
      rope_.apply(rows + t * q_dim + KvLoraRank, 1, q_dim, pos[t]);
    }
  }

  void prefill_attend(const float* q, const float* const* kv, std::int64_t T, float* a) const {
    causal_attention(q, c_->num_heads, q_dim, kv[0], kv[0], 1, q_dim, 0, v_dim, T, scale_, a);
  }

  /// a[n][H][rank] -> y[n][hidden]: per head W_UV_h a_h, then o_proj.
  void output(const weights_type& w, const float* a, std::int64_t n, float* y) const {
    const int H = c_->num_heads;
    const int nope = c_->qk_nope_head_dim;
    const int vh = c_->v_head_dim;
    std::vector<float>& v = scratch_v_;
    v.resize(std::size_t(n * H * vh));
    using stride_map = Eigen::Map<const row_matrix, 0, Eigen::OuterStride<>>;
    using out_map = Eigen::Map<row_matrix, 0, Eigen::OuterStride<>>;
    for (int hd = 0; hd < H; ++hd) {
      const stride_map ah(a + std::int64_t(hd) * KvLoraRank, n, KvLoraRank, Eigen::OuterStride<>(std::int64_t(H) * KvLoraRank));
      const cmap wuv(w.kv_b.weight.data() + (std::int64_t(hd) * (nope + vh) + nope) * KvLoraRank, vh, KvLoraRank);
      out_map vo(v.data() + std::int64_t(hd) * vh, n, vh, Eigen::OuterStride<>(std::int64_t(H) * vh));
      vo.noalias() = ah * wuv.transpose();
    }
    w.o.forward(v.data(), n, y);
  }

 private:
  // RMSNorm of the latent part of each row in place (row stride q_dim).
  void rms_norm_rows(const float* w, float* rows, std::int64_t n) const {
    for (std::int64_t t = 0; t < n; ++t) rms_norm(rows + t * q_dim, w, 1, KvLoraRank, c_->rms_norm_eps, rows + t * q_dim);
  }

  const model_config* c_;
  rotary rope_;
  double scale_;
  mutable std::vector<float> scratch_q_, scratch_a_, scratch_v_;
};

}  // namespace ws_moe
