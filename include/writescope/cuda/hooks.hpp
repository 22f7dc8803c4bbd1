// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/hooks.hpp — the compile-time Hooks parameter of
// basic_cuda_backend<Hooks>: the mutation-test switches (each removes one
// ordering guard or widens a race window) and the ablation switches (each
// replaces one design point of the streaming path by the baseline it improves
// on), and the copy-granularity policies of the streamed copies.
//
//   no_hooks          production (cuda_backend = basic_cuda_backend<no_hooks>):
//                     every switch is a static constexpr "off", so the backend,
//                     its engines and the kernels they launch carry no test
//                     branch, and the backend has no debug() / ablation().
//   cuda_test_hooks   mutation tests and the ablation benchmark: the switches
//                     are run-time values (cuda_debug_options,
//                     cuda_ablation_options) read at every call, so a test may
//                     flip them between steps. A program using it instantiates
//                     WS_CUDA_INSTANTIATE_TEST_HOOKS(Layout) (kernels.cuh) for
//                     each of its layouts: the attention kernel with a slow
//                     consumer.
//
// A Hooks type names `switches` (every member of cuda_debug_options, by that
// name) and `ablation` (a copy policy, per_step_allocation); with both switches
// types at their defaults the backend runs exactly the production code path.
// Host compiler only.
#pragma once

#include <concepts>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../config.hpp"

namespace writescope {

/// Switches that REMOVE a guard, for mutation tests only (with the guarding
/// event or wait removed, the test must fail). All off by default. Only a
/// backend with cuda_test_hooks has them (debug()); read at every call, so
/// tests may flip them between steps.
struct cuda_debug_options {
  bool skip_consumed_wait = false;   ///< WAR: refill a ping-pong buffer without waiting for its last reader
  bool skip_filled_wait = false;     ///< RAW: attend a ping-pong buffer without waiting for its copies
  bool skip_caller_event = false;    ///< RAW: read appended KV / q without waiting for the caller stream
  bool skip_eviction_wait = false;   ///< RAW: evict the D-window without waiting for the caller stream
  bool skip_block_reuse_wait = false;  ///< C9: D2H into host blocks without waiting for earlier H2D reads
  bool skip_landing_wait = false;    ///< RAW: stream pinned blocks without waiting for pending D2H writes
  /// Debug builds (WS_DEBUG_CHECKS()) reject H2D sources that are not page-locked;
  /// set this for the deliberate pageable-source ablation (pageable_allocator).
  bool allow_pageable_sources = false;
  /// Each CTA of the streamed-split attention kernel spins this many SM cycles
  /// before reading its buffer (a slow consumer; the kernel variant of
  /// WS_CUDA_INSTANTIATE_TEST_HOOKS).
  long long consumer_delay_cycles = 0;
  /// A spin kernel of this many SM cycles is queued on the copy stream before
  /// each chunk's copies (slow copies: the RAW guard's mutation test).
  long long copy_delay_cycles = 0;
  /// Sparse steps (docs/SPARSE.md), RAW: copy a staging buffer into ping-pong
  /// without the wait kernel on the host gather of its chunk. Device pull
  /// (sparse_transfer::device_pull): the pull kernel never waits for the gather
  /// threads; this removes the gate of the chunk's block-list copy only.
  bool skip_gather_wait = false;
  /// Sparse steps, WAR: gather into a staging buffer (and write the chunk's
  /// block lists) without waiting for the copy that last read it (two chunks
  /// earlier). Device pull: the block lists only. skip_consumed_wait and
  /// skip_filled_wait apply to pulled chunks as to copied ones (the pull kernel
  /// sits where the copy would, between the consumed wait and the filled record).
  bool skip_staging_wait = false;
  /// Sparse steps: every gather thread sleeps this long before each chunk (a slow gather).
  long long gather_delay_microseconds = 0;
  /// Fault kind K8: issue every host-side copy (streamed H2D runs, eviction
  /// and prefill D2H) as one cudaMemcpyAsync instead of splitting it at
  /// page-locked registration boundaries (pinned_registry::split). A run across
  /// two cudaHostRegister chunks, or two slabs that mmap placed back to back,
  /// then reaches the driver whole, which refuses it at the step
  /// (cudaErrorInvalidValue, pinned_allocators.hpp).
  bool skip_registration_split = false;
  /// Launcher thread (set_launch_thread): it sleeps this long before each
  /// launch's chunk loop (a late launcher).
  long long launcher_delay_microseconds = 0;
  /// C9 with the launcher thread: D2H into host blocks (write_blocks,
  /// copy_blocks_to_host) without first joining the launches whose copies the
  /// launcher may not have enqueued yet (their h2d_done record comes later).
  bool skip_pending_launch_join = false;
};

// -----------------------------------------------------------------------------
// Copy granularity of the streamed pinned blocks (paper §3.2, §7.4 Fig. 10)
// -----------------------------------------------------------------------------
// A policy splits one stream-plan run of `run_elems` bf16 elements (whole
// blocks of `block_elems`, each of (plane, KV head) slices of `slice_elems`)
// into the pieces issued as one copy each: f(first_elem, elems) in order.

/// The default: one copy per run of physically adjacent blocks (the format's
/// contiguous DMA).
struct coalesced_copies {
  template <class F>
  static void for_each_piece(index_t run_elems, index_t, index_t, F&& f) {
    f(index_t{0}, run_elems);
  }
};
/// Ablation: one copy per block (no coalescing).
struct per_block_copies {
  template <class F>
  static void for_each_piece(index_t run_elems, index_t block_elems, index_t, F&& f) {
    for (index_t e = 0; e < run_elems; e += block_elems) f(e, block_elems);
  }
};
/// Ablation: one copy per (plane, KV head) slice of a block, the per-segment
/// copies of a strided source; MLA has one slice per block (= per_block_copies).
struct per_slice_copies {
  template <class F>
  static void for_each_piece(index_t run_elems, index_t, index_t slice_elems, F&& f) {
    for (index_t e = 0; e < run_elems; e += slice_elems) f(e, slice_elems);
  }
};

/// Ablation switches (paper §7.4, Fig. 10) of cuda_test_hooks: each replaces
/// one design point of the streaming path with the baseline it improves on, so
/// that a benchmark can measure what the design point buys (bench/ws_bench.cpp,
/// mode ablate). All off by default: with the defaults the step runs exactly as
/// the production backend's. Read at every launch.
struct cuda_ablation_options {
  /// How the streamed pinned blocks are copied into ping-pong: which copy
  /// policy a launch runs (chosen once per launch, not per copy).
  enum class copy_granularity : std::uint8_t {
    coalesced_runs,  ///< coalesced_copies (default)
    per_block,       ///< per_block_copies
    per_slice,       ///< per_slice_copies
  };
  copy_granularity copies = copy_granularity::coalesced_runs;
  /// Destroy-and-rebuild transfer region instead of overwrite-reuse (paper
  /// §4.2): every launch cudaMallocs fresh ping-pong buffers (one per buffer
  /// index, each the size of the plan's largest chunk) instead of using the
  /// cache's, and finish() cudaFrees them, which synchronizes the device.
  bool per_step_allocation = false;
};

// -----------------------------------------------------------------------------
// Hooks
// -----------------------------------------------------------------------------

struct cuda_hooks_tag {};

/// Production hooks: no switch exists at run time.
struct no_hooks {
  using hooks_concept = cuda_hooks_tag;
  static constexpr bool enabled = false;
  /// Every member of cuda_debug_options, a constant "off".
  struct switches {
    static constexpr bool skip_consumed_wait = false;
    static constexpr bool skip_filled_wait = false;
    static constexpr bool skip_caller_event = false;
    static constexpr bool skip_eviction_wait = false;
    static constexpr bool skip_block_reuse_wait = false;
    static constexpr bool skip_landing_wait = false;
    static constexpr bool allow_pageable_sources = false;
    static constexpr long long consumer_delay_cycles = 0;
    static constexpr long long copy_delay_cycles = 0;
    static constexpr bool skip_gather_wait = false;
    static constexpr bool skip_staging_wait = false;
    static constexpr long long gather_delay_microseconds = 0;
    static constexpr bool skip_registration_split = false;
    static constexpr long long launcher_delay_microseconds = 0;
    static constexpr bool skip_pending_launch_join = false;
  };
  /// The design points as built: coalesced copies, overwrite-reuse.
  struct ablation {
    using copy_policy = coalesced_copies;
    static constexpr bool per_step_allocation = false;
  };
};

/// Mutation tests and ablation benchmarks: run-time switches, off by default.
struct cuda_test_hooks {
  using hooks_concept = cuda_hooks_tag;
  static constexpr bool enabled = true;
  using switches = cuda_debug_options;
  using ablation = cuda_ablation_options;
};

/// A Hooks type of basic_cuda_backend: opted in by the tag, with a `switches`
/// and an `ablation` type (default-constructible, copyable) and `enabled`.
template <class H>
concept cuda_hooks = requires {
  typename H::hooks_concept;
  typename H::switches;
  typename H::ablation;
  { H::enabled } -> std::convertible_to<bool>;
} && std::same_as<typename H::hooks_concept, cuda_hooks_tag> && std::semiregular<typename H::switches> &&
                     std::semiregular<typename H::ablation>;

static_assert(cuda_hooks<no_hooks> && cuda_hooks<cuda_test_hooks>);

namespace cuda_detail {

/// Calls f.template operator()<CopyPolicy>() with the copy policy of `abl`:
/// the type itself where the hooks fix it (no_hooks), else the one that
/// cuda_ablation_options::copies names — a choice per launch, not per copy.
template <class Ablation, class F>
void visit_copy_policy(const Ablation& abl, F&& f) {
  if constexpr (requires { typename Ablation::copy_policy; }) {
    (void)abl;
    std::forward<F>(f).template operator()<typename Ablation::copy_policy>();
  } else {
    using cg = cuda_ablation_options::copy_granularity;
    switch (abl.copies) {
      case cg::per_block: std::forward<F>(f).template operator()<per_block_copies>(); break;
      case cg::per_slice: std::forward<F>(f).template operator()<per_slice_copies>(); break;
      case cg::coalesced_runs:
      default: std::forward<F>(f).template operator()<coalesced_copies>(); break;
    }
  }
}

}  // namespace cuda_detail

}  // namespace writescope
