// SPDX-License-Identifier: Apache-2.0
// FAULT-KINDS K7 on cuda_backend: asynchronous copies and stream ordering.
//
//   C10  RAW on the caller stream (append / q before the GPU side reads them),
//        RAW of the eviction (D2H after the append that wrote the D-window),
//        WAR and RAW on the ping-pong buffers (refill vs its consumer, attend
//        vs its copies), evicted pinned blocks landing before they are
//        streamed, and r flipping between 0.2 and 0.8 every step for 300 steps
//        at L = 8192 with byte-exact evicted blocks.
//   C9   a recycled pinned block overwritten (by the library's own prefill D2H,
//        with poison) right after a step that streams it was submitted.
//
// Every guard has a mutation check: the matching cuda_debug_options switch
// (mutation_backend, i.e. basic_cuda_backend<cuda_test_hooks>) removes it and the test asserts that the result is WRONG. Races are timing
// dependent: a mutation counts as detected when any of three fresh attempts
// goes wrong, and the checks are only meaningful on a real GPU (they widen the
// race window with spin kernels and slow consumers). Uploads go through pinned
// staging (device_harness.hpp) so that no host call synchronizes the streams
// behind the test's back.
#include <doctest/doctest.h>

#include "device_harness.hpp"

using namespace wstest;
using namespace wstest::dev;

namespace {

using G = gqa_layout<128>;
const double gqa_scale = 1.0 / std::sqrt(128.0);
constexpr long long long_spin = 100'000'000;      // ~50 ms at 2 GHz
constexpr long long slow_consumer = 20'000'000;  // ~10 ms per CTA

/// The caches of the cases that flip a cuda_debug_options switch or widen a
/// race window with one (mutation_backend); the first case runs cuda_backend.
template <routing_policy Policy>
using race_cache = device_cache<G, Policy, cuda_host_alloc, mutation_backend>;

/// True when any of `tries` attempts reports a wrong result.
template <class F>
bool detected(F&& attempt, int tries = 3) {
  for (int i = 0; i < tries; ++i)
    if (attempt()) return true;
  return false;
}

/// Block 16, D 32, the whole pinned region pinned at init (no page-locking
/// while a race is staged), poison everywhere.
partition_spec race_spec(const G& L, int layers, int seqs, int pp_blocks, int split_blocks) {
  auto spec = small_spec(layers, seqs);
  spec.gpu_split_blocks = split_blocks;
  spec.pinned_initial_tokens = -1;
  set_ping_pong_blocks(spec, L, pp_blocks);
  return spec;
}

/// The GPU side of one step launched by hand (what hybrid_attention::step does
/// before its CPU side), so a test can act between submission and merge.
template <class Cache>
struct manual_step {
  using layout_type = typename Cache::layout_type;
  stream_plan plan;
  std::vector<window_ref<layout_type>> windows;
  typename Cache::backend_type::template gpu_engine<layout_type> engine;

  explicit manual_step(Cache& c) : engine(c.backend(), c.layout(), c.spec().max_sequences) {}

  void launch(Cache& c, int layer, std::span<const sequence_id> batch, mem_span<const float, device_space> q,
              double scale) {
    const layer_views<layout_type> v = c.views(layer);
    plan.build(
        int(batch.size()),
        [&](int i) { return std::span<const block_id>(v.sequences[std::size_t(batch[std::size_t(i)])].pinned_blocks); },
        [&](block_id id) { return v.pinned.block(id); }, v.format.block_elems(), v.ping_pong_blocks,
        c.spec().gpu_split_blocks, int(v.ping_pong.size()));
    windows.clear();
    for (sequence_id s : batch) {
      const sequence_state& st = v.sequences[std::size_t(s)];
      windows.push_back({v.window_region(st.window_slot), st.window_tokens[std::size_t(layer)]});
    }
    gpu_step_args<layout_type, device_space> a;
    a.format = v.format;
    a.softmax_scale = float(scale);
    a.batch = int(batch.size());
    a.q = q;
    a.plan = &plan;
    a.windows = windows;
    a.ping_pong = v.ping_pong;
    a.poison_workspaces = true;
    engine.launch(a);
  }

  /// CPU side empty (gpu_only), then the merge.
  void finish(int batch, int hq, float* out, float* lse) {
    (void)engine.host_queries();
    host_partial_view<float> cp = engine.cpu_partial(batch);
    for (int s = 0; s < batch; ++s)
      for (int h = 0; h < hq; ++h) {
        std::fill(cp.o_row(s, h), cp.o_row(s, h) + layout_type::v_dim, 0.0f);
        cp.lse_at(s, h) = empty_lse;
      }
    const index_t rows = index_t(batch) * hq;
    (void)engine.finish({device_span<float>(out, rows * layout_type::v_dim), device_span<float>(lse, rows), nullptr});
  }
};

}  // namespace

// -----------------------------------------------------------------------------
// RAW on the caller stream and of the eviction
// -----------------------------------------------------------------------------

TEST_CASE("K7/C10: a long spin on the caller stream before append, eviction in the same step") {
  const G L(32, 4);
  SUBCASE("append, attend, evict (hybrid step)") {
    cuda_backend be;
    device_cache<G, fixed_ratio> cache(be, L, race_spec(L, 2, 2, 4, 4), fixed_ratio(0.5), {}, cache_options{true});
    device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 21, gqa_scale);
    std::vector<sequence_id> batch{d.add(31), d.add(95)};  // windows of 31: the next append fills D
    d.before_append = [&](int) { spin(be.caller_stream(), long_spin); };
    for (int s = 0; s < 3; ++s) {
      const auto placed = d.placed(batch);
      const compare_result r = d.step(batch);
      INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
      REQUIRE(r.ok());
      REQUIRE(d.check_evicted(batch, placed) == 0);
      if (s == 0) CHECK(d.last_flush.evicted_sequences == 2);
    }
  }
  SUBCASE("append then evict with no attention in between") {
    cuda_backend be;
    device_cache<G, fixed_ratio> cache(be, L, race_spec(L, 1, 2, 4, 4), fixed_ratio(0.5), {}, cache_options{true});
    device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 23, gqa_scale);
    std::vector<sequence_id> batch{d.add(31), d.add(95)};
    d.before_append = [&](int) { spin(be.caller_stream(), long_spin); };
    const auto placed = d.placed(batch);
    d.append_layer(0, batch);
    CHECK(cache.flush().evicted_sequences == 2);
    CHECK(d.check_evicted(batch, placed) == 0);
  }
}

TEST_CASE("K7/C10 mutation: skip_caller_event -> the GPU side reads KV and q before they are written (expected wrong)") {
  const G L(32, 4);
  const bool wrong = detected([&] {
    mutation_backend be;
    race_cache<fixed_ratio> cache(be, L, race_spec(L, 1, 2, 4, 4), fixed_ratio(0.5), {}, cache_options{true});
    device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 22, gqa_scale);
    std::vector<sequence_id> batch{d.add(31), d.add(95)};
    d.before_append = [&](int) { spin(be.caller_stream(), long_spin); };
    be.debug().skip_caller_event = true;
    const compare_result r = d.step(batch);
    be.debug() = {};
    be.synchronize();
    return !r.ok();
  });
  CHECK(wrong);
}

TEST_CASE("K7/C10 mutation: skip_eviction_wait -> the D-window is evicted before the append wrote it (expected wrong)") {
  const G L(32, 4);
  const bool wrong = detected([&] {
    mutation_backend be;
    race_cache<fixed_ratio> cache(be, L, race_spec(L, 1, 2, 4, 4), fixed_ratio(0.5), {}, cache_options{true});
    device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 24, gqa_scale);
    std::vector<sequence_id> batch{d.add(31), d.add(95)};
    d.before_append = [&](int) { spin(be.caller_stream(), long_spin); };
    be.debug().skip_eviction_wait = true;
    const auto placed = d.placed(batch);
    d.append_layer(0, batch);
    (void)cache.flush();
    be.debug() = {};
    return d.check_evicted(batch, placed) > 0;
  });
  CHECK(wrong);
}

// -----------------------------------------------------------------------------
// Ping-pong: WAR (refill vs consumer) and RAW (attend vs copies)
// -----------------------------------------------------------------------------

namespace {

/// 2 sequences, 20 + 16 pinned blocks, 4-block buffers: 9 chunks over 2 buffers.
template <class Body>
bool pingpong_case(Body&& body) {
  const G L(32, 4);
  mutation_backend be;
  race_cache<gpu_only> cache(be, L, race_spec(L, 1, 2, 4, 4), gpu_only{}, {}, cache_options{true});
  device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 31, gqa_scale);
  std::vector<sequence_id> batch{d.add(325), d.add(265)};
  return body(be, d, batch);
}

/// Page-locked source and device destination of a large dummy copy that keeps
/// the copy stream busy for a few milliseconds.
struct busy_copy {
  static constexpr std::size_t bytes = std::size_t(256) << 20;
  void* host = nullptr;
  void* dev = nullptr;
  busy_copy() {
    WS_CUDA_TRY(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
    WS_CUDA_TRY(cudaMalloc(&dev, bytes));
  }
  ~busy_copy() {
    (void)cudaDeviceSynchronize();
    (void)cudaFree(dev);
    (void)cudaFreeHost(host);
  }
  void enqueue(cudaStream_t s) const { WS_CUDA_TRY(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s)); }
};

}  // namespace

TEST_CASE("K7/C10: a slow consumer while the next refill targets its buffer; a busy copy stream") {
  SUBCASE("slow consumer") {
    CHECK(pingpong_case([](mutation_backend& be, auto& d, std::vector<sequence_id>& batch) {
      be.debug().consumer_delay_cycles = slow_consumer;
      for (int s = 0; s < 2; ++s) {
        const compare_result r = d.step(batch);
        INFO("step " << s << ": rel_l2 " << r.max_rel_l2);
        REQUIRE(r.ok());
        REQUIRE(d.last_report.chunks >= 8);
      }
      return true;
    }));
  }
  SUBCASE("copies delayed behind other work on the copy stream") {
    busy_copy busy;
    CHECK(pingpong_case([&](mutation_backend& be, auto& d, std::vector<sequence_id>& batch) {
      d.before_append = [&](int) { busy.enqueue(be.copy_stream()); };
      for (int s = 0; s < 2; ++s) REQUIRE(d.step(batch).ok());
      return true;
    }));
  }
}

TEST_CASE("K7/C10 mutation: skip_consumed_wait -> a buffer is refilled while its consumer still reads it (expected wrong)") {
  const bool wrong = detected([] {
    return pingpong_case([](mutation_backend& be, auto& d, std::vector<sequence_id>& batch) {
      be.debug().consumer_delay_cycles = slow_consumer;
      be.debug().skip_consumed_wait = true;
      const compare_result r = d.step(batch);
      be.debug() = {};
      be.synchronize();
      return !r.ok();
    });
  });
  CHECK(wrong);
}

TEST_CASE("K7/C10: slow copies (a spin before every chunk's copies) still give the right result") {
  CHECK(pingpong_case([](mutation_backend& be, auto& d, std::vector<sequence_id>& batch) {
    be.debug().copy_delay_cycles = slow_consumer;
    const compare_result r = d.step(batch);
    be.debug() = {};
    INFO("rel_l2 " << r.max_rel_l2);
    return r.ok();
  }));
}

TEST_CASE("K7/C10 mutation: skip_filled_wait -> a buffer is attended before its copies land (expected wrong)") {
  const bool wrong = detected([&] {
    return pingpong_case([&](mutation_backend& be, auto& d, std::vector<sequence_id>& batch) {
      be.debug().copy_delay_cycles = slow_consumer;  // copies land long after the consumer could start
      be.debug().skip_filled_wait = true;
      const compare_result r = d.step(batch);
      be.debug() = {};
      be.synchronize();
      return !r.ok();
    });
  });
  CHECK(wrong);
}

// -----------------------------------------------------------------------------
// Evicted pinned blocks land before they are streamed
// -----------------------------------------------------------------------------

namespace {

/// Evicts to pinned blocks behind a long spin (no attention in between), then
/// immediately runs a step that streams those blocks. Returns that step's result.
compare_result evict_then_stream(bool skip_landing_wait) {
  const G L(32, 4);
  mutation_backend be;
  race_cache<gpu_only> cache(be, L, race_spec(L, 1, 2, 4, 4), gpu_only{}, {}, cache_options{true});
  device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 41, gqa_scale);
  std::vector<sequence_id> batch{d.add(31), d.add(63)};
  d.before_append = [&](int) { spin(be.caller_stream(), long_spin); };
  be.debug().skip_landing_wait = skip_landing_wait;
  d.append_layer(0, batch);  // fills both windows
  (void)cache.flush();       // D2H to pinned blocks, queued behind the spin
  d.before_append = nullptr;
  const compare_result r = d.step(batch);  // streams the evicted blocks
  be.debug() = {};
  be.synchronize();
  return r;
}

}  // namespace

TEST_CASE("K7/C10: evicted pinned blocks land before the next step streams them") {
  const compare_result r = evict_then_stream(false);
  INFO("rel_l2 " << r.max_rel_l2);
  CHECK(r.ok());
}

TEST_CASE("K7/C10 mutation: skip_landing_wait -> blocks are streamed before their eviction D2H lands (expected wrong)") {
  CHECK(detected([] { return !evict_then_stream(true).ok(); }));
}

// -----------------------------------------------------------------------------
// C9: a recycled pinned block rewritten right after submission
// -----------------------------------------------------------------------------

namespace {

/// Sequence A (256 tokens, all pinned: 16 blocks, 4 chunks over 2 buffers) is
/// submitted with a slow consumer; right after launch, A ends and B begins with
/// a poison prompt that the pool places in A's recycled blocks (lowest ids
/// first) — a D2H into blocks A's later chunks still have to stream. Returns
/// A's result against its own history.
compare_result recycle_after_submit(bool skip_block_reuse_wait, long long launcher_delay_us = 0,
                                    bool skip_pending_launch_join = false) {
  const G L(32, 4);
  using cache_t = race_cache<gpu_only>;
  mutation_backend be;
  cache_t cache(be, L, race_spec(L, 1, 2, 4, 4), gpu_only{}, {}, cache_options{true});
  device_decode_driver<cache_t> d(cache, attention_options{4, true}, 51, gqa_scale);
  const sequence_id a = d.add(256);
  const std::vector<sequence_id> batch{a};
  const std::vector<block_id> a_blocks = cache.sequence(a).pinned_blocks;
  REQUIRE(a_blocks.size() == 16);
  manual_step<cache_t> step(cache);
  const auto q = d.make_queries(batch);
  device_scratch out_dev, lse_dev;
  const int hq = L.num_q_heads();
  float* out = out_dev.get<float>(std::size_t(hq) * G::v_dim, be.caller_stream());
  float* lse = lse_dev.get<float>(std::size_t(hq), be.caller_stream());

  be.debug().consumer_delay_cycles = slow_consumer;
  be.debug().skip_block_reuse_wait = skip_block_reuse_wait;
  be.set_launch_thread(launcher_delay_us > 0);  // the late-launcher cases; the others enqueue in launch()
  be.debug().launcher_delay_microseconds = launcher_delay_us;
  be.debug().skip_pending_launch_join = skip_pending_launch_join;
  step.launch(cache, 0, batch, q, gqa_scale);

  cache.end_sequence(a);  // A's blocks return to the pool ...
  const sequence_id b = cache.begin_sequence(256);
  CHECK(cache.sequence(b).pinned_blocks == a_blocks);  // ... and B gets exactly them
  kv_batch<G> poison;
  poison.n = 256;
  for (int p = 0; p < G::planes; ++p)
    poison.planes[p].assign(std::size_t(256) * std::size_t(L.kv_heads()) * G::row_elems,
                            bf16::from_float(p == 0 ? 3.0e4f : 1.0e4f));
  cache.append_prefill(0, b, d.to_device(poison));  // D2H of poison into the recycled blocks

  step.finish(1, hq, out, lse);
  be.debug() = {};
  download(d.out, out, std::size_t(hq) * G::v_dim, be.caller_stream());
  download(d.lse, lse, std::size_t(hq), be.caller_stream());
  compare_result r;
  d.compare(0, batch, r);  // against A's history, which the driver still holds
  be.synchronize();
  return r;
}

}  // namespace

TEST_CASE("K7/C9: a recycled pinned block overwritten with poison right after the step is submitted") {
  const compare_result r = recycle_after_submit(false);
  INFO("rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
  CHECK(r.ok());
}

TEST_CASE("K7/C9 mutation: skip_block_reuse_wait -> poison reaches the output (expected wrong)") {
  CHECK(detected([] { return !recycle_after_submit(true).ok(); }));
}

// With the launcher thread (cuda_backend::set_launch_thread; the two cases
// below turn it on) the chunk copies are enqueued after launch() returned; a D2H into host blocks
// must first join it, or it waits on an h2d_done_ recorded before the copies.
TEST_CASE("K7/C9: a late launcher thread (20 ms) and a recycled pinned block rewritten right after launch()") {
  const compare_result r = recycle_after_submit(false, 20'000);
  INFO("rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
  CHECK(r.ok());
}

TEST_CASE("K7/C9 mutation: skip_pending_launch_join with a late launcher -> poison reaches the output (expected wrong)") {
  CHECK(detected([] { return !recycle_after_submit(false, 20'000, true).ok(); }));
}

// -----------------------------------------------------------------------------
// The launcher thread: same work, same order, own copies of the plan
// -----------------------------------------------------------------------------

namespace {

/// Two sequences (300 and 177 tokens, all pinned, several chunks over two
/// buffers) launched by hand with the launcher thread on or off. With
/// `clobber`, the caller's plan and window list are overwritten right after
/// launch() returns (the launcher, 5 ms late, must work from its copies).
/// Returns the merged output (host copy) and its comparison with fp64.
std::pair<std::vector<float>, compare_result> launcher_step(bool launcher_on, bool clobber) {
  const G L(32, 4);
  using cache_t = race_cache<gpu_only>;
  mutation_backend be;
  be.set_launch_thread(launcher_on);
  cache_t cache(be, L, race_spec(L, 1, 2, 4, 2), gpu_only{}, {}, cache_options{true});
  device_decode_driver<cache_t> d(cache, attention_options{4, true}, 77, gqa_scale);
  const std::vector<sequence_id> batch{d.add(300), d.add(177)};
  manual_step<cache_t> step(cache);
  const auto q = d.make_queries(batch);
  device_scratch out_dev, lse_dev;
  const int hq = L.num_q_heads();
  const std::size_t rows = batch.size() * std::size_t(hq);
  float* out = out_dev.get<float>(rows * G::v_dim, be.caller_stream());
  float* lse = lse_dev.get<float>(rows, be.caller_stream());
  be.debug().launcher_delay_microseconds = 5'000;
  step.launch(cache, 0, batch, q, gqa_scale);
  CHECK(step.engine.launch_pending() == launcher_on);
  if (clobber) {
    step.plan = stream_plan{};
    step.windows.assign(step.windows.size(), window_ref<G>{});
  }
  step.finish(int(batch.size()), hq, out, lse);
  CHECK_FALSE(step.engine.launch_pending());
  be.debug() = {};
  download(d.out, out, rows * G::v_dim, be.caller_stream());
  download(d.lse, lse, rows, be.caller_stream());
  compare_result r;
  d.compare(0, batch, r);
  be.synchronize();
  return {d.out, r};
}

}  // namespace

TEST_CASE("launcher thread: on and off give bit-identical outputs; the caller's plan may change after launch()") {
  const auto [on_out, on_r] = launcher_step(true, true);
  const auto [off_out, off_r] = launcher_step(false, false);
  INFO("on: rel_l2 " << on_r.max_rel_l2 << "; off: rel_l2 " << off_r.max_rel_l2);
  CHECK(on_r.ok());
  CHECK(off_r.ok());
  REQUIRE(on_out.size() == off_out.size());
  CHECK(std::memcmp(on_out.data(), off_out.data(), on_out.size() * sizeof(float)) == 0);
}

// -----------------------------------------------------------------------------
// r flipping every step, long context
// -----------------------------------------------------------------------------

TEST_CASE("K7/C10: r flipping between 0.2 and 0.8 every step for 300 steps at L = 8192, byte-exact evictions") {
  const G L(8, 2);
  mutation_backend be;
  partition_spec spec = small_spec(1, 2, 16, 32);
  spec.cpu_capacity_tokens = 2 * (8192 + 400);
  spec.pinned_capacity_tokens = 2 * (8192 + 400);
  spec.pinned_initial_tokens = -1;
  spec.gpu_split_blocks = 8;
  set_ping_pong_blocks(spec, L, 32);
  using cache_t = race_cache<flip_policy>;
  cache_t cache(be, L, spec, flip_policy(0.2, 0.8), {}, cache_options{true});
  device_decode_driver<cache_t> d(cache, attention_options{8, true}, 61, gqa_scale);
  std::vector<sequence_id> batch{d.add(8192), d.add(8192 - 17)};
  be.debug().consumer_delay_cycles = 100'000;                               // a slightly slow consumer
  d.before_append = [&](int) { spin(be.caller_stream(), 2'000'000); };      // and a busy caller stream
  const int steps = scaled(300, 40, 6);
  int evictions = 0;
  for (int s = 0; s < steps; ++s) {
    const auto placed = d.placed(batch);
    const compare_result r = d.step(batch);
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err << " streamed "
                 << d.last_report.streamed_tokens << " cpu " << d.last_report.cpu_tokens);
    REQUIRE(r.ok());
    REQUIRE(d.check_evicted(batch, placed) == 0);
    evictions += d.last_flush.evicted_sequences;
  }
  if (!quick()) CHECK(evictions >= 16);
  CHECK(cache.usage().cpu_used_blocks > 0);
  CHECK(cache.usage().pinned_used_blocks > 0);
}
