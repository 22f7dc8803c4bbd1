// SPDX-License-Identifier: Apache-2.0
// Quick device tests of cuda_backend — the set compute-sanitizer runs (with
// WS_TEST_QUICK=1): small GQA and MLA decode loops on all three engines, each
// engine's partial on its own (K1 empty partials, K2 natural-log LSE), L = 1,
// and determinism / batch invariance (K10).
#include <doctest/doctest.h>

#include "device_harness.hpp"

using namespace wstest;
using namespace wstest::dev;

namespace {

using G = gqa_layout<128>;
using M = mla_layout<512, 64>;

const double gqa_scale = 1.0 / std::sqrt(128.0);

template <class Layout, class Policy>
void small_loop(const Layout& L, Policy pol, const std::vector<index_t>& prompts, int steps, double scale) {
  test_rig<cuda_backend, Layout, Policy> t(L, small_spec_for(L, 1, int(prompts.size())), pol, attention_options{2, true},
                                          7, scale);
  auto& d = t.d;
  std::vector<sequence_id> batch;
  for (index_t p : prompts) batch.push_back(d.add(p));
  for (int s = 0; s < steps; ++s) {
    const auto placed = d.placed(batch);
    const compare_result r = d.step(batch);
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << ", lse excess " << r.max_lse_err << ", non-finite "
                 << r.non_finite);
    REQUIRE(r.ok());
    REQUIRE(d.check_evicted(batch, placed) == 0);
  }
}

}  // namespace

TEST_CASE("quick: GQA 8/2 decode on the GPU backend matches fp64 (r = 0, 0.5, 1)") {
  const G L(8, 2);
  const int steps = scaled(40, 6);
  SUBCASE("gpu_only") { small_loop(L, gpu_only{}, {1, 17, 40, 100}, steps, gqa_scale); }
  SUBCASE("fixed_ratio 0.5") { small_loop(L, fixed_ratio(0.5), {1, 17, 40, 100}, steps, gqa_scale); }
  SUBCASE("cpu_only") { small_loop(L, cpu_only{}, {1, 17, 40, 100}, steps, gqa_scale); }
}

TEST_CASE("quick: MLA 16 heads decode on the GPU backend matches fp64 (r = 0, 0.5)") {
  const M L(16);
  const double scale = presets::deepseek_v2_lite::softmax_scale();
  const int steps = scaled(36, 5);
  SUBCASE("gpu_only") { small_loop(L, gpu_only{}, {2, 33, 70}, steps, scale); }
  SUBCASE("fixed_ratio 0.5") { small_loop(L, fixed_ratio(0.5), {2, 33, 70}, steps, scale); }
}

TEST_CASE("quick: each engine's partial is its own natural-log LSE; empty sides are exactly (0, -inf)") {
  const G L(8, 2);
  const partition_spec spec = small_spec_for(L, 1, 3);
  test_rig<cuda_backend, G, fixed_ratio> t(L, spec, fixed_ratio(0.5), attention_options{2, true}, 11, gqa_scale);
  auto& cache = t.cache;
  auto& d = t.d;
  // 1: D-window only (CPU and streamed sides empty); 64: one placed batch on
  // each side; 100: all three engines.
  std::vector<sequence_id> batch{d.add(1), d.add(64), d.add(100)};
  int empty_seen = 0;
  for (int s = 0; s < scaled(40, 4); ++s) {
    debug_partials dbg;
    compare_result r;
    d.append_layer(0, batch);
    d.attend_layer(0, batch, true, r, &dbg);
    REQUIRE(r.ok());
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const sequence_state& st = cache.sequence(batch[i]);
      const float* qi = d.q.data() + i * std::size_t(L.num_q_heads()) * G::q_dim;
      const std::pair<engine, std::pair<const std::vector<float>*, const std::vector<float>*>> parts[] = {
          {engine::cpu, {&dbg.cpu_o, &dbg.cpu_lse}},
          {engine::streamed, {&dbg.streamed_o, &dbg.streamed_lse}},
          {engine::window, {&dbg.window_o, &dbg.window_lse}}};
      for (const auto& [e, pl] : parts) {
        bool empty = false;
        const compare_result pr = check_engine_partial(L, d.history(batch[i], 0), st, spec.block_tokens, e, *pl.first,
                                                       *pl.second, i, qi, gqa_scale, &empty);
        empty_seen += empty ? 1 : 0;
        INFO("step " << s << " sequence " << i << " engine " << int(e) << ": rel_l2 " << pr.max_rel_l2
                     << ", lse excess " << pr.max_lse_err);
        CHECK(pr.ok());
      }
    }
    (void)cache.flush();
  }
  CHECK(empty_seen > 0);
}

TEST_CASE("quick: L = 1 returns V of the only token, LSE = its score") {
  const G L(8, 2);
  test_rig<cuda_backend, G, fixed_ratio> t(L, small_spec_for(L, 1, 2, 4), fixed_ratio(0.5), attention_options{2, true}, 3,
                                          gqa_scale);
  auto& d = t.d;
  std::vector<sequence_id> batch{d.add(1)};
  compare_result r;
  d.attend_layer(0, batch, true, r);
  CHECK(r.ok());
  const auto& h = d.history(batch[0], 0);
  for (int head = 0; head < L.num_q_heads(); ++head)
    for (int e = 0; e < G::v_dim; ++e) {
      const int kvh = head / L.group_size();
      const float v = h.planes[1][std::size_t(kvh * G::row_elems + e)].to_float();
      REQUIRE(d.out[std::size_t(head * G::v_dim + e)] == v);
    }
}

TEST_CASE("quick: reruns are bit-identical; a sequence alone equals itself inside a batch (K10)") {
  const G L(8, 2);
  auto run = [&](const std::vector<std::pair<index_t, std::uint64_t>>& seqs, int steps) {
    test_rig<cuda_backend, G, fixed_ratio> t(L, small_spec_for(L, 1, 4), fixed_ratio(0.4), attention_options{3, true}, 5,
                                            gqa_scale);
    auto& d = t.d;
    std::vector<sequence_id> batch;
    for (const auto& [p, seed] : seqs) batch.push_back(d.add(p, seed));
    std::vector<std::vector<float>> first_rows;  // outputs of batch[0], every step
    std::vector<std::vector<float>> all;
    const std::size_t row = std::size_t(L.num_q_heads()) * G::v_dim;
    for (int s = 0; s < steps; ++s) {
      (void)d.step(batch, false);
      first_rows.emplace_back(d.out.begin(), d.out.begin() + std::ptrdiff_t(row));
      all.push_back(d.out);
    }
    return std::make_pair(first_rows, all);
  };
  const int steps = scaled(40, 4);
  const auto a = run({{70, 101}, {33, 102}, {5, 103}}, steps);
  const auto b = run({{70, 101}, {33, 102}, {5, 103}}, steps);
  const auto alone = run({{70, 101}}, steps);
  for (int s = 0; s < steps; ++s) {
    INFO("step " << s);
    CHECK(same_bits(a.second[std::size_t(s)], b.second[std::size_t(s)]));
    CHECK(same_bits(a.first[std::size_t(s)], alone.first[std::size_t(s)]));
  }
}
