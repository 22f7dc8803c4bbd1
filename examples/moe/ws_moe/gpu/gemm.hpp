// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/gemm.hpp — every matrix product of the CUDA path as a descriptor
// with cuBLAS's column-major semantics, the builders of the five products the
// decoders need, and a reference executor on the host.
//
// The CUDA executor hands a descriptor to cublasGemmEx (batch 1),
// cublasGemmStridedBatchedEx, cublasGemmBatchedEx (pointer tables) or
// cublasGemmGroupedBatchedEx (pointer tables, several shapes), always
// CUBLAS_COMPUTE_32F, fp32 output, alpha 1, beta 0;
// the emulated executor (and the unit tests) run reference_gemm on the same
// descriptor. Both call check_gemm first, which enforces cuBLAS's own argument
// rules (leading dimensions, equal input types, 32-bit sizes), so a descriptor
// that passes the host tests is one cuBLAS accepts.
//
// Column-major semantics: for each batch b,
//   C_b(i, j) = sum_l opA(i, l) * opB(l, j),  0 <= i < m, 0 <= j < n, 0 <= l < k
//   opA(i, l) = trans_a ? A_b[l + i*lda] : A_b[i + l*lda]
//   opB(l, j) = trans_b ? B_b[j + l*ldb] : B_b[l + j*ldb]
//   C_b(i, j) at C_b[i + j*ldc];  X_b = X + b*stride_x (elements)
// A row-major [R][C] matrix with row stride ld is the column-major C×R matrix
// with leading dimension ld; the builders below are written in those terms.
#pragma once

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <vector>

#include <writescope/error.hpp>

#include "kernel_math.hpp"

namespace ws_moe::gpu {

struct gemm_desc {
  bool trans_a = false, trans_b = false;
  idx m = 0, n = 0, k = 0;
  const void* a = nullptr;
  wtype a_type = wtype::f32;
  idx lda = 0, stride_a = 0;
  const void* b = nullptr;
  wtype b_type = wtype::f32;
  idx ldb = 0, stride_b = 0;
  float* c = nullptr;  ///< fp32 output
  idx ldc = 0, stride_c = 0;
  idx batch = 1;
};

/// Throws config_error (naming `what` and the rule) for a descriptor cuBLAS
/// would reject: mixed input types, a leading dimension below the stored rows,
/// sizes beyond 32 bits, a null operand of a non-empty product.
inline void check_gemm(const gemm_desc& d, const char* what) {
  auto fail = [&](const std::string& m) { throw writescope::config_error(std::string("GEMM ") + what + ": " + m); };
  if (d.m < 0 || d.n < 0 || d.k < 0 || d.batch < 1) fail("negative size or batch < 1");
  if (d.m == 0 || d.n == 0) return;
  if (d.a_type != d.b_type) fail("A and B must have the same element type");
  const idx lim = INT_MAX;
  if (d.m > lim || d.n > lim || d.k > lim || d.lda > lim || d.ldb > lim || d.ldc > lim || d.batch > lim)
    fail("a size or leading dimension exceeds 2^31-1");
  if (d.k > 0 && (d.a == nullptr || d.b == nullptr)) fail("null input operand");
  if (d.c == nullptr) fail("null output");
  if (d.lda < std::max<idx>(1, d.trans_a ? d.k : d.m))
    fail("lda " + std::to_string(d.lda) + " < " + std::to_string(d.trans_a ? d.k : d.m));
  if (d.ldb < std::max<idx>(1, d.trans_b ? d.n : d.k))
    fail("ldb " + std::to_string(d.ldb) + " < " + std::to_string(d.trans_b ? d.n : d.k));
  if (d.ldc < std::max<idx>(1, d.m)) fail("ldc " + std::to_string(d.ldc) + " < " + std::to_string(d.m));
}

/// A batch of products of one shape whose operands are device pointer tables
/// (pointer-array batched: cuBLASLt on the GPU): item i computes `base` with a = a[i], b = b[i], c = c[i]
/// (base's own pointers and strides unused; batch 1).
struct gemm_batched_desc {
  gemm_desc base;
  const void* const* a = nullptr;  ///< [count] device pointers
  const void* const* b = nullptr;
  float* const* c = nullptr;
  idx count = 0;
};

/// check_gemm on the shape of a batched descriptor; the tables must not be null.
inline void check_gemm_batched(const gemm_batched_desc& d, const char* what) {
  if (d.count < 0) throw writescope::config_error(std::string("GEMM ") + what + ": count < 0");
  if (d.count == 0) return;
  if (d.a == nullptr || d.b == nullptr || d.c == nullptr)
    throw writescope::config_error(std::string("GEMM ") + what + ": null pointer table");
  if (d.count > INT_MAX) throw writescope::config_error(std::string("GEMM ") + what + ": count exceeds 2^31-1");
  gemm_desc s = d.base;
  static float dummy;
  s.a = s.b = &dummy;
  s.c = &dummy;
  s.batch = 1;
  check_gemm(s, what);
}

/// Products of several shapes in one call (cublasGemmGroupedBatchedEx): every
/// item has base's transposes, types, m, k and leading dimensions; group g has
/// n[g] columns and count[g] items. The items of all groups, in group order,
/// take their operands from the device pointer tables: item i computes base
/// with a = a[i], b = b[i], c = c[i] (base's own pointers, strides, n and batch
/// unused). n and count are host arrays of one entry per group.
struct gemm_grouped_desc {
  gemm_desc base;
  const void* const* a = nullptr;  ///< [items] device pointers
  const void* const* b = nullptr;
  float* const* c = nullptr;
  std::vector<int> n, count;  ///< per group: columns, items
  [[nodiscard]] idx items() const {
    idx t = 0;
    for (int c : count) t += c;
    return t;
  }
};

/// check_gemm on every group's shape; the tables must not be null, counts
/// positive, n and count of equal length.
inline void check_gemm_grouped(const gemm_grouped_desc& d, const char* what) {
  auto fail = [&](const std::string& m) { throw writescope::config_error(std::string("GEMM ") + what + ": " + m); };
  if (d.n.size() != d.count.size())
    fail(std::to_string(d.n.size()) + " column counts for " + std::to_string(d.count.size()) + " groups");
  if (d.n.empty()) return;
  if (d.a == nullptr || d.b == nullptr || d.c == nullptr) fail("null pointer table");
  if (d.n.size() > std::size_t(INT_MAX) || d.items() > INT_MAX) fail("more than 2^31-1 groups or items");
  for (std::size_t g = 0; g < d.n.size(); ++g) {
    if (d.count[g] < 1) fail("group " + std::to_string(g) + " has " + std::to_string(d.count[g]) + " items (must be >= 1)");
    gemm_desc s = d.base;
    static float dummy;
    s.a = s.b = &dummy;
    s.c = &dummy;
    s.n = d.n[g];
    s.batch = 1;
    check_gemm(s, what);
  }
}

/// A batched prefill expert's rows rounded up to a size of a geometric
/// ladder: multiples of `pad` up to 8 * pad, above that 8 steps per octave
/// (m in (2^j, 2^(j+1)] rounds up to a multiple of 2^(j-3)). At most 1/8 of
/// the rows are padding beyond the first `pad`; experts of similar load share
/// a size, and the sizes are the same in every layer, so a layer runs a few
/// batched GEMMs of shapes cuBLAS has seen before.
inline idx ladder_rows(idx m, idx pad) {
  idx step = pad;
  if (m > 8 * pad) {
    int j = 0;
    while ((idx(2) << j) < m) ++j;  // 2^j < m <= 2^(j+1)
    step = std::max<idx>(pad, idx(1) << (j - 3));
  }
  return (m + step - 1) / step * step;
}

/// Batched-GEMM groups fitted to a layer's loads: `rows` are the row counts of
/// the experts that run batched, in ascending order (each >= 1). A group of
/// consecutive experts runs as one batched GEMM per matrix at the ladder size
/// of its largest expert (ladder_rows(max, pad)); a group costs `group_cost`
/// (the host issue of its calls, in any unit) and every padded row `row_cost`
/// (its GEMM work, same unit). Returns each expert's padded rows (same order),
/// the partition of least total cost (dynamic programming over the sorted
/// loads, O(n^2)). With group_cost > 0 consecutive groups get distinct sizes
/// (two of one size cost less as one), so grouping the experts by equal padded
/// rows gives back the partition; with group_cost 0 every expert keeps its own
/// ladder size (ladder_rows). Throws std::invalid_argument for rows not
/// ascending or < 1, pad < 1, or a negative cost.
inline std::vector<idx> fitted_group_rows(const std::vector<idx>& rows, idx pad, double row_cost, double group_cost) {
  if (pad < 1) throw std::invalid_argument("fitted_group_rows: pad " + std::to_string(pad) + " must be >= 1");
  if (!(row_cost >= 0) || !(group_cost >= 0))
    throw std::invalid_argument("fitted_group_rows: costs must be >= 0 (row " + std::to_string(row_cost) + ", group " +
                                std::to_string(group_cost) + ")");
  const std::size_t n = rows.size();
  for (std::size_t i = 0; i < n; ++i)
    if (rows[i] < 1 || (i > 0 && rows[i] < rows[i - 1]))
      throw std::invalid_argument("fitted_group_rows: rows[" + std::to_string(i) + "] = " + std::to_string(rows[i]) +
                                  " (rows must be >= 1 and ascending)");
  // best[j]: least cost of the first j experts; cut[j]: where its last group starts
  std::vector<double> best(n + 1, 0.0);
  std::vector<std::size_t> cut(n + 1, 0);
  for (std::size_t j = 1; j <= n; ++j) {
    const double size = double(ladder_rows(rows[j - 1], pad));
    best[j] = -1;
    for (std::size_t i = j; i-- > 0;) {  // the last group is experts i .. j-1
      const double c = best[i] + group_cost + double(j - i) * size * row_cost;
      if (best[j] < 0 || c < best[j]) {
        best[j] = c;
        cut[j] = i;
      }
    }
  }
  std::vector<idx> out(n);
  for (std::size_t j = n; j > 0;) {
    const std::size_t i = cut[j];
    const idx size = ladder_rows(rows[j - 1], pad);
    for (std::size_t q = i; q < j; ++q) out[q] = size;
    j = i;
  }
  return out;
}

/// The descriptor's product on the host (double accumulation), for the
/// emulated executor and the tests. Parallel over (batch, column).
inline void reference_gemm(const gemm_desc& d) {
  check_gemm(d, "reference");
  if (d.m == 0 || d.n == 0) return;
  const idx cols = d.batch * d.n;
#pragma omp parallel for schedule(static)
  for (idx bj = 0; bj < cols; ++bj) {
    const idx b = bj / d.n;
    const idx j = bj - b * d.n;
    const idx a0 = b * d.stride_a, b0 = b * d.stride_b;
    float* c = d.c + b * d.stride_c + j * d.ldc;
    for (idx i = 0; i < d.m; ++i) {
      double acc = 0.0;
      for (idx l = 0; l < d.k; ++l) {
        const float x = load_as_float(d.a, d.a_type, a0 + (d.trans_a ? l + i * d.lda : i + l * d.lda));
        const float y = load_as_float(d.b, d.b_type, b0 + (d.trans_b ? j + l * d.ldb : l + j * d.ldb));
        acc += double(x) * double(y);
      }
      c[i] = float(acc);
    }
  }
}

/// A batched descriptor on the host: reference_gemm per item (its tables in host memory).
inline void reference_gemm_batched(const gemm_batched_desc& d) {
  check_gemm_batched(d, "reference");
  for (idx i = 0; i < d.count; ++i) {
    gemm_desc s = d.base;
    s.a = d.a[i];
    s.b = d.b[i];
    s.c = d.c[i];
    s.batch = 1;
    reference_gemm(s);
  }
}

/// A grouped descriptor on the host: reference_gemm per item (its tables in host memory).
inline void reference_gemm_grouped(const gemm_grouped_desc& d) {
  check_gemm_grouped(d, "reference");
  idx i = 0;
  for (std::size_t g = 0; g < d.n.size(); ++g)
    for (int q = 0; q < d.count[g]; ++q, ++i) {
      gemm_desc s = d.base;
      s.a = d.a[i];
      s.b = d.b[i];
      s.c = d.c[i];
      s.n = d.n[g];
      s.batch = 1;
      reference_gemm(s);
    }
}

/// The host reference of expert_gemv_params (emulated executor and tests):
/// each product accumulated in double and rounded to fp32 once, like
/// reference_gemm, so that it equals the per-expert GEMM path bit for bit.
inline void expert_gemv_reference(const expert_gemv_params& p) {
  for (int e = 0; e < p.experts; ++e) {
    if (p.w[e] == nullptr) continue;
    const auto* w = static_cast<const std::uint16_t*>(p.w[e]);
    const auto* u = p.up ? static_cast<const std::uint16_t*>(p.up[e]) : nullptr;
    const idx r0 = p.offsets[e], r1 = p.offsets[e + 1];
#pragma omp parallel for schedule(static)
    for (idx r = r0; r < r1; ++r) {
      const float* x = p.x + r * p.x_stride;
      for (int o = 0; o < p.out; ++o) {
        double g = 0.0, v = 0.0;
        for (int l = 0; l < p.in; ++l) {
          const double xv = double(expert_input(x[l], p.round_x));
          g += xv * double(bf16_to_float(w[idx(o) * p.in + l]));
          if (u) v += xv * double(bf16_to_float(u[idx(o) * p.in + l]));
        }
        p.y[r * p.y_stride + o] = u ? silu(float(g)) * float(v) : float(g);
      }
    }
  }
}


// -----------------------------------------------------------------------------
// Builders
// -----------------------------------------------------------------------------

/// Linear layer: y[t][o] (row stride ldy) = sum_l x[t][l] · W[o][l], for
/// t < n, o < out; W row-major [out][in] (PyTorch's layout), x row-major [n][in].
///   column-major: C = y (out × n, ldc ldy) = opA(W: in × out, ld in, transposed) · x (in × n, ld in)
inline gemm_desc linear_desc(const void* w, wtype type, idx out, idx in, const void* x, idx n, float* y, idx ldy) {
  gemm_desc d;
  d.trans_a = true;
  d.m = out;
  d.n = n;
  d.k = in;
  d.a = w;
  d.a_type = type;
  d.lda = in;
  d.b = x;
  d.b_type = type;
  d.ldb = in;
  d.c = y;
  d.ldc = ldy;
  return d;
}

/// MLA absorption (attention.hpp): for each head h < H,
///   q'[t][h][0:rank] = q_nope[t][h] (nope) · W_UK_h ([nope][rank])
/// with q_nope at qf + t*H*qk + h*qk (qk = nope + rope), W_UK_h the rows
/// [h*(nope+vh), h*(nope+vh)+nope) of kv_b ([H*(nope+vh)][rank]), q' at
/// q + t*H*q_dim + h*q_dim. One strided batch over the heads.
///   column-major per head: C (rank × n, ldc H*q_dim) = W_UK_h (rank × nope, ld rank) · q_nope (nope × n, ld H*qk)
inline gemm_desc mla_absorb_desc(const void* kv_b, const void* qf, wtype type, idx n, int heads, int nope, int rope,
                                 int vh, int rank, float* q, int q_dim) {
  gemm_desc d;
  d.m = rank;
  d.n = n;
  d.k = nope;
  d.a = kv_b;
  d.a_type = type;
  d.lda = rank;
  d.stride_a = idx(nope + vh) * rank;
  d.b = qf;
  d.b_type = type;
  d.ldb = idx(heads) * (nope + rope);
  d.stride_b = nope + rope;
  d.c = q;
  d.ldc = idx(heads) * q_dim;
  d.stride_c = q_dim;
  d.batch = heads;
  return d;
}

/// MLA expansion (attention.hpp output): for each head h < H,
///   v[t][h][c] = sum_r a[t][h][r] · W_UV_h[c][r],  c < vh, r < rank
/// with a at a + t*H*rank + h*rank, W_UV_h the rows [h*(nope+vh)+nope, (h+1)*(nope+vh))
/// of kv_b, v at v + t*H*vh + h*vh.
///   column-major per head: C (vh × n, ldc H*vh) = opA(W_UV_h: rank × vh, ld rank, transposed) · a (rank × n, ld H*rank)
inline gemm_desc mla_expand_desc(const void* kv_b, const void* a, wtype type, idx n, int heads, int nope, int vh,
                                 int rank, float* v) {
  gemm_desc d;
  d.trans_a = true;
  d.m = vh;
  d.n = n;
  d.k = rank;
  d.a = static_cast<const char*>(kv_b) + idx(nope) * rank * type_bytes(type);
  d.a_type = type;
  d.lda = rank;
  d.stride_a = idx(nope + vh) * rank;
  d.b = a;
  d.b_type = type;
  d.ldb = idx(heads) * rank;
  d.stride_b = rank;
  d.c = v;
  d.ldc = idx(heads) * vh;
  d.stride_c = vh;
  d.batch = heads;
  return d;
}

/// Prefill scores of one query block, per KV head g < hkv (kernel_math.hpp pack_q_op):
///   S[g][q][key] = sum_l Qp[g][q][l] · K[key][g][l],  q < R, key < keys, l < qd
/// Qp packed [hkv][R][qd]; K token-major (token stride ts elements, KV head g
/// at + g*head_stride); S [hkv][R][keys].
///   column-major per g: C (keys × R, ldc keys) = opA(K: qd × keys, ld ts, transposed) · Qp (qd × R, ld qd)
inline gemm_desc prefill_qk_desc(const void* k, wtype type, idx ts, idx head_stride, const void* qp, idx R, int qd,
                                 idx keys, int hkv, float* s) {
  gemm_desc d;
  d.trans_a = true;
  d.m = keys;
  d.n = R;
  d.k = qd;
  d.a = k;
  d.a_type = type;
  d.lda = ts;
  d.stride_a = head_stride;
  d.b = qp;
  d.b_type = type;
  d.ldb = qd;
  d.stride_b = R * qd;
  d.c = s;
  d.ldc = keys;
  d.stride_c = R * keys;
  d.batch = hkv;
  return d;
}

/// Prefill outputs of one query block, per KV head g:
///   O[g][q][c] = sum_key P[g][q][key] · V[key][g][c],  c < dv
/// P [hkv][R][keys]; V token-major like K (MLA: the latent, the first dv
/// elements of the K row); O [hkv][R][dv].
///   column-major per g: C (dv × R, ldc dv) = V (dv × keys, ld ts) · P (keys × R, ld keys)
inline gemm_desc prefill_pv_desc(const void* v, wtype type, idx ts, idx head_stride, const void* p, idx R, idx keys,
                                 int dv, int hkv, float* o) {
  gemm_desc d;
  d.m = dv;
  d.n = R;
  d.k = keys;
  d.a = v;
  d.a_type = type;
  d.lda = ts;
  d.stride_a = head_stride;
  d.b = p;
  d.b_type = type;
  d.ldb = keys;
  d.stride_b = R * keys;
  d.c = o;
  d.ldc = dv;
  d.stride_c = R * dv;
  d.batch = hkv;
  return d;
}

}  // namespace ws_moe::gpu
