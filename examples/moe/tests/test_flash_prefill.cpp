// SPDX-License-Identifier: Apache-2.0
// The host twin of the causal prefill attention (ws_moe/gpu/flash_prefill.hpp
// flash_prefill_host) against the fp64 reference of flash_prefill_reference.hpp,
// and the parameter checks both implementations run (check_flash_prefill,
// check_flash_prefill_offsets): bad input is a config_error naming the rule,
// with nothing written.
//
// Shapes: the GQA 64/128 dims, MLA (192, 128) and (48, 16), lengths 1, 2, 63,
// 64, 65 and 4097, ragged batches with an empty sequence and unused rows before
// the first; dims the kernel is not built for (40, 24) still run on the host.
// Outputs are NaN-poisoned: every padding element and every row outside the
// sequences must stay NaN.
//
// Tolerance: the twin computes in fp32 (dot products of at most 192 terms,
// sums of at most 4097), so |out - ref| <= 2e-5 * sum_j p_j |v_j| + 1e-6 *
// max|v| and |lse - ref| <= 1e-5 * (1 + |ref|).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <writescope/error.hpp>

#include "flash_prefill_reference.hpp"
#include "ws_moe/gpu/flash_prefill.hpp"

using namespace ws_moe;
using gpu::idx;

namespace {

constexpr double rel_tol = 2e-5, abs_tol = 1e-6, lse_tol = 1e-5;
const float poison = std::numeric_limits<float>::quiet_NaN();

void run_case(const flash_ref::test_case& c, std::uint64_t seed) {
  const flash_ref::test_data d = flash_ref::make_data(c, seed);
  std::vector<float> out(std::size_t(d.out_elems()), poison), lse(std::size_t(d.lse_elems()), poison);
  gpu::flash_prefill_host(d.params(d.q.data(), d.k.data(), d.v.data(), out.data(), lse.data(), d.offsets.data()));
  const flash_ref::reference r = flash_ref::compute_reference(d);
  const flash_ref::comparison cmp = flash_ref::compare(d, r, out, lse, rel_tol, abs_tol, lse_tol);
  INFO(c.name << ": worst " << cmp.first_problem << " (max abs error " << cmp.max_abs_err << ")");
  CHECK(cmp.not_finite == 0);
  CHECK(cmp.overwritten == 0);
  CHECK(cmp.worst_ratio <= 1.0);
  CHECK(cmp.worst_lse_ratio <= 1.0);
}

/// A valid small problem (host buffers) for the error tests.
struct small_problem {
  flash_ref::test_data d = flash_ref::make_data({"small", 4, 2, 64, 64, {5, 3}, 0, 1.0}, 11);
  std::vector<float> out = std::vector<float>(std::size_t(d.out_elems()), poison);
  gpu::flash_prefill_params p = d.params(d.q.data(), d.k.data(), d.v.data(), out.data(), nullptr, d.offsets.data());
  [[nodiscard]] bool untouched() const {
    for (float x : out)
      if (!std::isnan(x)) return false;
    return true;
  }
};

/// f(p) throws config_error whose message contains `rule`, and writes nothing.
template <class F>
void require_refused(F f, const gpu::flash_prefill_params& p, const small_problem& sp, const std::string& rule) {
  try {
    f(p);
    FAIL("accepted; expected a config_error naming '" << rule << "'");
  } catch (const writescope::config_error& e) {
    INFO("message: " << e.what());
    CHECK(std::string(e.what()).find(rule) != std::string::npos);
  }
  CHECK(sp.untouched());
}

}  // namespace

TEST_CASE("flash_prefill_host equals the fp64 reference (GQA, MLA, lengths 1..4097, ragged)") {
  std::uint64_t seed = 100;
  for (const flash_ref::test_case& c : flash_ref::cases(true)) {
    SUBCASE(c.name.c_str()) { run_case(c, seed); }
    ++seed;
  }
}

TEST_CASE("flash_prefill_host runs dims the kernel is not built for, and lse = null writes none") {
  const flash_ref::test_data d = flash_ref::make_data({"d 40/24", 3, 1, 40, 24, {1, 70, 9}, 2, 2.0}, 7);
  std::vector<float> out(std::size_t(d.out_elems()), poison);
  const gpu::flash_prefill_params p = d.params(d.q.data(), d.k.data(), d.v.data(), out.data(), nullptr, d.offsets.data());
  CHECK_THROWS_AS(gpu::check_flash_prefill(p), writescope::config_error);
  gpu::flash_prefill_host(p);
  const flash_ref::comparison cmp = flash_ref::compare(d, flash_ref::compute_reference(d), out, {}, rel_tol, abs_tol, lse_tol);
  INFO("worst " << cmp.first_problem);
  CHECK(cmp.not_finite == 0);
  CHECK(cmp.overwritten == 0);
  CHECK(cmp.worst_ratio <= 1.0);
}

TEST_CASE("flash prefill checks: bad input is a config_error naming the rule, nothing written") {
  small_problem sp;
  const auto host = [](const gpu::flash_prefill_params& p) { gpu::flash_prefill_host(p); };
  const auto check = [](const gpu::flash_prefill_params& p) { gpu::check_flash_prefill(p); };
  REQUIRE_NOTHROW(gpu::check_flash_prefill(sp.p));
  REQUIRE_NOTHROW(gpu::check_flash_prefill_offsets(sp.p, sp.d.offsets.data()));

  SUBCASE("hq not a multiple of hkv") {
    gpu::flash_prefill_params p = sp.p;
    p.hkv = 3;
    require_refused(host, p, sp, "hq 4 is not a multiple of hkv 3");
    require_refused(check, p, sp, "hq 4 is not a multiple of hkv 3");
  }
  SUBCASE("non-positive heads or dims") {
    gpu::flash_prefill_params p = sp.p;
    p.hkv = 0;
    require_refused(host, p, sp, "must be positive");
    p = sp.p;
    p.dv = 0;
    require_refused(check, p, sp, "must be positive");
  }
  SUBCASE("head dims the kernel is not built for") {
    gpu::flash_prefill_params p = sp.p;
    p.dqk = 96;
    p.dv = 96;
    require_refused(check, p, sp, "supported (dqk, dv): (64, 64), (128, 128), (192, 128), (48, 16)");
  }
  SUBCASE("offsets not increasing") {
    std::vector<int> offs = {0, 5, 4};
    gpu::flash_prefill_params p = sp.p;
    p.seq_offsets = offs.data();
    require_refused(host, p, sp, "seq_offsets decrease at sequence 1: 5 then 4");
    require_refused([&](const gpu::flash_prefill_params& q) { gpu::check_flash_prefill_offsets(q, offs.data()); }, p, sp,
                    "seq_offsets decrease at sequence 1");
    offs = {-1, 4, 8};
    require_refused(host, p, sp, "seq_offsets[0] -1 is negative");
  }
  SUBCASE("a sequence longer than max_seq_tokens") {
    gpu::flash_prefill_params p = sp.p;
    p.max_seq_tokens = 4;
    require_refused(host, p, sp, "sequence 0 has 5 tokens, more than max_seq_tokens 4");
  }
  SUBCASE("negative strides") {
    const struct {
      idx gpu::flash_prefill_params::*member;
      const char* name;
    } members[] = {{&gpu::flash_prefill_params::q_token_stride, "q_token_stride"},
                   {&gpu::flash_prefill_params::k_head_stride, "k_head_stride"},
                   {&gpu::flash_prefill_params::v_token_stride, "v_token_stride"},
                   {&gpu::flash_prefill_params::o_head_stride, "o_head_stride"}};
    for (const auto& m : members) {
      gpu::flash_prefill_params p = sp.p;
      p.*m.member = -8;
      require_refused(host, p, sp, std::string(m.name) + " -8 is negative");
      require_refused(check, p, sp, std::string(m.name) + " -8 is negative");
    }
  }
  SUBCASE("strides the kernel's 16-byte copies cannot use") {
    gpu::flash_prefill_params p = sp.p;
    p.k_token_stride += 4;
    require_refused(check, p, sp, "k_token_stride");
    p = sp.p;
    p.o_head_stride += 1;
    require_refused(check, p, sp, "is not a multiple of 2 elements");
    p = sp.p;
    p.q = sp.d.q.data() + 1;
    require_refused(check, p, sp, "16-byte aligned");
  }
  SUBCASE("scale, null pointers, negative counts") {
    gpu::flash_prefill_params p = sp.p;
    p.scale = 0.0f;
    require_refused(host, p, sp, "scale");
    p.scale = std::numeric_limits<float>::infinity();
    require_refused(check, p, sp, "scale");
    p = sp.p;
    p.v = nullptr;
    require_refused(host, p, sp, "null");
    p = sp.p;
    p.seq_offsets = nullptr;
    require_refused(host, p, sp, "seq_offsets is null");
    p = sp.p;
    p.num_seqs = -1;
    require_refused(check, p, sp, "num_seqs -1 is negative");
  }
  SUBCASE("an empty batch is valid and writes nothing") {
    gpu::flash_prefill_params p = sp.p;
    p.num_seqs = 0;
    CHECK_NOTHROW(gpu::flash_prefill_host(p));
    CHECK_NOTHROW(gpu::check_flash_prefill(p));
    CHECK(sp.untouched());
  }
}
