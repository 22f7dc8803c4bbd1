// SPDX-License-Identifier: Apache-2.0
// Routing policies (paper §5; docs/ARCHITECTURE.md §1, §2a): eq. 2 by hand-computed numbers,
// the marginal-share rule, online re-estimation of A (and B), and — through a
// cache driven by decode appends and flushes — convergence of the placed CPU
// share to B/(A+B) and re-targeting when the measured CPU cost changes. The
// expected placements come from an independent simulation of eq. 2 and the
// marginal rule written here.
#include <doctest/doctest.h>

#include "support/harness.hpp"

using namespace wstest;

namespace {

struct no_tag_policy {
  route_decision route(const route_query&) const { return {}; }
  void observe(const cost_sample&) {}
};
static_assert(!routing_policy<no_tag_policy>, "policies are opt-in by tag");

roofline_params params(double a, double b, double c_cpu = 0, double c_gpu = 0, int window = 256) {
  roofline_params p;
  p.cpu_cost_per_token_seconds = a;
  p.gpu_cost_per_token_seconds = b;
  p.cpu_fixed_seconds = c_cpu;
  p.gpu_fixed_seconds = c_gpu;
  p.cost_window_samples = window;
  return p;
}

// eq. 2, written independently of policy.hpp.
double eq2(double a, double b, double delta, double L) {
  double r = b / (a + b) + delta / ((a + b) * L);
  return r < 0 ? 0 : (r > 1 ? 1 : r);
}

// The marginal-share rule: the side leaving the cumulative share closest to
// the target, measured in tokens after the batch; exact ties to the GPU.
bool to_cpu(double target, index_t placed, index_t cpu, index_t batch) {
  // |cpu + batch - want| < |cpu - want| with want = target·(placed + batch),
  // i.e. cpu + batch/2 < want: compared without a subtraction that an FMA
  // contraction could fuse with the product (ties to the GPU).
  return batch > 0 && double(2 * cpu + batch) < 2.0 * (target * double(placed + batch));
}

}  // namespace

TEST_CASE("roofline target_share follows eq. 2 (hand-computed), clamps, and handles L = 0") {
  // A = 2 ns, B = 6 ns per token: B/(A+B) = 0.75; |Δ| = 2 us: Δ/(A+B) = 250 tokens.
  SUBCASE("delta > 0 (GPU fixed cost larger): the CPU takes more of short contexts") {
    const roofline_policy p(params(2e-9, 6e-9, 1e-6, 3e-6));
    CHECK(p.converged_share() == doctest::Approx(0.75).epsilon(1e-12));
    CHECK(p.target_share(2000) == doctest::Approx(0.875).epsilon(1e-12));
    CHECK(p.target_share(1000) == doctest::Approx(1.0).epsilon(1e-12));
    CHECK(p.target_share(500) == 1.0);  // 1.25 clamped
    CHECK(p.target_share(1000000) == doctest::Approx(0.75025).epsilon(1e-12));
    CHECK(p.target_share(0) == 1.0);
    CHECK(p.target_share(-5) == 1.0);
  }
  SUBCASE("delta < 0 (CPU fixed cost larger): the GPU takes more of short contexts") {
    const roofline_policy p(params(2e-9, 6e-9, 3e-6, 1e-6));
    CHECK(p.params().fixed_overhead_gap_seconds() == doctest::Approx(-2e-6));
    CHECK(p.target_share(1000) == doctest::Approx(0.5).epsilon(1e-12));
    CHECK(p.target_share(400) == doctest::Approx(0.125).epsilon(1e-12));
    CHECK(p.target_share(250) == 0.0);  // 0.75 - 1 clamped
    CHECK(p.target_share(0) == 0.0);
  }
  SUBCASE("delta = 0: the converged share at every L") {
    const roofline_policy p(params(3e-9, 1e-9));
    for (index_t L : {index_t(0), index_t(1), index_t(256), index_t(1) << 20}) CHECK(p.target_share(L) == doctest::Approx(0.25));
  }
  SUBCASE("placement_headroom is subtracted after eq. 2, then clamped (CPU assist)") {
    roofline_params pr = params(2e-9, 6e-9, 1e-6, 3e-6);
    pr.placement_headroom = 0.05;
    const roofline_policy p(pr);
    CHECK(p.converged_share() == doctest::Approx(0.75).epsilon(1e-12));  // the model's balance is unchanged
    CHECK(p.target_share(2000) == doctest::Approx(0.825).epsilon(1e-12));
    CHECK(p.target_share(1000) == doctest::Approx(0.95).epsilon(1e-12));
    pr = params(3e-9, 1e-9);
    pr.placement_headroom = 0.4;
    CHECK(roofline_policy(pr).target_share(4096) == 0.0);  // 0.25 - 0.4 clamped
  }
  SUBCASE("route() steers toward r(L) of the placed tokens after the batch, all sequences") {
    const roofline_policy p(params(2e-9, 6e-9, 1e-6, 3e-6));
    route_query q;
    q.placed_tokens = 512;
    q.cpu_placed_tokens = 512;
    q.batch_tokens = 256;
    q.total_placed_tokens = 1744;  // + 256 = 2000: r = 0.875
    const route_decision d = p.route(q);
    CHECK(d.target.cpu_compute == doctest::Approx(0.875));
    CHECK(d.target.gpu_load == doctest::Approx(0.125));
    CHECK(d.region == (to_cpu(0.875, 512, 512, 256) ? placement::cpu_compute : placement::gpu_load));
  }
}

// The CPU side's path with an enqueue cost K per streamed token,
// C_CPU + A·r·L + K·(1−r)·L, against the GPU's C_GPU + B·(1−r)·L: the step is
// their max, minimised over r by brute force (independent of policy.hpp).
double best_share_brute(double a, double b, double k, double c_cpu, double c_gpu, double L) {
  double best_r = 0, best_t = 1e300;
  for (int i = 0; i <= 200000; ++i) {
    const double r = i / 200000.0;
    const double t = std::max(c_cpu + a * r * L + k * (1 - r) * L, c_gpu + b * (1 - r) * L);
    if (t < best_t - 1e-18) {
      best_t = t;
      best_r = r;
    }
  }
  return best_r;
}

TEST_CASE("roofline with an enqueue cost K: B - K replaces B, matching the brute-force optimum of the step") {
  SUBCASE("K < A, K < B: eq. 2 with B' = B - K, Δ term included") {
    for (double k : {0.0, 0.5e-9, 1e-9, 1.5e-9}) {
      CAPTURE(k);
      roofline_params pr = params(2e-9, 6e-9, 1e-6, 3e-6);
      pr.launch_cost_per_token_seconds = k;
      const roofline_policy p(pr);
      CHECK(p.launch_cost_per_token_seconds() == k);
      CHECK(p.converged_share() == doctest::Approx((6e-9 - k) / (8e-9 - k)).epsilon(1e-12));
      CHECK(roofline_converged_share(2e-9, 6e-9, k) == p.converged_share());
      for (double L : {4000.0, 20000.0, 1e6}) {
        CAPTURE(L);
        CHECK(p.target_share(index_t(L)) == doctest::Approx(eq2(2e-9, 6e-9 - k, 2e-6, L)).epsilon(1e-12));
        CHECK(p.target_share(index_t(L)) == doctest::Approx(best_share_brute(2e-9, 6e-9, k, 1e-6, 3e-6, L)).epsilon(1e-4));
      }
    }
    // K moves the share to the GPU: the CPU side also pays for every streamed token
    roofline_params pr = params(2e-9, 6e-9);
    pr.launch_cost_per_token_seconds = 1e-9;
    CHECK(roofline_policy(pr).converged_share() < roofline_policy(params(2e-9, 6e-9)).converged_share());
  }
  SUBCASE("no crossing: K >= A gives r = 1; A > K >= B gives r = 0 (the brute force agrees)") {
    roofline_params pr = params(2e-9, 6e-9);
    pr.launch_cost_per_token_seconds = 3e-9;  // >= A
    CHECK(roofline_policy(pr).target_share(1 << 20) == 1.0);
    CHECK(best_share_brute(2e-9, 6e-9, 3e-9, 0, 0, 1 << 20) == doctest::Approx(1.0));
    pr = params(8e-9, 2e-9);
    pr.launch_cost_per_token_seconds = 3e-9;  // A > K >= B
    CHECK(roofline_policy(pr).target_share(1 << 20) == 0.0);
    CHECK(roofline_policy(pr).converged_share() == 0.0);
    CHECK(best_share_brute(8e-9, 2e-9, 3e-9, 0, 0, 1 << 20) == doctest::Approx(0.0));
  }
  SUBCASE("K re-measured online from samples that carry a launch; untouched by the others or when not tracked") {
    roofline_params pr = params(2e-9, 6e-9, 0, 0, 2);
    roofline_policy p(pr);
    cost_sample s;
    s.cpu_tokens = 1000;
    s.cpu_seconds = 2e-6;
    p.observe(s);  // no launch: K stays 0
    CHECK(p.launch_cost_per_token_seconds() == 0.0);
    s.launch_streamed_tokens = 4000;
    s.launch_seconds = 4e-6;  // 1 ns per streamed token
    p.observe(s);
    CHECK(p.launch_cost_per_token_seconds() == doctest::Approx(1e-9).epsilon(1e-9));
    CHECK(p.converged_share() == doctest::Approx(5.0 / 7.0).epsilon(1e-9));
    s.launch_seconds = 12e-6;  // 3 ns; the window of 2 averages by ratio of sums
    p.observe(s);
    CHECK(p.launch_cost_per_token_seconds() == doctest::Approx(2e-9).epsilon(1e-9));
    pr.track_launch_cost = false;
    roofline_policy q(pr);
    q.observe(s);
    CHECK(q.launch_cost_per_token_seconds() == 0.0);
  }
}

TEST_CASE("roofline placement_headroom_z: eq. 2 with A + z·σ_A, σ_A the token-weighted spread of the window") {
  roofline_params pr;
  pr.cpu_cost_per_token_seconds = 2e-9;
  pr.gpu_cost_per_token_seconds = 2e-9;
  pr.cost_window_samples = 3;
  pr.placement_headroom_z = 1.5;
  roofline_policy p(pr);
  CHECK(p.cpu_cost_spread_seconds() == 0.0);
  CHECK(p.target_share(100000) == doctest::Approx(0.5));
  cost_sample s;
  s.cpu_tokens = 1000;
  s.cpu_seconds = 1e-6;  // 1 ns per token
  p.observe(s);
  CHECK(p.cpu_cost_spread_seconds() == 0.0);  // one sample: no spread yet
  s.cpu_tokens = 3000;
  s.cpu_seconds = 9e-6;  // 3 ns per token
  p.observe(s);
  // mean = 10 µs / 4000 = 2.5 ns; σ² = (1000·1.5² + 3000·0.5²) / 4000 ns² = 0.75 ns²
  const double mean = 2.5e-9, sigma = std::sqrt(0.75) * 1e-9;
  CHECK(p.cpu_cost_per_token_seconds() == doctest::Approx(mean).epsilon(1e-9));
  CHECK(p.cpu_cost_spread_seconds() == doctest::Approx(sigma).epsilon(1e-9));
  const double a = mean + 1.5 * sigma, b = 2e-9;
  CHECK(p.planned_cpu_cost_per_token_seconds() == doctest::Approx(a).epsilon(1e-9));
  CHECK(p.target_share(100000) == doctest::Approx(b / (a + b)).epsilon(1e-9));
  CHECK(p.converged_share() == doctest::Approx(b / (mean + b)).epsilon(1e-9));  // the balance, unshifted
  // steady samples: the spread leaves the window and the plan returns to the mean
  s.cpu_tokens = 2000;
  s.cpu_seconds = 4e-6;
  for (int i = 0; i < 3; ++i) p.observe(s);
  CHECK(p.cpu_cost_spread_seconds() == doctest::Approx(0.0).epsilon(1e-12));
  CHECK(p.target_share(100000) == doctest::Approx(0.5).epsilon(1e-9));
  // z = 0 (the default): no spread kept, eq. 2 on the mean
  pr.placement_headroom_z = 0.0;
  roofline_policy q(pr);
  s.cpu_seconds = 1e-6;
  q.observe(s);
  s.cpu_seconds = 9e-6;
  q.observe(s);
  CHECK(q.cpu_cost_spread_seconds() == 0.0);
  CHECK(q.planned_cpu_cost_per_token_seconds() == q.cpu_cost_per_token_seconds());
}

TEST_CASE("the marginal-share rule keeps the cumulative share within D/(2L) of a constant target") {
  for (double target : {0.0, 0.1, 0.3, 0.5, 0.77, 1.0}) {
    CAPTURE(target);
    const fixed_ratio pol(target);
    index_t placed = 0, cpu = 0;
    const index_t D = 256;
    for (int k = 0; k < 300; ++k) {
      route_query q;
      q.placed_tokens = placed;
      q.cpu_placed_tokens = cpu;
      q.batch_tokens = D;
      const route_decision d = pol.route(q);
      CHECK(d.target.cpu_compute == target);
      CHECK(d.target.cpu_compute + d.target.gpu_load == doctest::Approx(1.0));
      REQUIRE((d.region == placement::cpu_compute) == to_cpu(target, placed, cpu, D));
      if (d.region == placement::cpu_compute) cpu += D;
      placed += D;
      REQUIRE(std::abs(double(cpu) / double(placed) - target) <= double(D) / (2.0 * double(placed)) + 1e-12);
    }
  }
  // Ties go to the GPU: r = 0.5 alternates GPU, CPU, GPU, CPU exactly.
  route_query q;
  q.batch_tokens = 64;
  for (int k = 0; k < 40; ++k) {
    const placement p = route_toward(0.5, q);
    REQUIRE(p == (k % 2 ? placement::cpu_compute : placement::gpu_load));
    q.cpu_placed_tokens += p == placement::cpu_compute ? 64 : 0;
    q.placed_tokens += 64;
  }
  // r = 0.3 at L = 320 (D = 32): 96 CPU tokens wanted, options 80 and 112: a tie.
  route_query t;
  t.placed_tokens = 288;
  t.cpu_placed_tokens = 80;
  t.batch_tokens = 32;
  CHECK(route_toward(0.3, t) == placement::gpu_load);
  t.cpu_placed_tokens = 79;  // options 79 / 111 for 96 wanted: the CPU side is closer (15 vs 17)
  CHECK(route_toward(0.3, t) == placement::cpu_compute);
  CHECK(gpu_only{}.route(q).region == placement::gpu_load);
  CHECK(cpu_only{}.route(q).region == placement::cpu_compute);
}

TEST_CASE("roofline observe: A is a sliding ratio of sums with C_CPU removed; B only when tracked") {
  SUBCASE("window of 4, fixed cost removed, exact") {
    roofline_policy p(params(1e-9, 1e-9, 2e-6, 0, 4));
    const double truth[] = {5e-9, 5e-9, 7e-9, 9e-9, 11e-9, 13e-9};
    const index_t toks[] = {1000, 3000, 2000, 500, 4000, 1000};
    std::vector<std::pair<double, index_t>> seen;
    for (int i = 0; i < 6; ++i) {
      cost_sample s;
      s.cpu_tokens = toks[i];
      s.cpu_seconds = truth[i] * double(toks[i]) + 2e-6;
      s.gpu_seconds = 123.0;  // ignored: B is not tracked
      s.gpu_streamed_tokens = 10;
      p.observe(s);
      seen.emplace_back(truth[i] * double(toks[i]), toks[i]);
      double sec = 0;
      index_t tok = 0;
      for (std::size_t k = seen.size() > 4 ? seen.size() - 4 : 0; k < seen.size(); ++k) {
        sec += seen[k].first;
        tok += seen[k].second;
      }
      CHECK(p.cpu_cost_per_token_seconds() == doctest::Approx(sec / double(tok)).epsilon(1e-9));
      CHECK(p.gpu_cost_per_token_seconds() == 1e-9);
    }
  }
  SUBCASE("samples without CPU tokens or with a non-finite time leave A unchanged") {
    roofline_policy p(params(1e-9, 1e-9));
    cost_sample s;
    s.cpu_seconds = 5.0;
    s.cpu_tokens = 0;
    p.observe(s);
    CHECK(p.cpu_cost_per_token_seconds() == 1e-9);
    s.cpu_tokens = 100;
    s.cpu_seconds = std::numeric_limits<double>::quiet_NaN();
    p.observe(s);
    CHECK(p.cpu_cost_per_token_seconds() == 1e-9);
  }
  SUBCASE("a zero measurement keeps a positive floor (the share stays defined)") {
    roofline_policy p(params(1e-9, 1e-9, 1e-3, 0, 1));
    cost_sample s;
    s.cpu_tokens = 100;
    s.cpu_seconds = 1e-6;  // below the fixed cost: clamped to 0
    p.observe(s);
    CHECK(p.cpu_cost_per_token_seconds() > 0.0);
    CHECK(p.converged_share() == doctest::Approx(1.0));  // CPU looks free: all of it to the CPU
    CHECK(std::isfinite(p.target_share(1000)));
  }
  SUBCASE("B re-measured when track_gpu_cost") {
    roofline_params pr = params(1e-9, 1e-9, 0, 1e-6, 2);
    pr.track_gpu_cost = true;
    roofline_policy p(pr);
    cost_sample s;
    s.gpu_streamed_tokens = 1000;
    s.gpu_seconds = 4e-9 * 1000 + 1e-6;
    p.observe(s);
    CHECK(p.gpu_cost_per_token_seconds() == doctest::Approx(4e-9).epsilon(1e-9));
    CHECK(p.cpu_cost_per_token_seconds() == 1e-9);
    CHECK(p.converged_share() == doctest::Approx(0.8));
  }
  SUBCASE("a long run of samples: no drift from the running subtraction") {
    roofline_policy p(params(1e-9, 1e-9, 0, 0, 7));
    std::vector<std::pair<double, index_t>> seen;
    bf16_source src(3);
    for (int i = 0; i < 5000; ++i) {
      cost_sample s;
      s.cpu_tokens = 1 + index_t(std::abs(src.next_float()) * 1000);
      s.cpu_seconds = (1.0 + std::abs(src.next_float())) * 1e-9 * double(s.cpu_tokens) * (i < 2500 ? 1e3 : 1.0);
      p.observe(s);
      seen.emplace_back(s.cpu_seconds, s.cpu_tokens);
    }
    double sec = 0;
    index_t tok = 0;
    for (std::size_t k = seen.size() - 7; k < seen.size(); ++k) {
      sec += seen[k].first;
      tok += seen[k].second;
    }
    CHECK(p.cpu_cost_per_token_seconds() == doctest::Approx(sec / double(tok)).epsilon(1e-9));
  }
}

TEST_CASE("policy parameters out of range are config errors naming the value") {
  for (double bad : {1.5, -0.25}) {
    try {
      fixed_ratio f(bad);
      FAIL("expected config_error");
    } catch (const config_error& e) {
      CHECK(mentions(e.what(), {"fixed_ratio", bad > 1 ? "share 1.5 " : "share -0.25 ", "[0, 1]"}));
    }
  }
  CHECK_THROWS_AS((void)fixed_ratio(std::numeric_limits<double>::quiet_NaN()), config_error);  // (void): else clang reads a declaration
  CHECK_NOTHROW(fixed_ratio(0.0));
  CHECK_NOTHROW(fixed_ratio(1.0));
  try {
    roofline_policy p(params(-1e-9, 1e-9));
    FAIL("expected config_error");
  } catch (const config_error& e) {
    CHECK(mentions(e.what(), {"A=-1e-09 s"}));  // the value, not "-0.000000"
  }
  CHECK_THROWS_AS(roofline_policy(params(1e-9, -2e-9)), config_error);
  CHECK_THROWS_AS(roofline_policy(params(0.0, 1e-9)), config_error);
  CHECK_THROWS_AS(roofline_policy(params(1e-9, std::numeric_limits<double>::infinity())), config_error);
  CHECK_THROWS_AS(roofline_policy(params(1e-9, 1e-9, std::numeric_limits<double>::quiet_NaN())), config_error);
  CHECK_THROWS_AS(roofline_policy(params(1e-9, 1e-9, 0, 0, 0)), config_error);
  for (double bad : {-0.1, 1.0}) {
    roofline_params pr = params(1e-9, 1e-9);
    pr.placement_headroom = bad;
    const std::string want = "placement_headroom " + detail::format_double(bad);
    CHECK_THROWS_WITH_AS(roofline_policy{pr}, doctest::Contains(want.c_str()), config_error);
  }
  for (double bad : {-1e-9, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    roofline_params pr = params(1e-9, 1e-9);
    pr.launch_cost_per_token_seconds = bad;
    CHECK_THROWS_WITH_AS(roofline_policy{pr}, doctest::Contains("launch_cost_per_token_seconds (K)"), config_error);
  }
  for (double bad : {-0.5, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    roofline_params pr = params(1e-9, 1e-9);
    pr.placement_headroom_z = bad;
    const std::string want = "placement_headroom_z " + detail::format_double(bad);
    CHECK_THROWS_WITH_AS(roofline_policy{pr}, doctest::Contains(want.c_str()), config_error);
  }
}

namespace {

// A cache driven through decode appends and flushes only (no attention step,
// so no measured timings reach the policy: only injected samples do).
template <class Policy>
struct routing_rig {
  using L = gqa_layout<64>;
  static constexpr int D = 64;
  host_backend be;
  L lay{1, 1};
  host_cache<L, Policy> cache;
  explicit routing_rig(Policy p, int max_seqs = 1)
      : cache(be, lay, make_spec(max_seqs), std::move(p)) {}
  static partition_spec make_spec(int max_seqs) {
    partition_spec s = small_spec(1, max_seqs, 16, D);
    s.cpu_capacity_tokens = 1 << 20;
    s.pinned_capacity_tokens = 1 << 20;
    s.ping_pong_bytes = 4 * block_format<L>{L(1, 1), 16}.block_bytes();
    return s;
  }
  /// Begins a sequence and writes its (zero) prompt.
  sequence_id begin(index_t prompt) {
    const sequence_id id = cache.begin_sequence(prompt);
    std::vector<bf16> kz(std::size_t(prompt) * 64, bf16{0});
    kv_tokens<L, pageable_host_space> kv;
    kv.planes = {kz.data(), kz.data()};
    kv.num_tokens = prompt;
    cache.append_prefill(0, id, kv);
    return id;
  }
  /// D decode tokens for every sequence of `batch`, flushing after each.
  flush_report one_batch(std::span<const sequence_id> batch) {
    std::vector<bf16> kz(batch.size() * 64, bf16{0});
    kv_tokens<L, pageable_host_space> kv;
    kv.planes = {kz.data(), kz.data()};
    kv.num_tokens = index_t(batch.size());
    flush_report rep;
    for (int t = 0; t < D; ++t) {
      cache.append(0, batch, kv);
      const flush_report r = cache.flush();
      rep.evicted_sequences += r.evicted_sequences;
      rep.cpu_batches += r.cpu_batches;
      rep.gpu_batches += r.gpu_batches;
    }
    return rep;
  }
};

}  // namespace

TEST_CASE("roofline through the cache: the placed CPU share converges to B/(A+B) along eq. 2 as decode proceeds") {
  const double A = 3e-9, B = 1e-9, delta = 4e-6;  // p = 0.25, Δ/(A+B) = 1000 tokens
  routing_rig<roofline_policy> rig(roofline_policy(params(A, B, 0, delta)), 3);
  constexpr index_t D = routing_rig<roofline_policy>::D;
  // Three sequences, decoded together from empty prompts.
  std::vector<sequence_id> batch{rig.cache.begin_sequence(0), rig.cache.begin_sequence(0), rig.cache.begin_sequence(0)};
  // Independent simulation: flushes visit sequences in id order; L counts all
  // live sequences' placed tokens before the batch, plus the batch.
  std::vector<index_t> placed(3, 0), cpu(3, 0);
  std::vector<double> gaps;
  for (int k = 0; k < 120; ++k) {
    const flush_report rep = rig.one_batch(batch);
    REQUIRE(rep.evicted_sequences == 3);
    for (int i = 0; i < 3; ++i) {
      const index_t total = placed[0] + placed[1] + placed[2];
      const double r = eq2(A, B, delta, double(total + D));
      if (to_cpu(r, placed[std::size_t(i)], cpu[std::size_t(i)], D)) cpu[std::size_t(i)] += D;
      placed[std::size_t(i)] += D;
    }
    for (int i = 0; i < 3; ++i) {
      CAPTURE(k);
      CAPTURE(i);
      const sequence_state& st = rig.cache.sequence(batch[std::size_t(i)]);
      REQUIRE(st.placed_tokens == placed[std::size_t(i)]);
      REQUIRE(st.cpu_placed_tokens == cpu[std::size_t(i)]);
    }
    if (k == 19 || k == 59 || k == 119) {
      const index_t total = placed[0] + placed[1] + placed[2];
      gaps.push_back(std::abs(double(cpu[0] + cpu[1] + cpu[2]) / double(total) - 0.25));
    }
  }
  // The share approaches p as L grows (eq. 2: the gap is about Δ/((A+B)L)).
  INFO("gaps " << gaps[0] << " " << gaps[1] << " " << gaps[2]);
  CHECK(gaps[1] < gaps[0] / 2);
  CHECK(gaps[2] < gaps[1]);
  const index_t total = rig.cache.total_placed_tokens();
  CHECK(total == 3 * 120 * D);
  const index_t cpu_total = rig.cache.sequence(batch[0]).cpu_placed_tokens +
                            rig.cache.sequence(batch[1]).cpu_placed_tokens +
                            rig.cache.sequence(batch[2]).cpu_placed_tokens;
  const double share = double(cpu_total) / double(total);
  const double per_seq_quantum = double(D) / (2.0 * double(total) / 3.0);
  CHECK(std::abs(share - eq2(A, B, delta, double(total))) <= per_seq_quantum);
  CHECK(std::abs(share - 0.25) <= delta / (A + B) / double(total) + per_seq_quantum);
  CHECK(rig.cache.usage().cpu_used_blocks * 16 == cpu_total);
}

TEST_CASE("roofline re-targets when the measured CPU cost changes (injected samples)") {
  const double A0 = 1e-9, B = 1e-9;  // p = 0.5
  routing_rig<roofline_policy> rig(roofline_policy(params(A0, B, 0, 0, 4)));
  constexpr index_t D = routing_rig<roofline_policy>::D;
  const std::vector<sequence_id> batch{rig.cache.begin_sequence(0)};
  for (int k = 0; k < 20; ++k) rig.one_batch(batch);
  const sequence_state& st = rig.cache.sequence(batch[0]);
  CHECK(st.cpu_placed_tokens == 10 * D);
  CHECK(rig.cache.policy().target_share(21 * D) == doctest::Approx(0.5));

  // The CPU gets 3x slower: A = 3 ns (a full window of samples).
  const double A1 = 3e-9;
  for (int i = 0; i < 4; ++i) {
    cost_sample s;
    s.cpu_tokens = 10 * D;
    s.cpu_seconds = A1 * double(s.cpu_tokens);
    rig.cache.policy().observe(s);
  }
  CHECK(rig.cache.policy().cpu_cost_per_token_seconds() == doctest::Approx(A1));
  CHECK(eq2(A1, B, 0, 1) == doctest::Approx(0.25));
  // The simulation uses the policy's own estimate of A (a ratio of sums, which
  // may differ from 3e-9 in the last bit and so break exact ties differently).
  const double p1 = eq2(rig.cache.policy().cpu_cost_per_token_seconds(), B, 0, 1);
  CHECK(rig.cache.policy().target_share(21 * D) == p1);

  double share = 0.5;
  index_t placed = st.placed_tokens, cpu = st.cpu_placed_tokens;
  int reached = -1;
  for (int k = 0; k < 30; ++k) {
    const flush_report rep = rig.one_batch(batch);
    const bool sim_cpu = to_cpu(p1, placed, cpu, D);
    CHECK(rep.cpu_batches == (sim_cpu ? 1 : 0));
    if (sim_cpu) cpu += D;
    placed += D;
    const sequence_state& s2 = rig.cache.sequence(batch[0]);
    REQUIRE(s2.cpu_placed_tokens == cpu);
    const double now = double(s2.cpu_placed_tokens) / double(s2.placed_tokens);
    if (reached < 0) {
      CHECK(now < share);  // moves down at once, monotonically, until it gets there
      if (now <= p1 + 1e-12) reached = k + 1;
    } else {
      CHECK(std::abs(now - p1) <= double(D) / (2.0 * double(s2.placed_tokens)) + 1e-12);  // then stays there
    }
    share = now;
  }
  // 10 D on the CPU are a 0.25 share at 40 D placed: 20 GPU batches after the 20 placed.
  CHECK(reached == 20);

  // And back: the CPU gets fast (A = B / 3): the share climbs toward 0.75.
  for (int i = 0; i < 4; ++i) {
    cost_sample s;
    s.cpu_tokens = 1000;
    s.cpu_seconds = (B / 3) * 1000;
    rig.cache.policy().observe(s);
  }
  const flush_report up = rig.one_batch(batch);
  CHECK(up.cpu_batches == 1);
}

TEST_CASE("the cache reports the placed tokens of all live sequences before the batch to the policy") {
  // A recording policy: every route_query the cache sends, during begin_sequence and flush.
  scripted_policy pol;
  pol.fn = [](const route_query& q) { return (q.placed_tokens / q.batch_tokens) % 2 ? placement::cpu_compute : placement::gpu_load; };
  auto log = pol.log;
  routing_rig<scripted_policy> rig(pol, 3);
  constexpr index_t D = routing_rig<scripted_policy>::D;
  const sequence_id a = rig.begin(2 * D + 5);  // 2 batches at admission
  REQUIRE(log->size() == 2);
  CHECK((*log)[0].total_placed_tokens == 0);
  CHECK((*log)[1].total_placed_tokens == D);
  CHECK((*log)[1].placed_tokens == D);
  CHECK((*log)[0].live_sequences == 1);
  const sequence_id b = rig.begin(D);
  REQUIRE(log->size() == 3);
  CHECK((*log)[2].total_placed_tokens == 2 * D);  // a's 2 batches
  CHECK((*log)[2].placed_tokens == 0);
  CHECK((*log)[2].live_sequences == 2);
  log->clear();
  // Decode: b's window fills after D tokens, a's after D - 5 tokens.
  const std::vector<sequence_id> batch{a, b};
  rig.one_batch(batch);
  REQUIRE(log->size() == 2);
  // a evicts first (3 D placed in all before), then b (a's new batch counted once).
  CHECK((*log)[0].seq == a);
  CHECK((*log)[0].placed_tokens == 2 * D);
  CHECK((*log)[0].cpu_placed_tokens == D);
  CHECK((*log)[0].total_placed_tokens == 3 * D);
  CHECK((*log)[0].live_sequences == 2);
  CHECK((*log)[1].seq == b);
  CHECK((*log)[1].placed_tokens == D);
  CHECK((*log)[1].total_placed_tokens == 4 * D);
  CHECK(rig.cache.total_placed_tokens() == 5 * D);
  rig.cache.end_sequence(a);
  CHECK(rig.cache.total_placed_tokens() == 2 * D);
}

TEST_CASE("roofline through a real attention step: the measured CPU time reaches A; results unchanged") {
  using L = gqa_layout<128>;
  host_backend be;
  const L lay(8, 2);
  partition_spec spec = small_spec(1, 2);
  set_ping_pong_blocks(spec, lay, 8);
  roofline_params pr = params(1.0, 1.0, 0, 0, 1);  // absurd A = 1 s/token: p = 0.5
  host_cache<L, roofline_policy> cache(be, lay, spec, roofline_policy(pr), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, {2, true}, 13, 1.0 / std::sqrt(128.0));
  const std::vector<sequence_id> batch{d.add(2 * 32 + 3), d.add(4 * 32)};
  REQUIRE(cache.usage().cpu_used_blocks > 0);
  const compare_result r = d.step(batch);
  CHECK(r.ok());
  REQUIRE(d.last_report.cpu_tokens > 0);
  const double a = cache.policy().cpu_cost_per_token_seconds();
  CHECK(a < 1.0);  // the measurement replaced the calibration
  CHECK(a == doctest::Approx(std::max(d.last_report.cpu_seconds / double(d.last_report.cpu_tokens), 1e-15)));
  CHECK(cache.policy().gpu_cost_per_token_seconds() == 1.0);  // B not tracked
}

TEST_CASE("announce_admission: prompt batches see the admitted batch's L (coming_tokens); strong guarantee") {
  scripted_policy pol;
  auto log = pol.log;
  routing_rig<scripted_policy> rig(pol, 3);
  constexpr index_t D = routing_rig<scripted_policy>::D;
  CHECK_THROWS_AS(rig.cache.announce_admission(-1), shape_error);
  rig.cache.announce_admission((2 * D + 5) + D + D);
  rig.begin(2 * D + 5);
  REQUIRE(log->size() == 2);
  CHECK((*log)[0].total_placed_tokens == 0);
  CHECK((*log)[0].coming_tokens == D + 2 * D);  // its own second batch + the two announced prompts
  CHECK((*log)[1].coming_tokens == 2 * D);
  CHECK(rig.cache.announced_tokens() == 2 * D);
  rig.begin(D);
  CHECK((*log)[2].coming_tokens == D);
  rig.begin(D);
  CHECK((*log)[3].coming_tokens == 0);
  CHECK(rig.cache.announced_tokens() == 0);
  // A refused admission (no free slot) leaves the announcement as it was.
  rig.cache.announce_admission(4 * D);
  CHECK_THROWS_AS(rig.cache.begin_sequence(D), capacity_error);
  CHECK(rig.cache.announced_tokens() == 4 * D);
  rig.cache.announce_admission(0);
  CHECK(rig.cache.announced_tokens() == 0);
  // Without an announcement only the prompt's own later batches are coming.
  log->clear();
  routing_rig<scripted_policy> solo(pol, 1);
  solo.begin(3 * D);
  REQUIRE(log->size() == 3);
  CHECK((*log)[0].coming_tokens == 2 * D);
  CHECK((*log)[2].coming_tokens == 0);
}

TEST_CASE("roofline admission of a batch: with announce_admission every prompt lands on r(L) of the whole batch") {
  // Δ > 0 pushes small L to the CPU: prompts admitted one by one against the
  // tokens placed so far end above r(L_final), the first ones most.
  const double A = 1e-9, B = 1e-9, delta = 4e-6;  // p = 0.5, Δ/(A+B) = 2,000 tokens
  constexpr int seqs = 3;
  constexpr index_t D = routing_rig<roofline_policy>::D;
  const index_t prompt = 64 * D;  // 4,096 tokens each, 12,288 in all
  auto run = [&](bool announce) {
    routing_rig<roofline_policy> rig(roofline_policy(params(A, B, 0, delta)), seqs);
    if (announce) rig.cache.announce_admission(prompt * seqs);
    std::vector<sequence_id> ids;
    for (int i = 0; i < seqs; ++i) ids.push_back(rig.begin(prompt));
    std::vector<double> share;
    for (const sequence_id id : ids) {
      const sequence_state& st = rig.cache.sequence(id);
      share.push_back(double(st.cpu_placed_tokens) / double(st.placed_tokens));
    }
    return share;
  };
  const double r_final = eq2(A, B, delta, double(seqs * prompt));  // 0.663
  const std::vector<double> with = run(true), without = run(false);
  INFO("with " << with[0] << " " << with[1] << " " << with[2] << "; without " << without[0] << " " << without[1] << " "
               << without[2] << "; r(L_final) " << r_final);
  for (const double s : with) CHECK(std::abs(s - r_final) <= double(D) / double(prompt));  // one batch
  CHECK(without[0] > with[0] + 0.2);  // the effect the announcement removes (simulated: 0.98 vs 0.66)
}
