// SPDX-License-Identifier: Apache-2.0
// ws_moe/moe.hpp — routers and SiLU-gated experts, exactly as Hugging Face
// transformers defines them for each model (fp32):
//
//   Qwen3-MoE    p = softmax(logits) over all experts; top-k of p; renormalise
//                the k weights when norm_topk_prob (Qwen3MoeTopKRouter)
//   Mixtral      p = softmax(logits); top-k (2) of p; renormalise — the same as
//                a softmax over the k selected logits (MixtralTopKRouter)
//   DeepSeek-V2  p = softmax(logits); "greedy": top-k of p; "group_limited_greedy":
//                keep the topk_group groups (of n_group) with the largest
//                per-group max, zero the rest, top-k; weights × routed_scaling_factor
//                (DeepseekV2TopkRouter; like HF's native port, norm_topk_prob is
//                not applied — it is false in every public V2 config); plus the
//                shared experts (one MLP of n_shared × moe_intermediate) on every token
//
// Experts run in expert order, each over the tokens routed to it, and their
// weighted outputs are accumulated per token in that order (HF's index_add_).
// Ties in top-k go to the lower expert index.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "model_config.hpp"
#include "ops.hpp"
#include "weights.hpp"

namespace ws_moe {

/// Per-token routing result: `k` experts and their weights, row t at [t*k, t*k+k).
struct routing {
  int k = 0;
  std::vector<int> experts;
  std::vector<float> weights;
};

/// Routes `n` tokens h[n][hidden] through `router` by the rule of `c.kind`.
inline routing route_tokens(const model_config& c, const linear& router, const float* h, std::int64_t n) {
  const int E = router.out;
  const int k = c.experts_per_tok;
  routing r;
  r.k = k;
  r.experts.resize(std::size_t(n * k));
  r.weights.resize(std::size_t(n * k));
  std::vector<float> logits(static_cast<std::size_t>(n * E));
  router.forward(h, n, logits.data());
  std::vector<float> p(static_cast<std::size_t>(E));
  std::vector<int> order(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < n; ++t) {
    const float* lg = logits.data() + t * E;
    const float m = *std::max_element(lg, lg + E);
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += std::exp(double(lg[e]) - double(m));
    for (int e = 0; e < E; ++e) p[std::size_t(e)] = float(std::exp(double(lg[e]) - double(m)) / sum);
    std::vector<float> sel = p;  // scores top-k selects from
    if (c.kind == arch::deepseek_v2 && c.topk_method == "group_limited_greedy") {
      const int per = E / c.n_group;
      std::vector<float> gmax(static_cast<std::size_t>(c.n_group));
      for (int g = 0; g < c.n_group; ++g)
        gmax[std::size_t(g)] = *std::max_element(p.begin() + g * per, p.begin() + (g + 1) * per);
      std::vector<int> gorder(static_cast<std::size_t>(c.n_group));
      std::iota(gorder.begin(), gorder.end(), 0);
      std::stable_sort(gorder.begin(), gorder.end(),
                       [&](int a, int b) { return gmax[std::size_t(a)] > gmax[std::size_t(b)]; });
      std::vector<char> keep(static_cast<std::size_t>(c.n_group), 0);
      for (int i = 0; i < c.topk_group; ++i) keep[std::size_t(gorder[std::size_t(i)])] = 1;
      for (int e = 0; e < E; ++e)
        if (!keep[std::size_t(e / per)]) sel[std::size_t(e)] = 0.0f;
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
      return sel[std::size_t(a)] != sel[std::size_t(b)] ? sel[std::size_t(a)] > sel[std::size_t(b)] : a < b;
    });
    float wsum = 0.0f;
    for (int i = 0; i < k; ++i) wsum += sel[std::size_t(order[std::size_t(i)])];
    for (int i = 0; i < k; ++i) {
      const int e = order[std::size_t(i)];
      float w = sel[std::size_t(e)];
      if (c.kind == arch::mixtral || (c.kind == arch::qwen3_moe && c.norm_topk_prob)) w /= wsum;
      if (c.kind == arch::deepseek_v2) w *= float(c.routed_scaling_factor);
      r.experts[std::size_t(t * k + i)] = e;
      r.weights[std::size_t(t * k + i)] = w;
    }
  }
  return r;
}

/// out[n][hidden] = down(silu(gate(x)) * up(x)).
inline void mlp_forward(const mlp_weights& m, const float* x, std::int64_t n, float* out) {
  std::vector<float> g(static_cast<std::size_t>(n * m.gate.out)), u(static_cast<std::size_t>(n * m.up.out));
  m.gate.forward(x, n, g.data());
  m.up.forward(x, n, u.data());
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
  m.down.forward(g.data(), n, out);
}

/// The whole FFN of one layer: out[n][hidden] (written, not accumulated).
inline void ffn_forward(const model_config& c, const ffn_weights& f, const float* h, std::int64_t n, float* out) {
  const int H = c.hidden_size;
  if (!f.is_moe) {
    mlp_forward(f.dense, h, n, out);
    return;
  }
  std::fill(out, out + n * H, 0.0f);
  const routing r = route_tokens(c, f.moe.router, h, n);
  const int E = int(f.moe.experts.size());
  std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(E));  // (token*k + slot) per expert
  for (std::int64_t i = 0; i < n * r.k; ++i) rows[std::size_t(r.experts[std::size_t(i)])].push_back(i);
  std::vector<float> xin, y;
  for (int e = 0; e < E; ++e) {
    const auto& list = rows[std::size_t(e)];
    if (list.empty()) continue;
    const auto m = std::int64_t(list.size());
    xin.resize(std::size_t(m * H));
    y.resize(std::size_t(m * H));
    for (std::int64_t j = 0; j < m; ++j)
      std::copy_n(h + (list[std::size_t(j)] / r.k) * H, H, xin.data() + j * H);
    mlp_forward(f.moe.experts[std::size_t(e)], xin.data(), m, y.data());
    for (std::int64_t j = 0; j < m; ++j) {
      const std::int64_t t = list[std::size_t(j)] / r.k;
      const float w = r.weights[std::size_t(list[std::size_t(j)])];
      for (int i = 0; i < H; ++i) out[t * H + i] += y[std::size_t(j * H + i)] * w;
    }
  }
  if (f.moe.shared) {
    y.resize(std::size_t(n * H));
    mlp_forward(*f.moe.shared, h, n, y.data());
    for (std::int64_t i = 0; i < n * H; ++i) out[i] += y[std::size_t(i)];
  }
}

}  // namespace ws_moe
