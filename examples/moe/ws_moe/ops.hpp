// SPDX-License-Identifier: Apache-2.0
// ws_moe/ops.hpp — the host (fp32) building blocks of the decoders: linear
// layers (Eigen), RMSNorm, SiLU, rotary embeddings (plain, linear, YaRN; the
// rotate-half and interleaved conventions) and causal prefill attention.
//
// Numerics follow Hugging Face transformers in float32: RMSNorm computes the
// mean square in fp32-or-better and multiplies by the weight after
// normalising; RoPE frequencies are computed in fp32 like torch; prefill
// attention is fp32 GEMMs with the softmax sum in double, a difference far
// below the bf16 KV rounding the decode path adds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <writescope/detail/simd_include.hpp>
#include <Eigen/Dense>

#include <writescope/error.hpp>

#include "model_config.hpp"

namespace ws_moe {

using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using cmap = Eigen::Map<const row_matrix>;
using mmap_ = Eigen::Map<row_matrix>;

/// A linear layer y = x·Wᵀ (+ b), W row-major [out][in] as PyTorch stores it.
///
/// Computed as yᵀ = W·xᵀ so that W is the GEMM's left operand, streamed once
/// through Eigen's packing, which stays near memory bandwidth for the few rows
/// of a decode step. Threading: the output features are split into chunks over
/// the OpenMP team (each chunk single-threaded Eigen), never Eigen's own GEMM
/// threads — they spin-synchronise and stall on small or shared machines.
/// Inside a parallel region it runs on the calling thread.
struct linear {
  std::vector<float> weight;  ///< [out][in]
  std::vector<float> bias;    ///< [out] or empty
  int out = 0;
  int in = 0;

  /// y[n][out] = x[n][in]·Wᵀ + b. x and y must not alias.
  void forward(const float* x, std::int64_t n, float* y) const {
    if (n == 0) return;
    using col_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
    using yt_map = Eigen::Map<col_matrix, 0, Eigen::OuterStride<>>;
    const std::int64_t chunk = 256;
    const std::int64_t chunks = (out + chunk - 1) / chunk;
    const Eigen::Map<const col_matrix> Xt(x, in, n);  // xᵀ [in][n]
#pragma omp parallel for schedule(static)
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t o0 = c * chunk;
      const std::int64_t len = std::min<std::int64_t>(chunk, out - o0);
      // yᵀ[o0:o0+len][n] = W[o0:o0+len]·xᵀ: W is the GEMM's streamed left operand
      const cmap W(weight.data() + o0 * in, len, in);
      yt_map Yt(y + o0, len, n, Eigen::OuterStride<>(out));
      Yt.noalias() = W * Xt;
    }
    if (!bias.empty())
      for (std::int64_t r = 0; r < n; ++r)
        for (int o = 0; o < out; ++o) y[r * out + o] += bias[std::size_t(o)];
  }
};

/// y = x / sqrt(mean(x²) + eps) · w, row by row ([n][dim]); y may alias x.
inline void rms_norm(const float* x, const float* w, std::int64_t n, int dim, double eps, float* y) {
  for (std::int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0.0;
    for (int i = 0; i < dim; ++i) ss += double(xr[i]) * double(xr[i]);
    const float inv = float(1.0 / std::sqrt(ss / dim + eps));
    for (int i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

[[nodiscard]] inline float silu(float x) noexcept { return x / (1.0f + std::exp(-x)); }

/// Rotary embedding tables for one rotated width `dim` (even).
/// Style: rotate_half pairs (i, i + dim/2) (Llama, Qwen3, Mixtral); interleaved
/// pairs (2i, 2i+1) (DeepSeek-V2's complex form). cos/sin include HF's
/// attention_factor (YaRN), as HF multiplies it into both.
class rotary {
 public:
  enum class style { half, interleaved };

  rotary() = default;
  rotary(const rope_config& rc, int dim, style st) : dim_(dim), style_(st) {
    if (dim <= 0 || dim % 2 != 0) throw writescope::config_error("rope: rotated width " + std::to_string(dim) + " must be positive and even");
    const int half = dim / 2;
    inv_freq_.resize(std::size_t(half));
    // torch: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), in fp32
    for (int i = 0; i < half; ++i) {
      const float e = float(2 * i) / float(dim);
      inv_freq_[std::size_t(i)] = 1.0f / std::pow(float(rc.theta), e);
    }
    if (rc.type == "linear") {
      for (float& f : inv_freq_) f /= float(rc.factor);
    } else if (rc.type == "yarn") {
      yarn(rc, dim);
    }
  }

  [[nodiscard]] int dim() const noexcept { return dim_; }
  [[nodiscard]] float attention_factor() const noexcept { return attention_factor_; }
  /// Inverse frequencies [dim/2] (fp32, after linear / YaRN scaling).
  [[nodiscard]] const std::vector<float>& inv_freq() const noexcept { return inv_freq_; }
  [[nodiscard]] bool interleaved() const noexcept { return style_ == style::interleaved; }

  /// Rotates `heads` consecutive vectors of `dim_` elements (stride `stride`) at position `pos`.
  void apply(float* x, int heads, std::int64_t stride, std::int64_t pos) const {
    const int half = dim_ / 2;
    thread_local std::vector<float> c, s;
    c.resize(std::size_t(half));
    s.resize(std::size_t(half));
    for (int i = 0; i < half; ++i) {
      const float angle = float(pos) * inv_freq_[std::size_t(i)];  // fp32 like torch
      c[std::size_t(i)] = float(std::cos(double(angle))) * attention_factor_;
      s[std::size_t(i)] = float(std::sin(double(angle))) * attention_factor_;
    }
    for (int h = 0; h < heads; ++h) {
      float* v = x + h * stride;
      if (style_ == style::half) {
        for (int i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[std::size_t(i)] - b * s[std::size_t(i)];
          v[i + half] = b * c[std::size_t(i)] + a * s[std::size_t(i)];
        }
      } else {
        for (int i = 0; i < half; ++i) {
          const float a = v[2 * i], b = v[2 * i + 1];
          v[2 * i] = a * c[std::size_t(i)] - b * s[std::size_t(i)];
          v[2 * i + 1] = b * c[std::size_t(i)] + a * s[std::size_t(i)];
        }
      }
    }
  }

 private:
  // HF _compute_yarn_parameters.
  void yarn(const rope_config& rc, int dim) {
    const double base = rc.theta;
    const double factor = rc.factor;
    auto get_mscale = [](double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    if (rc.attention_factor) {
      attention_factor_ = float(*rc.attention_factor);
    } else if (rc.mscale != 0.0 && rc.mscale_all_dim != 0.0) {
      attention_factor_ = float(get_mscale(factor, rc.mscale) / get_mscale(factor, rc.mscale_all_dim));
    } else {
      attention_factor_ = float(get_mscale(factor, 1.0));
    }
    const double pi = 3.14159265358979323846;
    auto correction_dim = [&](double rot) {
      return (dim * std::log(rc.original_max_position_embeddings / (rot * 2 * pi))) / (2 * std::log(base));
    };
    double low = correction_dim(rc.beta_fast), high = correction_dim(rc.beta_slow);
    if (rc.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    const int half = dim / 2;
    for (int i = 0; i < half; ++i) {
      const float pos_freq = std::pow(float(base), float(2 * i) / float(dim));
      const float extrap = 1.0f / pos_freq;
      const float interp = 1.0f / (float(factor) * pos_freq);
      const float ramp = std::clamp(float((double(i) - low) / (high - low)), 0.0f, 1.0f);
      const float extrap_factor = 1.0f - ramp;
      inv_freq_[std::size_t(i)] = interp * (1.0f - extrap_factor) + extrap * extrap_factor;
    }
  }

  int dim_ = 0;
  style style_ = style::half;
  std::vector<float> inv_freq_;
  float attention_factor_ = 1.0f;
};

/// Causal attention of one sequence's prompt, fp32 (as HF in float32):
///   q    [T][hq][q_dim] dense
///   k, v KV head g of token j at k + j*token_stride + g*head_stride (q_dim
///        elements of K, the first v_dim elements of V are used)
///   out  [T][hq][v_dim]
/// Query head h reads KV head h / (hq / hkv). Token t attends tokens 0..t.
/// MLA in absorbed form is hkv = 1 with v = k (the latent is the value).
/// Work: per (query head, block of query_block rows) one score GEMM against the
/// keys up to the block's last row, a masked row softmax, one GEMM with V;
/// parallel over the (head, block) pairs. Memory: query_block x T scores per thread.
inline void causal_attention(const float* q, int hq, int q_dim, const float* k, const float* v, int hkv,
                             std::int64_t token_stride, std::int64_t head_stride, int v_dim, std::int64_t T,
                             double scale, float* out) {
  using stride_map = Eigen::Map<const row_matrix, 0, Eigen::OuterStride<>>;
  using out_map = Eigen::Map<row_matrix, 0, Eigen::OuterStride<>>;
  constexpr std::int64_t query_block = 128;
  const int group = hq / hkv;
  const std::int64_t blocks = (T + query_block - 1) / query_block;
  const std::int64_t tasks = std::int64_t(hq) * blocks;
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t task = 0; task < tasks; ++task) {
    const int h = int(task / blocks);
    const std::int64_t t0 = (task % blocks) * query_block;
    const std::int64_t rows = std::min(query_block, T - t0);
    const std::int64_t keys = t0 + rows;  // causal: this block sees tokens [0, t0 + rows)
    const std::int64_t off = std::int64_t(h / group) * head_stride;
    const stride_map Q(q + (t0 * hq + h) * std::int64_t(q_dim), rows, q_dim, Eigen::OuterStride<>(std::int64_t(hq) * q_dim));
    const stride_map K(k + off, keys, q_dim, Eigen::OuterStride<>(token_stride));
    const stride_map V(v + off, keys, v_dim, Eigen::OuterStride<>(token_stride));
    thread_local row_matrix S;
    S.resize(rows, keys);
    S.noalias() = Q * K.transpose();
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t valid = t0 + r + 1;
      float* srow = S.data() + r * keys;
      float m = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = 0; j < valid; ++j) m = std::max(m, srow[j] * float(scale));
      double sum = 0.0;
      for (std::int64_t j = 0; j < valid; ++j) sum += srow[j] = std::exp(srow[j] * float(scale) - m);
      const float inv = float(1.0 / sum);
      for (std::int64_t j = 0; j < valid; ++j) srow[j] *= inv;
      for (std::int64_t j = valid; j < keys; ++j) srow[j] = 0.0f;
    }
    out_map O(out + (t0 * hq + h) * std::int64_t(v_dim), rows, v_dim, Eigen::OuterStride<>(std::int64_t(hq) * v_dim));
    O.noalias() = S * V;
  }
}

}  // namespace ws_moe
