// SPDX-License-Identifier: Apache-2.0
// writescope/reference.hpp — fp64 reference attention (Eigen), independent of
// the cache, the kernels and the merge. For tests, examples and for engines
// that want to check an integration. Host only.
//
// Inputs are the exact values the library sees (bf16 KV widened exactly; fp32
// queries); every product and sum is double; LSE is natural log.
#pragma once

#include <cmath>
#include <limits>
#include <span>

#include "detail/simd_include.hpp"
#include <Eigen/Dense>

#include "bf16.hpp"
#include "config.hpp"

namespace writescope::reference {

using matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using vector = Eigen::VectorXd;

/// Widens `rows`×`cols` bf16 values (row r at data + r*stride) to a double matrix.
inline matrix widen(const bf16* data, index_t rows, index_t cols, index_t stride) {
  matrix m(rows, cols);
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) m(r, c) = double(data[r * stride + c].to_float());
  return m;
}

/// softmax(scale · K q) V for one query row: o [v_cols], returns the LSE.
/// K: [L][d], V: [L][v]. L = 0 gives o = 0, LSE = -inf.
inline double attend(const matrix& k, const matrix& v, const vector& q, double scale, double* o) {
  const index_t L = k.rows();
  if (L == 0) {
    for (index_t i = 0; i < v.cols(); ++i) o[i] = 0.0;
    return -std::numeric_limits<double>::infinity();
  }
  const vector s = (k * q) * scale;
  const double m = s.maxCoeff();
  const vector p = (s.array() - m).exp().matrix();
  const double sum = p.sum();
  const Eigen::RowVectorXd out = (p.transpose() * v) / sum;
  for (index_t i = 0; i < v.cols(); ++i) o[i] = out(i);
  return m + std::log(sum);
}

/// GQA decode attention of one sequence, fp64.
///   q [hq][d] fp32; k, v token-major [L][hkv][d] bf16; o [hq][d]; lse [hq].
/// Query head h reads KV head h / (hq / hkv).
inline void gqa_decode(int hq, int hkv, int d, const float* q, const bf16* k, const bf16* v, index_t L, double scale,
                       double* o, double* lse) {
  const int group = hq / hkv;
  for (int j = 0; j < hkv; ++j) {
    // L = 0: k and v may be null, and offsetting a null pointer is UB (UBSan).
    const matrix K = widen(L > 0 ? k + index_t(j) * d : k, L, d, index_t(hkv) * d);
    const matrix Vm = widen(L > 0 ? v + index_t(j) * d : v, L, d, index_t(hkv) * d);
    for (int g = 0; g < group; ++g) {
      const int h = j * group + g;
      vector qv(d);
      for (int i = 0; i < d; ++i) qv(i) = double(q[index_t(h) * d + i]);
      lse[h] = attend(K, Vm, qv, scale, o + index_t(h) * d);
    }
  }
}

/// MLA decode in absorbed form, fp64: rows [L][rank+rope] (c_kv ‖ k_pe),
/// q' [h][rank+rope]; output in latent space o [h][rank] (values = c_kv).
inline void mla_absorbed_decode(int heads, int rank, int rope, const float* q, const bf16* rows, index_t L,
                                double scale, double* o, double* lse) {
  const matrix K = widen(rows, L, rank + rope, rank + rope);
  const matrix Vm = K.leftCols(rank);
  for (int h = 0; h < heads; ++h) {
    vector qv(rank + rope);
    for (int i = 0; i < rank + rope; ++i) qv(i) = double(q[index_t(h) * (rank + rope) + i]);
    lse[h] = attend(K, Vm, qv, scale, o + index_t(h) * rank);
  }
}

/// MLA decode in the original, non-absorbed form (DeepSeek-V2), fp64: per head
/// k_h = [W_UK[h] c_kv ‖ k_pe], v_h = W_UV[h] c_kv, score = scale·(q_nope·k_nope + q_pe·k_pe).
///   q_nope [h][nope], q_pe [h][rope] fp32; c_kv [L][rank], k_pe [L][rope] bf16
///   (given as rows [L][rank+rope]); w_uk [h][nope][rank], w_uv [h][v][rank] double;
///   o [h][v_dim]; lse [h].
inline void mla_decode(int heads, int rank, int rope, int nope, int v_dim, const float* q_nope, const float* q_pe,
                       const bf16* rows, index_t L, const double* w_uk, const double* w_uv, double scale, double* o,
                       double* lse) {
  const matrix C = widen(rows, L, rank, rank + rope);
  const matrix P = widen(L > 0 ? rows + rank : rows, L, rope, rank + rope);
  for (int h = 0; h < heads; ++h) {
    Eigen::Map<const matrix> uk(w_uk + index_t(h) * nope * rank, nope, rank);
    Eigen::Map<const matrix> uv(w_uv + index_t(h) * v_dim * rank, v_dim, rank);
    matrix K(L, nope + rope);
    K.leftCols(nope) = C * uk.transpose();
    K.rightCols(rope) = P;
    const matrix Vm = C * uv.transpose();
    vector qv(nope + rope);
    for (int i = 0; i < nope; ++i) qv(i) = double(q_nope[index_t(h) * nope + i]);
    for (int i = 0; i < rope; ++i) qv(nope + i) = double(q_pe[index_t(h) * rope + i]);
    lse[h] = attend(K, Vm, qv, scale, o + index_t(h) * v_dim);
  }
}

}  // namespace writescope::reference
