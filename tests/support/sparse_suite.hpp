// SPDX-License-Identifier: Apache-2.0
// tests/support/sparse_suite.hpp — the block-level sparse selection tests
// (docs/SPARSE.md) written once, templated on the backend: tests/test_sparse.cpp
// instantiates them on host_backend, tests/cuda/test_cuda_sparse.cpp on
// cuda_backend (backend_traits, support/harness.hpp; the device one in
// tests/cuda/device_harness.hpp). Each body takes a case struct whose defaults
// are the library's (attention_options, sparse_options); a test file sets what
// its backend runs (sizes, threads, transfer mode). Every check is made on
// both backends, except where a body says otherwise and why.
#pragma once

#include <sys/resource.h>

#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "support/sparse_checks.hpp"

namespace wstest {

/// Worst error of a step_runner's last sparse step against the fp64 reference
/// restricted to the selection (per KV head) plus the D-window, every batch row.
template <class Cache>
compare_result check_last_selection(const step_runner<Cache>& r, int l, std::span<const sequence_id> batch) {
  using Layout = typename Cache::layout_type;
  auto& d = r.d;  // a reference member: the driver itself, not const
  const Layout& L = d.cache().layout();
  const int hq = L.num_q_heads();
  compare_result cr;
  for (std::size_t i = 0; i < batch.size(); ++i)
    check_restricted(L, d.history(batch[i], l), d.cache().sequence(batch[i]), d.cache().spec().block_tokens,
                     d.attention().last_selection(), int(i), d.q.data() + i * std::size_t(hq) * Layout::q_dim, d.scale(),
                     r.out.data() + i * std::size_t(hq) * Layout::v_dim, r.lse.data() + i * std::size_t(hq), cr);
  return cr;
}

/// The attention options of a sparse case.
struct sparse_case_options {
  int cpu_threads = 1;
  bool reserve = false;
  int gather_threads = sparse_options{}.gather_threads;
  sparse_transfer transfer = sparse_options{}.transfer;
  index_t direct_run_bytes = sparse_options{}.direct_run_bytes;

  attention_options attention() const {
    attention_options ao{cpu_threads, true};
    ao.sparse.reserve = reserve;
    ao.sparse.gather_threads = gather_threads;
    ao.sparse.transfer = transfer;
    ao.sparse.direct_run_bytes = direct_run_bytes;
    return ao;
  }
  bool pull() const { return transfer == sparse_transfer::device_pull; }
};

/// A decode loop of a sparse case: `prompts`, `steps` steps of two layers, room
/// for the longest prompt + `room` tokens per sequence.
struct sparse_loop_case {
  sparse_case_options opts;
  std::vector<index_t> prompts;
  index_t room = 100;  ///< tokens per sequence in each region: room + steps (+64)
  int steps = 0;
  std::uint64_t seed = 0;
  int check_every = 8;  ///< select_all: the fp64 comparison every this many steps
  /// Whether the policy streams some blocks (checked unless it is cpu_only or
  /// under WS_TEST_QUICK); false where a measuring policy may route all to the CPU.
  bool streams = true;
};

/// The setup of a sparse_loop_case on Backend: the spec of two layers with
/// room for the case's sequences and a ping-pong of `ping_pong_blocks` blocks,
/// the test_rig over it (seeded by the case), and the case's prompts.
template <class Backend, class Layout, class Policy>
struct sparse_rig {
  partition_spec spec;
  test_rig<Backend, Layout, Policy> rig;
  const sparse_loop_case& c;
  sparse_rig(const Layout& L, const sparse_loop_case& sc, index_t ping_pong_blocks, Policy pol, attention_options ao,
             double scale)
      : spec(spec_of(L, sc, ping_pong_blocks)), rig(L, spec, std::move(pol), ao, sc.seed, scale), c(sc) {}
  /// Begins one sequence per prompt of the case; their ids in order.
  std::vector<sequence_id> add_prompts() {
    std::vector<sequence_id> batch;
    for (index_t p : c.prompts) batch.push_back(rig.d.add(p));
    return batch;
  }

 private:
  static partition_spec spec_of(const Layout& L, const sparse_loop_case& sc, index_t ping_pong_blocks) {
    partition_spec s = sparse_spec(2, int(sc.prompts.size()), sc.room + sc.steps);
    set_ping_pong_blocks(s, L, ping_pong_blocks);
    return s;
  }
};

/// select_all against dense, step by step, every layer, with evictions, the
/// ping-pong buffers NaN-poisoned before each sparse step (it must move every
/// block itself): outputs, LSEs and every engine's partial bit-identical; the
/// report's volumes equal; every check_every-th step against the fp64
/// reference; the chunks went the way direct_run_bytes and the transfer mode say.
template <class Backend, class Layout, class Policy>
void select_all_matches_dense(const Layout& L, Policy pol, double scale, const sparse_loop_case& c) {
  using traits = backend_traits<Backend>;
  sparse_rig<Backend, Layout, Policy> t(L, c, 6, std::move(pol), c.opts.attention(), scale);
  auto& cache = t.rig.cache;
  using cache_type = typename test_rig<Backend, Layout, Policy>::cache_type;
  auto& d = t.rig.d;
  const partition_spec& spec = t.spec;
  if (c.opts.pull()) CHECK(d.attention().engine().sparse_staging_bytes() == 0);
  const std::vector<sequence_id> batch = t.add_prompts();
  step_runner<cache_type> r(d);
  select_all all;
  index_t gathered = 0, direct = 0, pulled = 0;
  for (int s = 0; s < c.steps; ++s)
    for (int l = 0; l < spec.num_layers; ++l) {
      CAPTURE(s);
      CAPTURE(l);
      d.append_layer(l, batch);
      r.make_queries(batch);
      debug_partials dd, ds;
      r.dense(l, batch, &dd);
      const std::vector<float> out = r.out, lse = r.lse;
      const step_report dense_rep = r.rep;
      r.poison_ping_pong();  // the sparse step must move every block itself
      r.sparse(l, batch, all, &ds);
      REQUIRE(same_bits(out, r.out));
      REQUIRE(same_bits(lse, r.lse));
      REQUIRE(same_bits(dd.cpu_o, ds.cpu_o));
      REQUIRE(same_bits(dd.cpu_lse, ds.cpu_lse));
      REQUIRE(same_bits(dd.streamed_o, ds.streamed_o));
      REQUIRE(same_bits(dd.streamed_lse, ds.streamed_lse));
      CHECK(r.rep.cpu_tokens == dense_rep.cpu_tokens);
      CHECK(r.rep.streamed_tokens == dense_rep.streamed_tokens);
      CHECK(r.rep.chunks == dense_rep.chunks);
      CHECK(r.rep.cpu_tasks == dense_rep.cpu_tasks);
      CHECK(r.rep.selected_blocks == r.rep.placed_blocks);
      // The copy count: compared on the host backend only, as before. The
      // device test never compared it; whether cuda_backend's sparse chunks
      // count copies as its dense ones do is not established by a GPU run.
      if constexpr (!traits::device) CHECK(r.rep.copies == dense_rep.copies);
      gathered += d.attention().engine().last_gather().gathered_chunks;
      direct += d.attention().engine().last_gather().direct_chunks;
      pulled += d.attention().engine().last_gather().pulled_chunks;
      if (s % c.check_every == 0) {  // and the output is right (dense is checked elsewhere; spot-check here)
        compare_result cr;
        std::vector<double> ro, rl;
        const int hq = L.num_q_heads();
        for (std::size_t i = 0; i < batch.size(); ++i) {
          reference_attention(L, d.history(batch[i], l), d.q.data() + i * std::size_t(hq) * Layout::q_dim, scale, ro, rl);
          compare_rows(hq, Layout::v_dim, r.out.data() + i * std::size_t(hq) * Layout::v_dim,
                       r.lse.data() + i * std::size_t(hq), ro, rl, cr);
        }
        INFO("rel_l2 " << cr.max_rel_l2 << ", lse excess " << cr.max_lse_err);
        REQUIRE(cr.ok());
      }
      if (l + 1 == spec.num_layers) cache.flush();
    }
  // Under compute-sanitizer (WS_TEST_QUICK) the GPU is ~100x slower, the
  // roofline policy measures that and may route every block to the CPU: the
  // streamed-chunk count is asserted in normal runs only.
  if (c.streams && !std::is_same_v<Policy, cpu_only> && !quick()) CHECK(gathered + pulled + direct > 0);
  CHECK((c.opts.direct_run_bytes == 0 ? gathered + pulled : direct) == 0);  // runs here are far below 2 MiB
  CHECK((c.opts.pull() ? gathered : pulled) == 0);                             // gathered chunks went the configured way
}

/// Top-k decode loop checked against the restricted reference, the test's own
/// summaries and its own top-k, every step and layer; the library's selection
/// is what the (recorded) selector answered; the report's gathered / pulled
/// bytes are the plan's gathered blocks in the configured mode.
template <class Backend, class Layout, class Policy>
void topk_loop(const Layout& L, Policy pol, double scale, top_k_selector sel, const sparse_loop_case& c) {
  sparse_rig<Backend, Layout, Policy> t(L, c, 5, std::move(pol), c.opts.attention(), scale);
  auto& cache = t.rig.cache;
  using cache_type = typename test_rig<Backend, Layout, Policy>::cache_type;
  auto& d = t.rig.d;
  const partition_spec& spec = t.spec;
  const std::vector<sequence_id> batch = t.add_prompts();
  step_runner<cache_type> r(d);
  recording<top_k_selector> rec{sel, {}};
  const int hq = L.num_q_heads();
  index_t selected = 0, placed = 0, moved_bytes = 0;
  for (int s = 0; s < c.steps; ++s)
    for (int l = 0; l < spec.num_layers; ++l) {
      CAPTURE(s);
      CAPTURE(l);
      d.append_layer(l, batch);
      r.make_queries(batch);
      r.poison_ping_pong();  // whatever the step does not move reads as NaN
      rec.log.clear();
      r.sparse(l, batch, rec);
      const compare_result cr = check_last_selection(r, l, batch);
      INFO("rel_l2 " << cr.max_rel_l2 << ", lse excess " << cr.max_lse_err << ", non-finite " << cr.non_finite);
      REQUIRE(cr.ok());
      int problems = 0;
      for (std::size_t i = 0; i < batch.size(); ++i)
        problems += check_topk(cache, d.attention(), d.history(batch[i], l), batch[i], l, int(i),
                               d.q.data() + i * std::size_t(hq) * Layout::q_dim, scale, sel);
      REQUIRE(problems == 0);
      // The library's selection is what the (recorded) selector answered.
      std::size_t call = 0;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        if (cache.sequence(batch[i]).block_table.empty()) continue;
        REQUIRE(call < rec.log.size());
        for (int h = 0; h < L.kv_heads(); ++h)
          CHECK(rec.log[call][std::size_t(h)] == d.attention().last_selection().blocks(int(i), h));
        ++call;
      }
      CHECK(call == rec.log.size());
      selected += r.rep.selected_blocks;
      placed += r.rep.placed_blocks;
      moved_bytes += r.rep.gathered_bytes + r.rep.pulled_bytes;
      const index_t staged = d.attention().last_plan().gathered_blocks * cache.format().block_bytes();
      CHECK(r.rep.gathered_bytes == (c.opts.pull() ? 0 : staged));
      CHECK(r.rep.pulled_bytes == (c.opts.pull() ? staged : 0));
      if (l + 1 == spec.num_layers) cache.flush();
    }
  CHECK(selected < placed);  // it was sparse
  if (c.streams && !std::is_same_v<Policy, cpu_only> && !quick()) CHECK(moved_bytes > 0);  // see select_all_matches_dense
}

/// K1: a selection that leaves an engine (or a KV head) without blocks gives
/// exactly the empty partial (0, -inf), and the rest stays right: three
/// sequences (128, 163, 31 tokens) under fixed_ratio 0.5, three steps.
template <class Backend>
void empty_engine_partials(const gqa_layout<128>& L, int cpu_threads, double scale) {
  using G = gqa_layout<128>;
  partition_spec spec = sparse_spec(1, 3, 300);
  set_ping_pong_blocks(spec, L, 4);
  test_rig<Backend, G, fixed_ratio> t(L, spec, fixed_ratio(0.5), attention_options{cpu_threads, true}, 21, scale);
  auto& cache = t.cache;
  auto& d = t.d;
  using cache_type = typename test_rig<Backend, G, fixed_ratio>::cache_type;
  const std::vector<sequence_id> batch{d.add(128), d.add(32 * 5 + 3), d.add(31)};
  step_runner<cache_type> r(d);
  const int hq = L.num_q_heads();
  const int rows = 3 * hq;
  const int bt = spec.block_tokens;
  for (int s = 0; s < 3; ++s) {
    d.append_layer(0, batch);
    r.make_queries(batch);
    auto check_all = [&](const char* what) {
      CAPTURE(what);
      const compare_result cr = check_last_selection(r, 0, batch);
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
      CHECK(empty_rows(dbg.streamed_o, dbg.streamed_lse, 0, rows));  // (0, -inf) exactly, every row
    }
    {
      only_region pinned_blocks{placement::gpu_load};
      debug_partials dbg;
      r.sparse(0, batch, pinned_blocks, &dbg);
      check_all("pinned blocks only");
      CHECK(r.rep.cpu_tokens == 0);
      CHECK(r.rep.cpu_tasks == 0);
      CHECK(empty_rows(dbg.cpu_o, dbg.cpu_lse, 0, rows));
    }
    {
      select_none none;
      debug_partials dbg;
      r.sparse(0, batch, none, &dbg);
      check_all("no block: D-window only");
      CHECK(empty_rows(dbg.cpu_o, dbg.cpu_lse, 0, rows));
      CHECK(empty_rows(dbg.streamed_o, dbg.streamed_lse, 0, rows));
      CHECK(r.rep.selected_blocks == 0);
    }
    {
      skip_head0 skip;
      debug_partials dbg;
      r.sparse(0, batch, skip, &dbg);
      check_all("KV head 0 attends no block");
      for (std::size_t i = 0; i < batch.size(); ++i) {  // the query heads of KV head 0, every sequence
        CHECK(empty_rows(dbg.cpu_o, dbg.cpu_lse, i * std::size_t(hq), L.group_size()));
        CHECK(empty_rows(dbg.streamed_o, dbg.streamed_lse, i * std::size_t(hq), L.group_size()));
      }
      // cpu_tokens are averaged over the KV heads: Hkv - 1 of Hkv heads attend the CPU blocks.
      index_t cpu_blocks = 0;
      for (sequence_id q : batch) cpu_blocks += index_t(cache.sequence(q).cpu_blocks.size());
      CHECK(r.rep.cpu_tokens == cpu_blocks * bt * (L.kv_heads() - 1) / L.kv_heads());
    }
    cache.flush();
  }
}

/// K4/C7: top-k selections of blocks past 2^32 bytes in each region of
/// `regions` (5 GiB of it, backend_traits::large_allocator; GQA 4/1, 512 bytes
/// per token): two never-written 2 GiB filler sequences push the real ones past
/// 2 and 4 GiB; each step against the restricted reference and the test's own
/// top-k, every selected block of the last sequence past 4 GiB. With
/// `max_rss_kib`, the process's peak resident set stays below it (the fillers
/// were never touched). A region the machine refuses is skipped with a warning.
template <class Backend>
void selections_past_4gib(const std::vector<placement>& regions, int cpu_threads, double scale,
                          std::optional<long> max_rss_kib) {
  using G = gqa_layout<128>;
  using traits = backend_traits<Backend>;
  using cache_type = typename traits::template cache<G, scripted_policy, typename traits::large_allocator>;
  const G lay(4, 1);  // 512 bytes per token
  const index_t gib_tokens = (index_t{1} << 30) / 512;
  for (placement where : regions) {
    const std::string region = to_string(where);
    CAPTURE(region);
    const partition_spec s = past_4gib_spec(lay, where);
    scripted_policy pol;
    pol.fn = [where](const route_query&) { return where; };
    Backend be;
    std::optional<cache_type> cache;
    try {
      cache.emplace(be, lay, s, pol, typename traits::large_allocator{}, cache_options{false});
    } catch (const resource_error& e) {
      WARN_MESSAGE(false, "skipped: this machine refuses a 5 GiB region: " << std::string(e.what()));
      continue;
    }
    typename traits::template driver<cache_type> d(*cache, attention_options{cpu_threads, true}, 41, scale);
    (void)cache->begin_sequence(2 * gib_tokens);  // never written
    const sequence_id a = d.add(2 * 256 + 10);    // at 2 GiB
    (void)cache->begin_sequence(2 * gib_tokens);  // to 4 GiB + a
    const sequence_id b = d.add(6 * 256 + 5);     // past 4 GiB
    const std::vector<sequence_id> batch{a, b};
    const layer_views<G> v = cache->views(0);
    const bf16* base = where == placement::cpu_compute ? v.cpu_block(0) : v.pinned_block(0);
    step_runner<cache_type> r(d);
    top_k_selector sel = top_k_selector::ratio(0.4);
    for (int st = 0; st < 3; ++st) {
      d.append_layer(0, batch);
      r.make_queries(batch);
      r.sparse(0, batch, sel);
      const compare_result cr = check_last_selection(r, 0, batch);
      int problems = 0;
      for (std::size_t i = 0; i < batch.size(); ++i)
        problems += check_topk(*cache, d.attention(), d.history(batch[i], 0), batch[i], 0, int(i),
                               d.q.data() + i * 4 * 128, scale, sel);
      REQUIRE(cr.ok());
      REQUIRE(problems == 0);
      // Every block of b selected lies past 4 GiB.
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
    if (max_rss_kib) {
      struct rusage ru {};
      getrusage(RUSAGE_SELF, &ru);
      CHECK(ru.ru_maxrss < *max_rss_kib);
    }
  }
}

/// The same selections through two attention objects on one cache: the
/// driver's (sparse_transfer::host_gather) and one with device_pull
/// (`pull_ctas` CTAs; the host backend emulates it: runs copied straight into
/// ping-pong, no staging), the ping-pong buffers NaN-poisoned before each step
/// so a block one mode failed to move cannot be read as left there by the
/// other. Outputs and LSEs bit-identical, step by step; the gather statistics
/// and reports say which way the gathered chunks went and that nothing was
/// staged in pull mode; every 8th step against the restricted reference.
template <class Backend, class Layout, class Policy, class Selector>
void pull_matches_gather(const Layout& L, Policy pol, double scale, const Selector& selector, const sparse_loop_case& c,
                         int pull_ctas) {
  sparse_case_options go = c.opts;
  go.reserve = true;
  go.transfer = sparse_transfer::host_gather;  // not the default
  const attention_options ao = go.attention();
  sparse_rig<Backend, Layout, Policy> t(L, c, 6, std::move(pol), ao, scale);
  auto& cache = t.rig.cache;
  using cache_type = typename test_rig<Backend, Layout, Policy>::cache_type;
  auto& d = t.rig.d;
  const partition_spec& spec = t.spec;
  attention_options po = ao;
  po.sparse.transfer = sparse_transfer::device_pull;
  po.sparse.pull_ctas = pull_ctas;
  hybrid_attention<cache_type> pull(cache, po);
  CHECK(pull.engine().sparse_staging_bytes() == 0);  // no staging in pull mode
  CHECK(d.attention().engine().sparse_staging_bytes() > 0);
  const std::vector<sequence_id> batch = t.add_prompts();
  step_runner<cache_type> r(d);
  const index_t block_bytes = cache.format().block_bytes();
  index_t pulled = 0;
  for (int s = 0; s < c.steps; ++s)
    for (int l = 0; l < spec.num_layers; ++l) {
      CAPTURE(s);
      CAPTURE(l);
      d.append_layer(l, batch);
      r.make_queries(batch);
      Selector sel_gather = selector, sel_pull = selector;
      r.poison_ping_pong();
      r.sparse(l, batch, sel_gather);
      const std::vector<float> out = r.out, lse = r.lse;
      const step_report gr = r.rep;
      const gather_stats gg = d.attention().engine().last_gather();
      const index_t staged_gather = d.attention().last_plan().gathered_blocks * block_bytes;
      if (s % 8 == 0) CHECK(check_last_selection(r, l, batch).ok());
      r.poison_ping_pong();
      r.sparse_with(pull, l, batch, sel_pull);
      REQUIRE(same_bits(out, r.out));
      REQUIRE(same_bits(lse, r.lse));
      const step_report& pr = r.rep;
      const gather_stats pg = pull.engine().last_gather();
      const index_t staged = pull.last_plan().gathered_blocks * block_bytes;
      CHECK(staged == staged_gather);
      CHECK(gg.pulled_chunks == 0);
      CHECK(gg.bytes == staged);
      CHECK(gr.pulled_bytes == 0);
      CHECK(gr.gathered_bytes == staged);
      CHECK(pg.gathered_chunks == 0);
      CHECK(pg.bytes == 0);
      CHECK(pr.gathered_bytes == 0);
      CHECK(pr.gather_seconds == 0.0);
      CHECK(pg.pulled_chunks == gg.gathered_chunks);
      CHECK(pg.direct_chunks == gg.direct_chunks);
      CHECK(pg.pulled_bytes == gg.bytes);
      CHECK(pg.pulled_bytes == staged);
      CHECK(pr.pulled_bytes == staged);
      pulled += pg.pulled_chunks;
      if (l + 1 == spec.num_layers) cache.flush();
    }
  CHECK(pull.engine().sparse_staging_bytes() == 0);
  if (c.streams && !std::is_same_v<Policy, cpu_only> && !quick()) CHECK(pulled > 0);
}

}  // namespace wstest
