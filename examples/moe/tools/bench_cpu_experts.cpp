// SPDX-License-Identifier: Apache-2.0
// ws_moe_bench_cpu_experts — ws_moe::cpu::run_experts (ws_moe/cpu_experts.hpp)
// on the expert shapes of Qwen3-30B-A3B (2048/768), DeepSeek-V2-Lite
// (2048/1408) and Mixtral-8x7B (4096/14336), per ISA the CPU supports and per
// precision:
//
//   decode   many experts × 1, 2 or 16 rows: weights far above L3, each byte read
//            once per call. Reported: GB/s of weights read, against the same-run
//            DRAM read ceiling (all threads stream-read a buffer of the same total
//            size, 64-byte vector loads) — ratio_dram.
//   batched  a few experts × 64, 512, 4096 rows: GFLOP/s (2 flops per multiply-add,
//            3·hidden·inter multiply-adds per row) against the same-run compute
//            ceiling of the ISA and precision: register-resident FMA chains
//            (vfmadd231ps) or vdpbf16ps chains on every thread — ratio_compute.
//            Also reported: the kernels' own register tile on L1-resident data
//            (tile_l1_gflops), the ceiling of the kernel's inner loop.
//
// Each case: one warm-up call, then calls until --min-seconds have passed (at
// least 3); best and median seconds. Weights are random bf16 in fresh host
// memory (pageable), one pool per model reused by every case. The scalar ISA
// runs the decode cases only (its batched cases take minutes; --scalar-batched).
//
//   OMP_PROC_BIND=close OMP_PLACES=cores ws_moe_bench_cpu_experts --threads 16
//       --min-seconds 0.3 --json cpu_experts.json
//
// Options: --threads N (default: omp_get_max_threads()), --min-seconds S
// (0.3), --json FILE (rewritten after every case), --models LIST
// (qwen3,dsv2,mixtral), --isas LIST (default: every supported one), --quick
// (fewer cases: one decode and one batched shape per model), --scalar-batched,
// --budget S (skip the remaining cases once S seconds have passed; 0 = none).
// The table is printed last.
#include <omp.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ws_moe/cpu_experts.hpp"
#include "ws_moe/dram_ceiling.hpp"

namespace cpux = ws_moe::cpu;
using json = nlohmann::json;
using clock_type = std::chrono::steady_clock;

namespace {

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t b = 0;
  while (b <= s.size()) {
    const std::size_t e = std::min(s.find(',', b), s.size());
    if (e > b) out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

struct options {
  int threads = 0;
  double min_seconds = 0.3, budget_seconds = 0;
  std::string json_path;
  std::vector<std::string> models = {"qwen3", "dsv2", "mixtral"};
  std::vector<std::string> isas;
  bool quick = false, scalar_batched = false;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(f + " needs a value");
      return argv[++i];
    };
    auto number = [&](const std::string& v) {
      char* end = nullptr;
      const double d = std::strtod(v.c_str(), &end);
      if (v.empty() || *end) throw usage_error(f + ": '" + v + "' is not a number");
      return d;
    };
    if (f == "--threads") {
      const double t = number(value());
      if (t < 1 || t != double(int(t))) throw usage_error("--threads must be a whole number >= 1");
      o.threads = int(t);
    } else if (f == "--min-seconds") {
      o.min_seconds = number(value());
      if (o.min_seconds < 0) throw usage_error("--min-seconds must be >= 0");
    } else if (f == "--budget") {
      o.budget_seconds = number(value());
    } else if (f == "--json") {
      o.json_path = value();
    } else if (f == "--models") {
      o.models = split(value());
      for (const auto& m : o.models)
        if (m != "qwen3" && m != "dsv2" && m != "mixtral") throw usage_error("--models: unknown model '" + m + "' (qwen3, dsv2, mixtral)");
    } else if (f == "--isas") {
      o.isas = split(value());
      for (const auto& m : o.isas)
        if (m != "scalar" && m != "avx2" && m != "avx512" && m != "avx512bf16")
          throw usage_error("--isas: unknown ISA '" + m + "' (scalar, avx2, avx512, avx512bf16)");
    } else if (f == "--quick") {
      o.quick = true;
    } else if (f == "--scalar-batched") {
      o.scalar_batched = true;
    } else if (f == "--help" || f == "-h") {
      std::printf("usage: ws_moe_bench_cpu_experts [--threads N] [--min-seconds S] [--json FILE] [--models LIST] "
                  "[--isas LIST] [--quick] [--scalar-batched] [--budget S]\n");
      std::exit(0);
    } else {
      throw usage_error("unknown option '" + f + "' (--help)");
    }
  }
  if (o.threads == 0) o.threads = std::max(1, omp_get_max_threads());
  return o;
}

// ---------------------------------------------------------------------------
// Ceilings
// ---------------------------------------------------------------------------

std::uint64_t g_sink = 0;

// The DRAM read ceiling: cpux::dram_read_gbps (ws_moe/dram_ceiling.hpp, shared with ws_decode).

#if defined(__x86_64__)
constexpr long peak_iters = 1 << 22;
__attribute__((target("avx512f"), noinline)) float fma_peak_avx512(float seed) {
  __m512 acc[16];
  const __m512 a = _mm512_set1_ps(1.0f + seed * 1e-7f), b = _mm512_set1_ps(seed * 1e-7f);
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(float(i));
  for (long it = 0; it < peak_iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), noinline)) float dpbf16_peak(float seed) {
  __m512 acc[16];
  const __m512bh a = (__m512bh)_mm512_set1_epi16(short(0x3f80 + int(seed)));
  const __m512bh b = (__m512bh)_mm512_set1_epi16(short(0x3000));
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(float(i));
  for (long it = 0; it < peak_iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx2,fma"), noinline)) float fma_peak_avx2(float seed) {
  __m256 acc[12];
  const __m256 a = _mm256_set1_ps(1.0f + seed * 1e-7f), b = _mm256_set1_ps(seed * 1e-7f);
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(float(i));
  for (long it = 0; it < peak_iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float t[8];
  _mm256_store_ps(t, s);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#endif

/// GFLOP/s of register-resident FMA (or vdpbf16ps) chains on every thread: the ISA's compute peak.
/// 0 where the ISA has no such loop (scalar).
double compute_peak_gflops(cpux::isa_kind isa, cpux::expert_precision prec, int threads) {
#if defined(__x86_64__)
  double flops_per_iter = 0;
  float (*fn)(float) = nullptr;
  if (isa == cpux::isa_kind::avx512bf16 && prec == cpux::expert_precision::bf16_inputs) {
    fn = &dpbf16_peak;
    flops_per_iter = 16 * 64;
  } else if (isa >= cpux::isa_kind::avx512) {
    fn = &fma_peak_avx512;
    flops_per_iter = 16 * 32;
  } else if (isa == cpux::isa_kind::avx2) {
    fn = &fma_peak_avx2;
    flops_per_iter = 12 * 16;
  } else {
    return 0;
  }
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    float sink = 0;
    const auto t0 = clock_type::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += fn(float(omp_get_thread_num()));
    const double s = seconds_since(t0);
    g_sink += std::uint64_t(sink != 0);
    best = std::max(best, double(threads) * flops_per_iter * double(peak_iters) / s / 1e9);
  }
  return best;
#else
  (void)isa, (void)prec, (void)threads;
  return 0;
#endif
}

// ---------------------------------------------------------------------------
// Weights and cases
// ---------------------------------------------------------------------------

struct model {
  std::string key, name;
  cpux::expert_shape shape;
};

const model models[] = {{"qwen3", "Qwen3-30B-A3B", {2048, 768}},
                        {"dsv2", "DeepSeek-V2-Lite", {2048, 1408}},
                        {"mixtral", "Mixtral-8x7B", {4096, 14336}}};

struct bench_case {
  std::string kind;  // decode | batched
  int experts;
  std::int64_t rows;
};

std::vector<bench_case> cases_for(const std::string& key, bool quick) {
  if (key == "mixtral") {
    if (quick) return {{"decode", 8, 1}, {"batched", 1, 512}};
    return {{"decode", 8, 1}, {"decode", 8, 2}, {"decode", 4, 16}, {"batched", 1, 64}, {"batched", 1, 512}};
  }
  if (key == "dsv2") {
    if (quick) return {{"decode", 64, 2}, {"batched", 4, 512}};
    return {{"decode", 64, 1}, {"decode", 64, 2}, {"decode", 32, 16}, {"batched", 4, 64}, {"batched", 4, 512}, {"batched", 2, 4096}};
  }
  if (quick) return {{"decode", 64, 2}, {"batched", 4, 512}};
  return {{"decode", 128, 1}, {"decode", 64, 2}, {"decode", 32, 16}, {"batched", 4, 64}, {"batched", 4, 512}, {"batched", 4, 4096}};
}

struct aligned_free {
  void operator()(void* p) const noexcept { std::free(p); }
};
template <class T>
std::unique_ptr<T[], aligned_free> alloc(std::size_t n) {
  void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
  if (!p) throw std::runtime_error("cannot allocate " + std::to_string(n * sizeof(T)) + " bytes");
  return std::unique_ptr<T[], aligned_free>(static_cast<T*>(p));
}

std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// n random bf16 of magnitude ≈ scale (first touch by the team that will read them).
void fill_bf16(std::uint16_t* w, std::size_t n, float scale, std::uint64_t seed, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) {
    const double u = double(mix(seed + i) >> 11) * 0x1.0p-53;
    w[i] = writescope::bf16::from_float(float((2 * u - 1) * scale)).bits;
  }
}

const char* prec_name(cpux::expert_precision p) { return p == cpux::expert_precision::fp32 ? "fp32" : "bf16_inputs"; }

template <class Isa>
void run_isa(std::span<const cpux::expert_task> ts, cpux::expert_shape s, cpux::expert_precision p, int threads) {
  cpux::run_experts<Isa>(ts, s, p, threads);
}

using runner = void (*)(std::span<const cpux::expert_task>, cpux::expert_shape, cpux::expert_precision, int);
runner runner_for(cpux::isa_kind k) {
  switch (k) {
    case cpux::isa_kind::avx512bf16: return &run_isa<cpux::isa::avx512bf16>;
    case cpux::isa_kind::avx512: return &run_isa<cpux::isa::avx512>;
    case cpux::isa_kind::avx2: return &run_isa<cpux::isa::avx2>;
    default: return &run_isa<cpux::isa::scalar>;
  }
}

/// GFLOP/s of the kernels' largest register tile on L1-resident data (all threads), per ISA and precision.
template <class Ops, class Tile>
double tile_l1_gflops_impl(Tile tile, int threads, double min_seconds) {
  constexpr int MR = Ops::mr_max, NR = Ops::nr(Ops::mr_max);
  constexpr std::int64_t k = 512;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::int64_t calls_total = 0;
    const auto t0 = clock_type::now();
#pragma omp parallel num_threads(threads) reduction(+ : calls_total)
    {
      std::vector<typename Ops::a_elem> a(std::size_t(MR * k));
      std::vector<std::uint16_t> b(std::size_t(NR * k));
      for (std::size_t i = 0; i < a.size(); ++i) {
        if constexpr (std::is_same_v<typename Ops::a_elem, float>)
          a[i] = float(i % 3) - 1.0f;
        else
          a[i] = std::uint16_t(0x3f80 + i % 5);
      }
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = std::uint16_t(0x3f80 + i % 7);
      const std::uint16_t* w[NR];
      for (int j = 0; j < NR; ++j) w[j] = b.data() + j * k;
      float out[MR][NR];
      std::int64_t calls = 0;
      const double budget = std::max(0.02, min_seconds / 10);
      const auto t1 = clock_type::now();
      while (seconds_since(t1) < budget) {
        for (int i = 0; i < 64; ++i) tile(a.data(), k, w, k, out);
        calls += 64;
      }
      calls_total += calls;
      g_sink += std::uint64_t(out[0][0] != 0);
    }
    const double sec = seconds_since(t0);
    best = std::max(best, double(calls_total) * 2.0 * MR * NR * k / sec / 1e9);
  }
  return best;
}

double tile_l1_gflops(cpux::isa_kind isa, cpux::expert_precision prec, int threads, double min_seconds) {
  namespace d = cpux::detail;
  constexpr int MR0 = d::k_scalar::ops::mr_max, NR0 = d::k_scalar::ops::nr(MR0);
#if defined(__x86_64__)
  constexpr int MR2 = d::k_avx2::ops::mr_max, NR2 = d::k_avx2::ops::nr(MR2);
  constexpr int MR5 = d::k_avx512::ops::mr_max, NR5 = d::k_avx512::ops::nr(MR5);
  constexpr int MRb = d::k_avx512bf16::ops::mr_max, NRb = d::k_avx512bf16::ops::nr(MRb);
  if (isa == cpux::isa_kind::avx512bf16 && prec == cpux::expert_precision::bf16_inputs)
    return tile_l1_gflops_impl<d::k_avx512bf16::ops>(&d::k_avx512bf16::tile<MRb, NRb>, threads, min_seconds);
  if (isa >= cpux::isa_kind::avx512)
    return tile_l1_gflops_impl<d::k_avx512::ops>(&d::k_avx512::tile<MR5, NR5>, threads, min_seconds);
  if (isa == cpux::isa_kind::avx2) return tile_l1_gflops_impl<d::k_avx2::ops>(&d::k_avx2::tile<MR2, NR2>, threads, min_seconds);
#endif
  (void)prec;
  return tile_l1_gflops_impl<d::k_scalar::ops>(&d::k_scalar::tile<MR0, NR0>, threads, min_seconds);
}

void write_json(const std::string& path, const json& doc) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    if (!f) throw std::runtime_error("cannot write " + tmp);
    f << doc.dump(1) << '\n';
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename " + tmp + " to " + path);
}

std::string first_line_with(const char* path, const char* key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) {
      const auto c = line.find(':');
      std::string v = c == std::string::npos ? line : line.substr(c + 1);
      v.erase(0, v.find_first_not_of(" \t"));
      return v;
    }
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  try {
    o = parse(argc, argv);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "ws_moe_bench_cpu_experts: %s\n", e.what());
    return 2;
  }
  const auto start = clock_type::now();
  if (!std::getenv("OMP_PROC_BIND"))
    std::fprintf(stderr, "note: OMP_PROC_BIND is not set; OMP_PROC_BIND=close OMP_PLACES=cores pins the threads\n");

  std::vector<cpux::isa_kind> isas;
  const cpux::isa_kind hw = cpux::detail::probe_isa();
  for (cpux::isa_kind k : {cpux::isa_kind::scalar, cpux::isa_kind::avx2, cpux::isa_kind::avx512, cpux::isa_kind::avx512bf16}) {
    if (int(k) > int(hw)) continue;
    if (!o.isas.empty() && std::find(o.isas.begin(), o.isas.end(), std::string(cpux::isa_name(k))) == o.isas.end()) continue;
    isas.push_back(k);
  }
  std::string cmd;
  for (int i = 0; i < argc; ++i) {
    if (i) cmd += ' ';
    cmd += argv[i];
  }
  json doc;
  doc["machine"] = {{"cpu_model", first_line_with("/proc/cpuinfo", "model name")},
                    {"logical_cpus", std::thread::hardware_concurrency()},
                    {"omp_proc_bind", std::getenv("OMP_PROC_BIND") ? std::getenv("OMP_PROC_BIND") : ""},
                    {"omp_places", std::getenv("OMP_PLACES") ? std::getenv("OMP_PLACES") : ""},
                    {"compiler", __VERSION__},
                    {"command", cmd}};
  doc["threads"] = o.threads;
  doc["min_seconds"] = o.min_seconds;
  doc["best_isa"] = std::string(cpux::isa_name(cpux::best_isa()));
  doc["results"] = json::array();

  // Compute ceilings per (ISA, precision), once.
  json ceil = json::object();
  std::fprintf(stderr, "[%6.1fs] compute ceilings\n", seconds_since(start));
  for (cpux::isa_kind k : isas)
    for (auto p : {cpux::expert_precision::bf16_inputs, cpux::expert_precision::fp32}) {
      const std::string key = std::string(cpux::isa_name(k)) + "/" + prec_name(p);
      ceil[key] = {{"peak_gflops", compute_peak_gflops(k, p, o.threads)},
                   {"tile_l1_gflops", tile_l1_gflops(k, p, o.threads, o.min_seconds)}};
    }
  doc["compute_ceilings"] = ceil;
  write_json(o.json_path, doc);

  struct row {
    std::string model, kind, isa, prec;
    int experts;
    std::int64_t rows;
    double ms, gbps, dram, gflops, peak;
  };
  std::vector<row> table;
  bool budget_spent = false;

  // Every model's decode cases first, then the batched ones (a --budget cut keeps the decode rows).
  for (const std::string phase : {"decode", "batched"}) {
    for (const model& m : models) {
      if (budget_spent) break;
      if (std::find(o.models.begin(), o.models.end(), m.key) == o.models.end()) continue;
      std::vector<bench_case> cs;
      for (const bench_case& c : cases_for(m.key, o.quick))
        if (c.kind == phase) cs.push_back(c);
      if (cs.empty()) continue;
      const std::int64_t H = m.shape.hidden, I = m.shape.inter;
      const std::size_t expert_elems = std::size_t(3 * H * I);
      int max_experts = 0;
      std::int64_t max_rows = 0;
      for (const auto& c : cs) {
        max_experts = std::max(max_experts, c.experts);
        max_rows = std::max<std::int64_t>(max_rows, c.rows * c.experts);
      }
      std::fprintf(stderr, "[%6.1fs] %s: %d experts of %.1f MB\n", seconds_since(start), m.name.c_str(), max_experts,
                   double(expert_elems) * 2 / 1e6);
      auto weights = alloc<std::uint16_t>(expert_elems * std::size_t(max_experts));
      fill_bf16(weights.get(), expert_elems * std::size_t(max_experts), 0.05f, 17, o.threads);
      auto x = alloc<float>(std::size_t(max_rows * H));
      auto y = alloc<float>(std::size_t(max_rows * H));
      for (std::size_t i = 0; i < std::size_t(max_rows * H); ++i) x[i] = float(int(mix(i) % 2001) - 1000) * 1e-3f;
      std::memset(y.get(), 0, std::size_t(max_rows * H) * 4);
      std::unique_ptr<std::uint64_t[], aligned_free> ceiling_buf;

      for (const auto& c : cs) {
        std::vector<cpux::expert_task> ts;
        for (int e = 0; e < c.experts; ++e) {
          const std::uint16_t* base = weights.get() + expert_elems * std::size_t(e);
          ts.push_back({{base, base + H * I, base + 2 * H * I}, x.get() + e * c.rows * H, y.get() + e * c.rows * H, c.rows});
        }
        const double weight_bytes = double(expert_elems) * 2 * c.experts;
        const double flops = 2.0 * 3.0 * double(H) * double(I) * double(c.rows) * c.experts;
        double dram = 0;
        if (c.kind == "decode") {
          const std::size_t bytes = std::size_t(weight_bytes) / 4096 * 4096;
          if (!ceiling_buf) {
            const std::size_t words = expert_elems * std::size_t(max_experts) * 2 / 8;
            ceiling_buf = alloc<std::uint64_t>(words);
  #pragma omp parallel for schedule(static) num_threads(o.threads)
            for (std::size_t i = 0; i < words; ++i) ceiling_buf[i] = i;
          }
          dram = cpux::dram_read_gbps(ceiling_buf.get(), bytes, o.threads, 5);
        }
        struct variant {
          cpux::isa_kind isa;
          cpux::expert_precision prec;
          bool prefetch;
        };
        std::vector<variant> vs;
        for (cpux::isa_kind k : isas) {
          if (c.kind == "batched" && k == cpux::isa_kind::scalar && !o.scalar_batched) continue;
          for (auto p : {cpux::expert_precision::bf16_inputs, cpux::expert_precision::fp32}) vs.push_back({k, p, true});
        }
        // The decode streaming without the software prefetch, for the best ISA (A/B of that choice).
        if (c.kind == "decode" && !isas.empty()) vs.push_back({isas.back(), cpux::expert_precision::bf16_inputs, false});
        for (const variant& v : vs) {
          {
            const cpux::isa_kind k = v.isa;
            const cpux::expert_precision p = v.prec;
            if (o.budget_seconds > 0 && seconds_since(start) > o.budget_seconds) {
              budget_spent = true;
              break;
            }
            cpux::detail::tuning().prefetch = v.prefetch;
            const runner run = runner_for(k);
            run(ts, m.shape, p, o.threads);  // warm-up (workspace, pages, caches)
            std::vector<double> secs;
            const auto t0 = clock_type::now();
            while (secs.size() < 3 || seconds_since(t0) < o.min_seconds) {
              const auto t1 = clock_type::now();
              run(ts, m.shape, p, o.threads);
              secs.push_back(seconds_since(t1));
              if (secs.size() >= 1000) break;
            }
            std::vector<double> sorted = secs;
            std::sort(sorted.begin(), sorted.end());
            const double best = sorted.front(), med = sorted[sorted.size() / 2];
            const std::string ck = std::string(cpux::isa_name(k)) + "/" + prec_name(p);
            const double peak = ceil[ck]["peak_gflops"].get<double>();
            const double tile = ceil[ck]["tile_l1_gflops"].get<double>();
            cpux::detail::tuning().prefetch = true;
            row r{m.key, c.kind, std::string(cpux::isa_name(k)), std::string(prec_name(p)) + (v.prefetch ? "" : "/nopf"),
                  c.experts, c.rows, best * 1e3, weight_bytes / best / 1e9, dram, flops / best / 1e9, peak};
            table.push_back(r);
            json jr = {{"model", m.name},
                       {"hidden", H},
                       {"inter", I},
                       {"kind", c.kind},
                       {"experts", c.experts},
                       {"rows_per_expert", c.rows},
                       {"isa", r.isa},
                       {"precision", prec_name(p)},
                       {"prefetch", v.prefetch},
                       {"calls", secs.size()},
                       {"seconds_best", best},
                       {"seconds_median", med},
                       {"weight_bytes", weight_bytes},
                       {"weights_gbps", r.gbps},
                       {"gflops", r.gflops},
                       {"compute_peak_gflops", peak},
                       {"tile_l1_gflops", tile},
                       {"ratio_compute", peak > 0 ? json(r.gflops / peak) : json(nullptr)},
                       {"ratio_tile_l1", tile > 0 ? json(r.gflops / tile) : json(nullptr)}};
            if (c.kind == "decode") {
              jr["dram_read_ceiling_gbps"] = dram;
              jr["ratio_dram"] = r.gbps / dram;
            }
            doc["results"].push_back(jr);
            write_json(o.json_path, doc);
            std::fprintf(stderr, "[%6.1fs] %-7s %-7s %3d x %4lld  %-10s %-16s %9.3f ms %7.1f GB/s %8.1f GFLOP/s\n",
                         seconds_since(start), m.key.c_str(), c.kind.c_str(), c.experts, (long long)c.rows, r.isa.c_str(),
                         r.prec.c_str(), r.ms, r.gbps, r.gflops);
          }
          if (budget_spent) break;
        }
        if (budget_spent) break;
      }
      if (budget_spent) break;
    }
  }
  if (budget_spent) {
    std::fprintf(stderr, "budget of %.0f s spent: the remaining cases were skipped\n", o.budget_seconds);
    doc["budget_spent"] = true;
    write_json(o.json_path, doc);
  }

  std::printf("\nws_moe_bench_cpu_experts: %d threads, best of >= 3 calls; decode vs the same-run DRAM read ceiling,\n"
              "batched vs the ISA's register FMA / vdpbf16ps peak (compute ceilings: JSON compute_ceilings)\n",
              o.threads);
  std::printf("%-8s %-8s %8s %-11s %-16s %10s %8s %8s %6s %9s %9s %6s\n", "model", "kind", "exp×rows", "isa", "precision",
              "ms", "GB/s", "ceil", "ratio", "GFLOP/s", "peak", "ratio");
  for (const row& r : table) {
    char er[32];
    std::snprintf(er, sizeof er, "%dx%lld", r.experts, (long long)r.rows);
    std::printf("%-8s %-8s %8s %-11s %-16s %10.3f %8.1f ", r.model.c_str(), r.kind.c_str(), er, r.isa.c_str(), r.prec.c_str(),
                r.ms, r.gbps);
    if (r.kind == "decode")
      std::printf("%8.1f %6.2f ", r.dram, r.gbps / r.dram);
    else
      std::printf("%8s %6s ", "-", "-");
    if (r.peak > 0)
      std::printf("%9.1f %9.1f %6.2f\n", r.gflops, r.peak, r.gflops / r.peak);
    else
      std::printf("%9.1f %9s %6s\n", r.gflops, "-", "-");
  }
  return g_sink == 42 ? 1 : 0;
}
