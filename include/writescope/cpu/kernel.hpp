// SPDX-License-Identifier: Apache-2.0
// writescope/cpu/kernel.hpp — what a CPU attention kernel is: the concept the
// CPU engine's kernel models (paper §6.1), and its input, kv_segment.
//
// A CPU attention kernel attends the `group` query heads that share one KV head
// over a list of blocks, in host memory, and returns their partial state
// (partial_state.hpp): the normalised output and its natural-log LSE. It is a
// type with one static function (no state, no virtual dispatch):
//
//   K::run(fmt, kv_head, q, q_head_stride, group, scale, segs, o, o_head_stride, lse)
//     fmt      the block format of the cache (layout.hpp)
//     q        [group][q_dim] fp32, head g at q + g*q_head_stride (unscaled queries)
//     segs     the blocks, in attention order; segment i's rows [0, tokens)
//     o        [group][v_dim] fp32 out, head g at o + g*o_head_stride
//     lse      [group] fp32 out: log Σ exp(scale·q·k) over the attended keys
//   An empty list (or only zero-token segments) yields o = 0, lse = −inf. The
//   result depends only on the inputs and the order of `segs`.
//
// Threading: hybrid_attention calls run() from its CPU engine's OpenMP
// threads at once, and host_backend's emulated device from its worker thread,
// so run() must be thread-safe (thread-local scratch, no locks on the path).
// Errors: run() may throw std::bad_alloc on a thread's first call (scratch);
// nothing else.
//
// Models: cpu::decode_kernel (fp32 FMA, cpu/attention.hpp),
// cpu::amx_decode_kernel and cpu::auto_decode_kernel (cpu/amx_attention.hpp).
// A kernel opts in with `using kernel_concept = writescope::cpu_attention_kernel_tag;`
// (examples/custom_cpu_kernel.cpp).
#pragma once

#include <concepts>
#include <span>
#include <type_traits>

#include "../bf16.hpp"
#include "../config.hpp"
#include "../layout.hpp"
#include "../memory_space.hpp"
#include "../region.hpp"

namespace writescope {

namespace cpu {

/// One block (or the valid prefix of one) for the kernel: `block` points at the
/// block's first element in the block format of layout.hpp; `tokens` in
/// [0, block_tokens] rows of it are attended. Host-readable memory: a segment
/// is made from a block of a host-accessible region (region.hpp), and a device
/// block does not convert (a compile error naming host_accessible_space), or
/// from a raw pointer the caller states is host memory (kernel tests, benches).
struct kv_segment {
  const bf16* block = nullptr;
  int tokens = 0;

  constexpr kv_segment() noexcept = default;
  constexpr kv_segment(const bf16* host_block, int num_tokens) noexcept : block(host_block), tokens(num_tokens) {}
  template <class T, memory_space Space>
    requires host_accessible_space<Space> && std::same_as<std::remove_const_t<T>, bf16>
  constexpr kv_segment(const mem_span<T, Space>& host_block, int num_tokens) noexcept
      : block(host_block.data()), tokens(num_tokens) {}
};

}  // namespace cpu

/// Opt-in tag: `using kernel_concept = cpu_attention_kernel_tag;` (nothing
/// satisfies the concept by accident).
struct cpu_attention_kernel_tag {};

/// A CPU attention kernel for layout `Layout` (see the file comment).
template <class K, class Layout>
concept cpu_attention_kernel =
    kv_layout<Layout> && std::same_as<typename K::kernel_concept, cpu_attention_kernel_tag> &&
    requires(const block_format<Layout>& fmt, int kv_head, const float* q, index_t q_head_stride, int group,
             float scale, std::span<const cpu::kv_segment> segs, float* o, index_t o_head_stride, float* lse) {
      { K::run(fmt, kv_head, q, q_head_stride, group, scale, segs, o, o_head_stride, lse) } -> std::same_as<void>;
    };

}  // namespace writescope
