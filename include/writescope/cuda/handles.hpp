// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/handles.hpp — RAII owners of the CUDA runtime objects the
// backend uses (streams, events, device memory, page-locked staging) and the
// few free functions around them. Host compiler only; includes nothing beyond
// <cuda_runtime_api.h>.
//
// Memory spaces: device_buffer owns device memory (cudaMalloc);
// allocate_page_locked returns page-locked host memory (cudaHostAlloc,
// portable), recorded in pinned_registry for the backend's copy splitting.
// Errors: creation throws cuda_error (WS_CUDA_TRY); allocation throws
// resource_error (device memory) or pinned_memory_error (page-locked memory)
// naming what was allocated and the size. Destructors never throw: a stream's
// destructor synchronizes it first; device and page-locked memory are freed
// after the work that uses them (cudaFree waits; the staging release
// synchronizes the device).
// Threads: the objects are not shared between threads unless a caller orders it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

#include "../config.hpp"
#include "../host_memory.hpp"
#include "../memory_space.hpp"
#include "cuda_error.hpp"
#include "pinned_allocators.hpp"

namespace writescope::cuda_detail {

/// A non-blocking stream (no implicit sync with the legacy default stream).
class unique_stream {
 public:
  unique_stream() = default;
  static unique_stream create() {
    unique_stream s;
    WS_CUDA_TRY(cudaStreamCreateWithFlags(&s.s_, cudaStreamNonBlocking));
    return s;
  }
  unique_stream(unique_stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  unique_stream& operator=(unique_stream&& o) noexcept {
    std::swap(s_, o.s_);
    return *this;
  }
  ~unique_stream() {
    if (s_ != nullptr) {
      ignore(cudaStreamSynchronize(s_));
      ignore(cudaStreamDestroy(s_));
    }
  }
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

/// An event; without timing (cudaEventDisableTiming) unless asked for.
class unique_event {
 public:
  unique_event() = default;
  static unique_event create(bool timing = false) {
    unique_event e;
    WS_CUDA_TRY(cudaEventCreateWithFlags(&e.e_, timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }
  unique_event(unique_event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  unique_event& operator=(unique_event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  ~unique_event() {
    if (e_ != nullptr) ignore(cudaEventDestroy(e_));
  }
  [[nodiscard]] cudaEvent_t get() const noexcept { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

inline void record(const unique_event& e, cudaStream_t s) { WS_CUDA_TRY(cudaEventRecord(e.get(), s)); }
inline void wait(cudaStream_t s, const unique_event& e) { WS_CUDA_TRY(cudaStreamWaitEvent(s, e.get(), 0)); }

/// cudaEventQuery without leaving cudaErrorNotReady in the runtime's last-error
/// slot (the next WS_CUDA_CHECK_LAST must not see it). True when complete.
inline bool event_done(const unique_event& e) {
  const cudaError_t r = cudaEventQuery(e.get());
  if (r == cudaSuccess) return true;
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(r, "cudaEventQuery", __FILE__, __LINE__);
  return false;
}

/// Device memory (cudaMalloc), freed on destruction. Movable.
class device_buffer {
 public:
  device_buffer() = default;
  device_buffer(std::byte* p, index_t bytes) noexcept : p_(p), bytes_(bytes) {}
  device_buffer(device_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (p_ != nullptr) ignore(cudaFree(p_));  // cudaFree waits for work using it
  }
  [[nodiscard]] std::byte* data() const noexcept { return p_; }
  [[nodiscard]] index_t size_bytes() const noexcept { return bytes_; }
  [[nodiscard]] device_span<std::byte> span() const noexcept { return device_span<std::byte>(p_, bytes_); }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return reinterpret_cast<T*>(p_);
  }

 private:
  std::byte* p_ = nullptr;
  index_t bytes_ = 0;
};

/// cudaMalloc of `bytes` (none for bytes <= 0); throws resource_error naming
/// `what` and the size.
inline device_buffer allocate_device_buffer(index_t bytes, const char* what) {
  if (bytes <= 0) return {};
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, static_cast<std::size_t>(bytes));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw resource_error(std::string(what) + ": cudaMalloc of " + format_bytes(bytes) + " of device memory failed: " +
                         cuda_error_text(e));
  }
  return device_buffer(static_cast<std::byte*>(p), bytes);
}

inline void release_staging(void* p, index_t, void*) noexcept {
  ignore(cudaDeviceSynchronize());
  try {
    pinned_registry::instance().remove(p);
  } catch (...) {
  }
  ignore(cudaFreeHost(p));
}

/// Page-locked host staging (cudaHostAlloc, portable) of `bytes` (none for
/// bytes <= 0), recorded in pinned_registry; throws pinned_memory_error.
inline host_allocation allocate_page_locked(index_t bytes) {
  if (bytes <= 0) return {};
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, static_cast<std::size_t>(bytes), cudaHostAllocPortable);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw pinned_memory_error("pinned memory: cudaHostAlloc of " + format_bytes(bytes) +
                              " for a staging buffer failed: " + cuda_error_text(e));
  }
  try {
    pinned_registry::instance().add(p, bytes);
  } catch (...) {
    ignore(cudaFreeHost(p));
    throw;
  }
  return host_allocation(p, bytes, &release_staging);
}

}  // namespace writescope::cuda_detail
