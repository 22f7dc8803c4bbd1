// SPDX-License-Identifier: Apache-2.0
// examples/moe/tools/bench_cuda.hpp — what the CUDA benchmarks of the example
// decoders share: command-line value checks, a device buffer, random bf16
// data, timing of a callable with CUDA events, and the cuBLAS bf16 GEMM
// ceiling every benchmark reports its rates against (same run).
//
// time_runs records its events on `stream` (nullptr: the legacy default
// stream); the callable must enqueue its work on that stream. Errors are
// exceptions (std::runtime_error; usage_error for command-line values).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <writescope/cuda/cuda_error.hpp>

#include "ws_moe/gpu/kernel_math.hpp"

namespace ws_moe::bench {

namespace gpu = ws_moe::gpu;
using json = nlohmann::json;

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t a = 0;
  while (a <= s.size()) {
    const std::size_t b = std::min(s.find(',', a), s.size());
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

inline int parse_int(const std::string& flag, const std::string& v, int lo) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < lo || x > 1000000)
    throw usage_error(flag + ": '" + v + "' is not an integer >= " + std::to_string(lo));
  return int(x);
}

inline void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + " failed: cuBLAS status " + std::to_string(int(s)));
}

template <class T>
struct device_buffer {
  T* p = nullptr;
  explicit device_buffer(std::size_t n) { WS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(T))); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { (void)cudaFree(p); }
};

/// Random bf16 of unit variance (uniform on [-sqrt 3, sqrt 3]), a fast
/// generator: the values only need to be ordinary.
inline std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint16_t> v(n);
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float u = float(x >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    v[i] = gpu::float_to_bf16((2.0f * u - 1.0f) * 1.7320508f);
  }
  return v;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Seconds of each of `reps` runs of f on `stream` (events around each run),
/// after `warmup` untimed runs.
template <class F>
std::vector<double> time_runs(F f, int warmup, int reps, cudaStream_t stream = nullptr) {
  for (int i = 0; i < warmup; ++i) f();
  WS_CUDA_TRY(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  WS_CUDA_TRY(cudaEventCreate(&a));
  WS_CUDA_TRY(cudaEventCreate(&b));
  std::vector<double> s;
  for (int i = 0; i < reps; ++i) {
    WS_CUDA_TRY(cudaEventRecord(a, stream));
    f();
    WS_CUDA_TRY(cudaEventRecord(b, stream));
    WS_CUDA_TRY(cudaEventSynchronize(b));
    float ms = 0;
    WS_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
    s.push_back(double(ms) * 1e-3);
  }
  WS_CUDA_TRY(cudaEventDestroy(a));
  WS_CUDA_TRY(cudaEventDestroy(b));
  return s;
}

/// cuBLAS bf16 GEMM n^3 with fp32 output and fp32 compute: median TFLOP/s.
inline json gemm_ceiling(int n, int warmup, int reps) {
  cublasHandle_t h;
  cublas_check(cublasCreate(&h), "cublasCreate");
  device_buffer<std::uint16_t> a(std::size_t(n) * n), b(std::size_t(n) * n);
  device_buffer<float> c(std::size_t(n) * n);
  {
    const std::vector<std::uint16_t> r = random_bf16(std::size_t(n) * n, 3);
    WS_CUDA_TRY(cudaMemcpy(a.p, r.data(), r.size() * 2, cudaMemcpyHostToDevice));
    WS_CUDA_TRY(cudaMemcpy(b.p, r.data(), r.size() * 2, cudaMemcpyHostToDevice));
  }
  const float one = 1.0f, zero = 0.0f;
  const auto run = [&] {
    cublas_check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.p, CUDA_R_16BF, n, b.p, CUDA_R_16BF, n, &zero,
                              c.p, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  };
  const std::vector<double> s = time_runs(run, warmup, reps);
  cublas_check(cublasDestroy(h), "cublasDestroy");
  const double flops = 2.0 * double(n) * n * n, med = median(s);
  return {{"name", "cublas_bf16_gemm_" + std::to_string(n) + "_fp32_out"},
          {"m", n}, {"n", n}, {"k", n}, {"median_seconds", med},
          {"best_seconds", *std::min_element(s.begin(), s.end())}, {"tflops", flops / med * 1e-12}};
}

}  // namespace ws_moe::bench
