// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/tensor_parallel.hpp — tensor_parallel_gqa and
// tensor_parallel_mla (writescope/tensor_parallel.hpp, docs/MULTI-GPU.md) on
// basic_cuda_backend: the device path's part that needs the CUDA runtime.
// Include this header (it includes both) to compose cuda_backend ranks; the
// compositions refuse a device backend at compile time without it. Host
// compiler only; the merge kernel it launches (launch_merge_rows) is declared
// in kernels.hpp and instantiated by WS_CUDA_INSTANTIATE (kernels.cuh).
//
// Devices and streams: rank r is its backend (basic_cuda_backend::device(),
// caller_stream()). "The caller" is rank 0: the step's q, out and lse, and
// the appended KV, are device memory of rank 0's device, written and read in
// the order of rank 0's caller stream. Every operation on rank r runs with
// rank r's device current (scope). Rank r's work of one composite call is
// enqueued on rank r's caller stream: it first waits for the event `ready`
// recorded on rank 0's caller stream when the call begins, and records its
// own event `done[r]` when its work is enqueued; rank 0's caller stream waits
// for every done[r] before the call returns (a rank whose caller stream is
// rank 0's needs neither). Copies between devices are peer copies
// (cudaMemcpyPeerAsync, cudaMemcpy3DPeerAsync: no peer access needed), on the
// stream of the rank whose work they are.
//
// Errors: a backend given for two ranks is refused before this is attached
// (tensor_parallel.hpp: config_error naming both ranks and the device); a failing CUDA call throws
// cuda_error (WS_CUDA_TRY). The *_quiet members, for exception paths, ignore
// CUDA errors.
// NUMA: numa_node(backend) is the node of the backend's device
// (cuda_device_numa_node, cuda/numa.hpp), which tensor_parallel.hpp gives each
// rank's copy of a numa_placeable_allocator on a host with several nodes.
// Threads: begin_call / end_call / init_states / merge_rows on the driving
// thread; rank_begin / rank_end / copy_rows for rank r on the thread that runs
// rank r (rank_team), between them.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "../tensor_parallel.hpp"
#include "cuda_backend.hpp"
#include "cuda_error.hpp"
#include "handles.hpp"
#include "kernels.hpp"
#include "numa.hpp"

namespace writescope::detail {

template <cuda_hooks Hooks>
struct tp_device<basic_cuda_backend<Hooks>> {
 public:
  using backend_type = basic_cuda_backend<Hooks>;
  static constexpr bool available = true;

  /// Makes the backend's device current until destruction, then restores the
  /// device that was current. Throws cuda_error (quiet: ignores errors).
  class scope {
   public:
    explicit scope(const backend_type& be, bool quiet = false) : device_(be.device()) {
      if (quiet) {
        if (cudaGetDevice(&prev_) != cudaSuccess) {
          (void)cudaGetLastError();
          prev_ = device_;
          return;
        }
        if (prev_ != device_ && cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
        return;
      }
      WS_CUDA_TRY(cudaGetDevice(&prev_));
      if (prev_ != device_) WS_CUDA_TRY(cudaSetDevice(device_));
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() {
      if (prev_ != device_) cuda_detail::ignore(cudaSetDevice(prev_));
    }

   private:
    int device_ = 0;
    int prev_ = 0;
  };

  tp_device() = default;
  tp_device(const tp_device&) = delete;
  tp_device& operator=(const tp_device&) = delete;
  tp_device(tp_device&&) noexcept = default;
  tp_device& operator=(tp_device&&) = delete;

  /// The ranks' backends (non-null and distinct, checked by the caller).
  /// Throws cuda_error when an event cannot be created (on its rank's device).
  void attach(std::span<backend_type* const> backends, const char* /*what*/) {
    const int n = int(backends.size());
    backends_.assign(backends.begin(), backends.end());
    done_.clear();
    done_.resize(std::size_t(n));
    recorded_.assign(std::size_t(n), 0);
    {
      const scope g(*backends_[0]);
      ready_ = cuda_detail::unique_event::create();
    }
    for (int r = 0; r < n; ++r) {
      const scope g(*backends_[std::size_t(r)]);
      done_[std::size_t(r)] = cuda_detail::unique_event::create();
    }
  }

  /// The host NUMA node of the backend's device (cuda_device_numa_node;
  /// no_numa_node where the platform does not report it). Throws cuda_error.
  static int numa_node(const backend_type& be) { return cuda_device_numa_node(be.device()); }

  [[nodiscard]] int device(int r) const noexcept { return backends_[std::size_t(r)]->device(); }
  [[nodiscard]] cudaStream_t stream(int r) const noexcept { return backends_[std::size_t(r)]->caller_stream(); }
  /// Whether rank r's device is rank 0's (the caller's).
  [[nodiscard]] bool same_device(int r) const noexcept { return device(r) == device(0); }
  /// Whether rank r's caller stream is rank 0's (then no event orders them).
  [[nodiscard]] bool caller_stream(int r) const noexcept { return same_device(r) && stream(r) == stream(0); }

  /// A composite call begins: `ready` recorded on rank 0's caller stream.
  void begin_call() {
    std::fill(recorded_.begin(), recorded_.end(), char{0});
    const scope g(*backends_[0]);
    cuda_detail::record(ready_, stream(0));
  }
  /// Rank r's stream waits for `ready` (rank r's device current).
  void rank_begin(int r) {
    if (!caller_stream(r)) cuda_detail::wait(stream(r), ready_);
  }
  /// Rank r's work of this call is enqueued: done[r] recorded on its stream.
  void rank_end(int r) {
    if (caller_stream(r)) return;
    cuda_detail::record(done_[std::size_t(r)], stream(r));
    recorded_[std::size_t(r)] = 1;
  }
  void rank_end_quiet(int r) noexcept {
    if (caller_stream(r)) return;
    if (cudaEventRecord(done_[std::size_t(r)].get(), stream(r)) == cudaSuccess)
      recorded_[std::size_t(r)] = 1;
    else
      (void)cudaGetLastError();
  }
  /// Rank 0's caller stream waits for every rank's done[r] of this call.
  void end_call() {
    const scope g(*backends_[0]);
    for (std::size_t r = 0; r < recorded_.size(); ++r)
      if (recorded_[r]) cuda_detail::wait(stream(0), done_[r]);
  }
  void end_call_quiet() noexcept {
    const scope g(*backends_[0], true);
    for (std::size_t r = 0; r < recorded_.size(); ++r)
      if (recorded_[r] && cudaStreamWaitEvent(stream(0), done_[r].get(), 0) != cudaSuccess) (void)cudaGetLastError();
  }

  /// `height` rows of `width` bytes from `src` (rows `spitch` bytes apart, on
  /// rank src_rank's device) to `dst` (rows `dpitch` apart, on rank
  /// dst_rank's device), on rank stream_rank's stream: one contiguous copy
  /// when both pitches are the width, else a strided one; peer copies
  /// (cudaMemcpyPeerAsync / cudaMemcpy3DPeerAsync) between two devices.
  void copy_rows(int stream_rank, void* dst, std::size_t dpitch, int dst_rank, const void* src, std::size_t spitch,
                 int src_rank, std::size_t width, std::size_t height) {
    if (width == 0 || height == 0) return;
    const cudaStream_t s = stream(stream_rank);
    const int dd = device(dst_rank), sd = device(src_rank);
    const bool dense = (dpitch == width && spitch == width) || height == 1;
    if (dense) {
      const std::size_t bytes = width * height;
      if (dd == sd)
        WS_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
      else
        WS_CUDA_TRY(cudaMemcpyPeerAsync(dst, dd, src, sd, bytes, s));
      return;
    }
    if (dd == sd) {
      WS_CUDA_TRY(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, s));
      return;
    }
    cudaMemcpy3DPeerParms p{};
    p.srcPtr = cudaPitchedPtr{const_cast<void*>(src), spitch, width, height};
    p.srcDevice = sd;
    p.dstPtr = cudaPitchedPtr{dst, dpitch, width, height};
    p.dstDevice = dd;
    p.extent = cudaExtent{width, height, 1};
    WS_CUDA_TRY(cudaMemcpy3DPeerAsync(&p, s));
  }

  /// Waits for rank r's caller stream (before a buffer it may read is freed).
  void synchronize_rank(int r) { WS_CUDA_TRY(cudaStreamSynchronize(stream(r))); }

  /// Sets `rows` states ([rows][v_dim], [rows]) on rank 0's device to the
  /// empty partial, on rank 0's caller stream.
  template <kv_layout Layout>
  void init_states(float* o, float* lse, index_t rows) {
    const scope g(*backends_[0]);
    gpu::launch_init_state<Layout>(o, lse, rows, stream(0));
  }

  /// state[rows[k]] ⊕= part[k] for every k and query head, on rank 0's caller
  /// stream (launch_merge_rows, max_merge_rows rows per launch, in order).
  template <kv_layout Layout>
  void merge_rows(float* state_o, float* state_lse, const float* part_o, const float* part_lse, int hq,
                  std::span<const int> rows) {
    const scope g(*backends_[0]);
    for (std::size_t k0 = 0; k0 < rows.size(); k0 += std::size_t(gpu::max_merge_rows)) {
      const std::size_t c = std::min(rows.size() - k0, std::size_t(gpu::max_merge_rows));
      gpu::merge_rows_params p{};
      p.state_o = state_o;
      p.state_lse = state_lse;
      p.part_o = part_o;
      p.part_lse = part_lse;
      p.hq = hq;
      p.part_begin = int(k0);
      p.num_rows = int(c);
      for (std::size_t k = 0; k < c; ++k) p.rows[k] = rows[k0 + k];
      gpu::launch_merge_rows<Layout>(p, stream(0));
    }
  }

 private:
  std::vector<backend_type*> backends_;
  cuda_detail::unique_event ready_;               // on rank 0's device
  std::vector<cuda_detail::unique_event> done_;   // [rank] on the rank's device
  std::vector<char> recorded_;                    // [rank] done recorded in this call
};

}  // namespace writescope::detail
