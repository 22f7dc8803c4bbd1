// The HBM tier on cuda_backend (partition_spec::hbm_capacity_tokens,
// placement::gpu_resident; docs/ARCHITECTURE.md "The HBM tier"). The shared
// bodies of support/hbm_suite.hpp (run on host_backend by tests/test_hbm.cpp)
// on the device: every subset of the four partials, boundary lengths, the
// region full mid-prefill and mid-decode, a sequence ending and another
// re-using its HBM blocks, batch-vs-solo bit identity, a failing flush that
// releases its staged HBM batch. Device-only: the init refusal against
// cudaMemGetInfo; the stream ordering of HBM writes (K7): a prefill scatter and
// an eviction into HBM blocks (both on the caller stream, behind a long spin)
// are read by the next step's kernels only after they land, and the
// skip_caller_event mutation falsifies that guard; a recycled HBM batch
// written by the next prompt's prefill while a slow step still reads it (WAR:
// the merge orders the caller stream after the step's kernels); the resident
// splits' own tokens in step_report and in the policy's samples.
#include <doctest/doctest.h>

#include "device_harness.hpp"
#include "support/hbm_suite.hpp"

using namespace wstest;
using namespace wstest::dev;
using namespace wstest::hbm;

namespace {

using G = gqa_layout<128>;
using M = mla_layout<512, 64>;
const double gqa_scale = 1.0 / std::sqrt(128.0);
const double mla_scale = 1.0 / std::sqrt(192.0);
constexpr long long long_spin = 100'000'000;     // ~50 ms at 2 GHz
constexpr long long slow_consumer = 20'000'000;  // ~10 ms per CTA

template <class F>
bool detected(F&& attempt, int tries = 3) {
  for (int i = 0; i < tries; ++i)
    if (attempt()) return true;
  return false;
}

}  // namespace

TEST_CASE("HBM (device): every subset of the four partials, solo and in one ragged batch") {
  SUBCASE("GQA 32/4") { every_subset_of_partials<cuda_backend>(G(32, 4), gqa_scale, 4); }
  SUBCASE("MLA 16 heads") { every_subset_of_partials<cuda_backend>(M(16), mla_scale, 4); }
}

TEST_CASE("HBM (device): boundary lengths") { boundary_lengths<cuda_backend>(G(32, 4), gqa_scale, 4); }

TEST_CASE("HBM (device): full mid-prefill and mid-decode falls through") {
  full_mid_prefill_and_decode<cuda_backend>(G(32, 4), gqa_scale, 4);
}

TEST_CASE("HBM (device): ending a sequence frees its HBM batches for reuse") {
  end_and_reuse<cuda_backend>(G(32, 4), gqa_scale, 4);
}

TEST_CASE("HBM (device): batch-vs-solo bit identity at fixed shares") {
  SUBCASE("GQA") { batch_vs_solo<cuda_backend>(G(32, 4), gqa_scale, 4, scaled(70, 35, 8)); }
  SUBCASE("MLA") { batch_vs_solo<cuda_backend>(M(16), mla_scale, 4, scaled(40, 20, 8)); }
}

TEST_CASE("HBM (device): a failing flush releases its staged HBM batch") {
  failing_flush_releases_hbm<cuda_backend>(G(32, 4), gqa_scale, 4);
}

TEST_CASE("HBM (device): init refused when the region exceeds the free device memory, naming both byte counts") {
  const G L(32, 4);
  cuda_backend be;
  partition_spec s = hbm_spec(L, 2, 2, 0);
  const index_t token_bytes = L.token_bytes() * 2;  // per token, both layers
  const index_t free_now = be.device_free_bytes();
  const index_t batches = free_now / (token_bytes * s.d_window_tokens) + 8;
  s.hbm_capacity_tokens = batches * s.d_window_tokens;
  const index_t hbm = batches * s.d_window_tokens * token_bytes;
  using cache_t = device_cache<G, gpu_only>;
  const std::string what = error_of([&] { cache_t c(be, L, s, gpu_only{}); });
  INFO(what);
  CHECK(mentions(what, {"HBM-resident region", std::to_string(hbm), "bytes free", "partition_spec::hbm_capacity_tokens"}));
  CHECK_THROWS_AS(cache_t(be, L, s, gpu_only{}), resource_error);
  CHECK(be.device_free_bytes() >= free_now - (index_t{64} << 20));  // nothing stayed allocated
  // 64 MiB of HBM per layer is accepted and reported
  s.hbm_capacity_tokens = (index_t{64} << 20) / L.token_bytes();
  cache_t ok(be, L, s, gpu_only{});
  CHECK(ok.usage().hbm_region_bytes == s.hbm_capacity_batches() * s.d_window_tokens * token_bytes);
}

TEST_CASE("HBM (device) K7: prefill and evictions into HBM behind a long spin on the caller stream are read in order") {
  const G L(32, 4);
  cuda_backend be;
  device_cache<G, gpu_only> cache(be, L, hbm_spec(L, 2, 2, 64), gpu_only{}, {}, cache_options{true});
  device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 91, gqa_scale);
  d.before_append = [&](int) { spin(be.caller_stream(), long_spin); };
  // the prompts' batches are scattered into HBM on the caller stream, behind the spin of their upload
  spin(be.caller_stream(), long_spin);
  std::vector<sequence_id> batch{d.add(3 * 32 + 31), d.add(32 - 1)};
  for (int s = 0; s < 3; ++s) {
    const auto placed = d.placed(batch);
    const compare_result r = d.step(batch);  // the first evicts both windows into HBM
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
    REQUIRE(r.ok());
    REQUIRE(d.check_evicted(batch, placed) == 0);
    if (s == 0) CHECK(d.last_flush.hbm_batches == 2);
  }
  CHECK(cache.sequence(batch[0]).hbm_placed_tokens == 4 * 32);
}

namespace {

/// One sequence whose next append fills its window: append, queries uploaded
/// and landed, then a long spin on the caller stream and the flush (its
/// eviction into HBM, a device-to-device copy, queued behind the spin), then a
/// dense step that reads the new HBM blocks. Returns whether the output was
/// wrong; `mutate` sets the backend's switches before the step.
template <class Mutate>
bool eviction_then_step(Mutate&& mutate) {
  const G L(32, 4);
  mutation_backend be;
  device_cache<G, gpu_only, cuda_host_alloc, mutation_backend> cache(be, L, hbm_spec(L, 1, 2, 8), gpu_only{}, {},
                                                                     cache_options{true});
  device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 93, gqa_scale);
  std::vector<sequence_id> batch{d.add(32 + 31), d.add(31)};
  step_runner<decltype(cache)> r(d);
  d.append_layer(0, batch);
  r.make_queries(batch);
  WS_CUDA_TRY(cudaStreamSynchronize(be.caller_stream()));
  spin(be.caller_stream(), long_spin);
  const flush_report f = cache.flush();
  CHECK(f.hbm_batches == 2);
  mutate(be);
  r.dense(0, batch);
  be.debug() = {};
  be.synchronize();
  d.out = r.out;
  d.lse = r.lse;
  compare_result cr;
  d.compare(0, batch, cr);
  CHECK(r.rep.resident_tokens == 3 * 32);
  CHECK(r.rep.window_tokens == 0);
  return !cr.ok();
}

}  // namespace

TEST_CASE("HBM (device) K7: an eviction into HBM is ordered before the kernel that reads it") {
  CHECK_FALSE(eviction_then_step([](mutation_backend&) {}));
}

TEST_CASE("HBM (device) K7 mutation: skip_caller_event -> the resident splits read HBM blocks before the eviction lands "
          "(expected wrong)") {
  CHECK(detected([] { return eviction_then_step([](mutation_backend& be) { be.debug().skip_caller_event = true; }); }));
}

TEST_CASE("HBM (device) K7: a recycled HBM batch rewritten by the next prefill while a slow step still reads it (WAR)") {
  const G L(32, 4);
  mutation_backend be;
  device_cache<G, gpu_only, cuda_host_alloc, mutation_backend> cache(be, L, hbm_spec(L, 1, 2, 2), gpu_only{}, {},
                                                                     cache_options{true});
  device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 95, gqa_scale);
  const sequence_id a = d.add(2 * 32 + 3);  // both batches in HBM
  const sequence_id b = d.add(32 + 1);      // pinned
  CHECK(cache.sequence(a).hbm_placed_tokens == 64);
  step_runner<decltype(cache)> r(d);
  const std::vector<sequence_id> ab{a, b};
  r.make_queries(ab);
  be.debug().consumer_delay_cycles = slow_consumer;  // the resident splits' kernel spins first
  r.dense(0, ab);  // fetch() waits for the outputs: take them from the device afterwards instead
  be.debug() = {};
  d.out = r.out;
  d.lse = r.lse;
  compare_result cr;
  d.compare(0, ab, cr);
  CHECK(cr.ok());
  // the same again, but the HBM batches are recycled into a new prompt right after the step
  r.make_queries(ab);
  be.debug().consumer_delay_cycles = slow_consumer;
  auto& attn = d.attention();
  std::vector<float> out, lse;
  activation_io<device_space, decltype(cache)> io(cache);
  const auto so = io.outputs(out, lse, ab.size() * std::size_t(L.num_q_heads()), G::v_dim, nullptr);
  (void)attn.step(0, ab, r.qa, float(gqa_scale), so);
  be.debug() = {};
  std::vector<std::vector<kv_history<G>>> keep{{d.history(a, 0)}, {d.history(b, 0)}};
  d.remove(a);
  const sequence_id c = d.add(2 * 32);  // its prefill scatter rewrites a's HBM blocks on the caller stream
  CHECK(cache.sequence(c).hbm_placed_tokens == 64);
  io.fetch(out, lse);
  // a's output of that step against the reference over a's kept history
  std::vector<double> ro, rl;
  compare_result wr;
  const int hq = L.num_q_heads();
  reference_attention(L, keep[0][0], d.q.data(), gqa_scale, ro, rl);
  compare_rows(hq, G::v_dim, out.data(), lse.data(), ro, rl, wr);
  reference_attention(L, keep[1][0], d.q.data() + std::size_t(hq) * G::q_dim, gqa_scale, ro, rl);
  compare_rows(hq, G::v_dim, out.data() + std::size_t(hq) * G::v_dim, lse.data() + hq, ro, rl, wr);
  INFO("rel_l2 " << wr.max_rel_l2 << " lse " << wr.max_lse_err);
  CHECK(wr.ok());
  CHECK(d.count_mismatches(c, 0, 0, 64) == 0);
}

namespace {

/// One step of `batch` enqueued behind a long spin on the caller stream.
/// Returns whether the spin was still running when step() returned (the
/// host did not wait for the device), with the step's report and its outputs
/// checked against fp64 after the spin.
template <class Cache>
bool step_returns_before_spin_ends(device_decode_driver<Cache>& d, std::span<const sequence_id> batch,
                                   step_report& rep) {
  step_runner<Cache> r(d);
  r.make_queries(batch);
  cuda_backend& be = d.cache().backend();
  // the output buffers first: growing them synchronizes the caller stream
  std::vector<float> out, lse;
  activation_io<device_space, Cache> io(d.cache());
  const auto so = io.outputs(out, lse, batch.size() * std::size_t(d.cache().layout().num_q_heads()),
                             Cache::layout_type::v_dim, nullptr);
  WS_CUDA_TRY(cudaStreamSynchronize(be.caller_stream()));
  cudaEvent_t spun = nullptr;
  WS_CUDA_TRY(cudaEventCreateWithFlags(&spun, cudaEventDisableTiming));
  spin(be.caller_stream(), long_spin);
  WS_CUDA_TRY(cudaEventRecord(spun, be.caller_stream()));
  rep = d.attention().step(0, batch, r.qa, float(d.scale()), so);
  const bool running = cudaEventQuery(spun) == cudaErrorNotReady;
  io.fetch(out, lse);
  WS_CUDA_TRY(cudaEventDestroy(spun));
  d.out = out;
  d.lse = lse;
  compare_result cr;
  d.compare(0, batch, cr);
  INFO("rel_l2 " << cr.max_rel_l2 << " lse " << cr.max_lse_err);
  CHECK(cr.ok());
  return running;
}

}  // namespace

TEST_CASE("HBM (device): an all-GPU step returns without waiting for the device; one with a CPU share waits for "
          "its queries") {
  const G L(32, 4);
  SUBCASE("every placed token in HBM or streamed, no CPU block: no query copy, no CPU side") {
    cuda_backend be;
    device_cache<G, gpu_only> cache(be, L, hbm_spec(L, 1, 3, 2), gpu_only{}, {}, cache_options{true});
    device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 99, gqa_scale);
    // HBM, HBM + window, pinned (the region is full): ragged, all-GPU
    const std::vector<sequence_id> batch{d.add(32), d.add(32 + 9), d.add(2 * 32 + 3)};
    CHECK(cache.sequence(batch[2]).pinned_blocks.size() > 0);
    step_report rep;
    CHECK(step_returns_before_spin_ends(d, batch, rep));
    CHECK_FALSE(rep.cpu_side);
    CHECK(rep.cpu_tasks == 0);
    CHECK(rep.resident_tokens == 2 * 32);
    CHECK(rep.streamed_tokens == 2 * 32);
  }
  SUBCASE("one sequence with CPU blocks: the step waits for its queries (after the spin)") {
    cuda_backend be;
    device_cache<G, cpu_only> cache(be, L, hbm_spec(L, 1, 2, 1), cpu_only{}, {}, cache_options{true});
    device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 101, gqa_scale);
    const std::vector<sequence_id> batch{d.add(32 + 3), d.add(2 * 32 + 5)};  // HBM; then the CPU region
    CHECK(cache.sequence(batch[1]).cpu_blocks.size() > 0);
    step_report rep;
    CHECK_FALSE(step_returns_before_spin_ends(d, batch, rep));
    CHECK(rep.cpu_side);
    CHECK(rep.cpu_tokens == 2 * 32);
  }
}

TEST_CASE("HBM (device): an all-GPU step that streams nothing runs on the caller stream, with the two-stream path's "
          "bits") {
  const G L(32, 4);
  cuda_backend be_on;
  CHECK(be_on.caller_stream_steps());
  SUBCASE("ragged batches over 40 steps: HBM, D-window, both, neither; against fp64 and the switch off") {
  // Two caches fed the same tokens: caller-stream steps on (the default) and off.
  cuda_backend be_off;
  be_off.set_caller_stream_steps(false);
  device_cache<G, gpu_only> on_cache(be_on, L, hbm_spec(L, 2, 6, 16), gpu_only{}, {}, cache_options{true});
  device_cache<G, gpu_only> off_cache(be_off, L, hbm_spec(L, 2, 6, 16), gpu_only{}, {}, cache_options{true});
  device_decode_driver<decltype(on_cache)> on(on_cache, attention_options{4, true}, 113, gqa_scale);
  device_decode_driver<decltype(off_cache)> off(off_cache, attention_options{4, true}, 113, gqa_scale);
  // ragged: HBM + window, HBM only (a whole batch), window only, two HBM batches + window, empty
  const index_t lengths[] = {32 + 5, 32, 3, 2 * 32 + 17, 0};
  std::vector<sequence_id> batch;
  for (const index_t n : lengths) {
    batch.push_back(on.add(n, 500 + std::uint64_t(n)));
    (void)off.add(n, 500 + std::uint64_t(n));
  }
  const int hq = L.num_q_heads();
  const std::size_t n_out = batch.size() * std::size_t(hq) * G::v_dim;
  for (int step = 0; step < 40; ++step) {  // appends fill the D-windows; flushes evict them into HBM
    for (int l = 0; l < 2; ++l) {
      on.append_layer(l, batch);
      off.append_layer(l, batch);
      const index_t before = on.attention().engine().caller_stream_launches();
      debug_partials dbg_on, dbg_off;
      compare_result r_on, r_off;
      on.attend_layer(l, batch, true, r_on, step % 8 == 0 ? &dbg_on : nullptr);
      off.attend_layer(l, batch, true, r_off, step % 8 == 0 ? &dbg_off : nullptr);
      INFO("step " << step << " layer " << l << ": rel_l2 " << r_on.max_rel_l2 << " lse " << r_on.max_lse_err);
      CHECK(r_on.ok());
      CHECK(r_off.ok());
      CHECK_FALSE(on.last_report.cpu_side);
      CHECK(on.last_report.streamed_tokens == 0);
      CHECK(on.attention().engine().caller_stream_launches() == before + 1);
      CHECK(same_bits(on.out.data(), off.out.data(), n_out));
      CHECK(same_bits(on.lse.data(), off.lse.data(), batch.size() * std::size_t(hq)));
      if (step % 8 == 0) {  // the partials: the D-window's read from the split workspace, the same bits
        CHECK(same_bits(dbg_on.window_o.data(), dbg_off.window_o.data(), n_out));
        CHECK(same_bits(dbg_on.window_lse.data(), dbg_off.window_lse.data(), batch.size() * std::size_t(hq)));
        CHECK(same_bits(dbg_on.streamed_o.data(), dbg_off.streamed_o.data(), n_out));
      }
    }
    (void)on_cache.flush();
    (void)off_cache.flush();
  }
  CHECK(off.attention().engine().caller_stream_launches() == 0);
  CHECK(on_cache.usage().hbm_used_blocks > 0);
  }
  SUBCASE("a batch with a streamed sequence takes the two-stream path") {
    device_cache<G, gpu_only> small(be_on, L, hbm_spec(L, 1, 2, 1), gpu_only{}, {}, cache_options{true});
    device_decode_driver<decltype(small)> d(small, attention_options{4, true}, 117, gqa_scale);
    const std::vector<sequence_id> two{d.add(32 + 3), d.add(2 * 32 + 5)};  // HBM, then pinned: the region is full
    REQUIRE(small.sequence(two[1]).pinned_blocks.size() > 0);
    const index_t before = d.attention().engine().caller_stream_launches();
    compare_result r;
    d.attend_layer(0, two, true, r);
    CHECK(r.ok());
    CHECK(d.attention().engine().caller_stream_launches() == before);
    CHECK(d.last_report.streamed_tokens > 0);
  }
  SUBCASE("the caller-stream step is queued behind the caller's work and returns before it ends") {
    device_cache<G, gpu_only> small(be_on, L, hbm_spec(L, 1, 3, 4), gpu_only{}, {}, cache_options{true});
    device_decode_driver<decltype(small)> d(small, attention_options{4, true}, 119, gqa_scale);
    const std::vector<sequence_id> three{d.add(32 + 3), d.add(9), d.add(2 * 32)};
    const index_t before = d.attention().engine().caller_stream_launches();
    step_report rep;
    CHECK(step_returns_before_spin_ends(d, three, rep));
    CHECK(d.attention().engine().caller_stream_launches() == before + 1);
    CHECK(rep.resident_tokens == 3 * 32);
  }
}

TEST_CASE("HBM (device): an engine launched without a CPU side refuses host_queries and cpu_partial; its output is "
          "the GPU partials alone") {
  const G L(32, 4);
  const int bt = 16;
  const index_t n = 11;  // D-window tokens of the one sequence
  const block_format<G> fmt{L, bt};
  cuda_backend be;
  bf16_source src(83);
  const kv_batch<G> kv = kv_generator<G>{}.make(L, n, src);
  kv_history<G> hist;
  record(hist, L, kv, 0, n);
  std::vector<bf16> image = block_image(fmt, kv, n);
  cuda_backend::device_buffer wbuf = be.allocate_device(fmt.block_bytes(), "D-window");
  WS_CUDA_TRY(cudaMemcpy(wbuf.as<bf16>(), image.data(), std::size_t(fmt.block_bytes()), cudaMemcpyHostToDevice));
  const window_ref<G> win{contiguous_region(fmt, device_span<bf16>(wbuf.as<bf16>(), fmt.block_elems())), int(n)};
  stream_plan plan;  // nothing streamed, nothing resident
  cuda_backend::gpu_engine<G> eng(be, L, 1);
  std::vector<float> q(std::size_t(L.num_q_heads()) * G::q_dim);
  for (auto& x : q) x = src.next_float();
  device_scratch q_dev, out_dev, lse_dev;
  float* dq = q_dev.get<float>(q.size(), be.caller_stream());
  WS_CUDA_TRY(cudaMemcpy(dq, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice));
  gpu_step_args<G, device_space> a;
  a.format = fmt;
  a.softmax_scale = float(gqa_scale);
  a.batch = 1;
  a.q = mem_span<const float, device_space>(dq, index_t(q.size()));
  a.plan = &plan;
  a.windows = std::span<const window_ref<G>>(&win, 1);
  a.poison_workspaces = true;
  a.cpu_side = false;
  eng.launch(a);
  CHECK_THROWS_AS((void)eng.host_queries(), state_error);
  CHECK_THROWS_AS((void)eng.cpu_partial(1), state_error);
  const std::size_t rows = std::size_t(L.num_q_heads());
  float* out = out_dev.get<float>(rows * G::v_dim, be.caller_stream());
  float* lse = lse_dev.get<float>(rows, be.caller_stream());
  debug_partials dbg;
  (void)eng.finish({device_span<float>(out, index_t(rows * G::v_dim)), device_span<float>(lse, index_t(rows)), &dbg});
  std::vector<float> o, l;
  download(o, out, rows * G::v_dim, be.caller_stream());
  download(l, lse, rows, be.caller_stream());
  std::vector<double> ro, rl;
  reference_attention(L, hist, q.data(), gqa_scale, ro, rl);
  compare_result r;
  compare_rows(L.num_q_heads(), G::v_dim, o.data(), l.data(), ro, rl, r);
  INFO("rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
  CHECK(r.ok());
  // the debug copy reports the CPU partial empty
  CHECK(std::all_of(dbg.cpu_lse.begin(), dbg.cpu_lse.end(), [](float x) { return x == empty_lse; }));
  CHECK(std::all_of(dbg.cpu_o.begin(), dbg.cpu_o.end(), [](float x) { return x == 0.0f; }));
  CHECK(dbg.cpu_lse.size() == rows);
}

TEST_CASE("HBM (device): the policy's samples carry the resident tokens of the launch they time") {
  const G L(32, 4);
  roofline_params rp;
  rp.cpu_cost_per_token_seconds = 2e-9;
  rp.gpu_cost_per_token_seconds = 1.4e-9;
  rp.hbm_cost_per_token_seconds = 0.01e-9;
  rp.track_gpu_cost = true;
  test_rig<cuda_backend, G, roofline_policy> rig(L, hbm_spec(L, 1, 2, 4), roofline_policy(rp), attention_options{4, true},
                                                 97, gqa_scale);
  const sequence_id a = rig.d.add(6 * 32 + 7);  // 4 batches in HBM, 2 on the host
  const std::vector<sequence_id> one{a};
  for (int s = 0; s < 6; ++s) {
    REQUIRE(rig.d.step(one).ok());
    CHECK(rig.d.last_report.resident_tokens == 4 * 32);
  }
  CHECK(rig.cache.sequence(a).hbm_placed_tokens == 4 * 32);
  const double b = rig.cache.policy().gpu_cost_per_token_seconds();
  CHECK(std::isfinite(b));
  CHECK(b > 0.0);
}

// ---------------------------------------------------------------------------
// The same bodies with the split-K resident kernels (set_resident_kernel):
// launch_resident_attend + launch_resident_fold over device tables instead of
// the streamed-chunk kernel in launches of max_attend_items.
// ---------------------------------------------------------------------------

namespace {

/// cuda_backend with the resident kernels on from construction, so that every
/// hybrid_attention built on it reserves their workspace.
struct resident_kernel_backend : cuda_backend {
  resident_kernel_backend() { set_resident_kernel(true); }
};

}  // namespace

template <>
struct wstest::backend_traits<resident_kernel_backend> : wstest::backend_traits<cuda_backend> {};

TEST_CASE("HBM (device, resident kernels): every subset of the four partials, solo and in one ragged batch") {
  SUBCASE("GQA 32/4") { every_subset_of_partials<resident_kernel_backend>(G(32, 4), gqa_scale, 4); }
  SUBCASE("MLA 16 heads") { every_subset_of_partials<resident_kernel_backend>(M(16), mla_scale, 4); }
}

TEST_CASE("HBM (device, resident kernels): boundary lengths, full mid-prefill and mid-decode, end and reuse") {
  boundary_lengths<resident_kernel_backend>(G(32, 4), gqa_scale, 4);
  full_mid_prefill_and_decode<resident_kernel_backend>(G(32, 4), gqa_scale, 4);
  end_and_reuse<resident_kernel_backend>(G(32, 4), gqa_scale, 4);
}

TEST_CASE("HBM (device, resident kernels): batch-vs-solo bit identity at fixed shares") {
  SUBCASE("GQA") { batch_vs_solo<resident_kernel_backend>(G(32, 4), gqa_scale, 4, scaled(70, 35, 8)); }
  SUBCASE("MLA") { batch_vs_solo<resident_kernel_backend>(M(16), mla_scale, 4, scaled(40, 20, 8)); }
}

TEST_CASE("HBM (device, resident kernels): the steps ran on them, exact against fp64; off, the engine keeps its path") {
  const G L(32, 4);
  for (const bool on : {true, false}) {
    CAPTURE(on);
    cuda_backend be;
    be.set_resident_kernel(on);
    device_cache<G, gpu_only> cache(be, L, hbm_spec(L, 2, 3, 64), gpu_only{}, {}, cache_options{true});
    device_decode_driver<decltype(cache)> d(cache, attention_options{4, true}, 95, gqa_scale);
    std::vector<sequence_id> batch{d.add(5 * 32 + 7), d.add(31), d.add(2 * 32)};
    for (int s = 0; s < 3; ++s) {
      const compare_result r = d.step(batch);
      INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
      REQUIRE(r.ok());
    }
    CHECK(d.last_report.resident_tokens > 0);
    const index_t launches = d.attention().engine().resident_kernel_launches();
    if (on)
      CHECK(launches == 3 * 2);  // every layer of every step
    else
      CHECK(launches == 0);
  }
}
