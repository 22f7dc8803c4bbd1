// SPDX-License-Identifier: Apache-2.0
// tests/consumer/consumer.cpp — what a downstream project compiles against an
// installed (find_package) or vendored (add_subdirectory) writescope, with
// writescope::core alone: a short ragged decode through an inplace_kv_cache +
// hybrid_attention on the host backend, compared at every step with fp64
// attention written out below (writescope/reference.hpp would need Eigen, i.e.
// writescope::reference). Built with -Wall -Wextra -Wsign-conversion -Werror:
// the library's headers must reach it as system headers. Exit 0 on agreement.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <writescope/writescope.hpp>

namespace ws = writescope;

namespace {

// fp64 softmax attention of one query token (hq heads) over L cached tokens
// [L][hkv][d] of one sequence (GQA: head h reads KV head h / (hq / hkv)).
void gqa_decode(int hq, int hkv, int d, const float* q, const ws::bf16* k, const ws::bf16* v, std::size_t L,
                double scale, double* o, double* lse) {
  const int group = hq / hkv;
  std::vector<double> s(L);
  for (int h = 0; h < hq; ++h) {
    const std::size_t j = std::size_t(h / group);
    double m = -1e300;
    for (std::size_t t = 0; t < L; ++t) {
      double dot = 0;
      for (int i = 0; i < d; ++i)
        dot += double(q[std::size_t(h * d + i)]) * double(k[(t * std::size_t(hkv) + j) * std::size_t(d) + std::size_t(i)].to_float());
      s[t] = dot * scale;
      m = std::max(m, s[t]);
    }
    double den = 0;
    for (std::size_t t = 0; t < L; ++t) den += std::exp(s[t] - m);
    for (int i = 0; i < d; ++i) {
      double acc = 0;
      for (std::size_t t = 0; t < L; ++t)
        acc += std::exp(s[t] - m) * double(v[(t * std::size_t(hkv) + j) * std::size_t(d) + std::size_t(i)].to_float());
      o[std::size_t(h * d + i)] = acc / den;
    }
    lse[h] = m + std::log(den);
  }
}

}  // namespace

int main() try {
  using layout = ws::gqa_layout<128>;
  using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::fixed_ratio>;
  constexpr int hq = 8, hkv = 2, d = 128;
  const layout lay(hq, hkv);
  ws::partition_spec spec;
  spec.block_tokens = 16;
  spec.d_window_tokens = 32;
  spec.max_sequences = 2;
  spec.cpu_capacity_tokens = 1024;
  spec.pinned_capacity_tokens = 1024;
  spec.ping_pong_bytes = 8 * ws::block_format<layout>{lay, 16}.block_bytes();
  spec.gpu_split_blocks = 4;
  ws::host_backend backend;
  cache_type cache(backend, lay, spec, ws::fixed_ratio(0.5));
  ws::hybrid_attention<cache_type> attention(cache);

  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<std::vector<ws::bf16>> k(2), v(2);  // every token of each sequence, [t][hkv][d]
  std::vector<ws::bf16> nk, nv;
  auto make = [&](ws::index_t n) {
    nk.resize(std::size_t(n) * hkv * d);
    nv.resize(nk.size());
    for (auto& x : nk) x = ws::bf16::from_float(normal(rng));
    for (auto& x : nv) x = ws::bf16::from_float(normal(rng));
    return cache_type::kv_input{{nk.data(), nv.data()}, n};
  };
  const ws::index_t prompts[2] = {100, 37};
  std::vector<ws::sequence_id> batch;
  for (ws::index_t p : prompts) {
    const ws::sequence_id id = cache.begin_sequence(p);
    cache.append_prefill(0, id, make(p));
    k[std::size_t(id)] = nk;
    v[std::size_t(id)] = nv;
    batch.push_back(id);
  }

  double worst = 0;
  std::vector<float> q(2 * hq * d), out(q.size()), lse(2 * hq);
  std::vector<double> ro(hq * d), rl(hq);
  for (int step = 0; step < 40; ++step) {
    cache.append(0, batch, make(2));
    for (int i = 0; i < 2; ++i) {
      k[std::size_t(batch[std::size_t(i)])].insert(k[std::size_t(batch[std::size_t(i)])].end(), nk.begin() + i * hkv * d,
                                                   nk.begin() + (i + 1) * hkv * d);
      v[std::size_t(batch[std::size_t(i)])].insert(v[std::size_t(batch[std::size_t(i)])].end(), nv.begin() + i * hkv * d,
                                                   nv.begin() + (i + 1) * hkv * d);
    }
    for (float& x : q) x = normal(rng);
    attention.step(0, batch, ws::host_span<const float>(q.data(), ws::index_t(q.size())), 0.088f,
                   {ws::host_span<float>(out.data(), ws::index_t(out.size())),
                    ws::host_span<float>(lse.data(), ws::index_t(lse.size())), nullptr});
    for (int i = 0; i < 2; ++i) {
      const auto& K = k[std::size_t(batch[std::size_t(i)])];
      const auto& V = v[std::size_t(batch[std::size_t(i)])];
      gqa_decode(hq, hkv, d, q.data() + i * hq * d, K.data(), V.data(), K.size() / std::size_t(hkv * d), 0.088,
                 ro.data(), rl.data());
      for (int h = 0; h < hq; ++h) {
        double num = 0, den = 0;
        for (int j = 0; j < d; ++j) {
          const double e = out[std::size_t((i * hq + h) * d + j)] - ro[std::size_t(h * d + j)];
          num += e * e;
          den += ro[std::size_t(h * d + j)] * ro[std::size_t(h * d + j)];
        }
        worst = std::max(worst, std::sqrt(num / den));
        worst = std::max(worst, std::abs(lse[std::size_t(i * hq + h)] - rl[std::size_t(h)]));
      }
    }
    cache.flush();
  }
  const ws::region_usage u = cache.usage();
  const bool ok = worst <= 1e-3 && u.cpu_used_blocks > 0 && u.pinned_used_blocks > 0;
  std::printf("writescope %d.%d.%d consumer: worst error %.2e, %lld unpinned + %lld pinned blocks: %s\n",
              WS_VERSION_MAJOR, WS_VERSION_MINOR, WS_VERSION_PATCH, worst, static_cast<long long>(u.cpu_used_blocks),
              static_cast<long long>(u.pinned_used_blocks), ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
} catch (const writescope::error& e) {
  std::fprintf(stderr, "consumer: %s\n", e.what());
  return 1;
}
