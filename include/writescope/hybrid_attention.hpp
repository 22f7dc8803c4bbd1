// SPDX-License-Identifier: Apache-2.0
// writescope/hybrid_attention.hpp — one decode-attention step of one layer over
// an inplace_kv_cache, with the CPU and GPU engines running at once and their
// partial states merged exactly by LSE (paper §4.2, §5.1, §6).
//
// Per step, for a batch of sequences:
//   1. the stream plan cuts each sequence's pinned blocks into splits and packs
//      them into ping-pong chunks, and its HBM-resident blocks into resident
//      splits (stream_plan.hpp);
//   2. the backend's GPU engine starts: it attends the resident splits in
//      place, streams the chunks through ping-pong and attends them, and
//      attends the D-window — asynchronously;
//   3. meanwhile the CPU engine's threads attend the unpinned blocks in place,
//      split into tasks of (sequence, KV head, cpu_task_blocks blocks), and
//      merge each (sequence, head)'s task partials in task order;
//   4. the GPU engine merges (HBM ⊕ streamed) ⊕ D-window ⊕ CPU into the output;
//   5. the measured cost of both sides goes to the routing policy (online A; B and, for
//      an asynchronous engine, the host enqueue K per streamed token — roofline_policy).
//
// CPU assist (optional, attention_options::assist; docs/DECISIONS.md): the
// pinned load region is host memory in the same block format, so the CPU
// engine can attend some of a sequence's pinned blocks in place instead of the
// GPU streaming them. Nothing moves: placement still decides where each byte
// lives; the assist only decides, per step, which engine reads the newest
// pinned blocks. In `adaptive` mode the number follows the two sides' measured
// per-token times so that both finish together, to follow the CPU engine's
// drift from step to step, which a placement fixed at write time cannot (off
// by default; why: docs/DECISIONS.md).
//
// Determinism: task and split boundaries depend only on each sequence's own
// blocks, and every merge runs in a fixed order, so outputs are bit-identical
// across reruns, thread counts, and batchmates at a fixed placement (K10) —
// with the assist off or `fixed`; `adaptive` follows measured times, so its
// boundaries (and the last bits of the output) vary from run to run.
// Threading: call step() from one thread (the one that drives the GPU). The
// CPU engine uses OpenMP with `cpu_threads` threads.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#  include <omp.h>
#endif

#include "assist.hpp"
#include "cpu/amx_attention.hpp"
#include "cpu/attention.hpp"
#include "cpu/kernel.hpp"
#include "error.hpp"
#include "inplace_kv_cache.hpp"
#include "partial_state.hpp"
#include "policy.hpp"
#include "sparse.hpp"
#include "sparse_pipeline.hpp"
#include "stream_plan.hpp"

namespace writescope {

struct attention_options {
  /// CPU engine threads; 0 = one less than the hardware threads (a core is
  /// left for the thread that drives the GPU), at least 1.
  int cpu_threads = 0;
  /// Fill partial-state workspaces with NaN before every step (tests: an
  /// unwritten partial shows as NaN in the output).
  bool poison_workspaces = false;
  /// The sparse pipeline (sparse steps only; docs/SPARSE.md).
  sparse_options sparse{};
  /// CPU assist over the pinned region (dense steps; off by default).
  assist_options assist{};
  /// Host memory the constructor reserves and touches for the CPU engine's
  /// task partials, at most: enough for the tasks of every block the spec's
  /// capacities can hold (plus the pinned ones with an assist) of
  /// max_sequences sequences. 0 (default): nothing resident at init; the
  /// workspace grows in the step that first needs it, by at least half, its
  /// new pages touched by the CPU engine's threads together. A decoder that
  /// wants no page faults on its decode path sets it (ws_decode: 256 MiB;
  /// absorbed MLA needs 32 KiB per task: docs/DECISIONS.md).
  index_t task_workspace_reserve_bytes = 0;
  /// A dense step whose batch has no block in the unpinned region and no
  /// assisted block runs without a CPU side (step_report::cpu_side false): no
  /// query copy, no CPU engine run, no wait for the device on the host. false:
  /// every step runs the CPU side, an empty CPU partial merged (the same bits;
  /// the ablation that measures what the all-GPU step saves).
  bool all_gpu_steps = true;
};

/// What one step did and how long each side took.
struct step_report {
  double cpu_seconds = 0.0;      ///< CPU engine wall time (attend + merge its tasks; not the wait for q)
  /// GPU side time (stream + attend). host_backend: this step's. cuda_backend:
  /// the newest earlier launch whose events completed (finish() never blocks;
  /// 0 before the first completes); time a step with a stream sync instead.
  double gpu_seconds = 0.0;
  double total_seconds = 0.0;    ///< the whole step, as the caller sees it
  /// Host-thread phases of total_seconds, in order (seconds): validation,
  /// assist choice, stream plan and the GPU launch; the wait for the step's
  /// queries on the host (cuda_backend: the q copy; with the assist also the
  /// pinned host writes); then cpu_seconds; then the engine's finish (merge
  /// enqueued) and the policy's feedback. Sparse steps: launch_seconds
  /// includes select_seconds. They show what lies on the CPU
  /// side's critical path besides the engine itself.
  double launch_seconds = 0.0;
  double query_wait_seconds = 0.0;
  double finish_seconds = 0.0;
  index_t cpu_tokens = 0;        ///< KV tokens attended by the CPU engine (assisted pinned tokens included)
  index_t assist_tokens = 0;     ///< of which pinned tokens the CPU engine attended in place (CPU assist)
  index_t streamed_tokens = 0;   ///< KV tokens streamed through ping-pong
  index_t resident_tokens = 0;   ///< KV tokens attended in place in the HBM-resident region
  index_t window_tokens = 0;     ///< KV tokens attended in the D-window
  index_t copies = 0;            ///< H2D copies issued (after coalescing)
  index_t chunks = 0;            ///< ping-pong fills
  int cpu_tasks = 0;
  /// false: an all-GPU dense step (no unpinned block in the batch, no assist):
  /// no query copy to the host, no CPU engine run, no CPU partial merged, and
  /// (cuda_backend) nothing in the step waits for the device
  bool cpu_side = true;
  // Sparse steps only (docs/SPARSE.md). There, cpu_tokens are the selected
  // unpinned tokens averaged over the KV heads (sum over heads of the tokens
  // each head attends, / Hkv) and streamed_tokens the selected pinned tokens
  // (union over the KV heads: what crosses PCIe): the volumes the policy sees.
  index_t placed_blocks = 0;     ///< placed blocks of the batch (the selection's candidates)
  index_t selected_blocks = 0;   ///< of which attended by at least one KV head
  double select_seconds = 0.0;   ///< summaries of newly placed blocks + the selector (in total_seconds)
  double gather_seconds = 0.0;   ///< host gather into staging, first to last memcpy (overlaps the copies)
  index_t gathered_bytes = 0;    ///< bytes gathered into staging by host memcpy (sparse_transfer::host_gather)
  index_t pulled_bytes = 0;      ///< bytes of gathered chunks pulled by the device instead (sparse_transfer::device_pull)
};

/// CpuKernel: the CPU engine's kernel, a cpu_attention_kernel (cpu/kernel.hpp)
/// for the cache's layout; host_backend's emulated device runs it too
/// (gpu_engine_for). Default cpu::auto_decode_kernel: AMX-BF16 tiles for MLA
/// where the CPU has them (cpu/amx_attention.hpp; WRITESCOPE_CPU_AMX), else
/// fp32 FMA. The GPU engine is the backend's (gpu_attention_engine, backend.hpp).
template <class Cache, cpu_attention_kernel<typename Cache::layout_type> CpuKernel =
                           cpu::auto_decode_kernel<typename Cache::layout_type>>
class hybrid_attention {
 public:
  using layout_type = typename Cache::layout_type;
  using backend_type = typename Cache::backend_type;
  using activation_space = typename Cache::activation_space;
  using cpu_kernel_type = CpuKernel;
  using engine_type = gpu_engine_for_t<backend_type, layout_type, CpuKernel>;
  static_assert(gpu_attention_engine<engine_type, backend_type, layout_type>,
                "hybrid_attention: the backend's GPU engine does not model gpu_attention_engine (backend.hpp)");

  /// Binds to `cache` (which must outlive this object) and creates the GPU
  /// engine with workspaces for up to spec().max_sequences sequences per step;
  /// reserves the CPU engine's task workspace (host memory, at most
  /// options.task_workspace_reserve_bytes). Throws config_error naming the
  /// value for assist options out of range (policy.hpp, assist_options),
  /// std::bad_alloc if the workspace cannot be allocated, and what the
  /// backend's engine constructor throws; nothing is bound then.
  explicit hybrid_attention(Cache& cache, attention_options options = {})
      : cache_(&cache),
        options_(options),
        engine_(cache.backend(), cache.layout(), cache.spec().max_sequences) {
    if (options_.cpu_threads <= 0)
      options_.cpu_threads = std::max(1, int(std::thread::hardware_concurrency()) - 1);
    const assist_options& a = options_.assist;
    auto unit = [](double v) { return v >= 0.0 && v <= 1.0; };
    if (!unit(a.fixed_fraction) || !unit(a.max_pinned_fraction) || !(a.rate_smoothing > 0.0 && a.rate_smoothing <= 1.0))
      throw config_error("attention_options::assist: fixed_fraction " + detail::format_double(a.fixed_fraction) +
                         " and max_pinned_fraction " + detail::format_double(a.max_pinned_fraction) +
                         " must lie in [0, 1], rate_smoothing " + detail::format_double(a.rate_smoothing) +
                         " in (0, 1]");
    auto rate = [](double v) { return v >= 0.0 && std::isfinite(v); };
    if (!rate(a.initial_cpu_seconds_per_token) || !rate(a.initial_gpu_seconds_per_token))
      throw config_error("attention_options::assist: initial per-token times (" +
                         detail::format_double(a.initial_cpu_seconds_per_token) + ", " +
                         detail::format_double(a.initial_gpu_seconds_per_token) + " s) must be finite and >= 0");
    if (!rate(a.resident_seconds_per_token))
      throw config_error("attention_options::assist: resident_seconds_per_token " +
                         detail::format_double(a.resident_seconds_per_token) + " s must be finite and >= 0");
    assist_cpu_rate_ = a.initial_cpu_seconds_per_token;
    assist_gpu_rate_ = a.initial_gpu_seconds_per_token;
    reserve_task_workspace();
    if (options_.sparse.reserve) reserve_sparse();
    // an engine with a split-K path for the HBM-resident region (cuda_backend,
    // set_resident_kernel): its workspace for the most eviction batches of the
    // region a step can attend, the region's
    if constexpr (requires(engine_type& e) { e.reserve_resident_items(index_t{0}); }) {
      const partition_spec& sp = cache.spec();
      if (sp.hbm_capacity_batches() > 0) engine_.reserve_resident_items(sp.hbm_capacity_batches());
    }
  }

  /// Attends `layer` for the batch `seqs` (distinct live sequences, ragged).
  ///   q        [batch][Hq][q_dim] fp32, activation space (MLA: absorbed q')
  ///   scale    softmax scale applied to q·k (the caller's; DeepSeek: incl. mscale²)
  ///   out      [batch][Hq][v_dim] fp32 (+ optional LSE [batch][Hq]), activation space
  /// Throws shape_error / state_error (before any work) for bad input. Feeds
  /// the measured costs to the cache's policy. With attention_options::assist
  /// the CPU engine also attends each sequence's newest pinned blocks in place
  /// (step_report::assist_tokens; cuda_backend: after waiting for pinned
  /// evictions still landing) and the GPU streams the rest. A batch with no
  /// unpinned block and no assisted block is an all-GPU step
  /// (attention_options::all_gpu_steps; step_report::cpu_side false): no CPU
  /// side, and on cuda_backend the call returns without waiting for the device
  /// (docs/CUDA-ENGINE.md, "All-GPU steps", for the two bounds on that).
  step_report step(int layer, std::span<const sequence_id> seqs, mem_span<const float, activation_space> q,
                   float scale, const step_outputs<activation_space>& out) {
    const auto t_start = std::chrono::steady_clock::now();
    const int batch = int(seqs.size());
    validate(layer, seqs, q, scale, out);
    complete_deferred_writes();

    const layer_views<layout_type> v = cache_->views(layer);
    const partition_spec& spec = cache_->spec();
    const index_t block_elems = v.format.block_elems();

    // 0. CPU assist: the newest assist_blocks_[i] pinned blocks of sequence i go to the CPU engine
    choose_assist(v, seqs);
    // 1. stream plan over the rest; 2-5. D-window, GPU launch, CPU side, merge, feedback
    plan_.build(
        batch,
        [&](int i) {
          const auto& pinned = v.sequences[std::size_t(seqs[std::size_t(i)])].pinned_blocks;
          return std::span<const block_id>(pinned.data(), pinned.size() - std::size_t(assist_blocks_[std::size_t(i)]));
        },
        [&](block_id id) { return v.pinned.block(id); }, block_elems, v.ping_pong_blocks, spec.gpu_split_blocks,
        int(v.ping_pong.size()), v.first_chunk_blocks);
    plan_.add_resident(
        batch,
        [&](int i) {
          const auto& hbm = v.sequences[std::size_t(seqs[std::size_t(i)])].hbm_blocks;
          return std::span<const block_id>(hbm.data(), hbm.size());
        },
        spec.gpu_split_blocks, spec.window_blocks(), resident_group_blocks(spec));
    // An all-GPU step (no unpinned block in the batch, no assist): no CPU side,
    // so the host never waits for the device within the step.
    bool cpu_side = assisting_ || !options_.all_gpu_steps;
    for (int i = 0; i < batch && !cpu_side; ++i)
      cpu_side = !v.sequences[std::size_t(seqs[std::size_t(i)])].cpu_blocks.empty();
    step_report rep;
    launch_cpu_merge(v, layer, seqs, q, scale, out, t_start, rep, cpu_side,
                     [&] { build_cpu_tasks(v, seqs, rep); });
    return rep;
  }

  /// Sparse step (paper §4.4; docs/SPARSE.md): attends `layer` for `seqs`
  /// like step() above, but only over the placed blocks `selector` chooses per
  /// (sequence, KV head), plus every sequence's whole D-window — exactly (the
  /// output is full attention restricted to those tokens). Per step:
  ///   1. queries to the host (cuda_backend: a synchronous D2H copy of q,
  ///      ordered after the caller stream — the selector needs them);
  ///   2. summaries of blocks placed since this layer's last sparse step
  ///      (block_summary_store::update; waits for pending host writes first);
  ///   3. selector.select(...) per sequence with placed blocks, validated
  ///      (shape_error for a block outside [0, placed blocks), before any work);
  ///   4. GPU side: the selected pinned blocks (union over the KV heads) in
  ///      splits of gpu_split_blocks, chunks with short runs gathered into
  ///      staging and moved as one copy each, or pulled by a device copy kernel
  ///      (sparse_options::transfer; stream_plan::build_sparse), each split
  ///      attended per KV head over its own blocks; the whole D-window;
  ///   5. CPU side: tasks of cpu_task_blocks selected unpinned blocks per
  ///      (sequence, KV head), in place;
  ///   6. merge, and the policy observes the selected volumes (step_report).
  /// With select_all the output is bit-identical to step(). Task and split
  /// boundaries depend only on each sequence's own selection (K10). The first
  /// sparse step reserves the pipeline unless attention_options::sparse.reserve.
  /// Throws what step() throws, config_error for more than 64 KV heads,
  /// state_error for a sequence with blocks in the HBM-resident region (the
  /// sparse path does not attend them: its summaries and gathers read host
  /// blocks), and whatever the selector throws (before any work); the reservation's errors
  /// (see reserve_sparse()); cuda_backend with sparse_transfer::device_pull:
  /// pinned_memory_error, before any work, for a block to pull outside the
  /// page-locked ranges.
  template <class Selector>
    requires block_selector<Selector, layout_type>
  step_report step(int layer, std::span<const sequence_id> seqs, mem_span<const float, activation_space> q,
                   float scale, const step_outputs<activation_space>& out, Selector& selector) {
    const auto t_start = std::chrono::steady_clock::now();
    const layout_type& L = cache_->layout();
    const int batch = int(seqs.size());
    const int hkv = L.kv_heads();
    validate(layer, seqs, q, scale, out);
    complete_deferred_writes();
    if (hkv > max_sparse_kv_heads)
      throw config_error("step: a sparse step supports at most " + std::to_string(max_sparse_kv_heads) +
                         " KV heads; the layout has " + std::to_string(hkv));
    for (const sequence_id s : seqs)
      if (const index_t n = cache_->sequence(s).hbm_placed_tokens; n > 0)
        throw state_error("step: a sparse step over sequence " + std::to_string(s) + ", which has " +
                          std::to_string(n) +
                          " tokens in the HBM-resident region: the sparse path attends host-placed blocks only "
                          "(use the dense step, or partition_spec::hbm_capacity_tokens = 0 for sparse decoding)");
    reserve_sparse();

    const layer_views<layout_type> v = cache_->views(layer);
    const partition_spec& spec = cache_->spec();
    const index_t block_elems = v.format.block_elems();
    const int bt = spec.block_tokens;
    step_report rep;

    // 1-3. queries on the host, summaries of new blocks, the selection
    const float* sel_q = selection_queries(q, index_t(batch) * L.num_q_heads() * layout_type::q_dim);
    summaries_.update(v, seqs, options_.cpu_threads, [&] { cache_->backend().synchronize_host_writes(); });
    selection_.clear();
    for (int i = 0; i < batch; ++i) {
      const sequence_state& st = v.sequences[std::size_t(seqs[std::size_t(i)])];
      const index_t n = index_t(st.block_table.size());
      sel_out_.reset(hkv, n);
      if (n > 0) {
        selection_input<layout_type> in;
        in.layout = &L;
        in.layer = layer;
        in.batch_index = i;
        in.seq = seqs[std::size_t(i)];
        in.placed_blocks = n;
        in.block_tokens = bt;
        in.q = sel_q + index_t(i) * L.num_q_heads() * layout_type::q_dim;
        in.scale = scale;
        in.blocks = std::span<const block_ref>(st.block_table);
        in.summaries = &summaries_;
        in.views = &v;
        selector.select(in, sel_out_);
      }
      selection_.append(seqs[std::size_t(i)], n, sel_out_);
      rep.placed_blocks += n;
    }
    rep.select_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

    // 4. sparse stream plan over each sequence's selected pinned blocks + D-window refs
    sel_pinned_.clear();
    sel_pinned_begin_.assign(1, 0);
    for (int i = 0; i < batch; ++i) {
      const sequence_state& st = v.sequences[std::size_t(seqs[std::size_t(i)])];
      const std::span<const std::uint64_t> masks = selection_.masks(i);
      for (std::size_t b = 0; b < masks.size(); ++b) {
        if (masks[b] == 0) continue;
        ++rep.selected_blocks;
        if (st.block_table[b].region == placement::gpu_load) sel_pinned_.push_back({st.block_table[b].id, masks[b]});
      }
      sel_pinned_begin_.push_back(index_t(sel_pinned_.size()));
    }
    const index_t bb = v.format.block_bytes();
    const index_t direct = options_.sparse.direct_run_bytes;
    const index_t direct_blocks = direct <= 0 ? 0 : direct / bb + (direct % bb != 0 ? 1 : 0);
    plan_.build_sparse(
        batch,
        [&](int i) {
          const index_t b0 = sel_pinned_begin_[std::size_t(i)];
          return std::span<const sparse_block>(sel_pinned_.data() + b0,
                                               std::size_t(sel_pinned_begin_[std::size_t(i) + 1] - b0));
        },
        [&](block_id id) { return v.pinned.block(id); }, block_elems, v.ping_pong_blocks, spec.gpu_split_blocks,
        int(v.ping_pong.size()), hkv, direct_blocks, v.first_chunk_blocks);
    // 4-7. D-window, GPU launch, CPU side over the selected unpinned blocks,
    // merge, and the policy observes the selected volumes (A and B stay per
    // attended token)
    assist_blocks_.assign(std::size_t(batch), 0);  // a sparse step never assists
    assisting_ = false;
    launch_cpu_merge(v, layer, seqs, q, scale, out, t_start, rep, true,
                     [&] { build_sparse_cpu_tasks(v, seqs, rep); });
    return rep;
  }

  /// Reserves the sparse pipeline now (the summary store's address space, the
  /// engine's staging buffers, block lists and gather threads); a no-op once
  /// done. Called by the constructor when attention_options::sparse.reserve,
  /// else by the first sparse step. Throws resource_error / pinned_memory_error;
  /// config_error for sparse.pull_ctas < 1, and (cuda_backend, device_pull) for
  /// a device that cannot address page-locked memory through host pointers or
  /// a block size that is not a multiple of 16 bytes.
  void reserve_sparse() {
    const layout_type& L = cache_->layout();
    const partition_spec& spec = cache_->spec();
    if (!sparse_reserved_ && options_.sparse.pull_ctas < 1)
      throw config_error("attention_options::sparse.pull_ctas is " + std::to_string(options_.sparse.pull_ctas) +
                         "; it must be >= 1 (CTAs of one pull-kernel launch)");
    if (!summaries_.reserved()) summaries_.reserve(L, spec);
    if (!sparse_reserved_) {
      const bool pull = options_.sparse.transfer == sparse_transfer::device_pull;
      sparse_reservation r;
      r.chunk_blocks = spec.ping_pong_blocks(L);
      r.block_bytes = cache_->format().block_bytes();
      r.buffers = spec.ping_pong_buffers;
      r.kv_heads = L.kv_heads();
      r.gather_threads = pull ? 1 : std::max(1, options_.sparse.gather_threads);  // pull: block lists only
      r.device_pull = pull;
      r.pull_ctas = options_.sparse.pull_ctas;
      engine_.reserve_sparse(r);
      sparse_reserved_ = true;
    }
  }

  [[nodiscard]] const attention_options& options() const noexcept { return options_; }
  /// Tasks the CPU engine's partial workspace holds now (see
  /// attention_options::task_workspace_reserve_bytes).
  [[nodiscard]] index_t task_workspace_tasks() const noexcept { return task_capacity_; }
  /// adaptive assist's smoothed per-token times (seconds per KV token; 0 until measured).
  [[nodiscard]] double assist_cpu_seconds_per_token() const noexcept { return assist_cpu_rate_; }
  [[nodiscard]] double assist_gpu_seconds_per_token() const noexcept { return assist_gpu_rate_; }
  [[nodiscard]] const stream_plan& last_plan() const noexcept { return plan_; }
  /// The validated selection of the last sparse step (batch order).
  [[nodiscard]] const step_selection& last_selection() const noexcept { return selection_; }
  /// The block summaries of the sparse steps.
  [[nodiscard]] const block_summary_store<layout_type>& summaries() const noexcept { return summaries_; }
  /// The GPU engine (diagnostics: gather statistics, reservations).
  [[nodiscard]] engine_type& engine() noexcept { return engine_; }

 private:
  /// The resident groups' cap in blocks (stream_plan::add_resident) for an
  /// engine with a split-K path over the HBM-resident region
  /// (reserve_resident_items); 0, no groups, for the others.
  [[nodiscard]] static index_t resident_group_blocks(const partition_spec& spec) noexcept {
    if constexpr (requires(engine_type& e) { e.reserve_resident_items(index_t{0}); }) {
      const index_t cap_tokens = layout_type::is_mla ? stream_plan::resident_group_max_tokens_mla
                                                     : stream_plan::resident_group_max_tokens_gqa;
      return std::max<index_t>(1, cap_tokens / spec.block_tokens);
    } else {
      return 0;
    }
  }

  // Host blocks the CPU engine may read were written by deferred pageable
  // prefill writes (cuda_backend::set_deferred_host_writes): finish them first.
  void complete_deferred_writes() { cache_->backend().complete_host_writes(); }

  // The common part of both steps once plan_ holds the stream plan: the
  // D-window references, the GPU launch (asynchronous), the CPU side
  // concurrently (build_tasks() fills tasks_; the clock starts after the wait
  // for the step's queries: an asynchronous engine copies them after the
  // caller's earlier work, and A must not absorb the GPU side's time), the
  // merge, and the policy's cost sample. Adds to `rep`. `cpu_side` false (the
  // dense step of a batch without unpinned blocks or assist): the engine skips
  // the query copy and the CPU partial (gpu_step_args::cpu_side), and so does
  // the host: no wait for the queries, no CPU engine run.
  template <class BuildTasks>
  void launch_cpu_merge(const layer_views<layout_type>& v, int layer, std::span<const sequence_id> seqs,
                        mem_span<const float, activation_space> q, float scale,
                        const step_outputs<activation_space>& out, std::chrono::steady_clock::time_point t_start,
                        step_report& rep, bool cpu_side, BuildTasks&& build_tasks) {
    const int batch = int(seqs.size());
    windows_.resize(std::size_t(batch));
    for (int i = 0; i < batch; ++i) {
      const sequence_state& st = v.sequences[std::size_t(seqs[std::size_t(i)])];
      windows_[std::size_t(i)] = {v.window_region(st.window_slot), st.window_tokens[std::size_t(layer)]};
      rep.window_tokens += st.window_tokens[std::size_t(layer)];
    }

    gpu_step_args<layout_type, activation_space> args;
    args.format = v.format;
    args.softmax_scale = scale;
    args.batch = batch;
    args.q = q;
    args.plan = &plan_;
    args.resident = v.hbm;
    args.windows = windows_;
    args.ping_pong = v.ping_pong;
    args.poison_workspaces = options_.poison_workspaces;
    if (!cpu_side) {  // no task (the batch has nothing for the CPU engine), checked before any work
      build_tasks();
      if (WS_DEBUG_CHECKS() && !tasks_.empty())
        throw state_error("hybrid_attention: an all-GPU step built " + std::to_string(tasks_.size()) + " CPU tasks");
    }
    args.cpu_side = cpu_side;
    rep.cpu_side = cpu_side;
    engine_.launch(args);
    const auto t_launched = std::chrono::steady_clock::now();
    rep.launch_seconds = std::chrono::duration<double>(t_launched - t_start).count();

    auto t_cpu_done = t_launched;
    if (cpu_side) {
      const float* host_q = engine_.host_queries();
      if (assisting_)  // pinned blocks the CPU reads may still be landing (asynchronous D2H)
        cache_->backend().synchronize_host_writes();
      const auto t_cpu = std::chrono::steady_clock::now();
      rep.query_wait_seconds = std::chrono::duration<double>(t_cpu - t_launched).count();
      build_tasks();
      run_cpu_side(v, batch, host_q, scale);
      t_cpu_done = std::chrono::steady_clock::now();
      rep.cpu_seconds = std::chrono::duration<double>(t_cpu_done - t_cpu).count();
    }

    rep.gpu_seconds = engine_.finish(out);
    rep.streamed_tokens = plan_.streamed_blocks * cache_->spec().block_tokens;
    rep.resident_tokens = plan_.resident_blocks * cache_->spec().block_tokens;
    rep.copies = index_t(plan_.runs.size());
    rep.chunks = index_t(plan_.chunks.size());
    rep.cpu_tasks = int(tasks_.size());
    rep.gather_seconds = engine_.last_gather().seconds;  // zeros after a dense step
    rep.gathered_bytes = engine_.last_gather().bytes;
    rep.pulled_bytes = engine_.last_gather().pulled_bytes;

    cost_sample s;
    s.cpu_seconds = rep.cpu_seconds;
    s.cpu_tokens = rep.cpu_tokens;
    s.gpu_seconds = rep.gpu_seconds;
    s.gpu_streamed_tokens = rep.streamed_tokens;
    s.gpu_resident_tokens = rep.resident_tokens;
    double gpu_critical = 0.0;  // the GPU side's critical seconds where the engine reports them
    bool gpu_sample_sparse = sparse_tasks_;  // whether the GPU sample is a sparse launch's
    if constexpr (engine_type::asynchronous) {
      // An asynchronous engine (cuda_backend) times an earlier launch: pair
      // those seconds with that launch's streamed tokens, and send no GPU
      // sample when no launch completed since the last step (B unchanged).
      const completed_gpu_cost c = engine_.take_completed_gpu_cost();
      s.gpu_seconds = c.seconds;
      s.gpu_streamed_tokens = c.streamed_tokens;
      s.gpu_resident_tokens = c.resident_tokens;
      gpu_critical = c.critical_seconds;
      gpu_sample_sparse = c.sparse;
      // This step's enqueue (the roofline's K): host time on the CPU side's
      // path. Dense steps only: a sparse step's launch includes the selection.
      if (!sparse_tasks_) {
        s.launch_seconds = rep.launch_seconds;
        s.launch_streamed_tokens = rep.streamed_tokens;
      }
    }
    s.batch_size = batch;
    update_assist_rates(s, gpu_critical, gpu_sample_sparse);
    cache_->policy().observe(s);
    const auto t_end = std::chrono::steady_clock::now();
    rep.finish_seconds = std::chrono::duration<double>(t_end - t_cpu_done).count();
    rep.total_seconds = std::chrono::duration<double>(t_end - t_start).count();
  }

  struct cpu_task {
    int batch_index;
    int kv_head;
    index_t first_block;  // index into the sequence's cpu_blocks (sparse: into task_ids_; assisted: pinned_blocks)
    int num_blocks;
    bool pinned = false;  // assisted: blocks of the pinned load region
  };

  // Per sequence of the step, how many of its newest pinned blocks the CPU
  // engine attends (assist_blocks_), from the assist mode.
  void choose_assist(const layer_views<layout_type>& v, std::span<const sequence_id> seqs) {
    const assist_options& a = options_.assist;
    assist_blocks_.assign(seqs.size(), 0);
    assisting_ = false;
    if (a.mode == assist_mode::off) return;
    double f = a.fixed_fraction;
    if (a.mode == assist_mode::adaptive) {
      index_t cpu_tokens = 0, pinned_tokens = 0, resident_tokens = 0;
      for (sequence_id id : seqs) {
        const sequence_state& st = v.sequences[std::size_t(id)];
        cpu_tokens += index_t(st.cpu_blocks.size());
        pinned_tokens += index_t(st.pinned_blocks.size());
        resident_tokens += index_t(st.hbm_blocks.size());
      }
      // the GPU side's resident tokens: a fixed cost next to what it streams
      const double gpu_fixed = a.resident_seconds_per_token * double(resident_tokens * v.format.block_tokens);
      f = assist_balance_fraction(assist_cpu_rate_, assist_gpu_rate_, cpu_tokens * v.format.block_tokens,
                                  pinned_tokens * v.format.block_tokens, a.max_pinned_fraction, gpu_fixed);
    }
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const index_t n = index_t(v.sequences[std::size_t(seqs[i])].pinned_blocks.size());
      index_t k = std::clamp<index_t>(index_t(std::llround(f * double(n))), 0, n);
      if (a.mode == assist_mode::adaptive)  // the cap holds after rounding: the GPU keeps a share to measure
        k = std::min(k, index_t(std::floor(a.max_pinned_fraction * double(n))));
      assist_blocks_[i] = k;
      assisting_ = assisting_ || k > 0;
    }
  }

  // adaptive assist: smoothed seconds per KV token of each side. The GPU side
  // prefers the engine's critical time (from the caller's readiness to the end
  // of the attention, excluding copies that ran ahead) where it reports one,
  // less its HBM-resident tokens at assist_options::resident_seconds_per_token
  // (at least a tenth of it is kept as streaming time).
  // Dense samples only: a sparse step's volumes are selected tokens averaged
  // over heads (and an asynchronous engine's GPU sample may be an earlier launch's).
  void update_assist_rates(const cost_sample& s, double gpu_critical_seconds, bool gpu_sample_sparse) {
    if (options_.assist.mode != assist_mode::adaptive) return;
    const double w = options_.assist.rate_smoothing;
    auto blend = [w](double& rate, double sample) { rate = rate > 0.0 ? rate + w * (sample - rate) : sample; };
    if (!sparse_tasks_ && s.cpu_tokens > 0 && std::isfinite(s.cpu_seconds) && s.cpu_seconds > 0.0)
      blend(assist_cpu_rate_, s.cpu_seconds / double(s.cpu_tokens));
    double g = gpu_critical_seconds > 0.0 ? gpu_critical_seconds : s.gpu_seconds;
    if (s.gpu_resident_tokens > 0 && std::isfinite(g))
      g = std::max(0.1 * g, g - options_.assist.resident_seconds_per_token * double(s.gpu_resident_tokens));
    if (!gpu_sample_sparse && s.gpu_streamed_tokens > 0 && std::isfinite(g) && g > 0.0)
      blend(assist_gpu_rate_, g / double(s.gpu_streamed_tokens));
  }

  // Queries for the selector, on the host: the step's own q when host-readable,
  // else a synchronous copy (ordered after the caller's stream).
  const float* selection_queries(const mem_span<const float, activation_space>& q, index_t n) {
    if constexpr (activation_space::host_accessible) {
      (void)n;
      return q.data();
    } else {
      sel_q_host_.resize(std::size_t(n));
      cache_->backend().copy_to_host_sync(sel_q_host_.data(), reinterpret_cast<const std::byte*>(q.data()),
                                          n * index_t(sizeof(float)));
      return sel_q_host_.data();
    }
  }

  // Sparse CPU tasks: per (sequence, KV head), the selected unpinned blocks in
  // token order, cut into runs of cpu_task_blocks (with every block selected:
  // exactly build_cpu_tasks' tasks).
  void build_sparse_cpu_tasks(const layer_views<layout_type>& v, std::span<const sequence_id> seqs, step_report& rep) {
    tasks_.clear();
    head_task_begin_.clear();
    task_ids_.clear();
    sparse_tasks_ = true;
    const int per_task = cache_->spec().cpu_task_blocks;
    const int hkv = cache_->layout().kv_heads();
    index_t token_heads = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const sequence_state& st = v.sequences[std::size_t(seqs[i])];
      const std::span<const std::uint64_t> masks = selection_.masks(int(i));
      for (int h = 0; h < hkv; ++h) {
        head_task_begin_.push_back(int(tasks_.size()));
        const index_t first = index_t(task_ids_.size());
        for (std::size_t b = 0; b < masks.size(); ++b)
          if (((masks[b] >> h) & 1u) != 0 && st.block_table[b].region == placement::cpu_compute)
            task_ids_.push_back(st.block_table[b].id);
        const index_t n = index_t(task_ids_.size()) - first;
        token_heads += n * v.format.block_tokens;
        for (index_t b0 = 0; b0 < n; b0 += per_task)
          tasks_.push_back({int(i), h, first + b0, int(std::min<index_t>(per_task, n - b0))});
      }
    }
    head_task_begin_.push_back(int(tasks_.size()));
    rep.cpu_tokens = token_heads / hkv;
    ensure_task_workspace(index_t(tasks_.size()));
    seqs_.assign(seqs.begin(), seqs.end());
  }

  void validate(int layer, std::span<const sequence_id> seqs, const mem_span<const float, activation_space>& q,
                float scale, const step_outputs<activation_space>& out) const {
    const layout_type& L = cache_->layout();
    const index_t batch = index_t(seqs.size());
    if (layer < 0 || layer >= cache_->spec().num_layers)
      throw shape_error("step: layer " + std::to_string(layer) + " outside [0, " +
                        std::to_string(cache_->spec().num_layers) + ")");
    if (batch > cache_->spec().max_sequences)
      throw shape_error("step: batch of " + std::to_string(batch) + " sequences exceeds max_sequences " +
                        std::to_string(cache_->spec().max_sequences));
    const index_t rows = batch * L.num_q_heads();
    if (q.size() != rows * layout_type::q_dim)
      throw shape_error("step: q has " + std::to_string(q.size()) + " elements, expected batch*Hq*q_dim = " +
                        std::to_string(rows * layout_type::q_dim));
    if (out.out.size() != rows * layout_type::v_dim)
      throw shape_error("step: out has " + std::to_string(out.out.size()) + " elements, expected batch*Hq*v_dim = " +
                        std::to_string(rows * layout_type::v_dim));
    if (!out.lse.empty() && out.lse.size() != rows)
      throw shape_error("step: lse has " + std::to_string(out.lse.size()) + " elements, expected batch*Hq = " +
                        std::to_string(rows));
    if (!(std::isfinite(scale) && scale > 0.0f))
      throw config_error("step: softmax scale " + std::to_string(scale) + " must be finite and positive");
    cache_->check_batch(seqs, layer, "step");
  }

  void build_cpu_tasks(const layer_views<layout_type>& v, std::span<const sequence_id> seqs, step_report& rep) {
    tasks_.clear();
    head_task_begin_.clear();
    sparse_tasks_ = false;
    const int per_task = cache_->spec().cpu_task_blocks;
    const int hkv = cache_->layout().kv_heads();
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const sequence_state& st = v.sequences[std::size_t(seqs[i])];
      const index_t n = index_t(st.cpu_blocks.size());
      const index_t k = assist_blocks_[i];  // the newest k pinned blocks
      const index_t p0 = index_t(st.pinned_blocks.size()) - k;
      rep.cpu_tokens += (n + k) * v.format.block_tokens;
      rep.assist_tokens += k * v.format.block_tokens;
      for (int h = 0; h < hkv; ++h) {
        head_task_begin_.push_back(int(tasks_.size()));
        for (index_t b0 = 0; b0 < n; b0 += per_task)
          tasks_.push_back({int(i), h, b0, int(std::min<index_t>(per_task, n - b0))});
        for (index_t b0 = 0; b0 < k; b0 += per_task)
          tasks_.push_back({int(i), h, p0 + b0, int(std::min<index_t>(per_task, k - b0)), true});
      }
    }
    head_task_begin_.push_back(int(tasks_.size()));
    ensure_task_workspace(index_t(tasks_.size()));
    seqs_.assign(seqs.begin(), seqs.end());
  }

  void run_cpu_side(const layer_views<layout_type>& v, int batch, const float* q, float scale) {
    const layout_type& L = cache_->layout();
    const int group = L.group_size();
    const int hq = L.num_q_heads();
    const int hkv = L.kv_heads();
    constexpr int V = layout_type::v_dim;
    constexpr int Q = layout_type::q_dim;
    host_partial_view<float> cpu = engine_.cpu_partial(batch);
    const int ntasks = int(tasks_.size());
    const int npairs = batch * hkv;
    const auto& seqs = seqs_;
    const auto& tasks = tasks_;
    auto run_task = [&](int t) {
      thread_local std::vector<cpu::kv_segment> segs;
      const cpu_task& task = tasks[std::size_t(t)];
      const sequence_state& st = v.sequences[std::size_t(seqs[std::size_t(task.batch_index)])];
      segs.clear();
      if (task.pinned) {  // CPU assist: pinned blocks, read in place (the same block format)
        const block_id* ids = st.pinned_blocks.data() + task.first_block;
        for (int b = 0; b < task.num_blocks; ++b) segs.push_back({v.pinned.block(ids[b]), v.format.block_tokens});
      } else {
        const block_id* ids = (sparse_tasks_ ? task_ids_.data() : st.cpu_blocks.data()) + task.first_block;
        for (int b = 0; b < task.num_blocks; ++b) segs.push_back({v.cpu.block(ids[b]), v.format.block_tokens});
      }
      const std::size_t row0 = std::size_t(task.batch_index) * std::size_t(hq) + std::size_t(task.kv_head) * group;
      CpuKernel::run(v.format, task.kv_head, q + row0 * Q, Q, group, scale, segs,
                     task_o_ + std::size_t(t) * group * V, V, task_lse_ + std::size_t(t) * group);
    };
    auto merge_pair = [&](int p) {  // (sequence, kv head): fold its tasks in order
      const int i = p / hkv;
      const int h = p % hkv;
      const int t0 = head_task_begin_[std::size_t(p)];
      const int t1 = head_task_begin_[std::size_t(p) + 1];
      for (int g = 0; g < group; ++g) {
        float* o = cpu.o_row(i, h * group + g);
        float& lse = cpu.lse_at(i, h * group + g);
        std::fill(o, o + V, 0.0f);
        lse = empty_lse;
        for (int t = t0; t < t1; ++t)
          merge_state_row(o, lse, task_o_ + (std::size_t(t) * group + g) * V,
                          task_lse_[std::size_t(t) * group + g], o, &lse, V);
      }
    };
#if defined(_OPENMP)
#  pragma omp parallel num_threads(options_.cpu_threads)
    {
#  pragma omp for schedule(dynamic, 1)
      for (int t = 0; t < ntasks; ++t) run_task(t);
#  pragma omp for schedule(static)
      for (int p = 0; p < npairs; ++p) merge_pair(p);
    }
#else
    for (int t = 0; t < ntasks; ++t) run_task(t);
    for (int p = 0; p < npairs; ++p) merge_pair(p);
#endif
  }

  // The task partials' workspace at the size of the spec's capacities (capped
  // by task_workspace_reserve_bytes), touched now by the CPU engine's threads:
  // a first decode step (and a step after an eviction that adds tasks) would
  // otherwise fault in tens of MB on the decode path (docs/DECISIONS.md).
  void reserve_task_workspace() {
    const partition_spec& spec = cache_->spec();
    const index_t per_task = std::max(1, spec.cpu_task_blocks);
    index_t blocks = spec.cpu_capacity_blocks();
    if (options_.assist.mode != assist_mode::off) blocks += spec.pinned_capacity_blocks();
    const index_t tasks = (blocks / per_task + 2 * index_t(spec.max_sequences)) * cache_->layout().kv_heads();
    const index_t task_bytes = task_stride() * index_t(sizeof(float));
    ensure_task_workspace(std::min(tasks, options_.task_workspace_reserve_bytes / std::max<index_t>(task_bytes, 1)));
  }

  // Elements of one task's partial outputs + LSEs.
  [[nodiscard]] index_t task_stride() const noexcept {
    return index_t(cache_->layout().group_size()) * (layout_type::v_dim + 1);
  }

  // Grows (never shrinks) the task workspace to `tasks` tasks, by at least half
  // its size, uninitialized; the new pages are touched by the CPU engine's
  // threads together, so their faults are spread instead of taken one by one
  // by whichever task writes first.
  void ensure_task_workspace(index_t tasks) {
    if (tasks <= task_capacity_) return;
    const index_t cap = std::max(tasks, task_capacity_ + task_capacity_ / 2);
    const index_t g = cache_->layout().group_size();
    const index_t elems = cap * task_stride();
    std::unique_ptr<float[]> buf(new float[std::size_t(elems)]);  // default-initialized: no zeroing pass
    constexpr index_t page_floats = 4096 / index_t(sizeof(float));
    float* const p = buf.get();
    const index_t pages = (elems + page_floats - 1) / page_floats;
#if defined(_OPENMP)
#  pragma omp parallel for schedule(static) num_threads(options_.cpu_threads) if (pages > 64)
#endif
    for (index_t i = 0; i < pages; ++i) p[i * page_floats] = 0.0f;
    task_buf_ = std::move(buf);
    task_capacity_ = cap;
    task_o_ = task_buf_.get();
    task_lse_ = task_o_ + cap * g * layout_type::v_dim;
  }

  Cache* cache_;
  attention_options options_;
  engine_type engine_;
  stream_plan plan_;
  std::vector<window_ref<layout_type>> windows_;
  std::vector<cpu_task> tasks_;
  std::vector<int> head_task_begin_;
  std::unique_ptr<float[]> task_buf_;  // [capacity][group][v_dim] partials, then [capacity][group] LSEs
  index_t task_capacity_ = 0;
  float* task_o_ = nullptr;
  float* task_lse_ = nullptr;
  std::vector<sequence_id> seqs_;
  // CPU assist
  std::vector<index_t> assist_blocks_;  // per sequence of the step: its newest pinned blocks the CPU attends
  bool assisting_ = false;
  double assist_cpu_rate_ = 0.0, assist_gpu_rate_ = 0.0;  // adaptive: smoothed seconds per KV token
  // Sparse steps
  bool sparse_tasks_ = false;        // tasks_ index task_ids_ (sparse) or each sequence's cpu_blocks (dense)
  std::vector<block_id> task_ids_;
  bool sparse_reserved_ = false;
  block_summary_store<layout_type> summaries_;
  block_selection sel_out_;
  step_selection selection_;
  std::vector<sparse_block> sel_pinned_;
  std::vector<index_t> sel_pinned_begin_;
  std::vector<float> sel_q_host_;
};

}  // namespace writescope
