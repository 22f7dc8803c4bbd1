// SPDX-License-Identifier: Apache-2.0
// Must not compile: a type with block_pool's members but without the opt-in
// is not a block_allocator.
// expect-error: block_allocator<A>.*enable_block_allocator<A> \[with A = look_alike\].+ evaluated to .+false
#include <writescope/block_allocator.hpp>

namespace ws = writescope;

struct look_alike : ws::block_pool {
  using ws::block_pool::block_pool;
};

template <ws::block_allocator A>
struct region {
  A blocks;
};

region<look_alike> r;
