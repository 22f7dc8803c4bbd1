// SPDX-License-Identifier: Apache-2.0
// Must not compile: a backend whose GPU engine lacks the engine's operations
// (launch, finish, ..., `asynchronous`) does not give a gpu_attention_engine,
// and hybrid_attention says so.
// expect-error: static assertion failed: hybrid_attention: the backend.s GPU engine does not model gpu_attention_engine
#include <writescope/writescope.hpp>

namespace ws = writescope;
using layout = ws::gqa_layout<128>;

struct partial_backend : ws::host_backend {
  template <ws::kv_layout L>
  class gpu_engine {
   public:
    gpu_engine(partial_backend&, const L&, int) {}
  };
};
static_assert(ws::backend<partial_backend>);

using cache_type = ws::inplace_kv_cache<layout, partial_backend, ws::pageable_allocator, ws::gpu_only>;
constexpr auto bytes = sizeof(ws::hybrid_attention<cache_type>);
