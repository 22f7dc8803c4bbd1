// Block-level sparse selection (paper §4.4, §7.5; docs/SPARSE.md) on the host
// backend: with every block selected a sparse step is bit-identical to the
// dense one (every policy, ragged batches, GQA and MLA, gathered and direct
// chunks); with top-k the output equals the fp64 reference restricted to the
// selected blocks of each KV head plus the D-window, and the selection is a
// top-k of the test's own summaries (recomputed from its own history); a
// selection that leaves an engine without blocks gives exactly the empty
// partial (K1); selections past 4 GiB offsets (K4/C7); user selectors; bad
// selections are typed errors with the cache unchanged; batch invariance
// (K10); the policy sees the selected volumes; the sparse stream plan; the
// device-pull transfer mode is accepted and emulated, bit-identical to the
// host gather.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <map>
#include <optional>
#include <random>
#include <set>

#include "support/sparse_checks.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<128>;
using M = mla_layout<512, 64>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

static_assert(block_selector<top_k_selector, G>);
static_assert(block_selector<select_all, M>);
static_assert(block_selector<sink_and_recent, G>);
static_assert(block_selector<recording<top_k_selector>, M>);
static_assert(!block_selector<not_a_selector, G>);
static_assert(!block_selector<int, G>);

roofline_policy test_roofline() {
  roofline_params p;
  p.cpu_cost_per_token_seconds = 2.0e-9;
  p.gpu_cost_per_token_seconds = 1.4e-9;
  p.cpu_fixed_seconds = 20e-6;
  p.gpu_fixed_seconds = 30e-6;
  p.cost_window_samples = 8;
  return roofline_policy(p);
}

/// select_all against dense, step by step, every layer, with evictions.
template <class Layout, class Policy>
void select_all_matches_dense(const Layout& L, Policy pol, double scale, index_t direct_run_bytes, int steps,
                              std::uint64_t seed) {
  host_backend be;
  const std::vector<index_t> prompts{1, 15, 33, 70, 100};
  partition_spec spec = sparse_spec(2, int(prompts.size()), 100 + steps);
  set_ping_pong_blocks(spec, L, 6);
  host_cache<Layout, Policy> cache(be, L, spec, pol, {}, cache_options{true});
  attention_options ao{1, true};
  ao.sparse.direct_run_bytes = direct_run_bytes;
  decode_driver<decltype(cache)> d(cache, ao, seed, scale);
  std::vector<sequence_id> batch;
  for (index_t p : prompts) batch.push_back(d.add(p));
  step_runner<decltype(cache)> r(d);
  select_all all;
  index_t gathered = 0, direct = 0;
  for (int s = 0; s < steps; ++s) {
    for (int l = 0; l < spec.num_layers; ++l) {
      CAPTURE(s);
      CAPTURE(l);
      d.append_layer(l, batch);
      r.make_queries(batch);
      debug_partials dd, ds;
      r.dense(l, batch, &dd);
      const std::vector<float> out = r.out, lse = r.lse;
      const step_report dense_rep = r.rep;
      r.sparse(l, batch, all, &ds);
      REQUIRE(same_bits(out, r.out));
      REQUIRE(same_bits(lse, r.lse));
      REQUIRE(same_bits(dd.cpu_o, ds.cpu_o));
      REQUIRE(same_bits(dd.streamed_lse, ds.streamed_lse));
      CHECK(r.rep.cpu_tokens == dense_rep.cpu_tokens);
      CHECK(r.rep.streamed_tokens == dense_rep.streamed_tokens);
      CHECK(r.rep.chunks == dense_rep.chunks);
      CHECK(r.rep.copies == dense_rep.copies);
      CHECK(r.rep.cpu_tasks == dense_rep.cpu_tasks);
      CHECK(r.rep.selected_blocks == r.rep.placed_blocks);
      gathered += d.attention().engine().last_gather().gathered_chunks +
                  d.attention().engine().last_gather().pulled_chunks;  // either transfer mode
      direct += d.attention().engine().last_gather().direct_chunks;
      if (s % 8 == 0) {  // and the output is right (dense is checked elsewhere; spot-check here)
        compare_result cr;
        std::vector<double> ro, rl;
        const int hq = L.num_q_heads();
        for (std::size_t i = 0; i < batch.size(); ++i) {
          reference_attention(L, d.history(batch[i], l), r.d.q.data() + i * std::size_t(hq) * Layout::q_dim, scale, ro,
                              rl);
          compare_rows(hq, Layout::v_dim, r.out.data() + i * std::size_t(hq) * Layout::v_dim,
                       r.lse.data() + i * std::size_t(hq), ro, rl, cr);
        }
        REQUIRE(cr.ok());
      }
    }
    cache.flush();
  }
  // Chunks went the way direct_run_bytes says (runs here are far below 2 MiB).
  if constexpr (std::is_same_v<Policy, gpu_only> || std::is_same_v<Policy, fixed_ratio>) CHECK(gathered + direct > 0);
  CHECK((direct_run_bytes == 0 ? gathered : direct) == 0);
}

}  // namespace

TEST_CASE("select_all is bit-identical to the dense step: GQA 32/4, every policy, gathered and direct chunks") {
  const G L(32, 4);
  const index_t modes[2] = {index_t{2} << 20, 0};  // gathered (runs < 2 MiB), direct
  SUBCASE("gpu_only") {
    for (index_t m : modes) select_all_matches_dense(L, gpu_only{}, gqa_scale, m, 24, 1);
  }
  SUBCASE("cpu_only") {
    for (index_t m : modes) select_all_matches_dense(L, cpu_only{}, gqa_scale, m, 24, 2);
  }
  SUBCASE("fixed_ratio 0.4") {
    for (index_t m : modes) select_all_matches_dense(L, fixed_ratio(0.4), gqa_scale, m, 24, 3);
  }
  SUBCASE("roofline") {
    for (index_t m : modes) select_all_matches_dense(L, test_roofline(), gqa_scale, m, 24, 4);
  }
}

TEST_CASE("select_all is bit-identical to the dense step: MLA DeepSeek-V2-Lite, every policy") {
  const M L = presets::deepseek_v2_lite::layout();
  const double scale = presets::deepseek_v2_lite::softmax_scale();
  SUBCASE("gpu_only") { select_all_matches_dense(L, gpu_only{}, scale, index_t{2} << 20, 12, 5); }
  SUBCASE("cpu_only") { select_all_matches_dense(L, cpu_only{}, scale, index_t{2} << 20, 12, 6); }
  SUBCASE("fixed_ratio 0.4, direct") { select_all_matches_dense(L, fixed_ratio(0.4), scale, 0, 12, 7); }
  SUBCASE("roofline") { select_all_matches_dense(L, test_roofline(), scale, index_t{2} << 20, 12, 8); }
}

namespace {

/// The same sparse steps through two attention objects on one cache: the
/// driver's (sparse_transfer::host_gather) and one with device_pull (emulated
/// by the host backend: runs copied straight into ping-pong, no staging).
/// Outputs and LSEs must be bit-identical; the gather statistics say which way
/// the gathered chunks went.
template <class Layout, class Policy, class Selector>
void pull_matches_gather(const Layout& L, Policy pol, double scale, const Selector& selector, int steps,
                         std::uint64_t seed) {
  host_backend be;
  const std::vector<index_t> prompts{1, 15, 33, 70, 100};
  partition_spec spec = sparse_spec(2, int(prompts.size()), 100 + steps);
  set_ping_pong_blocks(spec, L, 6);
  host_cache<Layout, Policy> cache(be, L, spec, pol, {}, cache_options{true});
  attention_options ao{1, true};
  ao.sparse.reserve = true;
  ao.sparse.transfer = sparse_transfer::host_gather;  // not the default
  decode_driver<decltype(cache)> d(cache, ao, seed, scale);
  attention_options po = ao;
  po.sparse.transfer = sparse_transfer::device_pull;
  po.sparse.pull_ctas = 7;  // meaningless on the host backend, accepted
  hybrid_attention<decltype(cache)> pull(cache, po);
  CHECK(pull.engine().sparse_staging_bytes() == 0);  // no staging in pull mode
  CHECK(d.attention().engine().sparse_staging_bytes() > 0);
  std::vector<sequence_id> batch;
  for (index_t p : prompts) batch.push_back(d.add(p));
  step_runner<decltype(cache)> r(d);
  const index_t block_bytes = cache.format().block_bytes();
  // Both attention objects stream through the cache's ping-pong buffers: NaN
  // them before each step, so a block one mode failed to move cannot be read
  // as left there by the other.
  auto poison_ping_pong = [&] {
    const layer_views<Layout> v = cache.views(0);
    be.fill_device(reinterpret_cast<std::byte*>(v.ping_pong.buffer(0).data()),
                   index_t(v.ping_pong.size()) * v.ping_pong_blocks * block_bytes, 0xffff);
  };
  index_t pulled = 0;
  for (int s = 0; s < steps; ++s) {
    for (int l = 0; l < spec.num_layers; ++l) {
      CAPTURE(s);
      CAPTURE(l);
      d.append_layer(l, batch);
      r.make_queries(batch);
      Selector sel_gather = selector, sel_pull = selector;
      poison_ping_pong();
      r.sparse(l, batch, sel_gather);
      const gather_stats gg = d.attention().engine().last_gather();
      std::vector<float> out(r.out.size(), std::numeric_limits<float>::quiet_NaN());
      std::vector<float> lse(r.lse.size(), std::numeric_limits<float>::quiet_NaN());
      const step_outputs<pageable_host_space> so{host_span<float>(out.data(), index_t(out.size())),
                                                 host_span<float>(lse.data(), index_t(lse.size())), nullptr};
      poison_ping_pong();
      const step_report pr =
          pull.step(l, batch, host_span<const float>(r.d.q.data(), index_t(r.d.q.size())), float(d.scale()), so, sel_pull);
      REQUIRE(same_bits(r.out, out));
      REQUIRE(same_bits(r.lse, lse));
      const gather_stats pg = pull.engine().last_gather();
      const index_t staged = pull.last_plan().gathered_blocks * block_bytes;
      CHECK(gg.pulled_chunks == 0);
      CHECK(r.rep.pulled_bytes == 0);
      CHECK(r.rep.gathered_bytes == staged);
      CHECK(pg.gathered_chunks == 0);
      CHECK(pg.bytes == 0);
      CHECK(pr.gathered_bytes == 0);
      CHECK(pr.gather_seconds == 0.0);
      CHECK(pg.pulled_chunks == gg.gathered_chunks);
      CHECK(pg.direct_chunks == gg.direct_chunks);
      CHECK(pg.pulled_bytes == staged);
      CHECK(pr.pulled_bytes == staged);
      pulled += pg.pulled_chunks;
      if (l + 1 == spec.num_layers) cache.flush();
    }
  }
  CHECK(pull.engine().sparse_staging_bytes() == 0);
  if constexpr (!std::is_same_v<Policy, cpu_only>) CHECK(pulled > 0);
}

}  // namespace

TEST_CASE("sparse_transfer::device_pull on the host backend: accepted, emulated, bit-identical to host_gather") {
  SUBCASE("GQA 32/4, top-k 0.5, gpu_only") {
    pull_matches_gather(G(32, 4), gpu_only{}, gqa_scale, top_k_selector::ratio(0.5), 16, 31);
  }
  SUBCASE("GQA 32/4, select_all, fixed_ratio 0.4") {
    pull_matches_gather(G(32, 4), fixed_ratio(0.4), gqa_scale, select_all{}, 12, 32);
  }
  SUBCASE("MLA DeepSeek-V2-Lite, top-k 0.3, fixed_ratio 0.5") {
    pull_matches_gather(presets::deepseek_v2_lite::layout(), fixed_ratio(0.5),
                        presets::deepseek_v2_lite::softmax_scale(), top_k_selector::ratio(0.3), 10, 33);
  }
  SUBCASE("pull_ctas < 1 is a config_error when the pipeline is reserved") {
    host_backend be;
    const G L(32, 4);
    partition_spec spec = sparse_spec(1, 2, 100);
    set_ping_pong_blocks(spec, L, 4);
    host_cache<G, gpu_only> cache(be, L, spec, gpu_only{});
    attention_options ao{1, false};
    ao.sparse.reserve = true;
    ao.sparse.transfer = sparse_transfer::device_pull;
    ao.sparse.pull_ctas = 0;
    CHECK_THROWS_AS(hybrid_attention<decltype(cache)>(cache, ao), config_error);
    ao.sparse.pull_ctas = 1;
    CHECK_NOTHROW(hybrid_attention<decltype(cache)>(cache, ao));
  }
}

namespace {

/// Top-k decode loop checked against the restricted reference, the test's own
/// summaries and its own top-k, every step and layer.
template <class Layout, class Policy>
void topk_loop(const Layout& L, Policy pol, double scale, top_k_selector sel, const std::vector<index_t>& prompts,
               int steps, std::uint64_t seed) {
  host_backend be;
  partition_spec spec = sparse_spec(2, int(prompts.size()), 200 + steps);
  set_ping_pong_blocks(spec, L, 5);
  host_cache<Layout, Policy> cache(be, L, spec, pol, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, seed, scale);
  std::vector<sequence_id> batch;
  for (index_t p : prompts) batch.push_back(d.add(p));
  step_runner<decltype(cache)> r(d);
  recording<top_k_selector> rec{sel, {}};
  const int hq = L.num_q_heads();
  index_t selected = 0, placed = 0;
  for (int s = 0; s < steps; ++s)
    for (int l = 0; l < spec.num_layers; ++l) {
      CAPTURE(s);
      CAPTURE(l);
      d.append_layer(l, batch);
      r.make_queries(batch);
      rec.log.clear();
      r.sparse(l, batch, rec);
      compare_result cr;
      int problems = 0;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const float* q = r.d.q.data() + i * std::size_t(hq) * Layout::q_dim;
        check_restricted(L, d.history(batch[i], l), cache.sequence(batch[i]), spec.block_tokens,
                         d.attention().last_selection(), int(i), q, scale,
                         r.out.data() + i * std::size_t(hq) * Layout::v_dim, r.lse.data() + i * std::size_t(hq), cr);
        problems += check_topk(cache, d.attention(), d.history(batch[i], l), batch[i], l, int(i), q, scale, sel);
      }
      INFO("rel_l2 " << cr.max_rel_l2 << ", lse excess " << cr.max_lse_err);
      REQUIRE(cr.ok());
      REQUIRE(problems == 0);
      // The library's selection is what the (recorded) selector answered.
      std::size_t call = 0;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        if (cache.sequence(batch[i]).block_table.empty()) continue;
        REQUIRE(call < rec.log.size());
        for (int h = 0; h < L.kv_heads(); ++h) CHECK(rec.log[call][std::size_t(h)] == d.attention().last_selection().blocks(int(i), h));
        ++call;
      }
      CHECK(call == rec.log.size());
      selected += r.rep.selected_blocks;
      placed += r.rep.placed_blocks;
      if (l + 1 == spec.num_layers) cache.flush();
    }
  CHECK(selected < placed);  // it was sparse
}

}  // namespace

TEST_CASE("top-k equals the fp64 reference restricted to the selected blocks + D-window, and is the test's own top-k") {
  SUBCASE("GQA 32/4, keep ratio 0.5, fixed_ratio 0.5") {
    topk_loop(G(32, 4), fixed_ratio(0.5), gqa_scale, top_k_selector::ratio(0.5), {40, 97, 200}, 40, 11);
  }
  SUBCASE("GQA 32/8 (Mixtral), keep 2 blocks, roofline") {
    topk_loop(G(32, 8), test_roofline(), gqa_scale, top_k_selector::blocks(2), {17, 64, 150}, 35, 12);
  }
  SUBCASE("GQA 8/2, keep ratio 0.2, gpu_only; cpu_only") {
    topk_loop(G(8, 2), gpu_only{}, gqa_scale, top_k_selector::ratio(0.2), {130, 33}, 35, 13);
    topk_loop(G(8, 2), cpu_only{}, gqa_scale, top_k_selector::ratio(0.2), {130, 33}, 35, 14);
  }
  SUBCASE("MLA DeepSeek-V2-Lite, keep ratio 0.3, fixed_ratio 0.5") {
    topk_loop(presets::deepseek_v2_lite::layout(), fixed_ratio(0.5), presets::deepseek_v2_lite::softmax_scale(),
              top_k_selector::ratio(0.3), {50, 140}, 34, 15);
  }
}

TEST_CASE("K1: a selection that leaves an engine (or a KV head) without blocks gives exactly the empty partial") {
  host_backend be;
  const G L(16, 4);
  partition_spec spec = sparse_spec(1, 3, 300);
  set_ping_pong_blocks(spec, L, 4);
  host_cache<G, fixed_ratio> cache(be, L, spec, fixed_ratio(0.5), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 21, gqa_scale);
  const std::vector<sequence_id> batch{d.add(128), d.add(32 * 5 + 3), d.add(31)};
  step_runner<decltype(cache)> r(d);
  for (int s = 0; s < 3; ++s) {
    d.append_layer(0, batch);
    r.make_queries(batch);
    auto check_all = [&](const char* what) {
      CAPTURE(what);
      compare_result cr;
      for (std::size_t i = 0; i < batch.size(); ++i)
        check_restricted(L, d.history(batch[i], 0), cache.sequence(batch[i]), 16, d.attention().last_selection(),
                         int(i), r.d.q.data() + i * 16 * 128, gqa_scale, r.out.data() + i * 16 * 128,
                         r.lse.data() + i * 16, cr);
      INFO("rel_l2 " << cr.max_rel_l2 << ", lse excess " << cr.max_lse_err << ", non-finite " << cr.non_finite);
      CHECK(cr.ok());
    };
    {
      only_region cpu_blocks{placement::cpu_compute};
      debug_partials dbg;
      r.sparse(0, batch, cpu_blocks, &dbg);
      check_all("CPU blocks only");
      CHECK(r.rep.streamed_tokens == 0);
      CHECK(r.rep.chunks == 0);
      CHECK(empty_rows(dbg.streamed_o, dbg.streamed_lse, 0, 3 * 16));  // (0, -inf) exactly, every row
    }
    {
      only_region pinned_blocks{placement::gpu_load};
      debug_partials dbg;
      r.sparse(0, batch, pinned_blocks, &dbg);
      check_all("pinned blocks only");
      CHECK(r.rep.cpu_tokens == 0);
      CHECK(r.rep.cpu_tasks == 0);
      CHECK(empty_rows(dbg.cpu_o, dbg.cpu_lse, 0, 3 * 16));
    }
    {
      select_none none;
      debug_partials dbg;
      r.sparse(0, batch, none, &dbg);
      check_all("no block: D-window only");
      CHECK(empty_rows(dbg.cpu_o, dbg.cpu_lse, 0, 3 * 16));
      CHECK(empty_rows(dbg.streamed_o, dbg.streamed_lse, 0, 3 * 16));
      CHECK(r.rep.selected_blocks == 0);
    }
    {
      skip_head0 skip;
      debug_partials dbg;
      r.sparse(0, batch, skip, &dbg);
      check_all("KV head 0 attends no block");
      for (std::size_t i = 0; i < batch.size(); ++i) {  // query heads 0..3 of every sequence
        CHECK(empty_rows(dbg.cpu_o, dbg.cpu_lse, i * 16, 4));
        CHECK(empty_rows(dbg.streamed_o, dbg.streamed_lse, i * 16, 4));
      }
      // cpu_tokens are averaged over the KV heads: 3 of 4 heads attend the CPU blocks.
      index_t cpu_blocks = 0;
      for (sequence_id s : batch) cpu_blocks += index_t(cache.sequence(s).cpu_blocks.size());
      CHECK(r.rep.cpu_tokens == cpu_blocks * 16 * 3 / 4);
    }
    cache.flush();
  }
}

TEST_CASE("K4/C7: selections of blocks past 2^32 bytes in the unpinned and pinned regions (MAP_NORESERVE, small RSS)") {
  const G lay(4, 1);  // 512 bytes per token
  const index_t gib_tokens = (index_t{1} << 30) / 512;
  for (placement where : {placement::cpu_compute, placement::gpu_load}) {
    const std::string region = to_string(where);
    CAPTURE(region);
    const partition_spec s = past_4gib_spec(lay, where);
    scripted_policy pol;
    pol.fn = [where](const route_query&) { return where; };
    host_backend be;
    std::optional<host_cache<G, scripted_policy>> cache;
    try {
      cache.emplace(be, lay, s, pol, pageable_allocator{}, cache_options{false});
    } catch (const resource_error& e) {
      WARN_MESSAGE(false, "skipped: this machine refuses a 5 GiB MAP_NORESERVE reservation: " << std::string(e.what()));
      continue;
    }
    decode_driver<host_cache<G, scripted_policy>> d(*cache, attention_options{1, true}, 41, gqa_scale);
    (void)cache->begin_sequence(2 * gib_tokens);         // never written
    const sequence_id a = d.add(2 * 256 + 10);           // at 2 GiB
    (void)cache->begin_sequence(2 * gib_tokens);         // to 4 GiB + a
    const sequence_id b = d.add(6 * 256 + 5);            // past 4 GiB
    const std::vector<sequence_id> batch{a, b};
    const layer_views<G> v = cache->views(0);
    const bf16* base = where == placement::cpu_compute ? v.cpu_block(0) : v.pinned_block(0);
    step_runner<host_cache<G, scripted_policy>> r(d);
    top_k_selector sel = top_k_selector::ratio(0.4);
    for (int st = 0; st < 3; ++st) {
      d.append_layer(0, batch);
      r.make_queries(batch);
      r.sparse(0, batch, sel);
      compare_result cr;
      int problems = 0;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        check_restricted(lay, d.history(batch[i], 0), cache->sequence(batch[i]), 64, d.attention().last_selection(),
                         int(i), r.d.q.data() + i * 4 * 128, gqa_scale, r.out.data() + i * 4 * 128,
                         r.lse.data() + i * 4, cr);
        problems += check_topk(*cache, d.attention(), d.history(batch[i], 0), batch[i], 0, int(i),
                               r.d.q.data() + i * 4 * 128, gqa_scale, sel);
      }
      REQUIRE(cr.ok());
      REQUIRE(problems == 0);
      // Every block b selected lies past 4 GiB, and some block of a past 2 GiB.
      const sequence_state& sb = cache->sequence(b);
      const std::vector<index_t> chosen = d.attention().last_selection().blocks(1, 0);
      REQUIRE(!chosen.empty());
      for (index_t k : chosen) {
        const block_ref& br = sb.block_table[std::size_t(k)];
        const bf16* p = where == placement::cpu_compute ? v.cpu_block(br.id) : v.pinned_block(br.id);
        CHECK(index_t(p - base) * index_t(sizeof(bf16)) > (index_t{1} << 32));
      }
      cache->flush();
    }
    struct rusage ru {};
    getrusage(RUSAGE_SELF, &ru);
    CHECK(ru.ru_maxrss < 2L * 1024 * 1024);  // KiB: < 2 GiB
  }
}

TEST_CASE("a user selector type plugs in: first block + recent blocks, different per KV head") {
  host_backend be;
  const G L(32, 4);
  partition_spec spec = sparse_spec(1, 3, 300);
  set_ping_pong_blocks(spec, L, 4);
  host_cache<G, fixed_ratio> cache(be, L, spec, fixed_ratio(0.3), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 51, gqa_scale);
  const std::vector<sequence_id> batch{d.add(0), d.add(90), d.add(200)};
  step_runner<decltype(cache)> r(d);
  sink_and_recent sel;
  for (int s = 0; s < 70; ++s) {
    CAPTURE(s);
    d.append_layer(0, batch);
    r.make_queries(batch);
    r.sparse(0, batch, sel);
    compare_result cr;
    for (std::size_t i = 0; i < batch.size(); ++i)
      check_restricted(L, d.history(batch[i], 0), cache.sequence(batch[i]), 16, d.attention().last_selection(), int(i),
                       r.d.q.data() + i * 32 * 128, gqa_scale, r.out.data() + i * 32 * 128, r.lse.data() + i * 32, cr);
    REQUIRE(cr.ok());
    const sequence_state& st = cache.sequence(batch[2]);
    const index_t n = index_t(st.block_table.size());
    CHECK(d.attention().last_selection().blocks(2, 0) ==
          std::vector<index_t>{0, std::max<index_t>(1, n - 2), n - 1});  // the duplicates were merged
    cache.flush();
  }
  CHECK(sel.calls > 0);
}

TEST_CASE("bad selections are typed errors before any work; the cache is unchanged and the next step works") {
  host_backend be;
  const G L(8, 2);
  partition_spec spec = sparse_spec(1, 2, 200);
  set_ping_pong_blocks(spec, L, 4);
  host_cache<G, fixed_ratio> cache(be, L, spec, fixed_ratio(0.5), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 61, gqa_scale);
  const std::vector<sequence_id> batch{d.add(70), d.add(100)};
  step_runner<decltype(cache)> r(d);
  d.append_layer(0, batch);
  r.make_queries(batch);
  const cache_snapshot before = snapshot(cache, batch);
  for (index_t off : {index_t{0}, index_t{5}, index_t{-1000}}) {
    CAPTURE(off);
    out_of_range bad{off};
    try {
      r.sparse(0, batch, bad);
      FAIL("no error");
    } catch (const shape_error& e) {
      const index_t n = index_t(cache.sequence(batch[0]).block_table.size());
      CHECK(mentions(e.what(), {"block selector", "block " + std::to_string(n + off), "sequence " + std::to_string(batch[0]),
                                "KV head 1", "[0, " + std::to_string(n) + ")"}));
    }
    CHECK(snapshot(cache, batch) == before);
  }
  throwing_selector thr;
  CHECK_THROWS_WITH(r.sparse(0, batch, thr), "selector failed");
  bad_head_selector bh;
  CHECK_THROWS_AS(r.sparse(0, batch, bh), shape_error);
  CHECK(snapshot(cache, batch) == before);
  CHECK_THROWS_AS(top_k_selector::ratio(1.5), config_error);
  CHECK_THROWS_AS(top_k_selector::blocks(-1), config_error);
  // The next step is right.
  top_k_selector sel = top_k_selector::ratio(0.5);
  r.sparse(0, batch, sel);
  compare_result cr;
  for (std::size_t i = 0; i < batch.size(); ++i)
    check_restricted(L, d.history(batch[i], 0), cache.sequence(batch[i]), 16, d.attention().last_selection(), int(i),
                     r.d.q.data() + i * 8 * 128, gqa_scale, r.out.data() + i * 8 * 128, r.lse.data() + i * 8, cr);
  CHECK(cr.ok());
}

TEST_CASE("more than 64 KV heads: a sparse step is a config_error") {
  host_backend be;
  const gqa_layout<64> L(65, 65);
  partition_spec spec = sparse_spec(1, 1, 64);
  set_ping_pong_blocks(spec, L, 4);
  host_cache<gqa_layout<64>, gpu_only> cache(be, L, spec, gpu_only{});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 71, 0.125);
  const std::vector<sequence_id> batch{d.add(40)};
  step_runner<decltype(cache)> r(d);
  d.append_layer(0, batch);
  r.make_queries(batch);
  select_all all;
  CHECK_THROWS_AS(r.sparse(0, batch, all), config_error);
}

TEST_CASE("K10: a sequence's sparse output is bit-identical alone and in a batch, and on a rerun") {
  sparse_batch_invariance<host_backend>(G(32, 4), 400, 230, 40);
}

namespace {
/// A policy that records what it observes.
struct observing_policy {
  using policy_concept = routing_policy_tag;
  fixed_ratio inner{0.5};
  std::shared_ptr<std::vector<cost_sample>> seen = std::make_shared<std::vector<cost_sample>>();
  route_decision route(const route_query& q) const { return inner.route(q); }
  void observe(const cost_sample& s) { seen->push_back(s); }
};
static_assert(routing_policy<observing_policy>);
}  // namespace

TEST_CASE("the policy observes the selected volumes: CPU tokens averaged over KV heads, streamed = union of pinned") {
  host_backend be;
  const G L(32, 4);
  partition_spec spec = sparse_spec(1, 3, 400);
  set_ping_pong_blocks(spec, L, 5);
  observing_policy pol;
  host_cache<G, observing_policy> cache(be, L, spec, pol, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 91, gqa_scale);
  const std::vector<sequence_id> batch{d.add(100), d.add(300), d.add(20)};
  step_runner<decltype(cache)> r(d);
  sink_and_recent sel;
  for (int s = 0; s < 40; ++s) {
    d.append_layer(0, batch);
    r.make_queries(batch);
    r.sparse(0, batch, sel);
    const step_selection& ss = d.attention().last_selection();
    index_t cpu_token_heads = 0, pinned_union = 0, union_all = 0, placed = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const sequence_state& st = cache.sequence(batch[i]);
      placed += index_t(st.block_table.size());
      for (std::size_t b = 0; b < st.block_table.size(); ++b) {
        const std::uint64_t m = ss.mask(int(i), index_t(b));
        if (m == 0) continue;
        ++union_all;
        if (st.block_table[b].region == placement::cpu_compute)
          cpu_token_heads += index_t(std::popcount(m)) * 16;
        else
          ++pinned_union;
      }
    }
    REQUIRE(!pol.seen->empty());
    const cost_sample& cs = pol.seen->back();
    CHECK(cs.cpu_tokens == cpu_token_heads / 4);
    CHECK(cs.gpu_streamed_tokens == pinned_union * 16);
    CHECK(r.rep.cpu_tokens == cpu_token_heads / 4);
    CHECK(r.rep.streamed_tokens == pinned_union * 16);
    CHECK(r.rep.selected_blocks == union_all);
    CHECK(r.rep.placed_blocks == placed);
    // host backend: every gathered chunk's bytes are reported
    const stream_plan& p = d.attention().last_plan();
    CHECK(r.rep.gathered_bytes + r.rep.pulled_bytes == p.gathered_blocks * cache.format().block_bytes());  // either mode
    cache.flush();
  }
}

TEST_CASE("summaries: computed once per placed block (prefill, eviction), recomputed for a reused sequence id") {
  host_backend be;
  const G L(8, 2);
  partition_spec spec = sparse_spec(2, 2, 300);
  set_ping_pong_blocks(spec, L, 4);
  host_cache<G, fixed_ratio> cache(be, L, spec, fixed_ratio(0.5), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 101, gqa_scale);
  std::vector<sequence_id> batch{d.add(64), d.add(100)};
  step_runner<decltype(cache)> r(d);
  top_k_selector sel = top_k_selector::ratio(0.5);
  auto check_layer = [&](int l) {
    for (std::size_t i = 0; i < batch.size(); ++i)
      CHECK(check_topk(cache, d.attention(), d.history(batch[i], l), batch[i], l, int(i),
                       r.d.q.data() + i * 8 * 128, gqa_scale, sel) == 0);
  };
  index_t prev_blocks = 0;
  for (int s = 0; s < 40; ++s) {
    CAPTURE(s);
    const index_t before = d.attention().summaries().summarized_blocks();
    for (int l = 0; l < 2; ++l) {
      d.append_layer(l, batch);
      r.make_queries(batch);
      r.sparse(l, batch, sel);
      check_layer(l);
    }
    index_t blocks = 0;
    for (sequence_id id : batch) blocks += index_t(cache.sequence(id).block_table.size());
    // Each block placed since the last step (by prefill, then by the last flush), once per layer.
    CHECK(d.attention().summaries().summarized_blocks() - before == 2 * (blocks - prev_blocks));
    prev_blocks = blocks;
    cache.flush();
  }
  // A reused sequence id with new content: its summaries are recomputed.
  const sequence_id old = batch[0];
  d.remove(old);
  const sequence_id again = d.add(96);
  REQUIRE(again == old);
  for (int l = 0; l < 2; ++l) {
    d.append_layer(l, batch);
    r.make_queries(batch);
    r.sparse(l, batch, sel);
    check_layer(l);
  }
}

TEST_CASE("stream_plan::build_sparse: all-ones masks give the dense plan; lists, order, chunking, gather flags") {
  constexpr index_t be = 8;  // fake block elements
  std::vector<bf16> arena(std::size_t(200) * be);
  auto ptr = [&](block_id id) { return pinned_span<const bf16>(arena.data() + index_t(id) * be, be); };
  std::mt19937 rng(5);
  std::vector<std::vector<block_id>> ids(5);
  block_id next = 0;
  for (auto& v : ids)
    for (int k = 0, n = int(rng() % 23); k < n; ++k) v.push_back(rng() % 4 == 0 ? block_id(150 + rng() % 50) : next++);
  for (int hkv : {1, 3})
  for (index_t ramp : {0, 3}) {  // without and with the chunk ramp (partition_spec::first_chunk_bytes)
    CAPTURE(ramp);
    const std::uint64_t all = (std::uint64_t{1} << hkv) - 1;
    std::vector<std::vector<sparse_block>> full(ids.size()), part(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i)
      for (block_id id : ids[i]) {
        full[i].push_back({id, all});
        const std::uint64_t m = rng() & all;
        if (m != 0) part[i].push_back({id, m});
      }
    stream_plan dense, sp;
    dense.build(
        int(ids.size()), [&](int i) { return std::span<const block_id>(ids[std::size_t(i)]); }, ptr, be, 7, 3, 2, ramp);
    sp.build_sparse(
        int(ids.size()), [&](int i) { return std::span<const sparse_block>(full[std::size_t(i)]); }, ptr, be, 7, 3, 2,
        hkv, 1000, ramp);
    REQUIRE(sp.sparse);
    REQUIRE(sp.chunks.size() == dense.chunks.size());
    REQUIRE(sp.runs.size() == dense.runs.size());
    REQUIRE(sp.splits.size() == dense.splits.size());
    for (std::size_t k = 0; k < sp.runs.size(); ++k) {
      CHECK(sp.runs[k].src.data() == dense.runs[k].src.data());
      CHECK(sp.runs[k].dst_block == dense.runs[k].dst_block);
      CHECK(sp.runs[k].num_blocks == dense.runs[k].num_blocks);
    }
    for (std::size_t k = 0; k < sp.splits.size(); ++k) {
      CHECK(sp.splits[k].batch_index == dense.splits[k].batch_index);
      CHECK(sp.splits[k].first_block == dense.splits[k].first_block);
      CHECK(sp.splits[k].num_blocks == dense.splits[k].num_blocks);
    }
    for (std::size_t c = 0; c < sp.chunks.size(); ++c) {
      CHECK(sp.chunks[c].buffer == dense.chunks[c].buffer);
      CHECK(sp.chunks[c].num_blocks == dense.chunks[c].num_blocks);
      CHECK(sp.chunks[c].gathered);  // runs shorter than 1000 blocks
    }
    // Partial masks: every selected block once, in order; each head's list is its mask.
    for (index_t direct : {index_t{0}, index_t{2}, index_t{1000}}) {
      sp.build_sparse(
          int(ids.size()), [&](int i) { return std::span<const sparse_block>(part[std::size_t(i)]); }, ptr, be, 7, 3, 2,
          hkv, direct, ramp);
      std::vector<std::vector<std::pair<const bf16*, std::uint64_t>>> seen(ids.size());
      for (const stream_chunk& c : sp.chunks) {
        std::vector<const bf16*> buf(std::size_t(c.num_blocks), nullptr);
        index_t shortest = 1 << 30;
        for (index_t r = c.run_begin; r < c.run_end; ++r) {
          const stream_run& run = sp.runs[std::size_t(r)];
          shortest = std::min(shortest, run.num_blocks);
          for (index_t k = 0; k < run.num_blocks; ++k) buf[std::size_t(run.dst_block + k)] = run.src.data() + k * be;
        }
        CHECK(c.gathered == (shortest < direct));
        CHECK(c.list_end - c.list_begin <= 2 * hkv * 7);
        for (index_t s = c.split_begin; s < c.split_end; ++s) {
          const stream_split& spl = sp.splits[std::size_t(s)];
          std::vector<std::uint64_t> masks(std::size_t(spl.num_blocks), 0);
          for (int h = 0; h < hkv; ++h) {
            const std::int32_t* lst =
                sp.block_lists.data() + c.list_begin + spl.list_offset + index_t(h) * (spl.num_blocks + 1);
            REQUIRE(lst[0] >= 0);
            REQUIRE(lst[0] <= spl.num_blocks);
            for (int j = 0; j < lst[0]; ++j) {
              REQUIRE(lst[1 + j] >= 0);
              REQUIRE(lst[1 + j] < spl.num_blocks);
              if (j > 0) CHECK(lst[1 + j] > lst[j]);
              masks[std::size_t(lst[1 + j])] |= std::uint64_t{1} << h;
            }
          }
          for (int k = 0; k < spl.num_blocks; ++k)
            seen[std::size_t(spl.batch_index)].push_back({buf[std::size_t(spl.first_block + k)], masks[std::size_t(k)]});
        }
      }
      for (std::size_t i = 0; i < ids.size(); ++i) {
        REQUIRE(seen[i].size() == part[i].size());
        for (std::size_t k = 0; k < part[i].size(); ++k) {
          CHECK(seen[i][k].first == ptr(part[i][k].id).data());
          CHECK(seen[i][k].second == part[i][k].kv_head_mask);
        }
      }
    }
  }
}
