// SPDX-License-Identifier: Apache-2.0
// Must not compile: a type that opts in to block_allocator but lacks
// allocation_bound() does not model it, and inplace_kv_cache's last template
// parameter refuses it, naming the missing expression.
// expect-error: satisfaction of .*block_allocator<BlockAllocator>.* \[with BlockAllocator = no_bound\].*the required expression .*ca\.allocation_bound\(n\).* is invalid
#include <writescope/writescope.hpp>

namespace ws = writescope;
using layout = ws::gqa_layout<128>;

struct no_bound {
  using allocator_concept = ws::block_allocator_tag;
  no_bound() = default;
  no_bound(ws::index_t, ws::index_t, const char*, const char*) {}
  ws::index_t capacity() const { return 0; }
  ws::index_t max_capacity() const { return 0; }
  ws::index_t free_blocks() const { return 0; }
  ws::index_t used_blocks() const { return 0; }
  const char* name() const { return "no_bound"; }
  bool is_used(ws::block_id) const { return false; }
  void grow_to(ws::index_t) {}
  void allocate(ws::index_t, std::vector<ws::block_id>&) {}
  void release(const ws::block_id*, std::size_t) {}
};

using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::gpu_only, no_bound>;
constexpr auto bytes = sizeof(cache_type);
