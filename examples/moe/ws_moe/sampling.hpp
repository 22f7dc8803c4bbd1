// SPDX-License-Identifier: Apache-2.0
// ws_moe/sampling.hpp — next-token selection: greedy (temperature 0) or
// temperature / top-k / top-p sampling with one seeded generator per sequence
// (a sequence's tokens do not depend on its batchmates).
//
// Greedy picks the first maximum (torch.argmax). Sampling: logits / T ->
// softmax -> keep the top_k most likely (0 = all) -> keep the smallest prefix,
// by descending probability, whose mass reaches top_p (at least one token) ->
// renormalise -> draw.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <writescope/error.hpp>

namespace ws_moe {

struct sampling_options {
  double temperature = 0.0;  ///< 0 = greedy
  double top_p = 1.0;
  int top_k = 0;
  std::uint64_t seed = 0;

  void validate() const {
    const auto num = [](double v) {  // shortest form that reads back the same ("-1", "0.95", "1e-07")
      char b[32];
      std::snprintf(b, sizeof b, "%.17g", v);
      for (int digits = 1; digits < 17; ++digits) {
        char c[32];
        std::snprintf(c, sizeof c, "%.*g", digits, v);
        if (std::strtod(c, nullptr) == v) return std::string(c);
      }
      return std::string(b);
    };
    if (!(temperature >= 0.0) || !std::isfinite(temperature))
      throw writescope::config_error("--temperature: must be >= 0 (and finite), not " + num(temperature));
    if (!(top_p > 0.0 && top_p <= 1.0))
      throw writescope::config_error("--top-p: must be in (0, 1], not " + num(top_p));
    if (top_k < 0) throw writescope::config_error("--top-k: must be >= 0, not " + std::to_string(top_k));
  }
};

[[nodiscard]] inline int argmax(std::span<const float> logits) {
  return int(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

class sampler {
 public:
  sampler(const sampling_options& o, int sequences) : o_(o) {
    o.validate();
    for (int i = 0; i < sequences; ++i) rng_.emplace_back(o.seed * 0x9e3779b97f4a7c15ull + std::uint64_t(i) + 1);
  }

  /// Greedy: next() reads only its arguments, so calls for different
  /// sequences may run concurrently; sampling shares scratch (one at a time).
  [[nodiscard]] bool greedy() const noexcept { return o_.temperature == 0.0; }

  int next(int seq, std::span<const float> logits) {
    if (o_.temperature == 0.0) return argmax(logits);
    const int V = int(logits.size());
    idx_.resize(std::size_t(V));
    std::iota(idx_.begin(), idx_.end(), 0);
    std::stable_sort(idx_.begin(), idx_.end(), [&](int a, int b) { return logits[std::size_t(a)] > logits[std::size_t(b)]; });
    int keep = o_.top_k > 0 ? std::min(o_.top_k, V) : V;
    p_.resize(std::size_t(keep));
    const double m = logits[std::size_t(idx_[0])];
    double sum = 0.0;
    for (int i = 0; i < keep; ++i) sum += p_[std::size_t(i)] = std::exp((logits[std::size_t(idx_[std::size_t(i)])] - m) / o_.temperature);
    double mass = 0.0;
    int n = 0;
    while (n < keep) {
      mass += p_[std::size_t(n)] / sum;
      ++n;
      if (mass >= o_.top_p) break;
    }
    std::discrete_distribution<int> d(p_.begin(), p_.begin() + n);
    return idx_[std::size_t(d(rng_[std::size_t(seq)]))];
  }

 private:
  sampling_options o_;
  std::vector<std::mt19937_64> rng_;
  std::vector<int> idx_;
  std::vector<double> p_;
};

}  // namespace ws_moe
