// SPDX-License-Identifier: Apache-2.0
// writescope/sparse_pipeline.hpp — the transfer side of a sparse step (paper
// §4.4, Fig. 6; docs/SPARSE.md): how selected pinned blocks reach the GPU, the
// options and the reservation of that pipeline, and what its gather did.
//
//   sparse_block        a selected pinned block and the KV heads that attend it
//                       (the input of stream_plan::build_sparse)
//   sparse_transfer     host gather into staging, or a device pull kernel
//   sparse_options      attention_options::sparse
//   sparse_reservation  what a GPU engine reserves for sparse steps
//   gather_stats        the gather of the last sparse step (engine.last_gather())
//
// The selection side (summaries, selectors) is sparse.hpp. Values only; host
// code.
#pragma once

#include <cstdint>

#include "config.hpp"

namespace writescope {

/// Most KV heads a sparse step supports (one bit per KV head per block).
inline constexpr int max_sparse_kv_heads = 64;

/// How the blocks of a gathered chunk (stream_chunk::gathered: a ping-pong
/// chunk with a short copy run) reach its ping-pong buffer on cuda_backend
/// (docs/SPARSE.md §4.1). Direct chunks (long runs) are DMA-copied run by run
/// in both modes; the attention side is the same in both.
enum class sparse_transfer : std::uint8_t {
  /// Host gather threads memcpy the chunk's blocks (non-temporal stores) into a
  /// page-locked staging buffer; ONE DMA copy then moves it to ping-pong. Host
  /// DRAM traffic is about three times the chunk's bytes (read the blocks,
  /// write staging, the DMA reads staging again), so on a fast link the gather,
  /// not the link, can bound the step (docs/SPARSE.md).
  host_gather,
  /// A copy kernel on the copy stream reads the chunk's blocks straight out of
  /// the pinned load region (page-locked and device-mapped: the GPU addresses
  /// it with the host pointers, unified addressing) over PCIe, and writes them
  /// contiguously into ping-pong in the order and layout staging would have
  /// had. Host DRAM is read once (by PCIe) and never written; no staging
  /// buffer, no host memcpy. It occupies up to sparse_options::pull_ctas CTAs
  /// beside the attention kernels while it runs. Needs a device with unified
  /// addressing and cudaDevAttrCanUseHostPointerForRegisteredMem (config_error
  /// at reservation otherwise) and every pulled block inside a range page-locked
  /// by cuda_host_alloc / cuda_host_register / cuda_backend (pinned_memory_error
  /// at launch otherwise, in every build type).
  device_pull,
};

/// "host_gather" / "device_pull".
[[nodiscard]] constexpr const char* to_string(sparse_transfer t) noexcept {
  return t == sparse_transfer::device_pull ? "device_pull" : "host_gather";
}

/// Options of the sparse pipeline (attention_options::sparse).
struct sparse_options {
  /// Reserve the sparse pipeline when the attention object is constructed: the
  /// GPU engine's two staging buffers (one ping-pong buffer each, page-locked on
  /// cuda_backend like the load region; none with sparse_transfer::device_pull),
  /// its block-list buffers and gather threads, and the summary store's address
  /// space. Otherwise the first sparse step reserves them (a one-time
  /// allocation; later steps allocate nothing).
  bool reserve = false;
  /// Host threads that gather selected pinned blocks into staging
  /// (cuda_backend; the host backend gathers on its emulated-device thread).
  /// They sleep unless a sparse step streams gathered chunks; keeping up with a
  /// PCIe Gen5 link takes several (docs/SPARSE.md). They compete with the CPU engine's threads in a hybrid
  /// step: lower attention_options::cpu_threads by as many. With
  /// sparse_transfer::device_pull no block is gathered on the host and one
  /// thread is started whatever this says (it only writes the chunks' block lists).
  int gather_threads = 4;
  /// How gathered chunks move: host gather + one DMA, or a device pull kernel
  /// (see sparse_transfer for what each does and why device_pull exists).
  /// Default device_pull: one pass over host memory and no host thread
  /// (docs/SPARSE.md §4.1; the rates of both modes: docs/SPARSE.md).
  /// A device without mapped page-locked memory gets a config_error naming the
  /// attribute at reservation: choose host_gather there.
  sparse_transfer transfer = sparse_transfer::device_pull;
  /// sparse_transfer::device_pull: the most CTAs (of 256 threads) one launch of
  /// the pull kernel uses; each CTA copies whole blocks. More CTAs keep more
  /// PCIe reads in flight and take more SM slots from the attention kernels.
  /// A tuning knob (sparse_bench --pull-ctas), used by device_pull on
  /// cuda_backend only; must be >= 1 whatever the mode and backend
  /// (config_error when the pipeline is reserved).
  int pull_ctas = 64;
  /// A ping-pong chunk whose copy runs all hold at least this many bytes is
  /// copied run by run straight from the pinned region (dense-like); any
  /// shorter run sends the chunk through staging (gather, then one copy).
  /// 0: never gather (the discrete-copy ablation); a huge value: always gather.
  index_t direct_run_bytes = index_t{2} << 20;
};

/// A selected pinned block of a sparse step: its id and the KV heads that
/// attend it (bit h = KV head h; never 0).
struct sparse_block {
  block_id id = 0;
  std::uint64_t kv_head_mask = 0;
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

}  // namespace writescope
