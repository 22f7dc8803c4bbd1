// SPDX-License-Identifier: Apache-2.0
// writescope/backend.hpp — what a backend is: where the "device" regions live
// (D-window, ping-pong), how KV gets written and evicted, and the engine that
// runs the GPU side of a decode step (docs/ARCHITECTURE.md).
//
// Two backends exist: host_backend (host_backend.hpp) emulates the device in
// host memory (DMA = memcpy, GPU kernel = the CPU kernel on a worker thread) so
// the whole pipeline runs without a GPU; cuda_backend (cuda/cuda_backend.hpp)
// is the real one. Both satisfy `backend`; both provide `gpu_engine<Layout>`.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "bf16.hpp"
#include "config.hpp"
#include "host_memory.hpp"
#include "layout.hpp"
#include "memory_space.hpp"
#include "partial_state.hpp"
#include "region.hpp"
#include "sparse_pipeline.hpp"
#include "stream_plan.hpp"

namespace writescope {

/// Opt-in tag: `using backend_concept = backend_tag;`.
struct backend_tag {};

/// Runtime tag of a copy/write destination. Regions are typed (region.hpp);
/// this tag only travels with lists of heterogeneous copies, and is derived
/// from the destination's space type (kind_of_space), never written by hand.
enum class memory_kind : std::uint8_t { pageable_host, pinned_host, device };

/// The memory_kind of memory space S.
template <memory_space S>
inline constexpr memory_kind kind_of_space = std::same_as<S, pageable_host_space> ? memory_kind::pageable_host
                                             : std::same_as<S, pinned_host_space> ? memory_kind::pinned_host
                                                                                  : memory_kind::device;

/// KV of `num_tokens` tokens in token-major order, as a model produces it, in
/// memory space Space (the backend's activation space).
///   plane p, element (token t, kv_head h, i) at planes[p][t*token_stride + h*Layout::row_elems + i]
/// GQA: planes = {K, V}; MLA: planes = {c_kv ‖ k_pe row}. token_stride 0 means
/// dense (kv_heads * row_elems).
template <kv_layout Layout, memory_space Space>
struct kv_tokens {
  std::array<const bf16*, Layout::planes> planes{};
  index_t num_tokens = 0;
  index_t token_stride = 0;

  [[nodiscard]] index_t stride(const Layout& l) const noexcept {
    return token_stride != 0 ? token_stride : index_t{l.kv_heads()} * Layout::row_elems;
  }
};

/// Write input tokens [src_token, src_token + num_tokens) into rows
/// [dst_token, dst_token + num_tokens) of the block at `dst` (in the space
/// `dst_kind` names). Made by into(), from a block of a typed region.
struct block_write {
  index_t src_token = 0;
  int num_tokens = 0;
  int dst_token = 0;
  bf16* dst = nullptr;
  memory_kind dst_kind = memory_kind::device;

  /// A write into `block` (one block of a region in space S).
  template <memory_space S>
  [[nodiscard]] static constexpr block_write into(const mem_span<bf16, S>& block, index_t src_token, int num_tokens,
                                                  int dst_token) noexcept {
    return {src_token, num_tokens, dst_token, block.data(), kind_of_space<S>};
  }
};

/// One eviction copy: `bytes` from device memory at `src` to `dst` (in the
/// space `dst_kind` names). Made by evict() (device to host: the backend's
/// copy_blocks_to_host) or within_device() (device to device, a D-window into
/// the HBM-resident region: copy_blocks_on_device).
struct block_copy {
  const bf16* src = nullptr;
  bf16* dst = nullptr;
  index_t bytes = 0;
  memory_kind dst_kind = memory_kind::pageable_host;

  /// Copies all of `src` (device) to the start of `dst` (a host region's blocks).
  template <class T, memory_space S>
    requires host_accessible_space<S>
  [[nodiscard]] static constexpr block_copy evict(const mem_span<T, device_space>& src,
                                                  const mem_span<bf16, S>& dst) noexcept {
    return {src.data(), dst.data(), src.size() * index_t(sizeof(bf16)), kind_of_space<S>};
  }
  /// Copies all of `src` (device) to the start of `dst` (device: blocks of the
  /// HBM-resident region).
  template <class T>
  [[nodiscard]] static constexpr block_copy within_device(const mem_span<T, device_space>& src,
                                                          const mem_span<bf16, device_space>& dst) noexcept {
    return {src.data(), dst.data(), src.size() * index_t(sizeof(bf16)), memory_kind::device};
  }
};

/// The D-window of one sequence of the batch: `blocks` (device) are its slot's
/// window_blocks blocks; the first `tokens` rows, in block order, are valid.
template <kv_layout Layout>
struct window_ref {
  device_region<Layout> blocks{};
  int tokens = 0;
};

/// Per-engine partial states of the last step, copied to the host for tests
/// and diagnostics: [batch][Hq][v_dim] and [batch][Hq], dense.
struct debug_partials {
  std::vector<float> cpu_o, cpu_lse;            ///< unpinned region (CPU engine)
  std::vector<float> streamed_o, streamed_lse;  ///< pinned region, streamed through ping-pong
  std::vector<float> window_o, window_lse;      ///< D-window
};

/// Arguments of the GPU side of one step (one layer), see gpu_engine::launch.
template <kv_layout Layout, memory_space ActSpace>
struct gpu_step_args {
  block_format<Layout> format;
  float softmax_scale = 1.0f;
  int batch = 0;
  mem_span<const float, ActSpace> q;          ///< [batch][Hq][q_dim], fp32
  const stream_plan* plan = nullptr;          ///< pinned blocks to stream (host memory); a sparse plan needs
                                              ///< the engine's reserve_sparse() first. Its resident_splits
                                              ///< name blocks of `resident`, attended in place first
  device_region<Layout> resident{};           ///< the layer's HBM-resident region (device)
  std::span<const window_ref<Layout>> windows;  ///< [batch] D-window of each sequence
  ping_pong_view<Layout> ping_pong;           ///< device buffers, plan chunk c uses buffer chunk.buffer
  bool poison_workspaces = false;             ///< fill partial workspaces with NaN first (tests)
  /// false: the step has no CPU partial (no sequence of the batch has blocks in
  /// the unpinned region and the CPU assist takes none): the engine neither
  /// copies q to the host nor uploads a CPU partial, and merges
  /// (HBM ⊕ streamed) ⊕ D-window alone — the same bits, since an empty partial
  /// (lse = -inf) is an exact identity of the merge. host_queries() and
  /// cpu_partial() must not be called for such a step.
  bool cpu_side = true;
};

/// Outputs of a step: the merged attention output and, optionally, its LSE.
template <memory_space ActSpace>
struct step_outputs {
  mem_span<float, ActSpace> out;   ///< [batch][Hq][v_dim] fp32
  mem_span<float, ActSpace> lse;   ///< [batch][Hq] fp32 natural log; may be empty
  debug_partials* debug = nullptr; ///< when set, receives each engine's partial (host copies)
};

/// GPU-side cost of one completed launch, reported by an asynchronous engine
/// (gpu_engine::take_completed_gpu_cost) for a launch that finished since the
/// last report; hybrid_attention feeds it to the policy in place of the step's.
struct completed_gpu_cost {
  double seconds = 0.0;         ///< stream + attend, merge excluded
  /// From the moment the caller's work before the launch was done (the
  /// compute stream may start) to the end of the attention: `seconds` without
  /// the copies that ran ahead of it. What the CPU engine's time compares with.
  double critical_seconds = 0.0;
  index_t streamed_tokens = 0;  ///< KV tokens that launch streamed through ping-pong
  bool sparse = false;          ///< that launch was a sparse step's (selected blocks)
  index_t resident_tokens = 0;  ///< KV tokens that launch attended in the HBM-resident region
};

/// The GPU side of a decode step for one layout, as hybrid_attention drives it
/// once per step from one thread: launch(args) starts it (the engine may work
/// asynchronously until finish): it attends the plan's resident splits in the
/// HBM-resident region in place, then streams and attends the chunks, folding
/// every split in plan order (resident first) into one running state per
/// sequence, then the D-window; host_queries() gives the step's queries in
/// host memory ([batch][Hq][q_dim] fp32, for the CPU engine); the CPU engine
/// writes its merged partial into cpu_partial(batch) (host memory, dense);
/// finish(out) merges (HBM ⊕ streamed) ⊕ D-window ⊕ CPU into `out` (activation space)
/// and returns the GPU side's seconds; reserve_sparse / last_gather serve
/// sparse steps (sparse_pipeline.hpp). `E::asynchronous` declares whether the
/// engine's timing is of an earlier launch: then take_completed_gpu_cost()
/// reports it, and the step's host enqueue time feeds the policy's K.
/// Construction: E(backend, layout, max_batch), allocating every workspace.
template <class E, class Backend, class Layout>
concept gpu_attention_engine =
    kv_layout<Layout> && std::constructible_from<E, Backend&, const Layout&, int> &&
    std::convertible_to<decltype(E::asynchronous), bool> &&
    requires(E& e, const gpu_step_args<Layout, typename Backend::activation_space>& args,
             const step_outputs<typename Backend::activation_space>& out, const sparse_reservation& r, int batch) {
      { e.launch(args) } -> std::same_as<void>;
      { e.host_queries() } -> std::convertible_to<const float*>;
      { e.cpu_partial(batch) } -> std::same_as<host_partial_view<float>>;
      { e.finish(out) } -> std::same_as<double>;
      { e.reserve_sparse(r) } -> std::same_as<void>;
      { e.last_gather() } -> std::convertible_to<const gather_stats&>;
    } && (!E::asynchronous || requires(E& e) {
      { e.take_completed_gpu_cost() } -> std::same_as<completed_gpu_cost>;
    });

/// The GPU engine hybrid_attention<Cache, CpuKernel> runs on backend B: B's
/// gpu_engine<Layout>. A backend whose device is emulated by CPU kernels
/// (host_backend) specializes it so that its device runs CpuKernel too.
template <class B, class Layout, class CpuKernel>
struct gpu_engine_for {
  using type = typename B::template gpu_engine<Layout>;
};
template <class B, class Layout, class CpuKernel>
using gpu_engine_for_t = typename gpu_engine_for<B, Layout, CpuKernel>::type;

/// The structural part of the backend concept: device memory, staging,
/// evictions, and the host-write ordering the cache and hybrid_attention rely
/// on — synchronize_host_writes() returns once every host-region write issued
/// so far (evictions, prefill) has landed (inplace_kv_cache::read_token waits
/// on it before reading a host region); complete_host_writes() once deferred
/// prefill writes have (a backend whose writes land on return makes both
/// no-ops). reserve_eviction_bounce() makes the backend's eviction staging
/// into pageable memory resident now, if it has any (cuda_backend: the
/// page-locked bounce buffer; a backend without one makes it a no-op); the
/// cache calls it at init when its pinned region is page-locked at init and
/// from prefault_cpu_region(), between steps, on the owning thread; it never
/// throws (a refusal leaves evictions on their direct path).
/// copy_blocks_on_device(copies) makes device-to-device copies (evictions of
/// D-windows into the HBM-resident region) ordered after the appends that
/// wrote their sources and before any later step's reads of their
/// destinations and any later append into their sources (cuda_backend: on the
/// caller stream); device_free_bytes() is the device memory free now (the
/// cache checks its HBM-resident region against it at init; host_backend:
/// an emulated figure, set_device_free_bytes). Layout-dependent
/// operations (write_blocks, gpu_attention_engine) are checked where they are
/// instantiated.
template <class B>
concept backend = std::same_as<typename B::backend_concept, backend_tag> &&
                  memory_space<typename B::activation_space> &&
                  requires(B& b, const B& cb, index_t bytes, std::span<const block_copy> copies, void* dst,
                           const std::byte* src, std::byte* dev, std::uint16_t pattern) {
                    typename B::device_buffer;
                    { b.allocate_device(bytes, "") } -> std::same_as<typename B::device_buffer>;
                    { b.allocate_staging(bytes) } -> std::same_as<host_allocation>;
                    { b.fill_device(dev, bytes, pattern) } -> std::same_as<void>;
                    { b.copy_blocks_to_host(copies) } -> std::same_as<void>;
                    { b.copy_blocks_on_device(copies) } -> std::same_as<void>;
                    { cb.device_free_bytes() } -> std::same_as<index_t>;
                    { b.copy_to_host_sync(dst, src, bytes) } -> std::same_as<void>;
                    { b.synchronize_host_writes() } -> std::same_as<void>;
                    { b.complete_host_writes() } -> std::same_as<void>;
                    { b.reserve_eviction_bounce() } noexcept -> std::same_as<void>;
                    { cb.name() } -> std::convertible_to<std::string_view>;
                  };

/// A backend that can defer its pageable prefill writes (cuda_backend; not
/// host_backend, whose writes land on return): set_deferred_host_writes(max)
/// sets the most bytes pending, deferred_host_writes() reads it back, and
/// reserve_deferred_host_writes(bytes) page-locks that much of the staging the
/// deferred writes go through now, throwing config_error for bytes outside
/// [0, max] and pinned_memory_error when page-locking is refused;
/// deferred_host_writes_reserved_bytes() is what is page-locked.
/// inplace_kv_cache::reserve_deferred_host_writes forwards to a backend that
/// models this and is a no-op on one that does not.
template <class B>
concept deferred_host_write_backend =
    backend<B> && requires(B& b, const B& cb, index_t bytes) {
      { b.set_deferred_host_writes(bytes) } -> std::same_as<void>;
      { cb.deferred_host_writes() } -> std::same_as<index_t>;
      { b.reserve_deferred_host_writes(bytes) } -> std::same_as<void>;
      { cb.deferred_host_writes_reserved_bytes() } -> std::same_as<index_t>;
    };

}  // namespace writescope
