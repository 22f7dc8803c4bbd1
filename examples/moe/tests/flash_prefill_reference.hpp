// SPDX-License-Identifier: Apache-2.0
// tests/flash_prefill_reference.hpp — what the flash prefill tests share
// (test_flash_prefill.cpp: the host twin; test_flash_prefill_gpu.cpp: the CUDA
// kernel): the test shapes, random bf16 inputs in a padded layout, and the
// independent fp64 reference (a plain softmax over all keys of the sequence,
// keys after the query excluded, in double) with the comparison.
//
// Layout of a case (elements): q/k/v heads padded by 8 and tokens by 8 more
// (strides stay multiples of 8, as the kernel's 16-byte copies need), out
// heads padded by 2 and tokens by 2; `first_row` unused rows before the first
// sequence. Everything of out and lse outside (sequence row, head, e < dv) must
// stay as poisoned (NaN).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ws_moe/gpu/flash_prefill.hpp"
#include "ws_moe/gpu/kernel_math.hpp"

namespace flash_ref {

using ws_moe::gpu::idx;

struct test_case {
  std::string name;
  int hq, hkv, dqk, dv;
  std::vector<int> lengths;  ///< tokens of each sequence, in row order
  int first_row = 0;         ///< unused rows before the first sequence
  double score_std = 1.0;    ///< standard deviation of the scaled scores (larger: sharper softmax)
};

/// The shapes both tests run: the GQA dims (64 and 128; groups 4, 2, 3, 8 and
/// 12: the kernel's 8, 4, 2 and 1 heads per CTA, several head groups per KV head),
/// MLA (192, 128) and (48, 16), lengths 1, 2, 63, 64, 65 and a ragged batch
/// each; `with_long` adds one sequence of 4097 tokens at d 64, 4 heads over 1.
inline std::vector<test_case> cases(bool with_long) {
  std::vector<test_case> v;
  const struct {
    const char* name;
    int hq, hkv, dqk, dv;
  } shapes[] = {{"gqa d64 hq4 hkv1", 4, 1, 64, 64},      {"gqa d64 hq4 hkv2", 4, 2, 64, 64},
                {"gqa d64 hq6 hkv2", 6, 2, 64, 64},      {"gqa d128 hq8 hkv1", 8, 1, 128, 128},
                {"gqa d128 hq12 hkv1", 12, 1, 128, 128}, {"gqa d128 hq4 hkv2", 4, 2, 128, 128},
                {"mla 192/128 hq2", 2, 2, 192, 128},     {"mla 48/16 hq4", 4, 4, 48, 16}};
  for (const auto& s : shapes) {
    for (int len : {1, 2, 63, 64, 65})
      v.push_back({std::string(s.name) + " len " + std::to_string(len), s.hq, s.hkv, s.dqk, s.dv, {len}, 0, 1.0});
    v.push_back({std::string(s.name) + " ragged", s.hq, s.hkv, s.dqk, s.dv, {17, 1, 0, 130, 64, 2, 95}, 3, 1.0});
  }
  v.push_back({"gqa d128 hq4 hkv1 sharp ragged", 4, 1, 128, 128, {200, 33}, 0, 6.0});
  v.push_back({"mla 192/128 hq1 sharp", 1, 1, 192, 128, {150}, 1, 6.0});
  if (with_long) v.push_back({"gqa d64 hq4 hkv1 len 4097", 4, 1, 64, 64, {4097}, 0, 1.0});
  return v;
}

struct test_data {
  test_case c;
  std::vector<int> offsets;  ///< num_seqs + 1 entries, starting at first_row
  idx tokens = 0;            ///< rows of the buffers (first_row + every sequence)
  int longest = 0;
  idx q_hs = 0, q_ts = 0, k_hs = 0, k_ts = 0, v_hs = 0, v_ts = 0, o_hs = 0, o_ts = 0;
  float scale = 0;
  std::vector<std::uint16_t> q, k, v;  ///< bf16 bits, padding zero
  [[nodiscard]] idx out_elems() const { return tokens * o_ts; }
  [[nodiscard]] idx lse_elems() const { return tokens * c.hq; }

  /// Parameters over the given buffers (host or device) with this layout.
  [[nodiscard]] ws_moe::gpu::flash_prefill_params params(const std::uint16_t* qp, const std::uint16_t* kp,
                                                         const std::uint16_t* vp, float* out, float* lse,
                                                         const int* offs) const {
    ws_moe::gpu::flash_prefill_params p;
    p.q = qp;
    p.k = kp;
    p.v = vp;
    p.out = out;
    p.lse = lse;
    p.seq_offsets = offs;
    p.num_seqs = int(c.lengths.size());
    p.max_seq_tokens = longest;
    p.hq = c.hq;
    p.hkv = c.hkv;
    p.dqk = c.dqk;
    p.dv = c.dv;
    p.q_token_stride = q_ts;
    p.q_head_stride = q_hs;
    p.k_token_stride = k_ts;
    p.k_head_stride = k_hs;
    p.v_token_stride = v_ts;
    p.v_head_stride = v_hs;
    p.o_token_stride = o_ts;
    p.o_head_stride = o_hs;
    p.scale = scale;
    return p;
  }
};

/// Random N(0, 1) bf16 q, k, v in the padded layout; scale = score_std / sqrt(dqk).
inline test_data make_data(const test_case& c, std::uint64_t seed) {
  test_data d;
  d.c = c;
  d.offsets.push_back(c.first_row);
  for (int len : c.lengths) {
    d.offsets.push_back(d.offsets.back() + len);
    d.longest = std::max(d.longest, len);
  }
  d.tokens = d.offsets.back();
  d.q_hs = c.dqk + 8;
  d.q_ts = c.hq * d.q_hs + 8;
  d.k_hs = c.dqk + 8;
  d.k_ts = c.hkv * d.k_hs + 8;
  d.v_hs = c.dv + 8;
  d.v_ts = c.hkv * d.v_hs + 8;
  d.o_hs = c.dv + 2;
  d.o_ts = c.hq * d.o_hs + 2;
  d.scale = float(c.score_std / std::sqrt(double(c.dqk)));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const auto fill = [&](std::vector<std::uint16_t>& x, int heads, int dim, idx hs, idx ts) {
    x.assign(std::size_t(d.tokens * ts), 0);
    for (idx t = 0; t < d.tokens; ++t)
      for (int h = 0; h < heads; ++h)
        for (int e = 0; e < dim; ++e) x[std::size_t(t * ts + h * hs + e)] = ws_moe::gpu::float_to_bf16(nd(rng));
  };
  fill(d.q, c.hq, c.dqk, d.q_hs, d.q_ts);
  fill(d.k, c.hkv, c.dqk, d.k_hs, d.k_ts);
  fill(d.v, c.hkv, c.dv, d.v_hs, d.v_ts);
  return d;
}

/// fp64 reference of every (row, head): out, lse and weight = sum_j p_j |v_j|
/// (per element, the scale of the error that rounding P to bf16 can cause).
struct reference {
  std::vector<double> out, weight;  ///< [tokens][hq][dv], dense
  std::vector<double> lse;          ///< [tokens][hq]
  double max_abs_v = 0;
};

inline reference compute_reference(const test_data& d) {
  const test_case& c = d.c;
  reference r;
  r.out.assign(std::size_t(d.tokens * c.hq * c.dv), 0.0);
  r.weight.assign(r.out.size(), 0.0);
  r.lse.assign(std::size_t(d.tokens * c.hq), 0.0);
  for (std::uint16_t b : d.v) r.max_abs_v = std::max(r.max_abs_v, double(std::fabs(ws_moe::gpu::bf16_to_float(b))));
  const auto val = [](const std::vector<std::uint16_t>& x, idx i) { return double(ws_moe::gpu::bf16_to_float(x[std::size_t(i)])); };
  const int group = c.hq / c.hkv;
  for (std::size_t s = 0; s + 1 < d.offsets.size(); ++s) {
    const idx start = d.offsets[s], len = d.offsets[s + 1] - start;
    if (len <= 0) continue;
    const idx rows = len * c.hq;
#pragma omp parallel for schedule(dynamic, 4)
    for (idx rh = 0; rh < rows; ++rh) {
      const idx t = rh / c.hq;
      const int h = int(rh % c.hq), g = h / group;
      std::vector<double> w(static_cast<std::size_t>(len));
      double mx = -std::numeric_limits<double>::infinity();
      for (idx j = 0; j < len; ++j) {  // every key of the sequence; those after t get weight 0
        double dot = -std::numeric_limits<double>::infinity();
        if (j <= t) {
          dot = 0.0;
          for (int e = 0; e < c.dqk; ++e)
            dot += val(d.q, (start + t) * d.q_ts + h * d.q_hs + e) * val(d.k, (start + j) * d.k_ts + g * d.k_hs + e);
          dot *= double(d.scale);
        }
        w[std::size_t(j)] = dot;
        mx = std::max(mx, dot);
      }
      double sum = 0.0;
      for (double& x : w) {
        x = std::exp(x - mx);
        sum += x;
      }
      const std::size_t o = std::size_t(((start + t) * c.hq + h) * c.dv);
      for (idx j = 0; j < len; ++j) {
        const double p = w[std::size_t(j)] / sum;
        for (int e = 0; e < c.dv; ++e) {
          const double x = val(d.v, (start + j) * d.v_ts + g * d.v_hs + e);
          r.out[o + std::size_t(e)] += p * x;
          r.weight[o + std::size_t(e)] += p * std::fabs(x);
        }
      }
      r.lse[std::size_t((start + t) * c.hq + h)] = mx + std::log(sum);
    }
  }
  return r;
}

/// Result of comparing an implementation's out/lse with the reference.
struct comparison {
  double worst_ratio = 0;       ///< max over elements of |out - ref| / tolerance (pass: <= 1)
  double max_abs_err = 0;
  double worst_lse_ratio = 0;   ///< likewise for lse (0 when lse was not requested)
  idx not_finite = 0;           ///< elements that should hold a value and do not
  idx overwritten = 0;          ///< poisoned elements (padding, rows outside sequences) no longer NaN
  std::string first_problem;    ///< where the worst element is, for the failure message
};

/// Element (token, head, e) passes when |out - ref| <= rel_tol * weight +
/// abs_tol * max|v|; lse when |lse - ref| <= lse_tol * (1 + |ref|). `lse` may
/// be empty (not requested); then lse is not compared.
inline comparison compare(const test_data& d, const reference& r, const std::vector<float>& out,
                          const std::vector<float>& lse, double rel_tol, double abs_tol, double lse_tol) {
  const test_case& c = d.c;
  comparison cmp;
  std::vector<char> in_seq(std::size_t(d.tokens), 0);
  for (std::size_t s = 0; s + 1 < d.offsets.size(); ++s)
    for (int t = d.offsets[s]; t < d.offsets[s + 1]; ++t) in_seq[std::size_t(t)] = 1;
  for (idx i = 0; i < idx(out.size()); ++i) {
    const idx t = i / d.o_ts, rem = i % d.o_ts;
    const idx h = rem / d.o_hs, e = rem % d.o_hs;
    const bool live = t < d.tokens && in_seq[std::size_t(t)] && h < c.hq && e < c.dv;
    const float x = out[std::size_t(i)];
    if (!live) {
      if (!std::isnan(x)) ++cmp.overwritten;
      continue;
    }
    if (!std::isfinite(x)) {
      ++cmp.not_finite;
      continue;
    }
    const std::size_t ri = std::size_t((t * c.hq + h) * c.dv + e);
    const double err = std::fabs(double(x) - r.out[ri]);
    const double tol = rel_tol * r.weight[ri] + abs_tol * r.max_abs_v;
    cmp.max_abs_err = std::max(cmp.max_abs_err, err);
    if (err / tol > cmp.worst_ratio) {
      cmp.worst_ratio = err / tol;
      cmp.first_problem = "token " + std::to_string(t) + " head " + std::to_string(h) + " elem " + std::to_string(e) +
                          ": got " + std::to_string(x) + ", fp64 " + std::to_string(r.out[ri]);
    }
  }
  for (idx i = 0; i < idx(lse.size()); ++i) {
    const idx t = i / c.hq;
    const float x = lse[std::size_t(i)];
    if (!(t < d.tokens && in_seq[std::size_t(t)])) {
      if (!std::isnan(x)) ++cmp.overwritten;
      continue;
    }
    if (!std::isfinite(x)) {
      ++cmp.not_finite;
      continue;
    }
    const double err = std::fabs(double(x) - r.lse[std::size_t(i)]);
    cmp.worst_lse_ratio = std::max(cmp.worst_lse_ratio, err / (lse_tol * (1.0 + std::fabs(r.lse[std::size_t(i)]))));
  }
  return cmp;
}

}  // namespace flash_ref
