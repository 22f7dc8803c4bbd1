// SPDX-License-Identifier: Apache-2.0
// Must not compile: a kernel with the right run() but without the opt-in tag
// is not a cpu_attention_kernel, so hybrid_attention refuses it.
// expect-error: cpu_attention_kernel<CpuKernel.*no type named .+kernel_concept.+ in .+struct untagged_kernel
#include <writescope/writescope.hpp>

namespace ws = writescope;
using layout = ws::gqa_layout<128>;

struct untagged_kernel {
  static void run(const ws::block_format<layout>&, int, const float*, ws::index_t, int, float,
                  std::span<const ws::cpu::kv_segment>, float*, ws::index_t, float*) {}
};

using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::gpu_only>;
ws::hybrid_attention<cache_type, untagged_kernel>* attention = nullptr;
