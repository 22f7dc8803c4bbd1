// SPDX-License-Identifier: Apache-2.0
// writescope/block_pool.hpp — block-id accounting of one region (paper §4.1:
// the block is the unit of routing, staging, eviction, transfer and reuse).
// The default model of block_allocator (block_allocator.hpp).
//
// A pool hands out block ids in [0, capacity). Allocation takes the lowest free
// ids, so a fresh or orderly-used pool gives runs of consecutive ids, which the
// streaming plan coalesces into single large copies. Freed blocks are reused in
// place (sequence-end reclamation). The pool holds ids only; the region that
// owns it maps an id to memory.
//
// Not thread-safe: the cache mutates pools from its owning thread only.
#pragma once

#include <bit>
#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "error.hpp"

namespace writescope {

class block_pool {
 public:
  block_pool() = default;
  /// A pool of `capacity_blocks` free blocks, which may later grow to
  /// `max_capacity_blocks`. `region_name` and `capacity_field` (the setting
  /// that sizes the region, e.g. "partition_spec::cpu_capacity_tokens"; may be
  /// null) are string literals (kept, not copied) named by the pool's errors.
  block_pool(index_t capacity_blocks, index_t max_capacity_blocks, const char* region_name,
             const char* capacity_field = nullptr)
      : max_capacity_(max_capacity_blocks), name_(region_name), capacity_field_(capacity_field) {
    if (capacity_blocks < 0 || max_capacity_blocks < capacity_blocks || max_capacity_blocks > INT32_MAX)
      throw config_error(std::string(region_name) + ": block capacity " + std::to_string(capacity_blocks) + " / max " +
                         std::to_string(max_capacity_blocks) + " is invalid (0 <= capacity <= max <= 2^31-1)");
    grow_to(capacity_blocks);
  }

  [[nodiscard]] index_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] index_t max_capacity() const noexcept { return max_capacity_; }
  [[nodiscard]] index_t free_blocks() const noexcept { return free_; }
  [[nodiscard]] index_t used_blocks() const noexcept { return capacity_ - free_; }
  [[nodiscard]] const char* name() const noexcept { return name_; }

  /// Raises the capacity to `capacity_blocks` (<= max_capacity). New blocks are free.
  void grow_to(index_t capacity_blocks) {
    if (capacity_blocks > max_capacity_)
      throw capacity_error(std::string(name_) + ": cannot grow to " + std::to_string(capacity_blocks) +
                           " blocks, the maximum is " + std::to_string(max_capacity_));
    if (capacity_blocks <= capacity_) return;
    words_.resize(static_cast<std::size_t>((capacity_blocks + 63) / 64), 0);
    free_ += capacity_blocks - capacity_;
    capacity_ = capacity_blocks;
  }

  [[nodiscard]] bool is_used(block_id b) const noexcept {
    return (words_[static_cast<std::size_t>(b) / 64] >> (static_cast<unsigned>(b) % 64)) & 1u;
  }

  /// Appends `n` free ids (lowest first) to `out` and marks them used. Throws
  /// capacity_error ("<region>: n blocks requested, f free of c (capacity
  /// exceeded; raise <capacity field>)") and changes nothing when fewer than
  /// `n` are free.
  void allocate(index_t n, std::vector<block_id>& out) {
    if (n > free_)
      throw capacity_error(std::string(name_) + ": " + std::to_string(n) + " blocks requested, " +
                           std::to_string(free_) + " free of " + std::to_string(capacity_) + " (capacity exceeded" +
                           (capacity_field_ ? std::string("; raise ") + capacity_field_ : std::string()) + ")");
    out.reserve(out.size() + static_cast<std::size_t>(n));
    index_t got = 0;
    for (std::size_t w = static_cast<std::size_t>(first_word_); got < n; ++w) {
      std::uint64_t bits = ~words_[w];
      while (bits != 0 && got < n) {
        const int bit = std::countr_zero(bits);
        const index_t id = index_t(w) * 64 + bit;
        if (id >= capacity_) break;
        words_[w] |= std::uint64_t{1} << bit;
        bits &= bits - 1;
        out.push_back(static_cast<block_id>(id));
        ++got;
      }
      if (words_[w] == ~std::uint64_t{0} && index_t(w) == first_word_) ++first_word_;
    }
    free_ -= n;
  }

  /// An id bound for the next `n` allocations (block_allocator): the lowest
  /// free ids are taken, and at most used_blocks() ids below any bound are in
  /// use, so they lie in [0, min(capacity, used + n)).
  [[nodiscard]] index_t allocation_bound(index_t n) const noexcept {
    return n >= capacity_ - used_blocks() ? capacity_ : used_blocks() + n;
  }

  /// Returns blocks to the pool. Throws state_error (and changes nothing) if an id
  /// is out of range or not allocated — a double free is a bug, never ignored.
  void release(const block_id* ids, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i)
      if (ids[i] < 0 || ids[i] >= capacity_ || !is_used(ids[i]))
        throw state_error(std::string(name_) + ": release of block " + std::to_string(ids[i]) +
                          " which is not allocated");
    for (std::size_t i = 0; i < count; ++i) {
      if (!is_used(ids[i])) {  // the same id twice in one call: undo and refuse
        for (std::size_t j = 0; j < i; ++j) set_bit(ids[j]);
        throw state_error(std::string(name_) + ": block " + std::to_string(ids[i]) + " released twice");
      }
      clear_bit(ids[i]);
    }
    for (std::size_t i = 0; i < count; ++i)
      if (index_t(ids[i] / 64) < first_word_) first_word_ = index_t(ids[i] / 64);
    free_ += index_t(count);
  }

 private:
  void set_bit(block_id b) noexcept { words_[static_cast<std::size_t>(b) / 64] |= std::uint64_t{1} << (unsigned(b) % 64); }
  void clear_bit(block_id b) noexcept {
    words_[static_cast<std::size_t>(b) / 64] &= ~(std::uint64_t{1} << (unsigned(b) % 64));
  }

  std::vector<std::uint64_t> words_;  // bit set = used
  index_t capacity_ = 0;
  index_t max_capacity_ = 0;
  index_t free_ = 0;
  index_t first_word_ = 0;            // no free id below 64*first_word_
  const char* name_ = "block pool";
  const char* capacity_field_ = nullptr;  // the setting that sizes the region (messages), or null
};

}  // namespace writescope
