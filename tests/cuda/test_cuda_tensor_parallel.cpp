// SPDX-License-Identifier: Apache-2.0
// Several GPUs of one host on cuda_backend (writescope/cuda/tensor_parallel.hpp,
// docs/MULTI-GPU.md): tensor_parallel_gqa (gqa_layout<128>, 32 query / 8 KV
// heads) and tensor_parallel_mla (mla_layout<512, 64>, 16 heads) with one
// rank on device 0, two ranks on device 0, and two ranks on devices 0 and 1
// (skipped with a message on a host with one device). Ragged batches, prompts
// whose eviction batches land in the unpinned and the pinned regions of every
// rank, decode steps over two layers with evictions. Every step's outputs (and
// LSEs) are compared with one cache of the full layout on one cuda_backend fed
// the same tokens (GQA: bit-identical; MLA: bit-identical with one rank,
// within 2e-5 otherwise) and with the fp64 reference. The outputs are
// poisoned (0xff, NaN) before every step, and every fifth step asks for no
// LSE (the MLA merge's own LSE state). Plus the refusal of one backend for two
// ranks.
#include <doctest/doctest.h>

#include <writescope/cuda/tensor_parallel.hpp>

#include <memory>

#include "device_harness.hpp"

using namespace wstest;
using namespace wstest::dev;

namespace {

using G = gqa_layout<128>;
using M = mla_layout<512, 64>;
const double gqa_scale = 1.0 / std::sqrt(128.0);
const double mla_scale = 1.0 / std::sqrt(192.0);

template <class Layout>
using tp_gqa = tensor_parallel_gqa<Layout, cuda_backend, cuda_host_alloc, fixed_ratio>;
template <class Layout>
using tp_mla = tensor_parallel_mla<Layout, cuda_backend, cuda_host_alloc, fixed_ratio>;

/// One cuda_backend per rank, rank r's on devices[r] (created with that
/// device current); device 0 is current again afterwards.
struct rank_backends {
  std::vector<std::unique_ptr<cuda_backend>> owned;
  std::vector<cuda_backend*> ptrs;
  explicit rank_backends(const std::vector<int>& devices) {
    for (int d : devices) {
      WS_CUDA_TRY(cudaSetDevice(d));
      owned.push_back(std::make_unique<cuda_backend>());
      ptrs.push_back(owned.back().get());
    }
    WS_CUDA_TRY(cudaSetDevice(0));
  }
  std::span<cuda_backend* const> span() const { return ptrs; }
};

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Worst |a - b| over two equally long vectors (equal values, infinities included, count 0).
double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    const double d = std::abs(double(a[i]) - double(b[i]));
    m = std::max(m, std::isnan(d) ? INFINITY : d);
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

/// Drives `tp` (on device backends, rank 0 on device 0) and one cache of the
/// full layout on its own cuda_backend (device 0) with the same tokens and
/// queries; compares every layer of every step. The inputs of each side are
/// uploaded on its caller stream (the composite's: rank 0's), its outputs
/// poisoned there before the step and downloaded after it.
template <class TP, class Layout>
run_stats drive(TP& tp, const Layout& L, const partition_spec& spec, const std::vector<index_t>& prompts, int steps,
                double scale, bool check_placement) {
  using single_cache = device_cache<Layout, fixed_ratio>;
  cuda_backend be;
  single_cache single(be, L, spec, fixed_ratio(0.5), {}, cache_options{true});
  hybrid_attention<single_cache> attn(single, attention_options{2, true});
  activation_io<device_space, single_cache> io1(single);
  activation_io<device_space, typename TP::cache_type> io_tp(tp.cache(0));  // rank 0's caller stream
  bf16_source src(4321);
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
      tp.append_prefill(l, a, io_tp.kv(kv));
      single.append_prefill(l, b, io1.kv(kv));
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
    const bool with_lse = step % 5 != 4;
    for (int l = 0; l < layers; ++l) {
      auto kv = gen.make(L, index_t(batch.size()), src);
      tp.append(l, batch, io_tp.kv(kv));
      single.append(l, batch, io1.kv(kv));
      for (std::size_t i = 0; i < batch.size(); ++i) record(hist[idx[i]][std::size_t(l)], L, kv, index_t(i), 1);
      q.resize(batch.size() * std::size_t(hq) * Q);
      for (float& x : q) x = src.next_float();
      const std::size_t rows = batch.size() * std::size_t(hq);
      step_outputs<device_space> so1 = io_tp.outputs(o1, l1, rows, V, nullptr);  // poisoned (0xff)
      step_outputs<device_space> so2 = io1.outputs(o2, l2, rows, V, nullptr);
      if (!with_lse) so1.lse = {};
      tp.step(l, batch, io_tp.queries(q), float(scale), so1);
      attn.step(l, batch, io1.queries(q), float(scale), so2);
      io_tp.fetch(o1, l1);
      io1.fetch(o2, l2);
      s.bit_identical = s.bit_identical && same_bits(o1, o2) && (!with_lse || same_bits(l1, l2));
      s.max_diff_out = std::max(s.max_diff_out, max_abs_diff(o1, o2));
      if (with_lse) s.max_diff_lse = std::max(s.max_diff_lse, max_abs_diff(l1, l2));
      std::vector<double> ro, rl;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        reference_attention(L, hist[idx[i]][std::size_t(l)], q.data() + i * std::size_t(hq) * Q, scale, ro, rl);
        compare_rows(hq, V, o1.data() + i * std::size_t(hq) * V, with_lse ? l1.data() + i * std::size_t(hq) : nullptr,
                     ro, rl, s.ref);
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

/// Every rank holds tokens in the unpinned and in the pinned region.
template <class TP>
void check_both_regions(TP& tp, int sequences) {
  for (int r = 0; r < tp.ranks(); ++r) {
    index_t cpu = 0, pinned = 0;
    for (sequence_id id = 0; id < sequences; ++id) {
      const sequence_state& st = tp.cache(r).sequence(tp.rank_sequence(r, id));
      cpu += st.cpu_placed_tokens;
      pinned += st.placed_tokens - st.cpu_placed_tokens - st.hbm_placed_tokens;
    }
    CAPTURE(r);
    CHECK(cpu > 0);
    CHECK(pinned > 0);
  }
}

// The prompts: batch boundaries of D = 32 crossed during the steps by every
// sequence that decodes long enough, several eviction batches per rank.
const std::vector<index_t> prompts{5, 50, 150, 250};

struct placement_case {
  const char* name;
  std::vector<int> devices;
};

std::vector<placement_case> placements() {
  std::vector<placement_case> c{{"1 rank on device 0", {0}}, {"2 ranks on device 0", {0, 0}}};
  if (device_count() >= 2)
    c.push_back({"2 ranks on devices 0 and 1", {0, 1}});
  else
    MESSAGE("one CUDA device: the case of 2 ranks on devices 0 and 1 is skipped");
  return c;
}

}  // namespace

TEST_CASE("tensor_parallel_gqa on cuda_backend: bit-identical to one cache of the full layout, and the fp64 reference") {
  const G L(32, 8);
  const int steps = scaled(20, 8, 4);
  for (const placement_case& pc : placements()) {
    CAPTURE(pc.name);
    const int n = int(pc.devices.size());
    rank_backends be(pc.devices);
    const G rl(32 / n, 8 / n);
    tp_gqa<G> tp(be.span(), L, small_spec_for(rl, 2, 4, 6), fixed_ratio(0.5), attention_options{4, true}, {},
                 cache_options{true});
    CHECK(tp.rank_layout() == rl);
    const run_stats s = drive(tp, L, small_spec_for(L, 2, 4, 6), prompts, steps, gqa_scale, true);
    INFO("rel_l2 " << s.ref.max_rel_l2 << ", lse excess " << s.ref.max_lse_err << ", non-finite " << s.ref.non_finite);
    CHECK(s.evictions > 0);
    CHECK(s.ref.ok());
    CHECK(s.placement_mismatches == 0);
    CHECK(s.bit_identical);
    CHECK(s.max_diff_out == 0.0);
    CHECK(s.max_diff_lse == 0.0);
    check_both_regions(tp, int(prompts.size()));
    MESSAGE("GQA " << pc.name << ": " << s.steps << " steps, " << s.evictions << " evictions, bit-identical "
                   << s.bit_identical);
  }
}

TEST_CASE("tensor_parallel_mla on cuda_backend: the ranks' merge against one cache of the full layout and the fp64 reference") {
  const M L(16);
  const int steps = scaled(20, 8, 4);
  for (const placement_case& pc : placements()) {
    CAPTURE(pc.name);
    const int n = int(pc.devices.size());
    rank_backends be(pc.devices);
    const partition_spec spec = small_spec_for(L, 2, 4, 6);
    tp_mla<M> tp(be.span(), L, spec, fixed_ratio(0.5), attention_options{4, true}, {}, cache_options{true});
    const run_stats s = drive(tp, L, spec, prompts, steps, mla_scale, false);
    INFO("rel_l2 " << s.ref.max_rel_l2 << ", lse excess " << s.ref.max_lse_err << ", non-finite " << s.ref.non_finite
                   << ", max |out diff| " << s.max_diff_out << ", max |lse diff| " << s.max_diff_lse);
    CHECK(s.evictions > 0);
    CHECK(s.ref.ok());
    CHECK(s.max_diff_out <= 2e-5);
    CHECK(s.max_diff_lse <= 2e-5);
    if (n == 1) CHECK(s.bit_identical);  // one rank: the merge from the empty state is the identity
    check_both_regions(tp, int(prompts.size()));
    // each rank holds whole eviction batches only, and every token once
    for (int r = 0; r < n; ++r)
      for (sequence_id id = 0; id < sequence_id(prompts.size()); ++id)
        CHECK(tp.cache(r).sequence(tp.rank_sequence(r, id)).placed_tokens % 32 == 0);
    for (sequence_id id = 0; id < sequence_id(prompts.size()); ++id) {
      index_t held = 0;
      for (int r = 0; r < n; ++r) held += tp.cache(r).sequence(tp.rank_sequence(r, id)).total_tokens(0);
      CHECK(held == tp.tokens(id, 0));
    }
    MESSAGE("MLA " << pc.name << ": " << s.steps << " steps, " << s.evictions << " evictions, max |out diff| "
                   << s.max_diff_out << ", bit-identical " << s.bit_identical);
  }
}

TEST_CASE("tensor_parallel on cuda_backend: one backend for two ranks is refused, naming the ranks and the device") {
  cuda_backend be;
  std::vector<cuda_backend*> ptrs{&be, &be};
  try {
    tp_gqa<G> tp(ptrs, G(32, 8), small_spec_for(G(16, 4), 1, 2), fixed_ratio(0.5));
    FAIL("no throw");
  } catch (const config_error& e) {
    CHECK(mentions(e.what(), {"tensor_parallel_gqa", "ranks 0 and 1", "same backend", "device 0"}));
  }
  CHECK_THROWS_AS(tp_mla<M>(ptrs, M(16), small_spec_for(M(16), 1, 2), fixed_ratio(0.5)), config_error);
}
