// SPDX-License-Identifier: Apache-2.0
// bench/prefill_write_bench_kernels.cu — the stand-in for a layer's compute in
// prefill_write_bench: one block that spins for a given time on the caller stream.
#include <cuda_runtime_api.h>

#include <writescope/cuda/cuda_error.hpp>

namespace wsb {
namespace {

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace

void launch_spin(double milliseconds, cudaStream_t stream) {
  static const long long cycles_per_ms = [] {
    int dev = 0, khz = 0;
    WS_CUDA_TRY(cudaGetDevice(&dev));
    WS_CUDA_TRY(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    return static_cast<long long>(khz);
  }();
  spin_kernel<<<1, 32, 0, stream>>>(static_cast<long long>(milliseconds * double(cycles_per_ms)));
  WS_CUDA_CHECK_LAST();
}

}  // namespace wsb
