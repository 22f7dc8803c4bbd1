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
#include "stream_plan.hpp"

namespace writescope {

/// Opt-in tag: `using backend_concept = backend_tag;`.
struct backend_tag {};

/// Runtime tag of a copy/write destination. Regions are typed (memory_space);
/// this tag only travels with lists of heterogeneous copies.
enum class memory_kind : std::uint8_t { pageable_host, pinned_host, device };

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
/// [dst_token, dst_token + num_tokens) of the block at `dst`.
struct block_write {
  index_t src_token = 0;
  int num_tokens = 0;
  int dst_token = 0;
  bf16* dst = nullptr;
  memory_kind dst_kind = memory_kind::device;
};

/// One eviction copy: `bytes` from device memory at `src` to host memory at `dst`.
struct block_copy {
  const bf16* src = nullptr;
  bf16* dst = nullptr;
  index_t bytes = 0;
  memory_kind dst_kind = memory_kind::pageable_host;
};

/// The D-window of one sequence of the batch: `slot` (device) holds
/// window_blocks blocks; the first `tokens` rows, in block order, are valid.
struct window_ref {
  const bf16* slot = nullptr;
  int tokens = 0;
};

/// Per-engine partial states of the last step, copied to the host for tests
/// and diagnostics: [batch][Hq][v_dim] and [batch][Hq], dense.
struct debug_partials {
  std::vector<float> cpu_o, cpu_lse;            ///< unpinned region (CPU engine)
  std::vector<float> streamed_o, streamed_lse;  ///< pinned region, streamed through ping-pong
  std::vector<float> window_o, window_lse;      ///< D-window
};

/// What a gpu_engine reserves for sparse steps (docs/SPARSE.md): two staging
/// buffers of `chunk_blocks` blocks of `block_bytes` (page-locked on a real
/// device, like the load region; none when `device_pull`), per-chunk block
/// lists for up to `buffers` ping-pong buffers of `kv_heads` heads, and
/// `gather_threads` host threads (cuda_backend) that gather selected blocks
/// into staging and write the block lists. Reserved once, off the step path; a
/// larger request later grows it (between steps); the transfer mode is the
/// latest reservation's.
struct sparse_reservation {
  index_t chunk_blocks = 0;
  index_t block_bytes = 0;
  int buffers = 2;
  int kv_heads = 1;
  int gather_threads = 1;
  /// sparse_transfer::device_pull: gathered chunks are pulled out of the pinned
  /// region by a copy kernel (cuda_backend; host_backend emulates it by copying
  /// the runs straight into ping-pong), no staging buffers.
  bool device_pull = false;
  /// device_pull: the most CTAs of one pull-kernel launch (sparse_options::pull_ctas), >= 1.
  int pull_ctas = 64;
};

/// The gather of the last sparse step (filled in by gpu_engine::finish).
/// Every chunk of the step's plan is counted once: as gathered, pulled or direct.
struct gather_stats {
  double seconds = 0.0;        ///< wall time from the first host gather memcpy to the last (0 if none)
  index_t bytes = 0;           ///< bytes gathered into staging by host memcpy (host_gather chunks only)
  index_t gathered_chunks = 0; ///< chunks gathered into staging and moved as one copy out of it
  index_t pulled_chunks = 0;   ///< stream_chunk::gathered chunks pulled by the device (sparse_transfer::device_pull)
  index_t pulled_bytes = 0;    ///< their bytes: read by the device over PCIe, no host copy (not in `bytes`)
  index_t direct_chunks = 0;   ///< chunks copied run by run from the pinned region
};

/// Arguments of the GPU side of one step (one layer), see gpu_engine::launch.
template <kv_layout Layout, memory_space ActSpace>
struct gpu_step_args {
  block_format<Layout> format;
  float softmax_scale = 1.0f;
  int batch = 0;
  mem_span<const float, ActSpace> q;          ///< [batch][Hq][q_dim], fp32
  const stream_plan* plan = nullptr;          ///< pinned blocks to stream (host memory); a sparse plan needs
                                              ///< the engine's reserve_sparse() first
  std::span<const window_ref> windows;        ///< [batch] D-window of each sequence
  std::span<bf16* const> ping_pong;           ///< device buffers, plan chunk c uses ping_pong[chunk.buffer]
  bool poison_workspaces = false;             ///< fill partial workspaces with NaN first (tests)
};

/// Outputs of a step: the merged attention output and, optionally, its LSE.
template <memory_space ActSpace>
struct step_outputs {
  mem_span<float, ActSpace> out;   ///< [batch][Hq][v_dim] fp32
  mem_span<float, ActSpace> lse;   ///< [batch][Hq] fp32 natural log; may be empty
  debug_partials* debug = nullptr; ///< when set, receives each engine's partial (host copies)
};

/// The structural part of the backend concept. Layout-dependent operations
/// (write_blocks, gpu_engine<Layout>) are checked where they are instantiated.
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
                    { b.copy_to_host_sync(dst, src, bytes) } -> std::same_as<void>;
                    { cb.name() } -> std::convertible_to<std::string_view>;
                  };

}  // namespace writescope
