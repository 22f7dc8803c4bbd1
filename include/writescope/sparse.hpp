// SPDX-License-Identifier: Apache-2.0
// writescope/sparse.hpp — block-level sparse selection on the partitioned
// format (paper §4.4, §7.5; docs/SPARSE.md).
//
// A sparse step attends, per sequence, only a selected set of its placed
// blocks (plus its whole D-window), exactly: the output equals full attention
// restricted to the selected blocks' tokens and the D-window. The selection is
// made per KV head (each GQA query group picks its own blocks; MLA has one KV
// head, so one set per sequence) by a `block_selector` from per-block
// summaries and the step's queries. Each selected block is attended where it
// lives: unpinned blocks in place by the CPU engine, pinned blocks streamed to
// the GPU — gathered into a contiguous staging buffer first, so a scattered
// selection still moves as one full-bandwidth copy per ping-pong chunk, or
// (sparse_transfer::device_pull) read straight out of the pinned region by a
// copy kernel.
//
// This header holds the selection side:
//   block_summary_store  one summary row per (layer, region, block id, KV head)
//                        — the mean key (MLA: the mean latent‖rope row) —
//                        computed once per block lifetime, the first time a
//                        sparse step of its layer sees it after placement
//   selection_input      what a selector sees for one sequence
//   block_selection      what it returns: logical block indices per KV head
//   block_selector       the concept (opt-in tag, then structural)
//   top_k_selector       keep k (or a ratio) of the placed blocks by score
//                        max over the group's heads of scale·q·summary
//   select_all           every block (a sparse step then equals the dense one bit for bit)
//   step_selection       a validated selection of one step (KV-head mask per block)
// The step itself is hybrid_attention::step(layer, seqs, q, scale, out, selector).
// The transfer side's types (sparse_options, sparse_transfer, the engine's
// reservation and gather statistics) are in sparse_pipeline.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#if defined(_OPENMP)
#  include <omp.h>
#endif

#include "bf16.hpp"
#include "config.hpp"
#include "error.hpp"
#include "host_memory.hpp"
#include "inplace_kv_cache.hpp"
#include "layout.hpp"
#include "partition_spec.hpp"
#include "policy.hpp"
#include "sparse_pipeline.hpp"  // sparse_options and the pipeline types, reachable through this header too

namespace writescope {

// -----------------------------------------------------------------------------
// Summaries
// -----------------------------------------------------------------------------

/// The summary of one (block, KV head): the mean of the block's key rows
/// (GQA: plane K of that head; MLA: the whole latent‖rope row), fp32,
/// summed in token order then divided by block_tokens. `out` has row_elems
/// elements.
template <kv_layout Layout>
inline void mean_key_summary(const block_format<Layout>& f, const bf16* block, int kv_head, float* out) noexcept {
  constexpr int R = Layout::row_elems;
  const bf16* k = block + f.slice_offset(Layout::key_plane, kv_head);
  for (int e = 0; e < R; ++e) out[e] = 0.0f;
  for (int t = 0; t < f.block_tokens; ++t)
    for (int e = 0; e < R; ++e) out[e] += k[index_t(t) * R + e].to_float();
  const float n = float(f.block_tokens);
  for (int e = 0; e < R; ++e) out[e] /= n;
}

/// Summaries of placed blocks, in host memory next to the regions: one row of
/// row_elems fp32 per (layer, region, block id, KV head), in address space
/// reserved for each region's capacity (MAP_NORESERVE: resident as written;
/// 1/block_tokens of the KV bytes of the blocks summarized).
///
/// update() summarizes the blocks of a batch that are new since it last saw
/// them — blocks placed by prefill routing or a flush, or all blocks of a
/// sequence that reuses an id (sequence_state::generation) — once per block
/// lifetime. On a backend whose host-region writes land asynchronously
/// (cuda_backend: D2H of evictions and prefill) it first waits for them
/// through the given hook, so a block is read only after it landed. Not
/// thread-safe; OpenMP threads compute the rows.
template <kv_layout Layout>
class block_summary_store {
 public:
  static constexpr int row_elems = Layout::row_elems;

  block_summary_store() = default;

  /// Reserves address space for every layer and region of `spec`. Throws
  /// resource_error when the reservation is refused.
  void reserve(const Layout& layout, const partition_spec& spec) {
    if (reserved()) return;
    std::vector<host_allocation> mem;
    const index_t row_bytes = index_t{layout.kv_heads()} * row_elems * index_t(sizeof(float));
    const index_t caps[2] = {spec.cpu_capacity_blocks(), spec.pinned_capacity_blocks()};
    for (int l = 0; l < spec.num_layers; ++l)
      for (int r = 0; r < 2; ++r) mem.push_back(detail::map_pageable(caps[r] * row_bytes, "block summaries"));
    tracks_.assign(std::size_t(spec.num_layers), {});
    mem_ = std::move(mem);
    hkv_ = layout.kv_heads();
    caps_[0] = caps[0];
    caps_[1] = caps[1];
    layers_ = spec.num_layers;
  }
  [[nodiscard]] bool reserved() const noexcept { return layers_ > 0; }

  /// The summary row of (layer, region, block id, KV head): row_elems fp32.
  [[nodiscard]] const float* row(int layer, placement region, block_id id, int kv_head) const noexcept {
    const auto r = std::size_t(region == placement::cpu_compute ? 0 : 1);
    return reinterpret_cast<const float*>(mem_[std::size_t(layer) * 2 + r].data()) +
           (index_t(id) * hkv_ + kv_head) * row_elems;
  }

  /// Summarizes the blocks of `seqs` in layer v.layer that it has not seen
  /// (see the class comment); `sync_host_writes()` is called once first when
  /// there are any. `threads` OpenMP threads compute the rows.
  template <class SyncHostWrites>
  void update(const layer_views<Layout>& v, std::span<const sequence_id> seqs, int threads,
              SyncHostWrites&& sync_host_writes) {
    auto& tracks = tracks_[std::size_t(v.layer)];
    work_.clear();
    for (const sequence_id s : seqs) {
      const sequence_state& st = v.sequences[std::size_t(s)];
      if (std::size_t(s) >= tracks.size()) tracks.resize(std::size_t(s) + 1);
      const track& tr = tracks[std::size_t(s)];
      const index_t first = tr.generation == st.generation ? tr.done : 0;
      for (index_t b = first; b < index_t(st.block_table.size()); ++b) work_.push_back({s, b});
    }
    if (!work_.empty()) {
      sync_host_writes();
      const auto n = std::int64_t(work_.size());
      auto one = [&](std::int64_t k) {
        const item& it = work_[std::size_t(k)];
        const block_ref& br = v.sequences[std::size_t(it.seq)].block_table[std::size_t(it.block)];
        const bf16* blk = v.host_block(br);
        for (int h = 0; h < hkv_; ++h)
          mean_key_summary(v.format, blk, h, const_cast<float*>(row(v.layer, br.region, br.id, h)));
      };
#if defined(_OPENMP)
#  pragma omp parallel for schedule(static) num_threads(std::max(1, threads)) if (n > 16)
      for (std::int64_t k = 0; k < n; ++k) one(k);
#else
      (void)threads;
      for (std::int64_t k = 0; k < n; ++k) one(k);
#endif
      summarized_ += n;
    }
    for (const sequence_id s : seqs) {
      const sequence_state& st = v.sequences[std::size_t(s)];
      tracks[std::size_t(s)] = {st.generation, index_t(st.block_table.size())};
    }
  }

  /// Blocks summarized so far (all layers): each placed block once per layer.
  [[nodiscard]] index_t summarized_blocks() const noexcept { return summarized_; }

 private:
  struct track {
    std::uint64_t generation = 0;
    index_t done = 0;  ///< blocks [0, done) of that generation's block table are summarized
  };
  struct item {
    sequence_id seq;
    index_t block;
  };
  std::vector<host_allocation> mem_;          // [layer * 2 + region]
  std::vector<std::vector<track>> tracks_;    // [layer][sequence id]
  std::vector<item> work_;
  int hkv_ = 1;
  int layers_ = 0;
  index_t caps_[2] = {0, 0};
  index_t summarized_ = 0;
};

// -----------------------------------------------------------------------------
// Selector interface
// -----------------------------------------------------------------------------

/// What a selector sees for one sequence of a sparse step. All host memory,
/// valid during the select() call.
template <kv_layout Layout>
struct selection_input {
  const Layout* layout = nullptr;
  int layer = 0;
  int batch_index = 0;            ///< position of the sequence in the step's batch
  sequence_id seq = 0;
  index_t placed_blocks = 0;      ///< n: logical blocks [0, n) (token order) may be selected
  int block_tokens = 0;
  const float* q = nullptr;       ///< this sequence's queries [Hq][q_dim], fp32, unscaled (MLA: absorbed q')
  float scale = 1.0f;             ///< the step's softmax scale
  std::span<const block_ref> blocks;                    ///< [n] where logical block b lives
  const block_summary_store<Layout>* summaries = nullptr;
  const layer_views<Layout>* views = nullptr;

  [[nodiscard]] int kv_heads() const noexcept { return layout->kv_heads(); }
  [[nodiscard]] int group_size() const noexcept { return layout->group_size(); }
  [[nodiscard]] int num_q_heads() const noexcept { return layout->num_q_heads(); }
  /// Query head h: q_dim fp32. Query heads [kv_head*group, (kv_head+1)*group) read KV head kv_head.
  [[nodiscard]] const float* query(int q_head) const noexcept { return q + index_t(q_head) * Layout::q_dim; }
  /// Summary of logical block b for `kv_head` (row_elems fp32; mean key, see mean_key_summary).
  [[nodiscard]] const float* summary(index_t b, int kv_head) const noexcept {
    const block_ref& r = blocks[std::size_t(b)];
    return summaries->row(layer, r.region, r.id, kv_head);
  }
  [[nodiscard]] placement region(index_t b) const noexcept { return blocks[std::size_t(b)].region; }
  /// The block's KV itself (block format of layout.hpp), for selectors with their own scores.
  [[nodiscard]] const bf16* block_data(index_t b) const noexcept {
    return views->host_block(blocks[std::size_t(b)]);
  }
};

/// A selector's answer for one sequence: per KV head, logical block indices in
/// [0, placed_blocks), any order; duplicates are ignored. An index outside the
/// range makes the step throw shape_error (before any work is started).
class block_selection {
 public:
  void reset(int kv_heads, index_t placed_blocks) {
    heads_.resize(std::size_t(kv_heads));
    for (auto& h : heads_) h.clear();
    n_ = placed_blocks;
  }
  [[nodiscard]] int kv_heads() const noexcept { return int(heads_.size()); }
  [[nodiscard]] index_t placed_blocks() const noexcept { return n_; }
  /// The list of KV head `kv_head` (append to it). Throws shape_error for a bad head.
  [[nodiscard]] std::vector<index_t>& blocks(int kv_head) {
    check_head(kv_head);
    return heads_[std::size_t(kv_head)];
  }
  [[nodiscard]] const std::vector<index_t>& blocks(int kv_head) const {
    check_head(kv_head);
    return heads_[std::size_t(kv_head)];
  }
  void add(int kv_head, index_t block) { blocks(kv_head).push_back(block); }
  /// Every placed block for every KV head.
  void add_all() {
    for (auto& h : heads_)
      for (index_t b = 0; b < n_; ++b) h.push_back(b);
  }

 private:
  void check_head(int kv_head) const {
    if (kv_head < 0 || kv_head >= kv_heads())
      throw shape_error("block_selection: KV head " + std::to_string(kv_head) + " outside [0, " +
                        std::to_string(kv_heads()) + ")");
  }
  std::vector<std::vector<index_t>> heads_;
  index_t n_ = 0;
};

/// Opt-in tag: `using selector_concept = block_selector_tag;` (nothing satisfies
/// the concept by accident).
struct block_selector_tag {};

/// A block selector for layout `Layout`: `s.select(in, out)` fills `out` (reset
/// to in.kv_heads() empty lists of in.placed_blocks) for one sequence. Called
/// from the step's thread, once per sequence with placed blocks, in batch
/// order; its answer must depend only on `in` for batch invariance (K10).
template <class S, class Layout>
concept block_selector = kv_layout<Layout> && std::same_as<typename S::selector_concept, block_selector_tag> &&
                         requires(S& s, const selection_input<Layout>& in, block_selection& out) {
                           { s.select(in, out) } -> std::same_as<void>;
                         };

/// Selects every placed block: the sparse step then computes exactly what the
/// dense step computes, with the same splits, tasks and merge order (bit-identical).
struct select_all {
  using selector_concept = block_selector_tag;
  template <kv_layout Layout>
  void select(const selection_input<Layout>&, block_selection& out) const {
    out.add_all();
  }
};

/// Keeps, per (sequence, KV head), the `keep(n)` placed blocks of highest score
///     score(b, kv_head) = max over the head's query group g of scale · q_g · summary(b, kv_head)
/// (ties: the lower block index first). keep(n) = min(n, k) for blocks(k),
/// min(n, ceil(ratio · n)) for ratio(r). Scores in fp32, fixed order.
class top_k_selector {
 public:
  using selector_concept = block_selector_tag;

  /// Keep `k` blocks per (sequence, KV head). Throws config_error for k < 0.
  static top_k_selector blocks(index_t k) {
    if (k < 0) throw config_error("top_k_selector: keep " + std::to_string(k) + " blocks must be >= 0");
    top_k_selector s;
    s.k_ = k;
    return s;
  }
  /// Keep ceil(ratio · n) of n placed blocks. Throws config_error unless 0 <= ratio <= 1.
  static top_k_selector ratio(double keep_ratio) {
    if (!(keep_ratio >= 0.0 && keep_ratio <= 1.0))
      throw config_error("top_k_selector: keep ratio " + detail::format_double(keep_ratio) + " is outside [0, 1]");
    top_k_selector s;
    s.ratio_ = keep_ratio;
    return s;
  }
  top_k_selector() = default;  ///< keeps everything (ratio 1)

  [[nodiscard]] index_t keep(index_t n) const noexcept {
    if (k_ >= 0) return std::min(n, k_);
    return std::min(n, index_t(std::ceil(ratio_ * double(n) - 1e-9)));
  }

  template <kv_layout Layout>
  void select(const selection_input<Layout>& in, block_selection& out) {
    const index_t n = in.placed_blocks;
    const index_t k = keep(n);
    if (k >= n) {
      out.add_all();
      return;
    }
    if (k == 0) return;
    constexpr int R = Layout::row_elems;
    const int group = in.group_size();
    scores_.resize(std::size_t(n));
    order_.resize(std::size_t(n));
    for (int h = 0; h < in.kv_heads(); ++h) {
      auto score_block = [&](std::int64_t b) {
        const float* s = in.summary(b, h);
        float best = -std::numeric_limits<float>::infinity();
        for (int g = 0; g < group; ++g) {
          const float* q = in.query(h * group + g);
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 partial sums: vectorizable, fixed order
          int e = 0;
          for (; e + 8 <= R; e += 8)
            for (int j = 0; j < 8; ++j) acc[j] += q[e + j] * s[e + j];
          for (; e < R; ++e) acc[0] += q[e] * s[e];
          const float dot = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
          const float v = in.scale * dot;
          if (v > best) best = v;  // NaN never wins
        }
        scores_[std::size_t(b)] = best;
      };
#if defined(_OPENMP)
#  pragma omp parallel for schedule(static) if (n * group * R > (index_t{1} << 20))
      for (std::int64_t b = 0; b < n; ++b) score_block(b);
#else
      for (std::int64_t b = 0; b < n; ++b) score_block(b);
#endif
      for (index_t b = 0; b < n; ++b) order_[std::size_t(b)] = b;
      const auto better = [&](index_t a, index_t b) {
        const float sa = scores_[std::size_t(a)], sb = scores_[std::size_t(b)];
        return sa > sb || (!(sb > sa) && a < b);
      };
      std::nth_element(order_.begin(), order_.begin() + std::ptrdiff_t(k - 1), order_.end(), better);
      std::vector<index_t>& dst = out.blocks(h);
      dst.assign(order_.begin(), order_.begin() + std::ptrdiff_t(k));
      std::sort(dst.begin(), dst.end());
    }
  }

 private:
  index_t k_ = -1;
  double ratio_ = 1.0;
  std::vector<float> scores_;
  std::vector<index_t> order_;
};

static_assert(block_selector<select_all, gqa_layout<128>>);
static_assert(block_selector<top_k_selector, mla_layout<512, 64>>);

// -----------------------------------------------------------------------------
// A validated selection
// -----------------------------------------------------------------------------

/// The selection of one sparse step, validated: per sequence of the batch (in
/// batch order) a KV-head mask per placed block (bit h: KV head h attends it).
/// hybrid_attention::last_selection() returns the last step's.
class step_selection {
 public:
  void clear() {
    begin_.assign(1, 0);
    masks_.clear();
  }
  [[nodiscard]] int batch() const noexcept { return begin_.empty() ? 0 : int(begin_.size()) - 1; }
  [[nodiscard]] index_t placed_blocks(int i) const noexcept {
    return begin_[std::size_t(i) + 1] - begin_[std::size_t(i)];
  }
  [[nodiscard]] std::uint64_t mask(int i, index_t b) const noexcept {
    return masks_[std::size_t(begin_[std::size_t(i)] + b)];
  }
  [[nodiscard]] std::span<const std::uint64_t> masks(int i) const noexcept {
    return {masks_.data() + begin_[std::size_t(i)], std::size_t(placed_blocks(i))};
  }
  /// The blocks KV head `kv_head` of sequence i attends, ascending.
  [[nodiscard]] std::vector<index_t> blocks(int i, int kv_head) const {
    std::vector<index_t> r;
    for (index_t b = 0; b < placed_blocks(i); ++b)
      if ((mask(i, b) >> kv_head) & 1u) r.push_back(b);
    return r;
  }

  /// Appends sequence `seq` (n placed blocks) with the answer `sel` of a
  /// selector; throws shape_error naming the sequence, the head and the block
  /// for an index outside [0, n) (the selection is then left without it).
  void append(sequence_id seq, index_t n, const block_selection& sel) {
    const index_t at = index_t(masks_.size());
    masks_.resize(std::size_t(at + n), 0);
    for (int h = 0; h < sel.kv_heads(); ++h)
      for (const index_t b : sel.blocks(h)) {
        if (b < 0 || b >= n) {
          masks_.resize(std::size_t(at));
          throw shape_error("step: the block selector chose block " + std::to_string(b) + " for sequence " +
                            std::to_string(seq) + ", KV head " + std::to_string(h) + "; the sequence has " +
                            std::to_string(n) + " placed blocks (valid: [0, " + std::to_string(n) + "))");
        }
        masks_[std::size_t(at + b)] |= std::uint64_t{1} << h;
      }
    begin_.push_back(at + n);
  }

 private:
  std::vector<index_t> begin_{0};
  std::vector<std::uint64_t> masks_;
};

}  // namespace writescope
