// SPDX-License-Identifier: Apache-2.0
// Calibration (paper §5.3) and online adaptation (§7.8) on the host backend:
// the calibration file format and its loader errors, the linear fit of step
// time against tokens, injected costs moving the routed share as eq. 2
// predicts (A and B re-measured online), convergence of the estimates within
// one eviction batch and of the placed share within a few, and how
// hybrid_attention pairs the GPU side's measured seconds with the tokens of
// the same launch when the engine reports an earlier launch (cuda_backend).
// Expected placements come from an independent simulation of eq. 2 and the
// marginal-share rule written here, as in test_policy.cpp.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <writescope/calibration.hpp>

#include "support/harness.hpp"

using namespace wstest;

namespace {

double eq2(double a, double b, double delta, double L) {
  const double r = b / (a + b) + delta / ((a + b) * L);
  return r < 0 ? 0 : (r > 1 ? 1 : r);
}

bool to_cpu(double target, index_t placed, index_t cpu, index_t batch) {
  const double want = target * double(placed + batch);
  return std::abs(double(cpu + batch) - want) < std::abs(double(cpu) - want);
}

/// A scratch file path, removed at scope exit.
struct temp_file {
  std::string path;
  explicit temp_file(const std::string& name)
      : path((std::filesystem::temp_directory_path() / ("ws_test_calibration_" + name)).string()) {}
  ~temp_file() { std::remove(path.c_str()); }
  void write(const std::string& text) const { std::ofstream(path, std::ios::binary) << text; }
};

calibration sample_calibration() {
  calibration c;
  c.device = "test GPU";
  c.cpu = "test CPU";
  c.date_utc = "2026-12-01T00:00:00Z";
  c.command = "calibrate --test";
  calibration_entry q16;
  q16.preset = "Qwen3-30B-A3B";
  q16.batch = 16;
  q16.cpu_threads = 15;
  q16.cpu_cost_per_token_seconds = 2.5e-11;
  q16.gpu_cost_per_token_seconds = 3.75e-11;
  q16.cpu_fixed_seconds = 8e-5;
  q16.gpu_fixed_seconds = 5e-5;
  q16.points.push_back({"cpu", 8192, 131072, 3.36e-6});
  q16.points.push_back({"gpu", 8192, 131072, 4.96e-6});
  calibration_entry q4 = q16;
  q4.batch = 4;
  q4.cpu_cost_per_token_seconds = 3e-11;
  q4.launch_cost_per_token_seconds = 0.75e-11;  // K; the other entries have none
  q4.block_tokens = 32;                          // the KV plan of the measurement
  q4.gpu_split_blocks = 4;
  q4.points.clear();
  calibration_entry d16 = q16;
  d16.preset = "DeepSeek-V2-Lite";
  d16.cpu_cost_per_token_seconds = 3.4e-11;
  d16.gpu_cost_per_token_seconds = 2.1e-11;
  d16.cpu_fixed_seconds = -1e-5;  // a negative intercept is legal (paper Fig. 7: Qwen3's Δ < 0)
  c.entries = {q16, q4, d16};
  return c;
}

}  // namespace

TEST_CASE("calibration files: save/load round trip, lookup by preset alias and nearest batch, params on a base") {
  temp_file f("roundtrip.json");
  const calibration c = sample_calibration();
  save_calibration(f.path, c);
  const calibration r = load_calibration(f.path);
  CHECK(r.device == "test GPU");
  CHECK(r.cpu == "test CPU");
  CHECK(r.command == "calibrate --test");
  REQUIRE(r.entries.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(r.entries[i].preset == c.entries[i].preset);
    CHECK(r.entries[i].batch == c.entries[i].batch);
    CHECK(r.entries[i].cpu_threads == 15);
    CHECK(r.entries[i].cpu_cost_per_token_seconds == c.entries[i].cpu_cost_per_token_seconds);  // exact: JSON round-trips doubles
    CHECK(r.entries[i].gpu_cost_per_token_seconds == c.entries[i].gpu_cost_per_token_seconds);
    CHECK(r.entries[i].cpu_fixed_seconds == c.entries[i].cpu_fixed_seconds);
    CHECK(r.entries[i].gpu_fixed_seconds == c.entries[i].gpu_fixed_seconds);
    CHECK(r.entries[i].launch_cost_per_token_seconds == c.entries[i].launch_cost_per_token_seconds);
    CHECK(r.entries[i].block_tokens == c.entries[i].block_tokens);
    CHECK(r.entries[i].gpu_split_blocks == c.entries[i].gpu_split_blocks);
    CHECK(r.entries[i].points.size() == c.entries[i].points.size());
  }
  // K enters the share as B - K: (3.75 - 0.75) / (3 + 3.75 - 0.75) = 0.5
  CHECK(r.entries[1].converged_share() == doctest::Approx(0.5));
  CHECK(r.entries[1].params().launch_cost_per_token_seconds == 0.75e-11);
  CHECK(roofline_policy(r.entries[1].params()).converged_share() == doctest::Approx(0.5));
  CHECK(r.entries[0].points[1].engine == "gpu");
  CHECK(r.entries[0].points[1].tokens == 131072);
  CHECK(r.entries[0].converged_share() == doctest::Approx(0.6));

  CHECK(&r.find("Qwen3-30B-A3B", 16) == &r.entries[0]);
  CHECK(&r.find("qwen3", 16) == &r.entries[0]);          // short alias
  CHECK(&r.find("QWEN3-30B-A3B", 4) == &r.entries[1]);   // case-insensitive
  CHECK(&r.find("qwen3", 8) == &r.entries[0]);           // 8 is as far from 4 as from 16 (log scale): the larger
  CHECK(&r.find("qwen3", 5) == &r.entries[1]);           // nearest in log scale
  CHECK(&r.find("qwen3", 64) == &r.entries[0]);
  CHECK(&r.find("dsv2", 1) == &r.entries[2]);            // the only DeepSeek batch

  roofline_params base;
  base.track_gpu_cost = true;
  base.cost_window_samples = 32;
  const roofline_params p = load_roofline_params(f.path, "deepseek-v2-lite", 16, base);
  CHECK(p.track_gpu_cost);
  CHECK(p.cost_window_samples == 32);
  CHECK(p.cpu_cost_per_token_seconds == 3.4e-11);
  CHECK(p.gpu_cost_per_token_seconds == 2.1e-11);
  CHECK(p.cpu_fixed_seconds == -1e-5);
  CHECK(p.fixed_overhead_gap_seconds() == doctest::Approx(6e-5));
  const roofline_policy pol(p);  // a loaded calibration is always a valid policy
  CHECK(pol.converged_share() == doctest::Approx(2.1 / 5.5));
}

TEST_CASE("calibration loader errors name the file, the entry and the field") {
  const auto expect_checkpoint = [](const std::string& path, std::initializer_list<std::string> words) {
    try {
      (void)load_calibration(path);
      FAIL("expected checkpoint_error");
    } catch (const checkpoint_error& e) {
      INFO(e.what());
      CHECK(mentions(e.what(), words));
    }
  };
  SUBCASE("missing file") {
    expect_checkpoint("/nonexistent/dir/cal.json", {"/nonexistent/dir/cal.json", "cannot open"});
    CHECK_THROWS_AS((void)load_roofline_params("/nonexistent/cal.json", "qwen3", 16), checkpoint_error);
  }
  temp_file f("bad.json");
  nlohmann::json good = to_json(sample_calibration());
  SUBCASE("truncated / not JSON") {
    const std::string text = good.dump();
    f.write(text.substr(0, text.size() / 2));
    expect_checkpoint(f.path, {f.path.c_str(), "not valid JSON"});
    f.write("");
    expect_checkpoint(f.path, {"not valid JSON"});
  }
  SUBCASE("not a calibration file") {
    f.write("[1, 2, 3]");
    expect_checkpoint(f.path, {"top level"});
    f.write(R"({"format": "safetensors", "version": 1, "entries": []})");
    expect_checkpoint(f.path, {"\"format\"", "writescope-calibration"});
    nlohmann::json j = good;
    j["version"] = 7;
    f.write(j.dump());
    expect_checkpoint(f.path, {"version 7", "not supported"});
    j = good;
    j.erase("entries");
    f.write(j.dump());
    expect_checkpoint(f.path, {"\"entries\""});
  }
  SUBCASE("missing or mistyped fields") {
    nlohmann::json j = good;
    j["entries"][1].erase("gpu_cost_per_token_seconds");
    f.write(j.dump());
    expect_checkpoint(f.path, {"entry 1", "Qwen3-30B-A3B", "missing field \"gpu_cost_per_token_seconds\""});
    j = good;
    j["entries"][0]["batch"] = "sixteen";
    f.write(j.dump());
    expect_checkpoint(f.path, {"entry 0", "\"batch\"", "wrong type"});
    j = good;
    j["entries"][2]["points"][0].erase("seconds");
    f.write(j.dump());
    expect_checkpoint(f.path, {"entry 2", "point 0", "\"seconds\""});
  }
  SUBCASE("values that break a rule") {
    nlohmann::json j = good;
    j["entries"][0]["cpu_cost_per_token_seconds"] = -2e-11;
    f.write(j.dump());
    expect_checkpoint(f.path, {"entry 0", "positive", "A=-2e-11 s"});
    j = good;
    j["entries"][0]["gpu_cost_per_token_seconds"] = 0.0;
    f.write(j.dump());
    expect_checkpoint(f.path, {"B=0 s"});
    j = good;
    j["entries"][1]["batch"] = 0;
    f.write(j.dump());
    expect_checkpoint(f.path, {"entry 1", "batch 0"});
    j = good;
    j["entries"][1]["launch_cost_per_token_seconds"] = -1e-12;
    f.write(j.dump());
    expect_checkpoint(f.path, {"entry 1", "launch_cost_per_token_seconds -1e-12", ">= 0"});
    j = good;
    j["entries"][1]["gpu_split_blocks"] = 0;
    f.write(j.dump());
    expect_checkpoint(f.path, {"entry 1", "gpu_split_blocks 0", ">= 1"});
  }
  SUBCASE("a file written before K and the KV plan were recorded loads with zeros") {
    nlohmann::json j = good;
    for (auto& e : j["entries"]) {
      e.erase("launch_cost_per_token_seconds");
      e.erase("block_tokens");
      e.erase("gpu_split_blocks");
    }
    f.write(j.dump());
    const calibration r = load_calibration(f.path);
    for (const calibration_entry& e : r.entries) {
      CHECK(e.launch_cost_per_token_seconds == 0.0);
      CHECK(e.block_tokens == 0);
      CHECK(e.gpu_split_blocks == 0);
    }
  }
  SUBCASE("a preset the file does not calibrate is a config_error listing what it has") {
    save_calibration(f.path, sample_calibration());
    try {
      (void)load_roofline_params(f.path, "Mixtral-8x7B", 16);
      FAIL("expected config_error");
    } catch (const config_error& e) {
      CHECK(mentions(e.what(), {"Mixtral-8x7B", "Qwen3-30B-A3B batch 16", "DeepSeek-V2-Lite batch 16", "calibrate"}));
    }
  }
}

TEST_CASE("fit_line recovers A and C_CPU from step times (eq. 1) and refuses degenerate input") {
  // T = A·tokens + C with A = 2.5e-11 s, C = 80 us, at five token counts, plus tiny noise.
  const std::vector<double> tokens{16384, 32768, 65536, 131072, 262144};
  std::vector<double> secs;
  for (std::size_t i = 0; i < tokens.size(); ++i) secs.push_back(2.5e-11 * tokens[i] + 8e-5 + (i % 2 ? 1e-9 : -1e-9));
  const linear_fit f = fit_line(tokens, secs);
  CHECK(f.n == 5);
  CHECK(f.slope == doctest::Approx(2.5e-11).epsilon(1e-3));
  CHECK(f.intercept == doctest::Approx(8e-5).epsilon(1e-3));
  CHECK(f.r2 > 0.9999);
  // A negative intercept (fixed cost of the other side larger) comes out as such.
  const std::vector<double> neg{1e-3, 2e-3, 3e-3};
  const std::vector<double> xs{1, 2, 3};
  const std::vector<double> ys{0.5e-3, 1.5e-3, 2.5e-3};
  CHECK(fit_line(xs, ys).intercept == doctest::Approx(-0.5e-3));
  CHECK_THROWS_AS((void)fit_line(std::vector<double>{1.0}, std::vector<double>{1.0}), config_error);
  CHECK_THROWS_AS((void)fit_line(std::vector<double>{2.0, 2.0}, std::vector<double>{1.0, 3.0}), config_error);
  CHECK_THROWS_AS((void)fit_line(xs, neg.size() == 3 ? std::vector<double>{1.0} : neg), config_error);
}

namespace {

// A cache driven by decode appends and flushes only (no attention step): the
// policy sees only the cost samples the test injects.
struct routing_rig {
  using L = gqa_layout<64>;
  static constexpr int D = 64;
  host_backend be;
  L lay{1, 1};
  host_cache<L, roofline_policy> cache;
  explicit routing_rig(const roofline_params& p, int max_seqs = 1) : cache(be, lay, make_spec(max_seqs), roofline_policy(p)) {}
  static partition_spec make_spec(int max_seqs) {
    partition_spec s = small_spec(1, max_seqs, 16, D);
    s.cpu_capacity_tokens = 1 << 20;
    s.pinned_capacity_tokens = 1 << 20;
    s.ping_pong_bytes = 4 * block_format<L>{L(1, 1), 16}.block_bytes();
    return s;
  }
  flush_report one_batch(std::span<const sequence_id> batch) {
    std::vector<bf16> kz(batch.size() * 64, bf16{0});
    kv_tokens<L, pageable_host_space> kv;
    kv.planes = {kz.data(), kz.data()};
    kv.num_tokens = index_t(batch.size());
    flush_report rep;
    for (int t = 0; t < D; ++t) {
      cache.append(0, batch, kv);
      const flush_report r = cache.flush();
      rep.cpu_batches += r.cpu_batches;
      rep.gpu_batches += r.gpu_batches;
    }
    return rep;
  }
  /// One decode step's worth of samples (one per layer) at the true costs
  /// a, b, c_cpu, c_gpu for the sequence's current placement.
  void inject(int layers, double a, double b, double c_cpu, double c_gpu, index_t cpu_tokens, index_t gpu_tokens) {
    for (int l = 0; l < layers; ++l) {
      cost_sample s;
      s.cpu_tokens = cpu_tokens;
      s.cpu_seconds = a * double(cpu_tokens) + c_cpu;
      s.gpu_streamed_tokens = gpu_tokens;
      s.gpu_seconds = b * double(gpu_tokens) + c_gpu;
      s.batch_size = 1;
      cache.policy().observe(s);
    }
  }
};

roofline_params costs(double a, double b, double c_cpu, double c_gpu, int window, bool track_b) {
  roofline_params p;
  p.cpu_cost_per_token_seconds = a;
  p.gpu_cost_per_token_seconds = b;
  p.cpu_fixed_seconds = c_cpu;
  p.gpu_fixed_seconds = c_gpu;
  p.cost_window_samples = window;
  p.track_gpu_cost = track_b;
  return p;
}

}  // namespace

TEST_CASE("injected costs move the share as eq. 2 predicts: PCIe contention (B), then CPU contention (A)") {
  // True solo costs, calibrated exactly: A = 2 ns, B = 3 ns per token: p = 0.6;
  // C_CPU = 0.2 us, C_GPU = 0.6 us: Δ/(A+B) = 80 tokens.
  const double A = 2e-9, B = 3e-9, c_cpu = 2e-7, c_gpu = 6e-7, delta = c_gpu - c_cpu;
  const int layers = 8;
  routing_rig rig(costs(A, B, c_cpu, c_gpu, 2 * layers, true));  // a window of two decode steps
  constexpr index_t D = routing_rig::D;
  const std::vector<sequence_id> batch{rig.cache.begin_sequence(0)};
  index_t placed = 0, cpu = 0;
  double a = A, b = B;
  // The simulation routes with the policy's own estimates (ratios of sums, which
  // may differ from the injected values in the last bit and break ties differently).
  auto sync_estimates = [&] {
    a = rig.cache.policy().cpu_cost_per_token_seconds();
    b = rig.cache.policy().gpu_cost_per_token_seconds();
  };
  // sim: one eviction batch routed by the independent model at the current estimates.
  auto check_batch = [&](const flush_report& rep) {
    const double r = eq2(a, b, delta, double(placed + D));
    const bool c = to_cpu(r, placed, cpu, D);
    REQUIRE(rep.cpu_batches == (c ? 1 : 0));
    REQUIRE(rep.gpu_batches == (c ? 0 : 1));
    cpu += c ? D : 0;
    placed += D;
    const sequence_state& st = rig.cache.sequence(batch[0]);
    REQUIRE(st.placed_tokens == placed);
    REQUIRE(st.cpu_placed_tokens == cpu);
    // The cumulative share stays within one batch quantum of the target.
    return std::abs(double(cpu) / double(placed) - r);
  };

  SUBCASE("calibrated on truth: on target from the first batch, and the estimates do not move") {
    for (int k = 0; k < 40; ++k) {
      const flush_report rep = rig.one_batch(batch);
      CHECK(check_batch(rep) <= double(D) / (2.0 * double(placed)) + 1e-12);
      rig.inject(layers, A, B, c_cpu, c_gpu, cpu, placed - cpu);
      sync_estimates();
      CHECK(rig.cache.policy().cpu_cost_per_token_seconds() == doctest::Approx(A).epsilon(1e-9));
      CHECK(rig.cache.policy().gpu_cost_per_token_seconds() == doctest::Approx(B).epsilon(1e-9));
    }
    CHECK(double(cpu) / double(placed) == doctest::Approx(eq2(A, B, delta, double(placed))).epsilon(double(D) / double(placed)));
  }

  SUBCASE("B triples (another tenant on PCIe): new batches go to the CPU; A triples later: back toward the GPU") {
    for (int k = 0; k < 20; ++k) {
      check_batch(rig.one_batch(batch));
      rig.inject(layers, A, B, c_cpu, c_gpu, cpu, placed - cpu);
      sync_estimates();
    }
    const double share_solo = double(cpu) / double(placed);
    // PCIe contention: B' = 3B. One decode step of samples is half the window;
    // after a second the window holds only contended samples.
    rig.inject(layers, A, 3 * B, c_cpu, c_gpu, cpu, placed - cpu);
    rig.inject(layers, A, 3 * B, c_cpu, c_gpu, cpu, placed - cpu);
    b = rig.cache.policy().gpu_cost_per_token_seconds();
    a = rig.cache.policy().cpu_cost_per_token_seconds();
    CHECK(b == doctest::Approx(3 * B).epsilon(1e-9));
    CHECK(a == doctest::Approx(A).epsilon(1e-9));
    CHECK(rig.cache.policy().converged_share() == doctest::Approx(9.0 / 11.0).epsilon(1e-9));  // 3B/(A+3B)
    CHECK(rig.cache.policy().target_share(placed + D) == doctest::Approx(eq2(A, 3 * B, delta, double(placed + D))));
    int moves_up = 0;
    for (int k = 0; k < 60; ++k) {
      const flush_report rep = rig.one_batch(batch);
      check_batch(rep);
      moves_up += rep.cpu_batches;
      rig.inject(layers, A, 3 * B, c_cpu, c_gpu, cpu, placed - cpu);
      sync_estimates();
    }
    const double share_contended = double(cpu) / double(placed);
    CHECK(share_contended > share_solo + 0.1);
    CHECK(std::abs(share_contended - eq2(A, 3 * B, delta, double(placed))) <= double(D) / (2.0 * double(placed)) + 1e-12);
    CHECK(moves_up > 30);
    // CPU contention: A' = 3A. p = 3B/(3A+3B) = 0.6 again: the share comes back down.
    rig.inject(layers, 3 * A, 3 * B, c_cpu, c_gpu, cpu, placed - cpu);
    rig.inject(layers, 3 * A, 3 * B, c_cpu, c_gpu, cpu, placed - cpu);
    a = rig.cache.policy().cpu_cost_per_token_seconds();
    b = rig.cache.policy().gpu_cost_per_token_seconds();
    CHECK(rig.cache.policy().converged_share() == doctest::Approx(0.6).epsilon(1e-9));
    for (int k = 0; k < 100; ++k) {
      check_batch(rig.one_batch(batch));
      rig.inject(layers, 3 * A, 3 * B, c_cpu, c_gpu, cpu, placed - cpu);
      sync_estimates();
    }
    CHECK(double(cpu) / double(placed) < share_contended - 0.05);
    CHECK(std::abs(double(cpu) / double(placed) - eq2(3 * A, 3 * B, delta, double(placed))) <=
          double(D) / (2.0 * double(placed)) + 1e-12);
  }
}

TEST_CASE("after a cost change the estimates converge within one eviction batch, the placed share within a few") {
  // 48 layers (Qwen3-30B-A3B), one sample per layer and step, a window of 256
  // samples (the default): a full window is 6 steps, far below D = 64 steps.
  const int layers = 48, window = 256;
  const double A = 2e-9, B = 3e-9;
  routing_rig rig(costs(A, B, 0, 0, window, true));
  constexpr index_t D = routing_rig::D;
  const std::vector<sequence_id> batch{rig.cache.begin_sequence(0)};
  for (int k = 0; k < 4; ++k) rig.one_batch(batch);  // L0 = 4 D, share 0.5 (p = 0.6 rounds to 2 of 4 batches)
  const sequence_state& st = rig.cache.sequence(batch[0]);
  REQUIRE(st.placed_tokens == 4 * D);
  const index_t cpu0 = st.cpu_placed_tokens;
  for (int step = 0; step < 8; ++step) rig.inject(layers, A, B, 0, 0, cpu0, st.placed_tokens - cpu0);  // a full window at the old costs
  REQUIRE(rig.cache.policy().cpu_cost_per_token_seconds() == doctest::Approx(A));
  // The CPU becomes 3x faster (A' = A/3, e.g. a competing job ended): p' = 3/(2/3+3) = 0.818.
  int steps_to_converge = -1;
  for (int step = 1; step <= int(D); ++step) {
    rig.inject(layers, A / 3, B, 0, 0, cpu0, st.placed_tokens - cpu0);
    if (steps_to_converge < 0 && std::abs(rig.cache.policy().cpu_cost_per_token_seconds() - A / 3) < 1e-9 * A)
      steps_to_converge = step;
  }
  INFO("steps until A converged: " << steps_to_converge);
  CHECK(steps_to_converge == (window + layers - 1) / layers);  // 6 steps: the window length in steps
  CHECK(steps_to_converge < int(D));                           // within one eviction batch
  // The share: every new batch goes to the CPU until the cumulative share is on
  // the new target; the independent simulation counts how many that takes.
  const double p1 = rig.cache.policy().converged_share();
  CHECK(p1 == doctest::Approx(B / (A / 3 + B)));
  index_t placed = st.placed_tokens, cpu = cpu0;
  int expected = 0;
  while (!(std::abs(double(cpu) / double(placed) - p1) <= double(D) / (2.0 * double(placed)))) {
    REQUIRE(to_cpu(p1, placed, cpu, D));
    cpu += D;
    placed += D;
    ++expected;
  }
  int batches = 0;
  while (std::abs(double(rig.cache.sequence(batch[0]).cpu_placed_tokens) / double(rig.cache.sequence(batch[0]).placed_tokens) -
                  p1) > double(D) / (2.0 * double(rig.cache.sequence(batch[0]).placed_tokens))) {
    const flush_report rep = rig.one_batch(batch);
    CHECK(rep.cpu_batches == 1);
    ++batches;
    REQUIRE(batches <= 50);
  }
  CHECK(batches == expected);
  CHECK(batches <= 5);  // a few eviction batches (the change came early: L0 = 4 D)
}

namespace {

// A host backend whose engine behaves like cuda_backend's: finish() returns the
// seconds of the previous launch (0 before one completed), and
// take_completed_gpu_cost() reports each completed launch once, with that
// launch's own streamed tokens.
inline std::vector<completed_gpu_cost>& lagged_launches() {
  static std::vector<completed_gpu_cost> v;
  return v;
}

struct lagged_backend : host_backend {
  template <kv_layout Layout>
  class gpu_engine : public host_backend::gpu_engine<Layout> {
    using base = host_backend::gpu_engine<Layout>;

   public:
    using base::base;
    static constexpr bool asynchronous = true;
    void launch(const typename base::args_type& a) {
      tokens_ = a.plan->streamed_blocks * a.format.block_tokens;
      base::launch(a);
    }
    double finish(const step_outputs<pageable_host_space>& o) {
      const double s = base::finish(o);
      auto& log = lagged_launches();
      log.push_back({s, 0.0, tokens_, false});
      if (log.size() < 2) return 0.0;
      fresh_ = true;
      return log[log.size() - 2].seconds;
    }
    completed_gpu_cost take_completed_gpu_cost() {
      if (!fresh_) return {};
      fresh_ = false;
      const auto& log = lagged_launches();
      return log[log.size() - 2];
    }

   private:
    index_t tokens_ = 0;
    bool fresh_ = false;
  };
};
static_assert(backend<lagged_backend>);

}  // namespace

TEST_CASE("hybrid_attention feeds B with each completed launch's own seconds and tokens (asynchronous engine)") {
  using L = gqa_layout<128>;
  lagged_backend be;
  const L lay(8, 2);
  partition_spec spec = small_spec(1, 2);
  set_ping_pong_blocks(spec, lay, 8);
  roofline_params pr = costs(1.0, 1.0, 0, 0, 1, true);  // absurd calibration: p = 0.5; window 1: B = the last sample
  inplace_kv_cache<L, lagged_backend, pageable_allocator, roofline_policy> cache(be, lay, spec, roofline_policy(pr));
  decode_driver<decltype(cache)> d(cache, {2, false}, 5, 1.0 / std::sqrt(128.0));
  lagged_launches().clear();
  const sequence_id a = d.add(4 * 32);      // 4 batches: 2 CPU, 2 pinned
  const sequence_id b = d.add(8 * 32 + 5);  // 8 batches
  const std::vector<sequence_id> one{a}, two{a, b};

  CHECK(d.step(one).ok());
  REQUIRE(lagged_launches().size() == 1);
  REQUIRE(lagged_launches()[0].streamed_tokens > 0);
  // No launch had completed: no GPU sample (before the fix, a 0-second sample pulled B to its floor).
  CHECK(cache.policy().gpu_cost_per_token_seconds() == 1.0);
  CHECK(cache.policy().cpu_cost_per_token_seconds() < 1.0);  // A is measured at once

  CHECK(d.step(two).ok());
  REQUIRE(lagged_launches().size() == 2);
  const completed_gpu_cost l0 = lagged_launches()[0], l1 = lagged_launches()[1];
  REQUIRE(l1.streamed_tokens != l0.streamed_tokens);
  // B = the first launch's seconds over the first launch's tokens, not over this step's.
  CHECK(cache.policy().gpu_cost_per_token_seconds() == doctest::Approx(std::max(l0.seconds / double(l0.streamed_tokens), 1e-15)));

  CHECK(d.step(two).ok());
  CHECK(cache.policy().gpu_cost_per_token_seconds() == doctest::Approx(std::max(l1.seconds / double(l1.streamed_tokens), 1e-15)));
}

TEST_CASE("host backend: online B from real steps is the step's GPU seconds per streamed token, C_GPU removed") {
  using L = gqa_layout<128>;
  host_backend be;
  const L lay(8, 2);
  partition_spec spec = small_spec(1, 2);
  set_ping_pong_blocks(spec, lay, 8);
  const double c_gpu = 1e-7;
  roofline_params pr = costs(1.0, 1.0, 0, c_gpu, 1, true);
  host_cache<L, roofline_policy> cache(be, lay, spec, roofline_policy(pr));
  decode_driver<decltype(cache)> d(cache, {2, false}, 9, 1.0 / std::sqrt(128.0));
  const std::vector<sequence_id> batch{d.add(6 * 32), d.add(4 * 32 + 3)};
  CHECK(d.step(batch).ok());
  const step_report& rep = d.last_report;
  REQUIRE(rep.streamed_tokens > 0);
  CHECK(cache.policy().gpu_cost_per_token_seconds() ==
        doctest::Approx(std::max(std::max(0.0, rep.gpu_seconds - c_gpu) / double(rep.streamed_tokens), 1e-15)));
}
