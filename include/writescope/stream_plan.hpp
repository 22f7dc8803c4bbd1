// SPDX-License-Identifier: Apache-2.0
// writescope/stream_plan.hpp — how a step's pinned blocks travel through the
// ping-pong buffers (paper §4.2, §6).
//
// The plan cuts every sequence's pinned blocks (logical order) into splits of
// at most `split_blocks` blocks — the unit of one GPU partial state — and packs
// whole splits into chunks of at most `chunk_blocks` blocks, one chunk per
// ping-pong fill, buffers used round-robin. With a ramp (`first_chunk_blocks`,
// partition_spec::first_chunk_bytes) the first chunk of a step holds only that
// many blocks and each next one twice as many as the one before, up to
// `chunk_blocks`: the GPU starts attending after one small copy instead of a
// whole buffer (the pipeline fill, which is the step's fixed overhead on the
// GPU side), and the chunks that follow are still large copies. Split boundaries depend only on the
// sequence itself, so a sequence's partials (and their merge order) are the
// same whatever its batchmates are (batch invariance, fault kind K10).
// Physically adjacent blocks that land adjacently in a chunk are coalesced into
// one copy run, so an orderly pool streams as a few large copies: a DMA copy
// has a fixed cost of microseconds, so copies must be megabytes to reach the
// link's rate (docs/BENCHMARKS.md, "Machine facts").
//
// One builder makes both kinds of plan; the dense plan is its select-all
// case. Sparse plans (build_sparse, docs/SPARSE.md; paper §4.4, Fig. 6): the
// same splits, chunks and runs over each sequence's SELECTED pinned blocks
// (the union over its KV heads), plus, per split and KV head, the list of the
// split's blocks that head attends. A chunk whose copy runs are all long is
// copied run by run from the pinned region (`gathered == false`); otherwise
// its runs are first gathered by host memcpy into a contiguous staging buffer
// and the chunk moves as ONE copy. With every block selected, splits, chunks
// and runs are exactly the dense ones.
//
// Resident splits (add_resident): a sequence's blocks in the HBM-resident
// region are attended in place, without a copy, before the first streamed
// chunk; they are cut at every eviction batch (one batch's blocks are
// contiguous, two batches' need not be) and every `split_blocks` blocks
// inside one, so their boundaries too depend only on the sequence itself.
// For engines with a split-K path over that region (cuda_backend's resident
// kernels) add_resident also cuts each sequence into resident groups: whole
// eviction batches, ceil(batches / resident_groups_per_sequence) of them per
// group and at most max_group_blocks blocks, each batch one contiguous run —
// longer units of work than one batch, their boundaries again set by the
// sequence alone.
//
// Vectors are reused across steps: no allocation in steady state.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "bf16.hpp"
#include "config.hpp"
#include "memory_space.hpp"
#include "sparse_pipeline.hpp"  // sparse_block

namespace writescope {

/// One copy: `num_blocks` contiguous blocks from the pinned load region (`src`,
/// num_blocks blocks, page-locked host) to block `dst_block` of the chunk's
/// ping-pong buffer.
struct stream_run {
  pinned_span<const bf16> src{};
  index_t dst_block = 0;
  index_t num_blocks = 0;
};

/// One GPU partial: blocks [first_block, first_block + num_blocks) of the
/// chunk's buffer, all of sequence `batch_index`, each block full.
/// Sparse plans: `list_offset` is where the split's block lists start, counted
/// from its chunk's `list_begin` in stream_plan::block_lists; KV head h's list
/// is the num_blocks + 1 entries at list_offset + h*(num_blocks + 1):
/// [count, i_0, ..., i_{count-1}, padding], i_j in [0, num_blocks) ascending,
/// relative to first_block. Dense plans: -1.
struct stream_split {
  int batch_index = 0;
  index_t first_block = 0;
  int num_blocks = 0;
  index_t list_offset = -1;
};

/// One unit of the split-K resident path (stream_plan::add_resident): whole
/// eviction batches of sequence `batch_index`, in logical order; batch k of the
/// group starts at block id resident_runs[first_run + k] of the HBM-resident
/// region and holds `batch_blocks` consecutive ids, the last one possibly
/// fewer; `num_blocks` blocks in all.
struct resident_group {
  int batch_index = 0;
  index_t first_run = 0;
  int num_runs = 0;
  index_t num_blocks = 0;
};

/// One ping-pong fill: runs [run_begin, run_end), splits [split_begin, split_end).
/// Sparse plans: its block lists are block_lists[list_begin, list_end), and
/// `gathered` says whether its runs go through a staging buffer (one copy of
/// num_blocks blocks) or are copied straight from the pinned region.
struct stream_chunk {
  int buffer = 0;
  index_t run_begin = 0, run_end = 0;
  index_t split_begin = 0, split_end = 0;
  index_t num_blocks = 0;
  index_t list_begin = 0, list_end = 0;
  bool gathered = false;
};

class stream_plan {
 public:
  std::vector<stream_run> runs;
  std::vector<stream_split> splits;
  std::vector<stream_chunk> chunks;
  index_t streamed_blocks = 0;
  index_t max_run_blocks = 0;
  // Sparse plans only (build_sparse); a dense build leaves them empty / false.
  bool sparse = false;
  std::vector<std::int32_t> block_lists;  ///< per-split, per-KV-head block lists (see stream_split)
  index_t max_chunk_list_ints = 0;        ///< largest list_end - list_begin of a chunk
  index_t gathered_blocks = 0;            ///< blocks of chunks with gathered == true
  /// Splits over blocks of the HBM-resident region (add_resident), attended in
  /// place before the first chunk, in this order: first_block is the block id
  /// in that region, the split's blocks are ids [first_block, first_block +
  /// num_blocks) (contiguous). list_offset -1. Empty after build() /
  /// build_sparse() until add_resident().
  std::vector<stream_split> resident_splits;
  index_t resident_blocks = 0;
  /// The same blocks as resident groups (add_resident with max_group_blocks >
  /// 0; else empty), sequence-major, and the first block id of each of their
  /// eviction batches (resident_group::first_run indexes it).
  std::vector<resident_group> resident_groups;
  std::vector<block_id> resident_runs;
  index_t resident_run_blocks = 0;  ///< blocks of one eviction batch (a run); 0 without groups
  /// A sequence with n eviction batches in the region is cut into groups of
  /// ceil(n / resident_groups_per_sequence) batches (at most max_group_blocks
  /// blocks): enough units of work for a lone sequence, few for a long one.
  static constexpr index_t resident_groups_per_sequence = 8;
  /// The group length hybrid_attention asks for (max_group_blocks =
  /// max(1, this / block_tokens)): long enough that one CTA's fixed work (its
  /// queries, its partial, the fold) is small against its tokens. MLA's CTA
  /// attends all heads of a 1,152-byte token and has few CTAs per item (one
  /// per 16 heads); a GQA item is several CTAs (KV heads × head groups) of a
  /// few hundred bytes per token each, so shorter items keep more CTAs busy.
  static constexpr index_t resident_group_max_tokens_mla = 4096;
  static constexpr index_t resident_group_max_tokens_gqa = 1024;

  /// Most blocks chunk `k` of a step may hold: `chunk_blocks`, or with a ramp
  /// (first_chunk_blocks > 0) max(first_chunk_blocks, split_blocks) * 2^k,
  /// whichever is smaller. Never below split_blocks (a split never straddles).
  [[nodiscard]] static index_t chunk_capacity(std::size_t k, index_t chunk_blocks, int split_blocks,
                                              index_t first_chunk_blocks) noexcept {
    if (first_chunk_blocks <= 0) return chunk_blocks;
    index_t cap = std::max<index_t>(first_chunk_blocks, split_blocks);
    for (std::size_t j = 0; j < k && cap < chunk_blocks; ++j) cap *= 2;
    return std::min(cap, chunk_blocks);
  }

  /// Builds the dense plan for `batch` sequences: the select-all case of the
  /// builder (every pinned block, attended by every KV head, so no block lists
  /// and no chunk gathered). `blocks_of(i)` returns sequence i's pinned block
  /// ids (std::span<const block_id>, logical order); `block_ptr(id)` the
  /// block in the pinned region (pinned_region::block: a pinned_span of
  /// block_elems elements). Requires 1 <= split_blocks <=
  /// chunk_blocks and buffers >= 1. `first_chunk_blocks` > 0 ramps the chunk
  /// sizes: chunk k holds at most min(chunk_blocks, max(first_chunk_blocks,
  /// split_blocks) * 2^k) blocks (0: every chunk may fill a whole buffer).
  template <class BlocksOf, class BlockPtr>
  void build(int batch, BlocksOf&& blocks_of, BlockPtr&& block_ptr, index_t block_elems, index_t chunk_blocks,
             int split_blocks, int buffers, index_t first_chunk_blocks = 0) {
    build_plan<false>(batch, blocks_of, block_ptr, block_elems, chunk_blocks, split_blocks, buffers, 0, 0,
                      first_chunk_blocks);
  }

  /// Builds a sparse plan: `selected_of(i)` returns sequence i's selected
  /// pinned blocks (std::span<const sparse_block>, logical order, masks != 0,
  /// bits only below kv_heads); splits of at most `split_blocks` of them are
  /// packed into chunks as in build(). A chunk is copied straight from the
  /// pinned region when each of its runs holds at least `direct_run_blocks`
  /// blocks (0: always), else gathered. Requires 1 <= split_blocks <=
  /// chunk_blocks, buffers >= 1, 1 <= kv_heads <= 64. A chunk's lists hold at
  /// most 2 * kv_heads * chunk_blocks entries. `first_chunk_blocks` ramps the
  /// chunk sizes as in build().
  /// Adds the resident splits of `batch` sequences: `blocks_of(i)` returns
  /// sequence i's blocks in the HBM-resident region (std::span<const
  /// block_id>, logical order, each eviction batch's `batch_blocks` ids
  /// consecutive), cut at every batch and every `split_blocks` blocks inside
  /// one. With `max_group_blocks` > 0 also the resident groups (see
  /// resident_group): per sequence of n batches, groups of g =
  /// min(ceil(n / resident_groups_per_sequence), max(1, max_group_blocks /
  /// batch_blocks)) batches, the last group of a sequence possibly fewer.
  /// Requires split_blocks >= 1, batch_blocks >= 1, max_group_blocks >= 0.
  template <class BlocksOf>
  void add_resident(int batch, BlocksOf&& blocks_of, int split_blocks, int batch_blocks, index_t max_group_blocks = 0) {
    resident_splits.clear();
    resident_groups.clear();
    resident_runs.clear();
    resident_blocks = 0;
    resident_run_blocks = max_group_blocks > 0 ? index_t(batch_blocks) : 0;
    const index_t group_cap = std::max<index_t>(1, max_group_blocks / batch_blocks);
    for (int i = 0; i < batch; ++i) {
      const auto ids = blocks_of(i);
      const index_t n = index_t(ids.size());
      for (index_t b0 = 0; b0 < n;) {
        const index_t batch_end = (b0 / batch_blocks + 1) * batch_blocks;
        const int nb = int(std::min<index_t>({index_t(split_blocks), n - b0, batch_end - b0}));
        resident_splits.push_back({i, index_t(ids[std::size_t(b0)]), nb});
        resident_blocks += nb;
        b0 += nb;
      }
      if (max_group_blocks <= 0 || n == 0) continue;
      const index_t batches = (n + batch_blocks - 1) / batch_blocks;
      const index_t per_group = std::min(group_cap, (batches + resident_groups_per_sequence - 1) /
                                                        resident_groups_per_sequence);
      for (index_t k0 = 0; k0 < batches; k0 += per_group) {
        const index_t k1 = std::min(batches, k0 + per_group);
        resident_groups.push_back({i, index_t(resident_runs.size()), int(k1 - k0),
                                   std::min(n, k1 * batch_blocks) - k0 * batch_blocks});
        for (index_t k = k0; k < k1; ++k) resident_runs.push_back(ids[std::size_t(k * batch_blocks)]);
      }
    }
  }

  template <class SelectedOf, class BlockPtr>
  void build_sparse(int batch, SelectedOf&& selected_of, BlockPtr&& block_ptr, index_t block_elems,
                    index_t chunk_blocks, int split_blocks, int buffers, int kv_heads, index_t direct_run_blocks,
                    index_t first_chunk_blocks = 0) {
    build_plan<true>(batch, selected_of, block_ptr, block_elems, chunk_blocks, split_blocks, buffers, kv_heads,
                     direct_run_blocks, first_chunk_blocks);
  }

 private:
  [[nodiscard]] static block_id entry_id(block_id id) noexcept { return id; }
  [[nodiscard]] static block_id entry_id(const sparse_block& b) noexcept { return b.id; }

  // The one builder. Entries are block ids (dense: every KV head attends every
  // block) or sparse_blocks (Lists: per-split, per-KV-head block lists from
  // the masks, and chunks with a run shorter than direct_run_blocks gathered).
  template <bool Lists, class EntriesOf, class BlockPtr>
  void build_plan(int batch, EntriesOf& entries_of, BlockPtr& block_ptr, index_t block_elems, index_t chunk_blocks,
                  int split_blocks, int buffers, int kv_heads, index_t direct_run_blocks,
                  index_t first_chunk_blocks) {
    runs.clear();
    splits.clear();
    chunks.clear();
    block_lists.clear();
    resident_splits.clear();
    resident_groups.clear();
    resident_runs.clear();
    resident_run_blocks = 0;
    resident_blocks = 0;
    streamed_blocks = 0;
    max_run_blocks = 0;
    max_chunk_list_ints = 0;
    gathered_blocks = 0;
    sparse = Lists;
    stream_chunk cur{};
    const bf16* run_end_ptr = nullptr;  // address right after the open run's last source block
    auto extend = [&](stream_run& r) {  // one more block at the end of run r
      ++r.num_blocks;
      r.src = pinned_span<const bf16>(r.src.data(), r.src.size() + block_elems);
    };
    auto close_chunk = [&] {
      if (cur.num_blocks == 0) return;
      cur.run_end = index_t(runs.size());
      cur.split_end = index_t(splits.size());
      if constexpr (Lists) {
        cur.list_end = index_t(block_lists.size());
        index_t shortest = std::numeric_limits<index_t>::max();
        for (index_t r = cur.run_begin; r < cur.run_end; ++r)
          shortest = std::min(shortest, runs[std::size_t(r)].num_blocks);
        cur.gathered = shortest < direct_run_blocks;
        if (cur.gathered) gathered_blocks += cur.num_blocks;
        max_chunk_list_ints = std::max(max_chunk_list_ints, cur.list_end - cur.list_begin);
      }
      chunks.push_back(cur);
      cur = stream_chunk{};
      cur.buffer = int(chunks.size() % std::size_t(buffers));
      cur.run_begin = index_t(runs.size());
      cur.split_begin = index_t(splits.size());
      cur.list_begin = index_t(block_lists.size());
      run_end_ptr = nullptr;
    };
    for (int i = 0; i < batch; ++i) {
      const auto entries = entries_of(i);
      const index_t n = index_t(entries.size());
      for (index_t b0 = 0; b0 < n; b0 += split_blocks) {
        const int nb = int(std::min<index_t>(split_blocks, n - b0));
        if (cur.num_blocks + nb > chunk_capacity(chunks.size(), chunk_blocks, split_blocks, first_chunk_blocks))
          close_chunk();
        if constexpr (Lists) {
          splits.push_back({i, cur.num_blocks, nb, index_t(block_lists.size()) - cur.list_begin});
          for (int h = 0; h < kv_heads; ++h) {  // [count, indices..., padding] per KV head
            const std::size_t at = block_lists.size();
            block_lists.push_back(0);
            std::int32_t count = 0;
            for (int k = 0; k < nb; ++k)
              if ((entries[std::size_t(b0 + k)].kv_head_mask >> h) & 1u) {
                block_lists.push_back(k);
                ++count;
              }
            block_lists[at] = count;
            block_lists.resize(at + std::size_t(nb) + 1, -1);
          }
        } else {
          splits.push_back({i, cur.num_blocks, nb});
        }
        for (int k = 0; k < nb; ++k) {
          const pinned_span<const bf16> src = block_ptr(entry_id(entries[std::size_t(b0 + k)]));
          if (src.data() == run_end_ptr && !runs.empty() &&
              runs.back().dst_block + runs.back().num_blocks == cur.num_blocks) {
            extend(runs.back());
          } else {
            runs.push_back({src, cur.num_blocks, 1});
          }
          max_run_blocks = std::max(max_run_blocks, runs.back().num_blocks);
          run_end_ptr = src.data() + src.size();
          ++cur.num_blocks;
        }
        streamed_blocks += nb;
      }
    }
    close_chunk();
  }
};

}  // namespace writescope
