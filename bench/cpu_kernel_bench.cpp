// SPDX-License-Identifier: Apache-2.0
// bench/cpu_kernel_bench.cpp — the CPU decode kernel on ONE thread, timed with
// the thread's CPU clock (CLOCK_THREAD_CPUTIME_ID), next to a one-thread
// streaming read timed the same way. For kernel work on shared or virtualised
// machines: the thread's CPU time does not count the time other processes
// hold the core, so the numbers hold while a build runs next to them (the
// memory bandwidth they take still shows). cpu_attention_bench measures the
// real multi-threaded step in wall time.
//
// Per preset and precision: "hot" (a few blocks, resident in L2) and "cold"
// (--mib of KV, far more than L3, walked in hybrid_attention's task order:
// sequence × KV head × 16-block range). Reports GB/s, ns and TSC ticks per
// (token, KV head), and the ratio to the read ceiling.
//
//   cpu_kernel_bench [--mib 1024] [--presets qwen3,mixtral,dsv2] [--amx] [--json path]
#include <writescope/writescope.hpp>

#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#  include <x86intrin.h>
#endif

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ws = writescope;
using ws::index_t;

namespace {

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

std::uint64_t ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return 0;
#endif
}

/// Best of 5 one-thread reads of `bytes` (64-bit words summed with SIMD).
double read_ceiling_gbps(std::size_t bytes) {
  std::vector<std::uint64_t> buf(bytes / 8);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = i;
  using batch = xsimd::batch<std::uint64_t>;
  constexpr std::size_t step = 4 * batch::size;
  const std::size_t n = buf.size() / step * step;
  double best = 0;
  std::uint64_t sink = 0;
  for (int r = 0; r < 5; ++r) {
    const double t0 = thread_seconds();
    batch a0(std::uint64_t(0)), a1(std::uint64_t(0)), a2(std::uint64_t(0)), a3(std::uint64_t(0));
    for (std::size_t i = 0; i < n; i += step) {
      a0 += batch::load_unaligned(&buf[i]);
      a1 += batch::load_unaligned(&buf[i + batch::size]);
      a2 += batch::load_unaligned(&buf[i + 2 * batch::size]);
      a3 += batch::load_unaligned(&buf[i + 3 * batch::size]);
    }
    sink += xsimd::hadd((a0 + a1) + (a2 + a3));
    best = std::max(best, double(n * 8) / (thread_seconds() - t0) / 1e9);
  }
  if (sink == 42) std::puts("");
  return best;
}

struct result {
  std::string preset, precision, mode;
  double mib = 0, gbps = 0, ns = 0, tsc = 0;
};

template <class Preset, class K>
result run(const char* precision, const char* mode, std::size_t mib, double ceiling) {
  using L = typename Preset::layout_type;
  const L lay = Preset::layout();
  const ws::block_format<L> f{lay, 64};
  const index_t nb = std::max<index_t>(8, index_t(mib << 20) / f.block_bytes());
  std::vector<ws::bf16> kv(std::size_t(nb * f.block_elems()));
  std::uint32_t x = 1;
  for (auto& e : kv) {
    x = x * 1664525u + 1013904223u;
    e = ws::bf16::from_float(float(x >> 8) / 16777216.0f * 4.0f - 2.0f);
  }
  const int g = lay.group_size();
  std::vector<float> q(std::size_t(lay.num_q_heads()) * L::q_dim), o(std::size_t(g) * L::v_dim);
  std::vector<float> lse(static_cast<std::size_t>(g));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = float(int(i * 7919 % 200) - 100) / 50.0f;
  const float scale = float(Preset::softmax_scale());
  constexpr index_t seq_blocks = 512, task_blocks = 16;  // 32K-token sequences, cpu_task_blocks = 16
  std::vector<ws::cpu::kv_segment> segs;
  const int reps = mib <= 8 ? 200 : 3;
  double best = 1e30;
  std::uint64_t best_ticks = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = thread_seconds();
    const std::uint64_t c0 = ticks();
    for (index_t s0 = 0; s0 < nb; s0 += seq_blocks)
      for (int h = 0; h < lay.kv_heads(); ++h)
        for (index_t b0 = s0; b0 < std::min(nb, s0 + seq_blocks); b0 += task_blocks) {
          segs.clear();
          for (index_t b = b0; b < std::min({nb, b0 + task_blocks, s0 + seq_blocks}); ++b)
            segs.push_back({kv.data() + b * f.block_elems(), 64});
          K::run(f, h, q.data() + std::size_t(h) * std::size_t(g) * L::q_dim, L::q_dim, g, scale, segs, o.data(),
                 L::v_dim, lse.data());
        }
    const double t = thread_seconds() - t0;
    if (t < best) {
      best = t;
      best_ticks = ticks() - c0;
    }
  }
  const double token_heads = double(nb) * 64.0 * lay.kv_heads();
  result r{std::string(Preset::name), precision, mode, double(nb * f.block_bytes()) / 1048576.0,
           double(nb * f.block_bytes()) / best / 1e9, best * 1e9 / token_heads, double(best_ticks) / token_heads};
  std::printf("%-16s %-4s %-4s %8.1f %8.2f %7.3f %10.1f %10.1f\n", r.preset.c_str(), r.precision.c_str(), mode, r.mib,
              r.gbps, r.gbps / ceiling, r.ns, r.tsc);
  std::fflush(stdout);
  return r;
}

template <class Preset>
void run_preset(std::vector<result>& out, std::size_t mib, double ceiling, bool bf16, bool amx) {
  using L = typename Preset::layout_type;
  using fp32_kernel = ws::cpu::decode_kernel<L, ws::cpu::default_arch, ws::cpu::fp32_scores>;
  using bf16_kernel = ws::cpu::decode_kernel<L, ws::cpu::default_arch, ws::cpu::bf16_scores>;
  out.push_back(run<Preset, fp32_kernel>("fp32", "hot", 1, ceiling));
  out.push_back(run<Preset, fp32_kernel>("fp32", "cold", mib, ceiling));
  if (bf16) {
    out.push_back(run<Preset, bf16_kernel>("bf16", "hot", 1, ceiling));
    out.push_back(run<Preset, bf16_kernel>("bf16", "cold", mib, ceiling));
  }
  if (amx) {
    out.push_back(run<Preset, ws::cpu::amx_decode_kernel<L>>("amx", "hot", 1, ceiling));
    out.push_back(run<Preset, ws::cpu::amx_decode_kernel<L>>("amx", "cold", mib, ceiling));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mib = 1024;
  std::string presets = "qwen3,mixtral,dsv2", json_path;
  bool bf16 = true, amx = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "cpu_kernel_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--mib") mib = std::size_t(std::atoll(value().c_str()));
    else if (a == "--presets") presets = value();
    else if (a == "--json") json_path = value();
    else if (a == "--no-bf16") bf16 = false;
    else if (a == "--amx") amx = true;
    else if (a == "--help" || a == "-h") {
      std::puts("cpu_kernel_bench [--mib N (default 1024)] [--presets qwen3,mixtral,dsv2] [--no-bf16] [--amx] [--json path]\n"
                "  --amx  also cpu::amx_decode_kernel (AMX-BF16 tiles; refused where amx_available() is false)");
      return 0;
    } else {
      std::fprintf(stderr, "cpu_kernel_bench: unknown flag '%s' (--help)\n", a.c_str());
      return 2;
    }
  }
  if (amx && !ws::cpu::amx_available()) {
    std::fprintf(stderr, "cpu_kernel_bench: --amx: this CPU (or kernel) offers no AMX-BF16 tiles\n");
    return 2;
  }
  if (mib < 16) {
    std::fprintf(stderr, "cpu_kernel_bench: --mib must be >= 16 (cold runs must miss the caches)\n");
    return 2;
  }
  try {
    ws::cpu::require_cpu_support();
    const double ceiling = read_ceiling_gbps(mib << 20);
    std::printf("one thread, thread CPU time; kernels for %s; read ceiling %.2f GB/s (%zu MiB)\n",
                ws::cpu::default_arch::name(), ceiling, mib);
    std::printf("%-16s %-4s %-4s %8s %8s %7s %10s %10s\n", "preset", "prec", "mode", "MiB", "GB/s", "ratio",
                "ns/tok·h", "tsc/tok·h");
    std::vector<result> rs;
    if (presets.find("qwen3") != std::string::npos) run_preset<ws::presets::qwen3_30b_a3b>(rs, mib, ceiling, bf16, amx);
    if (presets.find("mixtral") != std::string::npos) run_preset<ws::presets::mixtral_8x7b>(rs, mib, ceiling, bf16, amx);
    if (presets.find("dsv2") != std::string::npos) run_preset<ws::presets::deepseek_v2_lite>(rs, mib, ceiling, bf16, amx);
    const double ceiling_after = read_ceiling_gbps(mib << 20);
    std::printf("read ceiling again: %.2f GB/s\n", ceiling_after);
    if (!json_path.empty()) {
      nlohmann::json j;
      j["simd_arch"] = ws::cpu::default_arch::name();
      j["ceiling_gbps"] = {ceiling, ceiling_after};
      j["timing"] = "CLOCK_THREAD_CPUTIME_ID, best of reps; tsc = rdtsc ticks (not core cycles)";
      for (const result& r : rs)
        j["results"].push_back({{"preset", r.preset}, {"precision", r.precision}, {"mode", r.mode}, {"kv_mib", r.mib},
                                {"gbps", r.gbps}, {"ns_per_token_kvhead", r.ns}, {"tsc_per_token_kvhead", r.tsc}});
      std::ofstream(json_path) << j.dump(2) << '\n';
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpu_kernel_bench: error: %s\n", e.what());
    return 3;
  }
  return 0;
}
