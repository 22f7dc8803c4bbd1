// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/cuda_backend.hpp — the real device backend (paper §4.2,
// §4.3, §6; docs/CUDA-ENGINE.md): basic_cuda_backend<Hooks> and its
// gpu_engine<Layout>, composed of the parts below; cuda_backend is the
// production one (no_hooks). Host compiler only: these headers hold no kernels
// and include nothing beyond <cuda_runtime_api.h>; the kernels they launch are
// declared in kernels.hpp and instantiated by one .cu of the program
// (kernels.cuh explains how). docs/CUDA-ENGINE.md has the full ordering table.
//
//   hooks.hpp          the Hooks parameter (no_hooks, cuda_test_hooks), the
//                      mutation-test and ablation switches, copy policies
//   handles.hpp        RAII streams, events, device buffers, page-locked staging
//   launch_thread.hpp  an engine's launcher thread; the completion list
//   context.hpp        what the backend shares with its parts (streams, events)
//   host_writes.hpp    prefill scatter, evictions, bounce and deferred writes
//   dense_engine.hpp   the step phases, the dense chunk loop, merge, timing
//   sparse_engine.hpp  the sparse gather pipeline
//
// Memory spaces: activation_space = device_space. Appended KV, queries and
// outputs are device pointers; the D-window, ping-pong buffers and the
// HBM-resident region are device memory; the unpinned compute region is pageable host memory, the pinned load
// region page-locked host memory (cuda_host_alloc / cuda_host_register).
//
// Streams (one backend, one device, driven from one host thread):
//   caller  the caller's stream (given at construction, or created): appends,
//           prefill scatter (the HBM-resident region's too), evictions into
//           the HBM-resident region (device to device), the final merge. Everything a step produces is
//           ordered before work the caller enqueues on it afterwards.
//   h2d     streamed copies pinned -> ping-pong (shared by all engines).
//   d2h     eviction and prefill copies device -> host.
//   per engine: compute (split attention, fold, D-window) and a small stream
//           for the D2H copy of the queries.
// Events (all guards, see docs/CUDA-ENGINE.md for the hazard -> guard -> test table):
//   launch  caller -> compute, q: the appended KV and q are written (RAW)
//   filled[b] / consumed[b]  h2d -> compute (RAW) / compute -> h2d (WAR), per
//           ping-pong buffer, persisting across layers and steps
//   h2d_done  h2d -> d2h: no D2H rewrites a (recycled) pinned block an earlier
//           H2D still reads (fault case C9, docs/CUDA-ENGINE.md)
//   d2h_done  d2h -> h2d: evicted / prefilled pinned blocks have landed before
//           a step streams them; d2h -> caller after an eviction: the D-window
//           slots are not overwritten by the next append before they are copied
//   evict_src caller -> d2h: the eviction copies what the appends wrote (RAW)
//   compute_done compute -> caller: the merge reads finished partials, and the
//           caller's next writes (append, q) come after every read of them
// Host blocking: launch() never blocks and allocates nothing; host_queries()
// waits only for the q copy; cpu_partial() waits for the previous step's
// CPU-partial upload (in practice long done); finish() does not block (unless
// debug partials are requested). Evictions and prefill writes whose destination
// is pageable (the unpinned compute region) complete before they return, since
// the CPU reads those blocks directly; pinned destinations are asynchronous.
//
// Lifetimes: the backend outlives every cache and engine that uses it; a cache
// is destroyed after its hybrid_attention (engine). Destructors synchronize.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "../backend.hpp"
#include "../config.hpp"
#include "../host_memory.hpp"
#include "../layout.hpp"
#include "../memory_space.hpp"
#include "../partial_state.hpp"
#include "../sparse_pipeline.hpp"
#include "context.hpp"
#include "cuda_error.hpp"
#include "dense_engine.hpp"
#include "handles.hpp"
#include "hooks.hpp"
#include "host_writes.hpp"
#include "kernels.hpp"
#include "pinned_allocators.hpp"
#include "sparse_engine.hpp"

namespace writescope {

/// The CUDA backend (satisfies `backend`). Hooks: no_hooks in production
/// (cuda_backend), cuda_test_hooks for mutation tests and ablation benchmarks
/// (hooks.hpp). Not copyable or movable; one backend drives one device from
/// one host thread.
template <cuda_hooks Hooks = no_hooks>
class basic_cuda_backend {
 public:
  using backend_concept = backend_tag;
  using activation_space = device_space;
  using hooks_type = Hooks;
  /// Device memory (cudaMalloc), freed on destruction. Movable.
  using device_buffer = cuda_detail::device_buffer;

  /// Most ping-pong buffers an engine supports (events are created up front).
  static constexpr int max_ping_pong_buffers = cuda_detail::max_ping_pong_buffers;

  /// Uses the current device; creates its own (non-blocking) caller stream.
  basic_cuda_backend() : basic_cuda_backend(nullptr, true) {}
  /// Uses the current device and the caller's stream `caller` (0 = the legacy
  /// default stream). Everything the backend writes for the caller (appends,
  /// outputs) is ordered on `caller`.
  explicit basic_cuda_backend(cudaStream_t caller) : basic_cuda_backend(caller, false) {}
  basic_cuda_backend(const basic_cuda_backend&) = delete;
  basic_cuda_backend& operator=(const basic_cuda_backend&) = delete;
  /// Synchronizes the caller and d2h streams, then frees (deferred pageable
  /// writes still pending are dropped: their cache is gone).
  ~basic_cuda_backend() = default;

  /// The constructors' first call. Throws cuda_error whose message starts
  /// "no CUDA device: " and names the CUDA status (code(): that status, or
  /// cudaErrorNoDevice for 0 devices) when the runtime sees no device: no
  /// driver (cudaErrorInsufficientDriver), none visible (cudaErrorNoDevice,
  /// e.g. CUDA_VISIBLE_DEVICES=-1) or a count of 0. Other failures of
  /// cudaGetDeviceCount throw the usual WS_CUDA_TRY error.
  static void require_device() { cuda_detail::require_device(); }

  [[nodiscard]] std::string_view name() const noexcept { return ctx_.name; }
  [[nodiscard]] int device() const noexcept { return ctx_.device; }
  [[nodiscard]] cudaStream_t caller_stream() const noexcept { return ctx_.caller; }
  [[nodiscard]] cudaStream_t copy_stream() const noexcept { return ctx_.h2d.get(); }
  [[nodiscard]] cudaStream_t d2h_stream() const noexcept { return ctx_.d2h.get(); }
  /// Mutation-test switches (cuda_debug_options; cuda_test_hooks only).
  [[nodiscard]] typename Hooks::switches& debug() noexcept
    requires Hooks::enabled
  {
    return ctx_.debug;
  }
  /// Ablation switches (cuda_ablation_options, all off by default; cuda_test_hooks only).
  [[nodiscard]] typename Hooks::ablation& ablation() noexcept
    requires Hooks::enabled
  {
    return ctx_.ablation;
  }
  /// Largest device staging buffer write_blocks uses for host destinations.
  void set_max_staging_bytes(index_t bytes) noexcept { writes_.set_max_staging_bytes(bytes); }
  /// How the D2H copies of one write_blocks / copy_blocks_to_host call into
  /// page-locked memory (pinned blocks, bounce buffers) are enqueued: true
  /// (default) gathers them, merges adjacent pieces and submits one
  /// cudaMemcpyBatchAsync (copy_batch.hpp; single copies where the runtime or
  /// driver predates 12.8); false issues one cudaMemcpyAsync per piece (the
  /// baseline of bench/prefill_write_bench). Between calls; never throws.
  void set_batched_host_copies(bool on) noexcept { writes_.set_batched_host_copies(on); }
  /// {submissions, copies after the registration split, CUDA copy calls} of
  /// the D2H batches since construction (api calls == copies when nothing was
  /// batched).
  [[nodiscard]] std::array<std::uint64_t, 3> host_copy_counters() const noexcept {
    return writes_.host_copy_counters();
  }

  /// Whether a dense launch hands its chunk loop (the H2D copies of the
  /// streamed chunks, their split attention and folds, the D-window kernel)
  /// to the engine's launcher thread (off by default). launch() then returns
  /// after the q copy is enqueued, and the calling thread can wait for q and
  /// run the CPU engine while the launcher enqueues (one copy per run, two
  /// launches per 128 splits). The plan and window list are copied at launch,
  /// so the caller's contract is unchanged; D2H writes into host blocks first
  /// join a pending launch (C9). Off (the default): everything is enqueued
  /// inside launch(). The launcher competes with the CPU engine's threads for
  /// cores, hence off (docs/DECISIONS.md); on a host with cores to spare it
  /// takes the enqueue off the CPU side's path. Sparse launches are never
  /// handed over. Read at each launch; set between steps from the thread that
  /// drives the cache.
  void set_launch_thread(bool on) noexcept { ctx_.launch_thread = on; }
  [[nodiscard]] bool launch_thread() const noexcept { return ctx_.launch_thread; }

  /// Attends the HBM-resident region's splits with the split-K resident kernels
  /// (launch_resident_attend + launch_resident_fold: one launch each per step
  /// over a device table of items; docs/CUDA-ENGINE.md, "The resident kernel")
  /// instead of the streamed-chunk kernel in launches of max_attend_items with a
  /// fold after each (the default, off). Experimental: not the production path
  /// until measured. Read by an engine at construction (its workspace for the
  /// region's items is then reserved: set it before constructing
  /// hybrid_attention) and at each launch; an engine without that workspace
  /// keeps the default path. Set between steps from the thread that drives the cache.
  void set_resident_kernel(bool on) noexcept { ctx_.resident_kernel = on; }
  [[nodiscard]] bool resident_kernel() const noexcept { return ctx_.resident_kernel; }

  /// Whether an all-GPU dense step (gpu_step_args::cpu_side false) that
  /// streams nothing runs on the caller stream (on by default;
  /// docs/CUDA-ENGINE.md, "Caller-stream steps"): its HBM-resident splits and
  /// D-windows in one attention launch, one fold, the merge, and no event
  /// waited on or stream crossed; the output has the same bits as the
  /// two-stream path (off). It applies while the resident splits plus the
  /// batch fit one launch (gpu::max_attend_items) and the resident kernels
  /// (set_resident_kernel) do not take the step. Read at each launch; set
  /// between steps from the thread that drives the cache.
  void set_caller_stream_steps(bool on) noexcept { ctx_.caller_stream_steps = on; }
  [[nodiscard]] bool caller_stream_steps() const noexcept { return ctx_.caller_stream_steps; }

  /// cudaMalloc of `bytes`; throws resource_error naming `what` and the size.
  device_buffer allocate_device(index_t bytes, const char* what) {
    return cuda_detail::allocate_device_buffer(bytes, what);
  }

  /// Page-locked host staging (cudaHostAlloc); throws pinned_memory_error.
  host_allocation allocate_staging(index_t bytes) { return cuda_detail::allocate_page_locked(bytes); }

  /// Fills `bytes` of device memory with a repeated 16-bit pattern (poisoning).
  /// Synchronous (init-time only): later copies on other streams see the fill.
  void fill_device(std::byte* dst, index_t bytes, std::uint16_t pattern) {
    if (bytes <= 1) return;
    gpu::launch_fill_u16(reinterpret_cast<std::uint16_t*>(dst), bytes / 2, pattern, ctx_.caller);
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_.caller));
  }

  // --- writes into cache blocks (host_writes.hpp has the details) ------------

  /// Scatters token-major KV (device memory) into blocks: device destinations
  /// by a kernel on the caller stream, host destinations through a device
  /// staging buffer and D2H copies (C9-ordered). Returns once pageable
  /// destinations are complete; pinned ones complete asynchronously.
  template <kv_layout Layout>
  void write_blocks(const block_format<Layout>& fmt, const kv_tokens<Layout, device_space>& kv,
                    std::span<const block_write> writes) {
    writes_.write_blocks(fmt, kv, writes);
  }
  /// Eviction (paper §4.2): device -> host copies on the d2h stream after the
  /// caller's appends (RAW) and earlier H2D reads (C9); the caller waits for
  /// them before its next append (WAR). Returns once pageable destinations are
  /// complete (through the page-locked bounce buffer).
  void copy_blocks_to_host(std::span<const block_copy> copies) { writes_.copy_blocks_to_host(copies); }
  /// Eviction into the HBM-resident region: device -> device copies on the
  /// caller stream, so after the appends that wrote the D-window (RAW), before
  /// the next append into it (WAR) and before any later launch, whose compute
  /// stream waits for the caller's work so far (K7: the write of an HBM block
  /// is ordered before the kernel that reads it). Does not block the host.
  void copy_blocks_on_device(std::span<const block_copy> copies) {
    for (const block_copy& c : copies)
      if (c.bytes > 0)
        WS_CUDA_TRY(cudaMemcpyAsync(c.dst, c.src, static_cast<std::size_t>(c.bytes), cudaMemcpyDeviceToDevice,
                                    ctx_.caller));
  }
  /// Free device memory now (cudaMemGetInfo); the cache checks its
  /// HBM-resident region against it at init.
  [[nodiscard]] index_t device_free_bytes() const {
    std::size_t free_bytes = 0, total_bytes = 0;
    WS_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
    return index_t(free_bytes);
  }
  /// The eviction bounce buffer's largest size (default 32 MiB; 0 = direct
  /// copies into pageable memory). Between steps; never throws.
  void set_eviction_bounce_bytes(index_t bytes) noexcept { writes_.set_eviction_bounce_bytes(bytes); }
  /// Page-locks the bounce buffer now at its full size (no page-locking inside
  /// a later step, K8); a refusal means direct copies. Never throws.
  void reserve_eviction_bounce() noexcept { writes_.reserve_eviction_bounce(); }
  /// Whether evictions into pageable memory go through the bounce buffer.
  [[nodiscard]] bool eviction_bounce_active() const noexcept { return writes_.eviction_bounce_active(); }
  /// Waits until every host block written so far has landed (deferred
  /// pageable prefill writes included).
  void synchronize_host_writes() { writes_.synchronize_host_writes(); }
  /// Deferred pageable prefill writes, at most `max_bytes` pending (off by
  /// default: 0); completed by the next write, complete_host_writes or
  /// synchronize call.
  void set_deferred_host_writes(index_t max_bytes) { writes_.set_deferred_host_writes(max_bytes); }
  [[nodiscard]] index_t deferred_host_writes() const noexcept { return writes_.deferred_host_writes(); }
  /// Page-locks the deferred writes' prefill bounce buffer now at `bytes`
  /// (host memory; at most deferred_host_writes(); pass that for the whole
  /// buffer), so that no prefill page-locks it later. Completes pending
  /// deferred writes first. Between steps, on the driving thread. Throws
  /// config_error for bytes outside [0, deferred_host_writes()],
  /// pinned_memory_error when page-locking is refused (nothing changed).
  void reserve_deferred_host_writes(index_t bytes) { writes_.reserve_deferred_host_writes(bytes); }
  /// Bytes of that buffer page-locked now.
  [[nodiscard]] index_t deferred_host_writes_reserved_bytes() const noexcept {
    return writes_.deferred_host_writes_reserved_bytes();
  }
  /// Finishes the deferred pageable writes of the last write_blocks call.
  void complete_host_writes() { writes_.complete_host_writes(); }

  /// Device -> host copy ordered after the caller stream; complete on return.
  void copy_to_host_sync(void* dst, const std::byte* src, index_t bytes) {
    if (bytes <= 0) return;
    WS_CUDA_TRY(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToHost, ctx_.caller));
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_.caller));
  }

  /// Waits for the caller, copy and d2h streams (after any engine's launcher
  /// thread has enqueued its pending launch).
  void synchronize() {
    ctx_.join_pending_launches();
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_.caller));
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_.h2d.get()));
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_.d2h.get()));
    writes_.complete_host_writes();
  }

  /// The GPU side of a decode step for one layout (one per cache).
  template <kv_layout Layout>
  class gpu_engine;

 private:
  basic_cuda_backend(cudaStream_t caller, bool create) : ctx_(caller, create), writes_(ctx_) {}

  cuda_detail::backend_context<Hooks> ctx_;  // first: outlives the parts that use its streams
  cuda_detail::host_writes<Hooks> writes_;
};

/// The production backend: no test switch exists, the kernels it launches
/// carry no test branch.
using cuda_backend = basic_cuda_backend<no_hooks>;

/// The GPU side of a decode step of one layer (paper §4.2; docs/CUDA-ENGINE.md):
/// the same interface and the same order of work as host_backend::gpu_engine.
/// A dense launch runs dense_engine's phases (the order of work is in
/// dense_engine.hpp); a sparse plan (stream_plan::build_sparse, after
/// reserve_sparse()) runs the gather pipeline of sparse_engine.hpp through the
/// same phases. finish(): CPU partial H2D, then on the caller stream
///   out = (streamed ⊕ D-window) ⊕ CPU  (merge_state_row semantics),
/// the streamed state holding the HBM-resident splits, folded first.
/// Deterministic and batch-invariant: partial boundaries come from the plan
/// (each sequence's own blocks) and every merge runs in a fixed order.
///
/// Workspaces are allocated at construction for `max_batch` sequences; launch
/// allocates nothing and never blocks the host. One engine per cache: the
/// filled/consumed events guard the ping-pong buffers of the cache it serves.
/// Calls into one engine come from one thread.
template <cuda_hooks Hooks>
template <kv_layout Layout>
class basic_cuda_backend<Hooks>::gpu_engine {
 public:
  using args_type = gpu_step_args<Layout, device_space>;
  /// finish() never blocks: its timing is of an earlier launch (take_completed_gpu_cost).
  static constexpr bool asynchronous = true;
  static constexpr int Q = Layout::q_dim;
  static constexpr int V = Layout::v_dim;

  /// max_batch: sequences per step. Allocates device workspaces and pinned
  /// staging; throws resource_error / pinned_memory_error when refused.
  gpu_engine(basic_cuda_backend& backend, const Layout& layout, int max_batch)
      : dense_(backend.ctx_, layout, max_batch), sparse_(backend.ctx_) {}
  gpu_engine(const gpu_engine&) = delete;
  gpu_engine& operator=(const gpu_engine&) = delete;
  /// Waits for this engine's work (and the shared copy stream) before freeing.
  ~gpu_engine() {
    dense_.stop_launcher();
    cuda_detail::ignore(cudaStreamSynchronize(dense_.context().caller));
    cuda_detail::ignore(cudaStreamSynchronize(dense_.context().h2d.get()));
    dense_.free_step_buffers();
    sparse_.stop();
  }

  /// Reserves the sparse pipeline (backend.hpp sparse_reservation): two pinned
  /// staging buffers of r.chunk_blocks blocks (none with r.device_pull), two
  /// pinned and r.buffers device block-list buffers, and r.gather_threads
  /// gather threads (created once). A larger reservation later grows the
  /// buffers (waiting for the copy stream first); the transfer mode is the
  /// latest reservation's. Between steps only. Throws pinned_memory_error /
  /// resource_error; with r.device_pull, config_error when the device lacks
  /// cudaDevAttrUnifiedAddressing or cudaDevAttrCanUseHostPointerForRegisteredMem
  /// (the pull kernel reads page-locked memory through its host addresses),
  /// when r.block_bytes is not a positive multiple of 16 or r.pull_ctas < 1.
  /// With set_resident_kernel on: reserves the resident kernels' workspace for
  /// steps that attend at most `max_runs` eviction batches of the HBM-resident
  /// region (partials for as many resident groups, the device segment, item
  /// and run tables); a no-op when off or already as large. Throws
  /// resource_error naming the bytes when refused. hybrid_attention calls it at
  /// construction with the bound of its partition_spec (the region's batches).
  void reserve_resident_items(index_t max_runs) { dense_.reserve_resident_items(max_runs); }
  /// Dense launches whose resident splits ran through the resident kernels.
  [[nodiscard]] index_t resident_kernel_launches() const noexcept { return dense_.resident_kernel_launches(); }
  /// Dense launches that took the caller-stream path (set_caller_stream_steps).
  [[nodiscard]] index_t caller_stream_launches() const noexcept { return dense_.caller_stream_steps(); }

  void reserve_sparse(const sparse_reservation& r) {
    dense_.join_launch();
    sparse_.reserve(r);
  }
  /// Bytes of the two pinned staging buffers (0 before reserve_sparse, and
  /// while only device-pull reservations were made).
  [[nodiscard]] index_t sparse_staging_bytes() const noexcept { return sparse_.staging_bytes(); }
  /// The gather of the last finished sparse step (zeros after a dense one).
  [[nodiscard]] const gather_stats& last_gather() const noexcept { return sparse_.last_gather(); }

  /// Starts the GPU side of one step; returns at once (enqueues only). `a.q`
  /// (device), the D-window slots, the ping-pong buffers and the pinned
  /// sources of a.plan must stay valid until the step's work completes (the
  /// caller stream passes the merge); the plan and window list themselves are
  /// read during the call only. Throws shape_error / config_error before
  /// enqueueing anything for inconsistent arguments; in debug builds
  /// (WS_DEBUG_CHECKS()) pinned_memory_error for a source that is not page-locked;
  /// in every build, before enqueueing anything, pinned_memory_error for a
  /// block the device would pull (sparse plan, device-pull reservation) that
  /// lies outside the page-locked ranges (pinned_registry).
  void launch(const args_type& a) {
    dense_.join_launch();  // an earlier launch's chunk loop (finish() was skipped after an error)
    dense_.validate(a);
    if (a.plan->sparse) sparse_.validate(a);
    dense_.check_page_locked_sources(a);
    const typename Hooks::switches dbg = dense_.context().debug;
    if (a.plan->sparse)  // docs/SPARSE.md; the ablation switches apply to dense steps only
      sparse_.launch(dense_, a, dbg);
    else
      dense_.launch(a, dbg);
  }

  /// Whether a launch's chunk loop is still with the launcher thread (false
  /// after finish(), gpu_seconds_sync() or take_completed_gpu_cost()).
  [[nodiscard]] bool launch_pending() const noexcept { return dense_.launch_pending(); }

  /// Waits until the launcher thread has enqueued the last launch's chunk
  /// loop (no-op when nothing is pending); rethrows what it threw
  /// (cuda_error). Called by finish() and the other entry points that read
  /// the launch's state; callable by the owner between launch() and finish().
  void join_launch() { dense_.join_launch(); }

  /// Host-readable queries of the launched step ([batch][Hq][q_dim], pinned
  /// staging). Waits only for their D2H copy.
  [[nodiscard]] const float* host_queries() { return dense_.host_queries(); }

  /// Where the CPU engine writes its merged partial: dense [batch][Hq][v_dim] /
  /// [batch][Hq] in pinned staging. Waits until the previous step's upload of
  /// this buffer has finished (C9: a pinned source is never rewritten while an
  /// H2D still reads it).
  [[nodiscard]] host_partial_view<float> cpu_partial(int batch) { return dense_.cpu_partial(batch); }

  /// Uploads the CPU partial (tiny) and merges (streamed ⊕ D-window) ⊕ CPU into
  /// `o` (device) on the caller stream; does not block the host (unless
  /// o.debug is set: then it waits and copies every partial to the host; with
  /// the launcher thread it first waits until the launch is enqueued, and
  /// rethrows the launcher's cuda_error, which ends the step; after a sparse
  /// launch it waits until the gather threads are done with the step's chunks).
  /// Returns the GPU side's seconds (CUDA events: start of streaming to the
  /// end of the D-window kernel, merge excluded) of the most recent launch of
  /// this engine whose work has completed — usually the previous layer's, so
  /// no sync is needed; 0 before any has completed. gpu_seconds_sync() gives
  /// the exact value of the last launch.
  double finish(const step_outputs<device_space>& o) {
    dense_.end_launch(o);
    sparse_.finish_step(dense_.last_sparse());
    return dense_.merge(o);
  }

  /// The GPU-side cost of the newest launch whose timing completed since the
  /// last call, with the streamed tokens of that same launch; {0, 0} when none
  /// completed since. finish() returns an earlier launch's seconds (it never
  /// blocks), so hybrid_attention feeds the policy's online B from this pair,
  /// not from finish()'s seconds with the current step's tokens: the two differ
  /// right after an eviction, and before the first launch completes finish()
  /// returns 0. Each completed launch is reported at most once; older ones that
  /// complete together with a newer one are dropped (B is a sliding average).
  completed_gpu_cost take_completed_gpu_cost() noexcept { return dense_.take_completed_gpu_cost(); }

  /// Waits for the last launch's GPU side and returns its exact seconds.
  double gpu_seconds_sync() { return dense_.gpu_seconds_sync(); }

  /// The engine's compute stream (diagnostics).
  [[nodiscard]] cudaStream_t compute_stream() const noexcept { return dense_.compute(); }

 private:
  cuda_detail::dense_engine<Layout, Hooks> dense_;
  cuda_detail::sparse_pipeline<Layout, Hooks> sparse_;
};

static_assert(backend<cuda_backend> && backend<basic_cuda_backend<cuda_test_hooks>>);
static_assert(gpu_attention_engine<cuda_backend::gpu_engine<gqa_layout<128>>, cuda_backend, gqa_layout<128>>);

}  // namespace writescope
