// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/sparse_engine.hpp — the sparse gather pipeline of
// basic_cuda_backend::gpu_engine<Layout> (paper §4.4, Fig. 6; docs/SPARSE.md):
// sparse plans (stream_plan::build_sparse) after reserve_sparse(). Host
// compiler only.
//
// Host gather (sparse_transfer::host_gather): gather threads copy the selected
// blocks of chunk n into page-locked staging buffer n % 2 while the copy engine
// moves chunk n-1; per chunk, on the copy stream:
//   a one-thread wait kernel until every gather thread's page-locked,
//   device-mapped progress counter says chunk n is gathered (RAW; no host
//   callback); wait consumed[b]; ONE copy staging[n % 2] -> ping-pong[b] (a
//   gathered chunk; a direct one copies its long runs straight from the pinned
//   region); copy the chunk's block lists (pinned) -> the buffer's device
//   lists; record filled[b] and copy_done[n % ring] (the gather threads of
//   chunk n+2 synchronize on it before overwriting staging buffer n % 2: WAR)
// and on the compute stream the listed attention kernel per split and KV head
// (dense_engine::attend_chunk with the device lists).
// Device pull (sparse_transfer::device_pull): a gathered chunk is instead, on
// the copy stream, wait consumed[b]; the pull kernel (gpu::launch_pull_blocks)
// copies its blocks from the pinned region (device-mapped) into ping-pong[b] in
// staging's order and layout; then the wait kernel (it now gates only the block
// lists, which gather thread 0 still writes) and the list copy; record
// filled[b] and copy_done. No staging buffers, no host memcpy of blocks; direct
// chunks are unchanged.
//
// launch() only enqueues (it hands the chunks to the gather threads and
// returns); finish_step() waits until the gather threads are done with the
// step's chunks (they read the plan), i.e. until roughly the start of its last
// copy, not for the copies or kernels. Chunks of sparse launches are numbered
// by one serial over the engine's lifetime. On a failed launch every progress
// counter is raised to the maximum (wait kernels already enqueued let the copy
// stream go on) and later sparse launches throw state_error; dense launches
// are unaffected. Threads: the driving thread, and the gather threads
// (created once by reserve()), which share one mutex-guarded state.
#pragma once

// The pipeline runs its chunks through dense_engine's phases: what that header
// includes (streams, events, kernels, the plan, the registry) is used here too.
#include "dense_engine.hpp"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>

#include "../detail/stream_copy.hpp"
#include "../detail/thread_affinity.hpp"
#include "../sparse_pipeline.hpp"

namespace writescope::cuda_detail {

template <kv_layout Layout, cuda_hooks Hooks>
class sparse_pipeline {
 public:
  using engine_type = dense_engine<Layout, Hooks>;
  using args_type = typename engine_type::args_type;
  using switches = typename engine_type::switches;

  explicit sparse_pipeline(backend_context<Hooks>& ctx) noexcept : ctx_(&ctx) {}
  sparse_pipeline(const sparse_pipeline&) = delete;
  sparse_pipeline& operator=(const sparse_pipeline&) = delete;
  ~sparse_pipeline() { stop(); }

  /// Two pinned staging buffers of r.chunk_blocks blocks (none with
  /// r.device_pull), two pinned and r.buffers device block-list buffers, and
  /// r.gather_threads gather threads (created once); a larger reservation
  /// grows the buffers (after the copy stream drained). See
  /// gpu_engine::reserve_sparse for the errors.
  void reserve(const sparse_reservation& r) {
    if (r.device_pull) check_device_pull(r);
    const index_t staging = r.device_pull ? 0 : std::max<index_t>(r.chunk_blocks * r.block_bytes, 1);
    const index_t lists = std::max<index_t>(2 * index_t(r.kv_heads) * r.chunk_blocks, 1);
    const int buffers = std::max(r.buffers, 1);
    if (r.device_pull && index_t(pull_src_.capacity()) < r.chunk_blocks)
      pull_src_.reserve(std::size_t(r.chunk_blocks));  // launch fills it per pulled chunk without allocating
    device_pull_ = r.device_pull;
    pull_ctas_ = r.pull_ctas;
    if (staging > staging_bytes_ || lists > list_cap_ || buffers > list_buffers_) {
      WS_CUDA_TRY(cudaStreamSynchronize(ctx_->h2d.get()));  // nothing reads the old buffers any more
      const index_t sb = std::max(staging, staging_bytes_);
      const index_t lc = std::max(lists, list_cap_);
      const int lb = std::max(buffers, list_buffers_);
      host_allocation st[2], lh[2];
      for (int k = 0; k < 2; ++k) {
        st[k] = allocate_page_locked(sb);
        lh[k] = allocate_page_locked(lc * index_t(sizeof(std::int32_t)));
      }
      device_buffer ld = allocate_device_buffer(lc * lb * index_t(sizeof(std::int32_t)), "sparse block lists");
      for (int k = 0; k < 2; ++k) {
        staging_[k] = std::move(st[k]);
        lists_host_[k] = std::move(lh[k]);
      }
      lists_dev_ = std::move(ld);
      staging_bytes_ = sb;
      list_cap_ = lc;
      list_buffers_ = lb;
    }
    if (!gs_) {
      auto g = std::make_unique<gather_shared>();
      const int n = std::max(1, r.gather_threads);
      g->progress.assign(std::size_t(n), 0);
      g->t_first.assign(std::size_t(n), -1.0);
      g->t_last.assign(std::size_t(n), -1.0);
      host_allocation hp = allocate_page_locked(index_t(n) * index_t(sizeof(std::uint64_t)));
      std::memset(hp.data(), 0, std::size_t(n) * sizeof(std::uint64_t));
      void* dev = nullptr;
      WS_CUDA_TRY(cudaHostGetDevicePointer(&dev, hp.data(), 0));
      g->host_progress = reinterpret_cast<std::uint64_t*>(hp.data());
      host_progress_ = std::move(hp);
      dev_progress_ = static_cast<const unsigned long long*>(dev);
      gs_ = std::move(g);
      try {
        for (int j = 0; j < n; ++j)
          gather_threads_.emplace_back(&sparse_pipeline::gather_main, gs_.get(), j, ctx_->device);
      } catch (...) {
        stop_gather_threads();
        gs_.reset();
        throw resource_error("gpu_engine::reserve_sparse: could not start " + std::to_string(n) + " gather threads");
      }
    }
  }

  /// Bytes of the two pinned staging buffers.
  [[nodiscard]] index_t staging_bytes() const noexcept { return 2 * staging_bytes_; }
  /// The gather of the last finished sparse step (zeros after a dense one).
  [[nodiscard]] const gather_stats& last_gather() const noexcept { return gather_; }

  /// finish() of a step: for a sparse one, waits until the gather threads are
  /// done with its chunks and takes their statistics; zeros after a dense one.
  void finish_step(bool sparse_step) {
    gather_ = {};
    if (!sparse_step) return;
    wait_gathers();  // the gather threads read the plan: wait until they are done with it
    gather_ = job_stats_;
    double t0 = 0.0, t1 = 0.0;
    bool any = false;
    for (std::size_t j = 0; j < gs_->t_first.size() && job_stats_.gathered_chunks > 0; ++j) {
      if (gs_->t_first[j] < 0.0) continue;
      t0 = any ? std::min(t0, gs_->t_first[j]) : gs_->t_first[j];
      t1 = any ? std::max(t1, gs_->t_last[j]) : gs_->t_last[j];
      any = true;
    }
    gather_.seconds = any ? t1 - t0 : 0.0;
  }

  /// Ends the gather threads (idempotent).
  void stop() noexcept { stop_gather_threads(); }

  /// The sparse-only checks of gpu_engine::launch, before anything is enqueued.
  void validate(const args_type& a) const {
    if (!gs_) throw state_error("gpu_engine::launch: a sparse plan needs reserve_sparse() first");
    if (sparse_failed_)
      throw state_error("gpu_engine::launch: the sparse pipeline stopped after a failed launch (CUDA error); "
                        "create a new engine");
    const index_t block_bytes = a.format.block_bytes();
    std::pair<std::uintptr_t, std::uintptr_t> span{0, 0};  // the last registered span a pulled run was found in
    for (const stream_chunk& c : a.plan->chunks) {
      if (c.gathered && device_pull_) {
        if (c.num_blocks > index_t(pull_src_.capacity()))
          throw shape_error("gpu_engine::launch: a pulled chunk of " + std::to_string(c.num_blocks) +
                            " blocks exceeds the reserved " + std::to_string(pull_src_.capacity()) +
                            "; reserve_sparse() for the cache's ping-pong geometry");
        // The pull kernel dereferences these host addresses on the device:
        // only memory page-locked (and mapped) by this library's allocators.
        // The registry is asked once per registered span, not once per run.
        for (index_t k = c.run_begin; k < c.run_end; ++k) {
          const stream_run& r = a.plan->runs[std::size_t(k)];
          const auto lo = reinterpret_cast<std::uintptr_t>(r.src.data());
          const auto hi = lo + static_cast<std::uintptr_t>(r.num_blocks * block_bytes);
          if (lo < span.first || hi > span.second) span = pinned_registry::instance().covering_span(r.src.data());
          if (lo < span.first || hi > span.second) {
            char addr[32];
            std::snprintf(addr, sizeof addr, "%p", static_cast<const void*>(r.src.data()));
            throw pinned_memory_error(
                std::string("pinned memory: device pull of a run of ") + std::to_string(r.num_blocks) +
                " blocks (" + format_bytes(r.num_blocks * block_bytes) + ") at " + addr +
                ": the range is not page-locked by cuda_host_alloc / cuda_host_register (pinned_registry), so "
                "the device cannot read it; use one of them for the pinned region, or sparse_transfer::host_gather");
          }
        }
      }
      if (c.gathered && !device_pull_ && c.num_blocks * block_bytes > staging_bytes_)
        throw shape_error("gpu_engine::launch: a gathered chunk of " + std::to_string(c.num_blocks) +
                          " blocks exceeds the staging buffer (" + format_bytes(staging_bytes_) +
                          "); reserve_sparse() for the cache's ping-pong geometry");
      if (c.list_end - c.list_begin > list_cap_ || c.buffer >= list_buffers_)
        throw shape_error("gpu_engine::launch: a sparse chunk needs " + std::to_string(c.list_end - c.list_begin) +
                          " list entries in buffer " + std::to_string(c.buffer) + "; reserved " +
                          std::to_string(list_cap_) + " in " + std::to_string(list_buffers_) +
                          " buffers (reserve_sparse())");
    }
  }

  // The sparse launch: launch() with the chunks gathered into staging by the
  // gather threads, the copy stream gated by wait kernels on their progress, block lists
  // uploaded per chunk, and the listed attention kernel.
  void launch(engine_type& e, const args_type& a, const switches& dbg) {
    const stream_plan& plan = *a.plan;
    const index_t block_bytes = a.format.block_bytes();
    cudaStream_t h2d = ctx_->h2d.get();
    cudaStream_t comp = e.compute();
    gather_shared& g = *gs_;
    wait_gathers();  // the previous sparse step's (finish() did already, unless it was skipped)
    if (sparse_failed_) throw state_error("gpu_engine::launch: the sparse pipeline stopped after a failed launch");

    // Hand the chunks to the gather threads now: chunk n gathers once the
    // copies of chunk n-2 are done (its copy_done event, recorded below).
    const std::uint64_t first = next_serial_;
    if (copy_done_raw_.size() < plan.chunks.size() + 2) {  // the WAR ring: one event per chunk in flight
      WS_CUDA_TRY(cudaStreamSynchronize(h2d));  // earlier chunks' copies are done: no waits for them
      while (copy_done_raw_.size() < plan.chunks.size() + 2) {
        copy_done_.push_back(unique_event::create());
        copy_done_raw_.push_back(copy_done_.back().get());
      }
      std::lock_guard lk(g.mu);
      g.copy_done = copy_done_raw_.data();
      g.ring = copy_done_raw_.size();
      g.done_floor = first;
    }
    job_stats_ = {};
    const bool pull = device_pull_;
    for (const stream_chunk& c : plan.chunks) {
      if (c.gathered && pull) {
        ++job_stats_.pulled_chunks;
        job_stats_.pulled_bytes += c.num_blocks * block_bytes;
      } else if (c.gathered) {
        ++job_stats_.gathered_chunks;
        job_stats_.bytes += c.num_blocks * block_bytes;
      } else {
        ++job_stats_.direct_chunks;
      }
    }
    if (!plan.chunks.empty()) {
      {
        std::lock_guard lk(g.mu);
        gather_job& j = g.job;
        j.plan = &plan;
        j.first = first;
        j.format = a.format;
        for (int k = 0; k < 2; ++k) {
          j.staging[k] = staging_[k].data();
          j.lists[k] = reinterpret_cast<std::int32_t*>(lists_host_[k].data());
        }
        j.pull = pull;
        j.skip_staging_wait = dbg.skip_staging_wait;
        j.delay_us = dbg.gather_delay_microseconds;
        std::fill(g.t_first.begin(), g.t_first.end(), -1.0);
        std::fill(g.t_last.begin(), g.t_last.end(), -1.0);
        ++g.job_id;
      }
      g.cv.notify_all();
    }
    next_serial_ = first + plan.chunks.size();
    job_end_ = next_serial_;
    e.mark_launched(a.batch, true);

    try {
      // 0-2. As launch() (direct chunks read the region itself; gathered
      // blocks landed before the step: hybrid_attention's summary update
      // waited for every host write of newly placed blocks).
      const int tslot = e.begin_step(a, dbg);

      // 3. Per chunk: gated copy of its staging buffer (or direct runs) and its
      // lists, then the listed attention of its splits and the in-order fold.
      for (std::size_t k = 0; k < plan.chunks.size(); ++k) {
        const stream_chunk& c = plan.chunks[k];
        const std::uint64_t n = first + k;
        const auto slot = std::size_t(n & 1u);
        const auto b = std::size_t(c.buffer);
        const device_region<Layout> buf = a.ping_pong.buffer_region(int(b));
        std::int32_t* dev_lists = lists_dev_.as<std::int32_t>() + index_t(b) * list_cap_;
        const bool pulled = pull && c.gathered;
        auto gate = [&] {  // RAW: every gather thread finished chunk n (its blocks, if it gathers, and lists)
          if (!dbg.skip_gather_wait) gpu::launch_wait_host_counters(dev_progress_, int(g.progress.size()), n + 1, h2d);
        };
        if (!pulled) gate();
        if (!dbg.skip_consumed_wait) wait(h2d, e.consumed(b));  // WAR on ping-pong[b] and its lists
        if (dbg.copy_delay_cycles > 0) gpu::launch_spin(dbg.copy_delay_cycles, h2d);
        if (pulled) {  // device pull: the blocks in staging's order, straight from the region
          pull_src_.resize(std::size_t(c.num_blocks));  // capacity reserved: no allocation
          for (index_t r = c.run_begin; r < c.run_end; ++r) {
            const stream_run& run = plan.runs[std::size_t(r)];
            const auto src = contiguous_region(a.format, run.src);
            for (index_t i = 0; i < run.num_blocks; ++i) pull_src_[std::size_t(run.dst_block + i)] = src.block(i).data();
          }
          gpu::launch_pull_blocks(pull_src_.data(), c.num_blocks, buf.block(0).data(), block_bytes, pull_ctas_, h2d);
          gate();  // only the lists need the gather threads: the pull does not wait for them
        } else if (c.gathered) {
          engine_type::copy_h2d(buf.block(0).data(), reinterpret_cast<const bf16*>(staging_[slot].data()),
                                c.num_blocks * block_bytes, h2d, dbg);
        } else {
          for (index_t r = c.run_begin; r < c.run_end; ++r) {
            const stream_run& run = plan.runs[std::size_t(r)];
            engine_type::copy_h2d(buf.block(run.dst_block).data(), run.src.data(), run.num_blocks * block_bytes, h2d, dbg);
          }
        }
        const index_t list_ints = c.list_end - c.list_begin;
        if (list_ints > 0)
          WS_CUDA_TRY(cudaMemcpyAsync(dev_lists, lists_host_[slot].data(),
                                      static_cast<std::size_t>(list_ints) * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice, h2d));
        record(e.filled(b), h2d);
        WS_CUDA_TRY(cudaEventRecord(copy_done_raw_[std::size_t(n % copy_done_raw_.size())], h2d));
        {
          std::lock_guard lk(g.mu);
          g.recorded = n + 1;  // the gather of chunk n+2 may now wait for these copies (WAR)
        }
        g.cv.notify_all();
        if (!dbg.skip_filled_wait) wait(comp, e.filled(b));  // RAW
        e.attend_chunk(a, c, buf, b, dev_lists, dbg);  // the listed kernel, over the chunk's block lists
      }

      // 4. D-window attention (the dense kernel); timing.
      e.end_step(a, tslot);
    } catch (...) {
      // Wait kernels already enqueued must not wait for chunks that will never
      // be gathered: release them and stop the pipeline (later sparse launches
      // throw state_error; dense launches are unaffected).
      abort_gathers();
      throw;
    }
  }

 private:
  // reserve_sparse with device_pull: the device must read page-locked memory
  // through its host addresses (the pull kernel gets the plan's run sources),
  // and the kernel moves 16-byte vectors. config_error naming what fails.
  void check_device_pull(const sparse_reservation& r) const {
    const std::pair<cudaDeviceAttr, const char*> needed[] = {
        {cudaDevAttrUnifiedAddressing, "cudaDevAttrUnifiedAddressing"},
        {cudaDevAttrCanUseHostPointerForRegisteredMem, "cudaDevAttrCanUseHostPointerForRegisteredMem"}};
    for (const auto& [attr, name] : needed) {
      int v = 0;
      WS_CUDA_TRY(cudaDeviceGetAttribute(&v, attr, ctx_->device));
      if (v == 0)
        throw config_error(std::string("gpu_engine::reserve_sparse: sparse_transfer::device_pull needs ") + name +
                           " = 1 on device " + std::to_string(ctx_->device) +
                           " (kernels read the pinned region through its host addresses); it is 0 there: "
                           "use sparse_transfer::host_gather");
    }
    if (r.block_bytes <= 0 || r.block_bytes % 16 != 0)
      throw config_error("gpu_engine::reserve_sparse: sparse_transfer::device_pull needs a block size that is a "
                         "positive multiple of 16 bytes (16-byte vector copies); the block has " +
                         std::to_string(r.block_bytes) + " bytes");
    if (r.pull_ctas < 1)
      throw config_error("gpu_engine::reserve_sparse: pull_ctas " + std::to_string(r.pull_ctas) + " must be >= 1");
  }


  /// What the gather threads do for one launch.
  struct gather_job {
    const stream_plan* plan = nullptr;
    std::uint64_t first = 0;  ///< serial number of the plan's first chunk
    block_format<Layout> format{};
    std::byte* staging[2] = {nullptr, nullptr};  ///< page-locked; chunk n gathers into staging[n % 2]
    std::int32_t* lists[2] = {nullptr, nullptr};
    bool pull = false;  ///< gathered chunks are pulled by the device: write their block lists only
    bool skip_staging_wait = false;
    long long delay_us = 0;

    /// Staging buffer k as a region (block j of a chunk gathers into block j).
    [[nodiscard]] region_view<Layout, pinned_host_space, arena_storage> staging_region(std::size_t k) const noexcept {
      return {format, arena_storage{reinterpret_cast<bf16*>(staging[k]), 0}, 0};
    }
  };

  /// State shared by the launching thread and the gather threads (one mutex;
  /// counters only grow), plus the progress mirror the wait kernel reads. Chunks of
  /// sparse launches are numbered by one serial over the engine's lifetime;
  /// chunk n uses staging buffer n % 2.
  struct gather_shared {
    std::mutex mu;
    std::condition_variable cv;
    std::uint64_t recorded = 0;    ///< serials whose copy_done event is recorded (serial + 1 of the last)
    std::uint64_t done_floor = 0;  ///< serials below it are known copied (the copy stream was synchronized)
    const cudaEvent_t* copy_done = nullptr;  ///< ring of events: serial s's copies completed at copy_done[s % ring]
    std::uint64_t ring = 1;
    std::uint64_t* host_progress = nullptr;  ///< page-locked mirror of progress, read by the wait kernel (atomic_ref)
    std::vector<std::uint64_t> progress;  ///< per gather thread: serial + 1 of its last finished chunk
    std::vector<double> t_first, t_last;  ///< per gather thread: its first / last gather memcpy of the job (s)
    std::uint64_t job_id = 0;
    gather_job job;
    bool abort = false;  ///< a launch failed half-way: nothing waits any more
    bool stop = false;   ///< the engine is being destroyed
    [[nodiscard]] std::uint64_t min_progress() const noexcept {
      std::uint64_t m = ~std::uint64_t{0};
      for (const std::uint64_t p : progress) m = std::min(m, p);
      return m;
    }
  };

  static double now_seconds() noexcept {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  // Publishes thread j's progress to the wait kernel: after the fence, every
  // earlier store of this thread (the NT gather stores are fenced already,
  // stream_copy_fence) is visible before the counter, which is stored whole
  // (an atomic store; the kernel loads it with acquire at system scope).
  static void store_progress(gather_shared* g, std::size_t j, std::uint64_t v) noexcept {
    static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free);
    std::atomic_ref<std::uint64_t>(g->host_progress[j]).store(v, std::memory_order_release);
  }
  static void publish_progress(gather_shared* g, int j, std::uint64_t v) noexcept {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (g->host_progress != nullptr) store_progress(g, std::size_t(j), v);
  }
  // Raises every progress mirror to the maximum, so wait kernels already
  // enqueued let their streams go on (an aborted pipeline). Under g->mu.
  static void release_wait_kernels(gather_shared* g) noexcept {
    if (g->host_progress == nullptr) return;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    for (std::size_t j = 0; j < g->progress.size(); ++j) store_progress(g, j, ~std::uint64_t{0});
  }

  // Gather thread j of nt: for each chunk of a job, in order, wait until the
  // copies that last read its staging buffer (chunk n-2) completed (their
  // copy_done event), then copy its share of the chunk (blocks
  // [j*nb/nt, (j+1)*nb/nt) of the staging buffer, from whichever runs hold
  // them); thread 0 also writes the chunk's block lists; then publish n + 1.
  // A pull job (device pull) copies no block: only the lists are written (the
  // wait on chunk n-2's copies then guards the list buffer, WAR).
  static void gather_main(gather_shared* g, int j, int device) {
    detail::widen_thread_affinity();  // not the creator's (possibly OpenMP-bound) core
    (void)cudaSetDevice(device);      // the events it synchronizes on live there
    std::uint64_t seen = 0;
    for (;;) {
      gather_job job;
      {
        std::unique_lock lk(g->mu);
        g->cv.wait(lk, [&] { return g->stop || g->job_id != seen; });
        if (g->stop) return;
        seen = g->job_id;
        job = g->job;
      }
      const stream_plan& plan = *job.plan;
      const auto nt = index_t(g->progress.size());
      double t_first = -1.0, t_last = -1.0;
      for (std::size_t k = 0; k < plan.chunks.size(); ++k) {
        const std::uint64_t n = job.first + k;
        {
          std::unique_lock lk(g->mu);
          if (!job.skip_staging_wait && n >= 2 && n - 2 >= g->done_floor) {  // WAR: copies of chunk n-2 done
            g->cv.wait(lk, [&] { return g->abort || g->stop || g->recorded >= n - 1; });  // ... were enqueued
            if (!(g->abort || g->stop)) {
              const cudaEvent_t ev = g->copy_done[(n - 2) % g->ring];
              lk.unlock();
              const cudaError_t e = cudaEventSynchronize(ev);
              lk.lock();
              if (e != cudaSuccess) {  // a sticky error: wait_gathers() reports it
                g->abort = true;
                release_wait_kernels(g);
                g->cv.notify_all();
              }
            }
          }
          if (g->abort || g->stop) break;
        }
        if (job.delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(job.delay_us));
        const stream_chunk& c = plan.chunks[k];
        const auto slot = std::size_t(n & 1u);
        if (c.gathered && !job.pull) {  // this thread's share: chunk blocks [lo, hi), whatever runs they belong to
          const double t0 = now_seconds();
          const index_t lo = c.num_blocks * j / nt, hi = c.num_blocks * (j + 1) / nt;
          for (index_t r = c.run_begin; r < c.run_end; ++r) {
            const stream_run& run = plan.runs[std::size_t(r)];
            if (run.dst_block >= hi) break;  // runs are in destination order
            const index_t b0 = std::max(lo, run.dst_block), b1 = std::min(hi, run.dst_block + run.num_blocks);
            if (b0 < b1)  // non-temporal: only the DMA engine reads staging next
              detail::stream_copy(job.staging_region(slot).block(b0).data(),
                                  contiguous_region(job.format, run.src).block(b0 - run.dst_block).data(),
                                  static_cast<std::size_t>((b1 - b0) * job.format.block_bytes()));
          }
          detail::stream_copy_fence();  // before progress[j] publishes the chunk
          if (t_first < 0.0) t_first = t0;
          t_last = now_seconds();
        }
        if (j == 0 && c.list_end > c.list_begin)
          std::memcpy(job.lists[slot], plan.block_lists.data() + c.list_begin,
                      static_cast<std::size_t>(c.list_end - c.list_begin) * sizeof(std::int32_t));
        if (k + 1 == plan.chunks.size()) break;  // the last chunk is reported with the statistics below
        {
          std::lock_guard lk(g->mu);
          g->progress[std::size_t(j)] = n + 1;
          if (!g->abort) publish_progress(g, j, n + 1);
        }
        g->cv.notify_all();
      }
      {
        std::lock_guard lk(g->mu);
        g->progress[std::size_t(j)] = job.first + plan.chunks.size();  // done (also after an abort)
        if (!g->abort) publish_progress(g, j, job.first + plan.chunks.size());
        g->t_first[std::size_t(j)] = t_first;
        g->t_last[std::size_t(j)] = t_last;
      }
      g->cv.notify_all();
    }
  }

  // Waits until the gather threads finished the last posted job. Polls the copy
  // stream for a sticky CUDA error (the copy_done events would never complete,
  // so the gathers would stop): then aborts the pipeline and throws cuda_error.
  void wait_gathers() {
    if (!gs_) return;
    gather_shared& g = *gs_;
    std::unique_lock lk(g.mu);
    while (!(g.abort || g.min_progress() >= job_end_)) {
      if (g.cv.wait_for(lk, std::chrono::milliseconds(100)) != std::cv_status::timeout) continue;
      lk.unlock();
      const cudaError_t e = cudaStreamQuery(ctx_->h2d.get());
      if (e == cudaErrorNotReady) (void)cudaGetLastError();
      if (e != cudaSuccess && e != cudaErrorNotReady) {
        abort_gathers();
        check(e, "cudaStreamQuery (sparse gather pipeline)", __FILE__, __LINE__);
      }
      lk.lock();
    }
  }

  void abort_gathers() noexcept {
    if (!gs_) return;
    {
      std::lock_guard lk(gs_->mu);
      gs_->abort = true;
      release_wait_kernels(gs_.get());
    }
    gs_->cv.notify_all();
    sparse_failed_ = true;
  }

  void stop_gather_threads() noexcept {
    if (gs_) {
      {
        std::lock_guard lk(gs_->mu);
        gs_->stop = true;
      }
      gs_->cv.notify_all();
    }
    for (std::thread& t : gather_threads_)
      if (t.joinable()) t.join();
    gather_threads_.clear();
  }

  backend_context<Hooks>* ctx_;
  std::unique_ptr<gather_shared> gs_;
  std::vector<std::thread> gather_threads_;
  host_allocation host_progress_;                     // gather threads' progress, page-locked (wait kernel reads it)
  const unsigned long long* dev_progress_ = nullptr;  // its device-side address
  std::vector<unique_event> copy_done_;               // WAR ring (launch)
  std::vector<cudaEvent_t> copy_done_raw_;
  host_allocation staging_[2];     // pinned, staging_bytes_ each
  host_allocation lists_host_[2];  // pinned, list_cap_ entries each
  device_buffer lists_dev_;        // list_buffers_ × list_cap_ entries
  index_t staging_bytes_ = 0;
  bool device_pull_ = false;           // sparse_reservation::device_pull (the latest reservation's)
  int pull_ctas_ = 64;                 // sparse_reservation::pull_ctas
  std::vector<const void*> pull_src_;  // per-block sources of one pulled chunk (capacity: chunk_blocks)
  index_t list_cap_ = 0;
  int list_buffers_ = 0;
  std::uint64_t next_serial_ = 0;  // serial of the next sparse chunk
  std::uint64_t job_end_ = 0;      // serial after the last posted job's chunks
  bool sparse_failed_ = false;
  gather_stats job_stats_{}, gather_{};
};

}  // namespace writescope::cuda_detail
