// SPDX-License-Identifier: Apache-2.0
// ws_moe::cpu::run_experts (ws_moe/cpu_experts.hpp) against an fp64 reference
// written here: every ISA this CPU supports (pinned through the isa:: tags;
// the others are skipped with a message), both precisions, the shapes of the
// three models (Qwen3-30B-A3B, DeepSeek-V2-Lite, Mixtral-8x7B), of the test
// fixtures and odd ones, rows 1..257 (4096 at small shapes), several experts
// per call with different row counts (and an empty one), 1 and several
// threads. Outputs are poisoned with NaN before every call. In bf16_inputs
// mode the reference rounds X and the SiLU product to bf16 as the contract
// says and the tolerance is tight; the same output is also shown to be far
// from the unrounded reference, so the tolerance can tell them apart.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ws_moe/cpu_experts.hpp"

namespace cpux = ws_moe::cpu;
using cpux::expert_precision;
using cpux::expert_shape;
using cpux::expert_task;

namespace {

std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Uniform in [-a, a), a pure function of (seed, i).
float uniform(std::uint64_t seed, std::int64_t i, float a) {
  const double u = double(mix(seed * 0x2545f4914f6cdd1dull + std::uint64_t(i)) >> 11) * 0x1.0p-53;
  return float((2.0 * u - 1.0) * a);
}

std::uint16_t to_bf16(float f) { return writescope::bf16::from_float(f).bits; }
double from_bf16(std::uint16_t b) { return double(writescope::bf16{b}.to_float()); }
float round_bf16(float f) { return writescope::round_to_bf16(f); }

/// Random bf16 weights of unit-variance dot products against unit-variance inputs.
std::vector<std::uint16_t> random_weights(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::vector<std::uint16_t> w(std::size_t(rows * cols));
  const float a = float(std::sqrt(3.0 / double(cols)));
  const std::int64_t n = rows * cols;
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) w[std::size_t(i)] = to_bf16(uniform(seed, i, a));
  return w;
}

std::vector<float> random_x(std::int64_t rows, std::int64_t hidden, std::uint64_t seed) {
  std::vector<float> x(std::size_t(rows * hidden));
  for (std::int64_t i = 0; i < rows * hidden; ++i) x[std::size_t(i)] = uniform(seed, i, 1.7f);
  return x;
}

struct expert_weights {
  std::vector<std::uint16_t> gate, up, down;
  cpux::expert_view view() const { return {gate.data(), up.data(), down.data()}; }
};

expert_weights random_expert(expert_shape s, std::uint64_t seed) {
  return {random_weights(s.inter, s.hidden, seed * 3 + 1), random_weights(s.inter, s.hidden, seed * 3 + 2),
          random_weights(s.hidden, s.inter, seed * 3 + 3)};
}

/// The contract in fp64: Y = down(silu(X·gateᵀ) ⊙ (X·upᵀ)); `round` rounds X and the
/// SiLU product to bf16 (the product first to fp32, then to bf16).
std::vector<double> reference(const cpux::expert_view& w, const float* x, std::int64_t rows, expert_shape s, bool round) {
  const std::int64_t H = s.hidden, I = s.inter;
  std::vector<double> y(std::size_t(rows * H));
#pragma omp parallel
  {
    std::vector<double> xr(static_cast<std::size_t>(H)), a(static_cast<std::size_t>(I));
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t e = 0; e < H; ++e) {
        const float v = x[r * H + e];
        xr[std::size_t(e)] = round ? double(round_bf16(v)) : double(v);
      }
      for (std::int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (std::int64_t e = 0; e < H; ++e) {
          g += xr[std::size_t(e)] * from_bf16(w.gate[i * H + e]);
          u += xr[std::size_t(e)] * from_bf16(w.up[i * H + e]);
        }
        const double v = g / (1.0 + std::exp(-g)) * u;
        a[std::size_t(i)] = round ? double(round_bf16(float(v))) : v;
      }
      for (std::int64_t h = 0; h < H; ++h) {
        double acc = 0;
        for (std::int64_t i = 0; i < I; ++i) acc += a[std::size_t(i)] * from_bf16(w.down[h * I + i]);
        y[std::size_t(r * H + h)] = acc;
      }
    }
  }
  return y;
}

struct error_stats {
  double rel_l2 = 0, max_rel = 0;  ///< ‖y − ref‖₂ / ‖ref‖₂ and max|y − ref| / max|ref|
  bool all_finite = true;
};

error_stats compare(const std::vector<float>& y, const std::vector<double>& ref) {
  REQUIRE(y.size() == ref.size());
  error_stats e;
  double num = 0, den = 0, mx = 0, mref = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    if (!std::isfinite(y[i])) e.all_finite = false;
    const double d = double(y[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    mx = std::max(mx, std::fabs(d));
    mref = std::max(mref, std::fabs(ref[i]));
  }
  e.rel_l2 = std::sqrt(num / std::max(den, 1e-300));
  e.max_rel = mx / std::max(mref, 1e-300);
  if (!e.all_finite) e.rel_l2 = e.max_rel = std::numeric_limits<double>::infinity();
  return e;
}

/// Tolerances against the reference of the same precision (rel_l2, max_rel). fp32: sums of
/// up to 14336 fp32 products. bf16_inputs: the same, plus the rare SiLU products whose fp32
/// and fp64 values round to neighbouring bf16 values; not rounding X or A costs ≈ 3e-3.
constexpr double fp32_l2 = 1e-5, fp32_max = 3e-5;
constexpr double bf16_l2 = 3e-4, bf16_max = 2e-3;

/// One layer's worth of experts: each task its own expert and input, any row counts.
struct layer_case {
  expert_shape shape;
  std::vector<std::int64_t> rows;
  std::vector<expert_weights> experts;
  std::vector<std::vector<float>> x;
  std::vector<std::vector<float>> y;
  std::vector<std::vector<double>> ref_rounded, ref_exact;

  layer_case(expert_shape s, std::vector<std::int64_t> r, std::uint64_t seed, int distinct_experts = 0) : shape(s), rows(std::move(r)) {
    const std::size_t n = rows.size();
    const std::size_t ne = distinct_experts > 0 ? std::size_t(distinct_experts) : n;
    for (std::size_t e = 0; e < ne; ++e) experts.push_back(random_expert(s, seed * 131 + e));
    for (std::size_t t = 0; t < n; ++t) {
      x.push_back(random_x(rows[t], s.hidden, seed * 977 + t));
      y.emplace_back(std::size_t(rows[t] * s.hidden));
      ref_rounded.push_back(reference(experts[t % ne].view(), x[t].data(), rows[t], s, true));
      ref_exact.push_back(reference(experts[t % ne].view(), x[t].data(), rows[t], s, false));
    }
  }
  std::vector<expert_task> tasks() {
    std::vector<expert_task> ts;
    for (std::size_t t = 0; t < rows.size(); ++t)
      ts.push_back(expert_task{experts[t % experts.size()].view(), x[t].data(), y[t].data(), rows[t]});
    return ts;
  }
  void poison() {
    for (auto& v : y) std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
  }
};

template <class Isa>
void check_layer(layer_case& lc, expert_precision prec, int threads) {
  lc.poison();
  auto ts = lc.tasks();
  cpux::run_experts<Isa>(ts, lc.shape, prec, threads);
  const bool rounded = prec == expert_precision::bf16_inputs;
  for (std::size_t t = 0; t < lc.rows.size(); ++t) {
    const auto& ref = rounded ? lc.ref_rounded[t] : lc.ref_exact[t];
    const error_stats e = compare(lc.y[t], ref);
    INFO("isa ", Isa::name, ", ", rounded ? "bf16_inputs" : "fp32", ", hidden ", lc.shape.hidden, " inter ",
         lc.shape.inter, ", task ", t, " rows ", lc.rows[t], ", threads ", threads, ": rel_l2 ", e.rel_l2, " max_rel ",
         e.max_rel);
    CHECK(e.all_finite);
    CHECK(e.rel_l2 <= (rounded ? bf16_l2 : fp32_l2));
    CHECK(e.max_rel <= (rounded ? bf16_max : fp32_max));
    if (rounded && lc.rows[t] * lc.shape.hidden >= 64) {
      // The unrounded reference is far outside the bf16 tolerance: the check above sees the rounding.
      const error_stats u = compare(lc.y[t], lc.ref_exact[t]);
      CHECK(u.rel_l2 > 4 * bf16_l2);
    }
  }
}

template <class Isa, class F>
void for_isa(F&& f) {
  if (!cpux::isa_supported<Isa>()) {
    MESSAGE("skipped: this CPU does not support the ", Isa::name, " kernels");
    return;
  }
  f(Isa{});
}

template <class F>
void for_each_isa(F&& f) {
  for_isa<cpux::isa::scalar>(f);
  for_isa<cpux::isa::avx2>(f);
  for_isa<cpux::isa::avx512>(f);
  for_isa<cpux::isa::avx512bf16>(f);
}

int many_threads() { return std::max(3, std::min(8, omp_get_max_threads())); }

void check_all(layer_case& lc, bool threads_many = true) {
  for_each_isa([&](auto isa) {
    using Isa = decltype(isa);
    for (expert_precision p : {expert_precision::bf16_inputs, expert_precision::fp32}) {
      check_layer<Isa>(lc, p, 1);
      if (threads_many) check_layer<Isa>(lc, p, many_threads());
    }
  });
}

std::vector<float> flat(const layer_case& lc) {
  std::vector<float> out;
  for (const auto& v : lc.y) out.insert(out.end(), v.begin(), v.end());
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("fixture and odd shapes: every row count in one call, both precisions, every ISA, 1 and many threads") {
  const std::vector<std::int64_t> rows = {1, 2, 3, 0, 7, 16, 17, 64, 257};
  for (expert_shape s : {expert_shape{64, 16}, expert_shape{65, 17}, expert_shape{1, 1}, expert_shape{33, 47},
                         expert_shape{31, 2}, expert_shape{130, 95}}) {
    CAPTURE(s.hidden);
    CAPTURE(s.inter);
    layer_case lc(s, rows, std::uint64_t(s.hidden * 1000 + s.inter));
    check_all(lc);
  }
}

TEST_CASE("4096 rows at small shapes, next to a decode-sized expert") {
  for (expert_shape s : {expert_shape{64, 16}, expert_shape{65, 17}}) {
    CAPTURE(s.hidden);
    layer_case lc(s, {4096, 1}, 7);
    check_all(lc);
  }
}

TEST_CASE("Qwen3-30B-A3B and DeepSeek-V2-Lite expert shapes") {
  {
    layer_case lc({2048, 768}, {1, 2, 3, 7, 16, 17, 64, 257}, 11);
    check_all(lc);
  }
  {
    layer_case lc({2048, 1408}, {1, 3, 16, 17, 64}, 12);
    check_all(lc);
  }
}

TEST_CASE("Mixtral-8x7B expert shape (one expert, two tasks)") {
  layer_case lc({4096, 14336}, {1, 3}, 13, /*distinct_experts=*/1);
  check_all(lc, /*threads_many=*/true);
}

TEST_CASE("results are bit-identical for any thread count, on a non-initial thread and inside a parallel region") {
  layer_case lc({130, 95}, {1, 5, 17, 64}, 21);
  for_each_isa([&](auto isa) {
    using Isa = decltype(isa);
    for (expert_precision p : {expert_precision::bf16_inputs, expert_precision::fp32}) {
      CAPTURE(Isa::name);
      check_layer<Isa>(lc, p, 1);
      const std::vector<float> one = flat(lc);
      for (int th : {2, 3, many_threads()}) {
        check_layer<Isa>(lc, p, th);
        CHECK(same_bits(flat(lc), one));
      }
      // From a std::thread (not OpenMP's initial thread).
      lc.poison();
      std::thread worker([&] {
        auto ts = lc.tasks();
        cpux::run_experts<Isa>(ts, lc.shape, p, many_threads());
      });
      worker.join();
      CHECK(same_bits(flat(lc), one));
      // Inside an active parallel region with nested parallelism off: a team of one.
      lc.poison();
      const int levels = omp_get_max_active_levels();
      omp_set_max_active_levels(1);
#pragma omp parallel num_threads(2)
      {
#pragma omp single
        {
          auto ts = lc.tasks();
          cpux::run_experts<Isa>(ts, lc.shape, p, many_threads());
        }
      }
      omp_set_max_active_levels(levels);
      CHECK(same_bits(flat(lc), one));
    }
  });
}

TEST_CASE("side work: run once on the calling thread inside the region, the results bit-identical, its error rethrown") {
  layer_case lc({130, 95}, {1, 5, 17, 64}, 23);
  struct probe {
    int calls = 0;
    std::thread::id on;
    bool inside = false;
    bool fail = false;
  };
  auto fn = [](void* ctx) {
    auto* pr = static_cast<probe*>(ctx);
    ++pr->calls;
    pr->on = std::this_thread::get_id();
    pr->inside = omp_in_parallel() != 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the others start without thread 0
    if (pr->fail) throw std::runtime_error("side work failed");
  };
  for_each_isa([&](auto isa) {
    using Isa = decltype(isa);
    for (expert_precision p : {expert_precision::bf16_inputs, expert_precision::fp32}) {
      CAPTURE(Isa::name);
      check_layer<Isa>(lc, p, 1);
      const std::vector<float> one = flat(lc);
      for (int th : {1, 2, many_threads()}) {
        CAPTURE(th);
        probe pr;
        cpux::side_work side{fn, &pr};
        cpux::run_stats st;
        lc.poison();
        auto ts = lc.tasks();
        cpux::run_experts<Isa>(ts, lc.shape, p, th, &side, &st);
        CHECK(same_bits(flat(lc), one));
        CHECK(pr.calls == 1);
        CHECK(pr.on == std::this_thread::get_id());
        CHECK(pr.inside == (th > 1));
        CHECK(st.side_seconds >= 0.002);
        CHECK(st.total_seconds >= st.side_seconds);
        CHECK(st.setup_seconds >= 0.0);
        CHECK(st.wake_seconds >= 0.0);
      }
      probe bad;
      bad.fail = true;
      cpux::side_work side{fn, &bad};
      lc.poison();
      auto ts = lc.tasks();
      CHECK_THROWS_WITH_AS(cpux::run_experts<Isa>(ts, lc.shape, p, many_threads(), &side), "side work failed",
                           std::runtime_error);
      CHECK(bad.calls == 1);
      CHECK(same_bits(flat(lc), one));  // the experts ran all the same
    }
  });
  // No task with rows: the side work still runs, once, outside any region.
  probe pr;
  cpux::side_work side{fn, &pr};
  std::vector<expert_task> none;
  cpux::run_experts(none, lc.shape, expert_precision::bf16_inputs, many_threads(), &side);
  CHECK(pr.calls == 1);
  CHECK(!pr.inside);
}

TEST_CASE("in place: y may be the task's own x") {
  layer_case lc({65, 17}, {3, 20, 1}, 51);
  for (expert_precision p : {expert_precision::bf16_inputs, expert_precision::fp32}) {
    std::vector<std::vector<float>> io = lc.x;
    std::vector<expert_task> ts = lc.tasks();
    for (std::size_t t = 0; t < ts.size(); ++t) ts[t].x = ts[t].y = io[t].data();
    cpux::run_experts(ts, lc.shape, p, 3);
    for (std::size_t t = 0; t < ts.size(); ++t) {
      const auto& ref = p == expert_precision::bf16_inputs ? lc.ref_rounded[t] : lc.ref_exact[t];
      const error_stats e = compare(io[t], ref);
      INFO("task ", t, " rel_l2 ", e.rel_l2);
      CHECK(e.rel_l2 <= (p == expert_precision::bf16_inputs ? bf16_l2 : fp32_l2));
    }
  }
}

TEST_CASE("the dispatcher runs the best supported ISA") {
  const cpux::isa_kind k = cpux::best_isa();
  MESSAGE("best_isa: ", std::string(cpux::isa_name(k)));
  layer_case lc({65, 17}, {3, 20}, 31);
  for (expert_precision p : {expert_precision::bf16_inputs, expert_precision::fp32}) {
    lc.poison();
    auto ts = lc.tasks();
    cpux::run_experts(ts, lc.shape, p, 2);
    const std::vector<float> dispatched = flat(lc);
    switch (k) {
      case cpux::isa_kind::avx512bf16: check_layer<cpux::isa::avx512bf16>(lc, p, 2); break;
      case cpux::isa_kind::avx512: check_layer<cpux::isa::avx512>(lc, p, 2); break;
      case cpux::isa_kind::avx2: check_layer<cpux::isa::avx2>(lc, p, 2); break;
      default: check_layer<cpux::isa::scalar>(lc, p, 2); break;
    }
    CHECK(same_bits(flat(lc), dispatched));
  }
}

TEST_CASE("bad shapes and tasks throw config_error naming the value, and write nothing") {
  layer_case lc({65, 17}, {2, 3}, 41);
  const float sentinel = 7.25f;
  auto expect_error = [&](std::vector<expert_task> ts, expert_shape s, int threads, const std::string& needle) {
    for (auto& v : lc.y) std::fill(v.begin(), v.end(), sentinel);
    bool thrown = false;
    try {
      cpux::run_experts(ts, s, expert_precision::fp32, threads);
    } catch (const writescope::config_error& e) {
      thrown = true;
      INFO("message: ", e.what());
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
    CHECK_MESSAGE(thrown, "no config_error for ", needle);
    for (const auto& v : lc.y)
      for (float f : v) REQUIRE(f == sentinel);
  };
  const auto good = lc.tasks();
  expect_error(good, {0, 17}, 1, "hidden must be > 0, not 0");
  expect_error(good, {-65, 17}, 1, "not -65");
  expect_error(good, {65, 0}, 1, "inter must be > 0, not 0");
  expect_error(good, {65, -3}, 2, "inter must be > 0, not -3");
  expect_error(good, lc.shape, -1, "threads must be >= 0");
  {
    auto ts = good;
    ts[1].rows = -1;
    expect_error(ts, lc.shape, 1, "task 1: rows must be >= 0, not -1");
  }
  const char* names[] = {"w.gate", "w.up", "w.down", "x", "y"};
  for (int which = 0; which < 5; ++which) {
    auto ts = good;
    expert_task& t = ts[1];
    if (which == 0) t.w.gate = nullptr;
    if (which == 1) t.w.up = nullptr;
    if (which == 2) t.w.down = nullptr;
    if (which == 3) t.x = nullptr;
    if (which == 4) t.y = nullptr;
    expect_error(ts, lc.shape, 1, std::string("task 1: ") + names[which] + " is null with rows 3");
  }
  // Null pointers are fine for an empty task; an empty layer is a no-op.
  auto ts = good;
  ts.push_back(expert_task{});
  lc.poison();
  CHECK_NOTHROW(cpux::run_experts(ts, lc.shape, expert_precision::fp32, 1));
  CHECK(compare(lc.y[0], lc.ref_exact[0]).rel_l2 <= fp32_l2);
  CHECK_NOTHROW(cpux::run_experts(std::span<const expert_task>{}, lc.shape, expert_precision::fp32, 1));
}
