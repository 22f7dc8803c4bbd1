// SPDX-License-Identifier: Apache-2.0
// tests/consumer/components.cpp — the two optional components of an installed
// or vendored writescope: writescope::reference (<writescope/reference.hpp>,
// Eigen) and writescope::calibration (<writescope/calibration.hpp>,
// nlohmann-json), each used once. Exit 0 when both give the expected values.
#include <cmath>
#include <cstdio>
#include <vector>

#include <writescope/calibration.hpp>
#include <writescope/reference.hpp>

int main() try {
  namespace ws = writescope;
  // One cached token: the output is its V row and the LSE is scale * q.k.
  const int d = 128;
  std::vector<float> q(static_cast<std::size_t>(d), 0.5f);
  std::vector<ws::bf16> k(static_cast<std::size_t>(d), ws::bf16::from_float(0.25f)),
      v(static_cast<std::size_t>(d), ws::bf16::from_float(2.0f));
  std::vector<double> o(static_cast<std::size_t>(d)), lse(1);
  ws::reference::gqa_decode(1, 1, d, q.data(), k.data(), v.data(), 1, 0.5, o.data(), lse.data());
  const bool reference_ok = std::abs(o[0] - 2.0) < 1e-12 && std::abs(lse[0] - 0.5 * 0.125 * d) < 1e-9;

  const ws::calibration c = ws::parse_calibration(R"({"format": "writescope-calibration", "version": 1,
      "entries": [{"preset": "Qwen3-30B-A3B", "batch": 16, "cpu_threads": 15,
                   "cpu_cost_per_token_seconds": 1.9e-11, "gpu_cost_per_token_seconds": 3.9e-11,
                   "cpu_fixed_seconds": 6.0e-5, "gpu_fixed_seconds": 4.0e-5}]})");
  const bool calibration_ok = c.entries.size() == 1 && c.entries[0].batch == 16;
  std::printf("components: reference %s, calibration %s\n", reference_ok ? "PASS" : "FAIL",
              calibration_ok ? "PASS" : "FAIL");
  return reference_ok && calibration_ok ? 0 : 1;
} catch (const writescope::error& e) {
  std::fprintf(stderr, "components: %s\n", e.what());
  return 1;
}
