// writescope/stream_plan.hpp — how a step's pinned blocks travel through the
// ping-pong buffers (paper §4.2, §6; DESIGN.md §5 step 4).
//
// The plan cuts every sequence's pinned blocks (logical order) into splits of
// at most `split_blocks` blocks — the unit of one GPU partial state — and packs
// whole splits into chunks of at most `chunk_blocks` blocks, one chunk per
// ping-pong fill, buffers used round-robin. Split boundaries depend only on the
// sequence itself, so a sequence's partials (and their merge order) are the
// same whatever its batchmates are (batch invariance, fault kind K10).
// Physically adjacent blocks that land adjacently in a chunk are coalesced into
// one copy run, so an orderly pool streams as a few large copies (≥ 2 MB on
// real hardware; 4 KB copies crawl at 1.6 GB/s, DESIGN.md §6).
//
// Vectors are reused across steps: no allocation in steady state.
#pragma once

#include <algorithm>
#include <span>
#include <vector>

#include "bf16.hpp"
#include "config.hpp"
#include "memory_space.hpp"

namespace writescope {

/// One copy: `num_blocks` contiguous blocks from pinned memory at `src` to
/// block `dst_block` of the chunk's ping-pong buffer.
struct stream_run {
  const bf16* src = nullptr;  ///< pinned host
  index_t dst_block = 0;
  index_t num_blocks = 0;
};

/// One GPU partial: blocks [first_block, first_block + num_blocks) of the
/// chunk's buffer, all of sequence `batch_index`, each block full.
struct stream_split {
  int batch_index = 0;
  index_t first_block = 0;
  int num_blocks = 0;
};

/// One ping-pong fill: runs [run_begin, run_end), splits [split_begin, split_end).
struct stream_chunk {
  int buffer = 0;
  index_t run_begin = 0, run_end = 0;
  index_t split_begin = 0, split_end = 0;
  index_t num_blocks = 0;
};

class stream_plan {
 public:
  std::vector<stream_run> runs;
  std::vector<stream_split> splits;
  std::vector<stream_chunk> chunks;
  index_t streamed_blocks = 0;
  index_t max_run_blocks = 0;

  /// Builds the plan for `batch` sequences. `blocks_of(i)` returns sequence i's
  /// pinned block ids (std::span<const block_id>, logical order);
  /// `block_ptr(id)` the block's address in the pinned region. Requires
  /// 1 <= split_blocks <= chunk_blocks and buffers >= 1.
  template <class BlocksOf, class BlockPtr>
  void build(int batch, BlocksOf&& blocks_of, BlockPtr&& block_ptr, index_t block_elems, index_t chunk_blocks,
             int split_blocks, int buffers) {
    runs.clear();
    splits.clear();
    chunks.clear();
    streamed_blocks = 0;
    max_run_blocks = 0;
    stream_chunk cur{};
    const bf16* run_end_ptr = nullptr;  // address right after the open run's last source block
    auto close_chunk = [&] {
      if (cur.num_blocks == 0) return;
      cur.run_end = index_t(runs.size());
      cur.split_end = index_t(splits.size());
      chunks.push_back(cur);
      cur = stream_chunk{};
      cur.buffer = int(chunks.size() % std::size_t(buffers));
      cur.run_begin = index_t(runs.size());
      cur.split_begin = index_t(splits.size());
      run_end_ptr = nullptr;
    };
    for (int i = 0; i < batch; ++i) {
      const auto ids = blocks_of(i);
      const index_t n = index_t(ids.size());
      for (index_t b0 = 0; b0 < n; b0 += split_blocks) {
        const int nb = int(std::min<index_t>(split_blocks, n - b0));
        if (cur.num_blocks + nb > chunk_blocks) close_chunk();
        splits.push_back({i, cur.num_blocks, nb});
        for (int k = 0; k < nb; ++k) {
          const bf16* src = block_ptr(ids[std::size_t(b0 + k)]);
          if (src == run_end_ptr && !runs.empty() && runs.back().dst_block + runs.back().num_blocks == cur.num_blocks) {
            ++runs.back().num_blocks;
          } else {
            runs.push_back({src, cur.num_blocks, 1});
          }
          max_run_blocks = std::max(max_run_blocks, runs.back().num_blocks);
          run_end_ptr = src + block_elems;
          ++cur.num_blocks;
        }
        streamed_blocks += nb;
      }
    }
    close_chunk();
  }
};

}  // namespace writescope
