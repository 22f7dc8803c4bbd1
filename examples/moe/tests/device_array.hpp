// SPDX-License-Identifier: Apache-2.0
// examples/moe/tests/device_array.hpp — a device copy of a host vector for the
// GPU tests of the prefill attention (test_flash_prefill_gpu.cpp,
// test_cudnn_prefill_gpu.cpp): cudaMalloc'd device memory holding n elements
// of T, filled from the host vector at construction, read back with get(),
// freed at destruction. Synchronous copies on the default stream; CUDA
// failures throw writescope::cuda_error (WS_CUDA_TRY).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include <writescope/cuda/cuda_error.hpp>

namespace ws_moe::test {

template <class T>
struct device_array {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_array(const std::vector<T>& h) : n(h.size()) {
    WS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(T)));
    if (n > 0) WS_CUDA_TRY(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { (void)cudaFree(p); }
  /// The device contents, copied back to the host.
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n > 0) WS_CUDA_TRY(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

}  // namespace ws_moe::test
