// SPDX-License-Identifier: Apache-2.0
// tests/cuda/device_harness.hpp — device-side test machinery for cuda_backend:
// the activation_io of tests/support/harness.hpp for device_space, so that the
// one decode_driver and step_runner run on the GPU: KV and queries are
// generated on the host (seeded), kept there as the reference's own history,
// uploaded to device scratch buffers on the backend's caller stream (so uploads
// are stream-ordered with the cache's kernels), and outputs are downloaded
// after each step. The pass bar is harness.hpp's.
//
// Compiled by the host compiler only; GPU code is reached through
// cuda_backend and the launchers of kernels.hpp (instantiated in
// kernels_instantiate.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <writescope/cuda/cuda_backend.hpp>
#include <writescope/cuda/kernels.hpp>
#include <writescope/cuda/pinned_allocators.hpp>

#include "support/harness.hpp"

namespace wstest::dev {

using namespace writescope;

// env_flag, quick(), sanitizer_sizes() and scaled() (WS_TEST_QUICK,
// WS_TEST_SANITIZER) are support/harness.hpp's: the shared bodies size by them too.

/// A device array of n elements (cudaMalloc), freed on destruction; synchronous
/// upload / download; poison() fills it with 0xff bytes (NaN for fp32).
template <class T>
class dev_array {
 public:
  explicit dev_array(std::size_t n) : n_(n) {
    void* v = nullptr;
    WS_CUDA_TRY(cudaMalloc(&v, std::max<std::size_t>(n, 1) * sizeof(T)));
    p_ = static_cast<T*>(v);
  }
  dev_array(const dev_array&) = delete;
  dev_array& operator=(const dev_array&) = delete;
  ~dev_array() { (void)cudaFree(p_); }
  T* get() const { return p_; }
  void upload(const std::vector<T>& h) {
    if (h.size() > n_)
      throw std::logic_error("dev_array: " + std::to_string(h.size()) + " elements into " + std::to_string(n_));
    if (!h.empty()) WS_CUDA_TRY(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download(std::size_t n) const {
    std::vector<T> h(n);
    if (n > 0) WS_CUDA_TRY(cudaMemcpy(h.data(), p_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void poison() { WS_CUDA_TRY(cudaMemset(p_, 0xff, std::max<std::size_t>(n_, 1) * sizeof(T))); }  // NaN for fp32

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

/// fp64 decode attention (reference.hpp) of one sequence's query rows `q`
/// ([Hq][q_dim]) over the tokens at `where` (each: a block of `pool`, the
/// block format's row in it), in that order, into o [Hq][v_dim] and lse [Hq]:
/// the reference of the device tests that lay tokens out in a pool of blocks.
template <class Layout>
void reference_over_pool(const Layout& layout, int block_tokens, const std::vector<bf16>& pool, const float* q,
                         const std::vector<std::pair<index_t, int>>& where, double scale, std::vector<double>& o,
                         std::vector<double>& lse) {
  const int hq = layout.num_q_heads();
  const int hkv = layout.kv_heads();
  constexpr int R = Layout::row_elems;
  const index_t block_elems = block_format<Layout>{layout, block_tokens}.block_elems();
  const auto L = index_t(where.size());
  std::vector<bf16> planes[2];
  for (int pl = 0; pl < Layout::planes; ++pl) planes[pl].resize(std::size_t(L) * hkv * R);
  for (index_t t = 0; t < L; ++t) {
    const auto [blk, row] = where[std::size_t(t)];
    for (int pl = 0; pl < Layout::planes; ++pl)
      for (int h = 0; h < hkv; ++h) {
        const bf16* src = pool.data() + blk * block_elems + block_format<Layout>::offset_in(hkv, block_tokens, pl, h, row, 0);
        std::memcpy(planes[pl].data() + (t * hkv + h) * R, src, R * sizeof(bf16));
      }
  }
  o.assign(std::size_t(hq) * Layout::v_dim, 0.0);
  lse.assign(std::size_t(hq), 0.0);
  if constexpr (Layout::is_mla)
    reference::mla_absorbed_decode(hq, Layout::kv_lora_rank, Layout::rope_dim, q, planes[0].data(), L, scale, o.data(),
                                   lse.data());
  else
    reference::gqa_decode(hq, hkv, Layout::head_dim, q, planes[0].data(), planes[1].data(), L, scale, o.data(),
                          lse.data());
}

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

}  // namespace wstest::dev

namespace wstest {

/// activation_io (support/harness.hpp) for a backend whose activations live
/// on the device (cuda_backend): KV and queries are uploaded to device scratch
/// buffers through the page-locked ring on the backend's caller stream (so
/// uploads are stream-ordered with the cache's kernels), outputs are filled
/// with NaN there before the step and downloaded after it. Every scratch
/// buffer is sized at construction: growing later synchronizes the stream,
/// which would hide races behind a host wait.
template <class Cache>
class activation_io<device_space, Cache> {
 public:
  using layout_type = typename Cache::layout_type;
  static constexpr int P = layout_type::planes;

  explicit activation_io(Cache& cache) : cache_(&cache) {
    const std::size_t rows = std::size_t(cache.spec().max_sequences) * std::size_t(cache.layout().num_q_heads());
    (void)q_dev_.get<float>(rows * layout_type::q_dim, stream());
    (void)out_dev_.get<float>(rows * layout_type::v_dim, stream());
    (void)lse_dev_.get<float>(rows, stream());
    const std::size_t kv = std::size_t(cache.spec().max_sequences) * std::size_t(cache.layout().kv_heads()) *
                           layout_type::row_elems;
    for (int p = 0; p < P; ++p) (void)kv_[p].template get<bf16>(kv, stream());
    up_.reserve(std::max<std::size_t>(std::size_t(1) << 20, rows * layout_type::q_dim * sizeof(float)));
  }

  [[nodiscard]] cudaStream_t stream() const { return cache_->backend().caller_stream(); }

  kv_tokens<layout_type, device_space> kv(const kv_batch<layout_type>& b) {
    kv_tokens<layout_type, device_space> t;
    t.num_tokens = b.n;
    for (int p = 0; p < P; ++p) {
      bf16* d = kv_[p].template get<bf16>(b.planes[p].size(), stream());
      up_.upload(d, b.planes[p].data(), b.planes[p].size() * sizeof(bf16), stream());
      t.planes[std::size_t(p)] = d;
    }
    return t;
  }
  mem_span<const float, device_space> queries(const std::vector<float>& q) {
    float* dq = q_dev_.get<float>(q.size(), stream());
    up_.upload(dq, q.data(), q.size() * sizeof(float), stream());
    return mem_span<const float, device_space>(dq, index_t(q.size()));
  }
  step_outputs<device_space> outputs(std::vector<float>&, std::vector<float>&, std::size_t rows, int v_dim,
                                     debug_partials* dbg) {
    out_elems_ = rows * std::size_t(v_dim);
    rows_ = rows;
    float* o = out_dev_.get<float>(out_elems_, stream());
    float* l = lse_dev_.get<float>(rows_, stream());
    WS_CUDA_TRY(cudaMemsetAsync(o, 0xff, out_elems_ * sizeof(float), stream()));  // NaN: unwritten shows
    WS_CUDA_TRY(cudaMemsetAsync(l, 0xff, rows_ * sizeof(float), stream()));
    return {device_span<float>(o, index_t(out_elems_)), device_span<float>(l, index_t(rows_)), dbg};
  }
  void fetch(std::vector<float>& out, std::vector<float>& lse) {
    dev::download(out, out_dev_.get<float>(out_elems_, stream()), out_elems_, stream());
    dev::download(lse, lse_dev_.get<float>(rows_, stream()), rows_, stream());
  }

 private:
  Cache* cache_;
  dev::pinned_uploader up_;
  dev::device_scratch kv_[P], q_dev_, out_dev_, lse_dev_;
  std::size_t out_elems_ = 0, rows_ = 0;
};

}  // namespace wstest

namespace wstest::dev {

/// The decode driver of harness.hpp on cuda_backend, with the caller stream
/// and the device upload of a KV batch at hand.
template <class Cache>
class device_decode_driver : public decode_driver<Cache> {
 public:
  using decode_driver<Cache>::decode_driver;
  [[nodiscard]] cudaStream_t stream() const { return const_cast<device_decode_driver*>(this)->io().stream(); }
  /// Device view of a host KV batch (uploaded to the scratch buffers).
  kv_tokens<typename Cache::layout_type, device_space> to_device(const kv_batch<typename Cache::layout_type>& b) {
    return this->io().kv(b);
  }
};

/// The backend of the mutation tests: cuda_backend with the run-time switches
/// of cuda_test_hooks (debug(), ablation()); kernels_instantiate.cu
/// instantiates its slow-consumer kernels.
using mutation_backend = basic_cuda_backend<cuda_test_hooks>;

template <kv_layout Layout, routing_policy Policy, pinned_allocator Alloc = cuda_host_alloc, class Backend = cuda_backend>
using device_cache = inplace_kv_cache<Layout, Backend, Alloc, Policy>;

}  // namespace wstest::dev

namespace wstest {

/// The shared test bodies' types on cuda_backend, with either hooks (support/harness.hpp).
template <cuda_hooks Hooks>
struct backend_traits<basic_cuda_backend<Hooks>> {
  static constexpr bool device = true;
  using allocator = cuda_host_alloc;
  using large_allocator = cuda_host_register;  // K4/C7: registered in place, no 5 GiB cudaHostAlloc
  template <kv_layout Layout, routing_policy Policy, class Alloc = allocator>
  using cache = dev::device_cache<Layout, Policy, Alloc, basic_cuda_backend<Hooks>>;
  template <class Cache>
  using driver = dev::device_decode_driver<Cache>;
};

}  // namespace wstest

namespace wstest::dev {

/// The tests' roofline policy on the device: a 16-sample window, B re-measured online.
inline roofline_policy device_roofline() { return test_roofline(16, true); }

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
