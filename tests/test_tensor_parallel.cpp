// SPDX-License-Identifier: Apache-2.0
// Several GPUs of one host (writescope/tensor_parallel.hpp, docs/MULTI-GPU.md)
// on host_backend, one emulated device per rank: N = 1, 2, 4 ranks of
// tensor_parallel_gqa (KV heads split) and tensor_parallel_mla (tokens split by
// eviction batch), ragged batches, decode steps with evictions. Every step's
// outputs and LSEs are compared with the fp64 reference and with one cache of
// the full layout fed the same tokens; for GQA each rank's placement of every
// sequence equals the single cache's (same policy, same split within each
// head group). Plus the refusals and error propagation.
#include <doctest/doctest.h>

#include <writescope/tensor_parallel.hpp>

#include <atomic>
#include <thread>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<64>;
using M = mla_layout<512, 64>;

template <class Layout>
using tp_gqa = tensor_parallel_gqa<Layout, host_backend, pageable_allocator, fixed_ratio>;
template <class Layout>
using tp_mla = tensor_parallel_mla<Layout, host_backend, pageable_allocator, fixed_ratio>;

struct backends {
  std::vector<std::unique_ptr<host_backend>> owned;
  std::vector<host_backend*> ptrs;
  explicit backends(int n) {
    for (int r = 0; r < n; ++r) {
      owned.push_back(std::make_unique<host_backend>());
      ptrs.push_back(owned.back().get());
    }
  }
  std::span<host_backend* const> span() const { return ptrs; }
};

// Worst |a - b| over two equally long vectors (inf - inf counts as 0).
double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    m = std::max(m, double(std::abs(a[i] - b[i])));
  }
  return m;
}

struct run_stats {
  int steps = 0;
  int evictions = 0;
  int placement_mismatches = 0;
  bool bit_identical = true;
  double max_diff_out = 0.0, max_diff_lse = 0.0;
  compare_result ref;
};

// Drives `tp` (a tensor_parallel_gqa or _mla) and one cache of the full
// layout with the same tokens and queries; compares every layer of every step.
struct no_step_hook {
  template <class... A>
  void operator()(A&&...) const {}
};

template <class TP, class Layout, class StepHook = no_step_hook>
run_stats drive(TP& tp, const Layout& L, const partition_spec& spec, const std::vector<index_t>& prompts, int steps,
                double scale, bool check_placement, StepHook&& after_step = {}) {
  host_backend be;
  host_cache<Layout, fixed_ratio> single(be, L, spec, fixed_ratio(0.5), {}, cache_options{true});
  attention_options ao;
  ao.cpu_threads = 2;
  hybrid_attention<host_cache<Layout, fixed_ratio>> attn(single, ao);
  bf16_source src(1234);
  kv_generator<Layout> gen;
  const int layers = spec.num_layers, hq = L.num_q_heads();
  constexpr int Q = Layout::q_dim, V = Layout::v_dim;
  std::vector<sequence_id> seqs;
  std::vector<std::vector<kv_history<Layout>>> hist;
  for (index_t p : prompts) {
    const sequence_id a = tp.begin_sequence(p), b = single.begin_sequence(p);
    REQUIRE(a == b);
    seqs.push_back(a);
    hist.emplace_back(std::size_t(layers));
    for (int l = 0; l < layers && p > 0; ++l) {
      auto kv = gen.make(L, p, src);
      tp.append_prefill(l, a, kv.view());
      single.append_prefill(l, b, kv.view());
      record(hist.back()[std::size_t(l)], L, kv, 0, p);
    }
  }
  run_stats s;
  std::vector<float> q, o1, l1, o2, l2;
  for (int step = 0; step < steps; ++step) {
    // ragged batches: every sequence on even steps, the odd-indexed ones on odd steps
    std::vector<sequence_id> batch;
    std::vector<std::size_t> idx;
    for (std::size_t i = 0; i < seqs.size(); ++i)
      if (step % 2 == 0 || i % 2 == 1) {
        batch.push_back(seqs[i]);
        idx.push_back(i);
      }
    for (int l = 0; l < layers; ++l) {
      auto kv = gen.make(L, index_t(batch.size()), src);
      tp.append(l, batch, kv.view());
      single.append(l, batch, kv.view());
      for (std::size_t i = 0; i < batch.size(); ++i) record(hist[idx[i]][std::size_t(l)], L, kv, index_t(i), 1);
      q.resize(batch.size() * std::size_t(hq) * Q);
      for (float& x : q) x = src.next_float();
      const std::size_t rows = batch.size() * std::size_t(hq);
      o1.assign(rows * V, NAN);
      l1.assign(rows, NAN);
      o2.assign(rows * V, NAN);
      l2.assign(rows, NAN);
      const mem_span<const float, pageable_host_space> qs(q.data(), index_t(q.size()));
      tp.step(l, batch, qs, float(scale),
              {mem_span<float, pageable_host_space>(o1.data(), index_t(o1.size())),
               mem_span<float, pageable_host_space>(l1.data(), index_t(l1.size())), nullptr});
      attn.step(l, batch, qs, float(scale),
                {mem_span<float, pageable_host_space>(o2.data(), index_t(o2.size())),
                 mem_span<float, pageable_host_space>(l2.data(), index_t(l2.size())), nullptr});
      after_step(l, std::span<const sequence_id>(batch), q, scale, o1, l1);
      s.bit_identical = s.bit_identical && same_bits(o1, o2) && same_bits(l1, l2);
      s.max_diff_out = std::max(s.max_diff_out, max_abs_diff(o1, o2));
      s.max_diff_lse = std::max(s.max_diff_lse, max_abs_diff(l1, l2));
      std::vector<double> ro, rl;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        reference_attention(L, hist[idx[i]][std::size_t(l)], q.data() + i * std::size_t(hq) * Q, scale, ro, rl);
        compare_rows(hq, V, o1.data() + i * std::size_t(hq) * V, l1.data() + i * std::size_t(hq), ro, rl, s.ref);
      }
    }
    s.evictions += tp.flush().evicted_sequences;
    single.flush();
    ++s.steps;
    if (check_placement) {
      // every rank's block table of every sequence equals the single cache's
      s.placement_mismatches += rank_placement_mismatches(tp, single, seqs);
    }
  }
  return s;
}

partition_spec gqa_spec(const G& rank_layout) { return small_spec_for(rank_layout, 2, 4, 6); }

}  // namespace

TEST_CASE("tensor_parallel_gqa: N = 1, 2, 4 ranks against the fp64 reference and one cache of the full layout") {
  const G L(32, 8);
  const double scale = 1.0 / std::sqrt(64.0);
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    backends be(n);
    attention_options ao;
    ao.cpu_threads = 2;
    const G rl(32 / n, 8 / n);
    tp_gqa<G> tp(be.span(), L, gqa_spec(rl), fixed_ratio(0.5), ao, {}, cache_options{true});
    CHECK(tp.ranks() == n);
    CHECK(tp.rank_layout() == rl);
    // the ranks' CPU threads add up to the total (2), at least 1 each
    int threads = 0;
    for (int r = 0; r < n; ++r) threads += tp.attention(r).options().cpu_threads;
    CHECK(threads == std::max(2, n));
    const run_stats s = drive(tp, L, gqa_spec(L), {5, 40, 77, 130}, 40, scale, true);
    CHECK(s.evictions > 0);
    CHECK(s.ref.ok());
    CHECK(s.placement_mismatches == 0);
    CHECK(s.max_diff_out <= 1e-5);
    CHECK(s.max_diff_lse <= 1e-5);
    MESSAGE("GQA N=" << n << ": max |out diff| " << s.max_diff_out << ", bit-identical " << s.bit_identical);
  }
}

TEST_CASE("tensor_parallel_mla: N = 1, 2, 4 ranks (tokens split by eviction batch) against the fp64 reference and one cache") {
  const M L(16);
  const double scale = 1.0 / std::sqrt(576.0);
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    backends be(n);
    attention_options ao;
    ao.cpu_threads = 2;
    const partition_spec spec = small_spec_for(L, 2, 4, 6);
    tp_mla<M> tp(be.span(), L, spec, fixed_ratio(0.5), ao, {}, cache_options{true});
    // the split rule
    CHECK(tp.rank_of_token(0) == 0);
    CHECK(tp.rank_of_token(32) == 1 % n);
    CHECK(tp.rank_of_token(32 * n + 5) == 0);
    index_t sum = 0;
    for (int r = 0; r < n; ++r) sum += tp.rank_prompt_tokens(r, 130);
    CHECK(sum == 130);
    // The merge rule, bit for bit: each rank's own step over the sequences it holds tokens of
    // (run again: the same partials), merged by merge_state_row in rank order 0..N-1 from the
    // empty state, must give the composite's output exactly (a merge in another order would
    // differ in the last bits, which the comparison with one cache cannot see).
    int merge_mismatches = 0, merged_rows = 0;
    auto merge_order = [&](int l, std::span<const sequence_id> batch, const std::vector<float>& q, double sc,
                           const std::vector<float>& o1, const std::vector<float>& l1) {
      constexpr int Q = M::q_dim, V = M::v_dim;
      const int hq = L.num_q_heads();
      const std::size_t orow = std::size_t(hq) * V;
      std::vector<float> want(batch.size() * orow, 0.0f), want_lse(batch.size() * std::size_t(hq), empty_lse);
      for (int r = 0; r < n; ++r) {
        std::vector<sequence_id> ids;
        std::vector<std::size_t> rows;
        for (std::size_t i = 0; i < batch.size(); ++i) {
          const sequence_id id = tp.rank_sequence(r, batch[i]);
          if (tp.cache(r).sequence(id).total_tokens(l) > 0) {
            ids.push_back(id);
            rows.push_back(i);
          }
        }
        if (ids.empty()) continue;
        std::vector<float> qr(ids.size() * std::size_t(hq) * Q), orr(ids.size() * orow), lr(ids.size() * std::size_t(hq));
        for (std::size_t k = 0; k < ids.size(); ++k)
          std::copy_n(q.data() + rows[k] * std::size_t(hq) * Q, std::size_t(hq) * Q, qr.data() + k * std::size_t(hq) * Q);
        tp.attention(r).step(l, ids, mem_span<const float, pageable_host_space>(qr.data(), index_t(qr.size())), float(sc),
                             {mem_span<float, pageable_host_space>(orr.data(), index_t(orr.size())),
                              mem_span<float, pageable_host_space>(lr.data(), index_t(lr.size())), nullptr});
        for (std::size_t k = 0; k < ids.size(); ++k)
          for (int h = 0; h < hq; ++h) {
            float* o = want.data() + rows[k] * orow + std::size_t(h) * V;
            float& lse = want_lse[rows[k] * std::size_t(hq) + std::size_t(h)];
            merge_state_row(o, lse, orr.data() + k * orow + std::size_t(h) * V, lr[k * std::size_t(hq) + std::size_t(h)], o,
                            &lse, V);
          }
      }
      merged_rows += int(batch.size());
      if (!same_bits(want, o1) || !same_bits(want_lse, l1)) ++merge_mismatches;
    };
    const run_stats s = drive(tp, L, spec, {5, 40, 77, 130}, 40, scale, false, merge_order);
    CHECK(merged_rows > 0);
    CHECK(merge_mismatches == 0);
    CHECK(s.evictions > 0);
    CHECK(s.ref.ok());
    CHECK(s.max_diff_out <= 2e-5);
    CHECK(s.max_diff_lse <= 2e-5);
    if (n == 1) CHECK(s.bit_identical);  // one rank: the merge from the empty state is the identity
    // each rank holds whole eviction batches only, and every token once
    for (int r = 0; r < n; ++r)
      for (sequence_id id = 0; id < 4; ++id) CHECK(tp.cache(r).sequence(tp.rank_sequence(r, id)).placed_tokens % 32 == 0);
    for (sequence_id id = 0; id < 4; ++id) {
      index_t held = 0;
      for (int r = 0; r < n; ++r) held += tp.cache(r).sequence(tp.rank_sequence(r, id)).total_tokens(0);
      CHECK(held == tp.tokens(id, 0));
    }
    MESSAGE("MLA N=" << n << ": max |out diff| " << s.max_diff_out << ", bit-identical " << s.bit_identical);
  }
}

TEST_CASE("tensor_parallel: refusals name the numbers; rank errors propagate; ended sequences free every rank") {
  const G L(32, 8);
  SUBCASE("no ranks") {
    backends be(0);
    const partition_spec spec = gqa_spec(L);
    try {
      tp_gqa<G> tp(be.span(), L, spec, fixed_ratio(0.5));
      FAIL("no throw");
    } catch (const config_error& e) {
      CHECK(mentions(e.what(), {"0 ranks", "at least 1"}));
    }
    CHECK_THROWS_AS(tp_mla<M>(be.span(), M(16), small_spec_for(M(16), 1, 2), fixed_ratio(0.5)), config_error);
  }
  SUBCASE("KV heads not divisible") {
    backends be(3);
    try {
      tp_gqa<G> tp(be.span(), L, gqa_spec(G(8, 2)), fixed_ratio(0.5));
      FAIL("no throw");
    } catch (const config_error& e) {
      CHECK(mentions(e.what(), {"Hkv = 8", "Hq = 32", "3 ranks"}));
    }
  }
  SUBCASE("more ranks than KV heads") {
    // Hq is a multiple of Hkv, so Hkv divisible by N implies Hq divisible by N
    backends be(4);
    try {
      tp_gqa<G> tp(be.span(), G(32, 2), gqa_spec(G(8, 1)), fixed_ratio(0.5));
      FAIL("no throw");
    } catch (const config_error& e) {
      CHECK(mentions(e.what(), {"Hkv = 2", "4 ranks"}));
    }
  }
  SUBCASE("one backend for two ranks") {
    host_backend one;
    std::vector<host_backend*> ptrs{&one, &one};
    try {
      tp_gqa<G> tp(ptrs, L, gqa_spec(G(16, 4)), fixed_ratio(0.5));
      FAIL("no throw");
    } catch (const config_error& e) {
      CHECK(mentions(e.what(), {"tensor_parallel_gqa", "ranks 0 and 1", "same backend"}));
    }
    CHECK_THROWS_AS(tp_mla<M>(ptrs, M(16), small_spec_for(M(16), 1, 2), fixed_ratio(0.5)), config_error);
  }
  SUBCASE("null backend") {
    std::vector<host_backend*> ptrs{nullptr};
    CHECK_THROWS_AS(tp_gqa<G>(ptrs, L, gqa_spec(L), fixed_ratio(0.5)), config_error);
  }
  SUBCASE("errors of the ranks propagate; a refused begin leaves no rank holding the sequence") {
    backends be(2);
    attention_options ao;
    ao.cpu_threads = 2;
    const G rl(16, 4);
    tp_gqa<G> tp(be.span(), L, gqa_spec(rl), fixed_ratio(0.5), ao);
    const sequence_id a = tp.begin_sequence(10);
    std::vector<float> q(32 * 64), o(32 * 64), lse(32);
    const mem_span<const float, pageable_host_space> qs(q.data(), index_t(q.size()));
    const step_outputs<pageable_host_space> so{mem_span<float, pageable_host_space>(o.data(), index_t(o.size())),
                                               mem_span<float, pageable_host_space>(lse.data(), index_t(lse.size())),
                                               nullptr};
    const std::vector<sequence_id> batch{a};
    CHECK_THROWS_AS(tp.step(0, batch, qs, 0.125f, so), state_error);  // prompt not written
    CHECK_THROWS_AS(tp.step(7, batch, qs, 0.125f, so), shape_error);  // layer
    const mem_span<const float, pageable_host_space> short_q(q.data(), 5);
    CHECK_THROWS_AS(tp.step(0, batch, short_q, 0.125f, so), shape_error);
    CHECK_THROWS_AS(tp.end_sequence(3), shape_error);
    // fill every D-window slot (max_sequences 4), then one more is refused on rank 0
    for (int i = 0; i < 3; ++i) tp.begin_sequence(0);
    CHECK_THROWS_AS(tp.begin_sequence(0), capacity_error);
    tp.end_sequence(a);
    for (int r = 0; r < 2; ++r) CHECK(tp.cache(r).live_sequences() == 3);
    CHECK(tp.begin_sequence(0) == a);
  }
  SUBCASE("MLA: a refused begin leaves no rank holding the sequence") {
    backends be(2);
    partition_spec spec = small_spec_for(M(16), 1, 2);
    spec.cpu_capacity_tokens = 32;  // one eviction batch per rank, all placed on the CPU
    spec.pinned_capacity_tokens = 0;
    using tp_cpu = tensor_parallel_mla<M, host_backend, pageable_allocator, cpu_only>;
    tp_cpu tp(be.span(), M(16), spec, cpu_only{});
    // 96 tokens: batches 0 and 2 on rank 0 (two batches: refused), batch 1 on rank 1
    CHECK_THROWS_AS(tp.begin_sequence(96), capacity_error);
    CHECK(tp.cache(0).live_sequences() == 0);
    CHECK(tp.cache(1).live_sequences() == 0);
    // 64 tokens: one batch per rank fits
    const sequence_id s = tp.begin_sequence(64);
    CHECK(tp.cache(0).sequence(tp.rank_sequence(0, s)).placed_tokens == 32);
    CHECK(tp.cache(1).sequence(tp.rank_sequence(1, s)).placed_tokens == 32);
  }
}

TEST_CASE("rank_team: persistent rank threads, every rank each run, the lowest rank's exception after all finished") {
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    writescope::detail::rank_team team(n);
    CHECK(team.workers() == n - 1);
    const auto un = static_cast<std::size_t>(n);
    std::vector<std::thread::id> first(un);
    for (int run = 0; run < 3; ++run) {
      std::vector<std::thread::id> ids(un);
      std::vector<int> hits(un, 0);
      team.run([&](int r) {
        ids[std::size_t(r)] = std::this_thread::get_id();
        ++hits[std::size_t(r)];
      });
      CHECK(hits == std::vector<int>(un, 1));
      CHECK(ids[0] == std::this_thread::get_id());  // rank 0 on the caller
      for (int r = 1; r < n; ++r) {
        CHECK(ids[std::size_t(r)] != std::this_thread::get_id());
        if (run == 0) first[std::size_t(r)] = ids[std::size_t(r)];
        CHECK(ids[std::size_t(r)] == first[std::size_t(r)]);  // the same thread every run
        for (int q = 1; q < r; ++q) CHECK(ids[std::size_t(q)] != ids[std::size_t(r)]);
      }
    }
    // ranks n-1 and (if any) 1 throw: every rank still runs, the lowest thrower's exception comes back
    std::atomic<int> done{0};
    try {
      team.run([&](int r) {
        done.fetch_add(1);
        if (r == n - 1 || r == 1) throw config_error("rank " + std::to_string(r));
      });
      CHECK(n == 1);  // only rank 0 ran, and it did not throw
    } catch (const config_error& e) {
      CHECK(std::string(e.what()) == "rank " + std::to_string(std::min(1, n - 1)));
    }
    CHECK(done.load() == n);
    // and the team serves the next run
    std::atomic<int> again{0};
    team.run([&](int) { again.fetch_add(1); });
    CHECK(again.load() == n);
  }
}
