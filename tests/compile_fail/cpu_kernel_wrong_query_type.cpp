// SPDX-License-Identifier: Apache-2.0
// Must not compile: a tagged kernel whose run() takes bf16 queries (the
// concept's queries are fp32) does not model cpu_attention_kernel.
// expect-error: cpu_attention_kernel<CpuKernel.*required expression .+K::run
#include <writescope/writescope.hpp>

namespace ws = writescope;
using layout = ws::gqa_layout<128>;

struct bf16_query_kernel {
  using kernel_concept = ws::cpu_attention_kernel_tag;
  static void run(const ws::block_format<layout>&, int, const ws::bf16*, ws::index_t, int, float,
                  std::span<const ws::cpu::kv_segment>, float*, ws::index_t, float*) {}
};

using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::gpu_only>;
ws::hybrid_attention<cache_type, bf16_query_kernel>* attention = nullptr;
