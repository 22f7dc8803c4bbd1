// SPDX-License-Identifier: Apache-2.0
// CPU assist (hybrid_attention, attention_options::assist; docs/DECISIONS.md):
// the CPU engine attends some of each sequence's newest pinned blocks in place
// and the GPU side streams the rest.
//   * the balance function on its own (assist_balance_fraction);
//   * fixed fractions 0.25 / 0.5 / 1 over ragged GQA and MLA batches through
//     several eviction cycles against the fp64 reference, with the report's
//     token accounting (CPU + streamed = unpinned + pinned, nothing twice);
//   * adaptive mode: still exact, the fraction within its cap, rates measured;
//   * fixed mode is deterministic (bit-identical across CPU thread counts);
//   * bad options are a config_error naming the value.
#include <doctest/doctest.h>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<128>;
using M = mla_layout<512, 64>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

attention_options with_assist(int threads, assist_mode mode, double fraction = 0.0) {
  attention_options o{threads, true};
  o.assist.mode = mode;
  o.assist.fixed_fraction = fraction;
  return o;
}

/// Unpinned and pinned tokens of `batch` in the cache right now (all layers share one block table).
template <class Cache>
std::pair<index_t, index_t> placed_split(const Cache& cache, std::span<const sequence_id> batch) {
  index_t cpu = 0, pinned = 0;
  for (sequence_id id : batch) {
    const sequence_state& st = cache.sequence(id);
    cpu += index_t(st.cpu_blocks.size()) * cache.spec().block_tokens;
    pinned += index_t(st.pinned_blocks.size()) * cache.spec().block_tokens;
  }
  return {cpu, pinned};
}

/// Decodes `steps` steps of a ragged batch under `opts`, checking every layer
/// against fp64 and the token accounting of every step's last layer. Returns
/// the pinned tokens the CPU attended, summed over the steps' last layers.
template <class Layout>
index_t assisted_loop(const Layout& L, attention_options opts, const std::vector<index_t>& prompts, int steps,
                      double scale, std::uint64_t seed, double expect_fraction = -1.0) {
  const partition_spec spec = small_spec_for(L, 2, int(prompts.size()));
  test_rig<host_backend, Layout, fixed_ratio> t(L, spec, fixed_ratio(0.4), opts, seed, scale);
  auto& cache = t.cache;
  auto& d = t.d;
  std::vector<sequence_id> batch;
  for (index_t p : prompts) batch.push_back(d.add(p));
  index_t assisted = 0;
  for (int s = 0; s < steps; ++s) {
    const auto split = placed_split(cache, batch);  // no structured binding: clang 14 cannot capture one
    const index_t cpu_placed = split.first, pinned_placed = split.second;
    index_t want = 0;  // fixed mode: round(f * pinned blocks) per sequence, before the step's flush
    for (sequence_id id : batch) {
      const auto n = index_t(cache.sequence(id).pinned_blocks.size());
      want += index_t(std::llround(expect_fraction * double(n))) * spec.block_tokens;
    }
    const compare_result r = d.step(batch);
    const step_report& rep = d.last_report;
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << ", cpu " << rep.cpu_tokens << ", assist " << rep.assist_tokens
                 << ", streamed " << rep.streamed_tokens << ", placed cpu " << cpu_placed << " pinned "
                 << pinned_placed);
    REQUIRE(r.ok());
    // every placed token is attended by exactly one engine
    REQUIRE(rep.cpu_tokens + rep.streamed_tokens == cpu_placed + pinned_placed);
    REQUIRE(rep.cpu_tokens - rep.assist_tokens == cpu_placed);
    REQUIRE(rep.assist_tokens <= pinned_placed);
    if (expect_fraction >= 0.0) REQUIRE(rep.assist_tokens == want);
    assisted += rep.assist_tokens;
  }
  CHECK(cache.usage().pinned_used_blocks > 0);
  return assisted;
}

const std::vector<index_t> ragged{1, 15, 17, 33, 100, 260};

}  // namespace

TEST_CASE("assist_balance_fraction: equal finish times, clamped, zero without pinned tokens or rates") {
  // A = 2, B = 1 ns/token, 100 CPU + 400 pinned tokens: 2(100 + 400f) = 1(400 - 400f) -> f = 1/6
  CHECK(assist_balance_fraction(2e-9, 1e-9, 100, 400, 1.0) == doctest::Approx(1.0 / 6.0));
  CHECK(assist_balance_fraction(2e-9, 1e-9, 100, 400, 0.1) == doctest::Approx(0.1));  // capped
  CHECK(assist_balance_fraction(2e-9, 1e-9, 1000, 400, 1.0) == 0.0);                 // CPU already the long pole
  CHECK(assist_balance_fraction(1e-9, 1e-9, 0, 400, 1.0) == doctest::Approx(0.5));
  CHECK(assist_balance_fraction(1e-9, 1e-9, 100, 0, 1.0) == 0.0);
  CHECK(assist_balance_fraction(0.0, 1e-9, 100, 400, 1.0) == 0.0);  // CPU not measured yet
  CHECK(assist_balance_fraction(1e-9, 0.0, 100, 400, 1.0) == 0.0);  // GPU not measured yet
  // a fixed GPU cost (HBM-resident tokens): (400 + 200 - 0) / (2 * 400) of the pinned tokens
  CHECK(assist_balance_fraction(1e-9, 1e-9, 0, 400, 1.0, 200e-9) == doctest::Approx(0.75));
  CHECK(assist_balance_fraction(2e-9, 1e-9, 100, 400, 1.0, 0.0) == doctest::Approx(1.0 / 6.0));  // none: as before
}

TEST_CASE("fixed assist: GQA Qwen3 32/4, ragged, several evictions, exact against fp64") {
  const G L = presets::qwen3_30b_a3b::layout();
  for (double f : {0.25, 0.5, 1.0}) {
    CAPTURE(f);
    const index_t a = assisted_loop(L, with_assist(2, assist_mode::fixed, f), ragged, 100, gqa_scale, 11, f);
    CHECK(a > 0);
  }
}

TEST_CASE("fixed assist: MLA DeepSeek-V2-Lite, exact against fp64") {
  const M L = presets::deepseek_v2_lite::layout();
  for (double f : {0.5, 1.0}) {
    CAPTURE(f);
    const index_t a = assisted_loop(L, with_assist(3, assist_mode::fixed, f), {1, 16, 31, 90, 200}, 80,
                                    presets::deepseek_v2_lite::softmax_scale(), 12, f);
    CHECK(a > 0);
  }
}

TEST_CASE("adaptive assist: exact, within its cap, both rates measured") {
  const G L(8, 2);
  const partition_spec spec = small_spec_for(L, 2, 4);
  attention_options o = with_assist(2, assist_mode::adaptive);
  o.assist.max_pinned_fraction = 0.5;
  test_rig<host_backend, G, fixed_ratio> t(L, spec, fixed_ratio(0.2), o, 21, gqa_scale);
  auto& cache = t.cache;
  auto& d = t.d;
  std::vector<sequence_id> batch{d.add(300), d.add(40), d.add(129)};
  for (int s = 0; s < 60; ++s) {
    const auto split = placed_split(cache, batch);  // no structured binding: clang 14 cannot capture one
    const index_t cpu_placed = split.first, pinned_placed = split.second;
    index_t cap = 0;  // per sequence at most floor(0.5 * its pinned blocks)
    for (sequence_id id : batch)
      cap += index_t(cache.sequence(id).pinned_blocks.size() / 2) * spec.block_tokens;
    const compare_result r = d.step(batch);
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << ", assist " << d.last_report.assist_tokens);
    REQUIRE(r.ok());
    REQUIRE(d.last_report.cpu_tokens + d.last_report.streamed_tokens == cpu_placed + pinned_placed);
    REQUIRE(d.last_report.assist_tokens <= cap);
  }
  CHECK(d.attention().assist_cpu_seconds_per_token() > 0.0);
  CHECK(d.attention().assist_gpu_seconds_per_token() > 0.0);
}

TEST_CASE("fixed assist is deterministic: bit-identical outputs across CPU thread counts") {
  const G L(8, 2);
  auto run = [&](int threads) {
    test_rig<host_backend, G, fixed_ratio> t(L, small_spec_for(L, 2, 3), fixed_ratio(0.3),
                                            with_assist(threads, assist_mode::fixed, 0.5), 33, gqa_scale);
    auto& d = t.d;
    std::vector<sequence_id> batch{d.add(200), d.add(33), d.add(97)};
    std::vector<float> all;
    for (int s = 0; s < 40; ++s) {
      REQUIRE(d.step(batch, s % 8 == 0).ok());
      for (const auto& o : d.layer_out) all.insert(all.end(), o.begin(), o.end());
      for (const auto& l : d.layer_lse) all.insert(all.end(), l.begin(), l.end());
    }
    return all;
  };
  const std::vector<float> one = run(1), three = run(3);
  REQUIRE(one.size() == three.size());
  CHECK(std::memcmp(one.data(), three.data(), one.size() * sizeof(float)) == 0);
}

TEST_CASE("assist options out of range: config_error naming the value") {
  const G L(8, 2);
  host_backend be;
  auto spec = small_spec(1, 2);
  set_ping_pong_blocks(spec, L, 6);
  host_cache<G, fixed_ratio> cache(be, L, spec, fixed_ratio(0.5), {}, cache_options{true});
  auto make = [&](attention_options o) { hybrid_attention<decltype(cache)> h(cache, o); };
  attention_options o = with_assist(1, assist_mode::fixed, 1.5);
  CHECK_THROWS_WITH_AS(make(o), doctest::Contains("fixed_fraction 1.5"), config_error);
  o = with_assist(1, assist_mode::adaptive);
  o.assist.max_pinned_fraction = -0.1;
  CHECK_THROWS_WITH_AS(make(o), doctest::Contains("max_pinned_fraction -0.1"), config_error);
  o = with_assist(1, assist_mode::adaptive);
  o.assist.rate_smoothing = 0.0;
  CHECK_THROWS_WITH_AS(make(o), doctest::Contains("rate_smoothing 0"), config_error);
  o = with_assist(1, assist_mode::adaptive);
  o.assist.resident_seconds_per_token = -1e-9;
  CHECK_THROWS_WITH_AS(make(o), doctest::Contains("resident_seconds_per_token -1e-09"), config_error);
}

TEST_CASE("adaptive assist with an HBM-resident region: resident tokens are a fixed GPU cost, not streaming time") {
  // One sequence with two eviction batches in HBM and three pinned; equal
  // starting rates. Without resident_seconds_per_token the balance sees only the
  // pinned tokens (half of them to the CPU); with it, the GPU side's resident
  // work tips the balance to the CPU up to the cap. Exact either way (step().ok()).
  const G L(8, 2);
  partition_spec spec = small_spec_for(L, 1, 1, 6, 16, 16);  // block 16, D 16: one block per eviction batch
  spec.hbm_capacity_tokens = 2 * spec.d_window_tokens;       // two batches
  auto run = [&](double resident_seconds_per_token) {
    attention_options o = with_assist(1, assist_mode::adaptive);
    o.assist.max_pinned_fraction = 1.0;
    o.assist.initial_cpu_seconds_per_token = 1e-9;
    o.assist.initial_gpu_seconds_per_token = 1e-9;
    o.assist.resident_seconds_per_token = resident_seconds_per_token;
    test_rig<host_backend, G, gpu_only> t(L, spec, gpu_only{}, o, 7, gqa_scale);
    std::vector<sequence_id> batch{t.d.add(80)};
    REQUIRE(t.cache.sequence(batch[0]).hbm_blocks.size() == 2);
    REQUIRE(t.cache.sequence(batch[0]).pinned_blocks.size() == 3);
    REQUIRE(t.d.step(batch).ok());
    CHECK(t.d.last_report.resident_tokens == 2 * spec.block_tokens);
    return t.d.last_report.assist_tokens;
  };
  CHECK(run(0.0) == 2 * spec.block_tokens);   // f = 0.5 of 3 blocks: round(1.5) = 2
  CHECK(run(1e-6) == 3 * spec.block_tokens);  // 32 resident tokens at 1 us each: f clamps to the cap, all 3
}

TEST_CASE("adaptive assist: the cap holds after rounding, so the GPU keeps streaming") {
  // One and three pinned blocks and a CPU that looks free: round(0.5 * n) would
  // take 1 of 1 and 2 of 3 at the cap 0.5; floor takes 0 of 1 and 1 of 3.
  const G L(8, 2);
  const partition_spec spec = small_spec_for(L, 1, 2, 6, 16, 16);  // block 16, D 16: a prompt's whole D batches are single blocks
  attention_options o = with_assist(1, assist_mode::adaptive);
  o.assist.max_pinned_fraction = 0.5;
  o.assist.initial_cpu_seconds_per_token = 1e-12;  // the balance asks for everything
  o.assist.initial_gpu_seconds_per_token = 1e-6;
  test_rig<host_backend, G, gpu_only> t(L, spec, gpu_only{}, o, 5, gqa_scale);
  auto& cache = t.cache;
  auto& d = t.d;
  std::vector<sequence_id> batch{d.add(16), d.add(48)};
  REQUIRE(cache.sequence(batch[0]).pinned_blocks.size() == 1);
  REQUIRE(cache.sequence(batch[1]).pinned_blocks.size() == 3);
  REQUIRE(d.step(batch).ok());
  CHECK(d.last_report.assist_tokens == 1 * spec.block_tokens);
  CHECK(d.last_report.streamed_tokens == 3 * spec.block_tokens);
}
