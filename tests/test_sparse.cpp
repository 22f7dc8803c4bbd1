// SPDX-License-Identifier: Apache-2.0
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
// host gather. The cases that tests/cuda/test_cuda_sparse.cpp runs on the
// device too are written once, in support/sparse_suite.hpp (select_all vs
// dense, top-k, K1, K4/C7, pull vs gather; K10 in support/sparse_checks.hpp).
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <map>
#include <optional>
#include <random>
#include <set>

#include "support/sparse_suite.hpp"

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

/// The host runs of the shared bodies (support/sparse_suite.hpp): one CPU
/// thread, the library's sparse options (device_pull, emulated here).
sparse_loop_case host_case(std::vector<index_t> prompts, index_t room, int steps, std::uint64_t seed,
                           index_t direct_run_bytes = sparse_options{}.direct_run_bytes) {
  sparse_loop_case c;
  c.opts.direct_run_bytes = direct_run_bytes;
  c.prompts = std::move(prompts);
  c.room = room;
  c.steps = steps;
  c.seed = seed;
  c.check_every = 8;
  return c;
}

const std::vector<index_t> ragged{1, 15, 33, 70, 100};

}  // namespace

TEST_CASE("select_all is bit-identical to the dense step: GQA 32/4, every policy, gathered and direct chunks") {
  const G L(32, 4);
  const index_t modes[2] = {index_t{2} << 20, 0};  // gathered (runs < 2 MiB), direct
  SUBCASE("gpu_only") {
    for (index_t m : modes) select_all_matches_dense<host_backend>(L, gpu_only{}, gqa_scale, host_case(ragged, 100, 24, 1, m));
  }
  SUBCASE("cpu_only") {
    for (index_t m : modes) select_all_matches_dense<host_backend>(L, cpu_only{}, gqa_scale, host_case(ragged, 100, 24, 2, m));
  }
  SUBCASE("fixed_ratio 0.4") {
    for (index_t m : modes) select_all_matches_dense<host_backend>(L, fixed_ratio(0.4), gqa_scale, host_case(ragged, 100, 24, 3, m));
  }
  SUBCASE("roofline") {
    for (index_t m : modes) select_all_matches_dense<host_backend>(L, test_roofline(), gqa_scale, host_case(ragged, 100, 24, 4, m));
  }
}

TEST_CASE("select_all is bit-identical to the dense step: MLA DeepSeek-V2-Lite, every policy") {
  const M L = presets::deepseek_v2_lite::layout();
  const double scale = presets::deepseek_v2_lite::softmax_scale();
  SUBCASE("gpu_only") { select_all_matches_dense<host_backend>(L, gpu_only{}, scale, host_case(ragged, 100, 12, 5)); }
  SUBCASE("cpu_only") { select_all_matches_dense<host_backend>(L, cpu_only{}, scale, host_case(ragged, 100, 12, 6)); }
  SUBCASE("fixed_ratio 0.4, direct") {
    select_all_matches_dense<host_backend>(L, fixed_ratio(0.4), scale, host_case(ragged, 100, 12, 7, 0));
  }
  SUBCASE("roofline") {
    sparse_loop_case c = host_case(ragged, 100, 12, 8);
    c.streams = false;  // the roofline routes these short MLA sequences to the CPU on the host backend
    select_all_matches_dense<host_backend>(L, test_roofline(), scale, c);
  }
}

TEST_CASE("sparse_transfer::device_pull on the host backend: accepted, emulated, bit-identical to host_gather") {
  // pull_ctas = 7: meaningless on the host backend, accepted.
  SUBCASE("GQA 32/4, top-k 0.5, gpu_only") {
    pull_matches_gather<host_backend>(G(32, 4), gpu_only{}, gqa_scale, top_k_selector::ratio(0.5),
                                      host_case(ragged, 100, 16, 31), 7);
  }
  SUBCASE("GQA 32/4, select_all, fixed_ratio 0.4") {
    pull_matches_gather<host_backend>(G(32, 4), fixed_ratio(0.4), gqa_scale, select_all{}, host_case(ragged, 100, 12, 32),
                                      7);
  }
  SUBCASE("MLA DeepSeek-V2-Lite, top-k 0.3, fixed_ratio 0.5") {
    pull_matches_gather<host_backend>(presets::deepseek_v2_lite::layout(), fixed_ratio(0.5),
                                      presets::deepseek_v2_lite::softmax_scale(), top_k_selector::ratio(0.3),
                                      host_case(ragged, 100, 10, 33), 7);
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

TEST_CASE("top-k equals the fp64 reference restricted to the selected blocks + D-window, and is the test's own top-k") {
  SUBCASE("GQA 32/4, keep ratio 0.5, fixed_ratio 0.5") {
    topk_loop<host_backend>(G(32, 4), fixed_ratio(0.5), gqa_scale, top_k_selector::ratio(0.5),
                            host_case({40, 97, 200}, 200, 40, 11));
  }
  SUBCASE("GQA 32/8 (Mixtral), keep 2 blocks, roofline") {
    topk_loop<host_backend>(G(32, 8), test_roofline(), gqa_scale, top_k_selector::blocks(2),
                            host_case({17, 64, 150}, 200, 35, 12));
  }
  SUBCASE("GQA 8/2, keep ratio 0.2, gpu_only; cpu_only") {
    topk_loop<host_backend>(G(8, 2), gpu_only{}, gqa_scale, top_k_selector::ratio(0.2), host_case({130, 33}, 200, 35, 13));
    topk_loop<host_backend>(G(8, 2), cpu_only{}, gqa_scale, top_k_selector::ratio(0.2), host_case({130, 33}, 200, 35, 14));
  }
  SUBCASE("MLA DeepSeek-V2-Lite, keep ratio 0.3, fixed_ratio 0.5") {
    topk_loop<host_backend>(presets::deepseek_v2_lite::layout(), fixed_ratio(0.5), presets::deepseek_v2_lite::softmax_scale(),
                            top_k_selector::ratio(0.3), host_case({50, 140}, 200, 34, 15));
  }
}

TEST_CASE("K1: a selection that leaves an engine (or a KV head) without blocks gives exactly the empty partial") {
  empty_engine_partials<host_backend>(G(16, 4), 1, gqa_scale);
}

TEST_CASE("K4/C7: selections of blocks past 2^32 bytes in the unpinned and pinned regions (MAP_NORESERVE, small RSS)") {
  selections_past_4gib<host_backend>({placement::cpu_compute, placement::gpu_load}, 1, gqa_scale,
                                     2L * 1024 * 1024);  // KiB: < 2 GiB
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
