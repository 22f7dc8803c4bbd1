// SPDX-License-Identifier: Apache-2.0
// ws_moe_bench_flash_prefill — the causal prefill attention kernel
// (ws_moe/gpu/flash_prefill.cu, launch_flash_prefill) on the attention shapes
// of Qwen3-30B-A3B (32 query heads over 4 KV heads, d 128), Mixtral-8x7B
// (32 over 8, d 128) and DeepSeek-V2-Lite's non-absorbed MLA prefill (16 over
// 16, dqk 192 = 128 nope + 64 rope, dv 128), each at 4 x 32768, 8 x 8192 and
// 32 x 2048 tokens (equal-length sequences in one ragged call).
//
// Reported per case: median and best seconds of --reps timed launches (CUDA
// events around each launch, after --warmup untimed ones) and TFLOP/s counting
//   2 * (dqk + dv) * hq * sum over sequences of T (T + 1) / 2
// (the causal products only), next to the same-run ceiling: a cuBLAS bf16 GEMM
// 8192^3 (CUBLAS_COMPUTE_32F, fp32 output, the kernel's precision) — its
// median TFLOP/s, and each case's fraction of it. A spot check compares a few
// rows of every case with a host fp64 computation (spot_max_err, relative to
// max|v|) so that a fast wrong kernel does not pass unnoticed.
//
// Built with WS_MOE_HAVE_CUDNN (CMake found cuDNN and cudnn-frontend), each
// case also runs cuDNN's fused SDPA (ws_moe/gpu/cudnn_prefill.hpp: ragged
// layout, padding + causal masks, bf16 out) on the same inputs: a row with
// impl "cudnn_sdpa", its TFLOP/s, vs_ws_flash_prefill (its TFLOP/s over
// ours) and its own spot check (bf16 out: 8e-3 instead of 4e-3). A shape cuDNN
// refuses gives a row with supported false and cuDNN's reason; a machine
// without a loadable cuDNN gives "cudnn": {"available": false, "reason": ...}.
// The plan is built before the timed runs; its workspace is allocated once per
// case.
//
// Inputs: q, k, v random bf16 (unit variance, scale 1/sqrt(dqk)) in the
// decoders' layout [tokens][heads][d], dense; out fp32 [tokens][hq][dv]; no
// lse. One allocation per model at its largest token count, reused.
//
//   ws_moe_bench_flash_prefill --json flash_prefill.json
//
// Options: --reps N (10), --warmup N (2), --models LIST (qwen3,mixtral,dsv2),
// --shapes LIST (4x32768,8x8192,32x2048), --json FILE (rewritten after every
// case), --impls LIST (ws,cudnn: which implementations run; cudnn only with
// WS_MOE_HAVE_CUDNN). The table is printed last. Exit status 1 when a spot
// check fails.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <writescope/cuda/cuda_error.hpp>

#include "ws_moe/gpu/flash_prefill_launch.hpp"
#if defined(WS_MOE_HAVE_CUDNN)
#  include "ws_moe/gpu/cudnn_prefill.hpp"
#endif
#include "ws_moe/gpu/kernel_math.hpp"
#include "bench_cuda.hpp"

namespace gpu = ws_moe::gpu;
using gpu::idx;
using json = nlohmann::json;
using namespace ws_moe::bench;

namespace {

struct model_shape {
  std::string name;
  int hq, hkv, dqk, dv;
};
struct batch_shape {
  int sequences, tokens_per_sequence;
};

/// Max over a few (sequence, head, row) of |device - fp64| / max|v|; the
/// device rows are read from p.out (fp32), or from out_bf16 when it is given
/// (same strides).
double spot_check(const gpu::flash_prefill_params& p, const std::vector<int>& offsets, const std::vector<std::uint16_t>& q,
                  const std::vector<std::uint16_t>& k, const std::vector<std::uint16_t>& v,
                  const std::uint16_t* out_bf16 = nullptr) {
  const int seqs = int(offsets.size()) - 1;
  const int group = p.hq / p.hkv;
  double vmax = 0;
  for (std::uint16_t x : v) vmax = std::max(vmax, double(std::fabs(gpu::bf16_to_float(x))));
  double worst = 0;
  std::vector<float> row(std::size_t(p.dv));
  const auto at = [](const std::vector<std::uint16_t>& x, idx i) { return double(gpu::bf16_to_float(x[std::size_t(i)])); };
  for (int s : {0, seqs - 1})
    for (int h : {0, p.hq - 1}) {
      const int start = offsets[std::size_t(s)], len = offsets[std::size_t(s) + 1] - start;
      for (int t : {0, len / 2, len - 1}) {
        const idx tok = start + t;
        const int g = h / group;
        std::vector<double> w(std::size_t(t) + 1);
        double mx = -1e300, sum = 0;
        for (int j = 0; j <= t; ++j) {
          double d = 0;
          for (int e = 0; e < p.dqk; ++e)
            d += at(q, tok * p.q_token_stride + idx(h) * p.q_head_stride + e) *
                 at(k, idx(start + j) * p.k_token_stride + idx(g) * p.k_head_stride + e);
          w[std::size_t(j)] = d * p.scale;
          mx = std::max(mx, w[std::size_t(j)]);
        }
        for (double& x : w) sum += (x = std::exp(x - mx));
        if (out_bf16 != nullptr) {
          std::vector<std::uint16_t> raw(std::size_t(p.dv));
          WS_CUDA_TRY(cudaMemcpy(raw.data(), out_bf16 + tok * p.o_token_stride + idx(h) * p.o_head_stride,
                                 std::size_t(p.dv) * 2, cudaMemcpyDeviceToHost));
          for (int e = 0; e < p.dv; ++e) row[std::size_t(e)] = gpu::bf16_to_float(raw[std::size_t(e)]);
        } else {
          WS_CUDA_TRY(cudaMemcpy(row.data(), p.out + tok * p.o_token_stride + idx(h) * p.o_head_stride,
                                 std::size_t(p.dv) * 4, cudaMemcpyDeviceToHost));
        }
        for (int e = 0; e < p.dv; ++e) {
          double ref = 0;
          for (int j = 0; j <= t; ++j) ref += w[std::size_t(j)] * at(v, idx(start + j) * p.v_token_stride + idx(g) * p.v_head_stride + e);
          ref /= sum;
          const double err = std::fabs(double(row[std::size_t(e)]) - ref) / vmax;
          worst = std::isnan(err) ? 1e30 : std::max(worst, err);
        }
      }
    }
  return worst;
}

}  // namespace

int main(int argc, char** argv) try {
  int reps = 10, warmup = 2;
  std::string json_path;
  std::vector<std::string> model_names = {"qwen3", "mixtral", "dsv2"};
  std::vector<std::string> shape_names = {"4x32768", "8x8192", "32x2048"};
  std::vector<std::string> impl_names = {"ws", "cudnn"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--reps") reps = parse_int(a, value(), 1);
    else if (a == "--warmup") warmup = parse_int(a, value(), 0);
    else if (a == "--json") json_path = value();
    else if (a == "--models") model_names = split(value());
    else if (a == "--shapes") shape_names = split(value());
    else if (a == "--impls") impl_names = split(value());
    else if (a == "--help" || a == "-h") {
      std::printf("usage: ws_moe_bench_flash_prefill [--reps N] [--warmup N] [--models qwen3,mixtral,dsv2] "
                  "[--shapes 4x32768,8x8192,32x2048] [--impls ws,cudnn] [--json FILE]\n");
      return 0;
    } else {
      throw usage_error("unknown option '" + a + "' (--help)");
    }
  }
  const model_shape all_models[] = {{"qwen3", 32, 4, 128, 128}, {"mixtral", 32, 8, 128, 128}, {"dsv2", 16, 16, 192, 128}};
  std::vector<model_shape> models;
  for (const std::string& n : model_names) {
    bool found = false;
    for (const auto& m : all_models)
      if (m.name == n) {
        models.push_back(m);
        found = true;
      }
    if (!found) throw usage_error("--models: unknown model '" + n + "' (qwen3, mixtral, dsv2)");
  }
  bool run_ws = false, run_cudnn = false;
  for (const std::string& n : impl_names) {
    if (n == "ws") run_ws = true;
    else if (n == "cudnn") run_cudnn = true;
    else throw usage_error("--impls: unknown implementation '" + n + "' (ws, cudnn)");
  }
  std::vector<batch_shape> shapes;
  for (const std::string& s : shape_names) {
    const std::size_t x = s.find('x');
    if (x == std::string::npos) throw usage_error("--shapes: '" + s + "' is not SEQUENCESxTOKENS");
    shapes.push_back({parse_int("--shapes", s.substr(0, x), 1), parse_int("--shapes", s.substr(x + 1), 1)});
  }

  cudaDeviceProp prop{};
  WS_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  int clock_khz = 0;
  (void)cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  json doc = {{"benchmark", "flash_prefill"},
              {"device", {{"name", prop.name}, {"sm_count", prop.multiProcessorCount}, {"clock_mhz", clock_khz / 1000},
                          {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)}}},
              {"flop_count", "2*(dqk+dv)*hq*sum T(T+1)/2 (causal products only)"},
              {"reps", reps}, {"warmup", warmup}, {"rows", json::array()}};
  const auto save = [&] {
    if (json_path.empty()) return;
    std::ofstream f(json_path);
    f << doc.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write " + json_path);
  };
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::fflush(stdout);
  doc["ceiling"] = gemm_ceiling(8192, warmup, std::max(reps, 5));
  const double ceiling = doc["ceiling"]["tflops"].get<double>();
  std::printf("ceiling: cuBLAS bf16 GEMM 8192^3, fp32 out: %.1f TFLOP/s\n", ceiling);
#if defined(WS_MOE_HAVE_CUDNN)
  std::unique_ptr<gpu::cudnn_prefill> cudnn;
  if (run_cudnn) {
    const bool avail = gpu::cudnn_prefill::available();
    doc["cudnn"] = {{"available", avail}, {"version", gpu::cudnn_prefill::loaded_version()},
                    {"reason", gpu::cudnn_prefill::unavailable_reason()}};
    if (avail) cudnn = std::make_unique<gpu::cudnn_prefill>();
    std::printf("cuDNN: %s\n", avail ? ("version " + std::to_string(gpu::cudnn_prefill::loaded_version())).c_str()
                                      : gpu::cudnn_prefill::unavailable_reason().c_str());
  }
#else
  if (run_cudnn) doc["cudnn"] = {{"available", false}, {"reason", "built without WS_MOE_HAVE_CUDNN"}};
#endif
  save();

  bool spot_ok = true;
  for (const model_shape& m : models) {
    idx max_tokens = 0;
    for (const batch_shape& b : shapes) max_tokens = std::max<idx>(max_tokens, idx(b.sequences) * b.tokens_per_sequence);
    const std::vector<std::uint16_t> hq_data = random_bf16(std::size_t(max_tokens * m.hq * m.dqk), 11);
    const std::vector<std::uint16_t> hk_data = random_bf16(std::size_t(max_tokens * m.hkv * m.dqk), 12);
    const std::vector<std::uint16_t> hv_data = random_bf16(std::size_t(max_tokens * m.hkv * m.dv), 13);
    device_buffer<std::uint16_t> q(hq_data.size()), k(hk_data.size()), v(hv_data.size());
    device_buffer<float> out(std::size_t(max_tokens * m.hq * m.dv));
#if defined(WS_MOE_HAVE_CUDNN)
    device_buffer<std::uint16_t> out_bf16(cudnn ? std::size_t(max_tokens * m.hq * m.dv) : 0);
#endif
    WS_CUDA_TRY(cudaMemcpy(q.p, hq_data.data(), hq_data.size() * 2, cudaMemcpyHostToDevice));
    WS_CUDA_TRY(cudaMemcpy(k.p, hk_data.data(), hk_data.size() * 2, cudaMemcpyHostToDevice));
    WS_CUDA_TRY(cudaMemcpy(v.p, hv_data.data(), hv_data.size() * 2, cudaMemcpyHostToDevice));
    for (const batch_shape& b : shapes) {
      std::vector<int> offsets(std::size_t(b.sequences) + 1);
      for (int s = 0; s <= b.sequences; ++s) offsets[std::size_t(s)] = s * b.tokens_per_sequence;
      device_buffer<int> d_offsets(offsets.size());
      WS_CUDA_TRY(cudaMemcpy(d_offsets.p, offsets.data(), offsets.size() * sizeof(int), cudaMemcpyHostToDevice));
      gpu::flash_prefill_params p;
      p.q = q.p;
      p.k = k.p;
      p.v = v.p;
      p.out = out.p;
      p.seq_offsets = d_offsets.p;
      p.num_seqs = b.sequences;
      p.max_seq_tokens = b.tokens_per_sequence;
      p.hq = m.hq;
      p.hkv = m.hkv;
      p.dqk = m.dqk;
      p.dv = m.dv;
      p.q_token_stride = idx(m.hq) * m.dqk;
      p.q_head_stride = m.dqk;
      p.k_token_stride = idx(m.hkv) * m.dqk;
      p.k_head_stride = m.dqk;
      p.v_token_stride = idx(m.hkv) * m.dv;
      p.v_head_stride = m.dv;
      p.o_token_stride = idx(m.hq) * m.dv;
      p.o_head_stride = m.dv;
      p.scale = float(1.0 / std::sqrt(double(m.dqk)));
      gpu::check_flash_prefill_offsets(p, offsets.data());
      const double T = b.tokens_per_sequence;
      const double flops = 2.0 * (m.dqk + m.dv) * m.hq * b.sequences * T * (T + 1) / 2;
      const json shape = {{"model", m.name}, {"hq", m.hq}, {"hkv", m.hkv}, {"dqk", m.dqk}, {"dv", m.dv},
                          {"batch", b.sequences}, {"seq_tokens", b.tokens_per_sequence}, {"causal", true},
                          {"flops", flops}};
      [[maybe_unused]] double ws_tflops = 0;  // for the cuDNN row's vs_ws_flash_prefill
      if (run_ws) {
        const std::vector<double> s = time_runs([&] { gpu::launch_flash_prefill(p, nullptr); }, warmup, reps);
        const double med = median(s), tflops = flops / med * 1e-12;
        ws_tflops = tflops;
        const double spot = spot_check(p, offsets, hq_data, hk_data, hv_data);
        const bool ok = spot <= 4e-3;  // bf16 rounding of P: at most 2^-8 of max|v|
        spot_ok = spot_ok && ok;
        json row = shape;
        row.update({{"impl", "ws_flash_prefill"}, {"out_dtype", "fp32"}, {"median_seconds", med},
                    {"best_seconds", *std::min_element(s.begin(), s.end())}, {"tflops", tflops},
                    {"fraction_of_ceiling", tflops / ceiling}, {"spot_max_err", spot}, {"spot_ok", ok}});
        doc["rows"].push_back(row);
        std::printf("%-8s %2dx%-6d ws     %8.3f ms  %6.1f TFLOP/s  spot %.2e%s\n", m.name.c_str(), b.sequences,
                    b.tokens_per_sequence, med * 1e3, tflops, spot, ok ? "" : "  FAILED");
        std::fflush(stdout);
        save();
      }
#if defined(WS_MOE_HAVE_CUDNN)
      if (cudnn) {
        const gpu::cudnn_prefill_params c = gpu::to_cudnn_prefill_params(p, out_bf16.p, max_tokens);
        json row = shape;
        row.update({{"impl", "cudnn_sdpa"}, {"out_dtype", "bf16"}});
        if (!cudnn->supported(c)) {
          row.update({{"supported", false}, {"refusal", cudnn->last_refusal()}, {"spot_ok", true}});
          std::printf("%-8s %2dx%-6d cudnn  refused: %s\n", m.name.c_str(), b.sequences, b.tokens_per_sequence,
                      cudnn->last_refusal().c_str());
        } else {
          const std::size_t ws_bytes = cudnn->workspace_bytes(c);  // builds the plan, before the timed runs
          device_buffer<unsigned char> ws(ws_bytes);
          const std::vector<double> s = time_runs([&] { cudnn->run(c, ws.p, ws_bytes, nullptr); }, warmup, reps);
          const double med = median(s), tflops = flops / med * 1e-12;
          // bf16 out adds at most 2^-8 |out| <= 2^-8 max|v| to the rounding of P.
          const double spot = spot_check(p, offsets, hq_data, hk_data, hv_data, out_bf16.p);
          const bool ok = spot <= 8e-3;
          spot_ok = spot_ok && ok;
          row.update({{"supported", true}, {"workspace_bytes", ws_bytes}, {"median_seconds", med},
                      {"best_seconds", *std::min_element(s.begin(), s.end())}, {"tflops", tflops},
                      {"fraction_of_ceiling", tflops / ceiling}, {"spot_max_err", spot}, {"spot_ok", ok}});
          if (ws_tflops > 0) row["vs_ws_flash_prefill"] = tflops / ws_tflops;
          std::printf("%-8s %2dx%-6d cudnn  %8.3f ms  %6.1f TFLOP/s  spot %.2e%s\n", m.name.c_str(), b.sequences,
                      b.tokens_per_sequence, med * 1e3, tflops, spot, ok ? "" : "  FAILED");
        }
        doc["rows"].push_back(row);
        std::fflush(stdout);
        save();
      }
#endif
    }
  }

  std::printf("\nprefill attention (causal, bf16 in; ws_flash_prefill fp32 out, cudnn_sdpa bf16 out) on %s; "
              "ceiling cuBLAS bf16 GEMM %.1f TFLOP/s\n",
              prop.name, ceiling);
  std::printf("%-8s %-5s %-8s %-10s %-16s %10s %9s %8s\n", "model", "heads", "d", "batch", "impl", "median ms", "TFLOP/s",
              "of ceil");
  for (const json& r : doc["rows"]) {
    if (r.contains("supported") && !r["supported"].get<bool>()) continue;
    const std::string heads = std::to_string(r["hq"].get<int>()) + "/" + std::to_string(r["hkv"].get<int>());
    const std::string d = std::to_string(r["dqk"].get<int>()) + "/" + std::to_string(r["dv"].get<int>());
    const std::string batch = std::to_string(r["batch"].get<int>()) + "x" + std::to_string(r["seq_tokens"].get<int>());
    std::printf("%-8s %-5s %-8s %-10s %-16s %10.3f %9.1f %7.0f%%%s\n", r["model"].get<std::string>().c_str(),
                heads.c_str(), d.c_str(), batch.c_str(), r["impl"].get<std::string>().c_str(),
                r["median_seconds"].get<double>() * 1e3, r["tflops"].get<double>(),
                100.0 * r["fraction_of_ceiling"].get<double>(), r["spot_ok"].get<bool>() ? "" : "  SPOT CHECK FAILED");
  }
  return spot_ok ? 0 : 1;
} catch (const usage_error& e) {
  std::fprintf(stderr, "ws_moe_bench_flash_prefill: %s\n", e.what());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ws_moe_bench_flash_prefill: %s\n", e.what());
  return 1;
}
