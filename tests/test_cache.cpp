// SPDX-License-Identifier: Apache-2.0
// InplaceKVCache + hybrid attention end to end (paper §4, §5; docs/ARCHITECTURE.md §2-5):
// full decode loops of ragged batches against fp64 attention for every
// policy, lengths through every boundary, poisoned regions and workspaces;
// batch invariance bit for bit; GQA group sizes; and the format's bookkeeping
// (write-time routing, eviction byte-exactness, views, reuse, pinned growth).
#include <doctest/doctest.h>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<128>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

template <class P, int Tenths>
struct fixed_mk {
  using type = P;
  static P make() { return P(Tenths / 10.0); }
};
struct gpu_only_mk {
  using type = gpu_only;
  static gpu_only make() { return {}; }
};
struct cpu_only_mk {
  using type = cpu_only;
  static cpu_only make() { return {}; }
};
struct roofline_mk {
  using type = roofline_policy;
  static roofline_policy make() {
    roofline_params p;
    p.cpu_cost_per_token_seconds = 1e-9;
    p.gpu_cost_per_token_seconds = 1e-9;
    p.gpu_fixed_seconds = 2e-6;  // Δ > 0: r(L) moves with L
    return roofline_policy(p);
  }
};
using fixed_0 = fixed_mk<fixed_ratio, 0>;
using fixed_3 = fixed_mk<fixed_ratio, 3>;
using fixed_5 = fixed_mk<fixed_ratio, 5>;
using fixed_10 = fixed_mk<fixed_ratio, 10>;

// CPU engine threads: 1 unless a test is about threads. With the host backend
// the emulated GPU is one more thread, and on a 2-core CI machine 2 OpenMP
// threads + that worker oversubscribe the cores (fault kind K9): libgomp's
// spinning then slows every step ~30x. Thread counts are covered where they
// matter (one policy here, the batch run at r = 0.5, test_faults.cpp K10, C2).

// Block 16, D 32, split 4 blocks per GPU partial, 3 blocks per CPU task,
// ping-pong of 6 blocks (a chunk holds one full split and a part of the next).
partition_spec test_spec(int layers, int max_seqs) {
  partition_spec s = small_spec(layers, max_seqs);
  set_ping_pong_blocks(s, G(8, 2), 6);
  return s;
}

}  // namespace

TEST_CASE_TEMPLATE("decode loops of ragged batches match fp64 attention at every step, for every policy", Mk, fixed_0,
                   fixed_3, fixed_5, fixed_10, gpu_only_mk, cpu_only_mk, roofline_mk) {
  using P = typename Mk::type;
  host_backend be;
  const G lay(8, 2);
  host_cache<G, P> cache(be, lay, test_spec(2, 12), Mk::make(), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{std::is_same_v<Mk, fixed_5> ? 2 : 1, true}, 1234, gqa_scale);
  // First attended lengths P+1: 1, 2, block-1, block, block+1, D-1, D, D+1,
  // 2D+1, several batches; 70 decode steps walk each through 2+ evictions.
  std::vector<sequence_id> batch;
  for (index_t p : {0, 1, 14, 15, 16, 30, 31, 32, 64, 97, 150}) batch.push_back(d.add(p));
  int evictions = 0;
  for (int s = 0; s < 70; ++s) {
    debug_partials dbg;
    const compare_result r = d.step(batch, true, &dbg);
    INFO("step " << s << " rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err << " non-finite " << r.non_finite);
    REQUIRE(r.ok());
    evictions += d.last_flush.evicted_sequences;
  }
  CHECK(evictions >= 2 * int(batch.size()));
  // Where the policy put the batches.
  const region_usage u = cache.usage();
  if constexpr (std::is_same_v<P, gpu_only>) CHECK(u.cpu_used_blocks == 0);
  if constexpr (std::is_same_v<P, cpu_only>) CHECK(u.pinned_used_blocks == 0);
  if constexpr (std::is_same_v<Mk, fixed_0>) CHECK(u.cpu_used_blocks == 0);
  if constexpr (std::is_same_v<Mk, fixed_10>) CHECK(u.pinned_used_blocks == 0);
  if constexpr (std::is_same_v<Mk, fixed_3> || std::is_same_v<Mk, fixed_5>) {
    CHECK(u.cpu_used_blocks > 0);
    CHECK(u.pinned_used_blocks > 0);
    const double r = Mk::make().cpu_share();
    for (sequence_id id : batch) {  // every sequence within D/(2L) of r
      const sequence_state& st = cache.sequence(id);
      CHECK(std::abs(double(st.cpu_placed_tokens) / double(st.placed_tokens) - r) <= 32.0 / (2.0 * double(st.placed_tokens)) + 1e-12);
    }
  }
}

TEST_CASE("a sequence inside a ragged batch is bit-identical to its solo run at a fixed split (K10)") {
  const G lay(8, 2);
  const std::vector<index_t> prompts{3, 40, 97, 0, 64};
  const int steps = 45;
  for (int tenths : {0, 3, 5, 10}) {
    CAPTURE(tenths);
    // Solo runs: one cache per sequence.
    std::vector<std::vector<std::vector<float>>> solo_out(prompts.size()), solo_lse(prompts.size());
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      host_backend be;
      host_cache<G, fixed_ratio> cache(be, lay, test_spec(2, 1), fixed_ratio(tenths / 10.0), {}, cache_options{true});
      decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 0, gqa_scale);
      const std::vector<sequence_id> one{d.add(prompts[i], 100 + i)};
      for (int s = 0; s < steps; ++s) {
        REQUIRE(d.step(one, s % 9 == 0).ok());
        for (int l = 0; l < 2; ++l) {
          solo_out[i].push_back(d.layer_out[std::size_t(l)]);
          solo_lse[i].push_back(d.layer_lse[std::size_t(l)]);
        }
      }
    }
    // The same sequences (same seeds) together, in a shuffled batch order, in a
    // cache whose pools were used and recycled by an unrelated sequence first.
    host_backend be;
    host_cache<G, fixed_ratio> cache(be, lay, test_spec(2, 6), fixed_ratio(tenths / 10.0), {}, cache_options{true});
    decode_driver<decltype(cache)> d(cache, attention_options{tenths == 5 ? 2 : 1, true}, 0, gqa_scale);
    const sequence_id junk = d.add(77, 999);
    const std::vector<sequence_id> jb{junk};
    for (int s = 0; s < 20; ++s) d.step(jb, false);
    std::vector<sequence_id> ids(prompts.size());
    for (std::size_t i : {2, 0, 4, 1, 3}) ids[i] = d.add(prompts[i], 100 + i);
    d.remove(junk);
    const std::vector<sequence_id> batch{ids[3], ids[1], ids[4], ids[0], ids[2]};
    const std::size_t row = 8 * 128;
    for (int s = 0; s < steps; ++s) {
      const compare_result r = d.step(batch, s % 9 == 0);
      REQUIRE(r.ok());
      for (std::size_t bi = 0; bi < batch.size(); ++bi) {
        const std::size_t i = std::size_t(std::find(ids.begin(), ids.end(), batch[bi]) - ids.begin());
        for (int l = 0; l < 2; ++l) {
          CAPTURE(s);
          CAPTURE(i);
          CAPTURE(l);
          const auto& so = solo_out[i][std::size_t(s * 2 + l)];
          const auto& sl = solo_lse[i][std::size_t(s * 2 + l)];
          REQUIRE(same_bits(d.layer_out[std::size_t(l)].data() + bi * row, so.data(), row));
          REQUIRE(same_bits(d.layer_lse[std::size_t(l)].data() + bi * 8, sl.data(), 8));
        }
      }
    }
  }
}

TEST_CASE("GQA group sizes 1..32 over all three engines match fp64 attention") {
  struct hh {
    int hq, hkv;
  };
  for (hh h : {hh{4, 4}, hh{16, 4}, hh{20, 4}, hh{24, 4}, hh{28, 4}, hh{32, 4}, hh{64, 4}, hh{32, 1}, hh{40, 8}, hh{48, 2},
               hh{32, 32}}) {
    CAPTURE(h.hq);
    CAPTURE(h.hkv);
    host_backend be;
    const G lay(h.hq, h.hkv);
    partition_spec spec = small_spec(1, 3);
    set_ping_pong_blocks(spec, lay, 6);
    host_cache<G, fixed_ratio> cache(be, lay, spec, fixed_ratio(0.5), {}, cache_options{true});
    decode_driver<decltype(cache)> d(cache, attention_options{1, true}, std::uint64_t(h.hq * 100 + h.hkv), gqa_scale);
    const std::vector<sequence_id> batch{d.add(4 * 32 + 5), d.add(17), d.add(2 * 32)};
    for (int s = 0; s < 6; ++s) {
      debug_partials dbg;
      const compare_result r = d.step(batch, true, &dbg);
      INFO("step " << s << " rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
      REQUIRE(r.ok());
    }
    CHECK(cache.usage().cpu_used_blocks > 0);
    CHECK(cache.usage().pinned_used_blocks > 0);
  }
}

TEST_CASE("a policy changes where, never what: flipping the target between 0.2 and 0.8 every batch stays within the bar") {
  host_backend be;
  const G lay(8, 2);
  scripted_policy pol;
  pol.fn = [](const route_query& q) { return route_toward((q.placed_tokens / q.batch_tokens) % 2 ? 0.2 : 0.8, q); };
  host_cache<G, scripted_policy> cache(be, lay, test_spec(1, 3), pol, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 55, gqa_scale);
  const std::vector<sequence_id> batch{d.add(5 * 32 + 1), d.add(0), d.add(33)};
  for (int s = 0; s < 100; ++s) {
    const compare_result r = d.step(batch);
    INFO("step " << s << " rel_l2 " << r.max_rel_l2);
    REQUIRE(r.ok());
  }
  CHECK(cache.usage().cpu_used_blocks > 0);
  CHECK(cache.usage().pinned_used_blocks > 0);
}

namespace {

// Every token of every layer of `id`, read back from wherever it lives, equals
// the history the driver recorded when it was written (byte-exact).
template <class Cache>
void check_tokens_readback(const Cache& cache, const decode_driver<Cache>& d, sequence_id id) {
  using L = typename Cache::layout_type;
  const L& lay = cache.layout();
  const index_t row = index_t(lay.kv_heads()) * L::row_elems;
  std::vector<bf16> out(std::size_t(L::planes * row));
  for (int l = 0; l < cache.spec().num_layers; ++l) {
    const auto& h = d.history(id, l);
    REQUIRE(cache.sequence(id).total_tokens(l) == h.tokens);
    for (index_t t = 0; t < h.tokens; ++t) {
      cache.read_token(l, id, t, out);
      for (int p = 0; p < L::planes; ++p)
        REQUIRE(std::memcmp(out.data() + p * row, h.planes[p].data() + t * row, std::size_t(row) * sizeof(bf16)) == 0);
    }
  }
}

}  // namespace

TEST_CASE("write-time routing: prefill goes straight to its regions; eviction moves whole windows byte-exactly") {
  host_backend be;
  const G lay(4, 2);
  partition_spec spec = test_spec(3, 4);
  scripted_policy pol;  // batch k of a sequence: CPU when k is odd
  pol.fn = [](const route_query& q) {
    return (q.placed_tokens / q.batch_tokens) % 2 ? placement::cpu_compute : placement::gpu_load;
  };
  host_cache<G, scripted_policy> cache(be, lay, spec, pol, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 9, gqa_scale);
  const sequence_id a = d.add(3 * 32 + 7);  // 3 batches placed at admission, 7 tokens in the window
  const sequence_state& sa = cache.sequence(a);
  CHECK(sa.prompt_tokens == 103);
  CHECK(sa.placed_tokens == 96);
  CHECK(sa.cpu_placed_tokens == 32);
  CHECK(sa.block_table.size() == 6);
  CHECK(sa.cpu_blocks.size() == 2);
  CHECK(sa.pinned_blocks.size() == 4);
  for (int l = 0; l < 3; ++l) CHECK(sa.window_tokens[std::size_t(l)] == 7);
  CHECK(sa.block_table[2].region == placement::cpu_compute);
  CHECK(sa.block_table[3].region == placement::cpu_compute);
  check_tokens_readback(cache, d, a);

  const sequence_id b = d.add(32);  // exactly one batch: the window starts empty
  CHECK(cache.sequence(b).window_tokens[0] == 0);
  CHECK(cache.sequence(b).placed_tokens == 32);
  const sequence_id c = d.add(0);
  CHECK(cache.sequence(c).placed_tokens == 0);
  CHECK(cache.sequence(c).layer_ready[2] == 1);
  CHECK(cache.live_sequences() == 3);
  CHECK(cache.total_placed_tokens() == 128);

  const std::vector<sequence_id> batch{a, b, c};
  int flushed = 0;
  for (int s = 0; s < 70; ++s) {
    REQUIRE(d.step(batch, s % 10 == 0).ok());
    const flush_report& fr = d.last_flush;
    flushed += fr.evicted_sequences;
    CHECK(fr.cpu_batches + fr.gpu_batches == fr.evicted_sequences);
    // a's window fills at steps 24, 56; b's and c's at 31, 63.
    if (s == 24 || s == 56) CHECK(fr.evicted_sequences == 1);
    if (s == 31 || s == 63) CHECK(fr.evicted_sequences == 2);
  }
  CHECK(flushed == 6);
  for (sequence_id id : batch) check_tokens_readback(cache, d, id);
  CHECK(cache.sequence(a).placed_tokens == 5 * 32);
  CHECK(cache.sequence(a).window_tokens[1] == 103 + 70 - 160);
  CHECK(cache.total_placed_tokens() == 160 + 96 + 64);
}

TEST_CASE("flush evicts only windows that are full in every layer") {
  host_backend be;
  const G lay(4, 2);
  host_cache<G, gpu_only> cache(be, lay, test_spec(2, 1), gpu_only{}, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 4, gqa_scale);
  const sequence_id a = d.add(31);
  const std::vector<sequence_id> batch{a};
  d.append_layer(0, batch);  // layer 0 full, layer 1 not
  CHECK(cache.flush().evicted_sequences == 0);
  CHECK(cache.sequence(a).placed_tokens == 0);
  d.append_layer(1, batch);
  const flush_report r = cache.flush();
  CHECK(r.evicted_sequences == 1);
  CHECK(r.gpu_batches == 1);
  CHECK(cache.sequence(a).placed_tokens == 32);
  CHECK(cache.sequence(a).window_tokens == std::vector<int>{0, 0});
  CHECK(cache.flush().evicted_sequences == 0);  // idempotent
  check_tokens_readback(cache, d, a);
  compare_result r2;
  d.attend_layer(1, batch, true, r2);
  CHECK(r2.ok());
}

TEST_CASE("views: zero-copy block pointers agree with the format and with what was written") {
  host_backend be;
  const G lay(4, 2);
  scripted_policy pol;
  pol.fn = [](const route_query& q) {
    return (q.placed_tokens / q.batch_tokens) % 2 ? placement::cpu_compute : placement::gpu_load;
  };
  host_cache<G, scripted_policy> cache(be, lay, test_spec(2, 2), pol, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 21, gqa_scale);
  const sequence_id a = d.add(4 * 32 + 9);
  const index_t row = 2 * 128;
  for (int l = 0; l < 2; ++l) {
    const layer_views<G> v = cache.views(l);
    CHECK(v.layer == l);
    CHECK(v.window_blocks == 2);
    const sequence_state& st = v.sequences[std::size_t(a)];
    CHECK(st.live);
    const auto& h = d.history(a, l);
    for (index_t t = 0; t < h.tokens; ++t) {
      const bf16* blk;
      int r;
      if (t < st.placed_tokens) {
        const block_ref& b = st.block_table[std::size_t(t / 16)];
        blk = b.region == placement::cpu_compute ? v.cpu_block(b.id) : v.pinned_block(b.id);
        r = int(t % 16);
      } else {
        blk = v.window_region(st.window_slot).block((t - st.placed_tokens) / 16).data();
        r = int((t - st.placed_tokens) % 16);
      }
      for (int p = 0; p < 2; ++p)
        for (int kh = 0; kh < 2; ++kh)
          REQUIRE(std::memcmp(blk + v.format.offset(p, kh, r, 0), h.planes[p].data() + t * row + kh * 128, 256) == 0);
    }
  }
  // Layers live in different arenas.
  CHECK(cache.views(0).cpu.block(0).data() != cache.views(1).cpu.block(0).data());
  CHECK(cache.views(0).window.block(0).data() != cache.views(1).window.block(0).data());
  CHECK(cache.views(0).pinned.block(0).data() != cache.views(1).pinned.block(0).data());
  CHECK(cache.views(0).ping_pong.size() == 2);
  CHECK(cache.views(0).ping_pong_blocks == 6);
}

TEST_CASE("ended sequences return blocks and slots for in-place reuse; usage() tracks it") {
  host_backend be;
  const G lay(4, 2);
  host_cache<G, fixed_ratio> cache(be, lay, test_spec(1, 2), fixed_ratio(0.5), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 8, gqa_scale);
  const region_usage u0 = cache.usage();
  CHECK(u0.cpu_used_blocks == 0);
  CHECK(u0.pinned_used_blocks == 0);
  CHECK(u0.max_sequences == 2);
  CHECK(u0.cpu_capacity_blocks == 512);
  CHECK(u0.d_window_bytes == 2 * 2 * lay.token_bytes() * 16);
  CHECK(u0.ping_pong_bytes == 2 * 6 * lay.token_bytes() * 16);

  const sequence_id a = d.add(4 * 32);  // GPU, CPU, GPU, CPU
  const sequence_id b = d.add(2 * 32);
  region_usage u = cache.usage();
  CHECK(u.live_sequences == 2);
  CHECK(u.cpu_used_blocks == 2 * 2 + 2);
  CHECK(u.pinned_used_blocks == 2 * 2 + 2);
  const std::vector<block_id> a_cpu = cache.sequence(a).cpu_blocks;
  CHECK(a_cpu == std::vector<block_id>{0, 1, 2, 3});  // lowest first
  CHECK(cache.sequence(b).cpu_blocks == std::vector<block_id>{4, 5});
  const int a_slot = cache.sequence(a).window_slot;
  d.remove(a);
  u = cache.usage();
  CHECK(u.live_sequences == 1);
  CHECK(u.cpu_used_blocks == 2);
  CHECK(u.pinned_used_blocks == 2);
  CHECK(cache.total_placed_tokens() == 64);
  // A new sequence reuses a's slot and its blocks, lowest first, and decodes
  // correctly over the stale (not re-poisoned) contents.
  const sequence_id c = d.add(3 * 32 + 1);
  CHECK(c == a);  // the id is reused too
  CHECK(cache.sequence(c).window_slot == a_slot);
  CHECK(cache.sequence(c).cpu_blocks == std::vector<block_id>{0, 1});  // r = 0.5: GPU, CPU, GPU
  const std::vector<sequence_id> batch{c, b};
  for (int s = 0; s < 40; ++s) REQUIRE(d.step(batch).ok());
  d.remove(b);
  d.remove(c);
  u = cache.usage();
  CHECK(u.cpu_used_blocks == 0);
  CHECK(u.pinned_used_blocks == 0);
  CHECK(u.live_sequences == 0);
  CHECK(cache.total_placed_tokens() == 0);
}

TEST_CASE("the pinned region grows slab by slab up to its maximum, ahead of need when asked") {
  host_backend be;
  const G lay(4, 2);
  partition_spec spec = test_spec(2, 2);
  spec.pinned_capacity_tokens = 10 * 32;
  spec.pinned_initial_tokens = 0;
  spec.pinned_growth_tokens = 2 * 32;  // a slab = 2 eviction batches = 4 blocks
  host_cache<G, gpu_only> cache(be, lay, spec, gpu_only{}, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 3, gqa_scale);
  const index_t slab_bytes = 4 * 16 * lay.token_bytes() * 2;  // 4 blocks, 2 layers
  CHECK(cache.usage().pinned_capacity_blocks == 0);
  CHECK(cache.usage().pinned_max_blocks == 20);
  CHECK(cache.usage().pinned_region_bytes == 0);
  const sequence_id a = d.add(3 * 32);  // needs 6 blocks: 2 slabs
  CHECK(cache.usage().pinned_capacity_blocks == 8);
  CHECK(cache.usage().pinned_region_bytes == 2 * slab_bytes);
  cache.reserve_pinned_blocks(4);  // 6 used + 4 > 8: one more slab
  CHECK(cache.usage().pinned_capacity_blocks == 12);
  cache.reserve_pinned_blocks(100);  // bounded by the maximum
  CHECK(cache.usage().pinned_capacity_blocks == 20);
  CHECK(cache.usage().pinned_region_bytes == 5 * slab_bytes);
  const sequence_id b = d.add(5);
  const std::vector<sequence_id> batch{a, b};
  for (int s = 0; s < 60; ++s) REQUIRE(d.step(batch).ok());  // blocks spread over several slabs
  CHECK(cache.usage().pinned_used_blocks == 2 * (3 + 1) + 2 * 2);
  check_tokens_readback(cache, d, a);
  check_tokens_readback(cache, d, b);
}

TEST_CASE("mlock-pinned load region: pinned once at init, decodes correctly") {
  host_backend be;
  const G lay(4, 2);
  partition_spec spec = test_spec(1, 1);
  spec.pinned_capacity_tokens = 4 * 32;
  spec.pinned_initial_tokens = -1;
  try {
    inplace_kv_cache<G, host_backend, mlock_allocator, gpu_only> cache(be, lay, spec, gpu_only{}, {}, cache_options{true});
    decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 17, gqa_scale);
    const std::vector<sequence_id> batch{d.add(3 * 32 + 30)};
    CHECK(cache.usage().pinned_capacity_blocks == 8);
    for (int s = 0; s < 5; ++s) REQUIRE(d.step(batch).ok());  // the last pinned block is attended
    CHECK(cache.usage().pinned_used_blocks == 8);
  } catch (const pinned_memory_error& e) {  // RLIMIT_MEMLOCK too small here: refused at init, naming the size
    CHECK(mentions(e.what(), {"pinned memory", "bytes"}));
  }
}
