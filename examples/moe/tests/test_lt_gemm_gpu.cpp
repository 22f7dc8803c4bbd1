// SPDX-License-Identifier: Apache-2.0
// The prefill expert GEMMs' cuBLASLt path (ws_moe/gpu/lt_batched_gemm.hpp) on
// the device against a host fp64 product of the same bf16 operands. Label
// "gpu": exits 77 (SKIPPED) without a device, like tests/cuda.
//
// The decoder's shape: Y [rows][out] = X [rows][in] · Wᵀ per expert, i.e.
// column-major C [out x rows] = op_T(W [in x out]) · X [in x rows]. Items of one
// pointer-array call have their own W, X and Y pointers into packed buffers;
// row counts 1, 63, 64, 65, 200 and 4097 (odd, around a tile, across the
// power-of-two classes); every output element outside the written rows is
// poisoned (NaN) and must stay so. The class cache: calls whose n and count
// round up to the same powers of two share one heuristic query.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <writescope/cuda/cuda_error.hpp>

#include "device_array.hpp"
#include "ws_moe/gpu/kernel_math.hpp"
#include "ws_moe/gpu/lt_batched_gemm.hpp"

using ws_moe::test::device_array;

namespace {

std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.5f);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = ws_moe::gpu::float_to_bf16(d(rng));
  return v;
}

/// Checks Y rows [r0, r0 + rows) of item (w, x) against the fp64 product;
/// returns the largest |error| relative to max(1, |reference|).
double max_rel_err(const std::vector<float>& y, std::size_t y0, const std::vector<std::uint16_t>& w, std::size_t w0,
                   const std::vector<std::uint16_t>& x, std::size_t x0, int rows, int out, int in) {
  double worst = 0.0;
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < out; ++o) {
      double ref = 0.0;
      for (int i = 0; i < in; ++i)
        ref += double(ws_moe::gpu::bf16_to_float(w[w0 + std::size_t(o) * in + i])) *
               double(ws_moe::gpu::bf16_to_float(x[x0 + std::size_t(r) * in + i]));
      const double got = y[y0 + std::size_t(r) * out + o];
      const double e = std::isfinite(got) ? std::fabs(got - ref) / std::max(1.0, std::fabs(ref)) : 1e30;
      worst = std::max(worst, e);
    }
  return worst;
}

bool poisoned(const std::vector<float>& y, std::size_t from, std::size_t to) {
  for (std::size_t i = from; i < to; ++i)
    if (!std::isnan(y[i])) return false;
  return true;
}

}  // namespace

TEST_CASE("lt_batched_gemm: pointer-array items of 1..4097 rows equal the fp64 product; unwritten rows stay poisoned") {
  const int out = 96, in = 264;  // in % 8 == 0 (16-byte rows), not a power of two
  const std::vector<int> rows = {1, 63, 64, 65, 200, 4097};
  const int items = int(rows.size());
  std::size_t total = 0;
  std::vector<std::size_t> first;
  for (int r : rows) {
    first.push_back(total);
    total += std::size_t(r) + 8;  // a gap of 8 poisoned rows after every item
  }
  const auto w_h = random_bf16(std::size_t(items) * out * in, 1);
  const auto x_h = random_bf16(total * in, 2);
  const std::vector<float> y_poison(total * out, std::numeric_limits<float>::quiet_NaN());
  device_array<std::uint16_t> w(w_h), x(x_h);
  device_array<float> y(y_poison);
  ws_moe::gpu::lt_batched_gemm lt;
  // one call per item, each with its own n
  for (int e = 0; e < items; ++e) {
    std::vector<const void*> tab = {w.p + std::size_t(e) * out * in, x.p + first[std::size_t(e)] * in,
                                    y.p + first[std::size_t(e)] * out};
    device_array<const void*> t(tab);
    lt.run(true, false, out, rows[std::size_t(e)], in, CUDA_R_16BF, t.p, in, t.p + 1, in,
           reinterpret_cast<float* const*>(const_cast<void**>(t.p + 2)), out, 1, nullptr);
    WS_CUDA_TRY(cudaDeviceSynchronize());
  }
  const std::vector<float> y1 = y.get();
  for (int e = 0; e < items; ++e) {
    CAPTURE(rows[std::size_t(e)]);
    CHECK(max_rel_err(y1, first[std::size_t(e)] * out, w_h, std::size_t(e) * out * in, x_h, first[std::size_t(e)] * in,
                      rows[std::size_t(e)], out, in) < 1e-4);
    CHECK(poisoned(y1, (first[std::size_t(e)] + std::size_t(rows[std::size_t(e)])) * out,
                   (first[std::size_t(e)] + std::size_t(rows[std::size_t(e)]) + 8) * out));
  }
}

TEST_CASE("lt_batched_gemm: one call over several items; calls of one class share one heuristic query") {
  const int out = 128, in = 512, count = 3;
  const int n_a = 65, n_b = 100;  // both round up to 128: one class at count 3 (rounds to 4)
  const std::size_t per = 128;    // rows reserved per item
  const auto w_h = random_bf16(std::size_t(count) * out * in, 3);
  const auto x_h = random_bf16(std::size_t(count) * per * in, 4);
  const std::vector<float> y_poison(std::size_t(count) * per * out, std::numeric_limits<float>::quiet_NaN());
  device_array<std::uint16_t> w(w_h), x(x_h);
  device_array<float> y(y_poison);
  std::vector<const void*> tab;
  for (int e = 0; e < count; ++e) tab.push_back(w.p + std::size_t(e) * out * in);
  for (int e = 0; e < count; ++e) tab.push_back(x.p + std::size_t(e) * per * in);
  for (int e = 0; e < count; ++e) tab.push_back(y.p + std::size_t(e) * per * out);
  device_array<const void*> t(tab);
  auto* c = reinterpret_cast<float* const*>(const_cast<void**>(t.p + 2 * count));
  ws_moe::gpu::lt_batched_gemm lt;
  lt.run(true, false, out, n_a, in, CUDA_R_16BF, t.p, in, t.p + count, in, c, out, count, nullptr);
  WS_CUDA_TRY(cudaDeviceSynchronize());
  const std::vector<float> ya = y.get();
  const long after_first = lt.heuristic_queries();
  lt.run(true, false, out, n_b, in, CUDA_R_16BF, t.p, in, t.p + count, in, c, out, count, nullptr);
  WS_CUDA_TRY(cudaDeviceSynchronize());
  const std::vector<float> yb = y.get();
  CHECK(after_first >= 1);
  CHECK(lt.heuristic_queries() == after_first);  // the same class: no new query (an exact fallback would add one)
  // two items: count 2 is another class (a new query); the third item's rows are left as they were
  lt.run(true, false, out, n_a, in, CUDA_R_16BF, t.p, in, t.p + count, in, c, out, 2, nullptr);
  WS_CUDA_TRY(cudaDeviceSynchronize());
  CHECK(lt.heuristic_queries() > after_first);
  for (int e = 0; e < count; ++e) {
    CAPTURE(e);
    const std::size_t y0 = std::size_t(e) * per * out, w0 = std::size_t(e) * out * in, x0 = std::size_t(e) * per * in;
    CHECK(max_rel_err(ya, y0, w_h, w0, x_h, x0, n_a, out, in) < 1e-4);
    CHECK(poisoned(ya, y0 + std::size_t(n_a) * out, y0 + per * out));
    CHECK(max_rel_err(yb, y0, w_h, w0, x_h, x0, n_b, out, in) < 1e-4);
    CHECK(poisoned(yb, y0 + std::size_t(n_b) * out, y0 + per * out));
  }
}

TEST_CASE("lt_batched_gemm::run_single: plain products whose n changes from call to call") {
  const int out = 80, in = 136;
  const std::vector<int> rows = {3, 129, 2048};
  const std::size_t cap = 2048;
  const auto w_h = random_bf16(std::size_t(out) * in, 5);
  const auto x_h = random_bf16(cap * in, 6);
  ws_moe::gpu::lt_batched_gemm lt;
  device_array<std::uint16_t> w(w_h), x(x_h);
  for (int n : rows) {
    CAPTURE(n);
    const std::vector<float> y_poison(cap * out, std::numeric_limits<float>::quiet_NaN());
    device_array<float> y(y_poison);
    lt.run_single(true, false, out, n, in, CUDA_R_16BF, w.p, in, x.p, in, y.p, out, nullptr);
    WS_CUDA_TRY(cudaDeviceSynchronize());
    const std::vector<float> yh = y.get();
    CHECK(max_rel_err(yh, 0, w_h, 0, x_h, 0, n, out, in) < 1e-4);
    CHECK(poisoned(yh, std::size_t(n) * out, cap * out));
  }
}
