// SPDX-License-Identifier: Apache-2.0
// examples/custom_policy.cpp — a routing policy written outside the library,
// plugged into inplace_kv_cache as its fourth template parameter.
//
// latency_capped_policy routes eviction batches toward a fixed CPU share, like
// the library's fixed_ratio, but bounds the CPU engine's work per sequence: a
// batch goes to the pinned load region (GPU) whenever placing it in the
// unpinned compute region would make that sequence's CPU-resident tokens cost
// more than `cap_seconds` to attend at the CPU cost per token measured online.
// An engine with a per-token latency budget would write something like this.
//
// What a policy must provide (the writescope::routing_policy concept):
//   using policy_concept = writescope::routing_policy_tag;   opt-in, nothing matches by accident
//   route_decision route(const route_query&) const;            one call per eviction batch
//   void observe(const cost_sample&);                          one call per attention step
// and be copy-constructible. It decides where work runs, never what is
// computed, so the output still matches fp64 attention; this program checks
// that, and checks that the cap held for every batch routed.
//
// Usage: custom_policy [--steps N] [--layers N] [--cap-us X] [--cpu-share R] [--seed N]
// Exit status: 0 agreement and cap respected, 1 otherwise, 2 bad command line.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <writescope/reference.hpp>
#include <writescope/writescope.hpp>

namespace ws = writescope;

/// Routes toward `cpu_share` of each sequence's placed tokens, except that a
/// sequence never holds more CPU-resident tokens than `cap_seconds` / A, A
/// being the CPU engine's measured seconds per attended KV token (an
/// exponential moving average seeded with a calibrated value).
class latency_capped_policy {
 public:
  using policy_concept = ws::routing_policy_tag;

  latency_capped_policy(double cpu_share, double cap_seconds, double initial_cpu_cost_per_token_seconds)
      : share_(cpu_share), cap_seconds_(cap_seconds), a_(initial_cpu_cost_per_token_seconds) {
    if (!(cpu_share >= 0.0 && cpu_share <= 1.0) || !(cap_seconds > 0.0) || !(a_ > 0.0))
      throw ws::config_error("latency_capped_policy: need 0 <= cpu_share <= 1, cap > 0 and cost > 0");
  }

  [[nodiscard]] ws::route_decision route(const ws::route_query& q) const {
    ws::placement p = ws::route_toward(share_, q);  // the library's marginal-share rule
    if (p == ws::placement::cpu_compute && double(q.cpu_placed_tokens + q.batch_tokens) > cap_tokens())
      p = ws::placement::gpu_load;
    return {p, {share_, 1.0 - share_}};
  }

  void observe(const ws::cost_sample& s) {
    if (s.cpu_tokens <= 0 || !(s.cpu_seconds > 0.0)) return;
    const double a = s.cpu_seconds / double(s.cpu_tokens);
    a_ = 0.9 * a_ + 0.1 * a;
  }

  /// CPU-resident tokens one sequence may hold under the cap, at the current A.
  [[nodiscard]] double cap_tokens() const noexcept { return cap_seconds_ / a_; }
  [[nodiscard]] double cpu_cost_per_token_seconds() const noexcept { return a_; }
  [[nodiscard]] double cpu_share() const noexcept { return share_; }

 private:
  double share_;
  double cap_seconds_;
  double a_;
};

static_assert(ws::routing_policy<latency_capped_policy>);

/// The same members without the opt-in tag: not a routing policy.
struct look_alike {
  ws::route_decision route(const ws::route_query&) const { return {}; }
  void observe(const ws::cost_sample&) {}
};
static_assert(!ws::routing_policy<look_alike>, "routing_policy is opt-in by tag");

namespace {

struct options {
  int steps = 160;
  int layers = 2;
  double cap_us = 150.0;
  double cpu_share = 0.6;
  unsigned long long seed = 7;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::puts("usage: custom_policy [--steps N] [--layers N] [--cap-us X] [--cpu-share R] [--seed N]\n"
                "Runs a short decode loop with a user-written latency-capped routing policy and checks\n"
                "the outputs against fp64 attention and the cap against every routed batch.");
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "custom_policy: %s needs a value (try --help)\n", a.c_str());
      std::exit(2);
    }
    const char* v = argv[++i];
    char* end = nullptr;
    const double x = std::strtod(v, &end);
    if (end == v || *end != '\0') {
      std::fprintf(stderr, "custom_policy: %s: '%s' is not a number\n", a.c_str(), v);
      std::exit(2);
    }
    if (a == "--steps") o.steps = int(x);
    else if (a == "--layers") o.layers = int(x);
    else if (a == "--cap-us") o.cap_us = x;
    else if (a == "--cpu-share") o.cpu_share = x;
    else if (a == "--seed") o.seed = static_cast<unsigned long long>(x);
    else {
      std::fprintf(stderr, "custom_policy: unknown option %s (try --help)\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.steps < 1 || o.layers < 1) {
    std::fprintf(stderr, "custom_policy: --steps and --layers must be >= 1\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  using preset = ws::presets::qwen3_30b_a3b;
  using layout = preset::layout_type;
  using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, latency_capped_policy>;
  const layout lay = preset::layout();
  const int hq = lay.num_q_heads(), hkv = lay.kv_heads();
  constexpr int d = layout::head_dim;
  const double scale = preset::softmax_scale();

  const std::vector<ws::index_t> prompts{1200, 300, 2000};
  const int nseq = int(prompts.size());
  ws::partition_spec spec;
  spec.num_layers = o.layers;
  spec.block_tokens = 16;
  spec.d_window_tokens = 64;
  spec.max_sequences = nseq;
  spec.cpu_capacity_tokens = 8192;
  spec.pinned_capacity_tokens = 8192;
  spec.ping_pong_bytes = ws::index_t(2) << 20;

  // A calibrated at ~80 GB/s for 2048-byte tokens; the cap is in seconds of CPU work per sequence.
  const double a0 = double(lay.token_bytes()) / 80e9;
  ws::host_backend backend;
  cache_type cache(backend, lay, spec, latency_capped_policy(o.cpu_share, o.cap_us * 1e-6, a0));
  ws::hybrid_attention<cache_type> attention(cache);
  std::printf("latency_capped_policy: CPU share %.2f, cap %.1f us of CPU work per sequence "
              "(= %.0f tokens at the calibrated A = %.3g s/token)\n",
              o.cpu_share, o.cap_us, cache.policy().cap_tokens(), a0);

  // The reference's own copy of every token: [sequence][layer] K and V, token-major [t][hkv][d].
  std::vector<std::vector<std::vector<ws::bf16>>> hk(static_cast<std::size_t>(nseq)), hv(static_cast<std::size_t>(nseq));
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal;
  std::vector<ws::bf16> k, v;
  auto make = [&](ws::index_t n) {
    k.resize(std::size_t(n * hkv * d));
    v.resize(k.size());
    for (auto& x : k) x = ws::bf16::from_float(normal(rng));
    for (auto& x : v) x = ws::bf16::from_float(normal(rng));
    return cache_type::kv_input{{k.data(), v.data()}, n};
  };

  int cap_violations = 0, capped_seqs = 0;
  // Checks the cap for the batches just routed: A has not changed since they were.
  auto check_cap = [&](const std::vector<ws::index_t>& cpu_before, std::span<const ws::sequence_id> seqs) {
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const ws::sequence_state& st = cache.sequence(seqs[i]);
      if (st.cpu_placed_tokens > cpu_before[i] && double(st.cpu_placed_tokens) > cache.policy().cap_tokens()) {
        std::printf("cap violated: sequence %d holds %lld CPU tokens, cap %.0f\n", seqs[i],
                    static_cast<long long>(st.cpu_placed_tokens), cache.policy().cap_tokens());
        ++cap_violations;
      }
    }
  };

  std::vector<ws::sequence_id> batch;
  for (int i = 0; i < nseq; ++i) {
    const ws::sequence_id id = cache.begin_sequence(prompts[std::size_t(i)]);
    batch.push_back(id);
    check_cap(std::vector<ws::index_t>{0}, std::span<const ws::sequence_id>(&batch.back(), 1));
    hk[std::size_t(id)].resize(std::size_t(o.layers));
    hv[std::size_t(id)].resize(std::size_t(o.layers));
    for (int l = 0; l < o.layers; ++l) {
      cache.append_prefill(l, id, make(prompts[std::size_t(i)]));
      hk[std::size_t(id)][std::size_t(l)] = k;
      hv[std::size_t(id)][std::size_t(l)] = v;
    }
  }

  double worst_rel = 0, worst_lse = 0;
  bool ok = true;
  std::vector<float> q, out, lse;
  std::vector<double> ro(static_cast<std::size_t>(hq) * d), rl(static_cast<std::size_t>(hq));
  for (int step = 0; step < o.steps; ++step) {
    const bool check = step % 10 == 0 || step == o.steps - 1;
    for (int l = 0; l < o.layers; ++l) {
      cache.append(l, batch, make(nseq));
      for (int i = 0; i < nseq; ++i) {
        auto& K = hk[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        auto& V = hv[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        K.insert(K.end(), k.begin() + i * hkv * d, k.begin() + (i + 1) * hkv * d);
        V.insert(V.end(), v.begin() + i * hkv * d, v.begin() + (i + 1) * hkv * d);
      }
      q.resize(std::size_t(nseq * hq * d));
      for (auto& x : q) x = normal(rng);
      out.assign(q.size(), 0.0f);
      lse.assign(std::size_t(nseq * hq), 0.0f);
      attention.step(l, batch, ws::host_span<const float>(q.data(), ws::index_t(q.size())), float(scale),
                     {ws::host_span<float>(out.data(), ws::index_t(out.size())),
                      ws::host_span<float>(lse.data(), ws::index_t(lse.size())), nullptr});
      if (!check) continue;
      for (int i = 0; i < nseq; ++i) {
        const auto& K = hk[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        const auto& V = hv[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        ws::reference::gqa_decode(hq, hkv, d, q.data() + i * hq * d, K.data(), V.data(),
                                  ws::index_t(K.size()) / (hkv * d), scale, ro.data(), rl.data());
        for (int h = 0; h < hq; ++h) {
          double num = 0, den = 0;
          for (int j = 0; j < d; ++j) {
            const double x = out[std::size_t((i * hq + h) * d + j)], r = ro[std::size_t(h * d + j)];
            num += (x - r) * (x - r);
            den += r * r;
          }
          const double rel = std::sqrt(num / std::max(den, 1e-300));
          const double lerr = std::abs(double(lse[std::size_t(i * hq + h)]) - rl[std::size_t(h)]);
          worst_rel = std::max(worst_rel, rel);
          worst_lse = std::max(worst_lse, lerr);
          if (!(rel <= 5e-3) || !(lerr <= 1e-3 + 1e-5 * std::abs(rl[std::size_t(h)]))) ok = false;
        }
      }
    }
    std::vector<ws::index_t> cpu_before;
    for (ws::sequence_id s : batch) cpu_before.push_back(cache.sequence(s).cpu_placed_tokens);
    const ws::flush_report fr = cache.flush();
    check_cap(cpu_before, batch);
    if (fr.evicted_sequences > 0)
      std::printf("step %3d: evicted %d batch(es): %d -> CPU, %d -> GPU; cap now %.0f tokens (A = %.3g s/token)\n",
                  step, fr.evicted_sequences, fr.cpu_batches, fr.gpu_batches, cache.policy().cap_tokens(),
                  cache.policy().cpu_cost_per_token_seconds());
  }

  std::printf("\nseq  placed  on CPU  share  (target %.2f, cap %.0f tokens)\n", o.cpu_share, cache.policy().cap_tokens());
  for (ws::sequence_id s : batch) {
    const ws::sequence_state& st = cache.sequence(s);
    const double share = st.placed_tokens ? double(st.cpu_placed_tokens) / double(st.placed_tokens) : 0.0;
    if (share + 1e-9 < o.cpu_share && st.cpu_placed_tokens + spec.d_window_tokens > cache.policy().cap_tokens())
      ++capped_seqs;
    std::printf("%3d  %6lld  %6lld  %.3f\n", s, static_cast<long long>(st.placed_tokens),
                static_cast<long long>(st.cpu_placed_tokens), share);
  }
  std::printf("%d sequence(s) held below the target share by the cap; cap violations: %d\n", capped_seqs,
              cap_violations);
  std::printf("agreement with fp64: max rel L2 %.2e, max |dLSE| %.2e -> %s\n", worst_rel, worst_lse,
              ok && cap_violations == 0 ? "PASS" : "FAIL");
  return ok && cap_violations == 0 ? 0 : 1;
} catch (const ws::error& e) {
  std::fprintf(stderr, "custom_policy: writescope error: %s\n", e.what());
  return 3;
}
