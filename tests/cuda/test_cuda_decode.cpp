// SPDX-License-Identifier: Apache-2.0
// End-to-end decode loops on cuda_backend against the fp64 reference, for the
// three model geometries of the paper (Qwen3-30B-A3B GQA 32/4, Mixtral-8x7B
// GQA 32/8, DeepSeek-V2-Lite MLA 16 heads), every routing policy (gpu_only
// r = 0, fixed_ratio 0.4, cpu_only r = 1, roofline), ragged batches with the
// boundary lengths 1, block±1, D−1, D, D+1, several eviction cycles, poisoned
// regions and workspaces, evicted blocks checked byte for byte; the GQA head
// mapping on the GPU path (K4/C5); a recycled pool (K5/C8); long prompts
// through many ping-pong chunks.
#include <doctest/doctest.h>

#include "device_harness.hpp"

using namespace wstest;
using namespace wstest::dev;

namespace {

using G = gqa_layout<128>;
using M = mla_layout<512, 64>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

struct loop_config {
  int layers = 1;
  int block_tokens = 16;
  int d_window = 32;
  int ping_pong_blocks = 6;
  int ping_pong_buffers = 2;
  int split_blocks = 4;
  int steps = 100;
  int cpu_threads = 4;
  assist_options assist{};
  long long eviction_bounce_bytes = -1;  ///< >= 0: cuda_backend::set_eviction_bounce_bytes
};

/// Prefills `prompts`, decodes `steps` steps checking every layer of every step
/// and every eviction; returns the number of evictions per sequence (minimum).
template <class Layout, class Policy>
index_t decode_loop(const Layout& L, Policy pol, const std::vector<index_t>& prompts, const loop_config& c,
                    double scale, std::uint64_t seed) {
  cuda_backend be;
  if (c.eviction_bounce_bytes >= 0) be.set_eviction_bounce_bytes(index_t(c.eviction_bounce_bytes));
  auto spec = small_spec(c.layers, int(prompts.size()), c.block_tokens, c.d_window);
  spec.ping_pong_buffers = c.ping_pong_buffers;
  spec.gpu_split_blocks = c.split_blocks;
  index_t longest = 0;
  for (index_t p : prompts) longest = std::max(longest, p);
  spec.cpu_capacity_tokens = spec.pinned_capacity_tokens =
      index_t(prompts.size()) * (longest + c.steps + 2 * c.d_window);
  set_ping_pong_blocks(spec, L, c.ping_pong_blocks);
  device_cache<Layout, Policy> cache(be, L, spec, pol, {}, cache_options{true});
  attention_options ao{c.cpu_threads, true};
  ao.assist = c.assist;
  device_decode_driver<decltype(cache)> d(cache, ao, seed, scale);
  std::vector<sequence_id> batch;
  for (index_t p : prompts) batch.push_back(d.add(p));
  const auto placed0 = d.placed(batch);
  for (int s = 0; s < c.steps; ++s) {
    const auto placed = d.placed(batch);
    const compare_result r = d.step(batch);
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << ", lse excess " << r.max_lse_err << ", non-finite "
                 << r.non_finite << ", streamed " << d.last_report.streamed_tokens << ", cpu "
                 << d.last_report.cpu_tokens << " (assist " << d.last_report.assist_tokens << "), window "
                 << d.last_report.window_tokens);
    REQUIRE(r.ok());
    if (c.assist.mode == assist_mode::fixed && c.assist.fixed_fraction == 1.0) REQUIRE(d.last_report.streamed_tokens == 0);
    REQUIRE(d.check_evicted(batch, placed) == 0);
  }
  index_t evictions = std::numeric_limits<index_t>::max();
  const auto placed1 = d.placed(batch);
  for (std::size_t i = 0; i < batch.size(); ++i)
    evictions = std::min(evictions, (placed1[i] - placed0[i]) / spec.d_window_tokens);
  return evictions;
}

// Block 16, D 32: 1, block-1, block, block+1, D-1, D, D+1 and a few batches.
const std::vector<index_t> boundary_prompts{1, 15, 16, 17, 31, 32, 33, 100};

}  // namespace

TEST_CASE("GQA Qwen3 32/4: every policy, ragged boundary lengths, >= 3 eviction cycles, poisoned") {
  const G L = presets::qwen3_30b_a3b::layout();
  loop_config c;
  c.steps = scaled(100, 40, 6);
  const index_t need = sanitizer_sizes() ? 0 : quick() ? 1 : 3;
  SUBCASE("gpu_only (r = 0)") { CHECK(decode_loop(L, gpu_only{}, boundary_prompts, c, gqa_scale, 1) >= need); }
  SUBCASE("fixed_ratio 0.4") { CHECK(decode_loop(L, fixed_ratio(0.4), boundary_prompts, c, gqa_scale, 2) >= need); }
  SUBCASE("cpu_only (r = 1)") { CHECK(decode_loop(L, cpu_only{}, boundary_prompts, c, gqa_scale, 3) >= need); }
  SUBCASE("roofline") { CHECK(decode_loop(L, device_roofline(), boundary_prompts, c, gqa_scale, 4) >= need); }
}

TEST_CASE("GQA Mixtral 32/8: two layers, three ping-pong buffers, r = 0 and 0.4") {
  const G L = presets::mixtral_8x7b::layout();
  loop_config c;
  c.layers = 2;
  c.ping_pong_buffers = 3;
  c.ping_pong_blocks = 5;
  c.steps = scaled(70, 20, 6);
  const index_t need = quick() ? 0 : 1;  // the 7-token prompt fills its window (D = 32) after 25 steps
  SUBCASE("gpu_only") { CHECK(decode_loop(L, gpu_only{}, {40, 7, 64, 129}, c, gqa_scale, 5) >= need); }
  SUBCASE("fixed_ratio 0.4") { CHECK(decode_loop(L, fixed_ratio(0.4), {40, 7, 64, 129}, c, gqa_scale, 6) >= need); }
}

TEST_CASE("MLA DeepSeek-V2-Lite 16 heads: every policy, boundary lengths, >= 3 eviction cycles") {
  const M L = presets::deepseek_v2_lite::layout();
  const double scale = presets::deepseek_v2_lite::softmax_scale();
  loop_config c;
  c.steps = scaled(100, 30, 6);
  const std::vector<index_t> prompts{1, 16, 31, 32, 33, 90};
  const index_t need = quick() ? 0 : 3;
  SUBCASE("gpu_only (r = 0)") { CHECK(decode_loop(L, gpu_only{}, prompts, c, scale, 7) >= need); }
  SUBCASE("fixed_ratio 0.4") { CHECK(decode_loop(L, fixed_ratio(0.4), prompts, c, scale, 8) >= need); }
  SUBCASE("cpu_only (r = 1)") { CHECK(decode_loop(L, cpu_only{}, prompts, c, scale, 9) >= need); }
  SUBCASE("roofline") { CHECK(decode_loop(L, device_roofline(), prompts, c, scale, 10) >= need); }
}

TEST_CASE("CPU assist on the GPU path: the CPU reads pinned blocks in place, also right after evictions") {
  // Pinned evictions land asynchronously (d2h stream); an assisted step must
  // wait for them before the CPU reads: every step is checked against fp64,
  // and the eviction steps come every D = 32 steps.
  loop_config c;
  c.steps = scaled(100, 40, 6);
  const index_t need = sanitizer_sizes() ? 0 : quick() ? 1 : 3;
  const G L = presets::qwen3_30b_a3b::layout();
  const M ML = presets::deepseek_v2_lite::layout();
  SUBCASE("GQA, gpu_only placement, fixed 0.5") {
    c.assist = {assist_mode::fixed, 0.5};
    CHECK(decode_loop(L, gpu_only{}, boundary_prompts, c, gqa_scale, 41) >= need);
  }
  SUBCASE("GQA, fixed_ratio 0.4, fixed 1 (nothing streamed)") {
    c.assist = {assist_mode::fixed, 1.0};
    CHECK(decode_loop(L, fixed_ratio(0.4), boundary_prompts, c, gqa_scale, 42) >= need);
  }
  SUBCASE("GQA, roofline, adaptive") {
    c.assist.mode = assist_mode::adaptive;
    CHECK(decode_loop(L, device_roofline(), boundary_prompts, c, gqa_scale, 43) >= need);
  }
  SUBCASE("MLA, gpu_only placement, fixed 0.5") {
    c.assist = {assist_mode::fixed, 0.5};
    CHECK(decode_loop(ML, gpu_only{}, {1, 16, 31, 32, 33, 90}, c, presets::deepseek_v2_lite::softmax_scale(), 44) >=
          (quick() ? 0 : need));
  }
  SUBCASE("MLA, roofline, adaptive") {
    c.assist.mode = assist_mode::adaptive;
    CHECK(decode_loop(ML, device_roofline(), {1, 16, 31, 32, 33, 90}, c, presets::deepseek_v2_lite::softmax_scale(),
                      45) >= (quick() ? 0 : need));
  }
}

TEST_CASE("evictions into the unpinned region: through the bounce buffer in several groups, and direct") {
  // Qwen3 32/4, block 16: 32 KiB per block, D = 32 -> one 64 KiB copy per
  // (sequence, layer) when the two destination blocks are adjacent. Every
  // evicted block is compared byte for byte (check_evicted) and every step
  // against fp64.
  const G L = presets::qwen3_30b_a3b::layout();
  loop_config c;
  c.layers = 2;
  c.steps = scaled(70, 40, 6);
  const index_t need = sanitizer_sizes() ? 0 : 1;
  SUBCASE("bounce of 100 KiB: one or two copies per group, many waits") {
    c.eviction_bounce_bytes = 100 << 10;
    CHECK(decode_loop(L, cpu_only{}, boundary_prompts, c, gqa_scale, 51) >= need);
  }
  SUBCASE("bounce smaller than one copy: direct copies") {
    c.eviction_bounce_bytes = 16 << 10;
    CHECK(decode_loop(L, fixed_ratio(0.5), boundary_prompts, c, gqa_scale, 52) >= need);
  }
  SUBCASE("bounce disabled (0): direct copies") {
    c.eviction_bounce_bytes = 0;
    CHECK(decode_loop(L, cpu_only{}, boundary_prompts, c, gqa_scale, 53) >= need);
  }
}

TEST_CASE("long prompts through many chunks: block 64, D 128, split 8, 3 buffers") {
  const G L = presets::qwen3_30b_a3b::layout();
  loop_config c;
  c.block_tokens = 64;
  c.d_window = 128;
  c.ping_pong_blocks = 16;
  c.ping_pong_buffers = 3;
  c.split_blocks = 8;
  c.steps = scaled(90, 10, 3);
  SUBCASE("gpu_only") { CHECK(decode_loop(L, gpu_only{}, {1500, 300, 1100}, c, gqa_scale, 11) >= (quick() ? 0 : 1)); }
  SUBCASE("fixed_ratio 0.4") {
    CHECK(decode_loop(L, fixed_ratio(0.4), {1500, 300, 1100}, c, gqa_scale, 12) >= (quick() ? 0 : 1));
  }
}

TEST_CASE("more splits in one chunk than one attend launch takes (gpu::max_attend_items): launches folded in order") {
  // split 1, 200-block buffers: a chunk holds up to 200 splits, two attend launches and two folds.
  static_assert(gpu::max_attend_items < 200);
  loop_config c;
  c.block_tokens = 16;
  c.d_window = 32;
  c.ping_pong_blocks = 200;
  c.ping_pong_buffers = 2;
  c.split_blocks = 1;
  c.steps = scaled(40, 6, 2);
  SUBCASE("GQA gpu_only") {
    CHECK(decode_loop(presets::qwen3_30b_a3b::layout(), gpu_only{}, {1500, 900, 1100}, c, gqa_scale, 21) >= 0);
  }
  SUBCASE("MLA fixed_ratio 0.4") {
    CHECK(decode_loop(presets::deepseek_v2_lite::layout(), fixed_ratio(0.4), {2500, 700, 1900}, c,
                      presets::deepseek_v2_lite::softmax_scale(), 22) >= 0);
  }
}

TEST_CASE("GQA head mapping on the GPU path: query head h reads KV head h / (Hq/Hkv) (K4/C5)") {
  const std::pair<int, int> shapes[] = {{32, 4}, {32, 8}, {24, 4}, {40, 8}, {32, 32}, {32, 1}, {48, 2}};
  for (const auto& [hq, hkv] : shapes) {
    CAPTURE(hq);
    CAPTURE(hkv);
    const G L(hq, hkv);
    test_rig<cuda_backend, G, gpu_only> t(L, small_spec_for(L, 1, 2), gpu_only{}, attention_options{2, true}, 13, gqa_scale);
    auto& d = t.d;
    d.gen.value = [](int plane, int kvh, int, bf16_source& s) {
      return plane == G::value_plane ? bf16::from_float(float(kvh + 1)) : s.next();
    };
    std::vector<sequence_id> batch{d.add(100), d.add(37)};
    for (int s = 0; s < 3; ++s) {
      const compare_result r = d.step(batch);
      REQUIRE(r.ok());
      for (std::size_t i = 0; i < batch.size(); ++i)
        for (int h = 0; h < hq; ++h) {
          const float want = float(h / (hq / hkv) + 1);
          for (int e = 0; e < G::v_dim; ++e) {
            const float got = d.out[(i * std::size_t(hq) + std::size_t(h)) * G::v_dim + std::size_t(e)];
            // A weighted mean of one value: exact up to the fp32 rounding of Σp·v / Σp
            // and of the merges (a wrong head is off by >= 1/(Hkv+1), > 3%).
            REQUIRE(std::abs(got - want) <= 2e-5f * want);
          }
        }
    }
  }
}

TEST_CASE("recycled pool: end every sequence and decode new ones over the old blocks (K5/C8)") {
  const G L(8, 2);
  test_rig<cuda_backend, G, fixed_ratio> t(L, small_spec_for(L, 2, 3), fixed_ratio(0.5), attention_options{2, true}, 17,
                                          gqa_scale);
  auto& cache = t.cache;
  auto& d = t.d;
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    std::vector<sequence_id> batch{d.add(97 - 20 * round), d.add(1 + round), d.add(64)};
    for (int s = 0; s < scaled(70, 20, 6); ++s) {
      const auto placed = d.placed(batch);
      const compare_result r = d.step(batch);
      INFO("step " << s << ": rel_l2 " << r.max_rel_l2);
      REQUIRE(r.ok());
      REQUIRE(d.check_evicted(batch, placed) == 0);
    }
    for (sequence_id id : batch) d.remove(id);
    CHECK(cache.usage().cpu_used_blocks == 0);
    CHECK(cache.usage().pinned_used_blocks == 0);
  }
}
