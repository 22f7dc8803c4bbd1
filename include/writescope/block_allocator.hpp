// SPDX-License-Identifier: Apache-2.0
// writescope/block_allocator.hpp — what a block allocator is: the block-id
// accounting of one region (paper §4.1: the block is the unit of routing,
// staging, eviction, transfer and reuse). block_pool (block_pool.hpp) is the
// default model.
//
// An allocator hands out ids in [0, capacity()) of one region; the region that
// owns it maps an id to memory (layout.hpp's block format, one block per id).
// The operations and their contract:
//
//   A(capacity, max_capacity, region_name, capacity_field)
//                                  capacity free blocks, growable to
//                                  max_capacity; config_error for invalid sizes.
//                                  region_name and capacity_field (the setting
//                                  that sizes the region, may be null) are
//                                  string literals, kept, named by the errors
//   capacity() max_capacity() free_blocks() used_blocks()    block counts
//   name()                         the region's name, for messages
//   grow_to(n)                     raises the capacity (new blocks free);
//                                  capacity_error beyond max_capacity
//   is_used(id)                    whether id (in [0, capacity())) is allocated
//   allocate(n, out)               appends n free ids to `out`, marked used;
//                                  capacity_error and no change when fewer are free
//   release(ids, count)            returns ids; state_error and no change for an
//                                  id not allocated or given twice
//   allocation_bound(n)            an id bound b <= capacity(): the next n ids
//                                  allocate() hands out (no release between)
//                                  lie in [0, b). The cache makes the pages of
//                                  those blocks resident ahead of evictions
//                                  (inplace_kv_cache::prefault_cpu_region);
//                                  capacity() is always a correct answer
//
// Which free ids allocate() returns is the allocator's choice; the stream plan
// coalesces physically adjacent blocks into one copy, so an allocator that
// returns runs of consecutive ids (block_pool: the lowest free ids) streams as
// few large copies. The cache (inplace_kv_cache's last template parameter)
// owns one allocator per host region, built with the region's capacities;
// allocate() may throw only before it changes anything (the cache's strong
// guarantee depends on it). Not thread-safe: the cache mutates its allocators
// from its owning thread only. Host code, no virtual dispatch;
// examples/custom_block_allocator.cpp shows a model other than block_pool.
#pragma once

#include <concepts>
#include <cstddef>
#include <vector>

#include "block_pool.hpp"
#include "config.hpp"

namespace writescope {

/// Opt-in: a type is a block_allocator only if enable_block_allocator<A> is
/// true — by declaring `using allocator_concept = block_allocator_tag;`, or by
/// specializing the variable (as for block_pool below).
struct block_allocator_tag {};

template <class A>
inline constexpr bool enable_block_allocator = requires {
  requires std::same_as<typename A::allocator_concept, block_allocator_tag>;
};
template <>
inline constexpr bool enable_block_allocator<block_pool> = true;

/// A block allocator (see the file comment).
template <class A>
concept block_allocator =
    enable_block_allocator<A> && std::movable<A> && std::default_initializable<A> &&
    std::constructible_from<A, index_t, index_t, const char*, const char*> &&
    requires(A& a, const A& ca, index_t n, block_id id, std::vector<block_id>& out, const block_id* ids,
             std::size_t count) {
      { ca.capacity() } -> std::same_as<index_t>;
      { ca.max_capacity() } -> std::same_as<index_t>;
      { ca.free_blocks() } -> std::same_as<index_t>;
      { ca.used_blocks() } -> std::same_as<index_t>;
      { ca.name() } -> std::convertible_to<const char*>;
      { ca.is_used(id) } -> std::same_as<bool>;
      { a.grow_to(n) } -> std::same_as<void>;
      { a.allocate(n, out) } -> std::same_as<void>;
      { a.release(ids, count) } -> std::same_as<void>;
      { ca.allocation_bound(n) } -> std::same_as<index_t>;
    };

static_assert(block_allocator<block_pool>);

}  // namespace writescope
