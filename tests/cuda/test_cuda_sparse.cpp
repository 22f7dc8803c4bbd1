// SPDX-License-Identifier: Apache-2.0
// Block-level sparse selection on cuda_backend (docs/SPARSE.md; paper §4.4,
// Fig. 6). The cases shared with tests/test_sparse.cpp run the same bodies
// (support/sparse_suite.hpp, here on cuda_backend, there on host_backend);
// this file sets their device sizes and adds the device-only ones. select_all is
// bit-identical to the dense step (every policy, GQA and MLA, gathered and
// direct chunks, several gather threads); top-k equals the fp64 reference
// restricted to the selected blocks + D-window and is the test's own top-k;
// an engine without selected blocks gives exactly (0, -inf) (K1); selections
// past 4 GiB in the unpinned region (and, with WS_TEST_LARGE_PINNED=1, the
// pinned one); batch invariance (K10); the gather pipeline's two guards are
// falsified by their mutation switches (K7): the copy of a staging buffer
// waits for its gather (RAW), a gather waits for the copy that last read its
// staging buffer (WAR). The device-pull transfer mode (sparse_transfer::
// device_pull): the pull kernel itself against a host-side copy (cudaHostAlloc
// and cudaHostRegister memory, > 480 blocks, tails, errors); select_all
// bit-identical to dense and top-k equal to the reference in pull mode; pull
// bit-identical to the host gather on the same selection; a pageable source is
// a pinned_memory_error; the ping-pong guards (consumed / filled) hold for
// pulled chunks and are falsified by their mutation switches.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <optional>

#include "device_harness.hpp"
#include "support/sparse_suite.hpp"

using namespace wstest;
using namespace wstest::dev;

namespace {

using G = gqa_layout<128>;
using M = mla_layout<512, 64>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

/// The device runs of the shared bodies (support/sparse_suite.hpp): four CPU
/// threads; the gather threads and the transfer mode (host_gather unless said)
/// per case.
sparse_loop_case dev_case(std::vector<index_t> prompts, index_t room, int steps, int gather_threads, std::uint64_t seed,
                          sparse_transfer transfer = sparse_transfer::host_gather) {
  sparse_loop_case c;
  c.opts.cpu_threads = 4;
  c.opts.gather_threads = gather_threads;
  c.opts.transfer = transfer;
  c.prompts = std::move(prompts);
  c.room = room;
  c.steps = steps;
  c.seed = seed;
  return c;
}

/// select_all against dense: the pipeline reserved up front, a fp64 check every 10 steps.
template <class Layout, class Policy>
void select_all_case(const Layout& L, Policy pol, double scale, index_t direct_run_bytes, int gather_threads, int steps,
                     std::uint64_t seed, sparse_transfer transfer = sparse_transfer::host_gather) {
  sparse_loop_case c = dev_case({1, 15, 33, 70, 100, 260}, 260, steps, gather_threads, seed, transfer);
  c.opts.reserve = true;
  c.opts.direct_run_bytes = direct_run_bytes;
  c.check_every = 10;
  select_all_matches_dense<cuda_backend>(L, pol, scale, c);
}

}  // namespace

TEST_CASE("device: select_all is bit-identical to the dense step (GQA Qwen3 32/4, every policy, gathered/direct)") {
  const G L = presets::qwen3_30b_a3b::layout();
  const int steps = scaled(40, 12, 3);
  SUBCASE("gpu_only, gathered, 1 gather thread") { select_all_case(L, gpu_only{}, gqa_scale, index_t{2} << 20, 1, steps, 1); }
  SUBCASE("gpu_only, gathered, 3 gather threads") { select_all_case(L, gpu_only{}, gqa_scale, index_t{2} << 20, 3, steps, 2); }
  SUBCASE("gpu_only, direct") { select_all_case(L, gpu_only{}, gqa_scale, 0, 1, steps, 3); }
  SUBCASE("fixed_ratio 0.4") { select_all_case(L, fixed_ratio(0.4), gqa_scale, index_t{2} << 20, 2, steps, 4); }
  SUBCASE("cpu_only") { select_all_case(L, cpu_only{}, gqa_scale, index_t{2} << 20, 1, steps, 5); }
  SUBCASE("roofline") { select_all_case(L, device_roofline(), gqa_scale, index_t{2} << 20, 2, steps, 6); }
  const sparse_transfer pull = sparse_transfer::device_pull;
  SUBCASE("gpu_only, device pull") { select_all_case(L, gpu_only{}, gqa_scale, index_t{2} << 20, 1, steps, 41, pull); }
  SUBCASE("fixed_ratio 0.4, device pull") {
    select_all_case(L, fixed_ratio(0.4), gqa_scale, index_t{2} << 20, 2, steps, 42, pull);
  }
  SUBCASE("roofline, device pull") {
    select_all_case(L, device_roofline(), gqa_scale, index_t{2} << 20, 2, steps, 43, pull);
  }
  SUBCASE("gpu_only, direct, device pull (nothing to pull)") {
    select_all_case(L, gpu_only{}, gqa_scale, 0, 1, steps, 44, pull);
  }
}

TEST_CASE("device: select_all is bit-identical to the dense step (MLA DeepSeek-V2-Lite)") {
  const M L = presets::deepseek_v2_lite::layout();
  const double scale = presets::deepseek_v2_lite::softmax_scale();
  const int steps = scaled(30, 10, 3);
  SUBCASE("gpu_only") { select_all_case(L, gpu_only{}, scale, index_t{2} << 20, 2, steps, 7); }
  SUBCASE("fixed_ratio 0.4, direct") { select_all_case(L, fixed_ratio(0.4), scale, 0, 1, steps, 8); }
  SUBCASE("roofline") { select_all_case(L, device_roofline(), scale, index_t{2} << 20, 1, steps, 9); }
  SUBCASE("gpu_only, device pull") {
    select_all_case(L, gpu_only{}, scale, index_t{2} << 20, 1, steps, 45, sparse_transfer::device_pull);
  }
}

namespace {

/// Top-k against the restricted reference and the test's own top-k.
template <class Layout, class Policy>
void topk_case(const Layout& L, Policy pol, double scale, top_k_selector sel, std::vector<index_t> prompts, int steps,
               int gather_threads, std::uint64_t seed, sparse_transfer transfer = sparse_transfer::host_gather) {
  topk_loop<cuda_backend>(L, pol, scale, sel, dev_case(std::move(prompts), 300, steps, gather_threads, seed, transfer));
}

}  // namespace

TEST_CASE("device: top-k equals the fp64 reference restricted to the selection + D-window; the test's own top-k") {
  const int steps = scaled(36, 6, 2);
  SUBCASE("Qwen3 32/4, keep 0.5, fixed_ratio 0.5, 2 gather threads") {
    topk_case(presets::qwen3_30b_a3b::layout(), fixed_ratio(0.5), gqa_scale, top_k_selector::ratio(0.5),
              {40, 97, 200, 333}, steps, 2, 11);
  }
  SUBCASE("Mixtral 32/8, keep 3 blocks, gpu_only") {
    topk_case(presets::mixtral_8x7b::layout(), gpu_only{}, gqa_scale, top_k_selector::blocks(3), {17, 64, 150},
              steps, 1, 12);
  }
  SUBCASE("Qwen3, keep 0.2, roofline") {
    topk_case(presets::qwen3_30b_a3b::layout(), device_roofline(), gqa_scale, top_k_selector::ratio(0.2),
              {300, 33, 250}, steps, 1, 13);
  }
  SUBCASE("MLA DeepSeek-V2-Lite, keep 0.3, fixed_ratio 0.5") {
    topk_case(presets::deepseek_v2_lite::layout(), fixed_ratio(0.5), presets::deepseek_v2_lite::softmax_scale(),
              top_k_selector::ratio(0.3), {50, 140, 260}, steps, 2, 14);
  }
  SUBCASE("Qwen3 32/4, keep 0.5, fixed_ratio 0.5, device pull") {
    topk_case(presets::qwen3_30b_a3b::layout(), fixed_ratio(0.5), gqa_scale, top_k_selector::ratio(0.5),
              {40, 97, 200, 333}, steps, 1, 15, sparse_transfer::device_pull);
  }
  SUBCASE("Mixtral 32/8, keep 3 blocks, gpu_only, device pull") {
    topk_case(presets::mixtral_8x7b::layout(), gpu_only{}, gqa_scale, top_k_selector::blocks(3), {17, 64, 150},
              steps, 1, 16, sparse_transfer::device_pull);
  }
  SUBCASE("MLA DeepSeek-V2-Lite, keep 0.3, fixed_ratio 0.5, device pull") {
    topk_case(presets::deepseek_v2_lite::layout(), fixed_ratio(0.5), presets::deepseek_v2_lite::softmax_scale(),
              top_k_selector::ratio(0.3), {50, 140, 260}, steps, 1, 17, sparse_transfer::device_pull);
  }
}

TEST_CASE("device K1: an engine (or a KV head) without selected blocks gives exactly (0, -inf)") {
  empty_engine_partials<cuda_backend>(presets::qwen3_30b_a3b::layout(), 2, gqa_scale);
}

TEST_CASE("device K4/C7: selected blocks past 2^32 bytes (unpinned region; pinned with WS_TEST_LARGE_PINNED=1)") {
  const char* large = std::getenv("WS_TEST_LARGE_PINNED");
  const bool with_pinned = large != nullptr && *large == '1';
  std::vector<placement> regions{placement::cpu_compute};
  if (with_pinned) regions.push_back(placement::gpu_load);
  // No resident-set bound here: the CUDA context and registered memory count in it.
  selections_past_4gib<cuda_backend>(regions, 2, gqa_scale, std::nullopt);
}

TEST_CASE("device K10: a sequence's sparse output is bit-identical alone and in a batch, and on a rerun") {
  sparse_batch_invariance<cuda_backend>(presets::qwen3_30b_a3b::layout(), 500, 330, scaled(40, 10, 3));
}

namespace {

/// Sparse steps with many gathered chunks per step (ping-pong of 4 blocks,
/// keep 0.5 of ~100 pinned blocks per sequence): returns how many of `steps`
/// steps were wrong (bar or NaN). `setup(debug)` sets the switches.
template <class Setup>
int gather_race_run(Setup&& setup, int steps, std::uint64_t seed,
                    sparse_transfer transfer = sparse_transfer::host_gather) {
  mutation_backend be;  // the switches of cuda_test_hooks
  const G L = presets::qwen3_30b_a3b::layout();
  partition_spec spec = sparse_spec(1, 3, 900);
  set_ping_pong_blocks(spec, L, 4);
  device_cache<G, gpu_only, cuda_host_alloc, mutation_backend> cache(be, L, spec, gpu_only{}, {}, cache_options{true});
  attention_options ao{2, true};
  ao.sparse.reserve = true;
  ao.sparse.gather_threads = 2;
  ao.sparse.transfer = transfer;
  device_decode_driver<decltype(cache)> d(cache, ao, seed, gqa_scale);
  const std::vector<sequence_id> batch{d.add(800), d.add(600), d.add(500)};
  step_runner<decltype(cache)> r(d);
  top_k_selector sel = top_k_selector::ratio(0.5);
  setup(be.debug());
  int wrong = 0;
  for (int s = 0; s < steps; ++s) {
    d.append_layer(0, batch);
    r.make_queries(batch);
    r.sparse(0, batch, sel);
    REQUIRE(d.attention().last_plan().chunks.size() >= 4);
    if (transfer == sparse_transfer::device_pull) REQUIRE(d.attention().engine().last_gather().pulled_chunks >= 4);
    wrong += check_last_selection(r, 0, batch).ok() ? 0 : 1;
    cache.flush();
  }
  be.debug() = cuda_debug_options{};
  return wrong;
}

/// A mutation check: whether one of three fresh runs (seeds seed0, seed0 + 1,
/// seed0 + 2; stopping at the first) gives a wrong step with `setup`'s switches.
template <class Setup>
bool mutation_detected(Setup&& setup, int steps, std::uint64_t seed0,
                       sparse_transfer transfer = sparse_transfer::host_gather) {
  for (int attempt = 0; attempt < 3; ++attempt)
    if (gather_race_run(setup, steps, seed0 + std::uint64_t(attempt), transfer) > 0) return true;
  return false;
}

}  // namespace

TEST_CASE("device K7: the gather pipeline's guards (RAW: copy after gather; WAR: gather after the copy) and mutations") {
  const int steps = scaled(4, 2);
  SUBCASE("guarded, slow gather and slow copies: right") {
    CHECK(gather_race_run([](cuda_debug_options& o) { o.gather_delay_microseconds = 3000; }, steps, 31) == 0);
    CHECK(gather_race_run([](cuda_debug_options& o) { o.copy_delay_cycles = 20'000'000; }, steps, 32) == 0);
  }
  SUBCASE("mutation skip_gather_wait (copies staging before its gather): detected") {
    CHECK(mutation_detected(
        [](cuda_debug_options& o) {
          o.skip_gather_wait = true;
          o.gather_delay_microseconds = 5000;
        },
        steps, 33));
  }
  SUBCASE("mutation skip_staging_wait (gathers over a staging buffer being copied): detected") {
    CHECK(mutation_detected(
        [](cuda_debug_options& o) {
          o.skip_staging_wait = true;
          o.copy_delay_cycles = 50'000'000;
        },
        steps, 36));
  }
}

TEST_CASE("device K7: pulled chunks keep the ping-pong guards (WAR consumed[b], RAW filled[b]); their mutations") {
  const int steps = scaled(4, 2);
  const sparse_transfer pull = sparse_transfer::device_pull;
  SUBCASE("guarded, slow consumer, slow pulls, slow list writes: right") {
    CHECK(gather_race_run([](cuda_debug_options& o) { o.consumer_delay_cycles = 5'000'000; }, steps, 51, pull) == 0);
    CHECK(gather_race_run([](cuda_debug_options& o) { o.copy_delay_cycles = 20'000'000; }, steps, 52, pull) == 0);
    CHECK(gather_race_run([](cuda_debug_options& o) { o.gather_delay_microseconds = 3000; }, steps, 53, pull) == 0);
  }
  SUBCASE("mutation skip_consumed_wait (pulls into a buffer its consumer still reads): detected") {
    CHECK(mutation_detected(
        [](cuda_debug_options& o) {
          o.skip_consumed_wait = true;
          o.consumer_delay_cycles = 5'000'000;
        },
        steps, 54, pull));
  }
  SUBCASE("mutation skip_filled_wait (attends a buffer before its pull lands): detected") {
    CHECK(mutation_detected(
        [](cuda_debug_options& o) {
          o.skip_filled_wait = true;
          o.copy_delay_cycles = 20'000'000;
        },
        steps, 57, pull));
  }
}

namespace {

/// The same selection through host_gather and device_pull (`pull_ctas` CTAs), two gather threads.
template <class Layout, class Policy>
void pull_case(const Layout& L, Policy pol, double scale, top_k_selector sel, std::vector<index_t> prompts, int steps,
               int pull_ctas, std::uint64_t seed) {
  pull_matches_gather<cuda_backend>(L, pol, scale, sel, dev_case(std::move(prompts), 300, steps, 2, seed), pull_ctas);
}

}  // namespace

TEST_CASE("device: device_pull is bit-identical to host_gather on the same selection") {
  const int steps = scaled(24, 6, 2);
  SUBCASE("Qwen3 32/4, keep 0.5, gpu_only, 64 CTAs") {
    pull_case(presets::qwen3_30b_a3b::layout(), gpu_only{}, gqa_scale, top_k_selector::ratio(0.5),
                        {40, 97, 200, 333}, steps, 64, 61);
  }
  SUBCASE("Qwen3 32/4, keep 0.2, fixed_ratio 0.5, 1 CTA (grid-stride over every block)") {
    pull_case(presets::qwen3_30b_a3b::layout(), fixed_ratio(0.5), gqa_scale, top_k_selector::ratio(0.2),
                        {300, 33, 250}, steps, 1, 62);
  }
  SUBCASE("MLA DeepSeek-V2-Lite, keep 0.3, fixed_ratio 0.5, 3 CTAs") {
    pull_case(presets::deepseek_v2_lite::layout(), fixed_ratio(0.5),
                        presets::deepseek_v2_lite::softmax_scale(), top_k_selector::ratio(0.3), {50, 140, 260}, steps,
                        3, 63);
  }
}

TEST_CASE("device: gpu::launch_pull_blocks copies blocks from cudaHostAlloc and cudaHostRegister memory exactly") {
  cuda_backend be;  // the current device, a stream
  const cudaStream_t s = be.copy_stream();
  struct shape {
    index_t block_bytes;
    index_t count;
    int ctas;
  };
  // Tails inside a pass (1040 B: 65 vectors), several passes per block (64 KiB),
  // more blocks than one launch carries (1000 > 480), fewer CTAs than blocks.
  const shape shapes[] = {{1040, 7, 64}, {1040, 1000, 5}, {65536, 481, 64}, {16, 3, 1}};
  auto run = [&](auto allocator, const char* name) {
    CAPTURE(name);
    for (const shape& sh : shapes) {
      CAPTURE(sh.block_bytes);
      CAPTURE(sh.count);
      const index_t pool_blocks = sh.count + 17;
      host_allocation pool = allocator.allocate(pool_blocks * sh.block_bytes);
      auto* bytes = reinterpret_cast<unsigned char*>(pool.data());
      for (index_t i = 0; i < pool_blocks * sh.block_bytes; ++i) bytes[i] = static_cast<unsigned char>((i * 131 + 7) >> 3);
      std::vector<index_t> pick(static_cast<std::size_t>(sh.count));
      std::vector<const void*> src(pick.size());
      std::mt19937_64 rng(std::uint64_t(sh.count));
      for (std::size_t k = 0; k < pick.size(); ++k) {
        pick[k] = index_t(rng() % std::uint64_t(pool_blocks));
        src[k] = bytes + pick[k] * sh.block_bytes;
      }
      device_scratch dst;
      auto* d = dst.get<unsigned char>(std::size_t(sh.count * sh.block_bytes), s);
      WS_CUDA_TRY(cudaMemsetAsync(d, 0xa5, std::size_t(sh.count * sh.block_bytes), s));
      gpu::launch_pull_blocks(src.data(), sh.count, d, sh.block_bytes, sh.ctas, s);
      std::vector<unsigned char> got;
      download(got, d, std::size_t(sh.count * sh.block_bytes), s);
      int wrong_blocks = 0;
      for (std::size_t k = 0; k < pick.size(); ++k)
        wrong_blocks += std::memcmp(got.data() + index_t(k) * sh.block_bytes, src[k], std::size_t(sh.block_bytes)) != 0;
      CHECK(wrong_blocks == 0);
    }
  };
  run(cuda_host_alloc{}, "cudaHostAlloc");
  run(cuda_host_register{}, "cudaHostRegister (mapped)");

  host_allocation pool = cuda_host_alloc{}.allocate(4096);
  device_scratch dst;
  auto* d = dst.get<unsigned char>(4096, s);
  const void* one[1] = {pool.data()};
  CHECK_THROWS_AS(gpu::launch_pull_blocks(one, 1, d, 24, 4, s), config_error);  // not a multiple of 16
  CHECK_THROWS_AS(gpu::launch_pull_blocks(one, 1, d, 1024, 0, s), config_error);
  const void* odd[1] = {pool.data() + 8};
  CHECK_THROWS_AS(gpu::launch_pull_blocks(odd, 1, d, 1024, 4, s), config_error);
  CHECK_NOTHROW(gpu::launch_pull_blocks(one, 0, d, 1024, 4, s));  // nothing to do
  WS_CUDA_TRY(cudaStreamSynchronize(s));
}

TEST_CASE("device: pinned_registry::covering_span joins back-to-back registrations; covers() needs every byte") {
  auto& reg = cuda_detail::pinned_registry::instance();
  const std::uintptr_t base = std::uintptr_t{0x7e5a} << 32;  // far from any real allocation; removed below
  auto at = [&](std::uintptr_t off) { return reinterpret_cast<const void*>(base + off); };
  reg.add(at(0), 100);
  reg.add(at(100), 100);
  reg.add(at(300), 100);
  CHECK(reg.covering_span(at(150)) == std::pair<std::uintptr_t, std::uintptr_t>{base, base + 200});
  CHECK(reg.covering_span(at(0)) == std::pair<std::uintptr_t, std::uintptr_t>{base, base + 200});
  CHECK(reg.covering_span(at(200)) == std::pair<std::uintptr_t, std::uintptr_t>{0, 0});
  CHECK(reg.covers(at(50), 150));    // across the boundary at 100
  CHECK(!reg.covers(at(50), 151));   // one byte into the gap
  CHECK(!reg.covers(at(250), 100));  // starts in the gap
  CHECK(reg.covers(at(300), 100));
  CHECK(!reg.contains(at(50), 150)); // contains() wants one registration
  for (std::uintptr_t off : {0, 100, 300}) reg.remove(at(off));
}

TEST_CASE("device: device_pull refuses a pulled source outside the page-locked ranges (every build), before any work") {
  cuda_backend be;
  const G L = presets::qwen3_30b_a3b::layout();
  partition_spec spec = sparse_spec(1, 2, 200);
  set_ping_pong_blocks(spec, L, 4);
  device_cache<G, gpu_only> cache(be, L, spec, gpu_only{});
  cuda_backend::gpu_engine<G> eng(be, L, 2);
  sparse_reservation res;
  res.chunk_blocks = 4;
  res.block_bytes = cache.format().block_bytes();
  res.buffers = 2;
  res.kv_heads = L.kv_heads();
  res.device_pull = true;
  res.pull_ctas = 0;
  CHECK_THROWS_AS(eng.reserve_sparse(res), config_error);
  res.pull_ctas = 8;
  eng.reserve_sparse(res);
  CHECK(eng.sparse_staging_bytes() == 0);
  // Three pageable blocks, every other one selected: short runs, a gathered (pulled) chunk.
  std::vector<bf16> pageable(std::size_t(3 * cache.format().block_elems()));
  std::vector<sparse_block> sel{{0, 1}, {2, 1}};
  stream_plan plan;
  plan.build_sparse(
      1, [&](int) { return std::span<const sparse_block>(sel); },
      [&](block_id id) {  // pageable memory typed as pinned: the pull must refuse it
        return pinned_span<const bf16>(pageable.data() + index_t(id) * cache.format().block_elems(),
                                       cache.format().block_elems());
      },
      cache.format().block_elems(), 4, 4, 2, L.kv_heads(), index_t{1} << 40);
  REQUIRE(plan.chunks.size() == 1);
  REQUIRE(plan.chunks[0].gathered);
  gpu_step_args<G, device_space> args;
  args.format = cache.format();
  args.batch = 0;
  args.plan = &plan;
  const layer_views<G> v = cache.views(0);
  args.ping_pong = v.ping_pong;
  CHECK_THROWS_AS(eng.launch(args), pinned_memory_error);
  be.synchronize();
}

TEST_CASE("device: a sparse plan without reserve_sparse is a state_error; the first sparse step reserves") {
  cuda_backend be;
  const G L = presets::qwen3_30b_a3b::layout();
  partition_spec spec = sparse_spec(1, 2, 200);
  set_ping_pong_blocks(spec, L, 4);
  device_cache<G, gpu_only> cache(be, L, spec, gpu_only{});
  {
    cuda_backend::gpu_engine<G> eng(be, L, 2);
    stream_plan plan;
    std::vector<sparse_block> none;
    plan.build_sparse(
        1, [&](int) { return std::span<const sparse_block>(none); }, [&](block_id) { return pinned_span<const bf16>(); },
        cache.format().block_elems(), 4, 4, 2, 4, 0);
    gpu_step_args<G, device_space> args;
    args.format = cache.format();
    args.batch = 0;
    args.plan = &plan;
    const layer_views<G> v = cache.views(0);
    args.ping_pong = v.ping_pong;
    CHECK_THROWS_AS(eng.launch(args), state_error);
  }
  attention_options gather_options{2, true};
  gather_options.sparse.transfer = sparse_transfer::host_gather;  // the mode with staging to reserve
  device_decode_driver<decltype(cache)> d(cache, gather_options, 91, gqa_scale);
  const std::vector<sequence_id> batch{d.add(100), d.add(70)};
  step_runner<decltype(cache)> r(d);
  CHECK(d.attention().engine().sparse_staging_bytes() == 0);
  top_k_selector sel = top_k_selector::ratio(0.5);
  d.append_layer(0, batch);
  r.make_queries(batch);
  r.sparse(0, batch, sel);
  CHECK(check_last_selection(r, 0, batch).ok());
  CHECK(d.attention().engine().sparse_staging_bytes() == 2 * 4 * cache.format().block_bytes());
}
