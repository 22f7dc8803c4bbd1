// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/dense_engine.hpp — the step machinery of
// basic_cuda_backend::gpu_engine<Layout> (paper §4.2; docs/CUDA-ENGINE.md):
// workspaces, the engine's streams and events, the phases every launch runs
// (begin_step, attend_chunk, end_step), the dense chunk loop (on the calling
// thread or the launcher thread), the final merge and the GPU-side timing. The
// sparse pipeline (sparse_engine.hpp) runs its chunks through the same phases.
// Host compiler only.
//
// Per dense launch, on the engine's compute stream unless noted:
//   q D2H into pinned staging (q stream, after the caller's event);
//   streamed state := empty;
//   resident splits (blocks of the HBM-resident region, written on the caller
//   stream before the launch: the caller event orders them, K7): attended in
//   place with the dense kernel, max_attend_items per launch, each launch
//   folded in order into the streamed state — before the first chunk's
//   attention, while its H2D copy runs;
//   for each plan chunk c, buffer b = chunk.buffer:
//     h2d: wait consumed[b]; copy the chunk's runs into ping-pong[b] (one copy
//          per piece of the Hooks' copy policy); record filled[b]
//     compute: wait filled[b]; attend the chunk's splits (per-split partials);
//              record consumed[b]; fold the partials into each sequence's
//              running streamed state, in split order
//   record h2d_done on h2d (C9); D-window attention (only the valid rows are read);
// merge(): CPU partial H2D, then on the caller stream
//   out = (streamed ⊕ D-window) ⊕ CPU  (merge_state_row semantics), the
//   streamed state holding the HBM-resident splits folded first.
// An all-GPU launch (gpu_step_args::cpu_side false) skips the q D2H and the
// CPU partial's H2D and merges without it (an empty partial is an identity),
// so that the step does not make the host wait for the device (the resident
// kernels' table ring aside: a host more than its slots ahead waits there).
// An all-GPU launch that streams nothing (no plan chunk) and whose resident
// splits and D-windows fit one attention launch runs on the caller stream
// instead (launch_on_caller; set_caller_stream_steps): init, one attention
// launch over the resident splits then the D-windows, one fold of the
// resident splits; merge() reads the D-window partials from the split
// workspace. Same kernels, same merge order, same bits; no event waited on.
//
// Shapes: partial states are fp32, [max_batch][Hq][v_dim] and [max_batch][Hq]
// (device); the split workspace holds gpu::max_attend_items splits; q staging
// is [max_batch][Hq][q_dim] fp32 and the CPU partial [max_batch][Hq][v_dim] /
// [max_batch][Hq] fp32, both page-locked. Everything is allocated at
// construction; a launch allocates nothing (ablation per_step_allocation aside)
// and never blocks the host. Threads: the driving thread, and between post and
// join the launcher thread (the chunk loop and end_step only). Errors:
// resource_error / pinned_memory_error at construction; shape_error /
// config_error from validate(); pinned_memory_error (debug builds) for a
// pageable H2D source; cuda_error for a failing CUDA call.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../backend.hpp"
#include "../config.hpp"
#include "../error.hpp"
#include "../host_memory.hpp"
#include "../layout.hpp"
#include "../memory_space.hpp"
#include "../partial_state.hpp"
#include "../stream_plan.hpp"
#include "context.hpp"
#include "cuda_error.hpp"
#include "handles.hpp"
#include "hooks.hpp"
#include "kernels.hpp"
#include "launch_thread.hpp"
#include "pinned_allocators.hpp"

namespace writescope::cuda_detail {

template <kv_layout Layout, cuda_hooks Hooks>
class dense_engine {
 public:
  using args_type = gpu_step_args<Layout, device_space>;
  using switches = typename Hooks::switches;
  using ablation = typename Hooks::ablation;
  static constexpr int Q = Layout::q_dim;
  static constexpr int V = Layout::v_dim;

  dense_engine(backend_context<Hooks>& ctx, const Layout& layout, int max_batch)
      : ctx_(&ctx), layout_(layout), max_batch_(std::max(max_batch, 0)), hq_(layout.num_q_heads()), launcher_(ctx.pending) {
    const index_t rows = index_t(max_batch_) * hq_;
    const index_t split_rows = index_t(gpu::max_attend_items) * hq_;
    streamed_o_ = allocate_device_buffer(rows * V * 4, "streamed partial state");
    streamed_lse_ = allocate_device_buffer(rows * 4, "streamed partial state");
    window_o_ = allocate_device_buffer(rows * V * 4, "D-window partial state");
    window_lse_ = allocate_device_buffer(rows * 4, "D-window partial state");
    cpu_o_ = allocate_device_buffer(rows * V * 4, "CPU partial state");
    cpu_lse_ = allocate_device_buffer(rows * 4, "CPU partial state");
    split_o_ = allocate_device_buffer(split_rows * V * 4, "split partial workspace");
    split_lse_ = allocate_device_buffer(split_rows * 4, "split partial workspace");
    q_host_ = allocate_page_locked(rows * Q * 4);
    cpu_o_host_ = allocate_page_locked(rows * V * 4);
    cpu_lse_host_ = allocate_page_locked(rows * 4);
    compute_ = unique_stream::create();
    qstream_ = unique_stream::create();
    launch_ev_ = unique_event::create();
    q_done_ = unique_event::create();
    compute_done_ = unique_event::create();
    cpu_h2d_done_ = unique_event::create();
    for (int b = 0; b < max_ping_pong_buffers; ++b) {
      filled_[std::size_t(b)] = unique_event::create();
      consumed_[std::size_t(b)] = unique_event::create();
    }
    for (int s = 0; s < 2; ++s) {
      t_start_[std::size_t(s)] = unique_event::create(true);
      t_ready_[std::size_t(s)] = unique_event::create(true);
      t_end_[std::size_t(s)] = unique_event::create(true);
    }
  }
  dense_engine(const dense_engine&) = delete;
  dense_engine& operator=(const dense_engine&) = delete;
  ~dense_engine() {
    launcher_.stop();
    free_step_buffers();
  }

  [[nodiscard]] backend_context<Hooks>& context() const noexcept { return *ctx_; }
  [[nodiscard]] cudaStream_t compute() const noexcept { return compute_.get(); }
  [[nodiscard]] const unique_event& filled(std::size_t b) const noexcept { return filled_[b]; }
  [[nodiscard]] const unique_event& consumed(std::size_t b) const noexcept { return consumed_[b]; }
  [[nodiscard]] bool last_sparse() const noexcept { return last_sparse_; }
  /// A launch (dense or sparse) of `batch` sequences is under way.
  void mark_launched(int batch, bool sparse) noexcept {
    batch_ = batch;
    launched_ = true;
    last_sparse_ = sparse;
  }

  // --- the launcher thread ---------------------------------------------------

  [[nodiscard]] bool launch_pending() const noexcept { return launcher_.pending(); }
  void join_launch() { launcher_.join(); }
  void stop_launcher() noexcept { launcher_.stop(); }

  // --- dense launch ----------------------------------------------------------

  /// Steps 0-4 of a dense launch (after validate): the chunk loop and end_step
  /// on the launcher thread when the backend has it on (set_launch_thread) and
  /// the ablation allocates nothing per step, else here.
  void launch(const args_type& a, const switches& dbg) {
    last_sparse_ = false;
    const ablation abl = ctx_->ablation;
    if (abl.per_step_allocation) allocate_step_buffers(*a.plan, a.ping_pong.size(), a.format.block_bytes());
    mark_launched(a.batch, false);
    if (caller_stream_step(a, dbg, abl)) {  // an all-GPU step with nothing to stream: one stream, no events
      launch_on_caller(a);
      return;
    }

    // 0-2. Caller event, q to the CPU engine, stream ordering, workspaces.
    const int slot = begin_step(a, dbg);

    // 3-4. On the launcher thread (set_launch_thread), or here.
    if (ctx_->launch_thread && !abl.per_step_allocation && post_launch(a, dbg, abl, slot)) return;
    run_chunks(a, dbg, abl);
    end_step(a, slot);
  }

  // --- the caller-stream step -----------------------------------------------

  /// Whether launch() takes the caller-stream path: an all-GPU step
  /// (gpu_step_args::cpu_side false) whose plan streams nothing (no chunk)
  /// and whose HBM-resident splits and D-windows fit one attention launch
  /// (max_attend_items items, one fold segment per sequence), with the
  /// backend's switch on (set_caller_stream_steps), the resident kernels not
  /// taking the step, no per-step allocation (ablation) and none of the
  /// mutation switches that concern these kernels.
  [[nodiscard]] bool caller_stream_step(const args_type& a, const switches& dbg, const ablation& abl) const {
    if (!ctx_->caller_stream_steps || a.cpu_side || abl.per_step_allocation) return false;
    if (dbg.skip_caller_event || dbg.consumer_delay_cycles > 0) return false;
    const stream_plan& plan = *a.plan;
    if (plan.sparse || !plan.chunks.empty() || !plan.runs.empty()) return false;
    const index_t items = index_t(plan.resident_splits.size()) + index_t(a.batch);
    if (items > index_t(gpu::max_attend_items) || a.batch > gpu::max_fold_segments) return false;
    const bool resident_kernel = ctx_->resident_kernel && !plan.resident_groups.empty() &&
                                 index_t(plan.resident_runs.size()) <= resident_capacity_;
    return !resident_kernel;
  }

  // The caller-stream step (docs/CUDA-ENGINE.md, "Caller-stream steps"): on
  // the caller stream, after everything the caller enqueued before (the
  // appends and HBM writes of K7 included, by stream order): one attention
  // launch over the HBM-resident splits (items [0, k), in plan order) and
  // every sequence's D-window (item k + i for sequence i). merge() then runs
  // one fold_merge launch: each sequence's resident splits folded in order
  // from the empty state (written as the streamed partial), then ⊕ its
  // D-window partial (rows [k*Hq, (k+b)*Hq) of the split workspace): the
  // same merges in the same order as the two-stream path's init, fold and
  // merge kernels, so the same bits. No event is waited on and the copy
  // stream is not touched (nothing is copied from host blocks, so C9's
  // h2d_done of earlier steps stays valid).
  void launch_on_caller(const args_type& a) {
    cudaStream_t caller = ctx_->caller;
    const stream_plan& plan = *a.plan;
    const int k = int(plan.resident_splits.size());
    on_caller_ = true;
    cpu_side_ = false;
    const int slot = take_timing_slot();
    record(t_ready_[std::size_t(slot)], caller);
    record(t_start_[std::size_t(slot)], caller);
    if (a.poison_workspaces) {
      WS_CUDA_TRY(cudaMemsetAsync(split_o_.data(), 0xff, static_cast<std::size_t>(split_o_.size_bytes()), caller));
      WS_CUDA_TRY(cudaMemsetAsync(split_lse_.data(), 0xff, static_cast<std::size_t>(split_lse_.size_bytes()), caller));
    }
    gpu::attend_params& ap = step_attend_params(a);
    ap.block_lists = nullptr;
    ap.out_o = split_o_.as<float>();
    ap.out_lse = split_lse_.as<float>();
    ap.num_items = k + a.batch;
    gpu::fold_params& fp = split_fold_params();
    for (int s = 0; s < k; ++s)
      add_split_item(ap, fp, s, plan.resident_splits[std::size_t(s)], a.resident, a.format.block_tokens, nullptr);
    for (int i = 0; i < a.batch; ++i) {
      const window_ref<Layout>& w = a.windows[std::size_t(i)];
      ap.items[k + i] = {w.blocks.block(0).data(), w.tokens, i, k + i, 0};
    }
    if (ap.num_items > 0) gpu::launch_attend<Layout>(ap, caller);
    window_src_o_ = split_o_.as<float>() + index_t(k) * hq_ * V;
    window_src_lse_ = split_lse_.as<float>() + index_t(k) * hq_;
    // merge()'s fold_merge: sequence i's segment (empty where it has no resident split)
    gpu::fold_merge_params& fm = fold_merge_;
    fm = {};
    fm.state_o = streamed_o_.as<float>();
    fm.state_lse = streamed_lse_.as<float>();
    fm.split_o = split_o_.as<float>();
    fm.split_lse = split_lse_.as<float>();
    fm.window_o = window_src_o_;
    fm.window_lse = window_src_lse_;
    fm.hq = hq_;
    fm.batch = a.batch;
    for (int i = 0; i < a.batch; ++i) fm.segments[i] = {i, 0, 0};
    for (int g = 0; g < fp.num_segments; ++g) fm.segments[fp.segments[g].batch_index] = fp.segments[g];
    record(t_end_[std::size_t(slot)], caller);
    close_timing_slot(slot, plan, a.format.block_tokens);
    ++caller_stream_steps_;
  }
  /// Launches that took the caller-stream path (diagnostics, tests).
  [[nodiscard]] index_t caller_stream_steps() const noexcept { return caller_stream_steps_; }

  // --- validation ------------------------------------------------------------

  /// Shapes and plan geometry (shape_error / config_error) before anything is enqueued.
  void validate(const args_type& a) const {
    if (a.batch < 0 || a.batch > max_batch_)
      throw shape_error("gpu_engine::launch: batch " + std::to_string(a.batch) + " outside [0, " +
                        std::to_string(max_batch_) + "] (max_batch of the engine)");
    if (a.plan == nullptr) throw shape_error("gpu_engine::launch: no stream plan");
    if (index_t(a.windows.size()) < a.batch)
      throw shape_error("gpu_engine::launch: " + std::to_string(a.windows.size()) + " D-window refs for a batch of " +
                        std::to_string(a.batch));
    if (a.q.size() < index_t(a.batch) * hq_ * Q)
      throw shape_error("gpu_engine::launch: q has " + std::to_string(a.q.size()) + " elements, needs " +
                        std::to_string(index_t(a.batch) * hq_ * Q));
    if (a.ping_pong.size() > std::size_t(max_ping_pong_buffers))
      throw config_error("gpu_engine::launch: " + std::to_string(a.ping_pong.size()) +
                         " ping-pong buffers; cuda_backend supports at most " +
                         std::to_string(max_ping_pong_buffers));
    if (a.format.layout.num_q_heads() != hq_ || a.format.layout.kv_heads() != layout_.kv_heads())
      throw shape_error("gpu_engine::launch: the step's layout differs from the engine's");
    for (const stream_chunk& c : a.plan->chunks)
      if (c.buffer < 0 || std::size_t(c.buffer) >= a.ping_pong.size())
        throw shape_error("gpu_engine::launch: plan chunk uses ping-pong buffer " + std::to_string(c.buffer) + " of " +
                          std::to_string(a.ping_pong.size()));
  }

  /// Debug builds (WS_DEBUG_CHECKS()): every run the copy engine DMAs from the
  /// pinned region is page-locked (pinned_memory_error otherwise), unless the
  /// pageable-source ablation allows it.
  void check_page_locked_sources(const args_type& a) const {
    if (!WS_DEBUG_CHECKS() || ctx_->debug.allow_pageable_sources) return;
    if (!a.plan->sparse) {
      for (const stream_run& r : a.plan->runs) require_page_locked(r.src.data(), r.num_blocks * a.format.block_bytes());
    } else {  // only direct chunks DMA from the region; gathered ones from staging (page-locked) or,
              // pulled, are checked in every build (sparse_pipeline::validate)
      for (const stream_chunk& c : a.plan->chunks)
        for (index_t k = c.run_begin; k < c.run_end && !c.gathered; ++k) {
          const stream_run& r = a.plan->runs[std::size_t(k)];
          require_page_locked(r.src.data(), r.num_blocks * a.format.block_bytes());
        }
    }
  }

  // --- the phases of a launch ------------------------------------------------

  // Steps 0-2 of a launch, dense or sparse: the caller's work so far recorded;
  // q copied D2H for the CPU engine after it; the compute stream after the
  // caller, the copy stream after pending D2H writes into host blocks (C9);
  // the step's start timed on the copy stream; workspaces poisoned on request;
  // the streamed state initialized; the attention parameters of the step set.
  // Returns the timing slot of the step.
  int begin_step(const args_type& a, const switches& dbg) {
    const index_t rows = index_t(a.batch) * hq_;
    cudaStream_t h2d = ctx_->h2d.get();
    cudaStream_t comp = compute_.get();
    record(launch_ev_, ctx_->caller);
    cpu_side_ = a.cpu_side;
    on_caller_ = false;
    window_src_o_ = window_o_.as<float>();
    window_src_lse_ = window_lse_.as<float>();
    if (cpu_side_) {  // an all-GPU step (gpu_step_args::cpu_side false) needs no host copy of q
      if (!dbg.skip_caller_event) wait(qstream_.get(), launch_ev_);
      if (rows > 0)
        WS_CUDA_TRY(cudaMemcpyAsync(q_host_.data(), a.q.data(), static_cast<std::size_t>(rows * Q * 4),
                                    cudaMemcpyDeviceToHost, qstream_.get()));
      record(q_done_, qstream_.get());
    }
    if (!dbg.skip_caller_event) wait(comp, launch_ev_);
    const int slot = take_timing_slot();
    record(t_ready_[std::size_t(slot)], comp);
    if (!dbg.skip_landing_wait) wait(h2d, ctx_->d2h_done);
    record(t_start_[std::size_t(slot)], h2d);
    if (a.poison_workspaces) {
      WS_CUDA_TRY(cudaMemsetAsync(split_o_.data(), 0xff, static_cast<std::size_t>(split_o_.size_bytes()), comp));
      WS_CUDA_TRY(cudaMemsetAsync(split_lse_.data(), 0xff, static_cast<std::size_t>(split_lse_.size_bytes()), comp));
      WS_CUDA_TRY(cudaMemsetAsync(window_o_.data(), 0xff, static_cast<std::size_t>(rows * V * 4), comp));
      WS_CUDA_TRY(cudaMemsetAsync(window_lse_.data(), 0xff, static_cast<std::size_t>(rows * 4), comp));
      if (resident_capacity_ > 0) {  // the resident kernels' partials: an item left unwritten shows
        WS_CUDA_TRY(cudaMemsetAsync(resident_o_.data(), 0xff, static_cast<std::size_t>(resident_o_.size_bytes()), comp));
        WS_CUDA_TRY(cudaMemsetAsync(resident_lse_.data(), 0xff, static_cast<std::size_t>(resident_lse_.size_bytes()), comp));
      }
    }
    gpu::launch_init_state<Layout>(streamed_o_.as<float>(), streamed_lse_.as<float>(), rows, comp);
    (void)step_attend_params(a);
    return slot;
  }

  // The attention parameters of the step (queries, block format, scale, heads); the
  // caller sets the items, their outputs and block lists.
  gpu::attend_params& step_attend_params(const args_type& a) {
    gpu::attend_params& ap = attend_;
    ap.q = a.q.data();
    ap.block_elems = a.format.block_elems();
    ap.scale = a.softmax_scale;
    ap.hq = hq_;
    ap.hkv = layout_.kv_heads();
    ap.group = layout_.group_size();
    ap.block_tokens = a.format.block_tokens;
    return ap;
  }

  // Split `sp` (blocks of `region`) as attention item `local` (its partial at
  // split row `local`), and into the fold: a new segment, or the previous one
  // extended when it is the same sequence's.
  static void add_split_item(gpu::attend_params& ap, gpu::fold_params& fp, int local, const stream_split& sp,
                             const device_region<Layout>& region, int block_tokens, const std::int32_t* lists) {
    ap.items[local] = {region.block(sp.first_block).data(), sp.num_blocks * block_tokens, sp.batch_index, local,
                       lists != nullptr ? int(sp.list_offset) : 0};
    if (fp.num_segments > 0 && fp.segments[fp.num_segments - 1].batch_index == sp.batch_index)
      fp.segments[fp.num_segments - 1].split_end = local + 1;
    else
      fp.segments[fp.num_segments++] = {sp.batch_index, local, local + 1};
  }

  // The fold of the split workspace into the streamed state, no segment yet.
  gpu::fold_params& split_fold_params() {
    gpu::fold_params& fp = fold_;
    fp.state_o = streamed_o_.as<float>();
    fp.state_lse = streamed_lse_.as<float>();
    fp.split_o = split_o_.as<float>();
    fp.split_lse = split_lse_.as<float>();
    fp.hq = hq_;
    fp.num_segments = 0;
    return fp;
  }

  // Step 3's compute side for one chunk in ping-pong buffer `b` (at `buf`),
  // on the compute stream after its filled event: the chunk's splits attended
  // (max_attend_items per launch; with `lists`, the listed kernel over each
  // split's block lists, else the dense one), each launch folded in order into
  // the streamed state; consumed[b] recorded after the last reader of the
  // buffer (and of its lists).
  void attend_chunk(const args_type& a, const stream_chunk& c, const device_region<Layout>& buf, std::size_t b,
                    const std::int32_t* lists,
                    const switches& dbg) {
    attend_and_fold(a.plan->splits, c.split_begin, c.split_end, buf, a.format.block_tokens, lists, dbg,
                    [&](cudaStream_t comp) { record(consumed_[b], comp); });  // last reader of buffer b (and its lists)
  }

  // Step 3a of a dense launch: the plan's resident splits (blocks of the
  // HBM-resident region `a.resident`, contiguous per split) attended in place
  // on the compute stream, max_attend_items per launch, each launch folded in
  // order into the streamed state. The compute stream waits for the caller's
  // event (begin_step), after which every write into those blocks (prefill
  // scatter, evictions by copy_blocks_on_device: both on the caller stream) is
  // complete (K7). Nothing to do for a plan without resident splits.
  // With set_resident_kernel, a reserved workspace (reserve_resident_items)
  // and a plan with resident groups (stream_plan::add_resident with
  // max_group_blocks > 0), the resident blocks instead go through the split-K
  // resident kernels, one item per group: the fold segments, the item table
  // and the items' run bases written into one slot of a page-locked ring and
  // copied to the device in one copy on the compute stream (a true
  // asynchronous copy: a pageable source may make the driver wait for the
  // stream, which would tie the host to the GPU once per layer); a slot is
  // rewritten only after the copy out of it completed (its event,
  // resident_table_slots calls back); the device table is overwritten only
  // behind the previous launch's readers on the same stream; then one
  // attention launch over every item, one fold of each sequence's items in
  // order.
  void attend_resident(const args_type& a, const switches& dbg) {
    const stream_plan& plan = *a.plan;
    const std::vector<stream_split>& rs = plan.resident_splits;
    if (rs.empty()) return;
    bool slow_consumer = false;  // mutation tests time the default path's kernel
    if constexpr (Hooks::enabled) slow_consumer = dbg.consumer_delay_cycles > 0;
    if (ctx_->resident_kernel && !plan.resident_groups.empty() &&
        index_t(plan.resident_runs.size()) <= resident_capacity_ && !slow_consumer) {
      attend_resident_split_k(a, plan.resident_groups, plan.resident_runs);
      return;
    }
    attend_and_fold(rs, 0, index_t(rs.size()), a.resident, a.format.block_tokens, nullptr, dbg, [](cudaStream_t) {});
  }

  // Table slot layout: [segments: max_batch | items: n | run bases: runs], the
  // items and bases packed right after the segments, so the used prefix is
  // one copy.
  void attend_resident_split_k(const args_type& a, const std::vector<resident_group>& gs,
                               const std::vector<block_id>& runs) {
    cudaStream_t comp = compute_.get();
    const int n = int(gs.size());
    const std::size_t slot = std::size_t(resident_table_next_);
    resident_table_next_ = (resident_table_next_ + 1) % resident_table_slots;
    if (resident_table_used_[slot]) WS_CUDA_TRY(cudaEventSynchronize(resident_table_ev_[slot].get()));
    std::byte* const base = resident_tables_host_.data() + index_t(slot) * resident_slot_bytes_;
    auto* const segs = reinterpret_cast<gpu::fold_segment*>(base);
    const index_t items_offset = resident_items_offset_;
    const index_t runs_offset = (items_offset + index_t(n) * index_t(sizeof(gpu::resident_item)) + 15) / 16 * 16;
    auto* const items = reinterpret_cast<gpu::resident_item*>(base + items_offset);
    auto* const bases = reinterpret_cast<const bf16**>(base + runs_offset);
    std::byte* const dev = static_cast<std::byte*>(resident_tables_.data());
    const auto* const dev_bases = reinterpret_cast<const bf16* const*>(dev + runs_offset);
    for (std::size_t k = 0; k < runs.size(); ++k) bases[k] = a.resident.block(runs[k]).data();
    const int bt = a.format.block_tokens;
    int segments = 0;
    for (int k = 0; k < n; ++k) {
      const resident_group& g = gs[std::size_t(k)];
      items[k] = {dev_bases + g.first_run, int(g.num_blocks * bt), g.batch_index, k, 0};
      if (segments > 0 && segs[segments - 1].batch_index == g.batch_index)
        segs[segments - 1].split_end = k + 1;
      else
        segs[segments++] = {g.batch_index, k, k + 1};
    }
    const index_t used = runs_offset + index_t(runs.size()) * index_t(sizeof(const bf16*));
    WS_CUDA_TRY(cudaMemcpyAsync(dev, base, std::size_t(used), cudaMemcpyHostToDevice, comp));
    record(resident_table_ev_[slot], comp);
    resident_table_used_[slot] = true;
    gpu::resident_attend_params p{};
    p.q = a.q.data();
    p.items = reinterpret_cast<const gpu::resident_item*>(dev + items_offset);
    p.part_o = resident_o_.as<float>();
    p.part_lse = resident_lse_.as<float>();
    p.block_elems = a.format.block_elems();
    p.scale = a.softmax_scale;
    p.hq = hq_;
    p.hkv = layout_.kv_heads();
    p.group = layout_.group_size();
    p.block_tokens = bt;
    p.run_tokens = int(a.plan->resident_run_blocks) * bt;
    p.num_items = n;
    gpu::launch_resident_attend<Layout>(p, comp);
    gpu::resident_fold_params f{};
    f.state_o = streamed_o_.as<float>();
    f.state_lse = streamed_lse_.as<float>();
    f.part_o = resident_o_.as<const float>();
    f.part_lse = resident_lse_.as<const float>();
    f.segments = reinterpret_cast<const gpu::fold_segment*>(dev);
    f.hq = hq_;
    f.num_segments = segments;
    gpu::launch_resident_fold<Layout>(f, comp);
    ++resident_kernel_launches_;
  }

  /// The resident kernels' workspace for steps that attend at most `max_runs`
  /// eviction batches of the HBM-resident region (as many resident groups at
  /// most; see basic_cuda_backend::reserve_resident_items); only with
  /// set_resident_kernel on. Construction time, not a launch: allocates.
  void reserve_resident_items(index_t max_runs) {
    if (!ctx_->resident_kernel || max_runs <= resident_capacity_) return;
    join_launch();  // a pending launch's enqueue may still read the host tables; cudaFree of the old
                    // device buffers (move-assignment below) waits for the kernels that read them
    const auto align = [](index_t b) { return (b + 255) / 256 * 256; };
    resident_o_ = allocate_device_buffer(max_runs * hq_ * V * 4, "resident partial workspace");
    resident_lse_ = allocate_device_buffer(max_runs * hq_ * 4, "resident partial workspace");
    resident_items_offset_ = align(index_t(std::max(max_batch_, 1)) * index_t(sizeof(gpu::fold_segment)));
    resident_slot_bytes_ = align(resident_items_offset_ + max_runs * index_t(sizeof(gpu::resident_item)) + 16 +
                                 max_runs * index_t(sizeof(const bf16*)));
    resident_tables_ = allocate_device_buffer(resident_slot_bytes_, "resident item table");
    // the host tables: resident_table_slots slots, page-locked (join_launch above: no enqueue reads
    // the old slots; their pending copies are waited for before the old ring goes)
    for (std::size_t i = 0; i < resident_table_slots; ++i)
      if (resident_table_used_[i]) WS_CUDA_TRY(cudaEventSynchronize(resident_table_ev_[i].get()));
    resident_tables_host_ = allocate_page_locked(resident_table_slots * resident_slot_bytes_);
    for (std::size_t i = 0; i < resident_table_slots; ++i) {
      if (!resident_table_ev_[i].get()) resident_table_ev_[i] = unique_event::create();
      resident_table_used_[i] = false;
    }
    resident_capacity_ = max_runs;
  }
  [[nodiscard]] index_t resident_kernel_launches() const noexcept { return resident_kernel_launches_; }

  // Splits [begin, end) of `splits`, whose blocks lie in `region`, attended on
  // the compute stream, max_attend_items per launch (with `lists`, the listed
  // kernel over each split's block lists, else the dense one), each launch
  // folded in order into the streamed state; `after_last_attend(stream)` runs
  // between the last launch's attention and its fold (the last reader of the
  // region's bytes has then been enqueued).
  template <class AfterLastAttend>
  void attend_and_fold(const std::vector<stream_split>& splits, index_t begin, index_t end,
                       const device_region<Layout>& region, int block_tokens, const std::int32_t* lists,
                       const switches& dbg, AfterLastAttend&& after_last_attend) {
    cudaStream_t comp = compute_.get();
    gpu::attend_params& ap = attend_;
    ap.block_lists = lists;
    for (index_t s0 = begin; s0 < end; s0 += gpu::max_attend_items) {
      const index_t s1 = std::min<index_t>(end, s0 + gpu::max_attend_items);
      ap.out_o = split_o_.as<float>();
      ap.out_lse = split_lse_.as<float>();
      ap.num_items = int(s1 - s0);
      gpu::fold_params& fp = split_fold_params();
      for (index_t s = s0; s < s1; ++s)
        add_split_item(ap, fp, int(s - s0), splits[std::size_t(s)], region, block_tokens, lists);
      attend_streamed(ap, lists != nullptr, dbg, comp);
      if (s1 == end) after_last_attend(comp);
      gpu::launch_fold<Layout>(fp, comp);
    }
  }

  // Step 4 of a launch: the copy stream's end recorded for later D2H writes
  // (C9); the D-window attended with the dense kernel; the step's end and the
  // compute-done event recorded; the timing slot handed over.
  void end_step(const args_type& a, int slot) {
    cudaStream_t comp = compute_.get();
    record(ctx_->h2d_done, ctx_->h2d.get());  // C9: D2H into host blocks waits for this
    gpu::attend_params& ap = attend_;
    ap.block_lists = nullptr;
    ap.out_o = window_o_.as<float>();
    ap.out_lse = window_lse_.as<float>();
    for (int i0 = 0; i0 < a.batch; i0 += gpu::max_attend_items) {
      const int i1 = std::min(a.batch, i0 + gpu::max_attend_items);
      ap.num_items = i1 - i0;
      for (int i = i0; i < i1; ++i) {
        const window_ref<Layout>& w = a.windows[std::size_t(i)];
        ap.items[i - i0] = {w.blocks.block(0).data(), w.tokens, i, i, 0};
      }
      gpu::launch_attend<Layout>(ap, comp);
    }
    record(t_end_[std::size_t(slot)], comp);
    record(compute_done_, comp);
    close_timing_slot(slot, *a.plan, a.format.block_tokens);
  }

  // The timing slot of a new launch. A host more than one launch ahead
  // (all-GPU steps do not wait for the device) reuses a slot whose launch may
  // not have completed: that launch's timing is dropped (fewer samples, never
  // one launch's events paired with another's tokens).
  int take_timing_slot() {
    const int slot = timing_slot_;
    if (timing_pending_[std::size_t(slot)] && event_done(t_end_[std::size_t(slot)]) &&
        event_done(t_start_[std::size_t(slot)]) && event_done(t_ready_[std::size_t(slot)]))
      read_timing(std::size_t(slot));
    timing_pending_[std::size_t(slot)] = false;
    return slot;
  }

  // The slot's end recorded: its launch's tokens kept for read_timing, the next launch's slot chosen.
  void close_timing_slot(int slot, const stream_plan& plan, int block_tokens) {
    timing_pending_[std::size_t(slot)] = true;
    slot_tokens_[std::size_t(slot)] = plan.streamed_blocks * block_tokens;
    slot_resident_[std::size_t(slot)] = plan.resident_blocks * block_tokens;
    slot_sparse_[std::size_t(slot)] = plan.sparse;
    last_slot_ = slot;
    timing_slot_ = slot ^ 1;
  }

  // Host -> device, split where the source crosses a page-locked registration;
  // whole with the K8 mutation switch (`dbg.skip_registration_split`).
  static void copy_h2d(bf16* dst, const bf16* src, index_t bytes, cudaStream_t s, const switches& dbg) {
    auto issue = [&](index_t off, index_t len) {
      WS_CUDA_TRY(cudaMemcpyAsync(reinterpret_cast<std::byte*>(dst) + off,
                                  reinterpret_cast<const std::byte*>(src) + off, static_cast<std::size_t>(len),
                                  cudaMemcpyHostToDevice, s));
    };
    if (dbg.skip_registration_split)
      issue(0, bytes);
    else
      pinned_registry::instance().split(src, bytes, issue);
  }

  // --- the CPU side's buffers, the merge, timing -----------------------------

  [[nodiscard]] const float* host_queries() {
    require_cpu_side("host_queries");
    WS_CUDA_TRY(cudaEventSynchronize(q_done_.get()));
    return reinterpret_cast<const float*>(q_host_.data());
  }

  [[nodiscard]] host_partial_view<float> cpu_partial(int batch) {
    require_cpu_side("cpu_partial");
    WS_CUDA_TRY(cudaEventSynchronize(cpu_h2d_done_.get()));
    return host_partial_view<float>::dense(reinterpret_cast<float*>(cpu_o_host_.data()),
                                           reinterpret_cast<float*>(cpu_lse_host_.data()), batch, hq_, V);
  }

  /// The first half of finish(): state_error without a launch, shape_error for
  /// short outputs; then the launch is over and its launcher joined (its error
  /// ends the step).
  void end_launch(const step_outputs<device_space>& o) {
    if (!launched_) throw state_error("gpu_engine::finish: no step was launched");
    const index_t rows = index_t(batch_) * hq_;
    if (o.out.size() < rows * V)
      throw shape_error("gpu_engine::finish: out has " + std::to_string(o.out.size()) + " elements, needs " +
                        std::to_string(rows * V));
    if (!o.lse.empty() && o.lse.size() < rows)
      throw shape_error("gpu_engine::finish: lse has " + std::to_string(o.lse.size()) + " elements, needs " +
                        std::to_string(rows));
    launched_ = false;
    join_launch();  // the launcher's chunk loop (set_launch_thread); its error ends the step
  }

  /// The second half of finish(): the CPU partial uploaded and the merge
  /// enqueued on the caller stream; returns completed_gpu_seconds().
  double merge(const step_outputs<device_space>& o) {
    const index_t rows = index_t(batch_) * hq_;
    cudaStream_t caller = ctx_->caller;
    if (cpu_side_) {
      if (rows > 0) {
        WS_CUDA_TRY(cudaMemcpyAsync(cpu_o_.data(), cpu_o_host_.data(), static_cast<std::size_t>(rows * V * 4),
                                    cudaMemcpyHostToDevice, caller));
        WS_CUDA_TRY(cudaMemcpyAsync(cpu_lse_.data(), cpu_lse_host_.data(), static_cast<std::size_t>(rows * 4),
                                    cudaMemcpyHostToDevice, caller));
      }
      record(cpu_h2d_done_, caller);
    }
    if (on_caller_) {  // the caller-stream step's fold and merge in one launch (launch_on_caller)
      fold_merge_.out = o.out.data();
      fold_merge_.out_lse = o.lse.empty() ? nullptr : o.lse.data();
      gpu::launch_fold_merge<Layout>(fold_merge_, caller);
      if (o.debug) copy_debug(*o.debug, rows);
      return completed_gpu_seconds();
    }
    wait(caller, compute_done_);  // streamed and D-window partials are final (and the reads of q)
    if (cpu_side_) wait(caller, q_done_);  // the caller may overwrite q after this
    gpu::merge_params mp{};
    mp.streamed_o = streamed_o_.as<float>();
    mp.streamed_lse = streamed_lse_.as<float>();
    mp.window_o = window_src_o_;  // window_o_, or the split workspace after a caller-stream launch
    mp.window_lse = window_src_lse_;
    mp.cpu_o = cpu_side_ ? cpu_o_.as<float>() : nullptr;  // null: no CPU partial (an exact identity)
    mp.cpu_lse = cpu_side_ ? cpu_lse_.as<float>() : nullptr;
    mp.out = o.out.data();
    mp.out_lse = o.lse.empty() ? nullptr : o.lse.data();
    mp.rows = rows;
    gpu::launch_merge<Layout>(mp, caller);
    free_step_buffers();  // ablation only (per_step_allocation): cudaFree synchronizes the device
    if (o.debug) copy_debug(*o.debug, rows);
    return completed_gpu_seconds();
  }

  completed_gpu_cost take_completed_gpu_cost() noexcept {
    if (launcher_.pending()) return {};  // the launch's timing state is the launcher's until joined
    if (!fresh_) return {};
    fresh_ = false;
    return fresh_cost_;
  }

  double gpu_seconds_sync() {
    join_launch();
    const auto s = std::size_t(last_slot_);
    if (!timing_pending_[s]) return last_seconds_;
    WS_CUDA_TRY(cudaEventSynchronize(t_end_[s].get()));
    WS_CUDA_TRY(cudaEventSynchronize(t_start_[s].get()));
    WS_CUDA_TRY(cudaEventSynchronize(t_ready_[s].get()));
    read_timing(s);
    return last_seconds_;
  }

  void free_step_buffers() noexcept {
    for (void* p : step_buffers_raw_) ignore(cudaFree(p));  // waits for the work that uses it
    step_buffers_raw_.clear();
    step_buffers_.fill(nullptr);
  }

 private:
  // Step 3 of a dense launch with the copy policy of `abl` (chosen here, once),
  // after the resident splits (3a).
  void run_chunks(const args_type& a, const switches& dbg, const ablation& abl) {
    attend_resident(a, dbg);
    visit_copy_policy(abl, [&]<class Copy>() { stream_chunks<Copy>(a, dbg, abl); });
  }

  // Step 3 of a dense launch: stream the chunks through ping-pong; attend and
  // fold each. Runs on the launcher thread or inside launch().
  template <class Copy>
  void stream_chunks(const args_type& a, const switches& dbg, const ablation& abl) {
    const stream_plan& plan = *a.plan;
    const index_t block_elems = a.format.block_elems();
    const index_t slice_elems = a.format.slice_elems();
    cudaStream_t h2d = ctx_->h2d.get();
    cudaStream_t comp = compute_.get();
    for (const stream_chunk& c : plan.chunks) {
      const auto b = std::size_t(c.buffer);
      const device_region<Layout> buf = abl.per_step_allocation
                                            ? contiguous_region(a.format, device_span<bf16>(step_buffers_[b], 0))
                                            : a.ping_pong.buffer_region(int(b));
      if (!dbg.skip_consumed_wait) wait(h2d, consumed_[b]);  // WAR
      if (dbg.copy_delay_cycles > 0) gpu::launch_spin(dbg.copy_delay_cycles, h2d);
      for (index_t r = c.run_begin; r < c.run_end; ++r) {
        const stream_run& run = plan.runs[std::size_t(r)];
        bf16* dst = buf.block(run.dst_block).data();
        Copy::for_each_piece(run.src.size(), block_elems, slice_elems, [&](index_t e, index_t n) {
          copy_h2d(dst + e, run.src.data() + e, n * index_t(sizeof(bf16)), h2d, dbg);
        });
      }
      record(filled_[b], h2d);
      if (!dbg.skip_filled_wait) wait(comp, filled_[b]);  // RAW
      attend_chunk(a, c, buf, b, nullptr, dbg);
    }
  }

  // The streamed splits' attention; with the test hooks' slow consumer, the
  // kernel variant that spins first (WS_CUDA_INSTANTIATE_TEST_HOOKS).
  static void attend_streamed(const gpu::attend_params& ap, bool listed, const switches& dbg, cudaStream_t s) {
    if constexpr (Hooks::enabled) {
      if (dbg.consumer_delay_cycles > 0) {
        gpu::launch_attend_slow<Layout>(ap, listed, dbg.consumer_delay_cycles, s);
        return;
      }
    }
    if (listed)
      gpu::launch_attend_listed<Layout>(ap, s);
    else
      gpu::launch_attend<Layout>(ap, s);
  }

  // The launcher thread: launch() posts steps 3-4 with copies of the plan, the
  // window list (vector assignment keeps capacity:
  // no allocation once warm); false (the caller enqueues them itself) when the
  // thread could not be started.
  bool post_launch(const args_type& a, const switches& dbg, const ablation& abl, int slot) {
    if (!launcher_.start(ctx_->device, [this] { run_posted(); })) return false;
    job_plan_ = *a.plan;
    job_windows_.assign(a.windows.begin(), a.windows.end());
    job_args_ = a;
    job_args_.plan = &job_plan_;
    job_args_.windows = job_windows_;
    job_dbg_ = dbg;
    job_abl_ = abl;
    job_slot_ = slot;
    launcher_.post();
    return true;
  }

  void run_posted() {
    if (job_dbg_.launcher_delay_microseconds > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(job_dbg_.launcher_delay_microseconds));
    run_chunks(job_args_, job_dbg_, job_abl_);
    end_step(job_args_, job_slot_);
  }

  // Fault case C9: a pageable source silently makes the copy synchronous and
  // staged (and hides ordering bugs). Debug builds refuse it.
  static void require_page_locked(const void* p, index_t bytes) {
    if (bytes <= 0 || pinned_registry::instance().contains(p, bytes)) return;
    const void* ends[2] = {p, static_cast<const std::byte*>(p) + (bytes - 1)};
    for (const void* q : ends) {
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, q) != cudaSuccess) {
        (void)cudaGetLastError();
        attr.type = cudaMemoryTypeUnregistered;
      }
      if (attr.type != cudaMemoryTypeHost) {
        char addr[32];
        std::snprintf(addr, sizeof addr, "%p", q);
        throw pinned_memory_error(
            std::string("pinned memory: the H2D source at ") + addr + " (a run of " + format_bytes(bytes) +
            " of the pinned load region) is not page-locked, so the copy would be synchronous and staged "
            "(fault case C9 in docs/RELIABILITY.md); use cuda_host_alloc or cuda_host_register, or set "
            "cuda_debug_options::allow_pageable_sources for the pageable ablation");
      }
    }
  }

  // Ablation (per_step_allocation): fresh ping-pong buffers for this launch,
  // the size of the plan's largest chunk. Throws resource_error (nothing stays
  // allocated) when cudaMalloc refuses.
  void allocate_step_buffers(const stream_plan& plan, std::size_t buffers, index_t block_bytes) {
    free_step_buffers();
    index_t blocks = 1;
    for (const stream_chunk& c : plan.chunks) blocks = std::max(blocks, c.num_blocks);
    for (std::size_t b = 0; b < buffers; ++b) {
      void* p = nullptr;
      const cudaError_t e = cudaMalloc(&p, static_cast<std::size_t>(blocks * block_bytes));
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        free_step_buffers();
        throw resource_error("gpu_engine (ablation per_step_allocation): cudaMalloc of " +
                             format_bytes(blocks * block_bytes) + " failed: " + cuda_error_text(e));
      }
      step_buffers_raw_.push_back(p);
      step_buffers_[b] = static_cast<bf16*>(p);
    }
  }

  void read_timing(std::size_t s) {
    float ms = 0.0f;
    WS_CUDA_TRY(cudaEventElapsedTime(&ms, t_start_[s].get(), t_end_[s].get()));
    last_seconds_ = std::max(0.0, double(ms) * 1e-3);
    float critical_ms = 0.0f;
    WS_CUDA_TRY(cudaEventElapsedTime(&critical_ms, t_ready_[s].get(), t_end_[s].get()));
    timing_pending_[s] = false;
    fresh_cost_ = {last_seconds_, std::max(0.0, double(critical_ms) * 1e-3), slot_tokens_[s], slot_sparse_[s],
                   slot_resident_[s]};
    fresh_ = true;
  }

  double completed_gpu_seconds() {
    for (const int s : {last_slot_ ^ 1, last_slot_}) {  // older first: the newest completed wins
      const auto i = std::size_t(s);
      if (timing_pending_[i] && event_done(t_end_[i]) && event_done(t_start_[i]) && event_done(t_ready_[i]))
        read_timing(i);
    }
    return last_seconds_;
  }

  void copy_debug(debug_partials& d, index_t rows) {
    cudaStream_t caller = ctx_->caller;
    WS_CUDA_TRY(cudaStreamSynchronize(caller));
    const auto n_o = std::size_t(rows * V);
    const auto n_l = std::size_t(rows);
    d.streamed_o.resize(n_o);
    d.streamed_lse.resize(n_l);
    d.window_o.resize(n_o);
    d.window_lse.resize(n_l);
    const std::pair<std::vector<float>*, const float*> pairs[] = {
        {&d.streamed_o, streamed_o_.as<float>()}, {&d.streamed_lse, streamed_lse_.as<float>()},
        {&d.window_o, window_src_o_}, {&d.window_lse, window_src_lse_}};
    for (const auto& [vec, src] : pairs)
      if (!vec->empty())
        WS_CUDA_TRY(cudaMemcpyAsync(vec->data(), src, vec->size() * sizeof(float), cudaMemcpyDeviceToHost, caller));
    WS_CUDA_TRY(cudaStreamSynchronize(caller));
    if (!cpu_side_) {  // an all-GPU step: the CPU partial is empty
      d.cpu_o.assign(n_o, 0.0f);
      d.cpu_lse.assign(n_l, empty_lse);
      return;
    }
    const auto* co = reinterpret_cast<const float*>(cpu_o_host_.data());
    const auto* cl = reinterpret_cast<const float*>(cpu_lse_host_.data());
    d.cpu_o.assign(co, co + n_o);
    d.cpu_lse.assign(cl, cl + n_l);
  }

  void require_cpu_side(const char* what) const {
    if (!cpu_side_)
      throw state_error(std::string("gpu_engine::") + what +
                        ": the step was launched without a CPU side (gpu_step_args::cpu_side false)");
  }

  backend_context<Hooks>* ctx_;
  Layout layout_;
  int max_batch_;
  int hq_;
  int batch_ = 0;
  bool launched_ = false;
  bool cpu_side_ = true;  // the launch's gpu_step_args::cpu_side
  bool on_caller_ = false;  // the launch took the caller-stream path (launch_on_caller)
  gpu::fold_merge_params fold_merge_{};  // merge()'s launch after a caller-stream launch
  const float* window_src_o_ = nullptr;  // where merge() reads the D-window partials of the launch
  const float* window_src_lse_ = nullptr;
  index_t caller_stream_steps_ = 0;
  bool last_sparse_ = false;
  device_buffer streamed_o_, streamed_lse_, window_o_, window_lse_, cpu_o_, cpu_lse_, split_o_, split_lse_;
  host_allocation q_host_, cpu_o_host_, cpu_lse_host_;
  unique_stream compute_, qstream_;
  unique_event launch_ev_, q_done_, compute_done_, cpu_h2d_done_;
  std::array<unique_event, max_ping_pong_buffers> filled_, consumed_;
  std::array<unique_event, 2> t_start_, t_ready_, t_end_;
  std::array<bool, 2> timing_pending_{false, false};
  int timing_slot_ = 0;
  int last_slot_ = 0;
  double last_seconds_ = 0.0;
  std::array<index_t, 2> slot_tokens_{0, 0};
  std::array<index_t, 2> slot_resident_{0, 0};
  // the resident kernels (set_resident_kernel; reserve_resident_items)
  device_buffer resident_o_, resident_lse_, resident_tables_;
  static constexpr std::size_t resident_table_slots = 4;  // layers the host may enqueue ahead of the GPU's table copies
  host_allocation resident_tables_host_;                   // page-locked ring of [segments | items | bases] slots
  index_t resident_slot_bytes_ = 0, resident_items_offset_ = 0;
  std::array<unique_event, resident_table_slots> resident_table_ev_{};  // after the copies out of each slot
  std::array<bool, resident_table_slots> resident_table_used_{};
  int resident_table_next_ = 0;
  index_t resident_capacity_ = 0;  // eviction batches (runs) per step; items are at most as many
  index_t resident_kernel_launches_ = 0;
  std::array<bool, 2> slot_sparse_{false, false};
  completed_gpu_cost fresh_cost_{};
  bool fresh_ = false;
  std::vector<void*> step_buffers_raw_;  // ablation: per_step_allocation
  std::array<bf16*, max_ping_pong_buffers> step_buffers_{};
  gpu::attend_params attend_{};
  gpu::fold_params fold_{};
  // The launcher thread (set_launch_thread) and the posted job's copies
  launch_thread launcher_;
  stream_plan job_plan_;
  std::vector<window_ref<Layout>> job_windows_;
  args_type job_args_{};
  [[no_unique_address]] switches job_dbg_{};
  [[no_unique_address]] ablation job_abl_{};
  int job_slot_ = 0;
};

}  // namespace writescope::cuda_detail
