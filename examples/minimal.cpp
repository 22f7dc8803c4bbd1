// SPDX-License-Identifier: Apache-2.0
// examples/minimal.cpp — the smallest use of writescope from another engine:
// one layer, one sequence, a prompt and one decode step, checked against fp64
// attention. The part between README-BEGIN and README-END is the snippet shown
// in README.md, verbatim; the test `readme_snippet` fails if the two drift apart.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <writescope/reference.hpp>
#include <writescope/writescope.hpp>

int main() {
  // What the engine's model produced: prompt K/V and the new token's K/V,
  // token-major [tokens][kv_heads][128] bf16; the new token's query [32][128] fp32.
  const long prompt_tokens = 1000;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto random_bf16 = [&](std::size_t n) {
    std::vector<writescope::bf16> x(n);
    for (auto& e : x) e = writescope::bf16::from_float(normal(rng));
    return x;
  };
  const auto prompt_k = random_bf16(std::size_t(prompt_tokens) * 4 * 128);
  const auto prompt_v = random_bf16(std::size_t(prompt_tokens) * 4 * 128);
  const auto new_k = random_bf16(4 * 128), new_v = random_bf16(4 * 128);
  std::vector<float> q(32 * 128), out(32 * 128), lse(32);
  for (float& x : q) x = normal(rng);
  const float scale = 1.0f / std::sqrt(128.0f);

  // README-BEGIN
  namespace ws = writescope;
  using layout = ws::gqa_layout<128>;  // K and V rows of 128 bf16 per KV head
  using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::roofline_policy>;

  ws::host_backend backend;         // on a GPU: cuda_backend, examples/minimal_cuda.cpp
  const layout lay(32, 4);          // 32 query heads share 4 KV heads (Qwen3-30B-A3B)
  ws::partition_spec spec;          // per layer: block size, D, region capacities
  spec.num_layers = 1;
  spec.block_tokens = 64;
  spec.d_window_tokens = 256;       // D: the eviction batch, a multiple of the block
  spec.max_sequences = 8;
  spec.cpu_capacity_tokens = 1 << 16;     // unpinned compute region: the CPU attends it in place
  spec.pinned_capacity_tokens = 1 << 16;  // pinned load region: streamed to the GPU
  spec.ping_pong_bytes = 8 << 20;
  ws::roofline_params calibration;  // seconds per KV token, measured offline
  calibration.cpu_cost_per_token_seconds = 2.6e-8;  // A: 2 KiB per token at ~80 GB/s
  calibration.gpu_cost_per_token_seconds = 3.8e-8;  // B: 2 KiB per token at ~54 GB/s over PCIe
  cache_type cache(backend, lay, spec, ws::roofline_policy(calibration));
  ws::hybrid_attention<cache_type> attention(cache);

  // Prefill: whole D-token batches go to their final region now, the rest to the D-window.
  const ws::sequence_id seq = cache.begin_sequence(prompt_tokens);
  cache.append_prefill(/*layer=*/0, seq, {{prompt_k.data(), prompt_v.data()}, prompt_tokens});

  // One decode step: append the new token, attend (CPU and GPU engines at once,
  // merged by log-sum-exp), then flush once all layers are done.
  const ws::sequence_id batch[] = {seq};
  cache.append(0, batch, {{new_k.data(), new_v.data()}, 1});
  // outputs: out, lse (may be empty), and a debug_partials* (nullptr: none); returns a step_report
  attention.step(0, batch, ws::host_span<const float>(q.data(), ws::index_t(q.size())), scale,
                 {ws::host_span<float>(out.data(), ws::index_t(out.size())),
                  ws::host_span<float>(lse.data(), ws::index_t(lse.size())), nullptr});
  cache.flush();  // evicts every full D-window, whole, to the side the policy picks
  // README-END

  // Check against fp64 attention over the same tokens.
  std::vector<writescope::bf16> k = prompt_k, v = prompt_v;
  k.insert(k.end(), new_k.begin(), new_k.end());
  v.insert(v.end(), new_v.begin(), new_v.end());
  std::vector<double> ref_o(out.size()), ref_lse(lse.size());
  writescope::reference::gqa_decode(32, 4, 128, q.data(), k.data(), v.data(), prompt_tokens + 1, scale, ref_o.data(),
                                    ref_lse.data());
  double worst_rel = 0, worst_lse = 0;
  bool ok = true;
  for (int h = 0; h < 32; ++h) {
    double num = 0, den = 0;
    for (int i = 0; i < 128; ++i) {
      const double d = out[std::size_t(h * 128 + i)] - ref_o[std::size_t(h * 128 + i)];
      num += d * d;
      den += ref_o[std::size_t(h * 128 + i)] * ref_o[std::size_t(h * 128 + i)];
    }
    worst_rel = std::max(worst_rel, std::sqrt(num / den));
    const double lse_err = std::abs(double(lse[std::size_t(h)]) - ref_lse[std::size_t(h)]);
    worst_lse = std::max(worst_lse, lse_err);
    ok = ok && worst_rel <= 5e-3 && lse_err <= 1e-3 + 1e-5 * std::abs(ref_lse[std::size_t(h)]);
  }
  const auto& st = cache.sequence(seq);
  std::printf("sequence of %ld tokens: %lld on the CPU side, %lld streamed, %d in the D-window\n", prompt_tokens + 1,
              static_cast<long long>(st.cpu_placed_tokens), static_cast<long long>(st.placed_tokens - st.cpu_placed_tokens),
              st.window_tokens[0]);
  std::printf("max rel L2 %.2e, max |dLSE| %.2e vs fp64: %s\n", worst_rel, worst_lse, ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
