// SPDX-License-Identifier: Apache-2.0
// bench/monolithic.hpp — the baseline InplaceKVCache replaces (paper §3.3, §7.4
// "Replace InplaceKVCache with DynamicCache"): one monolithic, pageable KV
// buffer per layer, pre-allocated to a capacity and laid out per head,
//
//     [sequence][plane][kv_head][capacity][row]   bf16, pageable host memory,
//
// whose every decode step re-walks the prepare pipeline of a DynamicCache-style
// offloading wrapper: allocate and pin a staging buffer (cudaHostAlloc), splice
// the valid rows of every (sequence, plane, head) into it (the gaps of unused
// capacity are skipped), chunked H2D into a freshly allocated device buffer,
// attention on the GPU over all of it, then free both. Nothing is kept between
// steps, as with a cache whose physical state is fixed at allocation and has
// to be rebuilt for the consuming engine every time.
//
// The spliced staging buffer holds each sequence as one block of `tokens`
// tokens in writescope's block format ([plane][kv_head][token][row]), so the
// library's GPU attention kernel (gpu::launch_attend) attends it unchanged.
//
// Host compiler only; CUDA runtime calls and the instantiated launchers.
#pragma once

#include <cuda_runtime_api.h>

#include <sys/mman.h>

#include <writescope/cuda/cuda_error.hpp>
#include <writescope/cuda/kernels.hpp>

#include "bench_util.hpp"

namespace wsb {

/// Seconds of each stage of one rebuilt step.
struct rebuild_times {
  double alloc_pin = 0;  ///< cudaHostAlloc of the staging + cudaMalloc of the device copy
  double splice = 0;     ///< valid rows -> staging (OpenMP, `threads` threads)
  double h2d = 0;        ///< chunked H2D, synchronized
  double attend = 0;     ///< GPU attention over all tokens, synchronized (0 when not run)
  double release = 0;    ///< cudaFree + cudaFreeHost
  [[nodiscard]] double total() const { return alloc_pin + splice + h2d + attend + release; }
  [[nodiscard]] json to_json() const {
    return json{{"alloc_pin_ms", alloc_pin * 1e3}, {"splice_ms", splice * 1e3}, {"h2d_ms", h2d * 1e3},
                {"attend_ms", attend * 1e3},       {"release_ms", release * 1e3}, {"total_ms", total() * 1e3}};
  }
};

template <class Layout>
class monolithic_cache {
 public:
  static constexpr index_t chunk_bytes = index_t{64} << 20;  ///< H2D chunk of the wrapper

  /// `capacity` tokens per sequence pre-allocated in each of `layers` layers;
  /// filled with random bf16 (the valid rows are overwritten by fill()).
  monolithic_cache(const Layout& layout, int batch, index_t capacity, int layers, int threads, std::uint64_t seed)
      : layout_(layout), batch_(batch), capacity_(capacity), layers_(layers), threads_(std::max(1, threads)) {
    row_bytes_ = index_t(Layout::row_elems) * index_t(sizeof(ws::bf16));
    layer_bytes_ = index_t(batch) * Layout::planes * layout.kv_heads() * capacity * row_bytes_;
    const std::size_t total = std::size_t(layer_bytes_ * layers);
    void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("monolithic_cache: cannot reserve " + ws::format_bytes(index_t(total)));
    mem_ = static_cast<ws::bf16*>(p);
    bytes_ = total;
    // Random contents (first touch in parallel): attention over zeros is not a fair timing.
    const index_t elems = index_t(total / sizeof(ws::bf16));
    const index_t chunk = 1 << 16;
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (index_t c = 0; c < (elems + chunk - 1) / chunk; ++c) {
      splitmix64 rng{seed + std::uint64_t(c) * 0x9e3779b97f4a7c15ull};
      const index_t end = std::min(elems, (c + 1) * chunk);
      for (index_t i = c * chunk; i < end; ++i) mem_[i] = ws::bf16::from_float(rng.uniform(-2.0f, 2.0f));
    }
    WS_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  monolithic_cache(const monolithic_cache&) = delete;
  monolithic_cache& operator=(const monolithic_cache&) = delete;
  ~monolithic_cache() {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
    ::munmap(mem_, bytes_);
  }

  /// Bytes of KV one step of `tokens` tokens per sequence moves.
  [[nodiscard]] index_t step_bytes(index_t tokens) const { return index_t(batch_) * tokens * layout_.token_bytes(); }

  /// One rebuilt step of `layer` over `tokens` valid tokens per sequence. With
  /// `q` (device, [batch][Hq][q_dim] fp32) the GPU attends everything into
  /// out_o / out_lse (device); without, only the prepare pipeline runs.
  rebuild_times step(int layer, index_t tokens, const float* q = nullptr, float scale = 1.0f, float* out_o = nullptr,
                     float* out_lse = nullptr) {
    if (tokens < 1 || tokens > capacity_) throw std::logic_error("monolithic_cache: tokens outside [1, capacity]");
    rebuild_times t;
    const index_t bytes = step_bytes(tokens);
    auto t0 = clock_type::now();
    void* stage = nullptr;
    void* dev = nullptr;
    WS_CUDA_TRY(cudaHostAlloc(&stage, std::size_t(bytes), cudaHostAllocDefault));
    WS_CUDA_TRY(cudaMalloc(&dev, std::size_t(bytes)));
    t.alloc_pin = seconds_since(t0);

    t0 = clock_type::now();
    const int slices = batch_ * Layout::planes * layout_.kv_heads();  // (sequence, plane, head) rows
    const auto* src = mem_ + index_t(layer) * (layer_bytes_ / index_t(sizeof(ws::bf16)));
    auto* dst = static_cast<ws::bf16*>(stage);
    const index_t row = Layout::row_elems;
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int s = 0; s < slices; ++s)
      std::memcpy(dst + index_t(s) * tokens * row, src + index_t(s) * capacity_ * row, std::size_t(tokens * row_bytes_));
    t.splice = seconds_since(t0);

    t0 = clock_type::now();
    for (index_t off = 0; off < bytes; off += chunk_bytes)
      WS_CUDA_TRY(cudaMemcpyAsync(static_cast<std::byte*>(dev) + off, static_cast<const std::byte*>(stage) + off,
                                  std::size_t(std::min(chunk_bytes, bytes - off)), cudaMemcpyHostToDevice, stream_));
    WS_CUDA_TRY(cudaStreamSynchronize(stream_));
    t.h2d = seconds_since(t0);

    if (q != nullptr) {
      t0 = clock_type::now();
      ws::gpu::attend_params& p = params_;
      p.q = q;
      p.out_o = out_o;
      p.out_lse = out_lse;
      p.block_elems = index_t(Layout::planes) * layout_.kv_heads() * tokens * row;
      p.scale = scale;
      p.hq = layout_.num_q_heads();
      p.hkv = layout_.kv_heads();
      p.group = layout_.group_size();
      p.block_tokens = int(tokens);  // one block per sequence: the spliced [plane][head][token][row]
      for (int b0 = 0; b0 < batch_; b0 += ws::gpu::max_attend_items) {
        p.num_items = std::min(batch_ - b0, ws::gpu::max_attend_items);
        for (int i = 0; i < p.num_items; ++i)
          p.items[i] = {static_cast<const ws::bf16*>(dev) + index_t(b0 + i) * p.block_elems, int(tokens), b0 + i, b0 + i, 0};
        ws::gpu::launch_attend<Layout>(p, stream_);
      }
      WS_CUDA_TRY(cudaStreamSynchronize(stream_));
      t.attend = seconds_since(t0);
    }

    t0 = clock_type::now();
    WS_CUDA_TRY(cudaFree(dev));
    WS_CUDA_TRY(cudaFreeHost(stage));
    t.release = seconds_since(t0);
    return t;
  }

 private:
  Layout layout_;
  int batch_;
  index_t capacity_;
  int layers_;
  int threads_;
  index_t row_bytes_ = 0, layer_bytes_ = 0;
  ws::bf16* mem_ = nullptr;
  std::size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  ws::gpu::attend_params params_{};
};

}  // namespace wsb
