// SPDX-License-Identifier: Apache-2.0
// examples/custom_cpu_kernel.cpp — a CPU attention kernel written outside the
// library, plugged into hybrid_attention as its second template parameter.
//
// two_pass_kernel is a plain scalar kernel: per query head, one pass over the
// keys for the maximum score, one for the exponentials, their sum and the
// weighted values, all in fp32. It is slower than cpu::decode_kernel and
// easy to read: the shape a kernel for another ISA or a quantized KV format
// starts from.
//
// What a kernel must provide (the writescope::cpu_attention_kernel concept,
// writescope/cpu/kernel.hpp):
//   using kernel_concept = writescope::cpu_attention_kernel_tag;   opt-in, nothing matches by accident
//   static void run(fmt, kv_head, q, q_head_stride, group, scale, segs, o, o_head_stride, lse);
// returning the partial state (normalised output, natural-log LSE; an empty
// input gives o = 0, lse = -inf), thread-safe. hybrid_attention's CPU engine
// runs it on its threads; on host_backend the emulated device runs it too, so
// here every attended token goes through it: the program checks that by
// counting tokens, and checks the outputs against fp64 attention.
//
// Usage: custom_cpu_kernel [--steps N] [--layers N] [--cpu-share R] [--seed N]
// Exit status: 0 agreement and every token counted, 1 otherwise, 2 bad command line.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <writescope/reference.hpp>
#include <writescope/writescope.hpp>

namespace ws = writescope;

/// KV tokens attended per KV head, summed over every call (all threads).
inline std::atomic<long long> attended_tokens{0};

/// Two-pass scalar decode attention for any layout (GQA: K and V planes; MLA:
/// V is the first v_dim elements of the key row, Layout::value_plane == key_plane).
template <ws::kv_layout Layout>
struct two_pass_kernel {
  using kernel_concept = ws::cpu_attention_kernel_tag;

  static void run(const ws::block_format<Layout>& fmt, int kv_head, const float* q, ws::index_t q_head_stride,
                  int group, float scale, std::span<const ws::cpu::kv_segment> segs, float* o,
                  ws::index_t o_head_stride, float* lse) {
    constexpr int R = Layout::row_elems, Q = Layout::q_dim, V = Layout::v_dim;
    const ws::index_t k_off = fmt.slice_offset(Layout::key_plane, kv_head);
    const ws::index_t v_off = fmt.slice_offset(Layout::value_plane, kv_head);
    long long tokens = 0;
    for (const ws::cpu::kv_segment& s : segs) tokens += s.tokens;
    attended_tokens.fetch_add(tokens, std::memory_order_relaxed);
    auto score = [&](const float* qh, const ws::cpu::kv_segment& s, int t) {
      const ws::bf16* k = s.block + k_off + ws::index_t(t) * R;
      float dot = 0.0f;
      for (int e = 0; e < Q; ++e) dot += qh[e] * k[e].to_float();
      return scale * dot;
    };
    for (int g = 0; g < group; ++g) {
      const float* qh = q + g * q_head_stride;
      float* oh = o + g * o_head_stride;
      float m = -std::numeric_limits<float>::infinity();
      for (const auto& s : segs)
        for (int t = 0; t < s.tokens; ++t) m = std::max(m, score(qh, s, t));
      std::fill(oh, oh + V, 0.0f);
      if (m == -std::numeric_limits<float>::infinity()) {  // no key: the empty partial
        lse[g] = m;
        continue;
      }
      float sum = 0.0f;
      for (const auto& s : segs)
        for (int t = 0; t < s.tokens; ++t) {
          const float p = std::exp(score(qh, s, t) - m);
          sum += p;
          const ws::bf16* v = s.block + v_off + ws::index_t(t) * R;
          for (int e = 0; e < V; ++e) oh[e] += p * v[e].to_float();
        }
      for (int e = 0; e < V; ++e) oh[e] /= sum;
      lse[g] = m + std::log(sum);
    }
  }
};

static_assert(ws::cpu_attention_kernel<two_pass_kernel<ws::gqa_layout<128>>, ws::gqa_layout<128>>);

/// The same function without the opt-in tag: not a CPU attention kernel.
struct look_alike {
  static void run(const ws::block_format<ws::gqa_layout<128>>&, int, const float*, ws::index_t, int, float,
                  std::span<const ws::cpu::kv_segment>, float*, ws::index_t, float*) {}
};
static_assert(!ws::cpu_attention_kernel<look_alike, ws::gqa_layout<128>>, "cpu_attention_kernel is opt-in by tag");

namespace {

struct options {
  int steps = 24;
  int layers = 2;
  double cpu_share = 0.5;
  unsigned long long seed = 11;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::puts("usage: custom_cpu_kernel [--steps N] [--layers N] [--cpu-share R] [--seed N]\n"
                "Runs a short decode loop whose attention is a user-written scalar kernel and checks\n"
                "the outputs against fp64 attention and that every attended token went through it.");
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "custom_cpu_kernel: %s needs a value (try --help)\n", a.c_str());
      std::exit(2);
    }
    const char* v = argv[++i];
    char* end = nullptr;
    const double x = std::strtod(v, &end);
    if (end == v || *end != '\0') {
      std::fprintf(stderr, "custom_cpu_kernel: %s: '%s' is not a number\n", a.c_str(), v);
      std::exit(2);
    }
    if (a == "--steps") o.steps = int(x);
    else if (a == "--layers") o.layers = int(x);
    else if (a == "--cpu-share") o.cpu_share = x;
    else if (a == "--seed") o.seed = static_cast<unsigned long long>(x);
    else {
      std::fprintf(stderr, "custom_cpu_kernel: unknown option %s (try --help)\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.steps < 1 || o.layers < 1) {
    std::fprintf(stderr, "custom_cpu_kernel: --steps and --layers must be >= 1\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  using layout = ws::gqa_layout<128>;
  using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::fixed_ratio>;
  const layout lay(8, 2);
  const int hq = lay.num_q_heads(), hkv = lay.kv_heads();
  constexpr int d = layout::head_dim;
  const double scale = 1.0 / std::sqrt(double(d));

  const std::vector<ws::index_t> prompts{700, 96, 1300};
  const int nseq = int(prompts.size());
  ws::partition_spec spec;
  spec.num_layers = o.layers;
  spec.block_tokens = 16;
  spec.d_window_tokens = 32;
  spec.max_sequences = nseq;
  spec.cpu_capacity_tokens = 4096;
  spec.pinned_capacity_tokens = 4096;
  spec.ping_pong_bytes = ws::index_t(1) << 20;

  ws::host_backend backend;
  cache_type cache(backend, lay, spec, ws::fixed_ratio(o.cpu_share));
  ws::hybrid_attention<cache_type, two_pass_kernel<layout>> attention(cache, ws::attention_options{2});

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

  std::vector<ws::sequence_id> batch;
  for (int i = 0; i < nseq; ++i) {
    const ws::sequence_id id = cache.begin_sequence(prompts[std::size_t(i)]);
    batch.push_back(id);
    hk[std::size_t(id)].resize(std::size_t(o.layers));
    hv[std::size_t(id)].resize(std::size_t(o.layers));
    for (int l = 0; l < o.layers; ++l) {
      cache.append_prefill(l, id, make(prompts[std::size_t(i)]));
      hk[std::size_t(id)][std::size_t(l)] = k;
      hv[std::size_t(id)][std::size_t(l)] = v;
    }
  }

  double worst_rel = 0, worst_lse = 0;
  bool ok = true, counted = true;
  ws::index_t cpu_tokens = 0, streamed_tokens = 0;
  std::vector<float> q, out, lse;
  std::vector<double> ro(static_cast<std::size_t>(hq) * d), rl(static_cast<std::size_t>(hq));
  for (int step = 0; step < o.steps; ++step) {
    for (int l = 0; l < o.layers; ++l) {
      cache.append(l, batch, make(nseq));
      long long expect = 0;
      for (int i = 0; i < nseq; ++i) {
        auto& K = hk[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        auto& V = hv[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        K.insert(K.end(), k.begin() + i * hkv * d, k.begin() + (i + 1) * hkv * d);
        V.insert(V.end(), v.begin() + i * hkv * d, v.begin() + (i + 1) * hkv * d);
        expect += (long long)(K.size()) / d;  // tokens x KV heads
      }
      q.resize(std::size_t(nseq * hq * d));
      for (auto& x : q) x = normal(rng);
      out.assign(q.size(), 0.0f);
      lse.assign(std::size_t(nseq * hq), 0.0f);
      attended_tokens = 0;
      const ws::step_report rep =
          attention.step(l, batch, ws::host_span<const float>(q.data(), ws::index_t(q.size())), float(scale),
                         {ws::host_span<float>(out.data(), ws::index_t(out.size())),
                          ws::host_span<float>(lse.data(), ws::index_t(lse.size())), nullptr});
      cpu_tokens += rep.cpu_tokens;
      streamed_tokens += rep.streamed_tokens;
      if (attended_tokens.load() != expect) {  // CPU engine + emulated device (streamed and D-window)
        std::printf("step %d layer %d: the kernel attended %lld token-heads, expected %lld\n", step, l,
                    attended_tokens.load(), expect);
        counted = false;
      }
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
    cache.flush();
  }
  const bool both_sides = cpu_tokens > 0 && streamed_tokens > 0;
  std::printf("two_pass_kernel: %lld KV tokens attended by the CPU engine, %lld streamed (emulated device)\n",
              static_cast<long long>(cpu_tokens), static_cast<long long>(streamed_tokens));
  std::printf("agreement with fp64: max rel L2 %.2e, max |dLSE| %.2e; every token through the kernel: %s -> %s\n",
              worst_rel, worst_lse, counted ? "yes" : "no", ok && counted && both_sides ? "PASS" : "FAIL");
  return ok && counted && both_sides ? 0 : 1;
} catch (const ws::error& e) {
  std::fprintf(stderr, "custom_cpu_kernel: writescope error: %s\n", e.what());
  return 3;
}
