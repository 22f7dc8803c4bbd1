// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/cuda_backend.hpp — the real device backend (paper §4.2,
// §4.3, §6; docs/CUDA-ENGINE.md). Host compiler only: this header holds no kernels and
// includes nothing beyond <cuda_runtime_api.h>; the kernels it launches are
// declared in kernels.hpp and instantiated by one .cu of the program
// (kernels.cuh explains how). docs/CUDA-ENGINE.md has the full ordering table.
//
// Memory spaces: activation_space = device_space. Appended KV, queries and
// outputs are device pointers; the D-window and ping-pong buffers are device
// memory; the unpinned compute region is pageable host memory, the pinned load
// region page-locked host memory (cuda_host_alloc / cuda_host_register).
//
// Streams (one backend, one device, driven from one host thread):
//   caller  the caller's stream (given at construction, or created): appends,
//           prefill scatter, the final merge. Everything a step produces is
//           ordered before work the caller enqueues on it afterwards.
//   h2d     streamed copies pinned -> ping-pong (shared by all engines).
//   d2h     eviction and prefill copies device -> host.
//   per engine: compute (split attention, fold, D-window) and a small stream
//           for the D2H copy of the queries.
// Events (all guards, see docs/CUDA-ENGINE.md for the hazard -> guard -> test table):
//   launch  caller -> compute, q: the appended KV and q are written (RAW)
//   filled[b] / consumed[b]  h2d -> compute (RAW) / compute -> h2d (WAR), per
//           ping-pong buffer, persisting across layers and steps
//   h2d_done  h2d -> d2h: no D2H rewrites a (recycled) pinned block an earlier
//           H2D still reads (fault case C9, docs/CUDA-ENGINE.md)
//   d2h_done  d2h -> h2d: evicted / prefilled pinned blocks have landed before
//           a step streams them; d2h -> caller after an eviction: the D-window
//           slots are not overwritten by the next append before they are copied
//   evict_src caller -> d2h: the eviction copies what the appends wrote (RAW)
//   compute_done compute -> caller: the merge reads finished partials, and the
//           caller's next writes (append, q) come after every read of them
// Host blocking: launch() never blocks and allocates nothing; host_queries()
// waits only for the q copy; cpu_partial() waits for the previous step's
// CPU-partial upload (in practice long done); finish() does not block (unless
// debug partials are requested). Evictions and prefill writes whose destination
// is pageable (the unpinned compute region) complete before they return, since
// the CPU reads those blocks directly; pinned destinations are asynchronous.
//
// Lifetimes: the backend outlives every cache and engine that uses it; a cache
// is destroyed after its hybrid_attention (engine). Destructors synchronize.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "../backend.hpp"
#include "../config.hpp"
#include "../detail/stream_copy.hpp"
#include "../detail/thread_affinity.hpp"
#include "../error.hpp"
#include "../host_memory.hpp"
#include "../layout.hpp"
#include "../memory_space.hpp"
#include "../partial_state.hpp"
#include "../sparse_pipeline.hpp"
#include "../stream_plan.hpp"
#include "cuda_error.hpp"
#include "kernels.hpp"
#include "pinned_allocators.hpp"

namespace writescope {

/// Switches that REMOVE a guard, for mutation tests only (with the guarding
/// event or wait removed, the test must fail). All off by default;
/// never set them in production. Read at every call, so tests may flip them
/// between steps.
struct cuda_debug_options {
  bool skip_consumed_wait = false;   ///< WAR: refill a ping-pong buffer without waiting for its last reader
  bool skip_filled_wait = false;     ///< RAW: attend a ping-pong buffer without waiting for its copies
  bool skip_caller_event = false;    ///< RAW: read appended KV / q without waiting for the caller stream
  bool skip_eviction_wait = false;   ///< RAW: evict the D-window without waiting for the caller stream
  bool skip_block_reuse_wait = false;  ///< C9: D2H into host blocks without waiting for earlier H2D reads
  bool skip_landing_wait = false;    ///< RAW: stream pinned blocks without waiting for pending D2H writes
  /// Debug builds (WS_DEBUG_CHECKS()) reject H2D sources that are not page-locked;
  /// set this for the deliberate pageable-source ablation (pageable_allocator).
  bool allow_pageable_sources = false;
  /// Each CTA of the streamed-split attention kernel spins this many SM cycles
  /// before reading its buffer (a slow consumer).
  long long consumer_delay_cycles = 0;
  /// A spin kernel of this many SM cycles is queued on the copy stream before
  /// each chunk's copies (slow copies: the RAW guard's mutation test).
  long long copy_delay_cycles = 0;
  /// Sparse steps (docs/SPARSE.md), RAW: copy a staging buffer into ping-pong
  /// without the wait kernel on the host gather of its chunk. Device pull
  /// (sparse_transfer::device_pull): the pull kernel never waits for the gather
  /// threads; this removes the gate of the chunk's block-list copy only.
  bool skip_gather_wait = false;
  /// Sparse steps, WAR: gather into a staging buffer (and write the chunk's
  /// block lists) without waiting for the copy that last read it (two chunks
  /// earlier). Device pull: the block lists only. skip_consumed_wait and
  /// skip_filled_wait apply to pulled chunks as to copied ones (the pull kernel
  /// sits where the copy would, between the consumed wait and the filled record).
  bool skip_staging_wait = false;
  /// Sparse steps: every gather thread sleeps this long before each chunk (a slow gather).
  long long gather_delay_microseconds = 0;
  /// Fault kind K8: issue every host-side copy (streamed H2D runs, eviction
  /// and prefill D2H) as one cudaMemcpyAsync instead of splitting it at
  /// page-locked registration boundaries (pinned_registry::split). A run across
  /// two cudaHostRegister chunks, or two slabs that mmap placed back to back,
  /// then reaches the driver whole, which refuses it at the step
  /// (cudaErrorInvalidValue, pinned_allocators.hpp) — the mutation test of
  /// test_cuda_pinned also prints what the driver answers to such a copy.
  bool skip_registration_split = false;
  /// Launcher thread (cuda_backend::set_launch_thread): it sleeps this long
  /// before each launch's chunk loop (a late launcher).
  long long launcher_delay_microseconds = 0;
  /// C9 with the launcher thread: D2H into host blocks (write_blocks,
  /// copy_blocks_to_host) without first joining the launches whose copies the
  /// launcher may not have enqueued yet (their h2d_done_ record comes later).
  bool skip_pending_launch_join = false;
};

/// Ablation switches (paper §7.4, Fig. 10): each replaces one design point of
/// the streaming path with the baseline it improves on, so that a benchmark
/// can measure what the design point buys (bench/ws_bench.cpp, mode ablate).
/// All off by default: with the defaults the step runs exactly as without this
/// struct. Never set them in production. Read at every launch.
struct cuda_ablation_options {
  /// How the streamed pinned blocks are copied into ping-pong.
  enum class copy_granularity : std::uint8_t {
    coalesced_runs,  ///< default: one copy per run of physically adjacent blocks (the format's contiguous DMA)
    per_block,       ///< one cudaMemcpyAsync per block (no coalescing)
    per_slice,       ///< one per (plane, KV head) slice of a block: the per-segment copies of a strided
                     ///< source (paper §3.2); MLA has one slice per block, so it equals per_block there
  };
  copy_granularity copies = copy_granularity::coalesced_runs;
  /// Destroy-and-rebuild transfer region instead of overwrite-reuse (paper
  /// §4.2): every launch cudaMallocs fresh ping-pong buffers (one per buffer
  /// index, each the size of the plan's largest chunk) instead of using the
  /// cache's, and finish() cudaFrees them, which synchronizes the device.
  bool per_step_allocation = false;
};

namespace cuda_detail {

class unique_stream {
 public:
  unique_stream() = default;
  static unique_stream create() {
    unique_stream s;
    WS_CUDA_TRY(cudaStreamCreateWithFlags(&s.s_, cudaStreamNonBlocking));
    return s;
  }
  unique_stream(unique_stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  unique_stream& operator=(unique_stream&& o) noexcept {
    std::swap(s_, o.s_);
    return *this;
  }
  ~unique_stream() {
    if (s_ != nullptr) {
      ignore(cudaStreamSynchronize(s_));
      ignore(cudaStreamDestroy(s_));
    }
  }
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class unique_event {
 public:
  unique_event() = default;
  static unique_event create(bool timing = false) {
    unique_event e;
    WS_CUDA_TRY(cudaEventCreateWithFlags(&e.e_, timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }
  unique_event(unique_event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  unique_event& operator=(unique_event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  ~unique_event() {
    if (e_ != nullptr) ignore(cudaEventDestroy(e_));
  }
  [[nodiscard]] cudaEvent_t get() const noexcept { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

inline void record(const unique_event& e, cudaStream_t s) { WS_CUDA_TRY(cudaEventRecord(e.get(), s)); }
inline void wait(cudaStream_t s, const unique_event& e) { WS_CUDA_TRY(cudaStreamWaitEvent(s, e.get(), 0)); }

/// cudaEventQuery without leaving cudaErrorNotReady in the runtime's last-error
/// slot (the next WS_CUDA_CHECK_LAST must not see it). True when complete.
inline bool event_done(const unique_event& e) {
  const cudaError_t r = cudaEventQuery(e.get());
  if (r == cudaSuccess) return true;
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(r, "cudaEventQuery", __FILE__, __LINE__);
  return false;
}

inline void release_staging(void* p, index_t, void*) noexcept {
  ignore(cudaDeviceSynchronize());
  try {
    pinned_registry::instance().remove(p);
  } catch (...) {
  }
  ignore(cudaFreeHost(p));
}

}  // namespace cuda_detail

class cuda_backend {
 public:
  using backend_concept = backend_tag;
  using activation_space = device_space;

  /// Device memory (cudaMalloc), freed on destruction. Movable.
  class device_buffer {
   public:
    device_buffer() = default;
    device_buffer(std::byte* p, index_t bytes) noexcept : p_(p), bytes_(bytes) {}
    device_buffer(device_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
    device_buffer& operator=(device_buffer&& o) noexcept {
      std::swap(p_, o.p_);
      std::swap(bytes_, o.bytes_);
      return *this;
    }
    device_buffer(const device_buffer&) = delete;
    device_buffer& operator=(const device_buffer&) = delete;
    ~device_buffer() {
      if (p_ != nullptr) cuda_detail::ignore(cudaFree(p_));  // cudaFree waits for work using it
    }
    [[nodiscard]] std::byte* data() const noexcept { return p_; }
    [[nodiscard]] index_t size_bytes() const noexcept { return bytes_; }
    [[nodiscard]] device_span<std::byte> span() const noexcept { return device_span<std::byte>(p_, bytes_); }
    template <class T>
    [[nodiscard]] T* as() const noexcept {
      return reinterpret_cast<T*>(p_);
    }

   private:
    std::byte* p_ = nullptr;
    index_t bytes_ = 0;
  };

  /// Most ping-pong buffers an engine supports (events are created up front).
  static constexpr int max_ping_pong_buffers = 16;

  /// Uses the current device; creates its own (non-blocking) caller stream.
  cuda_backend() : cuda_backend(nullptr, true) {}
  /// Uses the current device and the caller's stream `caller` (0 = the legacy
  /// default stream). Everything the backend writes for the caller (appends,
  /// outputs) is ordered on `caller`.
  explicit cuda_backend(cudaStream_t caller) : cuda_backend(caller, false) {}

  /// The constructors' first call. Throws cuda_error whose message starts
  /// "no CUDA device: " and names the CUDA status (code(): that status, or
  /// cudaErrorNoDevice for 0 devices) when the runtime sees no device: no
  /// driver (cudaErrorInsufficientDriver), none visible (cudaErrorNoDevice,
  /// e.g. CUDA_VISIBLE_DEVICES=-1) or a count of 0. Other failures of
  /// cudaGetDeviceCount throw the usual WS_CUDA_TRY error.
  static void require_device() {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || (e == cudaSuccess && count == 0)) {
      (void)cudaGetLastError();
      throw cuda_error(std::string("no CUDA device: cudaGetDeviceCount ") +
                           (e == cudaSuccess ? std::string("found 0 devices")
                                             : std::string("returned ") + cudaGetErrorName(e) + " (" +
                                                   cudaGetErrorString(e) + ")"),
                       static_cast<int>(e == cudaSuccess ? cudaErrorNoDevice : e));
    }
    if (e != cudaSuccess) cuda_detail::throw_cuda_error(e, "cudaGetDeviceCount(&count)", __FILE__, __LINE__);
  }

  cuda_backend(const cuda_backend&) = delete;
  cuda_backend& operator=(const cuda_backend&) = delete;
  ~cuda_backend() {
    cuda_detail::ignore(cudaStreamSynchronize(caller_));
    cuda_detail::ignore(cudaStreamSynchronize(d2h_.get()));
    deferred_.clear();  // the blocks' owner (the cache) is gone or going: nothing reads them
    staging_ = device_buffer();
    eviction_bounce_ = host_allocation();
  }

  [[nodiscard]] std::string_view name() const noexcept { return name_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] cudaStream_t caller_stream() const noexcept { return caller_; }
  [[nodiscard]] cudaStream_t copy_stream() const noexcept { return h2d_.get(); }
  [[nodiscard]] cudaStream_t d2h_stream() const noexcept { return d2h_.get(); }
  /// Mutation-test switches (see cuda_debug_options).
  [[nodiscard]] cuda_debug_options& debug() noexcept { return debug_; }
  /// Ablation switches (see cuda_ablation_options; all off by default).
  [[nodiscard]] cuda_ablation_options& ablation() noexcept { return ablation_; }
  /// Largest device staging buffer write_blocks uses for host destinations.
  void set_max_staging_bytes(index_t bytes) noexcept { max_staging_bytes_ = std::max<index_t>(bytes, 1); }

  /// Whether a dense launch hands its chunk loop (the H2D copies of the
  /// streamed chunks, their split attention and folds, the D-window kernel)
  /// to the engine's launcher thread (off by default). launch() then returns
  /// after the q copy is enqueued, and the calling thread can wait for q and
  /// run the CPU engine while the launcher enqueues (milliseconds per layer
  /// for long sequences: one copy per run, two launches per 128 splits). The
  /// plan and window list are copied at launch, so the caller's contract is
  /// unchanged; D2H writes into host blocks first join a pending launch (C9).
  /// Off (the default): everything is enqueued inside launch(). The launcher
  /// competes with the CPU engine's threads for cores, hence off
  /// (docs/DECISIONS.md); on a host with cores to spare it takes the enqueue
  /// off the CPU side's path. Sparse
  /// launches are never handed over. Read at each launch; set between steps
  /// from the thread that drives the cache.
  void set_launch_thread(bool on) noexcept { launch_thread_ = on; }
  [[nodiscard]] bool launch_thread() const noexcept { return launch_thread_; }

  /// cudaMalloc of `bytes`; throws resource_error naming `what` and the size.
  device_buffer allocate_device(index_t bytes, const char* what) {
    if (bytes <= 0) return {};
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, static_cast<std::size_t>(bytes));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw resource_error(std::string(what) + ": cudaMalloc of " + format_bytes(bytes) + " of device memory failed: " +
                           cuda_detail::cuda_error_text(e));
    }
    return device_buffer(static_cast<std::byte*>(p), bytes);
  }

  /// Page-locked host staging (cudaHostAlloc); throws pinned_memory_error.
  host_allocation allocate_staging(index_t bytes) {
    if (bytes <= 0) return {};
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, static_cast<std::size_t>(bytes), cudaHostAllocPortable);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw pinned_memory_error("pinned memory: cudaHostAlloc of " + format_bytes(bytes) +
                                " for a staging buffer failed: " + cuda_detail::cuda_error_text(e));
    }
    try {
      cuda_detail::pinned_registry::instance().add(p, bytes);
    } catch (...) {
      cuda_detail::ignore(cudaFreeHost(p));
      throw;
    }
    return host_allocation(p, bytes, &cuda_detail::release_staging);
  }

  /// Fills `bytes` of device memory with a repeated 16-bit pattern (poisoning).
  /// Synchronous (init-time only): later copies on other streams see the fill.
  void fill_device(std::byte* dst, index_t bytes, std::uint16_t pattern) {
    if (bytes <= 1) return;
    gpu::launch_fill_u16(reinterpret_cast<std::uint16_t*>(dst), bytes / 2, pattern, caller_);
    WS_CUDA_TRY(cudaStreamSynchronize(caller_));
  }

  /// Scatters token-major KV (device memory) into blocks. Device destinations
  /// (the D-window) are written by a kernel on the caller stream. Host
  /// destinations (prefill routed to the pinned / unpinned regions) go through a
  /// device staging buffer (grown once, on first use; it is the only allocation
  /// on this path) and D2H copies on the d2h stream, coalesced over consecutive
  /// destination blocks, ordered after the scatter and after every earlier H2D
  /// read (C9). Pageable destinations take the eviction path's page-locked
  /// bounce buffer (set_eviction_bounce_bytes; direct copies when it is 0 or
  /// cannot be page-locked). Returns once pageable destinations are complete;
  /// pinned ones complete asynchronously (read_token / synchronize_host_writes wait).
  template <kv_layout Layout>
  void write_blocks(const block_format<Layout>& fmt, const kv_tokens<Layout, device_space>& kv,
                    std::span<const block_write> writes) {
    if (writes.empty()) return;
    join_pending_launches();  // C9: a launched step's H2D reads are enqueued before h2d_done_ is waited on
    complete_host_writes();   // the previous call's deferred bytes: the bounce buffer is reused from offset 0
    gpu::scatter_params& sp = scatter_;
    bool vec = kv.stride(fmt.layout) % 8 == 0;
    for (int p = 0; p < 2; ++p) {
      const bf16* plane = kv.planes[std::size_t(p < Layout::planes ? p : 0)];
      sp.planes[p] = plane;
      vec = vec && reinterpret_cast<std::uintptr_t>(plane) % 16 == 0;
    }
    sp.token_stride = kv.stride(fmt.layout);
    sp.kv_heads = fmt.layout.kv_heads();
    sp.block_tokens = fmt.block_tokens;
    sp.vectorized = vec ? 1 : 0;
    sp.num_items = 0;
    auto push = [&](const block_write& w, bf16* dst) {
      sp.items[sp.num_items++] = {w.src_token, dst, w.num_tokens, w.dst_token};
      if (sp.num_items == gpu::max_scatter_items) {
        gpu::launch_scatter<Layout>(sp, caller_);
        sp.num_items = 0;
      }
    };
    auto flush_scatter = [&] {
      if (sp.num_items > 0) gpu::launch_scatter<Layout>(sp, caller_);
      sp.num_items = 0;
    };

    // Device destinations: straight into the blocks, on the caller stream.
    host_writes_.clear();
    for (std::size_t i = 0; i < writes.size(); ++i) {
      const block_write& w = writes[i];
      if (w.num_tokens <= 0) continue;
      if (w.dst_kind == memory_kind::device)
        push(w, w.dst);
      else
        host_writes_.push_back(i);
    }
    flush_scatter();
    if (host_writes_.empty()) return;

    // Host destinations: scatter into staging block images, then D2H.
    const index_t block_bytes = fmt.block_bytes();
    const index_t block_elems = fmt.block_elems();
    const index_t n = index_t(host_writes_.size());
    ensure_staging(std::max(block_bytes, std::min(n * block_bytes, max_staging_bytes_ / block_bytes * block_bytes)));
    const index_t per_group = staging_.size_bytes() / block_bytes;
    bf16* staging = staging_.as<bf16>();
    bool pageable = false;
    std::vector<block_copy>& bounced = prefill_bounce_copies_;
    for (index_t g0 = 0; g0 < n; g0 += per_group) {
      bounced.clear();
      const index_t g1 = std::min(n, g0 + per_group);
      cuda_detail::wait(caller_, staging_free_);  // WAR: earlier D2H out of the staging buffer
      for (index_t j = g0; j < g1; ++j) push(writes[host_writes_[std::size_t(j)]], staging + (j - g0) * block_elems);
      flush_scatter();
      cuda_detail::record(staged_, caller_);
      cuda_detail::wait(d2h_.get(), staged_);  // RAW: the scatter wrote the images
      if (!debug_.skip_block_reuse_wait) cuda_detail::wait(d2h_.get(), h2d_done_);  // C9
      // Pageable destinations (the unpinned compute region): one DMA per copy
      // into the page-locked bounce buffer, then host threads copy the bytes
      // (bounce_to_pageable) instead of driver-staged pageable copies.
      auto copy_out = [&](bf16* dst, const bf16* src, index_t bytes, memory_kind kind) {
        if (kind == memory_kind::pageable_host && eviction_bounce_max_bytes_ > 0)
          bounced.push_back(block_copy{src, dst, bytes, kind});
        else
          copy_d2h(dst, src, bytes);
      };
      for (index_t j = g0; j < g1;) {
        const block_write& w = writes[host_writes_[std::size_t(j)]];
        const bf16* img = staging + (j - g0) * block_elems;
        pageable = pageable || w.dst_kind == memory_kind::pageable_host;
        const bool full = w.dst_token == 0 && w.num_tokens == fmt.block_tokens;
        if (full) {  // coalesce consecutive full destination blocks
          index_t run = 1;
          while (j + run < g1) {
            const block_write& x = writes[host_writes_[std::size_t(j + run)]];
            if (x.dst_token != 0 || x.num_tokens != fmt.block_tokens || x.dst_kind != w.dst_kind ||
                x.dst != w.dst + run * block_elems)
              break;
            ++run;
          }
          copy_out(w.dst, img, run * block_bytes, w.dst_kind);
          j += run;
        } else {  // only the written rows of every (plane, head) slice
          const index_t slice = fmt.slice_elems();
          const index_t row0 = index_t(w.dst_token) * Layout::row_elems;
          const index_t len = index_t(w.num_tokens) * Layout::row_elems * index_t(sizeof(bf16));
          for (index_t s = 0; s < index_t(Layout::planes) * fmt.layout.kv_heads(); ++s)
            copy_out(w.dst + s * slice + row0, img + s * slice + row0, len, w.dst_kind);
          ++j;
        }
      }
      if (!bounced.empty()) {
        if (deferred_max_bytes_ > 0 && !deferred_refused_) {
          defer_to_pageable(bounced);  // D2H into the prefill bounce buffer; the host copies later
        } else if (ensure_eviction_bounce(bounced)) {
          bounce_to_pageable(bounced);  // returns with the bytes in place
        } else {
          for (const block_copy& c : bounced) copy_d2h(c.dst, c.src, c.bytes);
          pageable_direct_ = true;
        }
      }
      cuda_detail::record(staging_free_, d2h_.get());
      cuda_detail::record(d2h_done_, d2h_.get());
    }
    if (pageable && (deferred_max_bytes_ == 0 || pageable_direct_)) WS_CUDA_TRY(cudaStreamSynchronize(d2h_.get()));
    pageable_direct_ = false;
  }

  /// Eviction (paper §4.2): device -> host copies on the d2h stream, ordered
  /// after everything enqueued on the caller stream so far (the appends that
  /// wrote the D-window, RAW) and after every earlier H2D read of host blocks
  /// (C9); the caller stream then waits for the copies before its next append
  /// can overwrite the slots (WAR). Returns once pageable destinations are
  /// complete (the CPU engine reads them in place); pinned ones land
  /// asynchronously and the next step's streaming waits for them.
  ///
  /// Pageable destinations (the unpinned compute region) go through a
  /// page-locked bounce buffer (set_eviction_bounce_bytes): one DMA per copy
  /// into it at full speed, one wait, then host threads copy the bytes to
  /// their blocks. A cudaMemcpyAsync straight into pageable memory is staged
  /// by the driver and returns only when done, one copy after the other, and
  /// an eviction batch is one copy per sequence and layer (docs/DECISIONS.md). If the bounce buffer cannot be
  /// page-locked, evictions fall back to direct copies (nothing else changes).
  void copy_blocks_to_host(std::span<const block_copy> copies) {
    join_pending_launches();  // C9, as in write_blocks
    complete_host_writes();   // deferred prefill bytes land before any later write can reach their blocks
    if (copies.empty()) return;
    cuda_detail::record(evict_src_, caller_);
    if (!debug_.skip_eviction_wait) cuda_detail::wait(d2h_.get(), evict_src_);
    if (!debug_.skip_block_reuse_wait) cuda_detail::wait(d2h_.get(), h2d_done_);
    bool pageable = false;
    for (const block_copy& c : copies) pageable = pageable || (c.bytes > 0 && c.dst_kind == memory_kind::pageable_host);
    const bool bounce = pageable && ensure_eviction_bounce(copies);
    if (bounce) bounce_to_pageable(copies);  // first: its waits then cover no pinned copy
    for (const block_copy& c : copies) {
      if (c.bytes <= 0 || (bounce && c.dst_kind == memory_kind::pageable_host)) continue;
      copy_d2h(c.dst, c.src, c.bytes);
    }
    cuda_detail::record(d2h_done_, d2h_.get());
    cuda_detail::wait(caller_, d2h_done_);
    if (pageable) WS_CUDA_TRY(cudaStreamSynchronize(d2h_.get()));
  }

  /// Size in bytes of the page-locked host bounce buffer for evictions into
  /// pageable memory, at most (allocated on the first such eviction, grown by
  /// doubling up to the largest batch seen, capped here); 0 = direct copies
  /// into pageable memory (the driver stages them). Default 32 MiB. Frees the
  /// current buffer (after a device synchronize); call it between steps, from
  /// the thread that drives the cache; never throws.
  void set_eviction_bounce_bytes(index_t bytes) noexcept {
    eviction_bounce_max_bytes_ = std::max<index_t>(bytes, 0);
    eviction_bounce_ = host_allocation();
    eviction_bounce_refused_ = false;
  }
  /// Page-locks the bounce buffer now at its full size (set_eviction_bounce_bytes),
  /// so that no later eviction pins memory: inplace_kv_cache calls it at
  /// construction when its pinned region is pinned at init
  /// (pinned_initial_tokens = -1; fault kind K8: nothing is page-locked inside
  /// a step). A refusal is not an error: evictions then copy directly into
  /// pageable memory, as after set_eviction_bounce_bytes(0). Between steps,
  /// from the thread that drives the cache; never throws.
  void reserve_eviction_bounce() noexcept {
    if (eviction_bounce_max_bytes_ <= 0 || eviction_bounce_refused_ ||
        eviction_bounce_.size_bytes() >= eviction_bounce_max_bytes_)
      return;
    try {
      host_allocation b = allocate_staging(eviction_bounce_max_bytes_);
      if (cudaStreamSynchronize(d2h_.get()) != cudaSuccess) return;  // nothing may still write the old buffer
      eviction_bounce_ = std::move(b);
    } catch (...) {
      eviction_bounce_refused_ = true;
    }
  }
  /// Whether evictions into pageable memory go through the bounce buffer (false
  /// before the first one, with set_eviction_bounce_bytes(0), or when no
  /// buffer could be page-locked).
  [[nodiscard]] bool eviction_bounce_active() const noexcept { return bool(eviction_bounce_); }

  /// Device -> host copy ordered after the caller stream; complete on return.
  void copy_to_host_sync(void* dst, const std::byte* src, index_t bytes) {
    if (bytes <= 0) return;
    WS_CUDA_TRY(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToHost, caller_));
    WS_CUDA_TRY(cudaStreamSynchronize(caller_));
  }

  /// Waits until every host block written by write_blocks / copy_blocks_to_host
  /// has landed (inplace_kv_cache::read_token calls it before reading host
  /// memory), deferred pageable prefill writes included.
  void synchronize_host_writes() {
    complete_host_writes();
    WS_CUDA_TRY(cudaStreamSynchronize(d2h_.get()));
  }

  /// Deferred pageable prefill writes (off by default): write_blocks then
  /// enqueues the D2H of blocks bound for pageable memory (the unpinned
  /// compute region) into a page-locked prefill bounce buffer and returns
  /// without waiting; host threads copy those bytes to their blocks at the
  /// next write_blocks, copy_blocks_to_host, complete_host_writes,
  /// synchronize_host_writes or synchronize call (hybrid_attention::step calls
  /// complete_host_writes before its CPU engine reads). The buffer grows to the
  /// pageable bytes of one write_blocks call, at most `max_bytes` (larger calls
  /// complete in pieces of that size); 0 turns deferral off (after completing
  /// what is pending). If the buffer cannot be page-locked, writes stay
  /// synchronous (through the eviction bounce buffer). Call between steps from
  /// the thread that drives the cache; complete (or synchronize) before
  /// destroying a cache whose blocks have pending writes. The completing calls
  /// (read_token through synchronize_host_writes included) are not safe to
  /// make from two threads at once.
  void set_deferred_host_writes(index_t max_bytes) {
    complete_host_writes();
    deferred_max_bytes_ = std::max<index_t>(max_bytes, 0);
    if (deferred_max_bytes_ == 0) deferred_bounce_ = host_allocation();
  }
  [[nodiscard]] index_t deferred_host_writes() const noexcept { return deferred_max_bytes_; }

  /// Finishes the deferred pageable writes (of the last write_blocks call):
  /// waits for their D2H, then copies
  /// the bytes to their blocks (OpenMP threads when large). A no-op when none
  /// is pending.
  void complete_host_writes() {
    if (deferred_.empty()) return;
    WS_CUDA_TRY(cudaEventSynchronize(deferred_done_.get()));
    copy_out_of_bounce(deferred_bounce_.data(), deferred_);
    deferred_.clear();
  }

  /// Waits for the caller, copy and d2h streams (after any engine's launcher
  /// thread has enqueued its pending launch).
  void synchronize() {
    join_pending_launches();
    WS_CUDA_TRY(cudaStreamSynchronize(caller_));
    WS_CUDA_TRY(cudaStreamSynchronize(h2d_.get()));
    WS_CUDA_TRY(cudaStreamSynchronize(d2h_.get()));
    complete_host_writes();
  }

  /// The GPU side of a decode step for one layout (one per cache).
  template <kv_layout Layout>
  class gpu_engine;

 private:
  cuda_backend(cudaStream_t caller, bool create) {
    require_device();
    WS_CUDA_TRY(cudaGetDevice(&device_));
    cudaDeviceProp prop{};
    WS_CUDA_TRY(cudaGetDeviceProperties(&prop, device_));
    name_ = std::string("cuda (") + prop.name + ", device " + std::to_string(device_) + ")";
    if (create) {
      own_caller_ = cuda_detail::unique_stream::create();
      caller_ = own_caller_.get();
    } else {
      caller_ = caller;
    }
    h2d_ = cuda_detail::unique_stream::create();
    d2h_ = cuda_detail::unique_stream::create();
    h2d_done_ = cuda_detail::unique_event::create();
    d2h_done_ = cuda_detail::unique_event::create();
    staged_ = cuda_detail::unique_event::create();
    staging_free_ = cuda_detail::unique_event::create();
    evict_src_ = cuda_detail::unique_event::create();
    deferred_done_ = cuda_detail::unique_event::create();
  }

  // The bounce buffer for this eviction's pageable copies: grown to their
  // total (at least doubling, capped at eviction_bounce_max_bytes_); false
  // (direct copies) when disabled, when one copy alone exceeds the buffer it
  // can have, or when no buffer could ever be page-locked. A refused growth
  // keeps the buffer it had (bounce_to_pageable works in groups).
  // Engines whose launcher thread may still be enqueueing a launch's copies
  // (set_launch_thread). Every D2H into host blocks waits on h2d_done_ for
  // the H2D reads before it (C9); h2d_done_ is recorded at the end of a
  // launch's chunk loop, so those paths first join the pending launches.
  struct pending_launch {
    void* engine;
    void (*join)(void*);
  };
  void join_pending_launches() {
    if (debug_.skip_pending_launch_join) return;  // mutation test only
    while (!pending_launches_.empty()) {
      const pending_launch p = pending_launches_.back();
      pending_launches_.pop_back();
      p.join(p.engine);
    }
  }
  void forget_pending_launch(void* engine) noexcept {
    std::erase_if(pending_launches_, [&](const pending_launch& p) { return p.engine == engine; });
  }

  bool ensure_eviction_bounce(std::span<const block_copy> copies) {
    if (eviction_bounce_max_bytes_ <= 0) return false;
    index_t total = 0, largest = 0;
    for (const block_copy& c : copies)
      if (c.bytes > 0 && c.dst_kind == memory_kind::pageable_host) {
        total += c.bytes;
        largest = std::max(largest, c.bytes);
      }
    const index_t have = eviction_bounce_.size_bytes();
    if (have >= std::min(total, eviction_bounce_max_bytes_) || eviction_bounce_refused_) return largest <= have;
    if (largest > eviction_bounce_max_bytes_) return false;
    const index_t want = std::min(std::max(total, 2 * have), eviction_bounce_max_bytes_);
    host_allocation grown;
    try {
      grown = allocate_staging(want);
    } catch (const pinned_memory_error&) {
      eviction_bounce_refused_ = true;  // no retry on every eviction; keep what we have
      return largest <= have;
    }
    WS_CUDA_TRY(cudaStreamSynchronize(d2h_.get()));  // nothing may still write the old buffer
    eviction_bounce_ = std::move(grown);
    return true;
  }

  // A piece of a bounce buffer and the pageable block bytes it is copied to.
  struct bounce_piece {
    void* dst;
    index_t offset;
    index_t bytes;
  };

  // Host copies of bounce pieces to their pageable blocks, spread over up to
  // 16 OpenMP threads when there is at least 1 MiB per thread.
  static void copy_out_of_bounce(const std::byte* buf, const std::vector<bounce_piece>& g) {
    if (g.empty()) return;
    const int n = int(g.size());
#if defined(_OPENMP)
    const index_t bytes = g.back().offset + g.back().bytes;
    const int threads = std::clamp(int(bytes / (index_t{1} << 20)), 1, std::min(16, n));
#  pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
#endif
    for (int i = 0; i < n; ++i)
      std::memcpy(g[std::size_t(i)].dst, buf + g[std::size_t(i)].offset, static_cast<std::size_t>(g[std::size_t(i)].bytes));
  }

  // Deferred pageable prefill writes of one staging group (set_deferred_host_writes):
  // D2H of each copy into the prefill bounce buffer after what is already
  // pending there (d2h stream, after the group's waits); when the buffer is
  // full, what is pending completes first (wait + host copies).
  void defer_to_pageable(std::span<const block_copy> copies) {
    index_t total = 0;
    for (const block_copy& c : copies) total += c.bytes;
    const index_t have = deferred_bounce_.size_bytes();
    index_t used = deferred_.empty() ? 0 : deferred_.back().offset + deferred_.back().bytes;
    if (have < std::min(used + total, deferred_max_bytes_)) {
      const index_t want = std::min(std::max(used + total, 2 * have), deferred_max_bytes_);
      if (!deferred_.empty()) {  // the pending bytes live in the old buffer
        cuda_detail::record(deferred_done_, d2h_.get());
        complete_host_writes();
        used = 0;
      }
      deferred_bounce_ = host_allocation();
      try {
        deferred_bounce_ = allocate_staging(want);
      } catch (const pinned_memory_error&) {  // no page-locked buffer: these and later writes stay synchronous
        deferred_refused_ = true;
        if (ensure_eviction_bounce(copies)) {
          bounce_to_pageable(copies);
        } else {
          for (const block_copy& c : copies) copy_d2h(c.dst, c.src, c.bytes);
          pageable_direct_ = true;
        }
        return;
      }
    }
    const index_t cap = deferred_bounce_.size_bytes();
    for (const block_copy& c : copies) {
      if (c.bytes > cap) {  // a single copy larger than the buffer: direct (driver-staged)
        copy_d2h(c.dst, c.src, c.bytes);
        pageable_direct_ = true;
        continue;
      }
      if (used + c.bytes > cap) {
        cuda_detail::record(deferred_done_, d2h_.get());
        complete_host_writes();
        used = 0;
      }
      WS_CUDA_TRY(cudaMemcpyAsync(deferred_bounce_.data() + used, c.src, static_cast<std::size_t>(c.bytes),
                                  cudaMemcpyDeviceToHost, d2h_.get()));
      deferred_.push_back({c.dst, used, c.bytes});
      used += c.bytes;
    }
    // every pending D2H so far is behind this record (one stream), also when a later step throws
    if (!deferred_.empty()) cuda_detail::record(deferred_done_, d2h_.get());
  }

  // The pageable copies of an eviction through the bounce buffer, in groups
  // that fit it: D2H of each copy into its slice (d2h stream, after the waits
  // copy_blocks_to_host enqueued), one wait, then the host copies, spread over
  // OpenMP threads where the group is large.
  void bounce_to_pageable(std::span<const block_copy> copies) {
    std::byte* const buf = eviction_bounce_.data();
    const index_t cap = eviction_bounce_.size_bytes();
    group_.clear();
    auto drain = [&] {
      if (group_.empty()) return;
      WS_CUDA_TRY(cudaStreamSynchronize(d2h_.get()));
      const int n = int(group_.size());
      const std::vector<bounce_piece>& g = group_;
#if defined(_OPENMP)
      const index_t bytes = g.back().offset + g.back().bytes;
      const int threads = std::clamp(int(bytes / (index_t{1} << 20)), 1, std::min(8, n));
#  pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
#endif
      for (int i = 0; i < n; ++i)
        std::memcpy(g[std::size_t(i)].dst, buf + g[std::size_t(i)].offset, static_cast<std::size_t>(g[std::size_t(i)].bytes));
      group_.clear();
    };
    index_t used = 0;
    for (const block_copy& c : copies) {
      if (c.bytes <= 0 || c.dst_kind != memory_kind::pageable_host) continue;
      if (used + c.bytes > cap) {
        drain();
        used = 0;
      }
      WS_CUDA_TRY(cudaMemcpyAsync(buf + used, c.src, static_cast<std::size_t>(c.bytes), cudaMemcpyDeviceToHost,
                                  d2h_.get()));
      group_.push_back({c.dst, used, c.bytes});
      used += c.bytes;
    }
    drain();
  }

  // Device -> host, split where the host range crosses a page-locked
  // registration (the driver rejects such copies); whole with the K8 mutation
  // switch cuda_debug_options::skip_registration_split.
  void copy_d2h(void* dst, const void* src, index_t bytes) {
    auto issue = [&](index_t off, index_t len) {
      WS_CUDA_TRY(cudaMemcpyAsync(static_cast<std::byte*>(dst) + off, static_cast<const std::byte*>(src) + off,
                                  static_cast<std::size_t>(len), cudaMemcpyDeviceToHost, d2h_.get()));
    };
    if (debug_.skip_registration_split)
      issue(0, bytes);
    else
      cuda_detail::pinned_registry::instance().split(dst, bytes, issue);
  }

  void ensure_staging(index_t bytes) {
    if (staging_.size_bytes() >= bytes) return;
    WS_CUDA_TRY(cudaStreamSynchronize(caller_));  // nothing may still use the old buffer
    WS_CUDA_TRY(cudaStreamSynchronize(d2h_.get()));
    staging_ = device_buffer();
    staging_ = allocate_device(bytes, "prefill staging buffer");
  }

  int device_ = 0;
  std::string name_;
  cuda_detail::unique_stream own_caller_;
  cudaStream_t caller_ = nullptr;
  cuda_detail::unique_stream h2d_, d2h_;
  cuda_detail::unique_event h2d_done_, d2h_done_, staged_, staging_free_, evict_src_;
  cuda_debug_options debug_{};
  cuda_ablation_options ablation_{};
  index_t max_staging_bytes_ = index_t{64} << 20;
  bool launch_thread_ = false;
  std::vector<pending_launch> pending_launches_;
  device_buffer staging_;
  index_t eviction_bounce_max_bytes_ = index_t{32} << 20;
  host_allocation eviction_bounce_;
  bool eviction_bounce_refused_ = false;
  std::vector<bounce_piece> group_;
  std::vector<block_copy> prefill_bounce_copies_;
  index_t deferred_max_bytes_ = 0;              ///< set_deferred_host_writes; 0 = off
  host_allocation deferred_bounce_;             ///< page-locked; the pending pieces' bytes
  std::vector<bounce_piece> deferred_;          ///< pending host copies (bounce offset -> block)
  cuda_detail::unique_event deferred_done_;     ///< recorded on d2h after the pending D2H
  bool deferred_refused_ = false;               ///< the prefill bounce buffer could not be page-locked
  bool pageable_direct_ = false;                ///< this write_blocks made a direct pageable copy
  gpu::scatter_params scatter_{};
  std::vector<std::size_t> host_writes_;
};

/// The GPU side of a decode step of one layer (paper §4.2; docs/CUDA-ENGINE.md):
/// the same interface and the same order of work as host_backend::gpu_engine.
///
/// Per launch, on the engine's compute stream unless noted:
///   q D2H into pinned staging (own stream, after the caller's event);
///   streamed state := empty;
///   for each plan chunk c, buffer b = chunk.buffer:
///     h2d: wait consumed[b]; copy the chunk's runs into ping-pong[b]; record filled[b]
///     compute: wait filled[b]; attend the chunk's splits (per-split partials);
///              record consumed[b]; fold the partials into each sequence's
///              running streamed state, in split order
///   D-window attention (ragged: only the valid rows are read);
/// finish(): CPU partial H2D, then on the caller stream
///   out = (streamed ⊕ D-window) ⊕ CPU  (merge_state_row semantics).
/// Deterministic and batch-invariant: partial boundaries come from the plan
/// (each sequence's own blocks) and every merge runs in a fixed order.
///
/// Workspaces are allocated at construction for `max_batch` sequences; launch
/// allocates nothing and never blocks the host. One engine per
/// cache: the filled/consumed events guard the ping-pong buffers of the cache
/// it serves. Calls into one engine come from one thread.
///
/// Sparse plans (stream_plan::build_sparse; docs/SPARSE.md; paper Fig. 6),
/// after reserve_sparse(): gather threads (host) copy the selected blocks of
/// chunk n into pinned staging buffer n % 2 while the copy engine moves chunk
/// n-1; per chunk, on the copy stream:
///   a one-thread wait kernel until every gather thread's page-locked
///   progress counter says chunk n is gathered (RAW; no host callback);
///   wait consumed[b]; ONE copy staging[n % 2] -> ping-pong[b] (a gathered
///   chunk; a direct one copies its long runs straight from the pinned region);
///   copy the chunk's block lists (pinned) -> the buffer's device lists;
///   record filled[b] and copy_done[n % ring] (the gather threads of chunk n+2
///   synchronize on it before overwriting staging buffer n % 2: WAR)
/// and on the compute stream the listed attention kernel per split and KV head.
/// launch() still enqueues only (it hands the chunks to the gather threads and
/// returns); finish() additionally waits until the gather threads are done
/// with the step's chunks (they read the plan), i.e. until roughly the start
/// of its last copy — not for the copies or kernels.
/// Device pull (sparse_reservation::device_pull, sparse_transfer::device_pull):
/// a gathered chunk is instead, on the copy stream, wait consumed[b]; the pull
/// kernel (gpu::launch_pull_blocks) copies its blocks from the pinned region
/// (device-mapped) into ping-pong[b] in staging's order and layout; then the
/// wait kernel (it now gates only the block lists, which gather thread 0 still
/// writes) and the list copy; record filled[b] and copy_done. No staging
/// buffers, no host memcpy of blocks; direct chunks are unchanged.
template <kv_layout Layout>
class cuda_backend::gpu_engine {
 public:
  using args_type = gpu_step_args<Layout, device_space>;
  /// finish() never blocks: its timing is of an earlier launch (take_completed_gpu_cost).
  static constexpr bool asynchronous = true;
  static constexpr int Q = Layout::q_dim;
  static constexpr int V = Layout::v_dim;

  /// max_batch: sequences per step. Allocates device workspaces and pinned
  /// staging; throws resource_error / pinned_memory_error when refused.
  gpu_engine(cuda_backend& backend, const Layout& layout, int max_batch)
      : be_(&backend), layout_(layout), max_batch_(std::max(max_batch, 0)), hq_(layout.num_q_heads()) {
    const index_t rows = index_t(max_batch_) * hq_;
    const index_t split_rows = index_t(gpu::max_attend_items) * hq_;
    streamed_o_ = be_->allocate_device(rows * V * 4, "streamed partial state");
    streamed_lse_ = be_->allocate_device(rows * 4, "streamed partial state");
    window_o_ = be_->allocate_device(rows * V * 4, "D-window partial state");
    window_lse_ = be_->allocate_device(rows * 4, "D-window partial state");
    cpu_o_ = be_->allocate_device(rows * V * 4, "CPU partial state");
    cpu_lse_ = be_->allocate_device(rows * 4, "CPU partial state");
    split_o_ = be_->allocate_device(split_rows * V * 4, "split partial workspace");
    split_lse_ = be_->allocate_device(split_rows * 4, "split partial workspace");
    q_host_ = be_->allocate_staging(rows * Q * 4);
    cpu_o_host_ = be_->allocate_staging(rows * V * 4);
    cpu_lse_host_ = be_->allocate_staging(rows * 4);
    compute_ = cuda_detail::unique_stream::create();
    qstream_ = cuda_detail::unique_stream::create();
    launch_ev_ = cuda_detail::unique_event::create();
    q_done_ = cuda_detail::unique_event::create();
    compute_done_ = cuda_detail::unique_event::create();
    cpu_h2d_done_ = cuda_detail::unique_event::create();
    for (int b = 0; b < max_ping_pong_buffers; ++b) {
      filled_[std::size_t(b)] = cuda_detail::unique_event::create();
      consumed_[std::size_t(b)] = cuda_detail::unique_event::create();
    }
    for (int s = 0; s < 2; ++s) {
      t_start_[std::size_t(s)] = cuda_detail::unique_event::create(true);
      t_ready_[std::size_t(s)] = cuda_detail::unique_event::create(true);
      t_end_[std::size_t(s)] = cuda_detail::unique_event::create(true);
    }
  }
  gpu_engine(const gpu_engine&) = delete;
  gpu_engine& operator=(const gpu_engine&) = delete;
  /// Waits for this engine's work (and the shared copy stream) before freeing.
  ~gpu_engine() {
    stop_launcher();
    cuda_detail::ignore(cudaStreamSynchronize(be_->caller_));
    cuda_detail::ignore(cudaStreamSynchronize(be_->h2d_.get()));
    free_step_buffers();
    stop_gather_threads();
  }

  /// Reserves the sparse pipeline (backend.hpp sparse_reservation): two pinned
  /// staging buffers of r.chunk_blocks blocks (none with r.device_pull), two
  /// pinned and r.buffers device block-list buffers, and r.gather_threads
  /// gather threads (created once). A larger reservation later grows the
  /// buffers (waiting for the copy stream first); the transfer mode is the
  /// latest reservation's. Between steps only. Throws pinned_memory_error /
  /// resource_error; with r.device_pull, config_error when the device lacks
  /// cudaDevAttrUnifiedAddressing or cudaDevAttrCanUseHostPointerForRegisteredMem
  /// (the pull kernel reads page-locked memory through its host addresses),
  /// when r.block_bytes is not a positive multiple of 16 or r.pull_ctas < 1.
  void reserve_sparse(const sparse_reservation& r) {
    join_launch();
    if (r.device_pull) check_device_pull(r);
    const index_t staging = r.device_pull ? 0 : std::max<index_t>(r.chunk_blocks * r.block_bytes, 1);
    const index_t lists = std::max<index_t>(2 * index_t(r.kv_heads) * r.chunk_blocks, 1);
    const int buffers = std::max(r.buffers, 1);
    if (r.device_pull && index_t(pull_src_.capacity()) < r.chunk_blocks)
      pull_src_.reserve(std::size_t(r.chunk_blocks));  // launch fills it per pulled chunk without allocating
    device_pull_ = r.device_pull;
    pull_ctas_ = r.pull_ctas;
    if (staging > staging_bytes_ || lists > list_cap_ || buffers > list_buffers_) {
      WS_CUDA_TRY(cudaStreamSynchronize(be_->h2d_.get()));  // nothing reads the old buffers any more
      const index_t sb = std::max(staging, staging_bytes_);
      const index_t lc = std::max(lists, list_cap_);
      const int lb = std::max(buffers, list_buffers_);
      host_allocation st[2], lh[2];
      for (int k = 0; k < 2; ++k) {
        st[k] = be_->allocate_staging(sb);
        lh[k] = be_->allocate_staging(lc * index_t(sizeof(std::int32_t)));
      }
      device_buffer ld = be_->allocate_device(lc * lb * index_t(sizeof(std::int32_t)), "sparse block lists");
      for (int k = 0; k < 2; ++k) {
        staging_[k] = std::move(st[k]);
        lists_host_[k] = std::move(lh[k]);
      }
      lists_dev_ = std::move(ld);
      staging_bytes_ = sb;
      list_cap_ = lc;
      list_buffers_ = lb;
    }
    if (!gs_) {
      auto g = std::make_unique<gather_shared>();
      const int n = std::max(1, r.gather_threads);
      g->progress.assign(std::size_t(n), 0);
      g->t_first.assign(std::size_t(n), -1.0);
      g->t_last.assign(std::size_t(n), -1.0);
      host_allocation hp = be_->allocate_staging(index_t(n) * index_t(sizeof(std::uint64_t)));
      std::memset(hp.data(), 0, std::size_t(n) * sizeof(std::uint64_t));
      void* dev = nullptr;
      WS_CUDA_TRY(cudaHostGetDevicePointer(&dev, hp.data(), 0));
      g->host_progress = reinterpret_cast<volatile std::uint64_t*>(hp.data());
      host_progress_ = std::move(hp);
      dev_progress_ = static_cast<const unsigned long long*>(dev);
      gs_ = std::move(g);
      try {
        for (int j = 0; j < n; ++j)
          gather_threads_.emplace_back(&gpu_engine::gather_main, gs_.get(), j, be_->device_);
      } catch (...) {
        stop_gather_threads();
        gs_.reset();
        throw resource_error("gpu_engine::reserve_sparse: could not start " + std::to_string(n) + " gather threads");
      }
    }
  }
  /// Bytes of the two pinned staging buffers (0 before reserve_sparse, and
  /// while only device-pull reservations were made).
  [[nodiscard]] index_t sparse_staging_bytes() const noexcept { return 2 * staging_bytes_; }
  /// The gather of the last finished sparse step (zeros after a dense one).
  [[nodiscard]] const gather_stats& last_gather() const noexcept { return gather_; }

  /// Starts the GPU side of one step; returns at once (enqueues only). `a.q`
  /// (device), the D-window slots, the ping-pong buffers and the pinned
  /// sources of a.plan must stay valid until the step's work completes (the
  /// caller stream passes the merge); the plan and window list themselves are
  /// read during the call only. Throws shape_error / config_error before
  /// enqueueing anything for inconsistent arguments; in debug builds
  /// (WS_DEBUG_CHECKS()) pinned_memory_error for a source that is not page-locked;
  /// in every build, before enqueueing anything, pinned_memory_error for a
  /// block the device would pull (sparse plan, device-pull reservation) that
  /// lies outside the page-locked ranges (pinned_registry).
  void launch(const args_type& a) {
    join_launch();  // an earlier launch's chunk loop (finish() was skipped after an error)
    validate(a);
    const cuda_debug_options dbg = be_->debug_;
    if (a.plan->sparse) {  // docs/SPARSE.md; the ablation switches apply to dense steps only
      launch_sparse(a, dbg);
      return;
    }
    last_sparse_ = false;
    const cuda_ablation_options abl = be_->ablation_;
    const index_t block_bytes = a.format.block_bytes();
    if (abl.per_step_allocation) allocate_step_buffers(*a.plan, a.ping_pong.size(), block_bytes);  // ablation only
    batch_ = a.batch;
    launched_ = true;

    // 0-2. Caller event, q to the CPU engine, stream ordering, workspaces.
    const int slot = begin_step(a, dbg);

    // 3-4. On the launcher thread (cuda_backend::set_launch_thread), or here.
    if (be_->launch_thread_ && !abl.per_step_allocation && post_launch(a, dbg, abl, slot)) return;
    stream_chunks(a, dbg, abl);
    end_step(a, slot);
  }

  /// Whether a launch's chunk loop is still with the launcher thread (false
  /// after finish(), gpu_seconds_sync() or take_completed_gpu_cost()).
  [[nodiscard]] bool launch_pending() const noexcept { return async_pending_; }

 private:
  // Step 3 of a dense launch: stream the chunks through ping-pong; attend and
  // fold each. Runs on the launcher thread or inside launch().
  void stream_chunks(const args_type& a, const cuda_debug_options& dbg, const cuda_ablation_options& abl) {
    const stream_plan& plan = *a.plan;
    const index_t block_elems = a.format.block_elems();
    const index_t block_bytes = a.format.block_bytes();
    cudaStream_t h2d = be_->h2d_.get();
    cudaStream_t comp = compute_.get();
    for (const stream_chunk& c : plan.chunks) {
      const auto b = std::size_t(c.buffer);
      bf16* buf = abl.per_step_allocation ? step_buffers_[b] : a.ping_pong[b];
      if (!dbg.skip_consumed_wait) cuda_detail::wait(h2d, consumed_[b]);  // WAR
      if (dbg.copy_delay_cycles > 0) gpu::launch_spin(dbg.copy_delay_cycles, h2d);
      for (index_t r = c.run_begin; r < c.run_end; ++r) {
        const stream_run& run = plan.runs[std::size_t(r)];
        bf16* dst = buf + run.dst_block * block_elems;
        if (abl.copies == cuda_ablation_options::copy_granularity::coalesced_runs) {
          copy_h2d(dst, run.src, run.num_blocks * block_bytes, h2d, dbg);
        } else {  // ablation: no coalescing (per block, or per (plane, head) slice)
          const bool slices = abl.copies == cuda_ablation_options::copy_granularity::per_slice;
          const index_t piece = slices ? a.format.slice_elems() : block_elems;
          for (index_t e = 0; e < run.num_blocks * block_elems; e += piece)
            copy_h2d(dst + e, run.src + e, piece * index_t(sizeof(bf16)), h2d, dbg);
        }
      }
      cuda_detail::record(filled_[b], h2d);
      if (!dbg.skip_filled_wait) cuda_detail::wait(comp, filled_[b]);  // RAW
      attend_chunk(a, c, buf, b, nullptr, dbg);
    }
  }

  // The launcher thread (cuda_backend::set_launch_thread). One job at a time:
  // launch() posts steps 3-4 with copies of the plan, the window list and the
  // ping-pong pointers; join_launch() waits for them and rethrows what they
  // threw. The job's fields are written before the post and read by the
  // launcher after it (the mutex orders them); the launcher's writes to the
  // engine (attention parameters, timing slots) are read after a join.
  struct launcher_shared {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
    bool posted = false;  // a job waits or runs
    std::exception_ptr error;
  };

  // Posts steps 3-4; false (the caller enqueues them itself) when the
  // launcher thread could not be started.
  bool post_launch(const args_type& a, const cuda_debug_options& dbg, const cuda_ablation_options& abl, int slot) {
    if (!launcher_.joinable()) {
      if (launcher_refused_) return false;
      try {
        if (!ls_) ls_ = std::make_unique<launcher_shared>();
        launcher_ = std::thread(&gpu_engine::launcher_main, this);
      } catch (...) {  // no thread: enqueue on the calling thread from now on
        launcher_refused_ = true;
        return false;
      }
    }
    job_plan_ = *a.plan;  // vector assignment keeps capacity: no allocation once warm
    job_windows_.assign(a.windows.begin(), a.windows.end());
    job_ping_pong_.assign(a.ping_pong.begin(), a.ping_pong.end());
    job_args_ = a;
    job_args_.plan = &job_plan_;
    job_args_.windows = job_windows_;
    job_args_.ping_pong = job_ping_pong_;
    job_dbg_ = dbg;
    job_abl_ = abl;
    job_slot_ = slot;
    be_->pending_launches_.reserve(be_->pending_launches_.size() + 1);  // may throw: before the post
    {
      std::lock_guard lk(ls_->mu);
      ls_->posted = true;
    }
    ls_->cv.notify_all();
    async_pending_ = true;
    be_->pending_launches_.push_back({this, [](void* e) { static_cast<gpu_engine*>(e)->join_launch(); }});
    return true;
  }

  void launcher_main() {
    detail::widen_thread_affinity();  // not the creator's (possibly OpenMP-bound) core
    (void)cudaSetDevice(be_->device_);
    launcher_shared& g = *ls_;
    for (;;) {
      {
        std::unique_lock lk(g.mu);
        g.cv.wait(lk, [&] { return g.stop || g.posted; });
        if (!g.posted) return;  // stop, nothing posted
      }
      std::exception_ptr err;
      try {
        if (job_dbg_.launcher_delay_microseconds > 0)
          std::this_thread::sleep_for(std::chrono::microseconds(job_dbg_.launcher_delay_microseconds));
        stream_chunks(job_args_, job_dbg_, job_abl_);
        end_step(job_args_, job_slot_);
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard lk(g.mu);
        g.posted = false;
        g.error = err;
      }
      g.cv.notify_all();
    }
  }

 public:
  /// Waits until the launcher thread has enqueued the last launch's chunk
  /// loop (no-op when nothing is pending); rethrows what it threw
  /// (cuda_error). Called by finish() and the other entry points that read
  /// the launch's state; callable by the owner between launch() and finish().
  void join_launch() {
    if (!async_pending_) return;
    async_pending_ = false;
    be_->forget_pending_launch(this);
    std::unique_lock lk(ls_->mu);
    ls_->cv.wait(lk, [&] { return !ls_->posted; });
    if (std::exception_ptr e = std::exchange(ls_->error, nullptr)) {
      lk.unlock();
      std::rethrow_exception(e);
    }
  }

 private:
  void stop_launcher() noexcept {
    if (!launcher_.joinable()) return;
    be_->forget_pending_launch(this);
    {
      std::lock_guard lk(ls_->mu);
      ls_->stop = true;
    }
    ls_->cv.notify_all();
    launcher_.join();  // a posted job completes first
    async_pending_ = false;
  }

 public:

  /// Host-readable queries of the launched step ([batch][Hq][q_dim], pinned
  /// staging). Waits only for their D2H copy.
  [[nodiscard]] const float* host_queries() {
    WS_CUDA_TRY(cudaEventSynchronize(q_done_.get()));
    return reinterpret_cast<const float*>(q_host_.data());
  }

  /// Where the CPU engine writes its merged partial: dense [batch][Hq][v_dim] /
  /// [batch][Hq] in pinned staging. Waits until the previous step's upload of
  /// this buffer has finished (C9: a pinned source is never rewritten while an
  /// H2D still reads it).
  [[nodiscard]] host_partial_view<float> cpu_partial(int batch) {
    WS_CUDA_TRY(cudaEventSynchronize(cpu_h2d_done_.get()));
    return host_partial_view<float>::dense(reinterpret_cast<float*>(cpu_o_host_.data()),
                                           reinterpret_cast<float*>(cpu_lse_host_.data()), batch, hq_, V);
  }

  /// Uploads the CPU partial (tiny) and merges (streamed ⊕ D-window) ⊕ CPU into
  /// `o` (device) on the caller stream; does not block the host (unless
  /// o.debug is set: then it waits and copies every partial to the host; with
  /// the launcher thread it first waits until the launch is enqueued, and
  /// rethrows the launcher's cuda_error, which ends the step).
  /// Returns the GPU side's seconds (CUDA events: start of streaming to the
  /// end of the D-window kernel, merge excluded) of the most recent launch of
  /// this engine whose work has completed — usually the previous layer's, so
  /// no sync is needed; 0 before any has completed. gpu_seconds_sync() gives
  /// the exact value of the last launch.
  double finish(const step_outputs<device_space>& o) {
    if (!launched_) throw state_error("gpu_engine::finish: no step was launched");
    const index_t rows = index_t(batch_) * hq_;
    if (o.out.size() < rows * V)
      throw shape_error("gpu_engine::finish: out has " + std::to_string(o.out.size()) + " elements, needs " +
                        std::to_string(rows * V));
    if (!o.lse.empty() && o.lse.size() < rows)
      throw shape_error("gpu_engine::finish: lse has " + std::to_string(o.lse.size()) + " elements, needs " +
                        std::to_string(rows));
    launched_ = false;
    join_launch();  // the launcher's chunk loop (set_launch_thread); its error ends the step
    gather_ = {};
    if (last_sparse_) {  // the gather threads read the plan: wait until they are done with it
      wait_gathers();
      gather_ = job_stats_;
      double t0 = 0.0, t1 = 0.0;
      bool any = false;
      for (std::size_t j = 0; j < gs_->t_first.size() && job_stats_.gathered_chunks > 0; ++j) {
        if (gs_->t_first[j] < 0.0) continue;
        t0 = any ? std::min(t0, gs_->t_first[j]) : gs_->t_first[j];
        t1 = any ? std::max(t1, gs_->t_last[j]) : gs_->t_last[j];
        any = true;
      }
      gather_.seconds = any ? t1 - t0 : 0.0;
    }
    cudaStream_t caller = be_->caller_;
    if (rows > 0) {
      WS_CUDA_TRY(cudaMemcpyAsync(cpu_o_.data(), cpu_o_host_.data(), static_cast<std::size_t>(rows * V * 4),
                                  cudaMemcpyHostToDevice, caller));
      WS_CUDA_TRY(cudaMemcpyAsync(cpu_lse_.data(), cpu_lse_host_.data(), static_cast<std::size_t>(rows * 4),
                                  cudaMemcpyHostToDevice, caller));
    }
    cuda_detail::record(cpu_h2d_done_, caller);
    cuda_detail::wait(caller, compute_done_);  // streamed and D-window partials are final
    cuda_detail::wait(caller, q_done_);        // the caller may overwrite q after this
    gpu::merge_params mp{};
    mp.streamed_o = streamed_o_.as<float>();
    mp.streamed_lse = streamed_lse_.as<float>();
    mp.window_o = window_o_.as<float>();
    mp.window_lse = window_lse_.as<float>();
    mp.cpu_o = cpu_o_.as<float>();
    mp.cpu_lse = cpu_lse_.as<float>();
    mp.out = o.out.data();
    mp.out_lse = o.lse.empty() ? nullptr : o.lse.data();
    mp.rows = rows;
    gpu::launch_merge<Layout>(mp, caller);
    free_step_buffers();  // ablation only (per_step_allocation): cudaFree synchronizes the device
    if (o.debug) copy_debug(*o.debug, rows);
    return completed_gpu_seconds();
  }

  /// The GPU-side cost of the newest launch whose timing completed since the
  /// last call, with the streamed tokens of that same launch; {0, 0} when none
  /// completed since. finish() returns an earlier launch's seconds (it never
  /// blocks), so hybrid_attention feeds the policy's online B from this pair,
  /// not from finish()'s seconds with the current step's tokens: the two differ
  /// right after an eviction, and before the first launch completes finish()
  /// returns 0. Each completed launch is reported at most once; older ones that
  /// complete together with a newer one are dropped (B is a sliding average).
  completed_gpu_cost take_completed_gpu_cost() noexcept {
    if (async_pending_) return {};  // the launch's timing state is the launcher's until joined
    if (!fresh_) return {};
    fresh_ = false;
    return fresh_cost_;
  }

  /// Waits for the last launch's GPU side and returns its exact seconds.
  double gpu_seconds_sync() {
    join_launch();
    const auto s = std::size_t(last_slot_);
    if (!timing_pending_[s]) return last_seconds_;
    WS_CUDA_TRY(cudaEventSynchronize(t_end_[s].get()));
    WS_CUDA_TRY(cudaEventSynchronize(t_start_[s].get()));
    WS_CUDA_TRY(cudaEventSynchronize(t_ready_[s].get()));
    read_timing(s);
    return last_seconds_;
  }

  /// The engine's compute stream (diagnostics).
  [[nodiscard]] cudaStream_t compute_stream() const noexcept { return compute_.get(); }

 private:
  void validate(const args_type& a) const {
    if (a.batch < 0 || a.batch > max_batch_)
      throw shape_error("gpu_engine::launch: batch " + std::to_string(a.batch) + " outside [0, " +
                        std::to_string(max_batch_) + "] (max_batch of the engine)");
    if (a.plan == nullptr) throw shape_error("gpu_engine::launch: no stream plan");
    if (index_t(a.windows.size()) < a.batch)
      throw shape_error("gpu_engine::launch: " + std::to_string(a.windows.size()) + " D-window refs for a batch of " +
                        std::to_string(a.batch));
    if (a.q.size() < index_t(a.batch) * hq_ * Q)
      throw shape_error("gpu_engine::launch: q has " + std::to_string(a.q.size()) + " elements, needs " +
                        std::to_string(index_t(a.batch) * hq_ * Q));
    if (a.ping_pong.size() > std::size_t(max_ping_pong_buffers))
      throw config_error("gpu_engine::launch: " + std::to_string(a.ping_pong.size()) +
                         " ping-pong buffers; cuda_backend supports at most " +
                         std::to_string(max_ping_pong_buffers));
    if (a.format.layout.num_q_heads() != hq_ || a.format.layout.kv_heads() != layout_.kv_heads())
      throw shape_error("gpu_engine::launch: the step's layout differs from the engine's");
    for (const stream_chunk& c : a.plan->chunks)
      if (c.buffer < 0 || std::size_t(c.buffer) >= a.ping_pong.size())
        throw shape_error("gpu_engine::launch: plan chunk uses ping-pong buffer " + std::to_string(c.buffer) + " of " +
                          std::to_string(a.ping_pong.size()));
    if (a.plan->sparse) validate_sparse(a);
    if (WS_DEBUG_CHECKS() && !be_->debug_.allow_pageable_sources) {
      if (!a.plan->sparse) {
        for (const stream_run& r : a.plan->runs) require_page_locked(r.src, r.num_blocks * a.format.block_bytes());
      } else {  // only direct chunks DMA from the region; gathered ones from staging (page-locked) or,
                // pulled, are checked in every build (validate_sparse)
        for (const stream_chunk& c : a.plan->chunks)
          for (index_t k = c.run_begin; k < c.run_end && !c.gathered; ++k) {
            const stream_run& r = a.plan->runs[std::size_t(k)];
            require_page_locked(r.src, r.num_blocks * a.format.block_bytes());
          }
      }
    }
  }

  // reserve_sparse with device_pull: the device must read page-locked memory
  // through its host addresses (the pull kernel gets the plan's run sources),
  // and the kernel moves 16-byte vectors. config_error naming what fails.
  void check_device_pull(const sparse_reservation& r) const {
    const std::pair<cudaDeviceAttr, const char*> needed[] = {
        {cudaDevAttrUnifiedAddressing, "cudaDevAttrUnifiedAddressing"},
        {cudaDevAttrCanUseHostPointerForRegisteredMem, "cudaDevAttrCanUseHostPointerForRegisteredMem"}};
    for (const auto& [attr, name] : needed) {
      int v = 0;
      WS_CUDA_TRY(cudaDeviceGetAttribute(&v, attr, be_->device_));
      if (v == 0)
        throw config_error(std::string("gpu_engine::reserve_sparse: sparse_transfer::device_pull needs ") + name +
                           " = 1 on device " + std::to_string(be_->device_) +
                           " (kernels read the pinned region through its host addresses); it is 0 there: "
                           "use sparse_transfer::host_gather");
    }
    if (r.block_bytes <= 0 || r.block_bytes % 16 != 0)
      throw config_error("gpu_engine::reserve_sparse: sparse_transfer::device_pull needs a block size that is a "
                         "positive multiple of 16 bytes (16-byte vector copies); the block has " +
                         std::to_string(r.block_bytes) + " bytes");
    if (r.pull_ctas < 1)
      throw config_error("gpu_engine::reserve_sparse: pull_ctas " + std::to_string(r.pull_ctas) + " must be >= 1");
  }

  void validate_sparse(const args_type& a) const {
    if (!gs_) throw state_error("gpu_engine::launch: a sparse plan needs reserve_sparse() first");
    if (sparse_failed_)
      throw state_error("gpu_engine::launch: the sparse pipeline stopped after a failed launch (CUDA error); "
                        "create a new engine");
    const index_t block_bytes = a.format.block_bytes();
    std::pair<std::uintptr_t, std::uintptr_t> span{0, 0};  // the last registered span a pulled run was found in
    for (const stream_chunk& c : a.plan->chunks) {
      if (c.gathered && device_pull_) {
        if (c.num_blocks > index_t(pull_src_.capacity()))
          throw shape_error("gpu_engine::launch: a pulled chunk of " + std::to_string(c.num_blocks) +
                            " blocks exceeds the reserved " + std::to_string(pull_src_.capacity()) +
                            "; reserve_sparse() for the cache's ping-pong geometry");
        // The pull kernel dereferences these host addresses on the device:
        // only memory page-locked (and mapped) by this library's allocators.
        // The registry is asked once per registered span, not once per run.
        for (index_t k = c.run_begin; k < c.run_end; ++k) {
          const stream_run& r = a.plan->runs[std::size_t(k)];
          const auto lo = reinterpret_cast<std::uintptr_t>(r.src);
          const auto hi = lo + static_cast<std::uintptr_t>(r.num_blocks * block_bytes);
          if (lo < span.first || hi > span.second) span = cuda_detail::pinned_registry::instance().covering_span(r.src);
          if (lo < span.first || hi > span.second) {
            char addr[32];
            std::snprintf(addr, sizeof addr, "%p", static_cast<const void*>(r.src));
            throw pinned_memory_error(
                std::string("pinned memory: device pull of a run of ") + std::to_string(r.num_blocks) +
                " blocks (" + format_bytes(r.num_blocks * block_bytes) + ") at " + addr +
                ": the range is not page-locked by cuda_host_alloc / cuda_host_register (pinned_registry), so "
                "the device cannot read it; use one of them for the pinned region, or sparse_transfer::host_gather");
          }
        }
      }
      if (c.gathered && !device_pull_ && c.num_blocks * block_bytes > staging_bytes_)
        throw shape_error("gpu_engine::launch: a gathered chunk of " + std::to_string(c.num_blocks) +
                          " blocks exceeds the staging buffer (" + format_bytes(staging_bytes_) +
                          "); reserve_sparse() for the cache's ping-pong geometry");
      if (c.list_end - c.list_begin > list_cap_ || c.buffer >= list_buffers_)
        throw shape_error("gpu_engine::launch: a sparse chunk needs " + std::to_string(c.list_end - c.list_begin) +
                          " list entries in buffer " + std::to_string(c.buffer) + "; reserved " +
                          std::to_string(list_cap_) + " in " + std::to_string(list_buffers_) +
                          " buffers (reserve_sparse())");
    }
  }

  // Fault case C9: a pageable source silently makes the copy synchronous and
  // staged (and hides ordering bugs). Debug builds refuse it.
  static void require_page_locked(const void* p, index_t bytes) {
    if (bytes <= 0 || cuda_detail::pinned_registry::instance().contains(p, bytes)) return;
    const void* ends[2] = {p, static_cast<const std::byte*>(p) + (bytes - 1)};
    for (const void* q : ends) {
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, q) != cudaSuccess) {
        (void)cudaGetLastError();
        attr.type = cudaMemoryTypeUnregistered;
      }
      if (attr.type != cudaMemoryTypeHost) {
        char addr[32];
        std::snprintf(addr, sizeof addr, "%p", q);
        throw pinned_memory_error(
            std::string("pinned memory: the H2D source at ") + addr + " (a run of " + format_bytes(bytes) +
            " of the pinned load region) is not page-locked, so the copy would be synchronous and staged "
            "(fault case C9 in docs/RELIABILITY.md); use cuda_host_alloc or cuda_host_register, or set "
            "cuda_debug_options::allow_pageable_sources for the pageable ablation");
      }
    }
  }

  // Host -> device, split where the source crosses a page-locked registration;
  // whole with the K8 mutation switch (`dbg.skip_registration_split`).
  static void copy_h2d(bf16* dst, const bf16* src, index_t bytes, cudaStream_t s, const cuda_debug_options& dbg) {
    auto issue = [&](index_t off, index_t len) {
      WS_CUDA_TRY(cudaMemcpyAsync(reinterpret_cast<std::byte*>(dst) + off,
                                  reinterpret_cast<const std::byte*>(src) + off, static_cast<std::size_t>(len),
                                  cudaMemcpyHostToDevice, s));
    };
    if (dbg.skip_registration_split)
      issue(0, bytes);
    else
      cuda_detail::pinned_registry::instance().split(src, bytes, issue);
  }

  // Ablation (cuda_ablation_options::per_step_allocation): fresh ping-pong
  // buffers for this launch, the size of the plan's largest chunk. Throws
  // resource_error (nothing stays allocated) when cudaMalloc refuses.
  void allocate_step_buffers(const stream_plan& plan, std::size_t buffers, index_t block_bytes) {
    free_step_buffers();
    index_t blocks = 1;
    for (const stream_chunk& c : plan.chunks) blocks = std::max(blocks, c.num_blocks);
    for (std::size_t b = 0; b < buffers; ++b) {
      void* p = nullptr;
      const cudaError_t e = cudaMalloc(&p, static_cast<std::size_t>(blocks * block_bytes));
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        free_step_buffers();
        throw resource_error("gpu_engine (ablation per_step_allocation): cudaMalloc of " +
                             format_bytes(blocks * block_bytes) + " failed: " + cuda_detail::cuda_error_text(e));
      }
      step_buffers_raw_.push_back(p);
      step_buffers_[b] = static_cast<bf16*>(p);
    }
  }

  void free_step_buffers() noexcept {
    for (void* p : step_buffers_raw_) cuda_detail::ignore(cudaFree(p));  // waits for the work that uses it
    step_buffers_raw_.clear();
    step_buffers_.fill(nullptr);
  }

  void read_timing(std::size_t s) {
    float ms = 0.0f;
    WS_CUDA_TRY(cudaEventElapsedTime(&ms, t_start_[s].get(), t_end_[s].get()));
    last_seconds_ = std::max(0.0, double(ms) * 1e-3);
    float critical_ms = 0.0f;
    WS_CUDA_TRY(cudaEventElapsedTime(&critical_ms, t_ready_[s].get(), t_end_[s].get()));
    timing_pending_[s] = false;
    fresh_cost_ = {last_seconds_, std::max(0.0, double(critical_ms) * 1e-3), slot_tokens_[s], slot_sparse_[s]};
    fresh_ = true;
  }

  double completed_gpu_seconds() {
    for (const int s : {last_slot_ ^ 1, last_slot_}) {  // older first: the newest completed wins
      const auto i = std::size_t(s);
      if (timing_pending_[i] && cuda_detail::event_done(t_end_[i]) && cuda_detail::event_done(t_start_[i]) &&
          cuda_detail::event_done(t_ready_[i]))
        read_timing(i);
    }
    return last_seconds_;
  }

  void copy_debug(debug_partials& d, index_t rows) {
    cudaStream_t caller = be_->caller_;
    WS_CUDA_TRY(cudaStreamSynchronize(caller));
    const auto n_o = std::size_t(rows * V);
    const auto n_l = std::size_t(rows);
    d.streamed_o.resize(n_o);
    d.streamed_lse.resize(n_l);
    d.window_o.resize(n_o);
    d.window_lse.resize(n_l);
    const std::pair<std::vector<float>*, const device_buffer*> pairs[] = {
        {&d.streamed_o, &streamed_o_}, {&d.streamed_lse, &streamed_lse_}, {&d.window_o, &window_o_},
        {&d.window_lse, &window_lse_}};
    for (const auto& [vec, buf] : pairs)
      if (!vec->empty())
        WS_CUDA_TRY(cudaMemcpyAsync(vec->data(), buf->data(), vec->size() * sizeof(float), cudaMemcpyDeviceToHost,
                                    caller));
    WS_CUDA_TRY(cudaStreamSynchronize(caller));
    const auto* co = reinterpret_cast<const float*>(cpu_o_host_.data());
    const auto* cl = reinterpret_cast<const float*>(cpu_lse_host_.data());
    d.cpu_o.assign(co, co + n_o);
    d.cpu_lse.assign(cl, cl + n_l);
  }

  // ---------------------------------------------------------------------------
  // Sparse pipeline (docs/SPARSE.md)
  // ---------------------------------------------------------------------------

  /// What the gather threads do for one launch.
  struct gather_job {
    const stream_plan* plan = nullptr;
    std::uint64_t first = 0;  ///< serial number of the plan's first chunk
    index_t block_bytes = 0;
    std::byte* staging[2] = {nullptr, nullptr};
    std::int32_t* lists[2] = {nullptr, nullptr};
    bool pull = false;  ///< gathered chunks are pulled by the device: write their block lists only
    bool skip_staging_wait = false;
    long long delay_us = 0;
  };

  /// State shared by the launching thread and the gather threads (one mutex;
  /// counters only grow), plus the progress mirror the wait kernel reads. Chunks of
  /// sparse launches are numbered by one serial over the engine's lifetime;
  /// chunk n uses staging buffer n % 2.
  struct gather_shared {
    std::mutex mu;
    std::condition_variable cv;
    std::uint64_t recorded = 0;    ///< serials whose copy_done event is recorded (serial + 1 of the last)
    std::uint64_t done_floor = 0;  ///< serials below it are known copied (the copy stream was synchronized)
    const cudaEvent_t* copy_done = nullptr;  ///< ring of events: serial s's copies completed at copy_done[s % ring]
    std::uint64_t ring = 1;
    volatile std::uint64_t* host_progress = nullptr;  ///< page-locked mirror of progress, read by the wait kernel
    std::vector<std::uint64_t> progress;  ///< per gather thread: serial + 1 of its last finished chunk
    std::vector<double> t_first, t_last;  ///< per gather thread: its first / last gather memcpy of the job (s)
    std::uint64_t job_id = 0;
    gather_job job;
    bool abort = false;  ///< a launch failed half-way: nothing waits any more
    bool stop = false;   ///< the engine is being destroyed
    [[nodiscard]] std::uint64_t min_progress() const noexcept {
      std::uint64_t m = ~std::uint64_t{0};
      for (const std::uint64_t p : progress) m = std::min(m, p);
      return m;
    }
  };

  static double now_seconds() noexcept {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  // Publishes thread j's progress to the wait kernel: after the fence, every
  // earlier store of this thread (the NT gather stores are fenced already,
  // stream_copy_fence) is visible before the counter.
  static void publish_progress(gather_shared* g, int j, std::uint64_t v) noexcept {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (g->host_progress != nullptr) g->host_progress[j] = v;
  }
  // Raises every progress mirror to the maximum, so wait kernels already
  // enqueued let their streams go on (an aborted pipeline). Under g->mu.
  static void release_wait_kernels(gather_shared* g) noexcept {
    if (g->host_progress == nullptr) return;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    for (std::size_t j = 0; j < g->progress.size(); ++j) g->host_progress[j] = ~std::uint64_t{0};
  }

  // Gather thread j of nt: for each chunk of a job, in order, wait until the
  // copies that last read its staging buffer (chunk n-2) completed (their
  // copy_done event), then copy its share of the chunk (blocks
  // [j*nb/nt, (j+1)*nb/nt) of the staging buffer, from whichever runs hold
  // them); thread 0 also writes the chunk's block lists; then publish n + 1.
  // A pull job (device pull) copies no block: only the lists are written (the
  // wait on chunk n-2's copies then guards the list buffer, WAR).
  static void gather_main(gather_shared* g, int j, int device) {
    detail::widen_thread_affinity();  // not the creator's (possibly OpenMP-bound) core
    (void)cudaSetDevice(device);      // the events it synchronizes on live there
    std::uint64_t seen = 0;
    for (;;) {
      gather_job job;
      {
        std::unique_lock lk(g->mu);
        g->cv.wait(lk, [&] { return g->stop || g->job_id != seen; });
        if (g->stop) return;
        seen = g->job_id;
        job = g->job;
      }
      const stream_plan& plan = *job.plan;
      const auto nt = index_t(g->progress.size());
      double t_first = -1.0, t_last = -1.0;
      for (std::size_t k = 0; k < plan.chunks.size(); ++k) {
        const std::uint64_t n = job.first + k;
        {
          std::unique_lock lk(g->mu);
          if (!job.skip_staging_wait && n >= 2 && n - 2 >= g->done_floor) {  // WAR: copies of chunk n-2 done
            g->cv.wait(lk, [&] { return g->abort || g->stop || g->recorded >= n - 1; });  // ... were enqueued
            if (!(g->abort || g->stop)) {
              const cudaEvent_t ev = g->copy_done[(n - 2) % g->ring];
              lk.unlock();
              const cudaError_t e = cudaEventSynchronize(ev);
              lk.lock();
              if (e != cudaSuccess) {  // a sticky error: wait_gathers() reports it
                g->abort = true;
                release_wait_kernels(g);
                g->cv.notify_all();
              }
            }
          }
          if (g->abort || g->stop) break;
        }
        if (job.delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(job.delay_us));
        const stream_chunk& c = plan.chunks[k];
        const auto slot = std::size_t(n & 1u);
        if (c.gathered && !job.pull) {  // this thread's share: chunk blocks [lo, hi), whatever runs they belong to
          const double t0 = now_seconds();
          const index_t lo = c.num_blocks * j / nt, hi = c.num_blocks * (j + 1) / nt;
          for (index_t r = c.run_begin; r < c.run_end; ++r) {
            const stream_run& run = plan.runs[std::size_t(r)];
            if (run.dst_block >= hi) break;  // runs are in destination order
            const index_t b0 = std::max(lo, run.dst_block), b1 = std::min(hi, run.dst_block + run.num_blocks);
            if (b0 < b1)  // non-temporal: only the DMA engine reads staging next
              detail::stream_copy(job.staging[slot] + b0 * job.block_bytes,
                                  reinterpret_cast<const std::byte*>(run.src) + (b0 - run.dst_block) * job.block_bytes,
                                  static_cast<std::size_t>((b1 - b0) * job.block_bytes));
          }
          detail::stream_copy_fence();  // before progress[j] publishes the chunk
          if (t_first < 0.0) t_first = t0;
          t_last = now_seconds();
        }
        if (j == 0 && c.list_end > c.list_begin)
          std::memcpy(job.lists[slot], plan.block_lists.data() + c.list_begin,
                      static_cast<std::size_t>(c.list_end - c.list_begin) * sizeof(std::int32_t));
        if (k + 1 == plan.chunks.size()) break;  // the last chunk is reported with the statistics below
        {
          std::lock_guard lk(g->mu);
          g->progress[std::size_t(j)] = n + 1;
          if (!g->abort) publish_progress(g, j, n + 1);
        }
        g->cv.notify_all();
      }
      {
        std::lock_guard lk(g->mu);
        g->progress[std::size_t(j)] = job.first + plan.chunks.size();  // done (also after an abort)
        if (!g->abort) publish_progress(g, j, job.first + plan.chunks.size());
        g->t_first[std::size_t(j)] = t_first;
        g->t_last[std::size_t(j)] = t_last;
      }
      g->cv.notify_all();
    }
  }

  // Waits until the gather threads finished the last posted job. Polls the copy
  // stream for a sticky CUDA error (the copy_done events would never complete,
  // so the gathers would stop): then aborts the pipeline and throws cuda_error.
  void wait_gathers() {
    if (!gs_) return;
    gather_shared& g = *gs_;
    std::unique_lock lk(g.mu);
    while (!(g.abort || g.min_progress() >= job_end_)) {
      if (g.cv.wait_for(lk, std::chrono::milliseconds(100)) != std::cv_status::timeout) continue;
      lk.unlock();
      const cudaError_t e = cudaStreamQuery(be_->h2d_.get());
      if (e == cudaErrorNotReady) (void)cudaGetLastError();
      if (e != cudaSuccess && e != cudaErrorNotReady) {
        abort_gathers();
        cuda_detail::check(e, "cudaStreamQuery (sparse gather pipeline)", __FILE__, __LINE__);
      }
      lk.lock();
    }
  }

  void abort_gathers() noexcept {
    if (!gs_) return;
    {
      std::lock_guard lk(gs_->mu);
      gs_->abort = true;
      release_wait_kernels(gs_.get());
    }
    gs_->cv.notify_all();
    sparse_failed_ = true;
  }

  void stop_gather_threads() noexcept {
    if (gs_) {
      {
        std::lock_guard lk(gs_->mu);
        gs_->stop = true;
      }
      gs_->cv.notify_all();
    }
    for (std::thread& t : gather_threads_)
      if (t.joinable()) t.join();
    gather_threads_.clear();
  }

  // Steps 0-2 of a launch, dense or sparse: the caller's work so far recorded;
  // q copied D2H for the CPU engine after it; the compute stream after the
  // caller, the copy stream after pending D2H writes into host blocks (C9);
  // the step's start timed on the copy stream; workspaces poisoned on request;
  // the streamed state initialized; the attention parameters of the step set.
  // Returns the timing slot of the step.
  int begin_step(const args_type& a, const cuda_debug_options& dbg) {
    const index_t rows = index_t(a.batch) * hq_;
    cudaStream_t h2d = be_->h2d_.get();
    cudaStream_t comp = compute_.get();
    cuda_detail::record(launch_ev_, be_->caller_);
    if (!dbg.skip_caller_event) cuda_detail::wait(qstream_.get(), launch_ev_);
    if (rows > 0)
      WS_CUDA_TRY(cudaMemcpyAsync(q_host_.data(), a.q.data(), static_cast<std::size_t>(rows * Q * 4),
                                  cudaMemcpyDeviceToHost, qstream_.get()));
    cuda_detail::record(q_done_, qstream_.get());
    if (!dbg.skip_caller_event) cuda_detail::wait(comp, launch_ev_);
    const int slot = timing_slot_;
    cuda_detail::record(t_ready_[std::size_t(slot)], comp);
    if (!dbg.skip_landing_wait) cuda_detail::wait(h2d, be_->d2h_done_);
    cuda_detail::record(t_start_[std::size_t(slot)], h2d);
    if (a.poison_workspaces) {
      WS_CUDA_TRY(cudaMemsetAsync(split_o_.data(), 0xff, static_cast<std::size_t>(split_o_.size_bytes()), comp));
      WS_CUDA_TRY(cudaMemsetAsync(split_lse_.data(), 0xff, static_cast<std::size_t>(split_lse_.size_bytes()), comp));
      WS_CUDA_TRY(cudaMemsetAsync(window_o_.data(), 0xff, static_cast<std::size_t>(rows * V * 4), comp));
      WS_CUDA_TRY(cudaMemsetAsync(window_lse_.data(), 0xff, static_cast<std::size_t>(rows * 4), comp));
    }
    gpu::launch_init_state<Layout>(streamed_o_.as<float>(), streamed_lse_.as<float>(), rows, comp);
    gpu::attend_params& ap = attend_;
    ap.q = a.q.data();
    ap.block_elems = a.format.block_elems();
    ap.scale = a.softmax_scale;
    ap.hq = hq_;
    ap.hkv = layout_.kv_heads();
    ap.group = layout_.group_size();
    ap.block_tokens = a.format.block_tokens;
    return slot;
  }

  // Step 3's compute side for one chunk in ping-pong buffer `b` (at `buf`),
  // on the compute stream after its filled event: the chunk's splits attended
  // (max_attend_items per launch; with `lists`, the listed kernel over each
  // split's block lists, else the dense one), each launch folded in order into
  // the streamed state; consumed[b] recorded after the last reader of the
  // buffer (and of its lists).
  void attend_chunk(const args_type& a, const stream_chunk& c, bf16* buf, std::size_t b, const std::int32_t* lists,
                    const cuda_debug_options& dbg) {
    const stream_plan& plan = *a.plan;
    const index_t block_elems = a.format.block_elems();
    cudaStream_t comp = compute_.get();
    gpu::attend_params& ap = attend_;
    ap.block_lists = lists;
    for (index_t s0 = c.split_begin; s0 < c.split_end; s0 += gpu::max_attend_items) {
      const index_t s1 = std::min<index_t>(c.split_end, s0 + gpu::max_attend_items);
      ap.out_o = split_o_.as<float>();
      ap.out_lse = split_lse_.as<float>();
      ap.delay_cycles = dbg.consumer_delay_cycles;
      ap.num_items = int(s1 - s0);
      gpu::fold_params& fp = fold_;
      fp.state_o = streamed_o_.as<float>();
      fp.state_lse = streamed_lse_.as<float>();
      fp.split_o = split_o_.as<float>();
      fp.split_lse = split_lse_.as<float>();
      fp.hq = hq_;
      fp.num_segments = 0;
      for (index_t s = s0; s < s1; ++s) {
        const stream_split& sp = plan.splits[std::size_t(s)];
        const int local = int(s - s0);
        ap.items[local] = {buf + sp.first_block * block_elems, sp.num_blocks * a.format.block_tokens,
                           sp.batch_index, local, lists != nullptr ? int(sp.list_offset) : 0};
        if (fp.num_segments > 0 && fp.segments[fp.num_segments - 1].batch_index == sp.batch_index)
          fp.segments[fp.num_segments - 1].split_end = local + 1;
        else
          fp.segments[fp.num_segments++] = {sp.batch_index, local, local + 1};
      }
      if (lists != nullptr)
        gpu::launch_attend_listed<Layout>(ap, comp);
      else
        gpu::launch_attend<Layout>(ap, comp);
      if (s1 == c.split_end) cuda_detail::record(consumed_[b], comp);  // last reader of buffer b (and its lists)
      gpu::launch_fold<Layout>(fp, comp);
    }
  }

  // Step 4 of a launch: the copy stream's end recorded for later D2H writes
  // (C9); the D-window attended with the dense kernel; the step's end and the
  // compute-done event recorded; the timing slot handed over.
  void end_step(const args_type& a, int slot) {
    cudaStream_t comp = compute_.get();
    cuda_detail::record(be_->h2d_done_, be_->h2d_.get());  // C9: D2H into host blocks waits for this
    gpu::attend_params& ap = attend_;
    ap.block_lists = nullptr;
    ap.out_o = window_o_.as<float>();
    ap.out_lse = window_lse_.as<float>();
    ap.delay_cycles = 0;
    for (int i0 = 0; i0 < a.batch; i0 += gpu::max_attend_items) {
      const int i1 = std::min(a.batch, i0 + gpu::max_attend_items);
      ap.num_items = i1 - i0;
      for (int i = i0; i < i1; ++i) {
        const window_ref& w = a.windows[std::size_t(i)];
        ap.items[i - i0] = {w.slot, w.tokens, i, i, 0};
      }
      gpu::launch_attend<Layout>(ap, comp);
    }
    cuda_detail::record(t_end_[std::size_t(slot)], comp);
    cuda_detail::record(compute_done_, comp);
    timing_pending_[std::size_t(slot)] = true;
    slot_tokens_[std::size_t(slot)] = a.plan->streamed_blocks * a.format.block_tokens;
    slot_sparse_[std::size_t(slot)] = a.plan->sparse;
    last_slot_ = slot;
    timing_slot_ = slot ^ 1;
  }

  // The sparse launch: launch() with the chunks gathered into staging by the
  // gather threads, the copy stream gated by wait kernels on their progress, block lists
  // uploaded per chunk, and the listed attention kernel.
  void launch_sparse(const args_type& a, const cuda_debug_options& dbg) {
    const stream_plan& plan = *a.plan;
    const index_t block_elems = a.format.block_elems();
    const index_t block_bytes = a.format.block_bytes();
    cudaStream_t h2d = be_->h2d_.get();
    cudaStream_t comp = compute_.get();
    gather_shared& g = *gs_;
    wait_gathers();  // the previous sparse step's (finish() did already, unless it was skipped)
    if (sparse_failed_) throw state_error("gpu_engine::launch: the sparse pipeline stopped after a failed launch");

    // Hand the chunks to the gather threads now: chunk n gathers once the
    // copies of chunk n-2 are done (its copy_done event, recorded below).
    const std::uint64_t first = next_serial_;
    if (copy_done_raw_.size() < plan.chunks.size() + 2) {  // the WAR ring: one event per chunk in flight
      WS_CUDA_TRY(cudaStreamSynchronize(h2d));  // earlier chunks' copies are done: no waits for them
      while (copy_done_raw_.size() < plan.chunks.size() + 2) {
        copy_done_.push_back(cuda_detail::unique_event::create());
        copy_done_raw_.push_back(copy_done_.back().get());
      }
      std::lock_guard lk(g.mu);
      g.copy_done = copy_done_raw_.data();
      g.ring = copy_done_raw_.size();
      g.done_floor = first;
    }
    job_stats_ = {};
    const bool pull = device_pull_;
    for (const stream_chunk& c : plan.chunks) {
      if (c.gathered && pull) {
        ++job_stats_.pulled_chunks;
        job_stats_.pulled_bytes += c.num_blocks * block_bytes;
      } else if (c.gathered) {
        ++job_stats_.gathered_chunks;
        job_stats_.bytes += c.num_blocks * block_bytes;
      } else {
        ++job_stats_.direct_chunks;
      }
    }
    if (!plan.chunks.empty()) {
      {
        std::lock_guard lk(g.mu);
        gather_job& j = g.job;
        j.plan = &plan;
        j.first = first;
        j.block_bytes = block_bytes;
        for (int k = 0; k < 2; ++k) {
          j.staging[k] = staging_[k].data();
          j.lists[k] = reinterpret_cast<std::int32_t*>(lists_host_[k].data());
        }
        j.pull = pull;
        j.skip_staging_wait = dbg.skip_staging_wait;
        j.delay_us = dbg.gather_delay_microseconds;
        std::fill(g.t_first.begin(), g.t_first.end(), -1.0);
        std::fill(g.t_last.begin(), g.t_last.end(), -1.0);
        ++g.job_id;
      }
      g.cv.notify_all();
    }
    next_serial_ = first + plan.chunks.size();
    job_end_ = next_serial_;
    batch_ = a.batch;
    launched_ = true;
    last_sparse_ = true;

    try {
      // 0-2. As launch() (direct chunks read the region itself; gathered
      // blocks landed before the step: hybrid_attention's summary update
      // waited for every host write of newly placed blocks).
      const int tslot = begin_step(a, dbg);

      // 3. Per chunk: gated copy of its staging buffer (or direct runs) and its
      // lists, then the listed attention of its splits and the in-order fold.
      for (std::size_t k = 0; k < plan.chunks.size(); ++k) {
        const stream_chunk& c = plan.chunks[k];
        const std::uint64_t n = first + k;
        const auto slot = std::size_t(n & 1u);
        const auto b = std::size_t(c.buffer);
        bf16* buf = a.ping_pong[b];
        std::int32_t* dev_lists = lists_dev_.as<std::int32_t>() + index_t(b) * list_cap_;
        const bool pulled = pull && c.gathered;
        auto gate = [&] {  // RAW: every gather thread finished chunk n (its blocks, if it gathers, and lists)
          if (!dbg.skip_gather_wait) gpu::launch_wait_host_counters(dev_progress_, int(g.progress.size()), n + 1, h2d);
        };
        if (!pulled) gate();
        if (!dbg.skip_consumed_wait) cuda_detail::wait(h2d, consumed_[b]);  // WAR on ping-pong[b] and its lists
        if (dbg.copy_delay_cycles > 0) gpu::launch_spin(dbg.copy_delay_cycles, h2d);
        if (pulled) {  // device pull: the blocks in staging's order, straight from the region
          pull_src_.resize(std::size_t(c.num_blocks));  // capacity reserved: no allocation
          for (index_t r = c.run_begin; r < c.run_end; ++r) {
            const stream_run& run = plan.runs[std::size_t(r)];
            for (index_t i = 0; i < run.num_blocks; ++i)
              pull_src_[std::size_t(run.dst_block + i)] = run.src + i * block_elems;
          }
          gpu::launch_pull_blocks(pull_src_.data(), c.num_blocks, buf, block_bytes, pull_ctas_, h2d);
          gate();  // only the lists need the gather threads: the pull does not wait for them
        } else if (c.gathered) {
          copy_h2d(buf, reinterpret_cast<const bf16*>(staging_[slot].data()), c.num_blocks * block_bytes, h2d, dbg);
        } else {
          for (index_t r = c.run_begin; r < c.run_end; ++r) {
            const stream_run& run = plan.runs[std::size_t(r)];
            copy_h2d(buf + run.dst_block * block_elems, run.src, run.num_blocks * block_bytes, h2d, dbg);
          }
        }
        const index_t list_ints = c.list_end - c.list_begin;
        if (list_ints > 0)
          WS_CUDA_TRY(cudaMemcpyAsync(dev_lists, lists_host_[slot].data(),
                                      static_cast<std::size_t>(list_ints) * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice, h2d));
        cuda_detail::record(filled_[b], h2d);
        WS_CUDA_TRY(cudaEventRecord(copy_done_raw_[std::size_t(n % copy_done_raw_.size())], h2d));
        {
          std::lock_guard lk(g.mu);
          g.recorded = n + 1;  // the gather of chunk n+2 may now wait for these copies (WAR)
        }
        g.cv.notify_all();
        if (!dbg.skip_filled_wait) cuda_detail::wait(comp, filled_[b]);  // RAW
        attend_chunk(a, c, buf, b, dev_lists, dbg);  // the listed kernel, over the chunk's block lists
      }

      // 4. D-window attention (the dense kernel); timing.
      end_step(a, tslot);
    } catch (...) {
      // Wait kernels already enqueued must not wait for chunks that will never
      // be gathered: release them and stop the pipeline (later sparse launches
      // throw state_error; dense launches are unaffected).
      abort_gathers();
      throw;
    }
  }

  cuda_backend* be_;
  Layout layout_;
  int max_batch_;
  int hq_;
  int batch_ = 0;
  bool launched_ = false;
  device_buffer streamed_o_, streamed_lse_, window_o_, window_lse_, cpu_o_, cpu_lse_, split_o_, split_lse_;
  host_allocation q_host_, cpu_o_host_, cpu_lse_host_;
  cuda_detail::unique_stream compute_, qstream_;
  cuda_detail::unique_event launch_ev_, q_done_, compute_done_, cpu_h2d_done_;
  std::array<cuda_detail::unique_event, max_ping_pong_buffers> filled_, consumed_;
  std::array<cuda_detail::unique_event, 2> t_start_, t_ready_, t_end_;
  std::array<bool, 2> timing_pending_{false, false};
  int timing_slot_ = 0;
  int last_slot_ = 0;
  double last_seconds_ = 0.0;
  std::array<index_t, 2> slot_tokens_{0, 0};
  std::array<bool, 2> slot_sparse_{false, false};
  completed_gpu_cost fresh_cost_{};
  bool fresh_ = false;
  std::vector<void*> step_buffers_raw_;  // ablation: per_step_allocation
  std::array<bf16*, max_ping_pong_buffers> step_buffers_{};
  gpu::attend_params attend_{};
  gpu::fold_params fold_{};
  // Launcher thread (set_launch_thread): the posted job's copies
  std::unique_ptr<launcher_shared> ls_;
  std::thread launcher_;
  bool launcher_refused_ = false;
  bool async_pending_ = false;
  stream_plan job_plan_;
  std::vector<window_ref> job_windows_;
  std::vector<bf16*> job_ping_pong_;
  args_type job_args_{};
  cuda_debug_options job_dbg_{};
  cuda_ablation_options job_abl_{};
  int job_slot_ = 0;
  // Sparse pipeline
  std::unique_ptr<gather_shared> gs_;
  std::vector<std::thread> gather_threads_;
  host_allocation host_progress_;                     // gather threads' progress, page-locked (wait kernel reads it)
  const unsigned long long* dev_progress_ = nullptr;  // its device-side address
  std::vector<cuda_detail::unique_event> copy_done_;  // WAR ring (launch_sparse)
  std::vector<cudaEvent_t> copy_done_raw_;
  host_allocation staging_[2];     // pinned, staging_bytes_ each
  host_allocation lists_host_[2];  // pinned, list_cap_ entries each
  device_buffer lists_dev_;        // list_buffers_ × list_cap_ entries
  index_t staging_bytes_ = 0;
  bool device_pull_ = false;           // sparse_reservation::device_pull (the latest reservation's)
  int pull_ctas_ = 64;                 // sparse_reservation::pull_ctas
  std::vector<const void*> pull_src_;  // per-block sources of one pulled chunk (capacity: chunk_blocks)
  index_t list_cap_ = 0;
  int list_buffers_ = 0;
  std::uint64_t next_serial_ = 0;  // serial of the next sparse chunk
  std::uint64_t job_end_ = 0;      // serial after the last posted job's chunks
  bool last_sparse_ = false;
  bool sparse_failed_ = false;
  gather_stats job_stats_{}, gather_{};
};

static_assert(backend<cuda_backend>);
static_assert(gpu_attention_engine<cuda_backend::gpu_engine<gqa_layout<128>>, cuda_backend, gqa_layout<128>>);

}  // namespace writescope
