// SPDX-License-Identifier: Apache-2.0
// writescope/partial_state.hpp — partial attention states and their exact merge
// by log-sum-exp (paper §4.2, §5.1; docs/MERGE-CONTRACT.md).
//
// A partial state over a subset S of a sequence's keys, for one query head, is
//
//     lse = log Σ_{j∈S} exp(s_j)             natural log, fp32
//     o   = Σ_{j∈S} exp(s_j − lse) · v_j     the normalised output, fp32 [v_dim]
//
// with s_j the scaled score of key j. The empty subset is (o = 0, lse = −inf);
// it is the identity of merge_states, and merging two empties gives an empty,
// never NaN. LSE is never +inf or NaN. GPU code that works in base 2 converts
// before it returns a partial (mixing bases is a silent wrong-answer bug).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "config.hpp"
#include "error.hpp"
#include "memory_space.hpp"

namespace writescope {

inline constexpr float empty_lse = -std::numeric_limits<float>::infinity();

/// Merges one row pair into `out` (which may alias a or b). Exact identities:
/// merge(x, empty) == x and merge(empty, x) == x bit for bit; merge(empty, empty)
/// == empty. Thread-safe, no allocation; callable from device code.
///   o_a, o_b, o_out: [v_dim] fp32        lse_*: scalars, natural log
WS_HOST_DEVICE inline void merge_state_row(const float* o_a, float lse_a, const float* o_b, float lse_b, float* o_out,
                                           float* lse_out, int v_dim) noexcept {
  if (lse_b == -INFINITY) {  // includes both empty
    if (o_out != o_a)
      for (int i = 0; i < v_dim; ++i) o_out[i] = o_a[i];
    *lse_out = lse_a;
    return;
  }
  if (lse_a == -INFINITY) {
    if (o_out != o_b)
      for (int i = 0; i < v_dim; ++i) o_out[i] = o_b[i];
    *lse_out = lse_b;
    return;
  }
  const float m = lse_a > lse_b ? lse_a : lse_b;
  const float wa = expf(lse_a - m);
  const float wb = expf(lse_b - m);
  const float s = wa + wb;
  const float ca = wa / s;
  const float cb = wb / s;
  for (int i = 0; i < v_dim; ++i) o_out[i] = o_a[i] * ca + o_b[i] * cb;
  *lse_out = m + logf(s);
}

/// A strided view of partial states of `num_seqs` sequences × `num_heads` query
/// heads × `v_dim` output elements, in memory space Space.
///   o   element (s, h, i) at o[s*o_seq_stride + h*o_head_stride + i]   (unit stride in i)
///   lse element (s, h)    at lse[s*lse_seq_stride + h*lse_head_stride]
template <class T, memory_space Space>
struct partial_state_view {
  T* o = nullptr;
  T* lse = nullptr;
  index_t num_seqs = 0;
  int num_heads = 0;
  int v_dim = 0;
  index_t o_seq_stride = 0;
  index_t o_head_stride = 0;
  index_t lse_seq_stride = 0;
  index_t lse_head_stride = 0;

  /// Dense [num_seqs][num_heads][v_dim] / [num_seqs][num_heads] view.
  static constexpr partial_state_view dense(T* o, T* lse, index_t num_seqs, int num_heads, int v_dim) noexcept {
    return {o, lse, num_seqs, num_heads, v_dim, index_t{num_heads} * v_dim, v_dim, num_heads, 1};
  }
  [[nodiscard]] WS_HOST_DEVICE T* o_row(index_t s, int h) const noexcept { return o + s * o_seq_stride + h * o_head_stride; }
  [[nodiscard]] WS_HOST_DEVICE T& lse_at(index_t s, int h) const noexcept {
    return lse[s * lse_seq_stride + h * lse_head_stride];
  }
};

template <class T = float>
using host_partial_view = partial_state_view<T, pageable_host_space>;

namespace detail {
template <class A, class B>
void check_same_partial_shape(const A& a, const B& b, const char* what) {
  if (a.num_seqs != b.num_seqs || a.num_heads != b.num_heads || a.v_dim != b.v_dim)
    throw shape_error(std::string("merge_states: ") + what + " has shape [" + std::to_string(b.num_seqs) + "][" +
                      std::to_string(b.num_heads) + "][" + std::to_string(b.v_dim) + "], expected [" +
                      std::to_string(a.num_seqs) + "][" + std::to_string(a.num_heads) + "][" +
                      std::to_string(a.v_dim) + "]");
}
/// True when the n1 x n2 grid of `width`-element rows at offsets i*s1 + j*s2
/// is pairwise disjoint. Sufficient test (nested strides, either order, any
/// sign); layouts it cannot prove disjoint are rejected.
inline bool rows_disjoint(index_t n1, index_t s1, index_t n2, index_t s2, index_t width) noexcept {
  if (n1 <= 1) s1 = 0;
  if (n2 <= 1) s2 = 0;
  s1 = s1 < 0 ? -s1 : s1;
  s2 = s2 < 0 ? -s2 : s2;
  if (s2 < s1) {
    std::swap(s1, s2);
    std::swap(n1, n2);
  }
  index_t extent = width;
  if (n1 > 1) {
    if (s1 < extent) return false;
    extent += (n1 - 1) * s1;
  }
  return n2 <= 1 || s2 >= extent;
}
/// [lowest, highest) element offsets a view's O rows (o = true) or LSEs cover.
template <class V>
std::pair<index_t, index_t> view_extent(const V& v, bool o) noexcept {
  const index_t ss = o ? v.o_seq_stride : v.lse_seq_stride, hs = o ? v.o_head_stride : v.lse_head_stride;
  const index_t ds = (v.num_seqs - 1) * ss, dh = index_t(v.num_heads - 1) * hs;
  return {(ds < 0 ? ds : 0) + (dh < 0 ? dh : 0), (ds > 0 ? ds : 0) + (dh > 0 ? dh : 0) + (o ? v.v_dim : 1)};
}
template <class V>
void check_partial_strides(const V& v, const char* what) {
  if (v.num_seqs <= 0 || v.num_heads <= 0) return;
  if (!rows_disjoint(v.num_seqs, v.o_seq_stride, v.num_heads, v.o_head_stride, v.v_dim))
    // Rows overlap: a merge would read values it already overwrote.
    throw shape_error(std::string("merge_states: ") + what + " has overlapping rows (o_head_stride=" +
                      std::to_string(v.o_head_stride) + ", o_seq_stride=" + std::to_string(v.o_seq_stride) +
                      ", v_dim=" + std::to_string(v.v_dim) + "): rows must not overlap");
  if (!rows_disjoint(v.num_seqs, v.lse_seq_stride, v.num_heads, v.lse_head_stride, 1))
    throw shape_error(std::string("merge_states: ") + what + " has overlapping LSEs (lse_head_stride=" +
                      std::to_string(v.lse_head_stride) + ", lse_seq_stride=" + std::to_string(v.lse_seq_stride) +
                      "): LSEs must not overlap");
}
/// `out` must alias `in` exactly (same pointers and strides) or not at all:
/// a partial overlap would read rows the merge already overwrote.
template <class I, class O>
void check_alias(const I& in, const O& out, const char* what) {
  if (in.num_seqs <= 0 || in.num_heads <= 0) return;
  auto overlaps = [](const auto* p, std::pair<index_t, index_t> ep, const auto* q, std::pair<index_t, index_t> eq) {
    const auto a0 = reinterpret_cast<std::uintptr_t>(p + ep.first), a1 = reinterpret_cast<std::uintptr_t>(p + ep.second);
    const auto b0 = reinterpret_cast<std::uintptr_t>(q + eq.first), b1 = reinterpret_cast<std::uintptr_t>(q + eq.second);
    return a0 < b1 && b0 < a1;
  };
  const bool same_o = static_cast<const void*>(in.o) == static_cast<const void*>(out.o) &&
                      in.o_seq_stride == out.o_seq_stride && in.o_head_stride == out.o_head_stride;
  const bool same_lse = static_cast<const void*>(in.lse) == static_cast<const void*>(out.lse) &&
                        in.lse_seq_stride == out.lse_seq_stride && in.lse_head_stride == out.lse_head_stride;
  if ((!same_o && overlaps(in.o, view_extent(in, true), out.o, view_extent(out, true))) ||
      (!same_lse && overlaps(in.lse, view_extent(in, false), out.lse, view_extent(out, false))))
    throw shape_error(std::string("merge_states: the output partly overlaps the ") + what +
                      " with different pointers or strides; alias an input exactly or not at all");
}
}  // namespace detail

/// out = merge(a, b) for every (sequence, head), on the host. Views may have any
/// non-overlapping strides (dense, transposed, padded); `out` may alias `a` or
/// `b` exactly (same pointers and strides). Throws shape_error on a shape
/// mismatch, overlapping rows or LSEs, or an output that partly overlaps an input.
/// Deterministic; single-threaded.
template <class A, class B, class O>
void merge_states(const partial_state_view<A, pageable_host_space>& a,
                  const partial_state_view<B, pageable_host_space>& b,
                  const partial_state_view<O, pageable_host_space>& out) {
  detail::check_same_partial_shape(a, b, "second input");
  detail::check_same_partial_shape(a, out, "output");
  detail::check_partial_strides(a, "first input");
  detail::check_partial_strides(b, "second input");
  detail::check_partial_strides(out, "output");
  detail::check_alias(a, out, "first input");
  detail::check_alias(b, out, "second input");
  for (index_t s = 0; s < a.num_seqs; ++s)
    for (int h = 0; h < a.num_heads; ++h)
      merge_state_row(a.o_row(s, h), a.lse_at(s, h), b.o_row(s, h), b.lse_at(s, h), out.o_row(s, h),
                      &out.lse_at(s, h), a.v_dim);
}

}  // namespace writescope
