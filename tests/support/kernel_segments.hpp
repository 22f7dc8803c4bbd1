// SPDX-License-Identifier: Apache-2.0
// Test support for the CPU decode kernels (test_cpu_kernel, test_amx_kernel):
// KV blocks cut into segments with poisoned tails, random histories and
// queries, and one call per KV head compared with the fp64 reference.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "harness.hpp"

namespace wstest {

// A list of blocks holding the tokens of `h`, cut into segments of `counts`
// tokens; each block is its own allocation, poisoned (3e4) past its segment.
template <class Layout>
struct segment_list {
  block_format<Layout> fmt;
  std::vector<std::vector<bf16>> blocks;
  std::vector<cpu::kv_segment> segs;
  segment_list(const Layout& L, int block_tokens, const kv_history<Layout>& h, const std::vector<int>& counts)
      : fmt{L, block_tokens} {
    const index_t row = index_t(L.kv_heads()) * Layout::row_elems;
    index_t t = 0;
    blocks.reserve(counts.size());
    for (int n : counts) {
      REQUIRE(n <= block_tokens);
      blocks.emplace_back(std::size_t(fmt.block_elems()), bf16{poison_bf16_bits});
      auto& b = blocks.back();
      for (int i = 0; i < n; ++i)
        for (int p = 0; p < Layout::planes; ++p)
          for (int hh = 0; hh < L.kv_heads(); ++hh)
            std::copy_n(h.planes[p].begin() + std::ptrdiff_t((t + i) * row + index_t(hh) * Layout::row_elems),
                        Layout::row_elems, b.begin() + std::ptrdiff_t(fmt.offset(p, hh, i, 0)));
      segs.push_back({b.data(), n});
      t += n;
    }
    REQUIRE(t == h.tokens);
  }
};

// Token counts per segment: full blocks of `bt`, with a partial block every
// `short_every` and a zero-token segment every `empty_every` (0 = never).
inline std::vector<int> cut(index_t total, int bt, int short_every, int empty_every) {
  std::vector<int> c;
  index_t t = 0;
  int k = 0;
  while (t < total) {
    if (empty_every > 0 && k % empty_every == 1) c.push_back(0);
    int n = int(std::min<index_t>(bt, total - t));
    if (short_every > 0 && k % short_every == short_every - 1 && n > 1) n = 1 + k % (n - 1);
    c.push_back(n);
    t += n;
    ++k;
  }
  if (empty_every > 0) c.push_back(0);
  return c;
}

template <class Layout>
kv_history<Layout> random_history(const Layout& L, index_t n, bf16_source& src,
                                  const kv_generator<Layout>& gen = kv_generator<Layout>{}) {
  kv_history<Layout> h;
  const auto b = gen.make(L, n, src);
  record(h, L, b, 0, n);
  return h;
}

// Runs the kernel for every KV head of `L` (queries q [Hq][q_dim]) and compares
// with the fp64 reference over all tokens of `h`.
template <class Layout, class Kernel>
compare_result run_kernel_and_compare(const Layout& L, const kv_history<Layout>& h, const segment_list<Layout>& sl,
                               const std::vector<float>& q, double scale, std::vector<float>* out = nullptr,
                               std::vector<float>* lse_out = nullptr) {
  const int hq = L.num_q_heads(), g = L.group_size();
  std::vector<float> o(std::size_t(hq) * Layout::v_dim, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> lse(std::size_t(hq), std::numeric_limits<float>::quiet_NaN());
  for (int j = 0; j < L.kv_heads(); ++j)
    Kernel::run(sl.fmt, j, q.data() + std::size_t(j) * g * Layout::q_dim, Layout::q_dim, g,
                                          float(scale), sl.segs, o.data() + std::size_t(j) * g * Layout::v_dim,
                                          Layout::v_dim, lse.data() + std::size_t(j) * g);
  std::vector<double> ro, rl;
  reference_attention(L, h, q.data(), scale, ro, rl);
  compare_result r;
  compare_rows(hq, Layout::v_dim, o.data(), lse.data(), ro, rl, r);
  if (out) *out = o;
  if (lse_out) *lse_out = lse;
  return r;
}

template <class Layout, class Arch>
compare_result run_and_compare(const Layout& L, const kv_history<Layout>& h, const segment_list<Layout>& sl,
                               const std::vector<float>& q, double scale, std::vector<float>* out = nullptr,
                               std::vector<float>* lse_out = nullptr) {
  return run_kernel_and_compare<Layout, cpu::decode_kernel<Layout, Arch>>(L, h, sl, q, scale, out, lse_out);
}

inline std::vector<float> random_queries(std::size_t n, bf16_source& src) {
  std::vector<float> q(n);
  for (auto& x : q) x = src.next_float();
  return q;
}

}  // namespace wstest
