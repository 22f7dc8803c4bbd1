// SPDX-License-Identifier: Apache-2.0
// writescope/host_backend.hpp — a backend that emulates the device in host
// memory, so the whole per-step pipeline (routing, eviction, streaming through
// ping-pong in chunks, per-split partials, merge) runs on machines without a
// GPU, CI included (docs/ARCHITECTURE.md).
//
// Emulation: "device memory" is host memory that only this backend touches,
// typed device_space; DMA is memcpy; a GPU kernel is a CPU attention kernel
// (gpu_engine's Kernel: hybrid_attention's CpuKernel, cpu/kernel.hpp) run on one
// persistent worker thread (the "device"), concurrently with the CPU engine's
// threads, as the real GPU side runs concurrently with them. The worker
// executes exactly the order the CUDA backend enqueues: for each chunk, copy
// its runs into its ping-pong buffer, attend its splits, fold each split into
// the sequence's running streamed state in split order; then attend the
// D-window. The HBM-resident region is emulated like the rest of the device:
// host memory typed device_space, its resident splits attended in place by the
// worker before the first chunk and folded first into the same running state;
// its free memory is a figure the test sets (set_device_free_bytes). Activations
// (appended KV, queries, outputs) are pageable host memory.
// Sparse plans (docs/SPARSE.md) run the same pipeline as cuda_backend, in
// order on the worker: a gathered chunk is memcpy'd block by block into staging
// buffer (chunk serial % 2), then copied whole into its ping-pong buffer; each
// split is attended per KV head over the blocks of that head's list. With
// sparse_transfer::device_pull (sparse_reservation::device_pull) a gathered
// chunk's runs are copied straight into their places in the ping-pong buffer
// instead, as cuda_backend's pull kernel writes them (same bytes, same layout:
// the attention and its results are identical to host_gather), and counted as
// pulled; no staging is reserved. pull_ctas has no meaning here and is ignored.
//
// Threading: one host_backend may serve several caches; each gpu_engine owns
// its worker thread. Calls into one engine come from one thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "detail/thread_affinity.hpp"
#include "cpu/attention.hpp"
#include "cpu/kernel.hpp"
#include "error.hpp"
#include "host_memory.hpp"
#include "partial_state.hpp"
#include "region.hpp"
#include "sparse_pipeline.hpp"
#include "stream_plan.hpp"

namespace writescope {

class host_backend {
 public:
  using backend_concept = backend_tag;
  using activation_space = pageable_host_space;

  /// Emulated device memory.
  class device_buffer {
   public:
    device_buffer() = default;
    explicit device_buffer(host_allocation a) : mem_(std::move(a)) {}
    [[nodiscard]] std::byte* data() const noexcept { return mem_.data(); }
    [[nodiscard]] index_t size_bytes() const noexcept { return mem_.size_bytes(); }
    [[nodiscard]] device_span<std::byte> span() const noexcept { return device_span<std::byte>(data(), size_bytes()); }

   private:
    host_allocation mem_;
  };

  [[nodiscard]] std::string_view name() const noexcept { return "host (emulated device)"; }

  device_buffer allocate_device(index_t bytes, const char* what) {
    return device_buffer(detail::map_pageable(bytes, what));
  }
  host_allocation allocate_staging(index_t bytes) { return detail::map_pageable(bytes, "staging buffer"); }

  /// Fills `bytes` of device memory with a repeated 16-bit pattern (poisoning).
  void fill_device(std::byte* dst, index_t bytes, std::uint16_t pattern) {
    auto* p = reinterpret_cast<std::uint16_t*>(dst);
    std::fill(p, p + bytes / 2, pattern);
  }

  /// Scatters token-major KV into blocks (prefill routing and decode staging).
  template <kv_layout Layout>
  void write_blocks(const block_format<Layout>& fmt, const kv_tokens<Layout, activation_space>& kv,
                    std::span<const block_write> writes) {
    const index_t stride = kv.stride(fmt.layout);
    for (const block_write& w : writes)
      for (int p = 0; p < Layout::planes; ++p)
        for (int h = 0; h < fmt.layout.kv_heads(); ++h)
          for (int t = 0; t < w.num_tokens; ++t)
            std::memcpy(w.dst + fmt.offset(p, h, w.dst_token + t, 0),
                        kv.planes[std::size_t(p)] + (w.src_token + t) * stride + index_t{h} * Layout::row_elems,
                        sizeof(bf16) * Layout::row_elems);
  }

  /// Eviction: device -> host copies, complete on return.
  void copy_blocks_to_host(std::span<const block_copy> copies) {
    for (const block_copy& c : copies) std::memcpy(c.dst, c.src, static_cast<std::size_t>(c.bytes));
  }
  /// Eviction into the HBM-resident region: device -> device copies, complete on return.
  void copy_blocks_on_device(std::span<const block_copy> copies) {
    for (const block_copy& c : copies) std::memcpy(c.dst, c.src, static_cast<std::size_t>(c.bytes));
  }

  /// The emulated device's free memory: what set_device_free_bytes() said
  /// (default: unlimited). The cache checks its HBM-resident region against it.
  [[nodiscard]] index_t device_free_bytes() const noexcept { return device_free_bytes_; }
  /// Sets the emulated device's free memory (tests of the init refusal).
  void set_device_free_bytes(index_t bytes) noexcept { device_free_bytes_ = bytes; }

  void copy_to_host_sync(void* dst, const std::byte* src, index_t bytes) {
    std::memcpy(dst, src, static_cast<std::size_t>(bytes));
  }

  /// Host-region writes complete on return here: nothing to wait for.
  void synchronize_host_writes() noexcept {}
  void complete_host_writes() noexcept {}
  /// Evictions are memcpy into the region itself: no staging to reserve.
  void reserve_eviction_bounce() noexcept {}

  /// The GPU side of a decode step for one layout (one per cache); its
  /// emulated device attends with `Kernel` (hybrid_attention passes its
  /// CpuKernel: gpu_engine_for below).
  template <kv_layout Layout, cpu_attention_kernel<Layout> Kernel = cpu::decode_kernel<Layout>>
  class gpu_engine;

 private:
  index_t device_free_bytes_ = std::numeric_limits<index_t>::max();
};

/// hybrid_attention<Cache, CpuKernel> on host_backend: the emulated device runs
/// CpuKernel as well. (A type derived from host_backend gets its own
/// gpu_engine<Layout>, as any backend, unless it specializes gpu_engine_for.)
template <class Layout, class CpuKernel>
struct gpu_engine_for<host_backend, Layout, CpuKernel> {
  using type = host_backend::gpu_engine<Layout, CpuKernel>;
};

template <kv_layout Layout, cpu_attention_kernel<Layout> Kernel>
class host_backend::gpu_engine {
 public:
  using args_type = gpu_step_args<Layout, pageable_host_space>;
  /// finish() waits for this step's GPU side and times it.
  static constexpr bool asynchronous = false;

  /// max_batch: sequences per step; nothing is allocated per step afterwards.
  gpu_engine(host_backend&, const Layout& layout, int max_batch) : layout_(layout), max_batch_(max_batch) {
    const auto rows = std::size_t(max_batch) * std::size_t(layout.num_q_heads());
    streamed_o_.resize(rows * Layout::v_dim);
    streamed_lse_.resize(rows);
    window_o_.resize(rows * Layout::v_dim);
    window_lse_.resize(rows);
    cpu_o_.resize(rows * Layout::v_dim);
    cpu_lse_.resize(rows);
    split_o_.resize(std::size_t(layout.group_size()) * Layout::v_dim);
    split_lse_.resize(std::size_t(layout.group_size()));
    worker_ = std::thread([this] {
      detail::widen_thread_affinity();
      worker_loop();
    });
  }
  gpu_engine(const gpu_engine&) = delete;
  gpu_engine& operator=(const gpu_engine&) = delete;
  ~gpu_engine() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  /// Starts the GPU side; returns at once. `a` and everything it points to must
  /// stay valid until finish() returns.
  void launch(const args_type& a) {
    if (a.plan != nullptr && a.plan->sparse && !device_pull_) {
      const index_t need = a.plan->chunks.empty() ? 0 : a.format.block_bytes();
      index_t most = 0;
      for (const stream_chunk& c : a.plan->chunks) most = std::max(most, c.gathered ? c.num_blocks : 0);
      if (most * need > staging_bytes_)
        throw state_error("gpu_engine::launch: a sparse plan needs reserve_sparse() with staging for " +
                          std::to_string(most) + " blocks first");
    }
    std::unique_lock lk(mu_);
    args_ = a;
    pending_ = true;
    done_ = false;
    lk.unlock();
    cv_.notify_all();
  }

  /// Reserves the sparse pipeline (two staging buffers of r.chunk_blocks
  /// blocks; none with r.device_pull, which is emulated: see the file comment);
  /// grows it when a larger reservation is asked for; the transfer mode is the
  /// latest reservation's. Between steps only. Throws resource_error.
  void reserve_sparse(const sparse_reservation& r) {
    device_pull_ = r.device_pull;
    const index_t bytes = r.device_pull ? 0 : r.chunk_blocks * r.block_bytes;
    if (bytes <= staging_bytes_) return;
    for (auto& st : staging_) st = detail::map_pageable(std::max<index_t>(bytes, 1), "sparse staging buffer");
    staging_bytes_ = bytes;
  }
  [[nodiscard]] index_t sparse_staging_bytes() const noexcept { return 2 * staging_bytes_; }
  /// The gather of the last finished sparse step.
  [[nodiscard]] const gather_stats& last_gather() const noexcept { return gather_; }

  /// Host-readable queries for the CPU engine ([batch][Hq][q_dim]).
  [[nodiscard]] const float* host_queries() const {
    require_cpu_side("host_queries");
    return args_.q.data();
  }

  /// Where the CPU engine writes its merged partial: dense [batch][Hq][v_dim] / [batch][Hq].
  [[nodiscard]] host_partial_view<float> cpu_partial(int batch) {
    require_cpu_side("cpu_partial");
    return host_partial_view<float>::dense(cpu_o_.data(), cpu_lse_.data(), batch, layout_.num_q_heads(),
                                           Layout::v_dim);
  }

  /// Waits for the GPU side, merges (HBM ⊕ streamed) ⊕ D-window ⊕ CPU into `o`; returns
  /// the GPU side's seconds (streaming + attention, merge excluded).
  double finish(const step_outputs<pageable_host_space>& o) {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [this] { return done_; });
    lk.unlock();
    gather_ = args_.plan != nullptr && args_.plan->sparse ? gather_pending_ : gather_stats{};
    const int batch = args_.batch;
    const int hq = layout_.num_q_heads();
    constexpr int V = Layout::v_dim;
    if (!args_.cpu_side) {  // an all-GPU step: the CPU partial is empty (an exact identity of the merge)
      const auto rows = std::size_t(batch) * std::size_t(hq);
      std::fill(cpu_o_.begin(), cpu_o_.begin() + std::ptrdiff_t(rows * V), 0.0f);
      std::fill(cpu_lse_.begin(), cpu_lse_.begin() + std::ptrdiff_t(rows), empty_lse);
    }
    if (o.debug) {
      const auto rows = std::size_t(batch) * std::size_t(hq);
      o.debug->cpu_o.assign(cpu_o_.begin(), cpu_o_.begin() + std::ptrdiff_t(rows * V));
      o.debug->cpu_lse.assign(cpu_lse_.begin(), cpu_lse_.begin() + std::ptrdiff_t(rows));
      o.debug->streamed_o.assign(streamed_o_.begin(), streamed_o_.begin() + std::ptrdiff_t(rows * V));
      o.debug->streamed_lse.assign(streamed_lse_.begin(), streamed_lse_.begin() + std::ptrdiff_t(rows));
      o.debug->window_o.assign(window_o_.begin(), window_o_.begin() + std::ptrdiff_t(rows * V));
      o.debug->window_lse.assign(window_lse_.begin(), window_lse_.begin() + std::ptrdiff_t(rows));
    }
    std::vector<float>& tmp = merge_tmp_;
    tmp.resize(V);
    for (int i = 0; i < batch; ++i)
      for (int h = 0; h < hq; ++h) {
        const std::size_t r = std::size_t(i) * std::size_t(hq) + std::size_t(h);
        float gpu_lse = 0;
        merge_state_row(&streamed_o_[r * V], streamed_lse_[r], &window_o_[r * V], window_lse_[r], tmp.data(), &gpu_lse,
                        V);
        float lse = 0;
        merge_state_row(tmp.data(), gpu_lse, &cpu_o_[r * V], cpu_lse_[r], o.out.data() + r * V, &lse, V);
        if (!o.lse.empty()) o.lse.data()[r] = lse;
      }
    return gpu_seconds_;
  }

 private:
  void require_cpu_side(const char* what) const {
    if (!args_.cpu_side)
      throw state_error(std::string("gpu_engine::") + what +
                        ": the step was launched without a CPU side (gpu_step_args::cpu_side false)");
  }

  void worker_loop() {
    for (;;) {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [this] { return pending_ || stop_; });
      if (stop_) return;
      pending_ = false;
      lk.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      run_gpu_side(args_);
      gpu_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      lk.lock();
      done_ = true;
      lk.unlock();
      cv_.notify_all();
    }
  }

  void run_gpu_side(const args_type& a) {
    const int hq = layout_.num_q_heads();
    const int group = layout_.group_size();
    constexpr int V = Layout::v_dim;
    const auto rows = std::size_t(a.batch) * std::size_t(hq);
    if (a.poison_workspaces) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::fill_n(split_o_.begin(), split_o_.size(), nan);
      std::fill_n(window_o_.begin(), rows * V, nan);
    }
    // Running streamed state starts empty: (0, -inf) is the identity of the merge.
    std::fill_n(streamed_o_.begin(), rows * V, 0.0f);
    std::fill_n(streamed_lse_.begin(), rows, empty_lse);
    const block_format<Layout>& f = a.format;
    const float* q = a.q.data();
    std::vector<cpu::kv_segment>& segs = segs_;
    // Resident splits: the HBM-resident region's blocks, in place, first.
    for (const stream_split& sp : a.plan->resident_splits) {
      segs.clear();
      for (int b = 0; b < sp.num_blocks; ++b)
        segs.push_back(emulated_segment(a.resident, sp.first_block + b, f.block_tokens));
      for (int kvh = 0; kvh < layout_.kv_heads(); ++kvh) attend_split(a, sp.batch_index, kvh, segs);
    }
    if (a.plan->sparse) {
      stream_sparse(a);
    } else {
      for (const stream_chunk& c : a.plan->chunks) {
        const device_region<Layout> buf = a.ping_pong.buffer_region(c.buffer);
        copy_runs(*a.plan, c, buf);  // "H2D" of the chunk
        for (index_t s = c.split_begin; s < c.split_end; ++s) {  // "kernel" over the chunk
          const stream_split& sp = a.plan->splits[std::size_t(s)];
          segs.clear();
          for (int b = 0; b < sp.num_blocks; ++b) segs.push_back(emulated_segment(buf, sp.first_block + b, f.block_tokens));
          for (int kvh = 0; kvh < layout_.kv_heads(); ++kvh) attend_split(a, sp.batch_index, kvh, segs);
        }
      }
    }
    for (int i = 0; i < a.batch; ++i) {  // D-window "kernel"
      const window_ref<Layout>& w = a.windows[std::size_t(i)];
      segs.clear();
      for (int t0 = 0; t0 < w.tokens; t0 += f.block_tokens)
        segs.push_back(emulated_segment(w.blocks, t0 / f.block_tokens, std::min(f.block_tokens, w.tokens - t0)));
      for (int kvh = 0; kvh < layout_.kv_heads(); ++kvh) {
        const std::size_t row0 = std::size_t(i) * std::size_t(hq) + std::size_t(kvh) * group;
        Kernel::run(f, kvh, q + row0 * Layout::q_dim, Layout::q_dim, group, a.softmax_scale, segs, &window_o_[row0 * V],
                    V, &window_lse_[row0]);
      }
    }
  }

  // The emulated device's memory is host memory (see the file comment): its
  // blocks are read by the CPU kernel, the one crossing of spaces here.
  static cpu::kv_segment emulated_segment(const device_region<Layout>& r, index_t id, int tokens) noexcept {
    return {space_cast<pageable_host_space>(r.block(id)), tokens};
  }

  // Each run of chunk `c` to its place in `dst` (a ping-pong buffer or staging).
  template <class Region>
  static void copy_runs(const stream_plan& plan, const stream_chunk& c, const Region& dst) {
    for (index_t r = c.run_begin; r < c.run_end; ++r) {
      const stream_run& run = plan.runs[std::size_t(r)];
      std::memcpy(dst.block(run.dst_block).data(), run.src.data(), static_cast<std::size_t>(run.src.size()) * sizeof(bf16));
    }
  }

  // One streamed split of sequence `batch_index` for KV head `kvh` over
  // `segs`: attended into the split workspace, then folded into the running
  // streamed state of the head's query group (split order).
  void attend_split(const args_type& a, int batch_index, int kvh, std::span<const cpu::kv_segment> segs) {
    const int group = layout_.group_size();
    constexpr int V = Layout::v_dim;
    const std::size_t row0 = std::size_t(batch_index) * std::size_t(layout_.num_q_heads()) + std::size_t(kvh) * group;
    Kernel::run(a.format, kvh, a.q.data() + row0 * Layout::q_dim, Layout::q_dim, group, a.softmax_scale, segs,
                split_o_.data(), V, split_lse_.data());
    for (int g = 0; g < group; ++g)
      merge_state_row(&streamed_o_[(row0 + g) * V], streamed_lse_[row0 + g], &split_o_[std::size_t(g) * V],
                      split_lse_[std::size_t(g)], &streamed_o_[(row0 + g) * V], &streamed_lse_[row0 + g], V);
  }

  // Sparse plan: per chunk, gather (if gathered) into staging (serial % 2) and
  // copy it whole into the chunk's buffer, or copy its runs straight; then
  // attend each split per KV head over that head's list, folding in split order.
  void stream_sparse(const args_type& a) {
    const int hkv = layout_.kv_heads();
    const block_format<Layout>& f = a.format;
    const index_t block_bytes = f.block_bytes();
    const stream_plan& plan = *a.plan;
    std::vector<cpu::kv_segment>& segs = segs_;
    gather_stats gs;
    std::chrono::steady_clock::time_point g0{}, g1{};
    for (const stream_chunk& c : plan.chunks) {
      const device_region<Layout> buf = a.ping_pong.buffer_region(c.buffer);
      if (c.gathered && device_pull_) {  // as the pull kernel writes them: the runs straight into ping-pong
        copy_runs(plan, c, buf);
        gs.pulled_bytes += c.num_blocks * block_bytes;
        ++gs.pulled_chunks;
      } else if (c.gathered) {
        const auto t0 = std::chrono::steady_clock::now();
        const host_allocation& sa = staging_[std::size_t(serial_ % 2)];
        const auto st = contiguous_region(f, host_span<bf16>(reinterpret_cast<bf16*>(sa.data()),
                                                             sa.size_bytes() / index_t(sizeof(bf16))));
        copy_runs(plan, c, st);  // host gather into staging
        const auto t1 = std::chrono::steady_clock::now();
        if (gs.gathered_chunks == 0) g0 = t0;
        g1 = t1;
        gs.bytes += c.num_blocks * block_bytes;
        ++gs.gathered_chunks;
        std::memcpy(buf.block(0).data(), st.block(0).data(), static_cast<std::size_t>(c.num_blocks * block_bytes));  // one "H2D" copy
      } else {
        copy_runs(plan, c, buf);  // direct: run by run from the pinned region
        ++gs.direct_chunks;
      }
      ++serial_;
      const std::int32_t* lists = plan.block_lists.data() + c.list_begin;
      for (index_t s = c.split_begin; s < c.split_end; ++s) {
        const stream_split& sp = plan.splits[std::size_t(s)];
        for (int kvh = 0; kvh < hkv; ++kvh) {
          const std::int32_t* lst = lists + sp.list_offset + index_t(kvh) * (sp.num_blocks + 1);
          segs.clear();
          for (int j = 0; j < lst[0]; ++j)
            segs.push_back(emulated_segment(buf, sp.first_block + lst[1 + j], f.block_tokens));
          attend_split(a, sp.batch_index, kvh, segs);
        }
      }
    }
    gs.seconds = gs.gathered_chunks > 0 ? std::chrono::duration<double>(g1 - g0).count() : 0.0;
    gather_pending_ = gs;
  }

  Layout layout_;
  int max_batch_;
  std::vector<float> streamed_o_, streamed_lse_, window_o_, window_lse_, cpu_o_, cpu_lse_, split_o_, split_lse_,
      merge_tmp_;
  std::vector<cpu::kv_segment> segs_;
  host_allocation staging_[2];
  index_t staging_bytes_ = 0;
  bool device_pull_ = false;  // sparse_reservation::device_pull (emulated)
  std::uint64_t serial_ = 0;  // sparse chunks streamed so far (staging buffer = serial % 2)
  gather_stats gather_pending_{}, gather_{};
  args_type args_{};
  double gpu_seconds_ = 0.0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool pending_ = false, done_ = true, stop_ = false;
  std::thread worker_;
};

static_assert(backend<host_backend>);
static_assert(gpu_attention_engine<host_backend::gpu_engine<gqa_layout<128>>, host_backend, gqa_layout<128>>);

}  // namespace writescope
