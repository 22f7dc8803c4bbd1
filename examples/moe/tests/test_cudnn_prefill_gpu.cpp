// SPDX-License-Identifier: Apache-2.0
// The cuDNN prefill attention (ws_moe/gpu/cudnn_prefill.hpp, cudnn_prefill)
// on the device against the fp64 reference of flash_prefill_reference.hpp, at
// the cases of test_flash_prefill_gpu.cpp. Label "gpu": exits 77 (SKIPPED)
// without a device; built only with WS_MOE_HAVE_CUDNN (a device without a
// loadable cuDNN fails, naming the reason).
//
// Shapes: GQA 64/128 (groups 4, 2, 3, 8, 12), MLA (192, 128) and (48, 16);
// lengths 1, 2, 63, 64, 65, 4097; ragged batches with an empty sequence and
// unused rows before the first; lse in every other case; the three models'
// head counts; int64 ragged offsets. The layout is the reference's except
// that out is bf16 with heads and tokens padded by 8 elements (cuDNN wants
// 16-byte strides). Outputs are poisoned (bf16 NaN) with a poisoned margin
// past their end: every padding element, every row outside the sequences and
// the margin must stay NaN. cuDNN may refuse (48, 16) (supported() false, a
// message); refusing 64/64, 128/128 or 192/128 fails.
//
// Tolerance: q, k, v are bf16 and exact in the reference. bf16 has an 8-bit
// significand, unit roundoff u = 2^-8. Two roundings reach out: P to bf16 as
// the operand of P V (|error| <= u * sum_j p_j |v_j|, as for our kernel) and
// the fp32 result to bf16 (<= u * |out| <= u * sum_j p_j |v_j|); so the test
// allows 2 x 1.05 u * sum_j p_j |v_j| + 1e-5 max|v|; lse (fp32) within
// 1e-4 (1 + |lse|).
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
#include "ws_moe/gpu/cudnn_prefill.hpp"

using namespace ws_moe;
using gpu::idx;

namespace {

constexpr double rel_tol = 2.0 * 1.05 / 256.0, abs_tol = 1e-5, lse_tol = 1e-4;
constexpr std::size_t margin_elems = 4096;  ///< poisoned elements after out and lse: an over-run shows
constexpr std::uint16_t bf16_nan = 0x7fc0;
const float poison = std::numeric_limits<float>::quiet_NaN();

using test::device_array;

struct device_bytes {
  void* p = nullptr;
  std::size_t n = 0;
  explicit device_bytes(std::size_t bytes) : n(bytes) { WS_CUDA_TRY(cudaMalloc(&p, std::max<std::size_t>(n, 1))); }
  device_bytes(const device_bytes&) = delete;
  device_bytes& operator=(const device_bytes&) = delete;
  ~device_bytes() { (void)cudaFree(p); }
};

/// The reference's data with out re-laid as bf16, heads and tokens padded by 8.
flash_ref::test_data make_bf16_out_data(const flash_ref::test_case& c, std::uint64_t seed) {
  flash_ref::test_data d = flash_ref::make_data(c, seed);
  d.o_hs = c.dv + 8;
  d.o_ts = c.hq * d.o_hs + 8;
  return d;
}

/// The inputs of one case on the device, with poisoned out (and lse) + margin.
struct device_case {
  flash_ref::test_data d;
  device_array<std::uint16_t> q, k, v;
  device_array<int> offsets;
  device_array<std::uint16_t> out;
  device_array<float> lse;
  device_case(const flash_ref::test_case& c, std::uint64_t seed, bool with_lse)
      : d(make_bf16_out_data(c, seed)), q(d.q), k(d.k), v(d.v), offsets(d.offsets),
        out(std::vector<std::uint16_t>(std::size_t(d.out_elems()) + margin_elems, bf16_nan)),
        lse(std::vector<float>(with_lse ? std::size_t(d.lse_elems()) + margin_elems : 0, poison)) {}
  [[nodiscard]] gpu::cudnn_prefill_params params() const {
    gpu::cudnn_prefill_params p;
    p.q = q.p;
    p.k = k.p;
    p.v = v.p;
    p.out = out.p;
    p.lse = lse.n > 0 ? lse.p : nullptr;
    p.seq_offsets = offsets.p;
    p.num_seqs = int(d.c.lengths.size());
    p.max_seq_tokens = d.longest;
    p.buffer_tokens = d.tokens;
    p.hq = d.c.hq;
    p.hkv = d.c.hkv;
    p.dqk = d.c.dqk;
    p.dv = d.c.dv;
    p.q_token_stride = d.q_ts;
    p.q_head_stride = d.q_hs;
    p.k_token_stride = d.k_ts;
    p.k_head_stride = d.k_hs;
    p.v_token_stride = d.v_ts;
    p.v_head_stride = d.v_hs;
    p.o_token_stride = d.o_ts;
    p.o_head_stride = d.o_hs;
    p.scale = d.scale;
    return p;
  }
  /// out as floats (bf16 NaN stays NaN).
  [[nodiscard]] std::vector<float> out_floats() const {
    const std::vector<std::uint16_t> raw = out.get();
    std::vector<float> f(raw.size());
    for (std::size_t i = 0; i < raw.size(); ++i) f[i] = gpu::bf16_to_float(raw[i]);
    return f;
  }
};

/// One engine for the whole test (its plan cache is shared), never destroyed:
/// its cuDNN handle must not outlive the CUDA context at exit.
gpu::cudnn_prefill& engine() {
  static gpu::cudnn_prefill* e = new gpu::cudnn_prefill();
  return *e;
}

bool may_be_refused(const flash_ref::test_case& c) {
  return !((c.dqk == 64 && c.dv == 64) || (c.dqk == 128 && c.dv == 128) || (c.dqk == 192 && c.dv == 128));
}

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

/// Runs p on `stream` with a fresh workspace of exactly workspace_bytes(p); false when cuDNN refuses the shape.
bool run_once(const gpu::cudnn_prefill_params& p, cudaStream_t stream) {
  if (!engine().supported(p)) return false;
  device_bytes ws(engine().workspace_bytes(p));
  engine().run(p, ws.p, ws.n, stream);
  WS_CUDA_TRY(cudaStreamSynchronize(stream));
  return true;
}

void run_case(const flash_ref::test_case& c, std::uint64_t seed, bool with_lse) {
  device_case dc(c, seed, with_lse);
  const gpu::cudnn_prefill_params p = dc.params();
  if (!run_once(p, nullptr)) {
    const std::string why = engine().last_refusal();
    if (may_be_refused(c)) {
      MESSAGE(c.name << ": cuDNN refuses the shape (the caller falls back to launch_flash_prefill): " << why);
      return;
    }
    FAIL(c.name << ": cuDNN refuses a shape it must run: " << why);
  }
  check_against_reference(dc, dc.out_floats(), dc.lse.get());
}

}  // namespace

TEST_CASE("cuDNN loads (cudnn_prefill::available)") {
  INFO("reason: " << gpu::cudnn_prefill::unavailable_reason());
  REQUIRE(gpu::cudnn_prefill::available());
  MESSAGE("cuDNN " << gpu::cudnn_prefill::loaded_version());
}

TEST_CASE("cudnn_prefill equals the fp64 reference (GQA, MLA, lengths 1..4097, ragged, lse)") {
  REQUIRE(gpu::cudnn_prefill::available());
  std::uint64_t seed = 100;
  bool with_lse = true;
  for (const flash_ref::test_case& c : flash_ref::cases(true)) {
    SUBCASE((c.name + (with_lse ? " +lse" : "")).c_str()) { run_case(c, seed, with_lse); }
    ++seed;
    with_lse = !with_lse;
  }
}

TEST_CASE("cudnn_prefill at the models' head counts (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V2-Lite MLA)") {
  REQUIRE(gpu::cudnn_prefill::available());
  const flash_ref::test_case shapes[] = {{"qwen3 32/4 d128", 32, 4, 128, 128, {300, 77}, 0, 1.0},
                                         {"mixtral 32/8 d128", 32, 8, 128, 128, {129}, 0, 1.0},
                                         {"dsv2-lite 16/16 192/128", 16, 16, 192, 128, {200, 5}, 0, 1.0}};
  std::uint64_t seed = 500;
  for (const auto& c : shapes) {
    SUBCASE(c.name.c_str()) { run_case(c, seed, true); }
    ++seed;
  }
}

TEST_CASE("cudnn_prefill: another bucket, another stream, bit-identical repeats, one plan per key") {
  REQUIRE(gpu::cudnn_prefill::available());
  device_case dc({"ragged d128 hq8 hkv2", 8, 2, 128, 128, {70, 0, 191, 3}, 5, 2.0}, 42, true);
  gpu::cudnn_prefill_params p = dc.params();
  p.max_seq_tokens += 100;  // 291 -> bucket 512 instead of 256
  p.buffer_tokens += 100;
  cudaStream_t stream = nullptr;
  WS_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  REQUIRE(run_once(p, stream));
  const std::vector<float> out1 = dc.out_floats(), lse1 = dc.lse.get();
  check_against_reference(dc, out1, lse1);
  const std::size_t plans = engine().cached_plans();
  REQUIRE(run_once(p, stream));
  CHECK(engine().cached_plans() == plans);
  WS_CUDA_TRY(cudaStreamDestroy(stream));
  const std::vector<float> out2 = dc.out_floats(), lse2 = dc.lse.get();
  idx differ = 0;
  for (std::size_t i = 0; i < out1.size(); ++i)
    if (!(out1[i] == out2[i] || (std::isnan(out1[i]) && std::isnan(out2[i])))) ++differ;
  for (std::size_t i = 0; i < lse1.size(); ++i)
    if (!(lse1[i] == lse2[i] || (std::isnan(lse1[i]) && std::isnan(lse2[i])))) ++differ;
  CHECK(differ == 0);
}

TEST_CASE("cudnn_prefill with int64 ragged offsets (buffer_tokens past 2^31 elements)") {
  REQUIRE(gpu::cudnn_prefill::available());
  device_case dc({"ragged d64 hq4 hkv2 int64", 4, 2, 64, 64, {40, 1, 77}, 2, 1.0}, 77, true);
  gpu::cudnn_prefill_params p = dc.params();
  p.buffer_tokens = std::numeric_limits<int>::max();  // the bound, not the data, picks int64 offsets
  if (!run_once(p, nullptr)) {
    MESSAGE("cuDNN refuses int64 ragged offsets (prompts past 2^31 elements fall back): " << engine().last_refusal());
    return;
  }
  check_against_reference(dc, dc.out_floats(), dc.lse.get());
}

TEST_CASE("cudnn_prefill refuses bad input with config_error and launches nothing") {
  REQUIRE(gpu::cudnn_prefill::available());
  device_case dc({"small", 4, 2, 64, 64, {5, 3}, 0, 1.0}, 9, false);
  device_bytes ws(engine().workspace_bytes(dc.params()));
  const auto refused = [&](const gpu::cudnn_prefill_params& p, std::size_t ws_bytes, const std::string& rule) {
    try {
      engine().run(p, ws.p, ws_bytes, nullptr);
      FAIL("accepted; expected a config_error naming '" << rule << "'");
    } catch (const writescope::config_error& e) {
      INFO("message: " << e.what());
      CHECK(std::string(e.what()).find(rule) != std::string::npos);
    }
    WS_CUDA_TRY(cudaDeviceSynchronize());
    idx written = 0;
    for (float x : dc.out_floats())
      if (!std::isnan(x)) ++written;
    CHECK(written == 0);
  };
  gpu::cudnn_prefill_params p = dc.params();
  p.hkv = 3;
  refused(p, ws.n, "is not a multiple of hkv 3");
  p = dc.params();
  p.dqk = p.dv = 20;
  refused(p, ws.n, "multiple of 8");
  p = dc.params();
  p.v_head_stride = -8;
  refused(p, ws.n, "v_head_stride -8 is negative");
  p = dc.params();
  p.o_token_stride += 2;
  refused(p, ws.n, "o_token_stride");
  p = dc.params();
  p.buffer_tokens = p.max_seq_tokens - 1;
  refused(p, ws.n, "buffer_tokens");
  refused(dc.params(), ws.n - 1, "smaller than the");
}
