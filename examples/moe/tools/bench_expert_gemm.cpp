// SPDX-License-Identifier: Apache-2.0
// ws_moe_bench_expert_gemm — a prefill MoE layer's routed-expert GEMMs on the
// device, issued the ways ws_decode can issue them, against a dense GEMM of
// the same FLOPs in the same run.
//
// One wave of `tokens` tokens routes tokens * top_k (token, expert) pairs
// over the model's experts (uniformly, or with expert popularity following a
// Zipf law, --zipf S). Expert e then has rows_e packed input rows and
//   gate_e = X_e · W_gate,eᵀ   [rows_e][I]   (X_e [rows_e][H] bf16, W [I][H] bf16)
//   up_e   = X_e · W_up,eᵀ     [rows_e][I]
//   y_e    = A_e · W_down,eᵀ   [rows_e][H]   (A_e [rows_e][I] bf16)
// with fp32 accumulation and fp32 outputs (the decoders' precision);
// 6 * H * I * sum(rows_e) useful FLOPs. The SiLU between them is not timed.
//
// Implementations (rows of the table; --impls):
//   dense        three cublasGemmEx of n = sum(rows_e) columns on one expert's
//                weights: the dense-GEMM rate for the same FLOPs (the ceiling
//                of the "grouped expert GEMMs >= 0.8 of dense" target)
//   batched_lt   ws_decode's --prefill-expert-gemm batched: rows padded up the
//                ladder (gemm.hpp ladder_rows, pad 64), one pointer-array
//                batched cuBLASLt GEMM per group of equal padded rows and
//                matrix, the algorithm chosen once per shape class
//                (lt_batched_gemm.hpp; rate counts the useful rows only)
//   batched      the same groups in power-of-two counts through
//                cublasGemmBatchedEx (its heuristic runs for every new shape:
//                see the first-issue host time)
//   grouped      ws_decode's --prefill-expert-gemm grouped: one
//                cublasGemmGroupedBatchedEx per matrix, exact rows
//   per_expert   three cublasGemmEx per expert with rows
// For each: median GPU seconds of --reps runs (CUDA events), the median host
// seconds to issue one run (the calls return before the GPU finishes: when
// this is near the GPU time, the host cannot keep the GPU fed), the host
// seconds of the first issue (shapes not seen before), TFLOP/s,
// fraction of dense, and a spot check of a few output elements of every
// matrix against the host in double (|err| relative to the output scale).
//
//   ws_moe_bench_expert_gemm --json expert_gemm.json
//   ws_moe_bench_expert_gemm --models qwen3 --tokens 32768,8192 --zipf 0.8
//
// Exit status 1 when a spot check fails; an implementation cuBLAS refuses
// gives a row with supported false and the status.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <writescope/cuda/cuda_error.hpp>

#include "bench_cuda.hpp"
#include "ws_moe/gpu/gemm.hpp"
#include "ws_moe/gpu/kernel_math.hpp"
#include "ws_moe/gpu/lt_batched_gemm.hpp"

namespace gpu = ws_moe::gpu;
using gpu::idx;
using json = nlohmann::json;
using namespace ws_moe::bench;

namespace {

struct moe_shape {
  std::string name;
  int experts, top_k, hidden, inter;
};

constexpr moe_shape all_models[] = {
    {"qwen3", 128, 8, 2048, 768},    // Qwen3-30B-A3B
    {"mixtral", 8, 2, 4096, 14336},  // Mixtral-8x7B
    {"dsv2", 64, 6, 2048, 1408},     // DeepSeek-V2-Lite (routed experts)
};

/// Rows per expert of one wave: every token picks top_k distinct experts,
/// with probability proportional to 1 / (rank + 1)^zipf over a random
/// permutation of the experts (zipf 0: uniform).
std::vector<int> route(const moe_shape& m, int tokens, double zipf, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> perm(std::size_t(m.experts));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<double> w(std::size_t(m.experts));
  for (int r = 0; r < m.experts; ++r) w[std::size_t(perm[std::size_t(r)])] = 1.0 / std::pow(double(r + 1), zipf);
  std::vector<int> rows(std::size_t(m.experts), 0);
  std::vector<double> left(w.size());
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int t = 0; t < tokens; ++t) {
    left = w;
    double total = std::accumulate(left.begin(), left.end(), 0.0);
    for (int s = 0; s < m.top_k; ++s) {  // sample without replacement
      double x = u(rng) * total;
      int e = 0;
      while (e + 1 < m.experts && (x -= left[std::size_t(e)]) >= 0) ++e;
      if (left[std::size_t(e)] == 0.0)  // rounding at the end of the range: the last expert still available
        for (e = m.experts - 1; left[std::size_t(e)] == 0.0; --e) {}
      ++rows[std::size_t(e)];
      total -= left[std::size_t(e)];
      left[std::size_t(e)] = 0.0;
    }
  }
  return rows;
}

/// One model's device data: every expert's three matrices, the packed bf16
/// inputs, fp32 outputs, and the host copies the spot check reads.
struct layer_data {
  const moe_shape& m;
  idx rows_cap;  // packed rows incl. the ladder's padding
  device_buffer<std::uint16_t> w_gate, w_up, w_down, x, a;
  device_buffer<float> g, u, y;
  std::vector<std::uint16_t> h_gate0, h_up0, h_down0, h_x, h_a;  // expert 0's weights (every expert gets them), inputs

  layer_data(const moe_shape& s, idx cap)
      : m(s), rows_cap(cap),
        w_gate(std::size_t(s.experts) * s.inter * s.hidden), w_up(w_gate_size()), w_down(w_gate_size()),
        x(std::size_t(cap) * s.hidden), a(std::size_t(cap) * s.inter),
        g(std::size_t(cap) * s.inter), u(std::size_t(cap) * s.inter), y(std::size_t(cap) * s.hidden) {
    const std::size_t wsz = std::size_t(s.inter) * s.hidden;
    h_gate0 = random_bf16(wsz, 21);
    h_up0 = random_bf16(wsz, 22);
    h_down0 = random_bf16(wsz, 23);
    h_x = random_bf16(std::size_t(cap) * s.hidden, 24);
    h_a = random_bf16(std::size_t(cap) * s.inter, 25);
    for (int e = 0; e < s.experts; ++e) {  // the same values in every expert: only addresses differ
      WS_CUDA_TRY(cudaMemcpy(w_gate.p + e * wsz, h_gate0.data(), wsz * 2, cudaMemcpyHostToDevice));
      WS_CUDA_TRY(cudaMemcpy(w_up.p + e * wsz, h_up0.data(), wsz * 2, cudaMemcpyHostToDevice));
      WS_CUDA_TRY(cudaMemcpy(w_down.p + e * wsz, h_down0.data(), wsz * 2, cudaMemcpyHostToDevice));
    }
    WS_CUDA_TRY(cudaMemcpy(x.p, h_x.data(), h_x.size() * 2, cudaMemcpyHostToDevice));
    WS_CUDA_TRY(cudaMemcpy(a.p, h_a.data(), h_a.size() * 2, cudaMemcpyHostToDevice));
  }
  std::size_t w_gate_size() const { return std::size_t(m.experts) * m.inter * m.hidden; }
  const std::uint16_t* wg(int e) const { return w_gate.p + std::size_t(e) * m.inter * m.hidden; }
  const std::uint16_t* wu(int e) const { return w_up.p + std::size_t(e) * m.inter * m.hidden; }
  const std::uint16_t* wd(int e) const { return w_down.p + std::size_t(e) * m.inter * m.hidden; }
};

/// The packed layout of one implementation: expert e's rows start at first[e]
/// and there are rows[e] of them (useful), padded[e] with padding.
struct packing {
  std::vector<idx> first, padded;
};

packing pack(const std::vector<int>& rows, bool ladder) {
  packing p;
  idx at = 0;
  for (int r : rows) {
    const idx pr = ladder && r > 0 ? gpu::ladder_rows(r, 64) : r;
    p.first.push_back(at);
    p.padded.push_back(pr);
    at += pr;
  }
  p.first.push_back(at);
  return p;
}

/// The output scale of each matrix's spot check: an element is a sum of K
/// products of unit-variance values, so of size ~sqrt(K).
double spot_check(const layer_data& d, const std::vector<int>& rows, const packing& p) {
  const moe_shape& m = d.m;
  double worst = 0;
  std::vector<float> got(1);
  auto at = [](const std::vector<std::uint16_t>& v, std::size_t i) { return double(gpu::bf16_to_float(v[i])); };
  for (int e = 0; e < m.experts; ++e) {
    if (rows[std::size_t(e)] == 0 || (e % 17 != 0 && e != m.experts - 1)) continue;  // a few experts
    for (int r : {0, rows[std::size_t(e)] - 1}) {
      const idx row = p.first[std::size_t(e)] + r;
      for (int which = 0; which < 3; ++which) {
        const int out = which == 2 ? m.hidden : m.inter, in = which == 2 ? m.inter : m.hidden;
        const std::vector<std::uint16_t>& w = which == 0 ? d.h_gate0 : which == 1 ? d.h_up0 : d.h_down0;
        const std::vector<std::uint16_t>& xin = which == 2 ? d.h_a : d.h_x;
        const float* dev = which == 0 ? d.g.p : which == 1 ? d.u.p : d.y.p;
        for (int o : {0, out / 2, out - 1}) {
          double ref = 0;
          for (int l = 0; l < in; ++l) ref += at(xin, std::size_t(row * in + l)) * at(w, std::size_t(idx(o) * in + l));
          WS_CUDA_TRY(cudaMemcpy(got.data(), dev + row * out + o, 4, cudaMemcpyDeviceToHost));
          const double err = std::fabs(double(got[0]) - ref) / std::sqrt(double(in));
          worst = std::isnan(err) ? 1e30 : std::max(worst, err);
        }
      }
    }
  }
  return worst;
}

struct impl_result {
  bool supported = true;
  std::string refusal;
  double gpu_seconds = 0, host_issue_seconds = 0;
  double first_issue_seconds = 0;  ///< host seconds of the first (untimed) issue: new shapes' heuristics included
};

/// Times `issue` (enqueues one run on the handle's stream): GPU seconds with
/// events, host seconds of the issuing itself.
impl_result time_impl(const std::function<cublasStatus_t()>& issue, cudaStream_t stream, int warmup, int reps) {
  impl_result r;
  const auto t_first = std::chrono::steady_clock::now();
  const cublasStatus_t s0 = issue();
  r.first_issue_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_first).count();
  if (s0 != CUBLAS_STATUS_SUCCESS) {
    r.supported = false;
    r.refusal = "cuBLAS status " + std::to_string(int(s0));
    WS_CUDA_TRY(cudaStreamSynchronize(stream));
    return r;
  }
  std::vector<double> host;
  const std::vector<double> gpu_s = time_runs(
      [&] {
        const auto t0 = std::chrono::steady_clock::now();
        cublas_check(issue(), "issue");
        host.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      },
      warmup, reps, stream);
  r.gpu_seconds = median(gpu_s);
  r.host_issue_seconds = median(host);
  return r;
}

}  // namespace

int main(int argc, char** argv) try {
  CLI::App app{"ws_moe_bench_expert_gemm: a prefill MoE layer's expert GEMMs (batched, grouped, per expert) "
               "against a dense GEMM of the same FLOPs"};
  int reps = 10, warmup = 3;
  double zipf = 0.0;
  std::string json_path;
  std::vector<std::string> model_names = {"qwen3", "mixtral", "dsv2"};
  std::vector<int> token_counts = {32768, 8192, 2048};
  std::vector<std::string> impl_names = {"dense", "batched_lt", "batched", "grouped", "per_expert"};
  app.add_option("--reps", reps, "timed runs per implementation")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--warmup", warmup, "untimed runs first")->check(CLI::Range(0, 1000))->capture_default_str();
  app.add_option("--zipf", zipf, "expert popularity exponent (0: uniform routing)")->check(CLI::Range(0.0, 4.0))->capture_default_str();
  app.add_option("--models", model_names, "qwen3, mixtral, dsv2")->delimiter(',')
      ->check(CLI::IsMember({"qwen3", "mixtral", "dsv2"}))->capture_default_str();
  app.add_option("--tokens", token_counts, "tokens per wave")->delimiter(',')->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--impls", impl_names, "dense, batched_lt, batched, grouped, per_expert")->delimiter(',')
      ->check(CLI::IsMember({"dense", "batched_lt", "batched", "grouped", "per_expert"}))->capture_default_str();
  app.add_option("--json", json_path, "write the results here (rewritten after every row)");
  CLI11_PARSE(app, argc, argv);
  auto wants = [&](const char* n) { return std::find(impl_names.begin(), impl_names.end(), n) != impl_names.end(); };

  cudaDeviceProp prop{};
  WS_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  json doc = {{"benchmark", "expert_gemm"},
              {"device", {{"name", prop.name}, {"sm_count", prop.multiProcessorCount}}},
              {"flop_count", "6 * hidden * inter * sum(rows_e) (gate, up, down; useful rows only)"},
              {"zipf", zipf}, {"reps", reps}, {"warmup", warmup}, {"rows", json::array()}};
  const auto save = [&] {
    if (json_path.empty()) return;
    std::ofstream f(json_path);
    f << doc.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write " + json_path);
  };
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  doc["ceiling"] = gemm_ceiling(8192, warmup, std::max(reps, 5));
  std::printf("ceiling: cuBLAS bf16 GEMM 8192^3, fp32 out: %.1f TFLOP/s\n", doc["ceiling"]["tflops"].get<double>());
  save();

  cudaStream_t stream = nullptr;
  WS_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t h = nullptr;
  cublas_check(cublasCreate(&h), "cublasCreate");
  cublas_check(cublasSetStream(h, stream), "cublasSetStream");
  const float one = 1.0f, zero = 0.0f;
  bool spot_ok = true;
  struct line {
    std::string text;
  };
  std::vector<line> table;

  for (const std::string& name : model_names) {
    const moe_shape& m = *std::find_if(std::begin(all_models), std::end(all_models), [&](const moe_shape& s) { return s.name == name; });
    const int maxT = *std::max_element(token_counts.begin(), token_counts.end());
    const idx cap = idx(maxT) * m.top_k + idx(m.experts) * 64 + idx(maxT) * m.top_k / 8;
    layer_data d(m, cap);
    const idx H = m.hidden, I = m.inter;
    for (int T : token_counts) {
      const std::vector<int> rows = route(m, T, zipf, 1000 + std::uint64_t(T));
      const idx useful = std::accumulate(rows.begin(), rows.end(), idx(0));
      const double flops = 6.0 * double(H) * double(I) * double(useful);
      int active = 0, most = 0;
      for (int r : rows) {
        active += r > 0;
        most = std::max(most, r);
      }
      const json shape = {{"model", m.name}, {"experts", m.experts}, {"top_k", m.top_k}, {"hidden", H}, {"inter", I},
                          {"tokens", T}, {"rows", useful}, {"active_experts", active}, {"most_rows", most},
                          {"flops", flops}, {"rows_per_expert", rows}};
      double dense_tflops = 0;
      // C (out x n) = W (in x out, transposed) . X (in x n): linear_desc's column-major form
      auto gemm = [&](const void* w, int out, int in, const void* xin, idx n, float* c) {
        return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, out, int(n), in, &one, w, CUDA_R_16BF, in, xin, CUDA_R_16BF, in,
                            &zero, c, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      };
      auto record = [&](const char* impl, const impl_result& r, const packing* p, idx padded_rows, int calls) {
        json row = shape;
        row.update({{"impl", impl}, {"supported", r.supported}, {"calls_per_run", calls}});
        char buf[256];
        if (!r.supported) {
          row["refusal"] = r.refusal;
          std::snprintf(buf, sizeof buf, "%-8s %6d %-11s refused: %s", m.name.c_str(), T, impl, r.refusal.c_str());
        } else {
          const double tflops = flops / r.gpu_seconds * 1e-12;
          if (std::string(impl) == "dense") dense_tflops = tflops;
          const double spot = p != nullptr ? spot_check(d, rows, *p) : 0.0;
          const bool ok = spot <= 1e-3;
          spot_ok = spot_ok && ok;
          row.update({{"gpu_seconds", r.gpu_seconds}, {"host_issue_seconds", r.host_issue_seconds},
                      {"first_issue_seconds", r.first_issue_seconds}, {"tflops", tflops},
                      {"fraction_of_dense", dense_tflops > 0 ? tflops / dense_tflops : 0.0},
                      {"padded_rows", padded_rows}, {"spot_max_err", spot}, {"spot_ok", ok}});
          std::snprintf(buf, sizeof buf, "%-8s %6d %-11s %8.3f ms  host %7.3f ms (first %7.2f ms)  %6.1f TFLOP/s  %5.2f of dense%s",
                        m.name.c_str(), T, impl, r.gpu_seconds * 1e3, r.host_issue_seconds * 1e3,
                        r.first_issue_seconds * 1e3, tflops,
                        dense_tflops > 0 ? tflops / dense_tflops : 0.0, ok ? "" : "  SPOT CHECK FAILED");
        }
        std::printf("%s\n", buf);
        std::fflush(stdout);
        table.push_back({buf});
        doc["rows"].push_back(row);
        save();
      };

      if (wants("dense")) {
        const impl_result r = time_impl(
            [&] {
              cublasStatus_t s = gemm(d.wg(0), int(I), int(H), d.x.p, useful, d.g.p);
              if (s == CUBLAS_STATUS_SUCCESS) s = gemm(d.wu(0), int(I), int(H), d.x.p, useful, d.u.p);
              if (s == CUBLAS_STATUS_SUCCESS) s = gemm(d.wd(0), int(H), int(I), d.a.p, useful, d.y.p);
              return s;
            },
            stream, warmup, reps);
        record("dense", r, nullptr, useful, 3);
      }
      if (wants("per_expert")) {
        const packing p = pack(rows, false);
        int calls = 0;
        const impl_result r = time_impl(
            [&] {
              calls = 0;
              for (int e = 0; e < m.experts; ++e) {
                const idx n = rows[std::size_t(e)], r0 = p.first[std::size_t(e)];
                if (n == 0) continue;
                cublasStatus_t s = gemm(d.wg(e), int(I), int(H), d.x.p + r0 * H, n, d.g.p + r0 * I);
                if (s == CUBLAS_STATUS_SUCCESS) s = gemm(d.wu(e), int(I), int(H), d.x.p + r0 * H, n, d.u.p + r0 * I);
                if (s == CUBLAS_STATUS_SUCCESS) s = gemm(d.wd(e), int(H), int(I), d.a.p + r0 * I, n, d.y.p + r0 * H);
                if (s != CUBLAS_STATUS_SUCCESS) return s;
                calls += 3;
              }
              return CUBLAS_STATUS_SUCCESS;
            },
            stream, warmup, reps);
        record("per_expert", r, &p, useful, calls);
      }
      // Pointer tables for batched and grouped: per matrix, [W][X][C] per item.
      auto upload_tables = [&](const std::vector<const void*>& host) {
        auto dev = std::make_unique<device_buffer<const void*>>(host.size());
        WS_CUDA_TRY(cudaMemcpy(dev->p, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
        return dev;
      };
      // The padded groups of the batched issues: experts of equal padded rows
      // (all of them, or the largest power-of-two count at a time), and their
      // pointer tables [9][count] per group (gate W X G, up W X U, down W A Y).
      struct group {
        idx rows;
        int count;
        std::size_t first;
      };
      auto padded_groups = [&](const packing& p, bool pow2_counts, std::vector<const void*>& tab) {
        std::vector<int> order;
        for (int e = 0; e < m.experts; ++e)
          if (rows[std::size_t(e)] > 0) order.push_back(e);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p.padded[std::size_t(a)] < p.padded[std::size_t(b)]; });
        std::vector<group> groups;
        for (std::size_t i = 0; i < order.size();) {
          std::size_t j = i;
          while (j < order.size() && p.padded[std::size_t(order[j])] == p.padded[std::size_t(order[i])]) ++j;
          if (pow2_counts) {
            std::size_t c = 1;
            while (2 * c <= j - i) c *= 2;
            j = i + c;
          }
          groups.push_back({p.padded[std::size_t(order[i])], int(j - i), tab.size()});
          for (int t = 0; t < 9; ++t)
            for (std::size_t q = i; q < j; ++q) {
              const int e = order[q];
              const idx r0 = p.first[std::size_t(e)];
              const void* ptr[9] = {d.wg(e), d.x.p + r0 * H, d.g.p + r0 * I, d.wu(e), d.x.p + r0 * H,
                                    d.u.p + r0 * I,  d.wd(e), d.a.p + r0 * I, d.y.p + r0 * H};
              tab.push_back(ptr[t]);
            }
          i = j;
        }
        return groups;
      };
      // Times one padded-group issue: `issue(g, out, in, a, b, c)` enqueues group
      // g's product of one matrix (a, b, c: its pointer tables).
      auto time_padded = [&](const char* impl, bool pow2_counts, const auto& issue) {
        const packing p = pack(rows, true);
        std::vector<const void*> tab;
        const std::vector<group> groups = padded_groups(p, pow2_counts, tab);
        const auto dev = upload_tables(tab);
        const void* const* T0 = dev->p;
        const impl_result r = time_impl(
            [&] {
              for (int t : {0, 3, 6}) {
                const int out = t == 6 ? int(H) : int(I), in = t == 6 ? int(I) : int(H);
                for (const group& g : groups) {
                  const void* const* base = T0 + g.first;
                  const cublasStatus_t s = issue(g, out, in, base + std::size_t(t) * g.count,
                                                 base + std::size_t(t + 1) * g.count,
                                                 const_cast<void* const*>(base + std::size_t(t + 2) * g.count));
                  if (s != CUBLAS_STATUS_SUCCESS) return s;
                }
              }
              return CUBLAS_STATUS_SUCCESS;
            },
            stream, warmup, reps);
        record(impl, r, &p, p.first.back(), 3 * int(groups.size()));
      };
      if (wants("batched_lt")) {
        gpu::lt_batched_gemm lt;
        time_padded("batched_lt", false,
                    [&](const group& g, int out, int in, const void* const* a, const void* const* b, void* const* c) {
                      lt.run(true, false, out, int(g.rows), in, CUDA_R_16BF, a, in, b, in,
                             reinterpret_cast<float* const*>(c), out, g.count, stream);
                      return CUBLAS_STATUS_SUCCESS;
                    });
      }
      if (wants("batched"))
        time_padded("batched", true,
                    [&](const group& g, int out, int in, const void* const* a, const void* const* b, void* const* c) {
                      return cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, out, int(g.rows), in, &one, a, CUDA_R_16BF,
                                                 in, b, CUDA_R_16BF, in, &zero, c, CUDA_R_32F, out, g.count,
                                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
                    });
      if (wants("grouped")) {
        const packing p = pack(rows, false);
        std::vector<int> order;
        for (int e = 0; e < m.experts; ++e)
          if (rows[std::size_t(e)] > 0) order.push_back(e);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rows[std::size_t(a)] < rows[std::size_t(b)]; });
        std::vector<int> n, count;
        for (std::size_t i = 0; i < order.size();) {
          std::size_t j = i;
          while (j < order.size() && rows[std::size_t(order[j])] == rows[std::size_t(order[i])]) ++j;
          n.push_back(rows[std::size_t(order[i])]);
          count.push_back(int(j - i));
          i = j;
        }
        std::vector<const void*> tab;
        for (int t = 0; t < 9; ++t)
          for (const int e : order) {
            const idx r0 = p.first[std::size_t(e)];
            const void* ptr[9] = {d.wg(e), d.x.p + r0 * H, d.g.p + r0 * I, d.wu(e), d.x.p + r0 * H,
                                  d.u.p + r0 * I,  d.wd(e), d.a.p + r0 * I, d.y.p + r0 * H};
            tab.push_back(ptr[t]);
          }
        const auto dev = upload_tables(tab);
        const void* const* T0 = dev->p;
        const std::size_t G = n.size(), A = order.size();
        const std::vector<cublasOperation_t> ta(G, CUBLAS_OP_T), tb(G, CUBLAS_OP_N);
        const std::vector<float> alpha(G, 1.0f), beta(G, 0.0f);
        const impl_result r = time_impl(
            [&] {
              for (int t : {0, 3, 6}) {
                const int out = t == 6 ? int(H) : int(I), in = t == 6 ? int(I) : int(H);
                const std::vector<int> mm(G, out), kk(G, in), ld_in(G, in), ld_out(G, out);
                const cublasStatus_t s = cublasGemmGroupedBatchedEx(
                    h, ta.data(), tb.data(), mm.data(), n.data(), kk.data(), alpha.data(), T0 + std::size_t(t) * A,
                    CUDA_R_16BF, ld_in.data(), T0 + std::size_t(t + 1) * A, CUDA_R_16BF, ld_in.data(), beta.data(),
                    const_cast<void* const*>(T0 + std::size_t(t + 2) * A), CUDA_R_32F, ld_out.data(), int(G), count.data(),
                    CUBLAS_COMPUTE_32F);
                if (s != CUBLAS_STATUS_SUCCESS) return s;
              }
              return CUBLAS_STATUS_SUCCESS;
            },
            stream, warmup, reps);
        record("grouped", r, &p, useful, 3);
      }
    }
  }
  cublas_check(cublasDestroy(h), "cublasDestroy");
  WS_CUDA_TRY(cudaStreamDestroy(stream));
  std::printf("\nprefill MoE expert GEMMs (bf16 in, fp32 out) on %s, zipf %.2f; ceiling %.1f TFLOP/s\n", prop.name, zipf,
              doc["ceiling"]["tflops"].get<double>());
  for (const line& l : table) std::printf("%s\n", l.text.c_str());
  return spot_ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ws_moe_bench_expert_gemm: %s\n", e.what());
  return 2;
}
