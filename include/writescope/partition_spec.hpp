// SPDX-License-Identifier: Apache-2.0
// writescope/partition_spec.hpp — the physical plan of an inplace_kv_cache
// (paper §4.3, Fig. 5: "PartitionSpec").
//
// Sizes are per layer: every layer has the same regions with the same block
// ids, and one routing decision per eviction batch covers all layers.
// Roofline parameters live in the routing policy object (roofline_params), not
// here, because a policy is a compile-time choice and fixed/gpu_only/cpu_only
// have none.
#pragma once

#include <algorithm>
#include <string>

#include "config.hpp"
#include "error.hpp"
#include "layout.hpp"

namespace writescope {

struct partition_spec {
  int num_layers = 1;                  ///< attention layers sharing the cache
  int block_tokens = 64;               ///< tokens per block (all regions)
  int d_window_tokens = 256;           ///< D: the D-window and the eviction batch, a multiple of block_tokens
  int max_sequences = 1;               ///< live sequences at once (D-window slots)
  /// The two host regions' capacities, tokens per layer (all sequences
  /// together). Both 0 (the default) is refused by validate(): at least one
  /// must be set, for the policy's regions (cpu_only needs the first,
  /// gpu_only the second).
  index_t cpu_capacity_tokens = 0;     ///< unpinned compute region, tokens per layer (all sequences)
  index_t pinned_capacity_tokens = 0;  ///< pinned load region at most, tokens per layer
  /// The HBM-resident region (device memory, attended in place by the GPU
  /// engine), tokens per layer, all sequences together; counted in whole
  /// eviction batches (rounded down to a multiple of d_window_tokens), so that
  /// one batch's blocks are contiguous. 0 (the default): no such region, the
  /// cache is the paper's three-region one. Allocated at init, checked first
  /// against the backend's free device memory (resource_error naming both
  /// byte counts). While it has room the built-in policies route every batch
  /// there; when it is full the batches fall through to the host regions.
  index_t hbm_capacity_tokens = 0;
  index_t pinned_initial_tokens = -1;  ///< pinned tokens pinned at init; -1 = all of pinned_capacity_tokens
  index_t pinned_growth_tokens = 0;    ///< tokens added per growth of the pinned region (0 = one D·max_sequences)
  index_t ping_pong_bytes = index_t{64} << 20;  ///< bytes of one ping-pong buffer (rounded down to whole blocks)
  int ping_pong_buffers = 2;           ///< ping-pong buffers (>= 2)
  /// Ramp of a step's chunks (stream_plan), 0 (the default): no ramp. > 0: the
  /// first ping-pong fill of a step holds about this many bytes (rounded down
  /// to whole blocks, at least gpu_split_blocks), each next fill twice the one
  /// before, up to ping_pong_bytes, so the GPU starts attending after a small
  /// copy. The first chunks' attention kernels then hold a few splits each and
  /// run one after another with most of the GPU idle, which can make the fixed
  /// GPU cost per layer larger, not smaller (docs/DECISIONS.md). An option for
  /// machines with slower links or larger buffers, where the fill matters.
  index_t first_chunk_bytes = 0;
  /// Streamed blocks per GPU partial (the split-K unit; batch-invariant). A
  /// step's GPU side ends with the attention of its last chunk, whose length is
  /// one split's work per CTA, so smaller splits shorten that fixed cost per
  /// layer (docs/DECISIONS.md).
  int gpu_split_blocks = 4;
  int cpu_task_blocks = 16;            ///< blocks per CPU task (the unit of CPU parallelism; batch-invariant)

  [[nodiscard]] int window_blocks() const noexcept { return d_window_tokens / block_tokens; }
  [[nodiscard]] index_t cpu_capacity_blocks() const noexcept {
    return (cpu_capacity_tokens + block_tokens - 1) / block_tokens;
  }
  [[nodiscard]] index_t pinned_capacity_blocks() const noexcept {
    return (pinned_capacity_tokens + block_tokens - 1) / block_tokens;
  }
  /// Eviction batches the HBM-resident region holds (hbm_capacity_tokens / D, rounded down).
  [[nodiscard]] index_t hbm_capacity_batches() const noexcept {
    return d_window_tokens > 0 ? std::max<index_t>(hbm_capacity_tokens, 0) / d_window_tokens : 0;
  }
  /// Blocks of the HBM-resident region (whole batches).
  [[nodiscard]] index_t hbm_capacity_blocks() const noexcept { return hbm_capacity_batches() * window_blocks(); }

  /// Throws config_error naming the first field that breaks its rule (both
  /// region capacities 0 included).
  template <kv_layout Layout>
  void validate(const Layout& layout) const {
    auto fail = [](const std::string& m) { throw config_error("partition_spec: " + m); };
    if (num_layers < 1) fail("num_layers " + std::to_string(num_layers) + " must be >= 1");
    if (block_tokens < 1) fail("block_tokens " + std::to_string(block_tokens) + " must be >= 1");
    if (d_window_tokens < block_tokens || d_window_tokens % block_tokens != 0)
      fail("D (d_window_tokens) " + std::to_string(d_window_tokens) + " is not a positive multiple of the block size " +
           std::to_string(block_tokens));
    if (max_sequences < 1) fail("max_sequences " + std::to_string(max_sequences) + " must be >= 1");
    if (cpu_capacity_tokens < 0 || pinned_capacity_tokens < 0 || hbm_capacity_tokens < 0)
      fail("region capacities must be >= 0 (cpu " + std::to_string(cpu_capacity_tokens) + ", pinned " +
           std::to_string(pinned_capacity_tokens) + ", hbm " + std::to_string(hbm_capacity_tokens) + ")");
    if (cpu_capacity_tokens == 0 && pinned_capacity_tokens == 0 && hbm_capacity_batches() == 0)
      fail("cpu_capacity_tokens and pinned_capacity_tokens are both 0 and hbm_capacity_tokens (" +
           std::to_string(hbm_capacity_tokens) + ") holds no whole eviction batch: no token could leave the "
           "D-window, so a sequence could never hold d_window_tokens (" + std::to_string(d_window_tokens) +
           ") tokens; set either (tokens per layer, all sequences together)");
    if (cpu_capacity_blocks() > INT32_MAX || pinned_capacity_blocks() > INT32_MAX || hbm_capacity_blocks() > INT32_MAX)
      fail("a region holds more than 2^31-1 blocks; raise block_tokens");
    if (pinned_initial_tokens > pinned_capacity_tokens)
      fail("pinned_initial_tokens " + std::to_string(pinned_initial_tokens) + " exceeds pinned_capacity_tokens " +
           std::to_string(pinned_capacity_tokens));
    if (pinned_growth_tokens < 0) fail("pinned_growth_tokens must be >= 0");
    if (ping_pong_buffers < 2) fail("ping_pong_buffers " + std::to_string(ping_pong_buffers) + " must be >= 2");
    if (gpu_split_blocks < 1) fail("gpu_split_blocks must be >= 1");
    if (first_chunk_bytes < 0) fail("first_chunk_bytes " + std::to_string(first_chunk_bytes) + " must be >= 0");
    if (cpu_task_blocks < 1) fail("cpu_task_blocks must be >= 1");
    const index_t block_bytes = block_format<Layout>{layout, block_tokens}.block_bytes();
    if (ping_pong_bytes / block_bytes < gpu_split_blocks)
      fail("a ping-pong buffer of " + std::to_string(ping_pong_bytes) + " bytes holds " +
           std::to_string(ping_pong_bytes / block_bytes) + " blocks of " + std::to_string(block_bytes) +
           " bytes, fewer than gpu_split_blocks=" + std::to_string(gpu_split_blocks));
  }

  template <kv_layout Layout>
  [[nodiscard]] index_t ping_pong_blocks(const Layout& layout) const noexcept {
    return ping_pong_bytes / block_format<Layout>{layout, block_tokens}.block_bytes();
  }
  /// Blocks of the first chunk of a step's ramp (0: no ramp); see first_chunk_bytes.
  template <kv_layout Layout>
  [[nodiscard]] index_t first_chunk_blocks(const Layout& layout) const noexcept {
    if (first_chunk_bytes <= 0) return 0;
    const index_t b = first_chunk_bytes / block_format<Layout>{layout, block_tokens}.block_bytes();
    return std::max<index_t>(b, gpu_split_blocks);
  }
};

}  // namespace writescope
