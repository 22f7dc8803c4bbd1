// SPDX-License-Identifier: Apache-2.0
// writescope/inplace_kv_cache.hpp — the InplaceKVCache format (paper §4).
//
// Every cached token of every sequence lives in exactly one of three places
// (four with the HBM tier), chosen when it is written and never moved afterwards:
//
//   unpinned compute region  host, pageable; attended in place by the CPU engine
//   pinned load region       host, page-locked; streamed to the GPU through ping-pong
//   HBM-resident region      device (partition_spec::hbm_capacity_tokens, optional);
//                            attended in place by the GPU engine, filled first
//   D-window                 device; the newest < D tokens of each sequence
//
// plus the fourth region, ping-pong: fixed device buffers the streamed blocks
// pass through, overwritten every step, never rebuilt. All regions store whole
// blocks in the block format of layout.hpp; all layers share one block table
// per sequence (one routing decision per eviction batch covers every layer);
// each layer has its own arena in each region.
//
// The paper's four operations (§4.3):
//   init    — the constructor: sizes and allocates the regions (the pinned
//             region may start smaller and grow batch by batch, never mid-step)
//   append  — append_prefill() routes a prompt's KV to its final regions at
//             write time (whole eviction batches, by the policy; the remainder
//             stays in the D-window); append() stages one decode token per
//             sequence in the D-window
//   views   — zero-copy views of a layer's regions and block tables
//   flush   — evicts every full D-window (D tokens, all layers) whole to the
//             region the policy picks (into the HBM-resident region by a
//             device-to-device copy, else to the host)
//
// Ragged batches: each sequence has its own length, block table and share.
// end_sequence() returns its blocks and D-window slot for in-place reuse.
// Admission and release are O(1) in the number of sequences: free D-window
// slots and ended sequence ids are kept in lists, the most recently freed
// taken first (a fresh cache hands out slots and ids 0, 1, 2, ...).
//
// Errors: every operation validates before it mutates; on a throw the cache is
// unchanged (strong guarantee). docs/ERRORS.md lists the cases.
// Threading: not thread-safe; drive a cache from one thread.
#pragma once

#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include "backend.hpp"
#include "block_allocator.hpp"
#include "error.hpp"
#include "host_memory.hpp"
#include "layout.hpp"
#include "memory_space.hpp"
#include "partition_spec.hpp"
#include "policy.hpp"
#include "region.hpp"

namespace writescope {

/// A placed block of a sequence: its region and its id in that region's pool.
struct block_ref {
  placement region = placement::gpu_load;
  block_id id = 0;
};

/// Bookkeeping of one sequence (read-only to users, through views()).
struct sequence_state {
  bool live = false;
  index_t prompt_tokens = 0;
  index_t placed_tokens = 0;          ///< tokens placed out of the D-window, every region (a multiple of D)
  index_t cpu_placed_tokens = 0;      ///< of which in the unpinned compute region
  index_t hbm_placed_tokens = 0;      ///< of which in the HBM-resident region
  int window_slot = -1;               ///< D-window slot
  std::vector<block_ref> block_table; ///< placed blocks in token order
  std::vector<block_id> cpu_blocks;   ///< unpinned compute blocks, token order
  std::vector<block_id> pinned_blocks;///< pinned load blocks, token order
  /// HBM-resident blocks, token order; each eviction batch's window_blocks ids
  /// are consecutive (the region is allocated in whole batches).
  std::vector<block_id> hbm_blocks;
  std::vector<int> window_tokens;     ///< [layer] valid D-window rows
  std::vector<std::uint8_t> layer_ready;  ///< [layer] prompt written (or no prompt)
  /// Distinct for every begin_sequence() of the cache (from 1): a sequence id
  /// reused after end_sequence() gets a new generation, so per-block data kept
  /// outside the cache (sparse block summaries) can tell the new owner apart.
  std::uint64_t generation = 0;

  [[nodiscard]] index_t total_tokens(int layer) const noexcept { return placed_tokens + window_tokens[std::size_t(layer)]; }
};

/// Options that change no result, only diagnostics.
struct cache_options {
  /// Fill every region with poison at init (K = 3e4, V = 1e4 as bf16 via a
  /// single pattern 3e4) so that an over-read or unwritten row shows in the
  /// output. Touches all memory: tests only.
  bool poison = false;
};

/// Poison bf16 value (3e4) used by cache_options::poison.
inline constexpr std::uint16_t poison_bf16_bits = bf16::from_float(3.0e4f).bits;

/// Zero-copy views of one layer's regions (paper §4.3 `views`), typed by
/// memory space and storage (region.hpp). Valid until the next mutating call
/// on the cache.
template <kv_layout Layout>
struct layer_views {
  int layer = 0;
  block_format<Layout> format;
  int window_blocks = 0;
  std::span<const sequence_state> sequences;  ///< indexed by sequence_id; check `live`

  // This layer's regions.
  cpu_region<Layout> cpu;              ///< unpinned compute region (pageable host), block ids of cpu_blocks
  pinned_region<Layout> pinned;        ///< pinned load region (page-locked slabs), block ids of pinned_blocks
  device_region<Layout> window;        ///< D-window (device): slot s is blocks [s*window_blocks, (s+1)*window_blocks)
  device_region<Layout> hbm;           ///< HBM-resident region (device), block ids of hbm_blocks (empty without one)
  ping_pong_view<Layout> ping_pong;    ///< ping-pong buffers (device)
  index_t ping_pong_blocks = 0;        ///< blocks per ping-pong buffer
  index_t first_chunk_blocks = 0;      ///< ramp start (partition_spec::first_chunk_bytes; 0: none)

  /// Host-readable start of unpinned block `id` / pinned block `id`.
  [[nodiscard]] const bf16* cpu_block(block_id id) const noexcept { return cpu.block(id).data(); }
  [[nodiscard]] const bf16* pinned_block(block_id id) const noexcept { return pinned.block(id).data(); }
  /// Host-readable start of a placed block, in whichever host region it lives
  /// (`b` must not be an HBM-resident block: device memory).
  [[nodiscard]] const bf16* host_block(const block_ref& b) const noexcept {
    return b.region == placement::cpu_compute ? cpu_block(b.id) : pinned_block(b.id);
  }
  /// D-window slot `slot` as a region of window_blocks blocks (device).
  [[nodiscard]] device_region<Layout> window_region(int slot) const noexcept {
    return window.sub(index_t(slot) * window_blocks, window_blocks);
  }
  /// Start of D-window slot `slot` (device memory).
  [[nodiscard]] const bf16* window_slot(int slot) const noexcept { return window_region(slot).block(0).data(); }
};

/// Occupancy of the regions, in blocks (per layer) and bytes (all layers).
struct region_usage {
  index_t cpu_used_blocks = 0, cpu_capacity_blocks = 0;
  index_t pinned_used_blocks = 0, pinned_capacity_blocks = 0, pinned_max_blocks = 0;
  index_t hbm_used_blocks = 0, hbm_capacity_blocks = 0;  ///< HBM-resident region (whole batches)
  int live_sequences = 0, max_sequences = 0;
  index_t cpu_region_bytes = 0, pinned_region_bytes = 0, d_window_bytes = 0, ping_pong_bytes = 0;
  index_t hbm_region_bytes = 0;
};

/// What one flush() did.
struct flush_report {
  int evicted_sequences = 0;
  int cpu_batches = 0;
  int gpu_batches = 0;  ///< into the pinned load region
  int hbm_batches = 0;  ///< into the HBM-resident region
};

/// The cache's axes (docs/ARCHITECTURE.md): the KV layout, the backend that
/// holds the device regions and runs the GPU engine, the allocator of the
/// pinned load region's page-locked slabs, the routing policy, and the block
/// allocator that hands out block ids in each of the two host regions (one
/// instance per region; block_pool, lowest free ids first, by default).
template <kv_layout Layout, backend Backend, pinned_allocator PinnedAllocator, routing_policy Policy,
          block_allocator BlockAllocator = block_pool>
class inplace_kv_cache {
 public:
  using layout_type = Layout;
  using backend_type = Backend;
  using policy_type = Policy;
  using pinned_allocator_type = PinnedAllocator;
  using block_allocator_type = BlockAllocator;
  using activation_space = typename Backend::activation_space;
  using kv_input = kv_tokens<Layout, activation_space>;

  /// init (§4.3): validates `spec`, allocates the unpinned compute region
  /// (reserved, resident on first write), the pinned load region's initial
  /// slabs (page-locked now, off the step path), the D-window, ping-pong and
  /// the HBM-resident region (partition_spec::hbm_capacity_tokens).
  /// Throws config_error for an invalid spec, resource_error /
  /// pinned_memory_error when memory is refused (nothing stays allocated);
  /// resource_error before anything is allocated when the HBM-resident region
  /// and the other device regions need more than backend.device_free_bytes(),
  /// naming the region's bytes, the other device bytes and the free bytes.
  inplace_kv_cache(Backend& backend, const Layout& layout, const partition_spec& spec, Policy policy,
                   PinnedAllocator pinned_allocator = {}, cache_options options = {})
      : backend_(&backend),
        layout_(layout),
        spec_((spec.validate(layout), spec)),
        format_{layout, spec.block_tokens},
        policy_(std::move(policy)),
        pinned_alloc_(std::move(pinned_allocator)),
        options_(options) {
    const index_t block_bytes = format_.block_bytes();
    const index_t cap_cpu = spec_.cpu_capacity_blocks();
    const index_t cap_pin = spec_.pinned_capacity_blocks();
    const index_t window_bytes = index_t(spec_.max_sequences) * spec_.window_blocks() * block_bytes * spec_.num_layers;
    pp_blocks_ = spec_.ping_pong_blocks(layout_);
    const index_t pp_bytes = pp_blocks_ * block_bytes * spec_.ping_pong_buffers;
    const index_t hbm_bytes = spec_.hbm_capacity_blocks() * block_bytes * spec_.num_layers;
    if (hbm_bytes > 0) {  // before anything is allocated
      const index_t free_bytes = backend.device_free_bytes();
      if (hbm_bytes > free_bytes || window_bytes + pp_bytes > free_bytes - hbm_bytes)
        throw resource_error("inplace_kv_cache: the HBM-resident region needs " + format_bytes(hbm_bytes) + " (" +
                             std::to_string(hbm_bytes) + " bytes: partition_spec::hbm_capacity_tokens " +
                             std::to_string(spec_.hbm_capacity_tokens) + " per layer, " +
                             std::to_string(spec_.hbm_capacity_batches()) + " eviction batches, " +
                             std::to_string(spec_.num_layers) + " layers) and the D-window and ping-pong " +
                             std::to_string(window_bytes + pp_bytes) + " bytes more, but the device (" +
                             std::string(backend.name()) + ") has " + std::to_string(free_bytes) +
                             " bytes free; lower partition_spec::hbm_capacity_tokens");
    }
    slab_blocks_ = spec_.pinned_growth_tokens > 0
                       ? (spec_.pinned_growth_tokens + spec_.block_tokens - 1) / spec_.block_tokens
                       : index_t(spec_.window_blocks()) * spec_.max_sequences;
    slab_blocks_ = std::max<index_t>(1, std::min<index_t>(slab_blocks_, std::max<index_t>(cap_pin, 1)));
    cpu_pool_ = BlockAllocator(cap_cpu, cap_cpu, "unpinned compute region", "partition_spec::cpu_capacity_tokens");
    pinned_pool_ = BlockAllocator(0, cap_pin, "pinned load region", "partition_spec::pinned_capacity_tokens");
    const index_t hbm_batches = spec_.hbm_capacity_batches();
    hbm_pool_ = BlockAllocator(hbm_batches, hbm_batches, "HBM-resident region", "partition_spec::hbm_capacity_tokens");

    cpu_mem_ = detail::map_pageable(cap_cpu * block_bytes * spec_.num_layers, "unpinned compute region");
    const index_t initial_pin = spec_.pinned_initial_tokens < 0
                                    ? cap_pin
                                    : (spec_.pinned_initial_tokens + spec_.block_tokens - 1) / spec_.block_tokens;
    grow_pinned_to(initial_pin);
    // Everything page-locked at init: so is the backend's eviction staging
    // (nothing is page-locked inside a step; never throws).
    if (spec_.pinned_initial_tokens < 0 && cap_cpu > 0) backend.reserve_eviction_bounce();

    d_window_ = backend_->allocate_device(window_bytes, "D-window");
    ping_pong_mem_ = backend_->allocate_device(pp_bytes, "ping-pong");
    if (hbm_bytes > 0) hbm_mem_ = backend_->allocate_device(hbm_bytes, "HBM-resident region");
    // end_sequence() releases HBM batches through this list: no allocation there.
    tmp_slots_.reserve(std::size_t(hbm_batches));
    // The free lists hold at most max_sequences entries each: reserved here,
    // after the regions (a refused region allocates none of it), so that
    // end_sequence() never allocates.
    free_slots_.reserve(std::size_t(spec_.max_sequences));
    for (int s = spec_.max_sequences - 1; s >= 0; --s) free_slots_.push_back(s);  // slot 0 is taken first
    free_ids_.reserve(std::size_t(spec_.max_sequences));
    if (options_.poison) {
      backend_->fill_device(d_window_.data(), d_window_.size_bytes(), poison_bf16_bits);
      backend_->fill_device(ping_pong_mem_.data(), ping_pong_mem_.size_bytes(), poison_bf16_bits);
      if (hbm_bytes > 0) backend_->fill_device(hbm_mem_.data(), hbm_mem_.size_bytes(), poison_bf16_bits);
      auto* c = reinterpret_cast<std::uint16_t*>(cpu_mem_.data());
      std::fill(c, c + cpu_mem_.size_bytes() / 2, poison_bf16_bits);
    }
  }

  inplace_kv_cache(const inplace_kv_cache&) = delete;
  inplace_kv_cache& operator=(const inplace_kv_cache&) = delete;

  // ---------------------------------------------------------------------------
  // Sequences
  // ---------------------------------------------------------------------------

  /// Announces that the next begin_sequence() calls admit prompts of
  /// `prompt_tokens` tokens in total (an engine admitting a batch of prompts
  /// knows it). Until they are admitted, each prompt batch is routed against
  /// the placed length the step will attend once all of them are in
  /// (eq. 2's L, paper §5.2) rather than against the tokens placed so far:
  /// otherwise, with Δ > 0, the first prompts of a batch see a small L and go
  /// mostly to the CPU, and placed blocks never move (docs/DECISIONS.md).
  /// Each begin_sequence() consumes its prompt's tokens from the announcement;
  /// announce_admission(0) withdraws what is left. A hint: routing only,
  /// never capacity. Throws shape_error for a negative count.
  void announce_admission(index_t prompt_tokens) {
    if (prompt_tokens < 0)
      throw shape_error("announce_admission: prompt_tokens " + std::to_string(prompt_tokens) + " < 0");
    announced_tokens_ = prompt_tokens;
  }
  /// Prompt tokens announced and not yet admitted (announce_admission()).
  [[nodiscard]] index_t announced_tokens() const noexcept { return announced_tokens_; }

  /// Admits a sequence whose prompt has `prompt_tokens` tokens: routes its
  /// floor(P/D) whole eviction batches by the policy (write-time routing; the
  /// HBM-resident region first while it has room, then the host regions),
  /// allocates their blocks in every layer and reserves a D-window slot for
  /// the remaining P mod D tokens and the decode tokens to come. The KV itself
  /// arrives through append_prefill(), layer by layer.
  /// The slot and the id come from free lists: O(1) in the number of
  /// sequences (admission_probes()); the work that grows is the prompt's
  /// own (floor(P/D) routing decisions, their blocks).
  /// Throws shape_error for P < 0; capacity_error when no D-window slot is
  /// free (naming partition_spec::max_sequences) or a region has too few free
  /// blocks for the prompt's batches (naming the prompt length and the field
  /// to raise, partition_spec::cpu_capacity_tokens or pinned_capacity_tokens);
  /// pinned_memory_error if growing the pinned region is refused. Strong
  /// guarantee.
  sequence_id begin_sequence(index_t prompt_tokens) {
    if (prompt_tokens < 0) throw shape_error("begin_sequence: prompt_tokens " + std::to_string(prompt_tokens) + " < 0");
    ++admission_probes_;
    if (free_slots_.empty())
      throw capacity_error("begin_sequence: a prompt of " + std::to_string(prompt_tokens) + " tokens: all " +
                           std::to_string(spec_.max_sequences) +
                           " D-window slots are in use (raise partition_spec::max_sequences, or end a sequence first)");
    const int slot = free_slots_.back();

    sequence_state st;
    st.live = true;
    st.prompt_tokens = prompt_tokens;
    st.window_slot = slot;
    st.window_tokens.assign(std::size_t(spec_.num_layers), 0);
    st.layer_ready.assign(std::size_t(spec_.num_layers), prompt_tokens == 0 ? 1 : 0);
    st.generation = ++generations_;

    ++admission_probes_;
    const bool reuse_id = !free_ids_.empty();
    const sequence_id id = reuse_id ? free_ids_.back() : sequence_id(seqs_.size());
    const index_t batches = prompt_tokens / spec_.d_window_tokens;
    // Tokens of announced prompts still to come after this one (routing only).
    const index_t announced_after = std::max<index_t>(0, announced_tokens_ - prompt_tokens);
    try {
      for (index_t k = 0; k < batches; ++k)
        place_batch(id, st, total_placed_tokens_, total_hbm_placed_tokens_, live_count_ + 1,
                    announced_after + (batches - 1 - k) * spec_.d_window_tokens,
                    [&] {
                      return "begin_sequence: a prompt of " + std::to_string(prompt_tokens) + " tokens (eviction batch " +
                             std::to_string(k + 1) + " of " + std::to_string(batches) + ", D = " +
                             std::to_string(spec_.d_window_tokens) + " tokens)";
                    });
      // The last step that can throw (std::bad_alloc): before the slot is taken.
      if (!reuse_id) seqs_.emplace_back();
    } catch (...) {
      release_blocks(st);
      throw;
    }
    // Commit: nothing below throws.
    free_slots_.pop_back();
    if (reuse_id) free_ids_.pop_back();
    total_placed_tokens_ += st.placed_tokens;
    total_hbm_placed_tokens_ += st.hbm_placed_tokens;
    announced_tokens_ = announced_after;
    seqs_[std::size_t(id)] = std::move(st);
    ++live_count_;
    return id;
  }

  /// Ends a sequence: its blocks and D-window slot return to their pools for
  /// in-place reuse, its id to the free ids (the next begin_sequence() takes
  /// the most recently ended). O(1) in the number of sequences. Throws
  /// shape_error for an unknown or ended sequence.
  void end_sequence(sequence_id seq) {
    sequence_state& st = live_state(seq, "end_sequence");
    release_blocks(st);
    free_slots_.push_back(st.window_slot);  // capacity reserved at init: cannot throw
    free_ids_.push_back(seq);
    total_placed_tokens_ -= st.placed_tokens;
    total_hbm_placed_tokens_ -= st.hbm_placed_tokens;
    st = sequence_state{};
    --live_count_;
  }

  // ---------------------------------------------------------------------------
  // append (§4.3)
  // ---------------------------------------------------------------------------

  /// Writes the prompt KV of `seq` for `layer` (kv.num_tokens == prompt tokens)
  /// straight to its final regions: placed batches to their unpinned / pinned /
  /// HBM-resident blocks, the last P mod D tokens to the D-window. Input in the backend's
  /// activation space (host for host_backend, device for cuda_backend).
  /// Throws shape_error (layer, sequence, token count, null plane) or
  /// state_error (layer already written). Strong guarantee.
  void append_prefill(int layer, sequence_id seq, const kv_input& kv) {
    check_layer(layer, "append_prefill");
    sequence_state& st = live_state(seq, "append_prefill");
    if (st.layer_ready[std::size_t(layer)])
      throw state_error("append_prefill: layer " + std::to_string(layer) + " of sequence " + std::to_string(seq) +
                        " already holds its prompt (" + std::to_string(st.prompt_tokens) + " tokens)");
    if (kv.num_tokens != st.prompt_tokens)
      throw shape_error("append_prefill: " + std::to_string(kv.num_tokens) + " tokens given, sequence " +
                        std::to_string(seq) + " was begun with a prompt of " + std::to_string(st.prompt_tokens));
    check_kv(kv, "append_prefill");
    writes_.clear();
    const int bt = spec_.block_tokens;
    for (std::size_t j = 0; j < st.block_table.size(); ++j) {
      const block_ref& b = st.block_table[j];
      writes_.push_back(placed_write(layer, b, index_t(j) * bt, bt));
    }
    const index_t rem = st.prompt_tokens - st.placed_tokens;
    const device_region<Layout> slot = slot_region(layer, st.window_slot);
    for (index_t t0 = 0; t0 < rem; t0 += bt)
      writes_.push_back(
          block_write::into(slot.block(t0 / bt), st.placed_tokens + t0, int(std::min<index_t>(bt, rem - t0)), 0));
    backend_->write_blocks(format_, kv, writes_);
    st.layer_ready[std::size_t(layer)] = 1;
    st.window_tokens[std::size_t(layer)] = int(rem);
  }

  /// append_prefill for several sequences of one layer in one backend write:
  /// seqs[i]'s prompt KV is tokens [first_tokens[i], first_tokens[i] + its
  /// prompt tokens) of `kv` (one buffer holding the sequences' prompts, e.g. a
  /// prefill wave's packed KV, in the backend's activation space: host for
  /// host_backend, device for cuda_backend, ordered on its caller stream).
  /// The same placement and bytes as one
  /// append_prefill per sequence, in one write_blocks call: one staging pass,
  /// and with cuda_backend's deferred pageable writes one completion per call
  /// instead of one per sequence (each completion waits for the previous
  /// call's copies). Throws shape_error (layer, sizes of the spans, unknown or
  /// repeated sequence, a prompt range outside kv, null plane) or state_error
  /// (layer already written); strong guarantee: nothing is written unless
  /// every sequence passes.
  void append_prefill(int layer, std::span<const sequence_id> seqs, std::span<const index_t> first_tokens,
                      const kv_input& kv) {
    check_layer(layer, "append_prefill");
    if (seqs.size() != first_tokens.size())
      throw shape_error("append_prefill: " + std::to_string(seqs.size()) + " sequences but " +
                        std::to_string(first_tokens.size()) + " first tokens");
    check_kv(kv, "append_prefill");
    seen_.assign(seqs_.size(), 0);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const sequence_state& st = live_state(seqs[i], "append_prefill");
      if (seen_[std::size_t(seqs[i])]++ != 0)
        throw shape_error("append_prefill: sequence " + std::to_string(seqs[i]) + " appears twice");
      if (st.layer_ready[std::size_t(layer)])
        throw state_error("append_prefill: layer " + std::to_string(layer) + " of sequence " + std::to_string(seqs[i]) +
                          " already holds its prompt (" + std::to_string(st.prompt_tokens) + " tokens)");
      if (first_tokens[i] < 0 || first_tokens[i] + st.prompt_tokens > kv.num_tokens)
        throw shape_error("append_prefill: sequence " + std::to_string(seqs[i]) + "'s prompt of " +
                          std::to_string(st.prompt_tokens) + " tokens from token " + std::to_string(first_tokens[i]) +
                          " lies outside the " + std::to_string(kv.num_tokens) + " tokens given");
    }
    writes_.clear();
    const int bt = spec_.block_tokens;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const sequence_state& st = seqs_[std::size_t(seqs[i])];
      const index_t t0 = first_tokens[i];
      for (std::size_t j = 0; j < st.block_table.size(); ++j) {
        const block_ref& b = st.block_table[j];
        writes_.push_back(placed_write(layer, b, t0 + index_t(j) * bt, bt));
      }
      const index_t rem = st.prompt_tokens - st.placed_tokens;
      const device_region<Layout> slot = slot_region(layer, st.window_slot);
      for (index_t w = 0; w < rem; w += bt)
        writes_.push_back(block_write::into(slot.block(w / bt), t0 + st.placed_tokens + w,
                                            int(std::min<index_t>(bt, rem - w)), 0));
    }
    backend_->write_blocks(format_, kv, writes_);
    for (const sequence_id id : seqs) {
      sequence_state& st = seqs_[std::size_t(id)];
      st.layer_ready[std::size_t(layer)] = 1;
      st.window_tokens[std::size_t(layer)] = int(st.prompt_tokens - st.placed_tokens);
    }
  }

  /// Stages one decode token per sequence in the D-window of `layer`:
  /// token i of `kv` belongs to seqs[i]. Throws shape_error (sizes, unknown or
  /// repeated sequence) or state_error (prompt not yet written, D-window full:
  /// call flush() after the step's last layer). Strong guarantee.
  void append(int layer, std::span<const sequence_id> seqs, const kv_input& kv) {
    check_layer(layer, "append");
    if (kv.num_tokens != index_t(seqs.size()))
      throw shape_error("append: " + std::to_string(kv.num_tokens) + " tokens for " + std::to_string(seqs.size()) +
                        " sequences (one token per sequence)");
    check_kv(kv, "append");
    check_batch(seqs, layer, "append");
    writes_.clear();
    const int bt = spec_.block_tokens;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const sequence_state& st = seqs_[std::size_t(seqs[i])];
      const int w = st.window_tokens[std::size_t(layer)];
      if (w >= spec_.d_window_tokens)
        throw state_error("append: the D-window of sequence " + std::to_string(seqs[i]) + " in layer " +
                          std::to_string(layer) + " is full (" + std::to_string(w) +
                          " tokens); call flush() after the last layer of each step");
      writes_.push_back(block_write::into(slot_region(layer, st.window_slot).block(w / bt), index_t(i), 1, w % bt));
    }
    backend_->write_blocks(format_, kv, writes_);
    for (sequence_id s : seqs) ++seqs_[std::size_t(s)].window_tokens[std::size_t(layer)];
  }

  // ---------------------------------------------------------------------------
  // Page residency of the unpinned region
  // ---------------------------------------------------------------------------

  /// Beyond the paper; serves §4.2's eviction (flush). `blocks`: a count of
  /// blocks per layer (every layer gets the same ids); memory: the pageable
  /// host region, written by this thread. Makes the unpinned compute region's
  /// pages resident for the next `blocks` CPU-region allocations, so that the evictions that take them
  /// (flush) copy into memory without page faults; on a backend with an
  /// eviction bounce buffer (cuda_backend::reserve_eviction_bounce) also
  /// page-locks that now, so the first eviction into this region does not
  /// allocate it. The region is reserved lazily (mmap, pages appear on first
  /// touch), so without this the first eviction into each block pays the
  /// kernel's fault and zeroing inside a decode step (docs/DECISIONS.md).
  ///
  /// The next n allocations lie in ids [0, allocation_bound(n)) of the
  /// region's block allocator (block_pool, lowest free ids first: [0, used +
  /// n)): this writes one zero byte per page of every free block there, in
  /// every layer (a free block's contents are unspecified; used
  /// blocks are not touched). With cache_options::poison every page was
  /// written at construction and no page is touched (the bounce buffer is
  /// still reserved). Returns the bytes of the blocks touched (0 when already
  /// resident from an earlier call). The high-water mark only grows: blocks in
  /// use inside a covered range are skipped and counted as resident, which
  /// holds because a block in use has been written and freeing a block
  /// (end_sequence, e.g. a sequence stopped at EOS) keeps its pages resident.
  ///
  /// Cost: the bytes touched / the kernel's page-zeroing rate (the blocks are
  /// touched by an OpenMP team of the calling thread when there are at least
  /// 256 of them; an engine can so prefault a prompt's blocks before its
  /// prefill, off the write path), plus, the first
  /// time on cuda_backend, page-locking the bounce buffer (32 MiB by default)
  /// and a wait for its D2H stream. Call between steps from the thread that
  /// owns the cache (e.g. after prefill, with n = the decode's eviction blocks
  /// per layer: sequences × (ceil(new tokens / block_tokens) + window blocks)).
  /// Throws config_error for n < 0 (before anything else); never changes what
  /// the cache holds.
  index_t prefault_cpu_region(index_t blocks) {
    if (blocks < 0)
      throw config_error("prefault_cpu_region: blocks = " + std::to_string(blocks) + " must be >= 0");
    const index_t cap = cpu_pool_.capacity();
    if (blocks > 0 && cap > 0) backend_->reserve_eviction_bounce();
    if (options_.poison) return 0;
    const index_t end = std::min(cap, cpu_pool_.allocation_bound(blocks));
    if (end <= cpu_prefaulted_blocks_) return 0;
    const index_t block_bytes = format_.block_bytes();
    const index_t page = index_t(::sysconf(_SC_PAGESIZE));
    index_t touched = 0;
    const index_t begin = cpu_prefaulted_blocks_;
#if defined(_OPENMP)
#  pragma omp parallel for schedule(static) reduction(+ : touched) if (end - begin >= 256)
#endif
    for (index_t b = begin; b < end; ++b) {
      if (cpu_pool_.is_used(block_id(b))) continue;
      touched += block_bytes * spec_.num_layers;
      for (int l = 0; l < spec_.num_layers; ++l) {
        volatile char* base = reinterpret_cast<volatile char*>(cpu_region_at(l).block(b).data());
        for (index_t o = 0; o < block_bytes; o += page) base[o] = 0;
        base[block_bytes - 1] = 0;  // a block that ends past a page boundary
      }
    }
    cpu_prefaulted_blocks_ = end;
    return touched;
  }

  /// Page-locks `bytes` of the staging that the backend's deferred pageable
  /// prefill writes go through (cuda_backend::reserve_deferred_host_writes,
  /// host memory), now rather than by doubling inside the first prefill
  /// calls; pass the backend's deferred_host_writes() (the max_bytes of
  /// set_deferred_host_writes, called first) to reserve it whole. A no-op
  /// returning 0 on a backend without deferred writes
  /// (!deferred_host_write_backend<Backend>, e.g. host_backend) and on a cache
  /// without an unpinned compute region (no prefill write goes to pageable
  /// memory). Returns the staging bytes page-locked after the call
  /// (deferred_host_writes_reserved_bytes()). Completes the pending deferred
  /// writes first; never changes what the cache holds. Call between steps from
  /// the thread that owns the cache. Throws config_error for bytes < 0 (on
  /// every backend, before anything else) and for bytes above the backend's
  /// deferred_host_writes(); pinned_memory_error when the backend cannot
  /// page-lock `bytes` (its staging is then unchanged).
  index_t reserve_deferred_host_writes(index_t bytes) {
    if (bytes < 0)
      throw config_error("reserve_deferred_host_writes: bytes = " + std::to_string(bytes) + " must be >= 0");
    if constexpr (deferred_host_write_backend<Backend>) {
      if (cpu_pool_.capacity() == 0) return 0;
      backend_->reserve_deferred_host_writes(bytes);
      return backend_->deferred_host_writes_reserved_bytes();
    } else {
      return 0;
    }
  }

  // ---------------------------------------------------------------------------
  // flush (§4.2, §4.3)
  // ---------------------------------------------------------------------------

  /// Evicts, whole, the D-window of every live sequence that holds D tokens in
  /// every layer: the policy routes each batch (marginal share, §5.3), its
  /// blocks are allocated in every layer and the window is copied there (D2H on
  /// the CUDA backend). Sequences with a partly full window are left alone.
  /// Throws capacity_error / pinned_memory_error when the destination cannot
  /// be allocated; then nothing is evicted (strong guarantee).
  flush_report flush() {
    flush_report rep;
    std::vector<std::pair<sequence_id, sequence_state>> staged;
    index_t total = total_placed_tokens_;
    index_t total_hbm = total_hbm_placed_tokens_;
    const int wb = spec_.window_blocks();
    // Stage (route + allocate), copy, then commit: every step that can throw
    // (policy, pools, pinned growth, std::bad_alloc, the backend's copies)
    // runs before the first change to a sequence (strong guarantee).
    try {
      staged.reserve(seqs_.size());
      for (std::size_t id = 0; id < seqs_.size(); ++id) {
        sequence_state& st = seqs_[id];
        if (!st.live || !window_full(st)) continue;
        sequence_state copy;  // only the fields place_batch touches
        copy.placed_tokens = st.placed_tokens;
        copy.cpu_placed_tokens = st.cpu_placed_tokens;
        copy.hbm_placed_tokens = st.hbm_placed_tokens;
        // `total` already counts this sequence's placed tokens; place_batch adds
        // them again, so pass the other sequences' share (route_query contract:
        // all live sequences' placed tokens before this batch, counted once).
        place_batch(sequence_id(id), copy, total - copy.placed_tokens, total_hbm - copy.hbm_placed_tokens, live_count_,
                    0, [&] {
                      return "flush: the full D-window of sequence " + std::to_string(id) + " (" +
                             std::to_string(copy.placed_tokens + spec_.d_window_tokens) + " tokens with this eviction)";
                    });
        total += spec_.d_window_tokens;
        if (copy.block_table[0].region == placement::gpu_resident) total_hbm += spec_.d_window_tokens;
        staged.emplace_back(sequence_id(id), std::move(copy));
        // Room for the commit's push_backs (capacity only: not observable).
        reserve_more(st.block_table, wb);
        reserve_more(region_list(st, staged.back().second.block_table[0].region), wb);
      }
      copies_.clear();
      device_copies_.clear();
      for (auto& [id, c] : staged) {
        const sequence_state& st = seqs_[std::size_t(id)];
        for (int layer = 0; layer < spec_.num_layers; ++layer) {
          const device_region<Layout> slot = slot_region(layer, st.window_slot);
          if (c.block_table[0].region == placement::gpu_resident) {  // one batch: wb consecutive blocks
            device_copies_.push_back(
                block_copy::within_device(slot.blocks(0, wb), hbm_region_at(layer).blocks(c.block_table[0].id, wb)));
            continue;
          }
          const cpu_region<Layout> cpu = cpu_region_at(layer);
          const pinned_region<Layout> pinned = pinned_region_at(layer);
          for (int k = 0; k < wb;) {  // coalesce destination runs of consecutive blocks
            const block_ref first = c.block_table[std::size_t(k)];
            const bool to_cpu = first.region == placement::cpu_compute;
            int n = 1;
            while (k + n < wb && c.block_table[std::size_t(k + n)].region == first.region &&
                   (to_cpu ? cpu.adjacent(c.block_table[std::size_t(k + n - 1)].id, c.block_table[std::size_t(k + n)].id)
                           : pinned.adjacent(c.block_table[std::size_t(k + n - 1)].id,
                                             c.block_table[std::size_t(k + n)].id)))
              ++n;
            copies_.push_back(to_cpu ? block_copy::evict(slot.blocks(k, n), cpu.blocks(first.id, n))
                                     : block_copy::evict(slot.blocks(k, n), pinned.blocks(first.id, n)));
            k += n;
          }
        }
      }
      backend_->copy_blocks_to_host(copies_);
      if (!device_copies_.empty()) backend_->copy_blocks_on_device(device_copies_);
    } catch (...) {
      for (auto& [id, c] : staged) release_blocks(c);
      throw;
    }
    // Commit: nothing below throws.
    for (auto& [id, c] : staged) {
      sequence_state& st = seqs_[std::size_t(id)];
      for (const block_ref& b : c.block_table) {
        st.block_table.push_back(b);
        region_list(st, b.region).push_back(b.id);
      }
      const placement r = c.block_table[0].region;
      ++(r == placement::cpu_compute ? rep.cpu_batches : r == placement::gpu_load ? rep.gpu_batches : rep.hbm_batches);
      st.cpu_placed_tokens = c.cpu_placed_tokens;
      st.hbm_placed_tokens = c.hbm_placed_tokens;
      st.placed_tokens = c.placed_tokens;
      std::fill(st.window_tokens.begin(), st.window_tokens.end(), 0);
      ++rep.evicted_sequences;
    }
    total_placed_tokens_ = total;
    total_hbm_placed_tokens_ = total_hbm;
    return rep;
  }

  // ---------------------------------------------------------------------------
  // views (§4.3)
  // ---------------------------------------------------------------------------

  /// Zero-copy views of `layer`. Throws shape_error for a bad layer.
  [[nodiscard]] layer_views<Layout> views(int layer) const {
    check_layer(layer, "views");
    layer_views<Layout> v;
    v.layer = layer;
    v.format = format_;
    v.window_blocks = spec_.window_blocks();
    v.sequences = std::span<const sequence_state>(seqs_);
    v.cpu = cpu_region_at(layer);
    v.pinned = pinned_region_at(layer);
    v.window = window_region_at(layer);
    v.hbm = hbm_region_at(layer);
    v.ping_pong = {device_region<Layout>{format_, arena_storage{ping_pong_base(), 0}, 0}, spec_.ping_pong_buffers,
                   pp_blocks_};
    v.ping_pong_blocks = pp_blocks_;
    v.first_chunk_blocks = spec_.first_chunk_blocks(layout_);
    return v;
  }

  // ---------------------------------------------------------------------------
  // Introspection
  // ---------------------------------------------------------------------------

  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  [[nodiscard]] const partition_spec& spec() const noexcept { return spec_; }
  [[nodiscard]] const block_format<Layout>& format() const noexcept { return format_; }
  [[nodiscard]] Policy& policy() noexcept { return policy_; }
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
  [[nodiscard]] Backend& backend() const noexcept { return *backend_; }
  [[nodiscard]] const cache_options& options() const noexcept { return options_; }
  [[nodiscard]] int live_sequences() const noexcept { return live_count_; }
  [[nodiscard]] index_t total_placed_tokens() const noexcept { return total_placed_tokens_; }
  /// Of total_placed_tokens(), those in the HBM-resident region.
  [[nodiscard]] index_t total_hbm_placed_tokens() const noexcept { return total_hbm_placed_tokens_; }
  /// Free-list entries (D-window slots and sequence ids) that begin_sequence()
  /// has examined, summed over the cache's life, refused calls included: two
  /// per call that gets past the prompt-length check, one when no slot is free.
  /// For tests of the O(1) admission.
  [[nodiscard]] std::uint64_t admission_probes() const noexcept { return admission_probes_; }

  /// The state of a live sequence. Throws shape_error otherwise.
  [[nodiscard]] const sequence_state& sequence(sequence_id seq) const {
    return const_cast<inplace_kv_cache*>(this)->live_state(seq, "sequence");
  }

  /// The block allocator of a region (placement::cpu_compute: the unpinned
  /// compute region; placement::gpu_load: the pinned load region;
  /// placement::gpu_resident: the HBM-resident region, whose ids are whole
  /// eviction batches: batch slot s holds blocks [s·window_blocks, (s+1)·window_blocks)).
  [[nodiscard]] const BlockAllocator& region_allocator(placement region) const noexcept {
    return region == placement::cpu_compute ? cpu_pool_ : region == placement::gpu_load ? pinned_pool_ : hbm_pool_;
  }

  [[nodiscard]] region_usage usage() const noexcept {
    region_usage u;
    u.cpu_used_blocks = cpu_pool_.used_blocks();
    u.cpu_capacity_blocks = cpu_pool_.capacity();
    u.pinned_used_blocks = pinned_pool_.used_blocks();
    u.pinned_capacity_blocks = pinned_pool_.capacity();
    u.pinned_max_blocks = pinned_pool_.max_capacity();
    u.hbm_used_blocks = hbm_pool_.used_blocks() * spec_.window_blocks();
    u.hbm_capacity_blocks = hbm_pool_.capacity() * spec_.window_blocks();
    u.hbm_region_bytes = hbm_mem_.size_bytes();
    u.live_sequences = live_count_;
    u.max_sequences = spec_.max_sequences;
    u.cpu_region_bytes = cpu_mem_.size_bytes();
    for (const auto& s : pinned_slabs_) u.pinned_region_bytes += s.size_bytes();
    u.d_window_bytes = d_window_.size_bytes();
    u.ping_pong_bytes = ping_pong_mem_.size_bytes();
    return u;
  }

  /// Copies the K/V of token `position` (0 = first prompt token) of `seq` in
  /// `layer` from wherever it lives into `out` (host, [planes][kv_heads][row]).
  /// For tests and debugging; synchronous. Throws shape_error for a bad
  /// position or a too small `out`.
  void read_token(int layer, sequence_id seq, index_t position, std::span<bf16> out) const {
    check_layer(layer, "read_token");
    const sequence_state& st = sequence(seq);
    if (position < 0 || position >= st.total_tokens(layer))
      throw shape_error("read_token: position " + std::to_string(position) + " outside [0, " +
                        std::to_string(st.total_tokens(layer)) + ")");
    const index_t need = index_t{Layout::planes} * layout_.kv_heads() * Layout::row_elems;
    if (index_t(out.size()) < need)
      throw shape_error("read_token: out has " + std::to_string(out.size()) + " elements, needs " + std::to_string(need));
    const int bt = spec_.block_tokens;
    // Every (plane, head) row of the token: a host region's by memcpy, the
    // D-window's through the backend.
    auto copy_rows = [&](const auto& region, index_t id, int row) {
      using space = typename std::remove_cvref_t<decltype(region)>::space_type;
      for (int p = 0; p < Layout::planes; ++p)
        for (int h = 0; h < layout_.kv_heads(); ++h) {
          const auto src = region.row(id, p, h, row);
          bf16* dst = out.data() + (index_t(p) * layout_.kv_heads() + h) * Layout::row_elems;
          if constexpr (host_accessible_space<space>)
            std::memcpy(dst, src.data(), sizeof(bf16) * Layout::row_elems);
          else
            backend_->copy_to_host_sync(dst, reinterpret_cast<const std::byte*>(src.data()),
                                        Layout::row_elems * index_t(sizeof(bf16)));
        }
    };
    if (position < st.placed_tokens) {
      // Host-region writes may land asynchronously (cuda_backend: D2H of
      // evictions to pinned blocks); wait for them.
      backend_->synchronize_host_writes();
      const block_ref& b = st.block_table[std::size_t(position / bt)];
      if (b.region == placement::cpu_compute)
        copy_rows(cpu_region_at(layer), b.id, int(position % bt));
      else if (b.region == placement::gpu_load)
        copy_rows(pinned_region_at(layer), b.id, int(position % bt));
      else
        copy_rows(hbm_region_at(layer), b.id, int(position % bt));
    } else {
      const index_t w = position - st.placed_tokens;
      copy_rows(slot_region(layer, st.window_slot), w / bt, int(w % bt));
    }
  }

  /// Pins ahead: grows the pinned region until at least `blocks` are free
  /// (bounded by its capacity). Call between steps (paper §7.7: pin one
  /// eviction window ahead). Throws pinned_memory_error if refused.
  void reserve_pinned_blocks(index_t blocks) {
    const index_t need = pinned_pool_.used_blocks() + blocks;
    if (need > pinned_pool_.capacity()) grow_pinned_to(std::min(need, pinned_pool_.max_capacity()));
  }

 private:
  [[nodiscard]] bool window_full(const sequence_state& st) const noexcept {
    for (int w : st.window_tokens)
      if (w < spec_.d_window_tokens) return false;
    return true;
  }

  sequence_state& live_state(sequence_id seq, const char* what) {
    if (seq < 0 || std::size_t(seq) >= seqs_.size() || !seqs_[std::size_t(seq)].live)
      throw shape_error(std::string(what) + ": sequence " + std::to_string(seq) + " is not a live sequence");
    return seqs_[std::size_t(seq)];
  }

  void check_layer(int layer, const char* what) const {
    if (layer < 0 || layer >= spec_.num_layers)
      throw shape_error(std::string(what) + ": layer " + std::to_string(layer) + " outside [0, " +
                        std::to_string(spec_.num_layers) + ")");
  }

  void check_kv(const kv_input& kv, const char* what) const {
    if (kv.num_tokens == 0) return;
    for (int p = 0; p < Layout::planes; ++p)
      if (kv.planes[std::size_t(p)] == nullptr)
        throw shape_error(std::string(what) + ": KV plane " + std::to_string(p) + " is null");
    const index_t dense = index_t{layout_.kv_heads()} * Layout::row_elems;
    if (kv.token_stride != 0 && kv.token_stride < dense)
      throw shape_error(std::string(what) + ": token_stride " + std::to_string(kv.token_stride) +
                        " is smaller than kv_heads*row_elems = " + std::to_string(dense));
  }

 public:
  /// Validates a decode batch for `layer`: live, distinct, prompt written.
  /// Throws shape_error / state_error naming the sequence.
  void check_batch(std::span<const sequence_id> seqs, int layer, const char* what) const {
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const sequence_id s = seqs[i];
      if (s < 0 || std::size_t(s) >= seqs_.size() || !seqs_[std::size_t(s)].live)
        throw shape_error(std::string(what) + ": sequence " + std::to_string(s) + " is not a live sequence");
      for (std::size_t j = 0; j < i; ++j)
        if (seqs[j] == s)
          throw shape_error(std::string(what) + ": sequence " + std::to_string(s) + " appears twice in the batch");
      if (!seqs_[std::size_t(s)].layer_ready[std::size_t(layer)])
        throw state_error(std::string(what) + ": layer " + std::to_string(layer) + " of sequence " +
                          std::to_string(s) + " has no prompt KV yet (append_prefill first)");
    }
  }

 private:
  // Routes one eviction batch of `st` and allocates its blocks (all layers share them).
  // `total_placed`: placed tokens of every other live sequence (st's own are added here);
  // `coming_tokens`: tokens about to be placed after this batch (this prompt's
  // later batches and announced prompts), counted into L for the routing only.
  // `context()`: the call and the batch, for a capacity_error's message (built
  // only on that error).
  // `total_hbm`: of total_placed, those in the HBM-resident region. A policy
  // answering gpu_resident while the region has no free batch is asked again
  // with hbm_free_tokens = 0; a second gpu_resident becomes gpu_load (a full
  // region falls through to the host tiers, policy.hpp).
  template <class Context>
  void place_batch(sequence_id id, sequence_state& st, index_t total_placed, index_t total_hbm, int live,
                   index_t coming_tokens, const Context& context) {
    const int wb = spec_.window_blocks();
    route_query q;
    q.seq = id;
    q.placed_tokens = st.placed_tokens;
    q.cpu_placed_tokens = st.cpu_placed_tokens;
    q.hbm_placed_tokens = st.hbm_placed_tokens;
    q.batch_tokens = spec_.d_window_tokens;
    q.total_placed_tokens = total_placed + st.placed_tokens;
    q.total_hbm_placed_tokens = total_hbm + st.hbm_placed_tokens;
    q.hbm_free_tokens = hbm_pool_.free_blocks() * spec_.d_window_tokens;
    q.coming_tokens = coming_tokens;
    q.live_sequences = live;
    route_decision d = policy_.route(q);
    if (d.region == placement::gpu_resident && hbm_pool_.free_blocks() < 1) {
      q.hbm_free_tokens = 0;
      d = policy_.route(q);
      if (d.region == placement::gpu_resident) d.region = placement::gpu_load;
    }
    tmp_ids_.clear();
    // Reserve first: once blocks are taken from a pool nothing may throw, or they leak.
    reserve_more(tmp_ids_, wb);
    reserve_more(st.block_table, wb);
    reserve_more(region_list(st, d.region), wb);
    try {
      if (d.region == placement::gpu_resident) {
        hbm_pool_.allocate(1, tmp_ids_);  // one batch slot: blocks [slot*wb, slot*wb + wb)
        const block_id slot = tmp_ids_[0];
        tmp_ids_.clear();
        for (int k = 0; k < wb; ++k) tmp_ids_.push_back(block_id(index_t(slot) * wb + k));
      } else if (d.region == placement::cpu_compute) {
        cpu_pool_.allocate(wb, tmp_ids_);
      } else {
        if (pinned_pool_.free_blocks() < wb)
          grow_pinned_to(std::min(pinned_pool_.max_capacity(),
                                  std::max(pinned_pool_.capacity() + slab_blocks_, pinned_pool_.used_blocks() + wb)));
        pinned_pool_.allocate(wb, tmp_ids_);
      }
    } catch (const capacity_error& e) {  // the pool's message names the region and the field; add the call
      const index_t now = d.region == placement::cpu_compute ? spec_.cpu_capacity_tokens
                          : d.region == placement::gpu_load  ? spec_.pinned_capacity_tokens
                                                             : spec_.hbm_capacity_tokens;
      throw capacity_error(context() + ": " + e.what() + ", now " + std::to_string(now) + " tokens per layer");
    }
    for (block_id b : tmp_ids_) {
      st.block_table.push_back({d.region, b});
      region_list(st, d.region).push_back(b);
    }
    st.placed_tokens += spec_.d_window_tokens;
    if (d.region == placement::cpu_compute) st.cpu_placed_tokens += spec_.d_window_tokens;
    if (d.region == placement::gpu_resident) st.hbm_placed_tokens += spec_.d_window_tokens;
  }

  // The list of `st`'s blocks in `region`.
  static std::vector<block_id>& region_list(sequence_state& st, placement region) noexcept {
    return region == placement::cpu_compute ? st.cpu_blocks
           : region == placement::gpu_load  ? st.pinned_blocks
                                            : st.hbm_blocks;
  }

  // Capacity for `n` more elements, growing geometrically (a push_back after it cannot throw).
  template <class T>
  static void reserve_more(std::vector<T>& v, int n) {
    if (v.capacity() - v.size() < std::size_t(n)) v.reserve(std::max(v.size() + std::size_t(n), 2 * v.capacity()));
  }

  void release_blocks(sequence_state& st) {
    cpu_pool_.release(st.cpu_blocks.data(), st.cpu_blocks.size());
    pinned_pool_.release(st.pinned_blocks.data(), st.pinned_blocks.size());
    const std::size_t wb = std::size_t(spec_.window_blocks());
    tmp_slots_.clear();  // capacity: every batch of the region (reserved at init)
    for (std::size_t k = 0; k < st.hbm_blocks.size(); k += wb) tmp_slots_.push_back(block_id(st.hbm_blocks[k] / block_id(wb)));
    hbm_pool_.release(tmp_slots_.data(), tmp_slots_.size());
    st.cpu_blocks.clear();
    st.pinned_blocks.clear();
    st.hbm_blocks.clear();
    st.block_table.clear();
  }

  // Grows the pinned region slab by slab up to `blocks` (rounded up to slabs,
  // capped at the maximum). A refused slab throws; earlier slabs stay (they
  // are valid, empty capacity), the pools stay consistent.
  void grow_pinned_to(index_t blocks) {
    blocks = std::min(blocks, pinned_pool_.max_capacity());
    // A slab kept when the pool's growth below failed (std::bad_alloc) is counted now.
    pinned_pool_.grow_to(std::min(index_t(pinned_slabs_.size()) * slab_blocks_, pinned_pool_.max_capacity()));
    while (index_t(pinned_slabs_.size()) * slab_blocks_ < blocks) {
      const index_t bytes = slab_blocks_ * format_.block_bytes() * spec_.num_layers;
      reserve_more(pinned_slab_ptrs_, 1);  // the two lists must not get out of step
      reserve_more(pinned_slabs_, 1);
      host_allocation a = pinned_alloc_.allocate(bytes);
      if (options_.poison) {
        auto* p = reinterpret_cast<std::uint16_t*>(a.data());
        std::fill(p, p + bytes / 2, poison_bf16_bits);
      }
      pinned_slab_ptrs_.push_back(reinterpret_cast<bf16*>(a.data()));
      pinned_slabs_.push_back(std::move(a));
      pinned_pool_.grow_to(std::min(index_t(pinned_slabs_.size()) * slab_blocks_, pinned_pool_.max_capacity()));
    }
  }

  // The regions of `layer` (region.hpp: the one block address computation).
  [[nodiscard]] cpu_region<Layout> cpu_region_at(int layer) const noexcept {
    return {format_, arena_storage{reinterpret_cast<bf16*>(cpu_mem_.data()),
                                   spec_.cpu_capacity_blocks()},
            layer};
  }
  [[nodiscard]] pinned_region<Layout> pinned_region_at(int layer) const noexcept {
    return {format_, slab_storage{pinned_slab_ptrs_.data(), index_t(pinned_slab_ptrs_.size()), slab_blocks_}, layer};
  }
  [[nodiscard]] device_region<Layout> window_region_at(int layer) const noexcept {
    return {format_,
            arena_storage{reinterpret_cast<bf16*>(d_window_.data()),
                          index_t(spec_.max_sequences) * spec_.window_blocks()},
            layer};
  }
  // D-window slot `slot` of `layer`: window_blocks blocks.
  [[nodiscard]] device_region<Layout> slot_region(int layer, int slot) const noexcept {
    return window_region_at(layer).sub(index_t(slot) * spec_.window_blocks(), spec_.window_blocks());
  }
  [[nodiscard]] device_region<Layout> hbm_region_at(int layer) const noexcept {
    return {format_, arena_storage{reinterpret_cast<bf16*>(hbm_mem_.data()), spec_.hbm_capacity_blocks()}, layer};
  }
  [[nodiscard]] bf16* ping_pong_base() const noexcept {
    return reinterpret_cast<bf16*>(ping_pong_mem_.data());
  }
  // A write of input tokens into placed block `b` of `layer`, in its region.
  [[nodiscard]] block_write placed_write(int layer, const block_ref& b, index_t src_token, int tokens) const noexcept {
    return b.region == placement::cpu_compute ? block_write::into(cpu_region_at(layer).block(b.id), src_token, tokens, 0)
           : b.region == placement::gpu_load
               ? block_write::into(pinned_region_at(layer).block(b.id), src_token, tokens, 0)
               : block_write::into(hbm_region_at(layer).block(b.id), src_token, tokens, 0);
  }
  Backend* backend_;
  Layout layout_;
  partition_spec spec_;
  block_format<Layout> format_;
  Policy policy_;
  PinnedAllocator pinned_alloc_;
  cache_options options_;

  BlockAllocator cpu_pool_;     ///< block ids of the unpinned compute region
  index_t cpu_prefaulted_blocks_ = 0;  ///< ids [0, this) of the unpinned region were made resident (prefault_cpu_region)
  BlockAllocator pinned_pool_;  ///< block ids of the pinned load region
  BlockAllocator hbm_pool_;     ///< batch slots of the HBM-resident region (one id = window_blocks blocks)
  index_t slab_blocks_ = 1;
  host_allocation cpu_mem_;
  std::vector<host_allocation> pinned_slabs_;
  std::vector<bf16*> pinned_slab_ptrs_;
  typename Backend::device_buffer d_window_;
  typename Backend::device_buffer ping_pong_mem_;
  typename Backend::device_buffer hbm_mem_;  ///< the HBM-resident region (empty without one)
  index_t pp_blocks_ = 0;

  std::vector<sequence_state> seqs_;
  std::vector<int> free_slots_;         // D-window slots not in use; back() is taken next
  std::vector<sequence_id> free_ids_;   // ended ids below seqs_.size(); back() is reused next
  std::uint64_t admission_probes_ = 0;  // admission_probes()
  int live_count_ = 0;
  index_t total_placed_tokens_ = 0;
  index_t total_hbm_placed_tokens_ = 0;  // of total_placed_tokens_, in the HBM-resident region
  index_t announced_tokens_ = 0;  // announce_admission(): prompt tokens still to be admitted
  std::uint64_t generations_ = 0;  // sequences begun so far (sequence_state::generation)

  std::vector<block_write> writes_;
  std::vector<char> seen_;  ///< append_prefill (several sequences): which sequences the call names
  std::vector<block_copy> copies_;
  std::vector<block_copy> device_copies_;  // flush: D-windows into the HBM-resident region
  std::vector<block_id> tmp_ids_;
  std::vector<block_id> tmp_slots_;  // release_blocks: HBM batch slots
};

}  // namespace writescope
