// The HBM tier on host_backend (partition_spec::hbm_capacity_tokens,
// placement::gpu_resident; docs/ARCHITECTURE.md "The HBM tier"): the shared
// bodies of support/hbm_suite.hpp (the same run on cuda_backend in
// tests/cuda/test_cuda_hbm.cpp), plus the host-only cases: the three-way
// routing of every built-in policy, the roofline's generalised eq. 2 and its
// online B with HBM time removed, the fall-through of a policy that insists on
// a full region, the resident splits of the stream plan, the init refusal
// against the (emulated) free device memory, the spec rules, and the sparse
// path's refusal of sequences with HBM blocks.
#include <doctest/doctest.h>

#include "support/hbm_suite.hpp"

using namespace wstest;
using namespace wstest::hbm;

namespace {

using G = gqa_layout<64>;
using M = mla_layout<512, 64>;
const double g_scale = 1.0 / std::sqrt(64.0);
const double m_scale = 1.0 / std::sqrt(192.0);

route_query query(index_t placed, index_t cpu, index_t hbm, index_t hbm_free, index_t total = 0, index_t total_hbm = 0) {
  route_query q;
  q.placed_tokens = placed;
  q.cpu_placed_tokens = cpu;
  q.hbm_placed_tokens = hbm;
  q.batch_tokens = 32;
  q.total_placed_tokens = total > 0 ? total : placed;
  q.total_hbm_placed_tokens = total > 0 ? total_hbm : hbm;
  q.hbm_free_tokens = hbm_free;
  q.live_sequences = 1;
  return q;
}

}  // namespace

// -----------------------------------------------------------------------------
// The shared bodies
// -----------------------------------------------------------------------------

TEST_CASE("HBM: every subset of the four partials (HBM, streamed, CPU, D-window), solo and in one ragged batch") {
  SUBCASE("GQA 4/2") { every_subset_of_partials<host_backend>(G(4, 2), g_scale, 1); }
  SUBCASE("MLA 8 heads") { every_subset_of_partials<host_backend>(M(8), m_scale, 2); }
}

TEST_CASE("HBM: boundary lengths (exactly full, one token past, one batch past; capacity rounded down)") {
  boundary_lengths<host_backend>(G(4, 2), g_scale, 1);
}

TEST_CASE("HBM: full mid-prefill and mid-decode falls through to the host tiers by their own share") {
  full_mid_prefill_and_decode<host_backend>(G(4, 2), g_scale, 1);
}

TEST_CASE("HBM: ending a sequence frees its HBM batches; the next sequence re-uses the same blocks") {
  end_and_reuse<host_backend>(G(4, 2), g_scale, 1);
}

TEST_CASE("HBM: an engine launched without a CPU side refuses host_queries and cpu_partial; its output is the GPU "
          "partials alone") {
  const G L(4, 2);
  const int bt = 16;
  const index_t n = 11;  // D-window tokens of the one sequence
  const block_format<G> fmt{L, bt};
  host_backend be;
  bf16_source src(83);
  const kv_batch<G> kv = kv_generator<G>{}.make(L, n, src);
  kv_history<G> hist;
  record(hist, L, kv, 0, n);
  std::vector<bf16> image = block_image(fmt, kv, n);
  const window_ref<G> win{contiguous_region(fmt, device_span<bf16>(image.data(), fmt.block_elems())), int(n)};
  stream_plan plan;  // nothing streamed, nothing resident
  gpu_engine_for_t<host_backend, G, cpu::auto_decode_kernel<G>> eng(be, L, 1);
  std::vector<float> q(std::size_t(L.num_q_heads()) * G::q_dim);
  for (auto& x : q) x = src.next_float();
  gpu_step_args<G, pageable_host_space> a;
  a.format = fmt;
  a.softmax_scale = float(g_scale);
  a.batch = 1;
  a.q = mem_span<const float, pageable_host_space>(q.data(), index_t(q.size()));
  a.plan = &plan;
  a.windows = std::span<const window_ref<G>>(&win, 1);
  a.cpu_side = false;
  eng.launch(a);
  CHECK_THROWS_AS((void)eng.host_queries(), state_error);
  CHECK_THROWS_AS((void)eng.cpu_partial(1), state_error);
  const std::size_t rows = std::size_t(L.num_q_heads());
  std::vector<float> o(rows * G::v_dim, std::numeric_limits<float>::quiet_NaN()), l(rows);
  debug_partials dbg;
  (void)eng.finish({mem_span<float, pageable_host_space>(o.data(), index_t(o.size())),
                    mem_span<float, pageable_host_space>(l.data(), index_t(l.size())), &dbg});
  std::vector<double> ro, rl;
  reference_attention(L, hist, q.data(), g_scale, ro, rl);
  compare_result r;
  compare_rows(L.num_q_heads(), G::v_dim, o.data(), l.data(), ro, rl, r);
  INFO("rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
  CHECK(r.ok());
  CHECK(std::all_of(dbg.cpu_lse.begin(), dbg.cpu_lse.end(), [](float x) { return x == empty_lse; }));
  CHECK(std::all_of(dbg.cpu_o.begin(), dbg.cpu_o.end(), [](float x) { return x == 0.0f; }));
  CHECK(dbg.cpu_lse.size() == rows);
}

TEST_CASE("HBM: batch-vs-solo bit identity at fixed shares (interleaved HBM blocks)") {
  SUBCASE("GQA, 1 thread") { batch_vs_solo<host_backend>(G(4, 2), g_scale, 1, 70); }
  SUBCASE("GQA, 2 threads") { batch_vs_solo<host_backend>(G(4, 2), g_scale, 2, 40); }
  SUBCASE("MLA") { batch_vs_solo<host_backend>(M(8), m_scale, 2, 35); }
}

TEST_CASE("HBM: a failing flush releases the HBM batch it had staged (strong guarantee)") {
  failing_flush_releases_hbm<host_backend>(G(4, 2), g_scale, 1);
}

// -----------------------------------------------------------------------------
// Routing
// -----------------------------------------------------------------------------

TEST_CASE("HBM routing: every built-in policy fills the HBM region first, then applies its host rule") {
  roofline_params rp;
  rp.cpu_cost_per_token_seconds = 2e-9;
  rp.gpu_cost_per_token_seconds = 1.4e-9;
  const roofline_policy roof(rp);
  const route_query room = query(64, 0, 64, 32);
  const route_query none = query(64, 0, 64, 31);  // less than a batch: no room
  CHECK(gpu_only{}.route(room).region == placement::gpu_resident);
  CHECK(cpu_only{}.route(room).region == placement::gpu_resident);
  CHECK(fixed_ratio(0.3).route(room).region == placement::gpu_resident);
  CHECK(roof.route(room).region == placement::gpu_resident);
  CHECK(gpu_only{}.route(none).region == placement::gpu_load);
  CHECK(cpu_only{}.route(none).region == placement::cpu_compute);
  CHECK(roof.route(none).region != placement::gpu_resident);
  CHECK(fixed_ratio(1.0).route(none).region == placement::cpu_compute);
  CHECK(fixed_ratio(0.0).route(none).region == placement::gpu_load);
  CHECK(!hbm_has_room(query(0, 0, 0, 0)));
}

TEST_CASE("HBM routing: the host share counts host tokens only (route_toward)") {
  // 64 tokens in HBM, none on the host: the first host batch at r = 0.5 is a
  // tie on the host tokens (to the GPU); counting the HBM tokens would send it
  // to the CPU.
  CHECK(route_toward(0.5, query(64, 0, 64, 0)) == placement::gpu_load);
  // 64 HBM + 32 pinned: the next one at 0.5 goes to the CPU.
  CHECK(route_toward(0.5, query(96, 0, 64, 0)) == placement::cpu_compute);
  // 64 HBM + 32 CPU + 0 pinned at r = 0.25: to the GPU (CPU share 0.5 > 0.25).
  CHECK(route_toward(0.25, query(96, 32, 64, 0)) == placement::gpu_load);
  CHECK(fixed_ratio(0.5).route(query(64, 0, 64, 0)).region == placement::gpu_load);
}

TEST_CASE("HBM routing: the roofline's eq. 2 over the host tokens, HBM time a fixed cost of the GPU side") {
  roofline_params rp;
  rp.cpu_cost_per_token_seconds = 2e-9;    // A
  rp.gpu_cost_per_token_seconds = 1.4e-9;  // B
  rp.cpu_fixed_seconds = 20e-6;
  rp.gpu_fixed_seconds = 30e-6;
  rp.hbm_cost_per_token_seconds = 0.05e-9;  // H
  const roofline_policy roof(rp);
  const double A = 2e-9, B = 1.4e-9, H = 0.05e-9, delta = 10e-6;
  for (index_t host : {index_t(4096), index_t(50000), index_t(300000)})
    for (index_t hbm : {index_t(0), index_t(8192), index_t(100000)}) {
      const double want = std::clamp(B / (A + B) + (delta + H * double(hbm)) / ((A + B) * double(host)), 0.0, 1.0);
      CHECK(roof.target_share(host, hbm) == doctest::Approx(want).epsilon(1e-12));
    }
  CHECK(roof.target_share(50000) == roof.target_share(50000, 0));
  // route(): L = the host tokens after the batch, the HBM tokens through Δ'.
  const route_query q = query(0, 0, 0, 0, 100000, 60000);
  CHECK(roof.route(q).target.cpu_compute == doctest::Approx(roof.target_share(40000 + 32, 60000)).epsilon(1e-12));
  // Larger HBM time: more of the host tokens to the CPU.
  CHECK(roof.target_share(40000, 60000) > roof.target_share(40000, 0));
  rp.hbm_cost_per_token_seconds = -1;
  CHECK_THROWS_AS(roofline_policy{rp}, config_error);
}

TEST_CASE("HBM routing: online B with the HBM tokens' time removed (track_gpu_cost)") {
  roofline_params rp;
  rp.cpu_cost_per_token_seconds = 2e-9;
  rp.gpu_cost_per_token_seconds = 1e-9;
  rp.gpu_fixed_seconds = 30e-6;
  rp.hbm_cost_per_token_seconds = 0.1e-9;
  rp.track_gpu_cost = true;
  roofline_policy roof(rp);
  cost_sample s;
  s.gpu_streamed_tokens = 10000;
  s.gpu_resident_tokens = 200000;
  s.gpu_seconds = 30e-6 + 0.1e-9 * 200000 + 3e-9 * 10000;  // B = 3 ns
  roof.observe(s);
  CHECK(roof.gpu_cost_per_token_seconds() == doctest::Approx(3e-9).epsilon(1e-9));
}

TEST_CASE("HBM routing: online H from the steps that streamed nothing (track_hbm_cost)") {
  roofline_params rp;
  rp.cpu_cost_per_token_seconds = 2e-9;
  rp.gpu_cost_per_token_seconds = 1e-9;
  rp.gpu_fixed_seconds = 30e-6;
  rp.hbm_cost_per_token_seconds = 1e-9;  // the prior, five times the measured cost below
  rp.cost_window_samples = 2;
  roofline_policy roof(rp);
  CHECK(roof.hbm_cost_per_token_seconds() == 1e-9);
  cost_sample s;
  s.gpu_resident_tokens = 100000;
  s.gpu_seconds = 30e-6 + 0.2e-9 * 100000;  // H = 0.2 ns past C_GPU
  roof.observe(s);
  CHECK(roof.hbm_cost_per_token_seconds() == doctest::Approx(0.2e-9).epsilon(1e-9));
  // eq. 2 with the measured H in Δ'
  const double A = 2e-9, B = 1e-9, delta = 30e-6 + 0.2e-9 * 60000;
  CHECK(roof.target_share(40000, 60000) ==
        doctest::Approx(std::clamp(B / (A + B) + delta / ((A + B) * 40000.0), 0.0, 1.0)).epsilon(1e-12));
  // a step that also streamed is B's sample, not H's
  cost_sample mixed = s;
  mixed.gpu_streamed_tokens = 5000;
  mixed.gpu_seconds = 1.0;
  roof.observe(mixed);
  CHECK(roof.hbm_cost_per_token_seconds() == doctest::Approx(0.2e-9).epsilon(1e-9));
  // a ratio of sums over the window: (s + t) / tokens, then t alone once s leaves it
  cost_sample t;
  t.gpu_resident_tokens = 300000;
  t.gpu_seconds = 30e-6 + 0.4e-9 * 300000;
  roof.observe(t);
  CHECK(roof.hbm_cost_per_token_seconds() == doctest::Approx((0.2e-9 * 1e5 + 0.4e-9 * 3e5) / 4e5).epsilon(1e-9));
  roof.observe(t);
  roof.observe(t);
  CHECK(roof.hbm_cost_per_token_seconds() == doctest::Approx(0.4e-9).epsilon(1e-9));
  // off: the prior stays
  rp.track_hbm_cost = false;
  roofline_policy fixed_h(rp);
  fixed_h.observe(s);
  CHECK(fixed_h.hbm_cost_per_token_seconds() == 1e-9);
}

TEST_CASE("HBM routing: a policy that answers gpu_resident for a full region is asked again, then falls through") {
  const G L(4, 2);
  scripted_policy pol;
  pol.fn = [](const route_query&) { return placement::gpu_resident; };
  test_rig<host_backend, G, scripted_policy> rig(L, hbm_spec(L, 1, 2, 1), pol, attention_options{1, true}, 5, g_scale);
  const sequence_id a = rig.d.add(3 * 32);
  CHECK(batch_regions(rig.cache, a) ==
        std::vector<placement>{placement::gpu_resident, placement::gpu_load, placement::gpu_load});
  const auto& log = *pol.log;
  REQUIRE(log.size() == 5);  // 1 + 2 per batch that found the region full
  CHECK(log[0].hbm_free_tokens == 32);
  CHECK(log[0].total_hbm_placed_tokens == 0);
  CHECK(log[1].hbm_free_tokens == 0);
  CHECK(log[1].hbm_placed_tokens == 32);
  CHECK(log[1].total_hbm_placed_tokens == 32);
  CHECK(log[2].hbm_free_tokens == 0);
  CHECK(log[4].placed_tokens == 64);
  const std::vector<sequence_id> one{a};
  CHECK(rig.d.step(one).ok());
}

// -----------------------------------------------------------------------------
// The plan, the spec, init, the sparse path
// -----------------------------------------------------------------------------

TEST_CASE("stream_plan::add_resident cuts at every eviction batch and every split_blocks blocks; build() clears it") {
  stream_plan p;
  const std::vector<std::vector<block_id>> ids{{4, 5, 6, 7, 0, 1, 2, 3}, {}, {8, 9, 10, 11}};
  p.add_resident(3, [&](int i) { return std::span<const block_id>(ids[std::size_t(i)]); }, 3, 4);
  const std::vector<std::array<index_t, 3>> want{{0, 4, 3}, {0, 7, 1}, {0, 0, 3}, {0, 3, 1}, {2, 8, 3}, {2, 11, 1}};
  REQUIRE(p.resident_splits.size() == want.size());
  for (std::size_t k = 0; k < want.size(); ++k) {
    CHECK(p.resident_splits[k].batch_index == want[k][0]);
    CHECK(p.resident_splits[k].first_block == want[k][1]);
    CHECK(p.resident_splits[k].num_blocks == want[k][2]);
    CHECK(p.resident_splits[k].list_offset == -1);
  }
  CHECK(p.resident_blocks == 12);
  // split_blocks larger than a batch: one split per batch, never across two
  p.add_resident(3, [&](int i) { return std::span<const block_id>(ids[std::size_t(i)]); }, 8, 4);
  CHECK(p.resident_splits.size() == 3);
  p.build(0, [](int) { return std::span<const block_id>(); }, [](block_id) { return pinned_span<const bf16>(); }, 1, 4,
          4, 2);
  CHECK(p.resident_splits.empty());
  CHECK(p.resident_blocks == 0);
}

TEST_CASE("stream_plan::add_resident groups whole eviction batches per sequence, bounded, in logical order") {
  stream_plan p;
  // batch_blocks 2; sequence 0: 20 batches (40 blocks, ids scattered), 1: none, 2: 3 batches, the last one block
  std::vector<std::vector<block_id>> ids(3);
  for (int k = 0; k < 20; ++k) {
    const block_id b = block_id((k * 7) % 20) * 2 + 100;
    ids[0].push_back(b);
    ids[0].push_back(b + 1);
  }
  ids[2] = {6, 7, 0, 1, 4};
  auto of = [&](int i) { return std::span<const block_id>(ids[std::size_t(i)]); };
  // at most 6 blocks (3 batches) per group: sequence 0 wants ceil(20 / 8) = 3 batches, sequence 2 one
  p.add_resident(3, of, 1, 2, 6);
  CHECK(p.resident_run_blocks == 2);
  CHECK(p.resident_splits.size() == 45);  // split_blocks 1: the default path's splits are unchanged
  const std::vector<std::array<index_t, 4>> want{{0, 0, 3, 6},   {0, 3, 3, 6},  {0, 6, 3, 6},  {0, 9, 3, 6},
                                                 {0, 12, 3, 6},  {0, 15, 3, 6}, {0, 18, 2, 4}, {2, 20, 1, 2},
                                                 {2, 21, 1, 2},  {2, 22, 1, 1}};
  REQUIRE(p.resident_groups.size() == want.size());
  index_t blocks = 0;
  for (std::size_t k = 0; k < want.size(); ++k) {
    const resident_group& g = p.resident_groups[k];
    CHECK(g.batch_index == want[k][0]);
    CHECK(g.first_run == want[k][1]);
    CHECK(g.num_runs == want[k][2]);
    CHECK(g.num_blocks == want[k][3]);
    blocks += g.num_blocks;
  }
  CHECK(blocks == p.resident_blocks);
  // every run is the first block of its batch, in the sequence's logical order
  REQUIRE(p.resident_runs.size() == 23);
  for (std::size_t k = 0; k < 20; ++k) CHECK(p.resident_runs[k] == ids[0][2 * k]);
  CHECK(p.resident_runs[20] == 6);
  CHECK(p.resident_runs[21] == 0);
  CHECK(p.resident_runs[22] == 4);
  // a sequence's groups do not depend on its batchmates (batch invariance)
  stream_plan solo;
  solo.add_resident(1, [&](int) { return std::span<const block_id>(ids[2]); }, 1, 2, 6);
  REQUIRE(solo.resident_groups.size() == 3);
  for (std::size_t k = 0; k < 3; ++k) {
    CHECK(solo.resident_groups[k].num_runs == p.resident_groups[7 + k].num_runs);
    CHECK(solo.resident_groups[k].num_blocks == p.resident_groups[7 + k].num_blocks);
  }
  // the cap: a group never holds more than max_group_blocks / batch_blocks batches (at least one)
  p.add_resident(3, of, 1, 2, 3);
  for (const resident_group& g : p.resident_groups) CHECK(g.num_runs == 1);
  // without max_group_blocks: no groups; build() clears them
  p.add_resident(3, of, 1, 2);
  CHECK(p.resident_groups.empty());
  CHECK(p.resident_runs.empty());
  CHECK(p.resident_run_blocks == 0);
  p.add_resident(3, of, 1, 2, 6);
  p.build(0, [](int) { return std::span<const block_id>(); }, [](block_id) { return pinned_span<const bf16>(); }, 1, 4,
          4, 2);
  CHECK(p.resident_groups.empty());
  CHECK(p.resident_runs.empty());
}

TEST_CASE("HBM spec: an HBM-only cache is valid; a region below one batch does not count") {
  const G L(4, 2);
  partition_spec s = hbm_spec(L, 1, 2, 2);
  s.cpu_capacity_tokens = 0;
  s.pinned_capacity_tokens = 0;
  CHECK_NOTHROW(s.validate(L));
  s.hbm_capacity_tokens = s.d_window_tokens - 1;
  CHECK(s.hbm_capacity_batches() == 0);
  CHECK_THROWS_AS(s.validate(L), config_error);
  s.hbm_capacity_tokens = -32;
  CHECK_THROWS_AS(s.validate(L), config_error);
  // HBM-only: the region full, the next batch has no host region: a capacity_error at admission
  s = hbm_spec(L, 1, 2, 2);
  s.cpu_capacity_tokens = 0;
  s.pinned_capacity_tokens = 0;
  test_rig<host_backend, G, gpu_only> rig(L, s, gpu_only{}, attention_options{1, true}, 3, g_scale);
  const sequence_id a = rig.d.add(2 * 32 + 4);
  CHECK(rig.cache.sequence(a).hbm_placed_tokens == 64);
  CHECK_THROWS_AS(rig.cache.begin_sequence(32), capacity_error);
  CHECK(rig.cache.usage().hbm_used_blocks == 4);
}

TEST_CASE("HBM init: refused against the backend's free device memory, naming both byte counts") {
  const G L(4, 2);
  const partition_spec s = hbm_spec(L, 2, 2, 100);
  const index_t block = block_format<G>{L, 16}.block_bytes();
  const index_t hbm = 100 * 2 * block * 2;      // batches * blocks * bytes * layers
  const index_t others = 2 * 2 * block * 2 + 6 * block * 2;  // D-window + ping-pong
  using cache_t = host_cache<G, gpu_only>;
  {
    host_backend be;
    be.set_device_free_bytes(1 << 20);
    const std::string what = error_of([&] { cache_t c(be, L, s, gpu_only{}); });
    INFO(what);
    CHECK(mentions(what, {"HBM-resident region", std::to_string(hbm), std::to_string(1 << 20),
                          "partition_spec::hbm_capacity_tokens"}));
    CHECK_THROWS_AS(cache_t(be, L, s, gpu_only{}), resource_error);
  }
  {
    host_backend be;
    be.set_device_free_bytes(hbm + others - 1);  // the region fits, the D-window and ping-pong not with it
    const std::string what = error_of([&] { cache_t c(be, L, s, gpu_only{}); });
    CHECK(mentions(what, {std::to_string(hbm), std::to_string(others), std::to_string(hbm + others - 1)}));
  }
  {
    host_backend be;
    be.set_device_free_bytes(hbm + others);
    cache_t c(be, L, s, gpu_only{});
    CHECK(c.usage().hbm_region_bytes == hbm);
    CHECK(c.usage().hbm_capacity_blocks == 200);
  }
  {
    host_backend be;
    be.set_device_free_bytes(0);  // without an HBM region nothing is checked
    partition_spec n = s;
    n.hbm_capacity_tokens = 0;
    CHECK_NOTHROW(cache_t(be, L, n, gpu_only{}));
  }
}

TEST_CASE("HBM sparse: a sparse step over a sequence with HBM blocks is a state_error before any work") {
  const G L(4, 2);
  test_rig<host_backend, G, gpu_only> rig(L, hbm_spec(L, 1, 3, 1), gpu_only{}, attention_options{1, true}, 9, g_scale);
  const sequence_id a = rig.d.add(32 + 5);  // its batch in HBM
  const sequence_id b = rig.d.add(3 * 32);  // the region is full: pinned
  step_runner<decltype(rig.cache)> r(rig.d);
  select_all sel;
  const std::vector<sequence_id> with_a{b, a}, only_b{b};
  r.make_queries(with_a);
  const std::string what = error_of([&] { r.sparse(0, with_a, sel); });
  CHECK(mentions(what, {"sequence " + std::to_string(a), "HBM-resident region", "32 tokens"}));
  CHECK_THROWS_AS(r.sparse(0, with_a, sel), state_error);
  // a batch without HBM blocks is attended as before, equal to the dense step
  r.make_queries(only_b);
  r.sparse(0, only_b, sel);
  const std::vector<float> sparse_out = r.out;
  r.dense(0, only_b);
  CHECK(same_bits(sparse_out, r.out));
}
