// SPDX-License-Identifier: Apache-2.0
// The CUDA causal prefill attention (ws_moe/gpu/flash_prefill.cu,
// launch_flash_prefill) on the device against the fp64 reference of
// flash_prefill_reference.hpp. Label "gpu": exits 77 (SKIPPED) without a
// device, like tests/cuda.
//
// Shapes: those of the host test (GQA 64/128 with 4, 2 and 1 heads per CTA,
// MLA (192, 128) and (48, 16); lengths 1, 2, 63, 64, 65, 4097; ragged batches
// with an empty sequence and unused rows before the first), lse requested in
// every other case, plus the three models' head counts. Outputs are poisoned
// (NaN) and allocated with a poisoned margin past their end: every padding
// element, every row outside the sequences and the margin must stay NaN.
//
// Tolerance: q, k, v are bf16 and exact in the reference; the kernel rounds P
// to bf16 (unit roundoff u = 2^-8) for the P V product and accumulates in fp32
// with the row sum of the unrounded P, so per element
//   |out - ref| <= u * sum_j p_j |v_j| (+ fp32 terms)
// and the test allows 1.05 u * sum_j p_j |v_j| + 1e-5 max|v|; lse (fp32 row
// sum and scores) within 1e-4 (1 + |lse|).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <writescope/cuda/cuda_error.hpp>
#include <writescope/error.hpp>

#include "device_array.hpp"
#include "flash_prefill_reference.hpp"
#include "ws_moe/gpu/flash_prefill_launch.hpp"

using namespace ws_moe;
using gpu::idx;

namespace {

constexpr double rel_tol = 1.05 / 256.0, abs_tol = 1e-5, lse_tol = 1e-4;
constexpr std::size_t margin_elems = 4096;  ///< poisoned floats after out and lse: an over-run shows
const float poison = std::numeric_limits<float>::quiet_NaN();

using test::device_array;

/// The inputs of one case on the device, with poisoned out (and lse) + margin.
struct device_case {
  flash_ref::test_data d;
  device_array<std::uint16_t> q, k, v;
  device_array<int> offsets;
  device_array<float> out, lse;
  device_case(const flash_ref::test_case& c, std::uint64_t seed, bool with_lse)
      : d(flash_ref::make_data(c, seed)), q(d.q), k(d.k), v(d.v), offsets(d.offsets),
        out(std::vector<float>(std::size_t(d.out_elems()) + margin_elems, poison)),
        lse(std::vector<float>(with_lse ? std::size_t(d.lse_elems()) + margin_elems : 0, poison)) {}
  [[nodiscard]] gpu::flash_prefill_params params() const {
    return d.params(q.p, k.p, v.p, out.p, lse.n > 0 ? lse.p : nullptr, offsets.p);
  }
};

void check_against_reference(const device_case& dc, const std::vector<float>& out, const std::vector<float>& lse) {
  const flash_ref::reference r = flash_ref::compute_reference(dc.d);
  const flash_ref::comparison cmp = flash_ref::compare(dc.d, r, out, lse, rel_tol, abs_tol, lse_tol);
  INFO(dc.d.c.name << ": worst " << cmp.first_problem << " (ratio " << cmp.worst_ratio << ", max abs error "
                   << cmp.max_abs_err << ", lse ratio " << cmp.worst_lse_ratio << ")");
  CHECK(cmp.not_finite == 0);
  CHECK(cmp.overwritten == 0);
  CHECK(cmp.worst_ratio <= 1.0);
  CHECK(cmp.worst_lse_ratio <= 1.0);
}

void run_case(const flash_ref::test_case& c, std::uint64_t seed, bool with_lse) {
  device_case dc(c, seed, with_lse);
  gpu::launch_flash_prefill(dc.params(), nullptr);
  WS_CUDA_TRY(cudaDeviceSynchronize());
  check_against_reference(dc, dc.out.get(), dc.lse.get());
}

}  // namespace

TEST_CASE("launch_flash_prefill equals the fp64 reference (GQA, MLA, lengths 1..4097, ragged, lse)") {
  std::uint64_t seed = 100;
  bool with_lse = true;
  for (const flash_ref::test_case& c : flash_ref::cases(true)) {
    SUBCASE((c.name + (with_lse ? " +lse" : "")).c_str()) { run_case(c, seed, with_lse); }
    ++seed;
    with_lse = !with_lse;
  }
}

TEST_CASE("launch_flash_prefill at the models' head counts (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V2-Lite MLA)") {
  const flash_ref::test_case shapes[] = {{"qwen3 32/4 d128", 32, 4, 128, 128, {300, 77}, 0, 1.0},
                                         {"mixtral 32/8 d128", 32, 8, 128, 128, {129}, 0, 1.0},
                                         {"dsv2-lite 16/16 192/128", 16, 16, 192, 128, {200, 5}, 0, 1.0}};
  std::uint64_t seed = 500;
  for (const auto& c : shapes) {
    SUBCASE(c.name.c_str()) { run_case(c, seed, true); }
    ++seed;
  }
}

TEST_CASE("launch_flash_prefill: a larger max_seq_tokens, another stream, and bit-identical repeats") {
  device_case dc({"ragged d128 hq8 hkv2", 8, 2, 128, 128, {70, 0, 191, 3}, 5, 2.0}, 42, true);
  gpu::flash_prefill_params p = dc.params();
  p.max_seq_tokens += 100;  // extra (empty) query tiles in the grid
  cudaStream_t stream = nullptr;
  WS_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  gpu::launch_flash_prefill(p, stream);
  WS_CUDA_TRY(cudaStreamSynchronize(stream));
  const std::vector<float> out1 = dc.out.get(), lse1 = dc.lse.get();
  check_against_reference(dc, out1, lse1);
  gpu::launch_flash_prefill(p, stream);
  WS_CUDA_TRY(cudaStreamSynchronize(stream));
  WS_CUDA_TRY(cudaStreamDestroy(stream));
  const std::vector<float> out2 = dc.out.get(), lse2 = dc.lse.get();
  idx differ = 0;
  for (std::size_t i = 0; i < out1.size(); ++i)
    if (!(out1[i] == out2[i] || (std::isnan(out1[i]) && std::isnan(out2[i])))) ++differ;
  for (std::size_t i = 0; i < lse1.size(); ++i)
    if (!(lse1[i] == lse2[i] || (std::isnan(lse1[i]) && std::isnan(lse2[i])))) ++differ;
  CHECK(differ == 0);
}

TEST_CASE("launch_flash_prefill refuses bad input with config_error and launches nothing") {
  device_case dc({"small", 4, 2, 64, 64, {5, 3}, 0, 1.0}, 9, false);
  const auto refused = [&](const gpu::flash_prefill_params& p, const std::string& rule) {
    try {
      gpu::launch_flash_prefill(p, nullptr);
      FAIL("accepted; expected a config_error naming '" << rule << "'");
    } catch (const writescope::config_error& e) {
      INFO("message: " << e.what());
      CHECK(std::string(e.what()).find(rule) != std::string::npos);
    }
    WS_CUDA_TRY(cudaDeviceSynchronize());
    idx written = 0;
    for (float x : dc.out.get())
      if (!std::isnan(x)) ++written;
    CHECK(written == 0);
  };
  gpu::flash_prefill_params p = dc.params();
  p.hkv = 3;
  refused(p, "is not a multiple of hkv 3");
  p = dc.params();
  p.dqk = p.dv = 96;
  refused(p, "supported (dqk, dv)");
  p = dc.params();
  p.v_head_stride = -8;
  refused(p, "v_head_stride -8 is negative");
  p = dc.params();
  p.q_token_stride += 2;
  refused(p, "q_token_stride");
}
