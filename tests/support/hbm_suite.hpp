// tests/support/hbm_suite.hpp — the HBM tier (partition_spec::hbm_capacity_tokens,
// placement::gpu_resident; docs/ARCHITECTURE.md "The HBM tier") written once,
// templated on the backend: tests/test_hbm.cpp runs the bodies on host_backend,
// tests/cuda/test_cuda_hbm.cpp on cuda_backend (backend_traits,
// support/harness.hpp and tests/cuda/device_harness.hpp). Every body compares
// with the fp64 reference (and, where placement is the point, byte-exact
// read_token of every placed token):
//   * every subset of the four partials (HBM, streamed, CPU, D-window) empty or
//     not, one sequence each, solo and all in one ragged batch (bit-identical);
//   * boundary lengths: the region exactly full, one token and one batch past;
//   * the region full mid-prefill and mid-decode (falls through, no error);
//   * a sequence ending and another re-using its HBM blocks;
//   * batch-vs-solo bit identity at fixed shares with HBM blocks;
//   * a failing flush releases the HBM batches it had staged (strong guarantee).
#pragma once

#include <algorithm>
#include <exception>
#include <array>
#include <optional>
#include <string>
#include <vector>

#include "support/harness.hpp"

namespace wstest::hbm {

/// The message of the exception `f` throws (empty when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

/// The routing of a sequence by its own batch index: script[k] for batch k of
/// every sequence (clamped to the last entry), whatever its batchmates are.
struct by_batch_index {
  std::vector<placement> script;
  placement operator()(const route_query& q) const {
    const std::size_t k = std::size_t(q.placed_tokens / q.batch_tokens);
    return script[std::min(k, script.size() - 1)];
  }
};

/// Per-sequence scripts (indexed by sequence id, the last one for ids past it).
struct by_sequence {
  std::vector<std::vector<placement>> scripts;
  placement operator()(const route_query& q) const {
    const auto& s = scripts[std::min(std::size_t(q.seq), scripts.size() - 1)];
    const std::size_t k = std::size_t(q.placed_tokens / q.batch_tokens);
    return s[std::min(k, s.size() - 1)];
  }
};

/// block 16, D 32 (2 blocks per batch), split 4, CPU tasks of 3 blocks,
/// ping-pong of 6 blocks, `hbm_batches` eviction batches of HBM.
template <kv_layout Layout>
partition_spec hbm_spec(const Layout& L, int layers, int max_seqs, index_t hbm_batches) {
  partition_spec s = small_spec_for(L, layers, max_seqs, 6);
  s.hbm_capacity_tokens = hbm_batches * s.d_window_tokens;
  return s;
}

/// The regions of a sequence's placed blocks, batch by batch (one entry per batch).
template <class Cache>
std::vector<placement> batch_regions(const Cache& c, sequence_id s) {
  const sequence_state& st = c.sequence(s);
  std::vector<placement> r;
  const std::size_t wb = std::size_t(c.spec().window_blocks());
  for (std::size_t k = 0; k < st.block_table.size(); k += wb) r.push_back(st.block_table[k].region);
  return r;
}

/// Mismatching tokens of every placed + window token of `s` in every layer (read_token).
template <class Driver>
int all_mismatches(const Driver& d, sequence_id s) {
  int bad = 0;
  for (int l = 0; l < d.cache().spec().num_layers; ++l)
    bad += d.count_mismatches(s, l, 0, d.cache().sequence(s).total_tokens(l));
  return bad;
}

/// The placements giving exactly the non-empty partials of `mask` (bit 0 HBM,
/// 1 streamed, 2 CPU, 3 D-window): one batch per placed partial, in an order
/// that depends on the mask, and 7 window tokens for bit 3.
inline std::vector<placement> subset_script(int mask) {
  std::vector<placement> p;
  if (mask & 1) p.push_back(placement::gpu_resident);
  if (mask & 2) p.push_back(placement::gpu_load);
  if (mask & 4) p.push_back(placement::cpu_compute);
  if (!p.empty()) std::rotate(p.begin(), p.begin() + (mask % int(p.size())), p.end());
  return p;
}

/// Every subset of the four partials, one sequence per subset (16 sequences,
/// the empty one included: no token at all), attended without an append (the
/// window stays as the prompt left it): each alone, then all 16 in one ragged
/// batch; each output against the fp64 reference, each engine's partial against
/// the reference of its own tokens (the HBM and streamed tokens form the GPU's
/// streamed partial: the resident splits fold into it first), the batch
/// bit-identical to the solo steps, and every token where the script put it.
template <class Backend, class Layout>
void every_subset_of_partials(const Layout& L, double scale, int cpu_threads) {
  constexpr int V = Layout::v_dim;
  const int D = 32;
  by_sequence script;
  for (int m = 0; m < 16; ++m) {
    auto s = subset_script(m);
    if (s.empty()) s.push_back(placement::gpu_load);  // never asked: no batch
    script.scripts.push_back(s);
  }
  scripted_policy pol;
  pol.fn = script;
  test_rig<Backend, Layout, scripted_policy> rig(L, hbm_spec(L, 2, 16, 8), pol, attention_options{cpu_threads, true}, 71,
                                                 scale);
  auto& d = rig.d;
  std::vector<sequence_id> all;
  for (int m = 0; m < 16; ++m) {
    const index_t batches = index_t(subset_script(m).size());
    const sequence_id id = d.add(batches * D + ((m & 8) ? 7 : 0), 1000 + std::uint64_t(m));
    REQUIRE(id == m);
    all.push_back(id);
    REQUIRE(batch_regions(rig.cache, id) == subset_script(m));
    CHECK(rig.cache.sequence(id).hbm_placed_tokens == ((m & 1) ? D : 0));
  }
  CHECK(rig.cache.usage().hbm_used_blocks == 8 * 2);
  CHECK(rig.cache.total_hbm_placed_tokens() == 8 * D);
  for (sequence_id s : all) CHECK(all_mismatches(d, s) == 0);
  // the same on a rig with attention_options::all_gpu_steps off: the CPU side in every step, the same bits
  attention_options with_cpu_side{cpu_threads, true};
  with_cpu_side.all_gpu_steps = false;
  test_rig<Backend, Layout, scripted_policy> ablated(L, hbm_spec(L, 2, 16, 8), pol, with_cpu_side, 71, scale);
  for (int m = 0; m < 16; ++m)
    (void)ablated.d.add(index_t(subset_script(m).size()) * D + ((m & 8) ? 7 : 0), 1000 + std::uint64_t(m));
  const int hq0 = L.num_q_heads();

  for (int l = 0; l < 2; ++l) {
    for (sequence_id s : all) {
      const std::vector<sequence_id> one{s};
      debug_partials dbg;
      compare_result r;
      d.attend_layer(l, one, true, r, &dbg);
      INFO("layer " << l << " subset " << s << ": rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
      CHECK(r.ok());
      const int m = int(s);
      CHECK(d.last_report.resident_tokens == ((m & 1) ? D : 0));
      CHECK(d.last_report.streamed_tokens == ((m & 2) ? D : 0));
      CHECK(d.last_report.cpu_tokens == ((m & 4) ? D : 0));
      CHECK(d.last_report.window_tokens == ((m & 8) ? 7 : 0));
      // all-GPU steps (no CPU block) skip the CPU side; the ablated rig never does, with the same bits
      CHECK(d.last_report.cpu_side == ((m & 4) != 0));
      compare_result ra;
      ablated.d.attend_layer(l, one, true, ra);
      CHECK(ra.ok());
      CHECK(ablated.d.last_report.cpu_side);
      CHECK(same_bits(ablated.d.out.data(), d.out.data(), std::size_t(hq0) * V));
      CHECK(same_bits(ablated.d.lse.data(), d.lse.data(), std::size_t(hq0)));
      const sequence_state& st = rig.cache.sequence(s);
      const std::pair<engine, int> parts[] = {{engine::streamed, 3}, {engine::cpu, 4}, {engine::window, 8}};
      for (const auto& part : parts) {  // no structured binding: INFO captures `e` in a lambda (clang-14)
        const engine e = part.first;
        const int bits = part.second;
        bool empty = false;
        const std::vector<float>& po = e == engine::streamed ? dbg.streamed_o : e == engine::cpu ? dbg.cpu_o : dbg.window_o;
        const std::vector<float>& pl =
            e == engine::streamed ? dbg.streamed_lse : e == engine::cpu ? dbg.cpu_lse : dbg.window_lse;
        const compare_result pr = check_engine_partial(L, d.history(s, l), st, 16, e, po, pl, 0, d.q.data(), scale, &empty);
        INFO("engine " << int(e));
        CHECK(pr.ok());
        CHECK(empty == ((m & bits) == 0));
      }
    }
  }
  const int hq = L.num_q_heads();
  // The batch of all 16 on a fresh rig, each sequence alone on another, with
  // the same seeds: every sequence draws its queries from its own source, so
  // both see the same queries.
  test_rig<Backend, Layout, scripted_policy> twin(L, hbm_spec(L, 2, 16, 8), pol, attention_options{cpu_threads, true}, 71,
                                                  scale);
  for (int m = 0; m < 16; ++m)
    (void)twin.d.add(index_t(subset_script(m).size()) * D + ((m & 8) ? 7 : 0), 1000 + std::uint64_t(m));
  test_rig<Backend, Layout, scripted_policy> solo(L, hbm_spec(L, 2, 16, 8), pol, attention_options{cpu_threads, true}, 71,
                                                  scale);
  for (int m = 0; m < 16; ++m)
    (void)solo.d.add(index_t(subset_script(m).size()) * D + ((m & 8) ? 7 : 0), 1000 + std::uint64_t(m));
  for (int l = 0; l < 2; ++l) {
    compare_result r;
    twin.d.attend_layer(l, all, true, r);
    INFO("batch of 16, layer " << l << ": rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
    CHECK(r.ok());
    for (sequence_id s : all) {
      const std::vector<sequence_id> one{s};
      compare_result rs;
      solo.d.attend_layer(l, one, true, rs);
      CHECK(rs.ok());
      const std::size_t i = std::size_t(s);
      CHECK(same_bits(solo.d.out.data(), twin.d.out.data() + i * std::size_t(hq) * V, std::size_t(hq) * V));
      CHECK(same_bits(solo.d.lse.data(), twin.d.lse.data() + i * std::size_t(hq), std::size_t(hq)));
    }
  }
}

/// Boundary lengths with gpu_only: a region of 3 batches exactly filled by a
/// prompt of 3·D, then one token past it (window), then one batch past it
/// (the 4th batch to the pinned region); decode on through evictions that all
/// fall through; a capacity not a multiple of D rounds down.
template <class Backend, class Layout>
void boundary_lengths(const Layout& L, double scale, int cpu_threads) {
  const int D = 32;
  auto spec = hbm_spec(L, 2, 3, 3);
  spec.hbm_capacity_tokens += 5;  // 3 batches + 5 tokens: 3 batches
  test_rig<Backend, Layout, gpu_only> rig(L, spec, gpu_only{}, attention_options{cpu_threads, true}, 73, scale);
  auto& d = rig.d;
  CHECK(rig.cache.usage().hbm_capacity_blocks == 3 * 2);
  SUBCASE("exactly full") {
    const sequence_id a = d.add(3 * D);
    CHECK(batch_regions(rig.cache, a) == std::vector<placement>(3, placement::gpu_resident));
    CHECK(rig.cache.usage().hbm_used_blocks == 6);
    CHECK(rig.cache.sequence(a).window_tokens[0] == 0);
    const std::vector<sequence_id> one{a};
    for (int s = 0; s < D + 3; ++s) {  // the first eviction falls through to the pinned region
      const compare_result r = d.step(one);
      REQUIRE(r.ok());
    }
    CHECK(batch_regions(rig.cache, a) == std::vector<placement>{placement::gpu_resident, placement::gpu_resident,
                                                                placement::gpu_resident, placement::gpu_load});
    CHECK(all_mismatches(d, a) == 0);
  }
  SUBCASE("one token past") {
    const sequence_id a = d.add(3 * D + 1);
    CHECK(batch_regions(rig.cache, a) == std::vector<placement>(3, placement::gpu_resident));
    CHECK(rig.cache.sequence(a).window_tokens[1] == 1);
    const std::vector<sequence_id> one{a};
    REQUIRE(d.step(one).ok());
    CHECK(all_mismatches(d, a) == 0);
  }
  SUBCASE("one batch past, and a second sequence finds the region full") {
    const sequence_id a = d.add(4 * D);
    CHECK(batch_regions(rig.cache, a) == std::vector<placement>{placement::gpu_resident, placement::gpu_resident,
                                                                placement::gpu_resident, placement::gpu_load});
    const sequence_id b = d.add(2 * D + 5);
    CHECK(batch_regions(rig.cache, b) == std::vector<placement>(2, placement::gpu_load));
    const std::vector<sequence_id> batch{a, b};
    for (int s = 0; s < D; ++s) REQUIRE(d.step(batch).ok());
    CHECK(all_mismatches(d, a) == 0);
    CHECK(all_mismatches(d, b) == 0);
  }
}

/// The region full mid-prefill: with room for 3 batches of which another
/// sequence holds one, a prompt of 5 sends its first 2 there and the rest to
/// the host tiers by the policy's two-way rule over the HOST tokens only
/// (fixed_ratio 0.5: pinned, CPU, pinned; the tie of the first host batch goes
/// to the GPU). The other sequence ends; mid-decode a third one's first
/// eviction takes the freed batch and its later ones fall through, as do all
/// of the long one's.
template <class Backend, class Layout>
void full_mid_prefill_and_decode(const Layout& L, double scale, int cpu_threads) {
  const int D = 32;
  test_rig<Backend, Layout, fixed_ratio> rig(L, hbm_spec(L, 2, 3, 3), fixed_ratio(0.5),
                                             attention_options{cpu_threads, true}, 75, scale);
  auto& d = rig.d;
  const sequence_id c = d.add(D);
  CHECK(batch_regions(rig.cache, c) == std::vector<placement>{placement::gpu_resident});
  const sequence_id a = d.add(5 * D + 3);
  CHECK(batch_regions(rig.cache, a) == std::vector<placement>{placement::gpu_resident, placement::gpu_resident,
                                                              placement::gpu_load, placement::cpu_compute,
                                                              placement::gpu_load});
  d.remove(c);
  const sequence_id b = d.add(D - 4);  // no batch yet: the region has one free batch
  CHECK(rig.cache.usage().hbm_used_blocks == 4);
  const std::vector<sequence_id> batch{a, b};
  int hbm_evictions = 0, host_evictions = 0;
  for (int s = 0; s < 3 * D; ++s) {
    const compare_result r = d.step(batch);
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
    REQUIRE(r.ok());
    hbm_evictions += d.last_flush.hbm_batches;
    host_evictions += d.last_flush.cpu_batches + d.last_flush.gpu_batches;
  }
  CHECK(hbm_evictions == 1);  // b's first eviction takes the last free batch
  CHECK(host_evictions == 5);
  CHECK(batch_regions(rig.cache, b)[0] == placement::gpu_resident);
  CHECK(rig.cache.usage().hbm_used_blocks == 6);
  CHECK(rig.cache.sequence(b).hbm_placed_tokens == D);
  // Every host batch of b followed fixed_ratio over b's host tokens alone.
  const auto rb = batch_regions(rig.cache, b);
  CHECK(rb == std::vector<placement>{placement::gpu_resident, placement::gpu_load, placement::cpu_compute});
  CHECK(all_mismatches(d, a) == 0);
  CHECK(all_mismatches(d, b) == 0);
}

/// A sequence ending frees its HBM batches; the next sequence re-uses the
/// same blocks (lowest free first), and its output and bytes are its own
/// (the old bytes are overwritten, not read). A sequence that kept host
/// blocks is unaffected.
template <class Backend, class Layout>
void end_and_reuse(const Layout& L, double scale, int cpu_threads) {
  const int D = 32;
  test_rig<Backend, Layout, cpu_only> rig(L, hbm_spec(L, 2, 3, 2), cpu_only{}, attention_options{cpu_threads, true}, 77,
                                          scale);
  auto& d = rig.d;
  const sequence_id a = d.add(2 * D + 9);
  const sequence_id b = d.add(D + 2);  // the region is full: b goes to the CPU
  CHECK(batch_regions(rig.cache, b) == std::vector<placement>{placement::cpu_compute});
  const std::vector<block_id> a_hbm = rig.cache.sequence(a).hbm_blocks;
  CHECK(a_hbm.size() == 4);
  const std::vector<sequence_id> ab{a, b};
  for (int s = 0; s < 5; ++s) REQUIRE(d.step(ab).ok());
  d.remove(a);
  CHECK(rig.cache.usage().hbm_used_blocks == 0);
  CHECK(rig.cache.total_hbm_placed_tokens() == 0);
  const sequence_id c = d.add(2 * D);
  CHECK(rig.cache.sequence(c).hbm_blocks == a_hbm);  // the same blocks, in place
  const std::vector<sequence_id> bc{b, c};
  for (int s = 0; s < D + 2; ++s) {
    const compare_result r = d.step(bc);
    INFO("step " << s);
    REQUIRE(r.ok());
  }
  CHECK(batch_regions(rig.cache, c) ==
        std::vector<placement>{placement::gpu_resident, placement::gpu_resident, placement::cpu_compute});
  CHECK(all_mismatches(d, b) == 0);
  CHECK(all_mismatches(d, c) == 0);
  // b's own window evictions went to the CPU (the region was full when it filled)
  for (placement p : batch_regions(rig.cache, b)) CHECK(p == placement::cpu_compute);
}

/// Batch-vs-solo bit identity at fixed shares with HBM blocks: every sequence
/// places batch k by its own script (resident, CPU, pinned, resident, ...),
/// so its placement is the same alone and in the batch; each sequence draws
/// from its own source. Solo and batched decode loops (with evictions into
/// all three regions) give bit-identical outputs every layer and step,
/// although the HBM blocks of the batched run are interleaved between
/// sequences (resident splits are cut at every eviction batch).
template <class Backend, class Layout>
void batch_vs_solo(const Layout& L, double scale, int cpu_threads, int steps) {
  const int D = 32;
  constexpr int V = Layout::v_dim;
  scripted_policy pol;
  pol.fn = by_batch_index{{placement::gpu_resident, placement::cpu_compute, placement::gpu_load,
                           placement::gpu_resident, placement::gpu_resident, placement::cpu_compute,
                           placement::gpu_load}};
  const std::vector<index_t> prompts{3 * D + 5, 0, D, 4 * D + 31};
  const int hq = L.num_q_heads();
  // batched
  test_rig<Backend, Layout, scripted_policy> rb(L, hbm_spec(L, 2, 4, 64), pol, attention_options{cpu_threads, true}, 79,
                                                scale);
  std::vector<sequence_id> batch;
  for (std::size_t i = 0; i < prompts.size(); ++i) batch.push_back(rb.d.add(prompts[i], 500 + i));
  std::vector<std::vector<std::vector<float>>> outs(static_cast<std::size_t>(steps));  // [step][layer]
  for (int s = 0; s < steps; ++s) {
    REQUIRE(rb.d.step(batch).ok());
    outs[std::size_t(s)] = rb.d.layer_out;
  }
  // the batched run's resident blocks interleave between sequences
  bool interleaved = false;
  for (sequence_id s : batch) {
    const auto& h = rb.cache.sequence(s).hbm_blocks;
    for (std::size_t k = 2; k < h.size(); k += 2) interleaved = interleaved || h[k] != h[k - 1] + 1;
  }
  CHECK(interleaved);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    test_rig<Backend, Layout, scripted_policy> ro(L, hbm_spec(L, 2, 4, 64), pol, attention_options{cpu_threads, true},
                                                  79, scale);
    const sequence_id id = ro.d.add(prompts[i], 500 + i);
    const std::vector<sequence_id> one{id};
    for (int s = 0; s < steps; ++s) {
      REQUIRE(ro.d.step(one).ok());
      for (int l = 0; l < 2; ++l) {
        const auto& bo = outs[std::size_t(s)][std::size_t(l)];
        INFO("sequence " << i << " step " << s << " layer " << l);
        CHECK(same_bits(ro.d.layer_out[std::size_t(l)].data(), bo.data() + i * std::size_t(hq) * V,
                        std::size_t(hq) * V));
      }
    }
    CHECK(batch_regions(ro.cache, id) == batch_regions(rb.cache, batch[i]));
  }
}

/// A flush that fails on a host region (pinned capacity 0, CPU full) after
/// another sequence's batch was staged into the HBM region: nothing is
/// evicted and the staged HBM batch is released (strong guarantee); the
/// next flush, once the other sequence has ended, succeeds.
template <class Backend, class Layout>
void failing_flush_releases_hbm(const Layout& L, double scale, int cpu_threads) {
  const int D = 32;
  auto spec = hbm_spec(L, 1, 2, 1);
  spec.pinned_capacity_tokens = 0;
  spec.cpu_capacity_tokens = D;
  scripted_policy pol;
  pol.fn = by_sequence{{{placement::gpu_resident}, {placement::cpu_compute}}};
  test_rig<Backend, Layout, scripted_policy> rig(L, spec, pol, attention_options{cpu_threads, true}, 81, scale);
  auto& d = rig.d;
  const sequence_id a = d.add(D - 1);      // its first eviction is scripted into the HBM region
  const sequence_id b = d.add(2 * D - 1);  // its prompt batch fills the CPU region; its next eviction fails
  CHECK(batch_regions(rig.cache, b) == std::vector<placement>{placement::cpu_compute});
  const std::vector<sequence_id> ab{a, b};
  d.append_layer(0, ab);
  const cache_snapshot before = snapshot(rig.cache, ab);
  CHECK_THROWS_AS(rig.cache.flush(), capacity_error);
  CHECK(snapshot(rig.cache, ab) == before);
  CHECK(rig.cache.usage().hbm_used_blocks == 0);  // a's staged HBM batch released
  CHECK(rig.cache.total_hbm_placed_tokens() == 0);
  d.remove(b);
  const flush_report f = rig.cache.flush();
  CHECK(f.hbm_batches == 1);
  CHECK(batch_regions(rig.cache, a) == std::vector<placement>{placement::gpu_resident});
  CHECK(all_mismatches(d, a) == 0);
  const std::vector<sequence_id> one{a};
  compare_result r;
  d.attend_layer(0, one, true, r);
  CHECK(r.ok());
}

/// One block in block format (`fmt`) holding the first `n` tokens of `kv`
/// (the rest zero): a D-window for engine-level tests.
template <class Layout>
std::vector<bf16> block_image(const block_format<Layout>& fmt, const kv_batch<Layout>& kv, index_t n) {
  const Layout& L = fmt.layout;
  std::vector<bf16> image(std::size_t(fmt.block_elems()));
  for (int p = 0; p < Layout::planes; ++p)
    for (int h = 0; h < L.kv_heads(); ++h)
      for (index_t t = 0; t < n; ++t)
        std::memcpy(image.data() + fmt.offset(p, h, int(t), 0),
                    kv.planes[p].data() + (std::size_t(t) * std::size_t(L.kv_heads()) + std::size_t(h)) *
                                              Layout::row_elems,
                    Layout::row_elems * sizeof(bf16));
  return image;
}

}  // namespace wstest::hbm
