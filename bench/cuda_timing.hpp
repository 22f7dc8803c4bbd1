// SPDX-License-Identifier: Apache-2.0
// bench/cuda_timing.hpp — what the CUDA microbenchmarks (micro_bench,
// resident_bench) time with: device memory freed on destruction, and a
// non-blocking stream with two events that times the work a callable enqueues.
// Host compiler, CUDA runtime API; throws writescope::device_error (WS_CUDA_TRY).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>

#include <writescope/cuda/cuda_error.hpp>

namespace wsb {

/// Device memory (cudaMalloc, at least 16 bytes), freed on destruction.
class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) { WS_CUDA_TRY(cudaMalloc(&p_, std::max<std::size_t>(bytes, 16))); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { (void)cudaFree(p_); }
  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(p_); }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

/// A non-blocking stream with two timing events.
struct timer_stream {
  cudaStream_t s = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  timer_stream() {
    WS_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    WS_CUDA_TRY(cudaEventCreate(&e0));
    WS_CUDA_TRY(cudaEventCreate(&e1));
  }
  timer_stream(const timer_stream&) = delete;
  timer_stream& operator=(const timer_stream&) = delete;
  ~timer_stream() {
    (void)cudaStreamSynchronize(s);
    (void)cudaEventDestroy(e0);
    (void)cudaEventDestroy(e1);
    (void)cudaStreamDestroy(s);
  }
  /// Seconds of the work `f(stream)` enqueues, after `before(stream)` (untimed)
  /// on the same stream; synchronizes on the end event.
  template <class Before, class F>
  double time(Before&& before, F&& f) {
    before(s);
    WS_CUDA_TRY(cudaEventRecord(e0, s));
    f(s);
    WS_CUDA_TRY(cudaEventRecord(e1, s));
    WS_CUDA_TRY(cudaEventSynchronize(e1));
    float ms = 0;
    WS_CUDA_TRY(cudaEventElapsedTime(&ms, e0, e1));
    return double(ms) * 1e-3;
  }
  /// Seconds of the work `f(stream)` enqueues.
  template <class F>
  double time(F&& f) {
    return time([](cudaStream_t) {}, f);
  }
};

}  // namespace wsb
