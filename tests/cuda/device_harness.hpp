// tests/cuda/device_harness.hpp — device-side test machinery for cuda_backend:
// the decode driver of tests/support/harness.hpp with inputs and outputs on the
// GPU. KV and queries are generated on the host (seeded), kept there as the
// reference's own history, uploaded to device scratch buffers on the backend's
// caller stream (so uploads are stream-ordered with the cache's kernels), and
// outputs are downloaded after each step. The pass bar is FAULT-KINDS.md's.
//
// Compiled by the host compiler only; GPU code is reached through
// cuda_backend and the launchers of kernels.hpp (instantiated in
// kernels_instantiate.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <writescope/cuda/cuda_backend.hpp>
#include <writescope/cuda/kernels.hpp>
#include <writescope/cuda/pinned_allocators.hpp>

#include "support/harness.hpp"

namespace wstest::dev {

using namespace writescope;

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
/// or WS_TEST_SANITIZER=1.
inline bool quick() { return env_flag("WS_TEST_QUICK") || sanitizer_sizes(); }

/// `full` normally, `reduced` under WS_TEST_QUICK.
inline int scaled(int full, int reduced) { return quick() ? reduced : full; }

/// `full` normally, `reduced` under WS_TEST_QUICK, `smallest` under WS_TEST_SANITIZER.
inline int scaled(int full, int reduced, int smallest) { return sanitizer_sizes() ? smallest : scaled(full, reduced); }

/// A device buffer that only grows; growing waits for `stream` first (the old
/// buffer may still be read by work enqueued there).
class device_scratch {
 public:
  device_scratch() = default;
  device_scratch(const device_scratch&) = delete;
  device_scratch& operator=(const device_scratch&) = delete;
  ~device_scratch() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  template <class T>
  T* get(std::size_t n, cudaStream_t stream) {
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 16);
    if (bytes > cap_) {
      WS_CUDA_TRY(cudaStreamSynchronize(stream));
      if (p_ != nullptr) WS_CUDA_TRY(cudaFree(p_));
      p_ = nullptr;
      WS_CUDA_TRY(cudaMalloc(&p_, bytes));
      cap_ = bytes;
    }
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  std::size_t cap_ = 0;
};

/// Asynchronous uploads through a ring of page-locked staging buffers. A
/// pageable cudaMemcpyAsync H2D synchronizes its stream first (CUDA's API
/// sync behaviour), which would make every race test block behind the kernel
/// it wants to race with; pinned staging keeps uploads truly asynchronous. A
/// slot is reused only after its previous copy completed (an event per slot).
class pinned_uploader {
 public:
  static constexpr int slots = 8;
  pinned_uploader() = default;
  pinned_uploader(const pinned_uploader&) = delete;
  pinned_uploader& operator=(const pinned_uploader&) = delete;
  ~pinned_uploader() {
    for (slot& s : slots_) {
      if (s.done != nullptr) {
        (void)cudaEventSynchronize(s.done);
        (void)cudaEventDestroy(s.done);
      }
      if (s.host != nullptr) (void)cudaFreeHost(s.host);
    }
  }
  /// Gives every slot at least `bytes` of staging now (allocating page-locked
  /// memory later could serialize the very work a race test overlaps).
  void reserve(std::size_t bytes) {
    for (slot& s : slots_) {
      if (s.done == nullptr) WS_CUDA_TRY(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
      if (s.cap >= bytes) continue;
      WS_CUDA_TRY(cudaEventSynchronize(s.done));
      if (s.host != nullptr) WS_CUDA_TRY(cudaFreeHost(s.host));
      s.host = nullptr;
      WS_CUDA_TRY(cudaHostAlloc(&s.host, bytes, cudaHostAllocDefault));
      s.cap = bytes;
    }
  }

  void upload(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
    if (bytes == 0) return;
    slot& s = slots_[std::size_t(next_)];
    next_ = (next_ + 1) % slots;
    if (s.done == nullptr)
      WS_CUDA_TRY(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    else
      WS_CUDA_TRY(cudaEventSynchronize(s.done));  // its previous copy has read the staging
    if (s.cap < bytes) {
      if (s.host != nullptr) WS_CUDA_TRY(cudaFreeHost(s.host));
      s.host = nullptr;
      WS_CUDA_TRY(cudaHostAlloc(&s.host, bytes, cudaHostAllocDefault));
      s.cap = bytes;
    }
    std::memcpy(s.host, src, bytes);
    WS_CUDA_TRY(cudaMemcpyAsync(dst, s.host, bytes, cudaMemcpyHostToDevice, stream));
    WS_CUDA_TRY(cudaEventRecord(s.done, stream));
  }

 private:
  struct slot {
    void* host = nullptr;
    std::size_t cap = 0;
    cudaEvent_t done = nullptr;
  };
  std::array<slot, slots> slots_{};
  int next_ = 0;
};

/// Device -> host on `stream`, complete on return.
template <class T>
void download(std::vector<T>& dst, const T* src, std::size_t n, cudaStream_t stream) {
  dst.resize(n);
  if (n == 0) return;
  WS_CUDA_TRY(cudaMemcpyAsync(dst.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
  WS_CUDA_TRY(cudaStreamSynchronize(stream));
}

/// A long kernel on `stream` (clock64 cycles; ~1e8 is tens of milliseconds).
inline void spin(cudaStream_t stream, long long cycles) { gpu::launch_spin(cycles, stream); }

/// The decode driver of harness.hpp for a cache over cuda_backend.
template <class Cache>
class device_decode_driver {
 public:
  using layout_type = typename Cache::layout_type;
  static constexpr int Q = layout_type::q_dim;
  static constexpr int V = layout_type::v_dim;
  static constexpr int P = layout_type::planes;

  device_decode_driver(Cache& cache, attention_options opts, std::uint64_t seed, double scale)
      : cache_(cache), attn_(cache, opts), src_(seed), scale_(scale) {
    // Size the per-step scratch now: growing later synchronizes the stream,
    // which would hide races behind a host wait.
    const std::size_t rows = std::size_t(cache.spec().max_sequences) * std::size_t(cache.layout().num_q_heads());
    (void)q_dev_.get<float>(rows * Q, stream());
    (void)out_dev_.get<float>(rows * V, stream());
    (void)lse_dev_.get<float>(rows, stream());
    const std::size_t kv = std::size_t(cache.spec().max_sequences) * std::size_t(cache.layout().kv_heads()) *
                           layout_type::row_elems;
    for (int p = 0; p < P; ++p) (void)kv_[p].template get<bf16>(kv, stream());
    up_.reserve(std::max<std::size_t>(std::size_t(1) << 20, rows * Q * sizeof(float)));
  }

  kv_generator<layout_type> gen;
  /// Called on every decode append, before the KV is uploaded (e.g. a spin
  /// kernel on the caller stream).
  std::function<void(int layer)> before_append;
  /// Optional query generator qgen(head, elem, source); default N(0,1).
  std::function<float(int, int, bf16_source&)> qgen;

  [[nodiscard]] cudaStream_t stream() const { return cache_.backend().caller_stream(); }

  /// Device view of a host KV batch (uploaded to the scratch buffers).
  kv_tokens<layout_type, device_space> to_device(const kv_batch<layout_type>& b) {
    kv_tokens<layout_type, device_space> t;
    t.num_tokens = b.n;
    for (int p = 0; p < P; ++p) {
      bf16* d = kv_[p].template get<bf16>(b.planes[p].size(), stream());
      up_.upload(d, b.planes[p].data(), b.planes[p].size() * sizeof(bf16), stream());
      t.planes[std::size_t(p)] = d;
    }
    return t;
  }

  /// Begins a sequence with a prompt of `p` tokens and writes every layer's prompt.
  sequence_id add(index_t p, std::optional<std::uint64_t> seed = std::nullopt) {
    const sequence_id id = cache_.begin_sequence(p);
    if (std::size_t(id) >= hist_.size()) {
      hist_.resize(std::size_t(id) + 1);
      own_src_.resize(std::size_t(id) + 1);
    }
    own_src_[std::size_t(id)].reset();
    if (seed) own_src_[std::size_t(id)].emplace(*seed);
    hist_[std::size_t(id)].assign(std::size_t(cache_.spec().num_layers), kv_history<layout_type>{});
    for (int l = 0; l < cache_.spec().num_layers; ++l) {
      auto b = gen.make(cache_.layout(), p, source_of(id));
      cache_.append_prefill(l, id, to_device(b));
      record(hist_[std::size_t(id)][std::size_t(l)], cache_.layout(), b, 0, p);
    }
    return id;
  }

  void remove(sequence_id id) {
    cache_.end_sequence(id);
    hist_[std::size_t(id)].clear();
    own_src_[std::size_t(id)].reset();
  }

  /// One decode step over every layer: append, attend, compare (if `check`),
  /// then flush. Returns the worst errors.
  compare_result step(std::span<const sequence_id> batch, bool check = true, debug_partials* dbg = nullptr) {
    compare_result r;
    layer_out.resize(std::size_t(cache_.spec().num_layers));
    for (int l = 0; l < cache_.spec().num_layers; ++l) {
      append_layer(l, batch);
      attend_layer(l, batch, check, r, dbg);
      layer_out[std::size_t(l)] = out;
    }
    last_flush = cache_.flush();
    return r;
  }

  /// Appends one token per sequence of `batch` to `layer` (and to the history).
  void append_layer(int l, std::span<const sequence_id> batch) {
    const layout_type& L = cache_.layout();
    kv_batch<layout_type> b;
    b.n = index_t(batch.size());
    for (sequence_id s : batch) {
      auto one = gen.make(L, 1, source_of(s));
      for (int p = 0; p < P; ++p) b.planes[p].insert(b.planes[p].end(), one.planes[p].begin(), one.planes[p].end());
    }
    if (before_append) before_append(l);
    cache_.append(l, batch, to_device(b));
    for (std::size_t i = 0; i < batch.size(); ++i) record(hist_[std::size_t(batch[i])][std::size_t(l)], L, b, index_t(i), 1);
  }

  /// Generates and uploads the queries of `batch` (host copy in `q`).
  mem_span<const float, device_space> make_queries(std::span<const sequence_id> batch) {
    const int hq = cache_.layout().num_q_heads();
    q.resize(batch.size() * std::size_t(hq) * Q);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      bf16_source& s = source_of(batch[i]);
      float* row = q.data() + i * std::size_t(hq) * Q;
      for (int h = 0; h < hq; ++h)
        for (int e = 0; e < Q; ++e) row[std::size_t(h) * Q + std::size_t(e)] = qgen ? qgen(h, e, s) : s.next_float();
    }
    float* dq = q_dev_.get<float>(q.size(), stream());
    up_.upload(dq, q.data(), q.size() * sizeof(float), stream());
    return mem_span<const float, device_space>(dq, index_t(q.size()));
  }

  /// Attends `layer` (no append), downloads the outputs into out/lse and compares.
  void attend_layer(int l, std::span<const sequence_id> batch, bool check, compare_result& r,
                    debug_partials* dbg = nullptr) {
    const int hq = cache_.layout().num_q_heads();
    const auto qd = make_queries(batch);
    const std::size_t rows = batch.size() * std::size_t(hq);
    float* dout = out_dev_.get<float>(rows * V, stream());
    float* dlse = lse_dev_.get<float>(rows, stream());
    WS_CUDA_TRY(cudaMemsetAsync(dout, 0xff, rows * V * sizeof(float), stream()));  // NaN: unwritten shows
    WS_CUDA_TRY(cudaMemsetAsync(dlse, 0xff, rows * sizeof(float), stream()));
    step_outputs<device_space> so{device_span<float>(dout, index_t(rows * V)), device_span<float>(dlse, index_t(rows)),
                                  dbg};
    last_report = attn_.step(l, batch, qd, float(scale_), so);
    download(out, dout, rows * V, stream());
    download(lse, dlse, rows, stream());
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
  bool has_own_source(sequence_id id) const {
    return std::size_t(id) < own_src_.size() && own_src_[std::size_t(id)].has_value();
  }
  bf16_source& source_of(sequence_id id) { return has_own_source(id) ? *own_src_[std::size_t(id)] : src_; }
  double scale() const { return scale_; }
  Cache& cache() { return cache_; }

  std::vector<float> q, out, lse;
  std::vector<std::vector<float>> layer_out;
  step_report last_report;
  flush_report last_flush;

 private:
  Cache& cache_;
  hybrid_attention<Cache> attn_;
  bf16_source src_;
  double scale_;
  std::vector<std::vector<kv_history<layout_type>>> hist_;
  std::vector<std::optional<bf16_source>> own_src_;
  pinned_uploader up_;
  device_scratch kv_[P], q_dev_, out_dev_, lse_dev_;
};

template <kv_layout Layout, routing_policy Policy, pinned_allocator Alloc = cuda_host_alloc>
using device_cache = inplace_kv_cache<Layout, cuda_backend, Alloc, Policy>;

/// A policy whose target CPU share alternates between `a` and `b` every time
/// a step is observed (every layer-step): placement flips under the stream.
class flip_policy {
 public:
  using policy_concept = routing_policy_tag;
  flip_policy(double a, double b) : a_(a), b_(b) {}
  [[nodiscard]] route_decision route(const route_query& q) const {
    const double r = flip_ ? b_ : a_;
    return {route_toward(r, q), {r, 1.0 - r}};
  }
  void observe(const cost_sample&) { flip_ = !flip_; }

 private:
  double a_, b_;
  bool flip_ = false;
};
static_assert(routing_policy<flip_policy>);

}  // namespace wstest::dev
