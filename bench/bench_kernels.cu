// SPDX-License-Identifier: Apache-2.0
// bench/bench_kernels.cu — the one .cu file of the CUDA benchmarks: explicit
// instantiations of the GPU kernels' launchers (writescope/cuda/kernels.cuh)
// for the layouts of the three presets (Qwen3-30B-A3B and Mixtral-8x7B: GQA
// d 128; DeepSeek-V2-Lite: absorbed MLA 512 + 64), with the slow-consumer
// kernels of the ablation arms' backend (cuda_test_hooks) and the resident-region
// kernels (resident_bench). Compiled by nvcc.
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE_COMMON()
WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
WS_CUDA_INSTANTIATE(writescope::mla_layout<512, 64>)
WS_CUDA_INSTANTIATE_TEST_HOOKS(writescope::gqa_layout<128>)
WS_CUDA_INSTANTIATE_TEST_HOOKS(writescope::mla_layout<512, 64>)

// The same-run HBM read rate of ws_bench --mode hbm (bench/hbm_ceiling.hpp):
// cub::DeviceReduce::Sum over a device buffer of 64-bit words, the best of a
// few timed passes after one warm-up (the sum is read back so nothing is elided).
#include <cub/device/device_reduce.cuh>

#include "hbm_ceiling.hpp"

#include <writescope/cuda/cuda_error.hpp>

#include <algorithm>

namespace wsb {

double hbm_read_gbps(std::size_t bytes, int passes) {
  const std::size_t n = std::max<std::size_t>(bytes / sizeof(unsigned long long), 1);
  unsigned long long* in = nullptr;
  unsigned long long* sum = nullptr;
  void* temp = nullptr;
  std::size_t temp_bytes = 0;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  double best = 0.0;
  auto release = [&] {
    (void)cudaFree(in);
    (void)cudaFree(sum);
    (void)cudaFree(temp);
    if (e0 != nullptr) (void)cudaEventDestroy(e0);
    if (e1 != nullptr) (void)cudaEventDestroy(e1);
  };
  try {
    WS_CUDA_TRY(cudaMalloc(&in, n * sizeof(unsigned long long)));
    WS_CUDA_TRY(cudaMalloc(&sum, sizeof(unsigned long long)));
    WS_CUDA_TRY(cudaMemset(in, 1, n * sizeof(unsigned long long)));
    WS_CUDA_TRY(cub::DeviceReduce::Sum(nullptr, temp_bytes, in, sum, n));
    WS_CUDA_TRY(cudaMalloc(&temp, std::max<std::size_t>(temp_bytes, 1)));
    WS_CUDA_TRY(cudaEventCreate(&e0));
    WS_CUDA_TRY(cudaEventCreate(&e1));
    for (int p = 0; p <= std::max(passes, 1); ++p) {  // pass 0 warms up
      WS_CUDA_TRY(cudaEventRecord(e0));
      WS_CUDA_TRY(cub::DeviceReduce::Sum(temp, temp_bytes, in, sum, n));
      WS_CUDA_TRY(cudaEventRecord(e1));
      WS_CUDA_TRY(cudaEventSynchronize(e1));
      float ms = 0;
      WS_CUDA_TRY(cudaEventElapsedTime(&ms, e0, e1));
      if (p > 0 && ms > 0) best = std::max(best, double(n * sizeof(unsigned long long)) / (double(ms) * 1e-3) / 1e9);
    }
    unsigned long long host_sum = 0;
    WS_CUDA_TRY(cudaMemcpy(&host_sum, sum, sizeof host_sum, cudaMemcpyDeviceToHost));
    (void)host_sum;
  } catch (...) {
    release();
    throw;
  }
  release();
  return best;
}

}  // namespace wsb
