// SPDX-License-Identifier: Apache-2.0
// ws_moe/vram_split.hpp against hand-worked numbers: the benefit densities of
// a routed expert and of a KV token in HBM, which use is filled first, the
// caps (demand, --hbm-kv-gib, the experts' floor), whole eviction batches,
// fixed mode and its refusals naming both numbers, and the reasons.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "ws_moe/vram_split.hpp"

using ws_moe::hbm_kv_mode;
using ws_moe::split_vram;
using ws_moe::vram_split_inputs;
using writescope::index_t;

namespace {

constexpr index_t MiB = index_t{1} << 20;
constexpr double GiB = double(index_t{1} << 30);

// 8 experts of 2 MiB (slab and host bytes), top-2, batch 4; KV tokens of 1 KiB over
// 4 layers, eviction batches of 64 tokens (64 KiB), A = 4 ns, B = 3 ns, K = 1 ns, H = 0.5 ns.
vram_split_inputs base() {
  vram_split_inputs in;
  in.avail_bytes = 64 * MiB;
  in.experts_total = 8;
  in.expert_slab_bytes = 2 * MiB;
  in.expert_host_bytes = 2 * MiB;
  in.host_expert_floor_bytes = 1 * MiB;
  in.num_experts = 8;
  in.experts_per_token = 2;
  in.batch = 4;
  in.cpu_expert_bytes_per_second = 100e9;
  in.kv_demand_tokens = 64 * 100;  // 100 batches: 6.25 MiB
  in.batch_tokens = 64;
  in.kv_token_bytes = 1024;
  in.num_layers = 4;
  in.cpu_seconds_per_token = 4e-9;
  in.gpu_seconds_per_token = 3e-9;
  in.launch_seconds_per_token = 1e-9;
  in.hbm_seconds_per_token = 0.5e-9;
  return in;
}

}  // namespace

TEST_CASE("the densities: P·t_cpu per expert byte, L·A·(B'−H)/(A+B') per KV byte") {
  const auto s = split_vram(base());
  const double P = 1.0 - std::pow(1.0 - 2.0 / 8.0, 4.0);
  CHECK(s.expert_use_probability == doctest::Approx(P));
  CHECK(s.expert_seconds_per_gib == doctest::Approx(P * (2.0 * MiB / 100e9) / (2.0 * MiB) * GiB));
  const double A = 4e-9, Bp = 2e-9, H = 0.5e-9;
  CHECK(s.kv_seconds_per_gib == doctest::Approx(4.0 * A * (Bp - H) / (A + Bp) / 1024.0 * GiB));
}

TEST_CASE("KV denser: the region takes the planned KV (whole batches), the experts the rest") {
  auto in = base();
  in.cpu_expert_bytes_per_second = 1e15;  // experts save almost nothing
  const auto s = split_vram(in);
  CHECK(s.first == "KV");
  CHECK(s.hbm_tokens == 64 * 100);
  CHECK(s.hbm_bytes == 100 * 64 * 1024);
  CHECK(s.reason.rfind("KV first", 0) == 0);
  // --hbm-kv-gib caps it, rounded down to whole batches
  in.cap_bytes = 64 * 1024 * 10 + 5;
  CHECK(split_vram(in).hbm_tokens == 64 * 10);
  // a cap below one batch: no region, and the reason says why
  in.cap_bytes = 1000;
  const auto none = split_vram(in);
  CHECK(none.hbm_bytes == 0);
  CHECK(none.reason.find("no region: --hbm-kv-gib holds no whole eviction batch of") != std::string::npos);
}

TEST_CASE("KV denser but the budget holds less than the KV and the experts: the experts' floor stays free") {
  auto in = base();
  in.cpu_expert_bytes_per_second = 1e15;
  in.avail_bytes = 4 * MiB;  // the KV demand alone (6.25 MiB) does not fit
  const auto s = split_vram(in);
  CHECK(s.first == "KV");
  CHECK(s.hbm_bytes == (3 * MiB / (64 * 1024)) * 64 * 1024);  // avail − floor, whole batches
  CHECK(s.hbm_bytes <= in.avail_bytes - in.host_expert_floor_bytes);
}

TEST_CASE("experts denser: they take their demand first, the region what is left") {
  auto in = base();
  in.cpu_expert_bytes_per_second = 1e6;  // a host expert costs seconds
  in.avail_bytes = 16 * MiB + 64 * 1024 * 7 + 100;
  const auto s = split_vram(in);
  CHECK(s.first == "experts");
  CHECK(s.hbm_tokens == 64 * 7);
  in.avail_bytes = 10 * MiB;  // not even the experts fit: no region
  const auto none = split_vram(in);
  CHECK(none.hbm_bytes == 0);
  CHECK(none.first == "experts");
}

TEST_CASE("H at least B': a KV token in HBM saves nothing, the experts go first") {
  auto in = base();
  in.hbm_seconds_per_token = 2e-9;  // = B − K
  const auto s = split_vram(in);
  CHECK(s.kv_seconds_per_gib == 0.0);
  CHECK(s.first == "experts");
  CHECK(s.reason.find("saves nothing") != std::string::npos);
}

TEST_CASE("off, unsized, fixed and fixed's refusals") {
  auto in = base();
  in.mode = hbm_kv_mode::off;
  CHECK(split_vram(in).hbm_bytes == 0);
  CHECK(split_vram(in).reason.find("--hbm-kv off") != std::string::npos);
  in = base();
  in.sized = false;
  CHECK(split_vram(in).hbm_bytes == 0);
  in = base();
  in.mode = hbm_kv_mode::fixed;
  in.cap_bytes = 64 * 1024 * 3 + 1;
  const auto f = split_vram(in);
  CHECK(f.hbm_tokens == 64 * 3);
  CHECK(f.first == "KV");
  in.cap_bytes = 100;
  CHECK_THROWS_WITH_AS(split_vram(in), doctest::Contains("holds no whole eviction batch"), writescope::config_error);
  in.cap_bytes = 128 * MiB;
  CHECK_THROWS_WITH_AS(split_vram(in), doctest::Contains("but the VRAM budget has"), writescope::config_error);
}

TEST_CASE("--kv-vram-budget-mib: auto's region capped at what it leaves, fixed refused above it") {
  auto in = base();
  in.cpu_expert_bytes_per_second = 1e15;  // KV first
  in.kv_budget_left_bytes = 64 * 1024 * 5 + 7;
  CHECK(split_vram(in).hbm_tokens == 64 * 5);
  in.kv_budget_left_bytes = 0;  // the D-window and ping-pong took it all
  const auto none = split_vram(in);
  CHECK(none.hbm_bytes == 0);
  CHECK(none.reason.find("no region: --kv-vram-budget-mib holds no whole eviction batch") != std::string::npos);
  in = base();
  in.mode = hbm_kv_mode::fixed;
  in.cap_bytes = 64 * 1024 * 3;
  in.kv_budget_left_bytes = 64 * 1024 * 3;
  CHECK(split_vram(in).hbm_tokens == 64 * 3);
  in.kv_budget_left_bytes = 64 * 1024 * 2;
  CHECK_THROWS_WITH_AS(split_vram(in), doctest::Contains("needs 0.19 MiB (196608 bytes)"), writescope::config_error);
  CHECK_THROWS_WITH_AS(split_vram(in), doctest::Contains("--kv-vram-budget-mib leaves 0.12 MiB (131072 bytes)"),
                       writescope::config_error);
}
