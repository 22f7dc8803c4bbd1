// SPDX-License-Identifier: Apache-2.0
// examples/minimal_cuda.cpp — examples/minimal.cpp on the GPU: one layer, one
// sequence, a prompt and one decode step on cuda_backend, with the engine's
// K/V, q and out in device memory and the pinned load region page-locked by
// cuda_host_register. The same inputs go through host_backend (the emulated
// GPU) and the two outputs must agree. Host code, compiled by g++; its
// kernels are instantiated in minimal_cuda.cu (nvcc). docs/EMBEDDING.md shows
// the part between README-BEGIN and README-END verbatim (test
// embedding_cuda_snippet).
//
// Exit status: 0 when the outputs agree, 1 when not or on an error, 77 when
// there is no usable CUDA device (it prints "no CUDA device: <reason>").
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <writescope/cuda/cuda_backend.hpp>
#include <writescope/cuda/cuda_error.hpp>
#include <writescope/cuda/pinned_allocators.hpp>
#include <writescope/writescope.hpp>

namespace {

namespace ws = writescope;

constexpr long prompt_tokens = 1000;
constexpr int q_heads = 32, kv_heads = 4, head_dim = 128;

// A device copy of a host vector (what the engine's model would have produced
// on the GPU), freed with the object.
template <class T>
class device_array {
 public:
  device_array(const std::vector<T>& host, cudaStream_t stream) {
    WS_CUDA_TRY(cudaMalloc(&p_, host.size() * sizeof(T)));
    WS_CUDA_TRY(cudaMemcpyAsync(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { (void)cudaFree(p_); }
  [[nodiscard]] T* data() const noexcept { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
};

struct cuda_result {
  std::vector<float> out, lse;
  std::string device_name;
  writescope::partition_spec spec;
};

// The decode step on cuda_backend, the engine's buffers in device memory.
cuda_result run_cuda(cudaStream_t stream, const std::vector<writescope::bf16>& prompt_k_host,
                     const std::vector<writescope::bf16>& prompt_v_host, const std::vector<writescope::bf16>& new_k_host,
                     const std::vector<writescope::bf16>& new_v_host, const std::vector<float>& q_host, float scale) {
  cuda_result r{std::vector<float>(q_host.size()), std::vector<float>(q_heads), {}, {}};
  const device_array<writescope::bf16> prompt_k_dev(prompt_k_host, stream), prompt_v_dev(prompt_v_host, stream);
  const device_array<writescope::bf16> new_k_dev(new_k_host, stream), new_v_dev(new_v_host, stream);
  const device_array<float> q_dev(q_host, stream), out_dev(r.out, stream), lse_dev(r.lse, stream);
  const writescope::bf16 *prompt_k = prompt_k_dev.data(), *prompt_v = prompt_v_dev.data();
  const writescope::bf16 *new_k = new_k_dev.data(), *new_v = new_v_dev.data();
  const float* q = q_dev.data();
  float *out = out_dev.data(), *lse = lse_dev.data();

  // README-BEGIN
  namespace ws = writescope;
  using layout = ws::gqa_layout<128>;
  using cache_type = ws::inplace_kv_cache<layout, ws::cuda_backend, ws::cuda_host_register, ws::roofline_policy>;

  ws::cuda_backend backend(stream);  // appends, the step's outputs and the merge are ordered on `stream`
  const layout lay(32, 4);
  ws::partition_spec spec;           // as in minimal.cpp
  spec.num_layers = 1;
  spec.block_tokens = 64;
  spec.d_window_tokens = 256;
  spec.max_sequences = 8;
  spec.cpu_capacity_tokens = 1 << 16;     // unpinned compute region (pageable host memory)
  spec.pinned_capacity_tokens = 1 << 16;  // pinned load region: page-locked now by cuda_host_register
  spec.ping_pong_bytes = 8 << 20;
  ws::roofline_params calibration;
  calibration.cpu_cost_per_token_seconds = 2.6e-8;
  calibration.gpu_cost_per_token_seconds = 3.8e-8;
  cache_type cache(backend, lay, spec, ws::roofline_policy(calibration));
  ws::hybrid_attention<cache_type> attention(cache);

  // Prefill: the prompt's K/V are device pointers (kv_tokens in device_space).
  const ws::sequence_id seq = cache.begin_sequence(prompt_tokens);
  cache.append_prefill(/*layer=*/0, seq, {{prompt_k, prompt_v}, prompt_tokens});

  // One decode step: device K/V, device q, device out and LSE.
  const ws::sequence_id batch[] = {seq};
  cache.append(0, batch, {{new_k, new_v}, 1});
  attention.step(0, batch, ws::device_span<const float>(q, 32 * 128), scale,
                 {ws::device_span<float>(out, 32 * 128), ws::device_span<float>(lse, 32), nullptr});
  cache.flush();
  // Work the engine enqueues on `stream` from here on may read out and lse.
  // README-END

  WS_CUDA_TRY(cudaMemcpyAsync(r.out.data(), out, r.out.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  WS_CUDA_TRY(cudaMemcpyAsync(r.lse.data(), lse, r.lse.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  WS_CUDA_TRY(cudaStreamSynchronize(stream));
  r.device_name = backend.name();
  r.spec = cache.spec();
  return r;
}  // attention, cache, backend (it synchronizes its streams), then the device arrays

}  // namespace

int main() try {
  // The engine's inputs, as in minimal.cpp: prompt K/V and the new token's K/V
  // token-major [tokens][kv_heads][128] bf16, the new token's query [32][128] fp32.
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto random_bf16 = [&](std::size_t n) {
    std::vector<ws::bf16> x(n);
    for (auto& e : x) e = ws::bf16::from_float(normal(rng));
    return x;
  };
  const auto prompt_k_host = random_bf16(std::size_t(prompt_tokens) * kv_heads * head_dim);
  const auto prompt_v_host = random_bf16(std::size_t(prompt_tokens) * kv_heads * head_dim);
  const auto new_k_host = random_bf16(kv_heads * head_dim), new_v_host = random_bf16(kv_heads * head_dim);
  std::vector<float> q_host(q_heads * head_dim);
  for (float& x : q_host) x = normal(rng);
  const float scale = 1.0f / std::sqrt(float(head_dim));

  ws::cuda_backend::require_device();  // "no CUDA device: ..." before any other CUDA call
  cudaStream_t stream = nullptr;       // the engine's stream
  WS_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cuda_result r = run_cuda(stream, prompt_k_host, prompt_v_host, new_k_host, new_v_host, q_host, scale);
  WS_CUDA_TRY(cudaStreamDestroy(stream));
  const std::vector<float>&out_cuda = r.out, &lse_cuda = r.lse;

  // The same inputs through host_backend (host memory, the emulated GPU side).
  std::vector<float> out_host(q_host.size()), lse_host(q_heads);
  {
    using layout = ws::gqa_layout<128>;
    using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::roofline_policy>;
    ws::host_backend backend;
    ws::roofline_params calibration;
    calibration.cpu_cost_per_token_seconds = 2.6e-8;
    calibration.gpu_cost_per_token_seconds = 3.8e-8;
    cache_type cache(backend, layout(q_heads, kv_heads), r.spec, ws::roofline_policy(calibration));
    ws::hybrid_attention<cache_type> attention(cache);
    const ws::sequence_id seq = cache.begin_sequence(prompt_tokens);
    cache.append_prefill(0, seq, {{prompt_k_host.data(), prompt_v_host.data()}, prompt_tokens});
    const ws::sequence_id batch[] = {seq};
    cache.append(0, batch, {{new_k_host.data(), new_v_host.data()}, 1});
    attention.step(0, batch, ws::host_span<const float>(q_host.data(), ws::index_t(q_host.size())), scale,
                   {ws::host_span<float>(out_host.data(), ws::index_t(out_host.size())),
                    ws::host_span<float>(lse_host.data(), ws::index_t(lse_host.size())), nullptr});
    cache.flush();
  }

  // fp32 accumulation on both sides over the same bf16 K/V: only the order of
  // the sums differs, so the outputs agree far below bf16's precision (2^-8).
  double worst_rel = 0, worst_lse = 0;
  for (int h = 0; h < q_heads; ++h) {
    double num = 0, den = 0;
    for (int i = 0; i < head_dim; ++i) {
      const double d = double(out_cuda[std::size_t(h * head_dim + i)]) - out_host[std::size_t(h * head_dim + i)];
      num += d * d;
      den += double(out_host[std::size_t(h * head_dim + i)]) * out_host[std::size_t(h * head_dim + i)];
    }
    worst_rel = std::max(worst_rel, std::sqrt(num / den));
    worst_lse = std::max(worst_lse, std::abs(double(lse_cuda[std::size_t(h)]) - lse_host[std::size_t(h)]));
  }
  const bool ok = worst_rel <= 1e-4 && worst_lse <= 1e-4;
  std::printf("%s vs host_backend, %ld tokens: max rel L2 %.2e, max |dLSE| %.2e (tolerance 1e-4): %s\n",
              r.device_name.c_str(), prompt_tokens + 1, worst_rel, worst_lse, ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
} catch (const writescope::cuda_error& e) {
  if (std::string_view(e.what()).starts_with("no CUDA device")) {
    std::printf("%s\n", e.what());  // one line: "no CUDA device: <the CUDA status>"
    return 77;
  }
  std::fprintf(stderr, "minimal_cuda: %s\n", e.what());
  return 1;
} catch (const writescope::error& e) {
  std::fprintf(stderr, "minimal_cuda: %s\n", e.what());
  return 1;
}
