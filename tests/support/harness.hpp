// SPDX-License-Identifier: Apache-2.0
// tests/support/harness.hpp — shared test machinery: seeded bf16 KV, a
// history of every token written (the reference's own copy, independent of
// the cache), a decode-loop driver for any backend (activation_io), and
// comparison with the fp64 reference under the pass bar of docs/RELIABILITY.md:
//   relative L2 error per (sequence, head) <= 5e-3, LSE within 1e-3 + 1e-5·|LSE|,
//   never NaN/Inf in outputs, never NaN/+Inf in an LSE.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <cstring>
#include <bit>
#include <initializer_list>
#include <optional>
#include <random>
#include <span>
#include <vector>

// The fp64 reference is single-threaded: Eigen's OpenMP GEMM would spin
// against the CPU engine's threads and the emulated GPU worker (2-core CI).
#ifndef EIGEN_DONT_PARALLELIZE
#  define EIGEN_DONT_PARALLELIZE
#endif
#include <writescope/reference.hpp>
#include <writescope/writescope.hpp>

namespace wstest {

using namespace writescope;

inline constexpr double rel_l2_bar = 5e-3;

/// True when the environment variable `name` is set to something other than "" or "0".
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && *v != '0';
}

/// True when the tests should run the smallest sizes that still reach every
/// code path of a case: WS_TEST_SANITIZER=1 (compute-sanitizer racecheck, whose
/// shared-memory instrumentation makes the attention kernels far slower than
/// memcheck does). Implies quick().
inline bool sanitizer_sizes() { return env_flag("WS_TEST_SANITIZER"); }

/// True when the tests should run reduced sizes (sanitizer runs): WS_TEST_QUICK=1,
/// or WS_TEST_SANITIZER=1. The device tests (tests/cuda) and the shared bodies
/// they run set their sizes with it; the host ctest runs never set either.
inline bool quick() { return env_flag("WS_TEST_QUICK") || sanitizer_sizes(); }

/// `full` normally, `reduced` under WS_TEST_QUICK.
inline int scaled(int full, int reduced) { return quick() ? reduced : full; }

/// `full` normally, `reduced` under WS_TEST_QUICK, `smallest` under WS_TEST_SANITIZER.
inline int scaled(int full, int reduced, int smallest) { return sanitizer_sizes() ? smallest : scaled(full, reduced); }

/// Every token written to one (sequence, layer): per plane, token-major
/// [tokens][kv_heads][row] bf16.
template <kv_layout Layout>
struct kv_history {
  std::vector<bf16> planes[Layout::planes];
  index_t tokens = 0;
};

/// Seeded N(0,1) (or mean + sd·N(0,1)) values rounded to bf16.
struct bf16_source {
  std::mt19937_64 rng;
  explicit bf16_source(std::uint64_t seed) : rng(seed) {}
  bf16 next(float mean = 0.0f, float sd = 1.0f) {
    std::normal_distribution<float> d(mean, sd);
    return bf16::from_float(d(rng));
  }
  float next_float() {
    std::normal_distribution<float> d(0.0f, 1.0f);
    return d(rng);
  }
};

/// Token-major KV for `n` tokens, one vector per plane.
template <kv_layout Layout>
struct kv_batch {
  std::vector<bf16> planes[Layout::planes];
  index_t n = 0;
  kv_tokens<Layout, pageable_host_space> view() const {
    kv_tokens<Layout, pageable_host_space> t;
    for (int p = 0; p < Layout::planes; ++p) t.planes[std::size_t(p)] = planes[p].data();
    t.num_tokens = n;
    return t;
  }
};

/// Value generator: by default N(0,1) for every plane; tests override it to
/// make structured values (V = kv_head + 1, V = 1 + 0.25·N(0,1), ...).
template <kv_layout Layout>
struct kv_generator {
  // value(plane, kv_head, elem, source) -> bf16
  std::function<bf16(int, int, int, bf16_source&)> value = [](int, int, int, bf16_source& s) { return s.next(); };

  kv_batch<Layout> make(const Layout& L, index_t n, bf16_source& src) const {
    kv_batch<Layout> b;
    b.n = n;
    for (int p = 0; p < Layout::planes; ++p) {
      b.planes[p].resize(std::size_t(n * L.kv_heads() * Layout::row_elems));
      for (index_t t = 0; t < n; ++t)
        for (int h = 0; h < L.kv_heads(); ++h)
          for (int i = 0; i < Layout::row_elems; ++i)
            b.planes[p][std::size_t((t * L.kv_heads() + h) * Layout::row_elems + i)] = value(p, h, i, src);
    }
    return b;
  }
};

/// Appends tokens [first, first+count) of batch `b` (or one token `first` for
/// each of several histories) to a history.
template <kv_layout Layout>
void record(kv_history<Layout>& hist, const Layout& L, const kv_batch<Layout>& b, index_t first, index_t count) {
  const index_t row = index_t(L.kv_heads()) * Layout::row_elems;
  for (int p = 0; p < Layout::planes; ++p)
    hist.planes[p].insert(hist.planes[p].end(), b.planes[p].begin() + std::ptrdiff_t(first * row),
                          b.planes[p].begin() + std::ptrdiff_t((first + count) * row));
  hist.tokens += count;
}

/// fp64 reference of one sequence in absorbed/natural form for this layout.
template <kv_layout Layout>
void reference_attention(const Layout& L, const kv_history<Layout>& h, const float* q, double scale,
                         std::vector<double>& o, std::vector<double>& lse) {
  o.assign(std::size_t(L.num_q_heads()) * Layout::v_dim, 0.0);
  lse.assign(std::size_t(L.num_q_heads()), 0.0);
  if constexpr (Layout::is_mla) {
    reference::mla_absorbed_decode(L.num_q_heads(), Layout::kv_lora_rank, Layout::rope_dim, q, h.planes[0].data(),
                                   h.tokens, scale, o.data(), lse.data());
  } else {
    reference::gqa_decode(L.num_q_heads(), L.kv_heads(), Layout::head_dim, q, h.planes[0].data(), h.planes[1].data(),
                          h.tokens, scale, o.data(), lse.data());
  }
}

/// Worst errors of a comparison.
struct compare_result {
  double max_rel_l2 = 0.0;
  double max_lse_err = 0.0;  ///< |lse - ref| - (1e-3 + 1e-5|ref|): <= 0 passes
  bool non_finite = false;
  bool ok() const { return !non_finite && max_rel_l2 <= rel_l2_bar && max_lse_err <= 0.0; }
};

/// Compares one sequence's output rows [Hq][v_dim] and LSE [Hq] with the reference.
inline void compare_rows(int hq, int v_dim, const float* o, const float* lse, const std::vector<double>& ro,
                         const std::vector<double>& rlse, compare_result& r) {
  for (int h = 0; h < hq; ++h) {
    double num = 0, den = 0;
    for (int i = 0; i < v_dim; ++i) {
      const double x = o[h * v_dim + i];
      if (!std::isfinite(x)) r.non_finite = true;
      const double d = x - ro[std::size_t(h * v_dim + i)];
      num += d * d;
      den += ro[std::size_t(h * v_dim + i)] * ro[std::size_t(h * v_dim + i)];
    }
    r.max_rel_l2 = std::max(r.max_rel_l2, den > 0 ? std::sqrt(num / den) : std::sqrt(num));
    if (lse) {
      if (std::isnan(lse[h]) || lse[h] == INFINITY) r.non_finite = true;
      const double ref = rlse[std::size_t(h)];
      if (std::isinf(ref) && ref < 0) {
        if (!(std::isinf(lse[h]) && lse[h] < 0)) r.max_lse_err = std::max(r.max_lse_err, 1.0);
      } else {
        r.max_lse_err = std::max(r.max_lse_err, std::abs(lse[h] - ref) - (1e-3 + 1e-5 * std::abs(ref)));
      }
    }
  }
}

/// How a decode_driver hands its inputs to the cache in the backend's
/// activation space and gets the outputs back in host memory (where the
/// reference compares them). This primary template serves backends whose
/// activations are host memory (host_backend and types derived from it): the
/// host vectors are handed over as they are. tests/cuda/device_harness.hpp
/// specializes it for device_space (uploads on the caller stream, downloads
/// after the step), so one driver and one test body serve both backends.
template <class Space, class Cache>
class activation_io {
 public:
  using layout_type = typename Cache::layout_type;
  explicit activation_io(Cache&) {}

  /// The batch as the cache's input (valid until the next call).
  kv_tokens<layout_type, Space> kv(const kv_batch<layout_type>& b) {
    kv_tokens<layout_type, Space> t;
    for (int p = 0; p < layout_type::planes; ++p) t.planes[std::size_t(p)] = b.planes[p].data();
    t.num_tokens = b.n;
    return t;
  }
  /// The queries (host copy `q`, [batch][Hq][q_dim]) as the step's input.
  mem_span<const float, Space> queries(const std::vector<float>& q) {
    return mem_span<const float, Space>(q.data(), index_t(q.size()));
  }
  /// Outputs of a step of `rows` (batch x Hq) rows: filled with NaN first (an
  /// unwritten element shows); fetch() makes them readable in out / lse.
  step_outputs<Space> outputs(std::vector<float>& out, std::vector<float>& lse, std::size_t rows, int v_dim,
                              debug_partials* dbg) {
    out.assign(rows * std::size_t(v_dim), std::numeric_limits<float>::quiet_NaN());
    lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
    return {mem_span<float, Space>(out.data(), index_t(out.size())), mem_span<float, Space>(lse.data(), index_t(lse.size())),
            dbg};
  }
  void fetch(std::vector<float>&, std::vector<float>&) {}
};

/// A cache + attention + the reference's own history of every token, driven
/// through prefill and decode steps, on any backend (activation_io moves the
/// inputs and outputs). Queries are regenerated per step from the seeded source.
template <class Cache>
class decode_driver {
 public:
  using layout_type = typename Cache::layout_type;
  using activation_space = typename Cache::activation_space;
  using io_type = activation_io<activation_space, Cache>;
  static constexpr int Q = layout_type::q_dim;
  static constexpr int V = layout_type::v_dim;
  static constexpr int P = layout_type::planes;

  decode_driver(Cache& cache, attention_options opts, std::uint64_t seed, double scale)
      : cache_(cache), attn_(cache, opts), src_(seed), scale_(scale), io_(cache) {}

  kv_generator<layout_type> gen;

  /// Optional query generator qgen(head, elem, source); default N(0,1).
  std::function<float(int, int, bf16_source&)> qgen;
  /// Called on every decode append, before the KV is handed to the cache
  /// (e.g. a spin kernel on the device's caller stream).
  std::function<void(int layer)> before_append;

  /// Begins a sequence with a prompt of `p` tokens and writes every layer's prompt.
  /// With `seed`, the sequence draws its KV and queries from its own source, so
  /// its inputs do not depend on its batchmates (batch-invariance tests, K10).
  sequence_id add(index_t p, std::optional<std::uint64_t> seed = std::nullopt) {
    const sequence_id id = cache_.begin_sequence(p);
    if (std::size_t(id) >= hist_.size()) {
      hist_.resize(std::size_t(id) + 1);
      own_src_.resize(std::size_t(id) + 1);
    }
    own_src_[std::size_t(id)].reset();
    if (seed) own_src_[std::size_t(id)].emplace(*seed);
    hist_[std::size_t(id)].assign(std::size_t(cache_.spec().num_layers), kv_history<layout_type>{});
    for (int l = 0; l < cache_.spec().num_layers && p > 0; ++l) {  // an empty prompt needs no prefill
      auto b = gen.make(cache_.layout(), p, source_of(id));
      cache_.append_prefill(l, id, io_.kv(b));
      record(hist_[std::size_t(id)][std::size_t(l)], cache_.layout(), b, 0, p);
    }
    return id;
  }

  void remove(sequence_id id) {
    cache_.end_sequence(id);
    hist_[std::size_t(id)].clear();
    own_src_[std::size_t(id)].reset();
  }

  /// One decode step over every layer for `batch`: append one token per
  /// sequence, attend, compare (if `check`), then flush. Returns worst errors.
  /// layer_out[l] / layer_lse[l] keep every layer's outputs of the step.
  compare_result step(std::span<const sequence_id> batch, bool check = true, debug_partials* dbg = nullptr) {
    compare_result r;
    layer_out.resize(std::size_t(cache_.spec().num_layers));
    layer_lse.resize(std::size_t(cache_.spec().num_layers));
    for (int l = 0; l < cache_.spec().num_layers; ++l) {
      append_layer(l, batch);
      attend_layer(l, batch, check, r, dbg);
      layer_out[std::size_t(l)] = out;
      layer_lse[std::size_t(l)] = lse;
    }
    last_flush = cache_.flush();
    return r;
  }

  /// Appends one new token per sequence of `batch` to `layer` (and to the history).
  void append_layer(int l, std::span<const sequence_id> batch) {
    const layout_type& L = cache_.layout();
    const bool own = std::any_of(batch.begin(), batch.end(), [&](sequence_id s) { return has_own_source(s); });
    kv_batch<layout_type> b;
    if (!own) {
      b = gen.make(L, index_t(batch.size()), src_);
    } else {  // token by token, each from its sequence's source
      b.n = index_t(batch.size());
      for (sequence_id s : batch) {
        auto one = gen.make(L, 1, source_of(s));
        for (int p = 0; p < P; ++p) b.planes[p].insert(b.planes[p].end(), one.planes[p].begin(), one.planes[p].end());
      }
    }
    if (before_append) before_append(l);
    cache_.append(l, batch, io_.kv(b));
    for (std::size_t i = 0; i < batch.size(); ++i) record(hist_[std::size_t(batch[i])][std::size_t(l)], L, b, index_t(i), 1);
  }

  /// Generates the queries of `batch` (host copy in `q`) and hands them over.
  mem_span<const float, activation_space> make_queries(std::span<const sequence_id> batch) {
    const int hq = cache_.layout().num_q_heads();
    q.resize(batch.size() * std::size_t(hq) * Q);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      bf16_source& s = source_of(batch[i]);
      float* row = q.data() + i * std::size_t(hq) * Q;
      for (int h = 0; h < hq; ++h)
        for (int e = 0; e < Q; ++e) row[std::size_t(h) * Q + std::size_t(e)] = qgen ? qgen(h, e, s) : s.next_float();
    }
    return io_.queries(q);
  }

  /// Attends one layer (no append), brings the outputs to out/lse and compares.
  void attend_layer(int l, std::span<const sequence_id> batch, bool check, compare_result& r,
                    debug_partials* dbg = nullptr) {
    const auto qa = make_queries(batch);
    const auto so = io_.outputs(out, lse, batch.size() * std::size_t(cache_.layout().num_q_heads()), V, dbg);
    last_report = attn_.step(l, batch, qa, float(scale_), so);
    io_.fetch(out, lse);
    if (check) compare(l, batch, r);
  }

  /// Compares out/lse of the last attended layer with the fp64 reference.
  void compare(int l, std::span<const sequence_id> batch, compare_result& r) const {
    const layout_type& L = cache_.layout();
    const int hq = L.num_q_heads();
    std::vector<double> ro, rl;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      reference_attention(L, hist_[std::size_t(batch[i])][std::size_t(l)], q.data() + i * std::size_t(hq) * Q, scale_,
                          ro, rl);
      compare_rows(hq, V, out.data() + i * std::size_t(hq) * V, lse.data() + i * std::size_t(hq), ro, rl, r);
    }
  }

  /// Byte-exact check of tokens [first, first + count) of `id` in `layer`:
  /// what the cache holds (read_token, wherever the token lives) against the
  /// history. Returns the number of mismatching tokens.
  int count_mismatches(sequence_id id, int layer, index_t first, index_t count) const {
    const layout_type& L = cache_.layout();
    const std::size_t row = std::size_t(L.kv_heads()) * layout_type::row_elems;
    std::vector<bf16> got(std::size_t(P) * row);
    const kv_history<layout_type>& h = hist_[std::size_t(id)][std::size_t(layer)];
    int bad = 0;
    for (index_t t = first; t < first + count; ++t) {
      cache_.read_token(layer, id, t, got);
      bool same = true;
      for (int p = 0; p < P && same; ++p)
        same = std::memcmp(got.data() + std::size_t(p) * row, h.planes[p].data() + std::size_t(t) * row,
                           row * sizeof(bf16)) == 0;
      bad += same ? 0 : 1;
    }
    return bad;
  }

  /// After a flush: byte-exact check of the batch every sequence of `batch`
  /// just evicted (its last D placed tokens), in every layer. Returns mismatches.
  int check_evicted(std::span<const sequence_id> batch, std::span<const index_t> placed_before) const {
    int bad = 0;
    const int D = cache_.spec().d_window_tokens;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const sequence_state& st = cache_.sequence(batch[i]);
      if (st.placed_tokens == placed_before[i]) continue;
      for (int l = 0; l < cache_.spec().num_layers; ++l) bad += count_mismatches(batch[i], l, st.placed_tokens - D, D);
    }
    return bad;
  }

  /// Placed tokens of each sequence of `batch` (for check_evicted).
  std::vector<index_t> placed(std::span<const sequence_id> batch) const {
    std::vector<index_t> v;
    for (sequence_id s : batch) v.push_back(cache_.sequence(s).placed_tokens);
    return v;
  }

  const kv_history<layout_type>& history(sequence_id id, int layer) const { return hist_[std::size_t(id)][std::size_t(layer)]; }
  kv_history<layout_type>& history(sequence_id id, int layer) { return hist_[std::size_t(id)][std::size_t(layer)]; }
  hybrid_attention<Cache>& attention() { return attn_; }
  bf16_source& source() { return src_; }

  bool has_own_source(sequence_id id) const {
    return std::size_t(id) < own_src_.size() && own_src_[std::size_t(id)].has_value();
  }
  bf16_source& source_of(sequence_id id) { return has_own_source(id) ? *own_src_[std::size_t(id)] : src_; }
  double scale() const { return scale_; }
  Cache& cache() { return cache_; }
  const Cache& cache() const { return cache_; }
  io_type& io() { return io_; }

  std::vector<float> q, out, lse;
  std::vector<std::vector<float>> layer_out, layer_lse;
  step_report last_report;
  flush_report last_flush;

 private:
  Cache& cache_;
  hybrid_attention<Cache> attn_;
  bf16_source src_;
  double scale_;
  std::vector<std::vector<kv_history<layout_type>>> hist_;
  std::vector<std::optional<bf16_source>> own_src_;
  io_type io_;
};

/// Dense and sparse steps with the same queries on a decode_driver's cache,
/// on any backend; out / lse hold the last step's outputs in host memory.
template <class Cache>
struct step_runner {
  using layout_type = typename Cache::layout_type;
  using activation_space = typename Cache::activation_space;
  static constexpr int Q = layout_type::q_dim;
  static constexpr int V = layout_type::v_dim;
  explicit step_runner(decode_driver<Cache>& driver) : d(driver), io(driver.cache()) {}
  decode_driver<Cache>& d;
  activation_io<activation_space, Cache> io;  ///< its own output buffers: the driver's stay as they are
  mem_span<const float, activation_space> qa;
  std::vector<float> out, lse;
  step_report rep;

  /// The queries of `batch` (host copy: d.q), drawn from each sequence's source.
  void make_queries(std::span<const sequence_id> batch) { qa = d.make_queries(batch); }
  /// NaN (bf16 0xffff) into every ping-pong buffer of the cache: a step that
  /// fails to move a block then cannot read one left there by an earlier step.
  void poison_ping_pong() {
    const layer_views<layout_type> v = d.cache().views(0);
    d.cache().backend().fill_device(reinterpret_cast<std::byte*>(v.ping_pong.buffer(0).data()),
                                    index_t(v.ping_pong.size()) * v.ping_pong_blocks * v.format.block_bytes(), 0xffff);
  }
  void dense(int l, std::span<const sequence_id> batch, debug_partials* dbg = nullptr) {
    const auto so = outputs(batch.size(), dbg);
    rep = d.attention().step(l, batch, qa, float(d.scale()), so);
    io.fetch(out, lse);
  }
  template <class Selector>
  void sparse(int l, std::span<const sequence_id> batch, Selector& sel, debug_partials* dbg = nullptr) {
    sparse_with(d.attention(), l, batch, sel, dbg);
  }
  /// A sparse step through another attention object on the same cache.
  template <class Attention, class Selector>
  void sparse_with(Attention& attn, int l, std::span<const sequence_id> batch, Selector& sel,
                   debug_partials* dbg = nullptr) {
    const auto so = outputs(batch.size(), dbg);
    rep = attn.step(l, batch, qa, float(d.scale()), so, sel);
    io.fetch(out, lse);
  }

 private:
  step_outputs<activation_space> outputs(std::size_t batch, debug_partials* dbg) {
    return io.outputs(out, lse, batch * std::size_t(d.cache().layout().num_q_heads()), V, dbg);
  }
};

/// The roofline policy of the tests: fixed costs of 20 / 30 us, 2.0 / 1.4 ns
/// per CPU / GPU token, a cost window of `window` samples.
inline roofline_policy test_roofline(int window = 8, bool track_gpu_cost = false) {
  roofline_params p;
  p.cpu_cost_per_token_seconds = 2.0e-9;
  p.gpu_cost_per_token_seconds = 1.4e-9;
  p.cpu_fixed_seconds = 20e-6;
  p.gpu_fixed_seconds = 30e-6;
  p.cost_window_samples = window;
  p.track_gpu_cost = track_gpu_cost;
  return roofline_policy(p);
}

/// A small spec for tests: block 16, D 32, generous capacities.
inline partition_spec small_spec(int layers = 1, int max_seqs = 4, int block_tokens = 16, int d_window = 32) {
  partition_spec s;
  s.num_layers = layers;
  s.block_tokens = block_tokens;
  s.d_window_tokens = d_window;
  s.max_sequences = max_seqs;
  s.cpu_capacity_tokens = 8192;
  s.pinned_capacity_tokens = 8192;
  s.pinned_initial_tokens = 0;
  s.gpu_split_blocks = 4;
  s.cpu_task_blocks = 3;
  s.ping_pong_bytes = 0;  // set by caller via set_ping_pong_blocks
  s.first_chunk_bytes = 1;  // the ramp from one split (chunks of split, 2 x split, ... blocks): every test streams through it
  return s;
}

template <kv_layout Layout>
void set_ping_pong_blocks(partition_spec& s, const Layout& L, index_t blocks) {
  s.ping_pong_bytes = blocks * block_format<Layout>{L, s.block_tokens}.block_bytes();
}

template <kv_layout Layout, routing_policy Policy>
using host_cache = inplace_kv_cache<Layout, host_backend, pageable_allocator, Policy>;

/// The types a test body written once (sparse_checks.hpp) needs of a backend:
/// its cache over a layout and a policy, and its decode driver. This is the
/// host backend's; tests/cuda/device_harness.hpp specializes it for
/// cuda_backend, so that the body runs on both with the same assertions.
template <class Backend>
struct backend_traits {
  /// Whether the backend's activations live on a device (sizes under WS_TEST_QUICK, ...).
  static constexpr bool device = false;
  /// The allocator of the pinned region in most tests, and the one of the
  /// 5 GiB regions past 4 GiB (K4/C7): reserved address space, pages on first touch.
  using allocator = pageable_allocator;
  using large_allocator = pageable_allocator;
  template <kv_layout Layout, routing_policy Policy, class Alloc = allocator>
  using cache = inplace_kv_cache<Layout, Backend, Alloc, Policy>;
  template <class Cache>
  using driver = decode_driver<Cache>;
};

/// small_spec(layers, max_seqs, block_tokens, d_window) with a ping-pong of
/// `ping_pong_blocks` blocks of layout `L`.
template <kv_layout Layout>
partition_spec small_spec_for(const Layout& L, int layers, int max_seqs, index_t ping_pong_blocks = 6,
                              int block_tokens = 16, int d_window = 32) {
  partition_spec s = small_spec(layers, max_seqs, block_tokens, d_window);
  set_ping_pong_blocks(s, L, ping_pong_blocks);
  return s;
}

/// A backend, a cache on it (backend_traits::cache, with the cache's
/// debug-poisoning on) and the backend's decode driver over the cache: the
/// setup most tests open with, written once for every backend.
template <class Backend, kv_layout Layout, routing_policy Policy>
struct test_rig {
  using cache_type = typename backend_traits<Backend>::template cache<Layout, Policy>;
  using driver_type = typename backend_traits<Backend>::template driver<cache_type>;
  Backend be;
  cache_type cache;
  driver_type d;
  test_rig(const Layout& L, const partition_spec& spec, Policy pol, attention_options ao, std::uint64_t seed,
           double scale)
      : cache(be, L, spec, std::move(pol), {}, cache_options{true}), d(cache, ao, seed, scale) {}
};

/// A test policy routing by a function of the query; every query it answers is
/// logged (shared between copies), so tests can check what the cache asked.
struct scripted_policy {
  using policy_concept = routing_policy_tag;
  std::function<placement(const route_query&)> fn = [](const route_query&) { return placement::gpu_load; };
  std::shared_ptr<std::vector<route_query>> log = std::make_shared<std::vector<route_query>>();
  route_decision route(const route_query& q) const {
    log->push_back(q);
    const placement p = fn(q);
    return {p, p == placement::cpu_compute ? share_plan{1.0, 0.0} : share_plan{0.0, 1.0}};
  }
  void observe(const cost_sample&) {}
};
static_assert(routing_policy<scripted_policy>);

/// The tokens of `h` whose index satisfies `keep`, as a history of their own.
template <kv_layout Layout, class Pred>
kv_history<Layout> select_tokens(const Layout& L, const kv_history<Layout>& h, Pred keep) {
  kv_history<Layout> r;
  const std::size_t row = std::size_t(L.kv_heads()) * Layout::row_elems;
  for (index_t t = 0; t < h.tokens; ++t) {
    if (!keep(t)) continue;
    for (int p = 0; p < Layout::planes; ++p)
      r.planes[p].insert(r.planes[p].end(), h.planes[p].begin() + std::ptrdiff_t(std::size_t(t) * row),
                         h.planes[p].begin() + std::ptrdiff_t(std::size_t(t + 1) * row));
    ++r.tokens;
  }
  return r;
}

/// Which engine attends token t of a sequence whose state is `st` (at attend time).
enum class engine { cpu = 0, streamed = 1, window = 2 };
inline engine engine_of(const sequence_state& st, index_t t, int block_tokens) {
  if (t >= st.placed_tokens) return engine::window;
  return st.block_table[std::size_t(t / block_tokens)].region == placement::cpu_compute ? engine::cpu
                                                                                       : engine::streamed;
}

/// Checks one engine's partial of batch row `i` (debug_partials) against the
/// fp64 reference of that engine's own keys: an empty key set must give exactly
/// (0, -inf); a non-empty one its own natural-log LSE (a base-2 leak shows as a
/// ratio of 1.4427) and normalised output within the bar.
template <kv_layout Layout>
compare_result check_engine_partial(const Layout& L, const kv_history<Layout>& hist, const sequence_state& st,
                                    int block_tokens, engine e, const std::vector<float>& po,
                                    const std::vector<float>& plse, std::size_t i, const float* q, double scale,
                                    bool* was_empty = nullptr) {
  const int hq = L.num_q_heads();
  constexpr int V = Layout::v_dim;
  const kv_history<Layout> sub = select_tokens(L, hist, [&](index_t t) { return engine_of(st, t, block_tokens) == e; });
  compare_result r;
  const float* o = po.data() + i * std::size_t(hq) * V;
  const float* lse = plse.data() + i * std::size_t(hq);
  if (was_empty) *was_empty = sub.tokens == 0;
  if (sub.tokens == 0) {
    for (int h = 0; h < hq; ++h) {
      if (!(std::isinf(lse[h]) && lse[h] < 0)) r.max_lse_err = std::max(r.max_lse_err, 1.0);
      for (int k = 0; k < V; ++k)
        if (std::bit_cast<std::uint32_t>(o[std::size_t(h) * V + std::size_t(k)]) != 0u) r.non_finite = true;
    }
    return r;
  }
  std::vector<double> ro, rl;
  reference_attention(L, sub, q, scale, ro, rl);
  compare_rows(hq, V, o, lse, ro, rl, r);
  return r;
}

/// Bitwise equality of two float vectors (NaN payloads and signed zeros included).
/// Tensor-parallel ranks against one cache of the full layout: the sequences
/// of `seqs` whose block table on some rank differs (in length or in a
/// block's region) from the single cache's, counted once per rank.
template <class TP, class Cache>
int rank_placement_mismatches(TP& tp, const Cache& single, std::span<const sequence_id> seqs) {
  int bad = 0;
  for (int r = 0; r < tp.ranks(); ++r)
    for (sequence_id id : seqs) {
      const sequence_state& a = tp.cache(r).sequence(tp.rank_sequence(r, id));
      const sequence_state& b = single.sequence(id);
      bool same = a.block_table.size() == b.block_table.size();
      for (std::size_t k = 0; same && k < a.block_table.size(); ++k)
        same = a.block_table[k].region == b.block_table[k].region;
      bad += same ? 0 : 1;
    }
  return bad;
}

inline bool same_bits(const float* a, const float* b, std::size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && same_bits(a.data(), b.data(), a.size());
}

/// Everything observable about a cache's bookkeeping, for strong-guarantee checks.
struct cache_snapshot {
  index_t cpu_used = 0, pinned_used = 0, cpu_capacity = 0, pinned_max = 0, total_placed = 0;
  int live = 0;
  struct seq {
    sequence_id id;
    index_t prompt, placed, cpu_placed;
    int slot;
    std::vector<std::pair<int, block_id>> table;
    std::vector<int> window;
    std::vector<std::uint8_t> ready;
    bool operator==(const seq&) const = default;
  };
  std::vector<seq> seqs;
  bool operator==(const cache_snapshot&) const = default;
};

template <class Cache>
cache_snapshot snapshot(const Cache& c, std::span<const sequence_id> ids) {
  cache_snapshot s;
  const region_usage u = c.usage();
  s.cpu_used = u.cpu_used_blocks;
  s.pinned_used = u.pinned_used_blocks;
  s.cpu_capacity = u.cpu_capacity_blocks;
  s.pinned_max = u.pinned_max_blocks;
  s.total_placed = c.total_placed_tokens();
  s.live = c.live_sequences();
  for (sequence_id id : ids) {
    const sequence_state& st = c.sequence(id);
    cache_snapshot::seq q{id, st.prompt_tokens, st.placed_tokens, st.cpu_placed_tokens, st.window_slot, {}, st.window_tokens,
                          st.layer_ready};
    for (const block_ref& b : st.block_table) q.table.emplace_back(int(b.region), b.id);
    s.seqs.push_back(std::move(q));
  }
  return s;
}

/// True when `what` contains every one of `parts`.
inline bool mentions(const std::string& what, std::initializer_list<std::string> parts) {
  for (const auto& p : parts)
    if (what.find(p) == std::string::npos) return false;
  return true;
}

}  // namespace wstest
