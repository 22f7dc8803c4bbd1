// SPDX-License-Identifier: Apache-2.0
// tests/support/sparse_checks.hpp — checks and selectors shared by the host
// and device tests of block-level sparse selection (docs/SPARSE.md): the fp64
// reference restricted to a selection (per KV head, plus the D-window), the
// test's own block summaries and top-k, small test selectors, and the test
// bodies written once for every backend (backend_traits, harness.hpp).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <doctest/doctest.h>
#include <set>
#include <stdexcept>
#include <vector>

#include "support/harness.hpp"

namespace wstest {

/// The spec of the sparse tests: `seqs` sequences of up to `tokens_per_seq`
/// tokens (+64) in each host region; block 16, D 32, splits of 4 blocks, CPU
/// tasks of 3. The caller sets the ping-pong size.
inline partition_spec sparse_spec(int layers, int seqs, index_t tokens_per_seq) {
  partition_spec s = small_spec(layers, seqs, 16, 32);
  s.cpu_capacity_tokens = s.pinned_capacity_tokens = index_t(seqs) * (tokens_per_seq + 64);
  s.gpu_split_blocks = 4;
  s.cpu_task_blocks = 3;
  return s;
}

/// The K4/C7 spec (GQA 4/1, 512 bytes per token): one layer, blocks of 64,
/// D 256, 4 sequences, 5 GiB in the region `where` (all of it mapped or
/// page-locked at init), nothing in the other; ping-pong of 8 blocks.
inline partition_spec past_4gib_spec(const gqa_layout<128>& lay, placement where) {
  const index_t gib_tokens = (index_t{1} << 30) / 512;
  partition_spec s;
  s.num_layers = 1;
  s.block_tokens = 64;
  s.d_window_tokens = 256;
  s.max_sequences = 4;
  s.cpu_capacity_tokens = where == placement::cpu_compute ? 5 * gib_tokens : 0;
  s.pinned_capacity_tokens = where == placement::gpu_load ? 5 * gib_tokens : 0;
  s.pinned_initial_tokens = -1;
  s.pinned_growth_tokens = s.pinned_capacity_tokens;
  s.gpu_split_blocks = 4;
  s.cpu_task_blocks = 4;
  set_ping_pong_blocks(s, lay, 8);
  return s;
}

/// Whether rows [row0, row0 + n) of a partial (o: [rows][v_dim], lse: [rows])
/// are exactly the empty partial: LSE -inf and every output element +0.
inline bool empty_rows(const std::vector<float>& o, const std::vector<float>& lse, std::size_t row0, int n,
                       int v_dim = 128) {
  for (int k = 0; k < n; ++k) {
    if (!(std::isinf(lse[row0 + std::size_t(k)]) && lse[row0 + std::size_t(k)] < 0)) return false;
    for (int e = 0; e < v_dim; ++e)
      if (std::bit_cast<std::uint32_t>(o[(row0 + std::size_t(k)) * std::size_t(v_dim) + std::size_t(e)]) != 0u)
        return false;
  }
  return true;
}

/// Compares batch row i of out/lse with the fp64 reference over, per KV head h,
/// the tokens of the blocks h selected plus the D-window (tokens >= placed).
template <kv_layout Layout>
void check_restricted(const Layout& L, const kv_history<Layout>& hist, const sequence_state& st, int bt,
                      const step_selection& sel, int i, const float* q, double scale, const float* out,
                      const float* lse, compare_result& r) {
  const int hkv = L.kv_heads();
  const int group = L.group_size();
  constexpr int V = Layout::v_dim;
  for (int h = 0; h < hkv; ++h) {
    const kv_history<Layout> sub = select_tokens(L, hist, [&](index_t t) {
      return t >= st.placed_tokens || ((sel.mask(i, t / bt) >> h) & 1u) != 0;
    });
    std::vector<double> ro, rl;
    reference_attention(L, sub, q, scale, ro, rl);
    const std::vector<double> ro_g(ro.begin() + std::ptrdiff_t(h * group * V), ro.begin() + std::ptrdiff_t((h + 1) * group * V));
    const std::vector<double> rl_g(rl.begin() + h * group, rl.begin() + (h + 1) * group);
    compare_rows(group, V, out + std::size_t(h * group) * V, lse + h * group, ro_g, rl_g, r);
  }
}

/// The test's own summary of block b, KV head h: mean key in fp32, token order.
template <kv_layout Layout>
std::vector<float> own_summary(const Layout& L, const kv_history<Layout>& hist, int bt, index_t b, int h) {
  constexpr int R = Layout::row_elems;
  std::vector<float> s(R, 0.0f);
  const auto& K = hist.planes[Layout::key_plane];
  for (int t = 0; t < bt; ++t)
    for (int e = 0; e < R; ++e)
      s[std::size_t(e)] += K[std::size_t(((b * bt + t) * L.kv_heads() + h) * R + e)].to_float();
  for (auto& x : s) x /= float(bt);
  return s;
}

/// Checks the library's summaries against the test's own (bit for bit) and its
/// selection of row i against the test's own top-k scores (fp64, with a tolerance
/// for fp32 rounding at the cut). Returns the number of problems.
template <class Cache>
int check_topk(Cache& cache, const hybrid_attention<Cache>& attn, const kv_history<typename Cache::layout_type>& hist,
               sequence_id seq, int layer, int i, const float* q, double scale, const top_k_selector& sel) {
  using Layout = typename Cache::layout_type;
  constexpr int R = Layout::row_elems;
  const Layout& L = cache.layout();
  const sequence_state& st = cache.sequence(seq);
  const int bt = cache.spec().block_tokens;
  const index_t n = index_t(st.block_table.size());
  int bad = 0;
  for (int h = 0; h < L.kv_heads(); ++h) {
    std::vector<double> score(static_cast<std::size_t>(n));
    double top = 0;
    for (index_t b = 0; b < n; ++b) {
      const std::vector<float> s = own_summary(L, hist, bt, b, h);
      const block_ref& br = st.block_table[std::size_t(b)];
      if (std::memcmp(s.data(), attn.summaries().row(layer, br.region, br.id, h), sizeof(float) * R) != 0) ++bad;
      double best = -INFINITY;
      for (int g = 0; g < L.group_size(); ++g) {
        double dot = 0;
        for (int e = 0; e < R; ++e) dot += double(q[(h * L.group_size() + g) * R + e]) * double(s[std::size_t(e)]);
        best = std::max(best, scale * dot);
      }
      score[std::size_t(b)] = best;
      top = std::max(top, std::abs(best));
    }
    const std::vector<index_t> chosen = attn.last_selection().blocks(i, h);
    if (index_t(chosen.size()) != sel.keep(n)) ++bad;
    const std::set<index_t> in(chosen.begin(), chosen.end());
    double lo = INFINITY, hi = -INFINITY;
    for (index_t b = 0; b < n; ++b) {
      if (in.count(b) != 0)
        lo = std::min(lo, score[std::size_t(b)]);
      else
        hi = std::max(hi, score[std::size_t(b)]);
    }
    if (!(lo >= hi - 1e-4 * (1.0 + top))) ++bad;
  }
  return bad;
}

/// Test selectors.
struct only_region {  // every block of one region, all KV heads
  using selector_concept = block_selector_tag;
  placement where = placement::cpu_compute;
  template <kv_layout Layout>
  void select(const selection_input<Layout>& in, block_selection& out) const {
    for (index_t b = 0; b < in.placed_blocks; ++b)
      if (in.region(b) == where)
        for (int h = 0; h < in.kv_heads(); ++h) out.add(h, b);
  }
};
struct select_none {
  using selector_concept = block_selector_tag;
  template <kv_layout Layout>
  void select(const selection_input<Layout>&, block_selection&) const {}
};
struct skip_head0 {  // KV head 0 attends no block, the others all
  using selector_concept = block_selector_tag;
  template <kv_layout Layout>
  void select(const selection_input<Layout>& in, block_selection& out) const {
    for (int h = 1; h < in.kv_heads(); ++h)
      for (index_t b = 0; b < in.placed_blocks; ++b) out.add(h, b);
  }
};
/// A user selector (StreamingLLM-like): the first block (attention sink) and
/// the last `recent` blocks, plus, for odd KV heads, every third block.
struct sink_and_recent {
  using selector_concept = block_selector_tag;
  index_t recent = 2;
  int calls = 0;
  template <kv_layout Layout>
  void select(const selection_input<Layout>& in, block_selection& out) {
    ++calls;
    for (int h = 0; h < in.kv_heads(); ++h) {
      out.add(h, 0);
      for (index_t b = std::max<index_t>(0, in.placed_blocks - recent); b < in.placed_blocks; ++b) out.add(h, b);
      if (h % 2 == 1)
        for (index_t b = 0; b < in.placed_blocks; b += 3) out.add(h, b);  // duplicates are fine
    }
  }
};
/// Records what an inner selector answered (a user type wrapping a library one).
template <class Inner>
struct recording {
  using selector_concept = block_selector_tag;
  Inner inner;
  std::vector<std::vector<std::vector<index_t>>> log;  // per call: per head
  template <kv_layout Layout>
  void select(const selection_input<Layout>& in, block_selection& out) {
    inner.select(in, out);
    auto& e = log.emplace_back();
    for (int h = 0; h < out.kv_heads(); ++h) e.push_back(out.blocks(h));
  }
};
struct out_of_range {
  using selector_concept = block_selector_tag;
  index_t offset = 0;  // chosen block = placed_blocks + offset
  template <kv_layout Layout>
  void select(const selection_input<Layout>& in, block_selection& out) const {
    out.add(0, 0);
    out.add(in.kv_heads() - 1, in.placed_blocks + offset);
  }
};
struct throwing_selector {
  using selector_concept = block_selector_tag;
  template <kv_layout Layout>
  void select(const selection_input<Layout>&, block_selection&) {
    throw std::runtime_error("selector failed");
  }
};
struct bad_head_selector {  // a KV head that does not exist
  using selector_concept = block_selector_tag;
  template <kv_layout Layout>
  void select(const selection_input<Layout>& in, block_selection& out) {
    out.add(in.kv_heads(), 0);
  }
};
struct not_a_selector {  // structurally right, but without the opt-in tag
  template <kv_layout Layout>
  void select(const selection_input<Layout>&, block_selection&) const {}
};



/// K10 on Backend: a sequence's top-k sparse output (keep ratio 0.5,
/// fixed_ratio 0.5, GQA layout `L` with Hq = 32, head dim 128) is bit-identical
/// alone, in a batch with two others (each sequence drawing from its own
/// seeded source), and on a rerun of the batch; `steps` decode steps of one
/// layer, room for `tokens_per_seq` tokens, the sequence's prompt `prompt`.
template <class Backend>
void sparse_batch_invariance(const gqa_layout<128>& L, index_t tokens_per_seq, index_t prompt, int steps) {
  using G = gqa_layout<128>;
  const double scale = 1.0 / std::sqrt(128.0);
  auto run = [&](bool with_mates) {
    Backend be;
    partition_spec spec = sparse_spec(1, 4, tokens_per_seq);
    set_ping_pong_blocks(spec, L, 5);
    typename backend_traits<Backend>::template cache<G, fixed_ratio> cache(be, L, spec, fixed_ratio(0.5), {},
                                                                          cache_options{true});
    typename backend_traits<Backend>::template driver<decltype(cache)> d(cache, attention_options{2, true}, 81, scale);
    std::vector<sequence_id> batch;
    if (with_mates) batch.push_back(d.add(150, 7));
    const sequence_id me = d.add(prompt, 8);
    batch.push_back(me);
    if (with_mates) batch.push_back(d.add(61, 9));
    step_runner<decltype(cache)> r(d);
    top_k_selector sel = top_k_selector::ratio(0.5);
    std::vector<std::vector<float>> mine;
    const std::size_t at = with_mates ? 1 : 0;
    for (int s = 0; s < steps; ++s) {
      d.append_layer(0, batch);
      r.make_queries(batch);
      r.sparse(0, batch, sel);
      mine.emplace_back(r.out.begin() + std::ptrdiff_t(at * 32 * 128), r.out.begin() + std::ptrdiff_t((at + 1) * 32 * 128));
      cache.flush();
    }
    return mine;
  };
  const auto alone = run(false);
  const auto in_batch = run(true);
  const auto again = run(true);
  REQUIRE(alone.size() == in_batch.size());
  for (std::size_t s = 0; s < alone.size(); ++s) {
    CAPTURE(s);
    CHECK(same_bits(alone[s], in_batch[s]));
    CHECK(same_bits(in_batch[s], again[s]));
  }
}

}  // namespace wstest
