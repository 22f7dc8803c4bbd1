// SPDX-License-Identifier: Apache-2.0
// Device tests of the default attention path's kernels (kernels.cuh):
// launch_attend over items of contiguous bf16 blocks, launch_fold of each
// sequence's split partials in order, launch_merge, and launch_fold_merge (the
// caller-stream step's fold and merge in one launch), against an fp64
// reference. The item lengths sit on and around the 32-token tile and the
// pipeline's stage boundaries (0, 1, 31, 32, 33, 64, 95, 96, 97, 255, 256, 300
// tokens), and the fold segments are longer than the fold's eight-partial
// load groups and not multiples of them (21, 9 and 8 splits, and a sequence
// with none), so every remainder path runs. Outputs are poisoned (NaN) first,
// so an unwritten element shows. launch_fold_merge must give the bits of
// launch_init_state + launch_fold + launch_merge (the claim the caller-stream
// step rests on), and a rerun the same bits (K10).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <random>
#include <vector>

#include <writescope/cuda/cuda_error.hpp>
#include <writescope/cuda/kernels.hpp>

#include "device_harness.hpp"
#include "support/harness.hpp"

using namespace writescope;
using wstest::dev::dev_array;

namespace {

using G = gqa_layout<128>;
using M = mla_layout<512, 64>;

/// An item: `tokens` tokens in contiguous blocks from `first_block` of the pool.
struct item {
  int seq;
  index_t first_block;
  int tokens;
};

template <class Layout>
struct attend_case {
  Layout layout;
  int block_tokens;
  int batch;
  std::vector<bf16> pool;         // [pool_blocks][block_elems]
  std::vector<float> q;           // [batch][hq][q_dim]
  std::vector<item> splits;       // sequence-major, in fold order
  std::vector<item> windows;      // one per sequence (the D-window partial)
  double scale;

  [[nodiscard]] index_t block_elems() const { return block_format<Layout>{layout, block_tokens}.block_elems(); }

  /// fp64 attention of sequence `seq`'s query over the tokens of `its`, concatenated.
  void reference(int seq, const std::vector<item>& its, std::vector<double>& o, std::vector<double>& lse) const {
    std::vector<std::pair<index_t, int>> where;
    for (const item& it : its)
      for (int i = 0; i < it.tokens; ++i) where.emplace_back(it.first_block + i / block_tokens, i % block_tokens);
    wstest::dev::reference_over_pool(layout, block_tokens, pool,
                                     q.data() + std::size_t(seq) * layout.num_q_heads() * Layout::q_dim, where, scale,
                                     o, lse);
  }
};

/// Sequence s gets counts[s] splits whose lengths cycle through the boundary
/// lengths (from offset s), each in its own blocks of a random pool; window
/// lengths from `window_tokens`.
template <class Layout>
attend_case<Layout> make_case(const Layout& layout, int block_tokens, const std::vector<int>& counts,
                              const std::vector<int>& window_tokens, double scale, std::uint64_t seed) {
  static const int lengths[] = {0, 1, 31, 32, 33, 64, 95, 96, 97, 255, 256, 300};
  constexpr int n_lengths = int(sizeof lengths / sizeof lengths[0]);
  attend_case<Layout> c{layout, block_tokens, int(counts.size()), {}, {}, {}, {}, scale};
  index_t blocks = 0;
  auto take = [&](int seq, int tokens) {
    const item it{seq, blocks, tokens};
    blocks += (tokens + block_tokens - 1) / block_tokens + 1;  // a spare block between items
    return it;
  };
  for (int s = 0; s < c.batch; ++s)
    for (int k = 0; k < counts[std::size_t(s)]; ++k) c.splits.push_back(take(s, lengths[(s + 5 * k) % n_lengths]));
  for (int s = 0; s < c.batch; ++s) c.windows.push_back(take(s, window_tokens[std::size_t(s)]));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  c.pool.resize(std::size_t(blocks * c.block_elems()));
  for (bf16& x : c.pool) x = bf16::from_float(u(rng));
  c.q.resize(std::size_t(c.batch) * layout.num_q_heads() * Layout::q_dim);
  for (float& x : c.q) x = 2.0f * u(rng);
  return c;
}

template <class Layout>
struct run_result {
  std::vector<float> part_o, part_lse;    // [splits + batch][hq][v_dim]: splits, then the D-windows
  std::vector<float> state_o, state_lse;  // [batch][hq][v_dim]
  std::vector<float> out, out_lse;        // [batch][hq][v_dim]
};

/// `fused` false: launch_attend over the splits, init + fold + (launch_attend
/// over the D-windows) + merge, as the two-stream path does; true: one
/// launch_attend over splits and D-windows, then launch_fold_merge, as the
/// caller-stream path does.
template <class Layout>
run_result<Layout> run(const attend_case<Layout>& c, bool fused) {
  const int hq = c.layout.num_q_heads();
  constexpr int V = Layout::v_dim;
  const int k = int(c.splits.size());
  const int b = c.batch;
  REQUIRE(k + b <= gpu::max_attend_items);
  dev_array<bf16> pool(c.pool.size());
  dev_array<float> q(c.q.size());
  pool.upload(c.pool);
  q.upload(c.q);
  const std::size_t rows = std::size_t(b) * hq;
  dev_array<float> part_o(std::size_t(k + b) * hq * V), part_lse(std::size_t(k + b) * hq);
  dev_array<float> state_o(rows * V), state_lse(rows), out(rows * V), out_lse(rows);
  for (auto* a : {&part_o, &part_lse, &state_o, &state_lse, &out, &out_lse}) a->poison();

  gpu::attend_params ap{};
  ap.q = q.get();
  ap.out_o = part_o.get();
  ap.out_lse = part_lse.get();
  ap.block_elems = c.block_elems();
  ap.scale = float(c.scale);
  ap.hq = hq;
  ap.hkv = c.layout.kv_heads();
  ap.group = c.layout.group_size();
  ap.block_tokens = c.block_tokens;
  std::vector<gpu::fold_segment> segs;
  for (int s = 0; s < k; ++s) {
    const item& it = c.splits[std::size_t(s)];
    ap.items[s] = {pool.get() + it.first_block * c.block_elems(), it.tokens, it.seq, s, 0};
    if (!segs.empty() && segs.back().batch_index == it.seq)
      segs.back().split_end = s + 1;
    else
      segs.push_back({it.seq, s, s + 1});
  }
  auto window_items = [&](int first_slot) {
    for (int i = 0; i < b; ++i) {
      const item& w = c.windows[std::size_t(i)];
      ap.items[first_slot + i] = {pool.get() + w.first_block * c.block_elems(), w.tokens, i, k + i, 0};
    }
  };
  const float* window_o = part_o.get() + std::size_t(k) * hq * V;
  const float* window_lse = part_lse.get() + std::size_t(k) * hq;
  if (fused) {
    window_items(k);
    ap.num_items = k + b;
    gpu::launch_attend<Layout>(ap, nullptr);
    gpu::fold_merge_params fm{};
    fm.state_o = state_o.get();
    fm.state_lse = state_lse.get();
    fm.split_o = part_o.get();
    fm.split_lse = part_lse.get();
    fm.window_o = window_o;
    fm.window_lse = window_lse;
    fm.out = out.get();
    fm.out_lse = out_lse.get();
    fm.hq = hq;
    fm.batch = b;
    for (int i = 0; i < b; ++i) fm.segments[i] = {i, 0, 0};
    for (const gpu::fold_segment& sg : segs) fm.segments[sg.batch_index] = sg;
    gpu::launch_fold_merge<Layout>(fm, nullptr);
  } else {
    gpu::launch_init_state<Layout>(state_o.get(), state_lse.get(), index_t(rows), nullptr);
    ap.num_items = k;
    gpu::launch_attend<Layout>(ap, nullptr);
    gpu::fold_params fp{};
    fp.state_o = state_o.get();
    fp.state_lse = state_lse.get();
    fp.split_o = part_o.get();
    fp.split_lse = part_lse.get();
    fp.hq = hq;
    fp.num_segments = int(segs.size());
    for (std::size_t g = 0; g < segs.size(); ++g) fp.segments[g] = segs[g];
    gpu::launch_fold<Layout>(fp, nullptr);
    window_items(0);  // a second launch, its partials after the splits'
    ap.num_items = b;
    gpu::launch_attend<Layout>(ap, nullptr);
    gpu::merge_params mp{};
    mp.streamed_o = state_o.get();
    mp.streamed_lse = state_lse.get();
    mp.window_o = window_o;
    mp.window_lse = window_lse;
    mp.out = out.get();
    mp.out_lse = out_lse.get();
    mp.rows = index_t(rows);
    gpu::launch_merge<Layout>(mp, nullptr);
  }
  WS_CUDA_TRY(cudaDeviceSynchronize());
  return {part_o.download(std::size_t(k + b) * hq * V), part_lse.download(std::size_t(k + b) * hq),
          state_o.download(rows * V), state_lse.download(rows), out.download(rows * V), out_lse.download(rows)};
}

template <class Layout>
void check(const attend_case<Layout>& c) {
  const int hq = c.layout.num_q_heads();
  constexpr int V = Layout::v_dim;
  const int k = int(c.splits.size());
  const auto three = run(c, false);
  const auto fused = run(c, true);

  // Every split and D-window partial against fp64 (an empty item: exactly (0, -inf)).
  for (int s = 0; s < k + c.batch; ++s) {
    const item& it = s < k ? c.splits[std::size_t(s)] : c.windows[std::size_t(s - k)];
    INFO("item " << s << ": sequence " << it.seq << ", " << it.tokens << " tokens");
    std::vector<double> ro, rl;
    c.reference(it.seq, {it}, ro, rl);
    wstest::compare_result cr;
    wstest::compare_rows(hq, V, three.part_o.data() + std::size_t(s) * hq * V, three.part_lse.data() + std::size_t(s) * hq,
                         ro, rl, cr);
    CHECK(cr.ok());
    if (it.tokens == 0)
      for (int h = 0; h < hq; ++h) {
        const float l = three.part_lse[std::size_t(s) * hq + h];
        CHECK((std::isinf(l) && l < 0));
        CHECK(three.part_o[(std::size_t(s) * hq + h) * V] == 0.0f);
      }
  }
  // Folded states (the union of a sequence's splits) and outputs (⊕ its D-window).
  for (int s = 0; s < c.batch; ++s) {
    std::vector<item> its;
    for (const item& it : c.splits)
      if (it.seq == s) its.push_back(it);
    INFO("sequence " << s << ": " << its.size() << " splits");
    std::vector<double> ro, rl;
    c.reference(s, its, ro, rl);
    wstest::compare_result cs;
    wstest::compare_rows(hq, V, three.state_o.data() + std::size_t(s) * hq * V, three.state_lse.data() + std::size_t(s) * hq,
                         ro, rl, cs);
    CHECK(cs.ok());
    its.push_back(c.windows[std::size_t(s)]);
    c.reference(s, its, ro, rl);
    wstest::compare_result co;
    wstest::compare_rows(hq, V, three.out.data() + std::size_t(s) * hq * V, three.out_lse.data() + std::size_t(s) * hq, ro,
                         rl, co);
    CHECK(co.ok());
  }
  // fold_merge = init + fold + merge, bit for bit; the attention partials too.
  CHECK(wstest::same_bits(fused.part_o, three.part_o));
  CHECK(wstest::same_bits(fused.part_lse, three.part_lse));
  CHECK(wstest::same_bits(fused.state_o, three.state_o));
  CHECK(wstest::same_bits(fused.state_lse, three.state_lse));
  CHECK(wstest::same_bits(fused.out, three.out));
  CHECK(wstest::same_bits(fused.out_lse, three.out_lse));
  // K10: a rerun gives the same bits.
  const auto again = run(c, true);
  CHECK(wstest::same_bits(again.out, fused.out));
  CHECK(wstest::same_bits(again.out_lse, fused.out_lse));
}

}  // namespace

TEST_CASE("attend kernels: GQA 32/4 tile-boundary lengths, long fold segments, fold_merge = init + fold + merge") {
  const double scale = 1.0 / std::sqrt(128.0);
  SUBCASE("block_tokens 16") { check(make_case(G(32, 4), 16, {21, 9, 0, 8}, {5, 32, 0, 70}, scale, 51)); }
  SUBCASE("block_tokens 24, group 20 (two head groups per KV head)") {
    check(make_case(G(40, 2), 24, {9, 17}, {1, 33}, scale, 52));
  }
}

TEST_CASE("attend kernels: MLA 512 + 64, 16 heads, tile-boundary lengths, long fold segments, fold_merge") {
  const double scale = presets::deepseek_v2_lite::softmax_scale();
  check(make_case(M(16), 64, {12, 0, 19}, {17, 3, 0}, scale, 53));
}
