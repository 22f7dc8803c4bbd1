// SPDX-License-Identifier: Apache-2.0
// The CUDA path's grouped-expert kernel (ops.cu launch_expert_gemv) on the
// device against its host reference (gemm.hpp expert_gemv_reference, which
// test_gpu_math pins to the per-expert GEMM path bit for bit). Label "gpu":
// exits 77 (SKIPPED) without a device, like tests/cuda.
//
// Shapes: out not a multiple of the 8 warps of a block, experts of 0, 1, 8, 9
// and 33 rows (one, two and five passes of the kernel's 8-row loop), one
// expert in host memory (null table entry) whose rows must stay poisoned, and
// rows of the output outside every expert poisoned too; each launch again over
// the routed rows' sorted experts (block_experts) must give the same bits.
// Also the router (launch_route against route_op), RMSNorm, and the decode
// step's one-launch grouping of routed pairs (launch_group_pairs) against the
// tables of the three-launch path it replaces (a stable sort, expert_bounds_op,
// scatter_rows_op), element for element, up to the 1,024 pairs one launch takes.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include <writescope/cuda/cuda_error.hpp>

#include "ws_moe/gpu/gemm.hpp"
#include "ws_moe/gpu/kernel_math.hpp"
#include "ws_moe/gpu/ops.hpp"

using namespace ws_moe;
using gpu::idx;

namespace {

template <class T>
struct device_array {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_array(const std::vector<T>& h) : n(h.size()) {
    WS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T)));
    WS_CUDA_TRY(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { (void)cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    WS_CUDA_TRY(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = gpu::float_to_bf16(d(rng));
  return v;
}

}  // namespace

TEST_CASE("launch_expert_gemv equals expert_gemv_reference (gate-up and plain, bf16 and fp32 inputs)") {
  const int E = 6, out = 76, in = 264;                   // out % 8 != 0; in % 8 == 0, not a power of two
  const std::vector<int> offsets = {0, 1, 1, 10, 43, 51, 59};  // rows 1, 0, 9, 33, 8, 8
  const int host_expert = 4;
  const int rows = offsets.back() + 3;  // 3 rows past every expert: never written
  std::vector<std::vector<std::uint16_t>> g, u;
  for (int e = 0; e < E; ++e) {
    g.push_back(random_bf16(std::size_t(out) * in, 10 + std::uint64_t(e), 0.1f));
    u.push_back(random_bf16(std::size_t(out) * in, 20 + std::uint64_t(e), 0.1f));
  }
  std::vector<float> x(std::size_t(rows) * in);
  {
    std::mt19937_64 rng(3);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (float& v : x) v = d(rng);
  }
  std::vector<std::unique_ptr<device_array<std::uint16_t>>> dg, du;
  std::vector<const void*> tg(static_cast<std::size_t>(E)), tu(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) {
    dg.push_back(std::make_unique<device_array<std::uint16_t>>(g[std::size_t(e)]));
    du.push_back(std::make_unique<device_array<std::uint16_t>>(u[std::size_t(e)]));
    tg[std::size_t(e)] = e == host_expert ? nullptr : dg.back()->p;
    tu[std::size_t(e)] = e == host_expert ? nullptr : du.back()->p;
  }
  const device_array<const void*> dtg(tg), dtu(tu);
  const device_array<int> doff(offsets);
  const device_array<float> dx(x);
  std::vector<unsigned> keys;  // each routed row's expert, ascending: what device routing sorts
  for (int e = 0; e < E; ++e)
    for (int r = offsets[std::size_t(e)]; r < offsets[std::size_t(e) + 1]; ++r) keys.push_back(unsigned(e));
  const device_array<unsigned> dkeys(keys);
  const float poison = -3.5e33f;
  for (const int round_x : {0, 1})
    for (const bool gate_up : {true, false}) {
      CAPTURE(round_x);
      CAPTURE(gate_up);
      device_array<float> dy(std::vector<float>(std::size_t(rows) * out, poison));
      gpu::expert_gemv_params p;
      p.w = dtg.p;
      p.up = gate_up ? dtu.p : nullptr;
      p.offsets = doff.p;
      p.experts = E;
      p.out = out;
      p.in = in;
      p.x = dx.p;
      p.x_stride = in;
      p.y = dy.p;
      p.y_stride = out;
      p.round_x = round_x;
      gpu::launch_expert_gemv(p, nullptr);
      WS_CUDA_TRY(cudaDeviceSynchronize());
      const std::vector<float> got = dy.get();
      // The same launch over the routed pairs' sorted experts (device routing's
      // grid: one block row per pair, repeats skipped): bit-identical output.
      {
        device_array<float> dy2(std::vector<float>(std::size_t(rows) * out, poison));
        gpu::expert_gemv_params pl = p;
        pl.block_experts = dkeys.p;
        pl.blocks = int(keys.size());
        pl.y = dy2.p;
        gpu::launch_expert_gemv(pl, nullptr);
        WS_CUDA_TRY(cudaDeviceSynchronize());
        CHECK(dy2.get() == got);
      }
      // the host reference on host copies of the same tables
      std::vector<const void*> hg(static_cast<std::size_t>(E)), hu(static_cast<std::size_t>(E));
      for (int e = 0; e < E; ++e) {
        hg[std::size_t(e)] = e == host_expert ? nullptr : g[std::size_t(e)].data();
        hu[std::size_t(e)] = e == host_expert ? nullptr : u[std::size_t(e)].data();
      }
      std::vector<float> ref(got.size(), poison);
      gpu::expert_gemv_params q = p;
      q.w = hg.data();
      q.up = gate_up ? hu.data() : nullptr;
      q.offsets = offsets.data();
      q.x = x.data();
      q.y = ref.data();
      gpu::expert_gemv_reference(q);
      double worst = 0.0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        if (ref[i] == poison) {
          REQUIRE(got[i] == poison);  // host expert's rows and rows outside every expert: unwritten
          continue;
        }
        REQUIRE(std::isfinite(got[i]));
        worst = std::max(worst, std::fabs(double(got[i]) - double(ref[i])) / (1.0 + std::fabs(double(ref[i]))));
      }
      MESSAGE("max relative difference " << worst);
      CHECK(worst < 2e-5);  // fp32 accumulation of 264 products against double
    }
}

TEST_CASE("launch_expert_gemv refuses an input width it cannot load in 16-byte pieces") {
  gpu::expert_gemv_params p;
  p.experts = 1;
  p.out = 8;
  p.in = 12;  // not a multiple of 8
  p.x_stride = 12;
  CHECK_THROWS_AS(gpu::launch_expert_gemv(p, nullptr), writescope::config_error);
  p.in = 16;
  p.x_stride = 18;  // rows not 16-byte aligned
  CHECK_THROWS_AS(gpu::launch_expert_gemv(p, nullptr), writescope::config_error);
}

// launch_route (one warp per row) against route_op run serially on the host
// (which test_gpu_math pins to the host decoder's route_tokens): the same
// experts in the same order, ties included (quantised logits), and weights
// within 1e-7 (only the order of the double sum of exponentials differs).
// Outputs start poisoned, so an unwritten slot fails.
TEST_CASE("launch_route equals route_op for the three routers, 1 to 300 rows, ties included") {
  struct shape {
    const char* name;
    int E, k, group_limited, n_group, topk_group, renorm, apply_scale;
    float scale;
  };
  const shape shapes[] = {
      {"Qwen3 128 top-8, renormalised", 128, 8, 0, 1, 1, 1, 0, 1.0f},
      {"512 experts top-8 (the most route_op takes)", 512, 8, 0, 1, 1, 0, 0, 1.0f},
      {"Mixtral 8 top-2", 8, 2, 0, 1, 1, 1, 0, 1.0f},
      {"DeepSeek-V2-Lite 64 top-6, scaled", 64, 6, 0, 1, 1, 0, 1, 2.5f},
      {"group-limited 160 in 8 groups, top-3 groups, top-6", 160, 6, 1, 8, 3, 0, 1, 16.0f},
      {"33 experts top-5 (not a multiple of the warp)", 33, 5, 0, 1, 1, 1, 0, 1.0f},
      {"top-k = all experts", 12, 12, 0, 1, 1, 1, 0, 1.0f},
  };
  for (const shape& s : shapes)
    for (const int n : {1, 37, 300}) {
      CAPTURE(s.name);
      CAPTURE(n);
      std::mt19937_64 rng(std::uint64_t(s.E * 1000 + n));
      std::normal_distribution<float> d(0.0f, 1.5f);
      std::vector<float> logits(std::size_t(n) * s.E);
      for (float& v : logits) v = std::round(d(rng) * 4.0f) / 4.0f;  // many exact ties
      for (int e = 0; e < s.E; e += 3) logits[std::size_t(e)] = logits[1];  // and a wide one in row 0
      gpu::route_op r{};
      r.E = s.E;
      r.k = s.k;
      r.group_limited = s.group_limited;
      r.n_group = s.n_group;
      r.topk_group = s.topk_group;
      r.renorm = s.renorm;
      r.apply_scale = s.apply_scale;
      r.scale = s.scale;
      std::vector<int> ref_e(std::size_t(n) * s.k, -3);
      std::vector<float> ref_w(std::size_t(n) * s.k, -3.0f);
      r.logits = logits.data();
      r.experts = ref_e.data();
      r.weights = ref_w.data();
      for (idx t = 0; t < n; ++t) r(t);

      device_array<float> dl(logits);
      device_array<int> de(std::vector<int>(std::size_t(n) * s.k, -7));
      device_array<float> dw(std::vector<float>(std::size_t(n) * s.k, std::nanf("")));
      r.logits = dl.p;
      r.experts = de.p;
      r.weights = dw.p;
      gpu::launch_route(r, n, nullptr);
      WS_CUDA_TRY(cudaDeviceSynchronize());
      CHECK(de.get() == ref_e);
      const std::vector<float> w = dw.get();
      double worst = 0.0;
      for (std::size_t i = 0; i < w.size(); ++i) worst = std::max(worst, double(std::fabs(w[i] - ref_w[i])));
      CHECK(worst <= 1e-7);  // NaN (an unwritten weight) fails too
      CHECK(std::none_of(w.begin(), w.end(), [](float x) { return std::isnan(x); }));
    }
}

TEST_CASE("launch_group_pairs writes the tables of sort_pairs + expert_bounds_op + scatter_rows_op") {
  struct shape {
    int E, k, tokens;
  };
  // 1024 pairs: the most one launch takes (and the expert_bounds position n past the last thread).
  for (const shape s : {shape{128, 8, 1}, shape{128, 8, 7}, shape{128, 8, 128}, shape{8, 2, 1}, shape{8, 2, 512},
                        shape{64, 6, 170}, shape{512, 8, 3}}) {
    CAPTURE(s.E);
    CAPTURE(s.k);
    CAPTURE(s.tokens);
    const int n = s.tokens * s.k;
    std::mt19937_64 rng(std::uint64_t(s.E * 7919 + n));
    std::vector<int> experts(static_cast<std::size_t>(n));
    std::vector<float> weights(static_cast<std::size_t>(n));
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int t = 0; t < s.tokens; ++t) {  // k distinct experts per token, router order (not sorted)
      std::vector<int> all(static_cast<std::size_t>(s.E));
      for (int e = 0; e < s.E; ++e) all[std::size_t(e)] = e;
      std::shuffle(all.begin(), all.end(), rng);
      if (t % 3 == 0) std::sort(all.begin(), all.begin() + s.k);  // and some with few distinct experts overall
      for (int j = 0; j < s.k; ++j) {
        experts[std::size_t(t * s.k + j)] = t % 5 == 0 ? j : all[std::size_t(j)];
        weights[std::size_t(t * s.k + j)] = u(rng);
      }
    }
    // The reference: a stable sort by expert, then the two functors on the host.
    std::vector<int> order(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) order[std::size_t(i)] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return unsigned(experts[std::size_t(a)]) < unsigned(experts[std::size_t(b)]); });
    std::vector<unsigned> ref_keys(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) ref_keys[std::size_t(i)] = unsigned(experts[std::size_t(order[std::size_t(i)])]);
    std::vector<int> ref_first(std::size_t(s.E) + 1, -5);
    const gpu::expert_bounds_op bounds{ref_keys.data(), n, s.E, ref_first.data()};
    for (idx i = 0; i <= n; ++i) bounds(i);
    std::vector<int> ref_src(std::size_t(n), -5), ref_crow(std::size_t(n), -5);
    std::vector<float> ref_cw(std::size_t(n), -5.0f);
    const gpu::scatter_rows_op scatter{ref_keys.data(), order.data(), ref_first.data(), ref_first.data(),
                                       experts.data(),  weights.data(), s.k,           ref_src.data(),
                                       ref_crow.data(), ref_cw.data()};
    for (idx p = 0; p < n; ++p) scatter(p);

    device_array<int> de(experts);
    device_array<float> dw(weights);
    device_array<unsigned> keys(std::vector<unsigned>(std::size_t(n), 0xdeadbeefu));
    device_array<int> pairs(std::vector<int>(std::size_t(n), -7));
    device_array<int> first(std::vector<int>(std::size_t(s.E) + 1, -7));
    device_array<int> src(std::vector<int>(std::size_t(n), -7));
    device_array<int> crow(std::vector<int>(std::size_t(n), -7));
    device_array<float> cw(std::vector<float>(std::size_t(n), std::nanf("")));
    gpu::launch_group_pairs(de.p, dw.p, n, s.k, s.E, keys.p, pairs.p, first.p, src.p, crow.p, cw.p, nullptr);
    WS_CUDA_TRY(cudaDeviceSynchronize());
    CHECK(keys.get() == ref_keys);
    CHECK(pairs.get() == order);
    CHECK(first.get() == ref_first);
    CHECK(src.get() == ref_src);
    CHECK(crow.get() == ref_crow);
    const std::vector<float> w = cw.get();
    CHECK(std::memcmp(w.data(), ref_cw.data(), w.size() * sizeof(float)) == 0);
  }
}

// Greedy selection on the device (launch_argmax_rows: chunks of a row reduced
// per CTA, folded by an atomic max) against the first maximum on the host:
// ties to the lower column (also across chunks), -0 equal to +0, NaN never
// chosen, rows of -inf or NaN give column 0; the keys buffer poisoned first
// (the launch zeroes it itself), rows past the launch's untouched.
TEST_CASE("launch_argmax_rows gives the first maximum of each row") {
  for (const idx cols : {idx(1), idx(77), idx(4096), idx(151936), idx(102400)}) {
    CAPTURE(cols);
    const idx rows = 9;
    std::vector<float> v(std::size_t(rows * cols));
    std::mt19937_64 rng(std::uint64_t(cols) * 31);
    std::normal_distribution<float> d(0.0f, 3.0f);
    for (float& f : v) f = d(rng);
    auto row = [&](idx r) { return v.data() + r * cols; };
    if (cols > 8) {
      const float m = *std::max_element(row(1), row(1) + cols) + 1.0f;  // tie in two far chunks
      row(1)[cols - 1] = m;
      row(1)[1] = m;
      for (idx c = 0; c < cols; ++c) row(2)[c] = -1.0f - float(c % 5);
      row(2)[cols / 3] = -0.0f;
      row(2)[cols / 2] = 0.0f;
      row(3)[0] = NAN;
      row(3)[cols - 1] = NAN;
      const float m7 = *std::max_element(row(7), row(7) + cols);  // tie inside one chunk
      row(7)[6] = m7;
    }
    std::fill(row(4), row(4) + cols, -INFINITY);
    std::fill(row(5), row(5) + cols, NAN);
    row(6)[cols - 1] = INFINITY;
    device_array<float> dx(v);
    const idx launched = rows - 1;  // the last key is outside the launch
    device_array<std::uint64_t> keys(std::vector<std::uint64_t>(std::size_t(rows), 0xababababababababull));
    gpu::launch_argmax_rows(dx.p, launched, cols, keys.p, nullptr);
    WS_CUDA_TRY(cudaDeviceSynchronize());
    const std::vector<std::uint64_t> k = keys.get();
    for (idx r = 0; r < launched; ++r) {
      CAPTURE(r);
      int ref = -1;
      for (idx c = 0; c < cols; ++c)
        if (!std::isnan(row(r)[c]) && (ref < 0 || row(r)[c] > row(r)[ref])) ref = int(c);
      CHECK(gpu::argmax_key_column(k[std::size_t(r)]) == (ref < 0 ? 0 : ref));
    }
    CHECK(k[std::size_t(launched)] == 0xababababababababull);
    if (cols > 8) {
      CHECK(gpu::argmax_key_column(k[1]) == 1);
      CHECK(gpu::argmax_key_column(k[2]) == int(cols / 3));
    }
  }
  CHECK_THROWS_AS(gpu::launch_argmax_rows(nullptr, 65536, 10, nullptr, nullptr), writescope::config_error);
  CHECK_THROWS_AS(gpu::launch_argmax_rows(nullptr, 1, 0, nullptr, nullptr), writescope::config_error);
}

TEST_CASE("launch_group_pairs refuses what one launch cannot take") {
  CHECK_THROWS_AS(gpu::launch_group_pairs(nullptr, nullptr, 0, 8, 128, nullptr, nullptr, nullptr, nullptr, nullptr,
                                          nullptr, nullptr),
                  writescope::config_error);
  CHECK_THROWS_AS(gpu::launch_group_pairs(nullptr, nullptr, gpu::group_pairs_max + 8, 8, 128, nullptr, nullptr, nullptr,
                                          nullptr, nullptr, nullptr, nullptr),
                  writescope::config_error);
  CHECK_THROWS_AS(gpu::launch_group_pairs(nullptr, nullptr, 12, 8, 128, nullptr, nullptr, nullptr, nullptr, nullptr,
                                          nullptr, nullptr),
                  writescope::config_error);  // not whole tokens
  CHECK_THROWS_AS(gpu::launch_group_pairs(nullptr, nullptr, 8, 8, gpu::route_op::max_experts + 1, nullptr, nullptr,
                                          nullptr, nullptr, nullptr, nullptr, nullptr),
                  writescope::config_error);
}

TEST_CASE("launch_route refuses shapes the warp kernel cannot hold") {
  gpu::route_op r{};
  r.E = gpu::route_op::max_experts + 1;
  r.k = 2;
  CHECK_THROWS_AS(gpu::launch_route(r, 1, nullptr), writescope::config_error);
  r.E = 16;
  r.k = 17;  // more than the experts
  CHECK_THROWS_AS(gpu::launch_route(r, 1, nullptr), writescope::config_error);
  r.k = 2;
  r.group_limited = 1;
  r.n_group = 3;  // does not divide 16
  r.topk_group = 1;
  CHECK_THROWS_AS(gpu::launch_route(r, 1, nullptr), writescope::config_error);
}

// launch_rms_norm (one CTA per row above 512 elements, one warp per row below)
// against the host formula (sum of squares in double, rms_inverse, w * (x * inv)):
// within 2 ulp-scale relative error (only the order of the double sum differs),
// strided rows, in place (y aliasing x), output gaps between rows left untouched.
TEST_CASE("launch_rms_norm equals the host formula (block and warp kernels, in place, strided)") {
  for (const int dim : {128, 512, 2048, 4096, 5000})
    for (const int rows : {1, 7})
      for (const bool in_place : {false, true}) {
        CAPTURE(dim);
        CAPTURE(rows);
        CAPTURE(in_place);
        const idx stride = dim + 3;  // a gap after every row
        std::mt19937_64 rng(std::uint64_t(dim * 10 + rows));
        std::normal_distribution<float> d(0.0f, 2.0f);
        std::vector<float> x(static_cast<std::size_t>(rows * stride)), w(static_cast<std::size_t>(dim));
        for (float& v : x) v = d(rng);
        for (float& v : w) v = 1.0f + 0.1f * d(rng);
        const double eps = 1e-6;
        std::vector<float> ref(x.size(), -9.0f);
        for (int r = 0; r < rows; ++r) {
          double ss = 0.0;
          for (int e = 0; e < dim; ++e) ss += double(x[std::size_t(r * stride + e)]) * double(x[std::size_t(r * stride + e)]);
          const float inv = gpu::rms_inverse(ss, dim, eps);
          for (int e = 0; e < dim; ++e) ref[std::size_t(r * stride + e)] = w[std::size_t(e)] * (x[std::size_t(r * stride + e)] * inv);
        }
        device_array<float> dx(x), dw(w);
        device_array<float> dy(std::vector<float>(x.size(), -9.0f));
        gpu::rms_norm_params p{dx.p, stride, dw.p, rows, dim, eps, in_place ? dx.p : dy.p, stride};
        gpu::launch_rms_norm(p, nullptr);
        WS_CUDA_TRY(cudaDeviceSynchronize());
        const std::vector<float> got = in_place ? dx.get() : dy.get();
        double worst = 0.0;
        for (int r = 0; r < rows; ++r)
          for (idx e = 0; e < stride; ++e) {
            const std::size_t i = std::size_t(r * stride + e);
            if (e >= dim) {  // the gap: untouched (x's value in place, the poison otherwise)
              REQUIRE(got[i] == (in_place ? x[i] : -9.0f));
              continue;
            }
            worst = std::max(worst, std::fabs(double(got[i]) - double(ref[i])) / (1e-30 + std::fabs(double(ref[i]))));
          }
        CHECK(worst <= 4e-7);
      }
}
