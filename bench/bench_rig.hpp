// SPDX-License-Identifier: Apache-2.0
// bench/bench_rig.hpp — the decode rig every attention benchmark drives: an
// inplace_kv_cache + hybrid_attention for a model preset, a batch of sequences
// admitted with random bf16 KV (prefill routed at write time by the policy),
// and timed decode steps (per layer: append one token per sequence, attend;
// after the last layer: flush full D-windows, pin one window ahead), each step
// ended by a stream synchronization so that a step's time is what a decoder
// waits for. Plus the same-run ceilings: CPU streaming read, pinned H2D, and
// both at once.
//
// Backend: compiled with WS_BENCH_CUDA=1 it runs on cuda_backend (KV, queries
// and outputs in device memory, pinned region through cudaHostRegister); without
// it on host_backend (the emulated device), which is how CI and the development
// machine smoke-test every benchmark mode. Host compiler only (the CUDA kernels
// are instantiated in bench_kernels.cu).
#pragma once

#include "bench_util.hpp"

#if WS_BENCH_CUDA
#  include <cuda_runtime_api.h>

#  include <writescope/cuda/cuda_backend.hpp>
#  include <writescope/cuda/pinned_allocators.hpp>
#endif

#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace wsb {

#if WS_BENCH_CUDA
using backend_t = ws::cuda_backend;
/// The ablation arms' backend (ws_bench --mode ablate): the run-time switches
/// of cuda_test_hooks; bench_kernels.cu instantiates its kernels.
using ablation_backend_t = ws::basic_cuda_backend<ws::cuda_test_hooks>;
using pinned_t = ws::cuda_host_register;
inline constexpr bool has_cuda = true;
#else
using backend_t = ws::host_backend;
using pinned_t = ws::pageable_allocator;
inline constexpr bool has_cuda = false;
#endif
using act_space = typename backend_t::activation_space;

/// GPU facts for the JSON ("none" on the host build).
inline json device_info() {
#if WS_BENCH_CUDA
  int dev = 0;
  cudaDeviceProp p{};
  WS_CUDA_TRY(cudaGetDevice(&dev));
  WS_CUDA_TRY(cudaGetDeviceProperties(&p, dev));
  int runtime = 0, driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  (void)cudaDriverGetVersion(&driver);
  return json{{"gpu", p.name},
               {"gpu_memory_gib", double(p.totalGlobalMem) / double(1 << 30)},
               {"sm_count", p.multiProcessorCount},
               {"cuda_runtime", runtime},
               {"cuda_driver", driver},
               {"backend", "cuda"}};
#else
  return json{{"gpu", "none (host_backend: emulated device)"}, {"backend", "host"}};
#endif
}

// ---------------------------------------------------------------------------
// Activation memory (device memory on CUDA, host memory on the host backend)
// ---------------------------------------------------------------------------

class act_buffer {
 public:
  act_buffer() = default;
  explicit act_buffer(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 64)) {
#if WS_BENCH_CUDA
    WS_CUDA_TRY(cudaMalloc(&p_, bytes_));
#else
    p_ = std::aligned_alloc(64, (bytes_ + 63) / 64 * 64);
    if (p_ == nullptr) throw std::bad_alloc();
#endif
  }
  act_buffer(act_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  act_buffer& operator=(act_buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  act_buffer(const act_buffer&) = delete;
  act_buffer& operator=(const act_buffer&) = delete;
  ~act_buffer() {
#if WS_BENCH_CUDA
    if (p_ != nullptr) (void)cudaFree(p_);
#else
    std::free(p_);
#endif
  }
  /// Copies host memory in; complete on return (setup only).
  void upload(const void* src, std::size_t bytes, std::size_t offset = 0) {
#if WS_BENCH_CUDA
    WS_CUDA_TRY(cudaMemcpy(static_cast<std::byte*>(p_) + offset, src, bytes, cudaMemcpyHostToDevice));
    WS_CUDA_TRY(cudaDeviceSynchronize());  // a pageable cudaMemcpy may return before the DMA lands
#else
    std::memcpy(static_cast<std::byte*>(p_) + offset, src, bytes);
#endif
  }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(p_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Waits for everything the backend's caller stream holds (the end of a step).
template <class Backend>
void sync_caller(Backend& be) {
#if WS_BENCH_CUDA
  WS_CUDA_TRY(cudaStreamSynchronize(be.caller_stream()));
#else
  (void)be;
#endif
}

/// Waits for every stream of the backend (admission done, pinned writes landed).
template <class Backend>
void sync_all(Backend& be) {
#if WS_BENCH_CUDA
  be.synchronize();
#else
  (void)be;
#endif
}

// ---------------------------------------------------------------------------
// Random KV in activation memory
// ---------------------------------------------------------------------------

/// Random bf16 token rows in the backend's activation space; prefill and
/// append read windows of it at varying offsets (generating every layer's KV
/// anew would dominate the run time).
template <class Layout>
class kv_pool {
 public:
  static constexpr index_t slack_tokens = 4096;

  kv_pool(const Layout& layout, index_t max_tokens, std::uint64_t seed)
      : row_(index_t(layout.kv_heads()) * Layout::row_elems), max_tokens_(std::max<index_t>(max_tokens, 1)) {
    const index_t elems = (max_tokens_ + slack_tokens) * row_;
    const std::vector<ws::bf16> host = random_bf16(elems, seed);
    buf_ = act_buffer(std::size_t(elems) * sizeof(ws::bf16));
    buf_.upload(host.data(), host.size() * sizeof(ws::bf16));
  }

  /// `n` <= max_tokens tokens starting near `offset` (each plane elsewhere).
  [[nodiscard]] ws::kv_tokens<Layout, act_space> kv(std::uint64_t offset, index_t n) const {
    if (n > max_tokens_) throw std::logic_error("kv_pool: " + std::to_string(n) + " tokens requested, pool holds " + std::to_string(max_tokens_));
    ws::kv_tokens<Layout, act_space> t;
    const auto* base = buf_.as<const ws::bf16>();
    for (int p = 0; p < Layout::planes; ++p)
      t.planes[std::size_t(p)] = base + index_t((offset + std::uint64_t(p) * 1531u) % std::uint64_t(slack_tokens)) * row_;
    t.num_tokens = n;
    return t;
  }
  [[nodiscard]] index_t max_tokens() const noexcept { return max_tokens_; }

 private:
  index_t row_;
  index_t max_tokens_;
  act_buffer buf_;
};

// ---------------------------------------------------------------------------
// A policy wrapper that records every cost sample the cache's policy sees
// ---------------------------------------------------------------------------

/// Routes with `inner` and logs every cost_sample (shared between copies):
/// the calibration measures with the same instrument as the online loop.
template <class Inner>
struct recording_policy {
  using policy_concept = ws::routing_policy_tag;
  Inner inner;
  std::shared_ptr<std::vector<ws::cost_sample>> log = std::make_shared<std::vector<ws::cost_sample>>();

  explicit recording_policy(Inner i) : inner(std::move(i)) {}
  [[nodiscard]] ws::route_decision route(const ws::route_query& q) const { return inner.route(q); }
  void observe(const ws::cost_sample& s) {
    log->push_back(s);
    inner.observe(s);
  }
};

// ---------------------------------------------------------------------------
// The decode rig
// ---------------------------------------------------------------------------

struct rig_config {
  int batch = 16;
  int layers = 1;
  index_t max_prompt = 8192;     ///< longest prompt admitted (a multiple of d_window keeps the D-window empty)
  int max_decode_steps = 64;     ///< decode steps between admissions (capacity)
  int cpu_threads = 0;           ///< CPU engine threads (0: cores - 1)
  int block_tokens = 64;
  int d_window = 256;
  index_t first_chunk_bytes = 0;  ///< partition_spec::first_chunk_bytes (0: no ramp)
  int gpu_split_blocks = 4;        ///< partition_spec::gpu_split_blocks (blocks per GPU partial)
  index_t hbm_capacity_tokens = 0;  ///< partition_spec::hbm_capacity_tokens (per layer; 0: no HBM-resident region)
  bool all_gpu_steps = true;        ///< attention_options::all_gpu_steps (false: the CPU side in every step)
  std::uint64_t seed = 1;
};

/// Layers so that one decode step reads at least `min_rotation_bytes` of KV
/// (successive steps then stream from DRAM, not from the 300 MiB L3), at most `cap`.
inline int rotation_layers(index_t layer_bytes, double min_rotation_bytes, int cap = 64) {
  if (layer_bytes <= 0) return 1;
  return std::clamp(int(std::ceil(min_rotation_bytes / double(layer_bytes))), 1, cap);
}

/// Aggregates of one timed decode run (per layer-step unless said otherwise).
struct decode_stats {
  std::vector<double> step_seconds;  ///< per decode step (all layers), synchronized
  double step_ms_median = 0;         ///< per layer-step: median decode step / layers
  double step_ms_mean = 0;
  double cpu_ms = 0;                 ///< median CPU engine time per layer-step (cost samples)
  double gpu_ms = 0;                 ///< median GPU side time per layer-step (CUDA events, cost samples)
  index_t cpu_tokens = 0;            ///< per layer-step (median sample)
  index_t streamed_tokens = 0;
  index_t window_tokens = 0;         ///< D-window tokens of the last layer-step
  index_t resident_tokens = 0;       ///< HBM-resident tokens of the last layer-step
  index_t copies = 0;                ///< H2D copies of the last layer-step
  int layers = 0;
};

template <class Preset, class Policy, class Pinned = pinned_t, class Backend = backend_t>
class rig {
 public:
  using layout_type = typename Preset::layout_type;
  using policy_type = recording_policy<Policy>;
  using cache_type = ws::inplace_kv_cache<layout_type, Backend, Pinned, policy_type>;
  using attention_type = ws::hybrid_attention<cache_type>;
  static constexpr int Q = layout_type::q_dim;
  static constexpr int V = layout_type::v_dim;

  rig(Backend& be, const rig_config& c, Policy policy, const kv_pool<layout_type>& pool)
      : be_(&be),
        cfg_(c),
        layout_(Preset::layout()),
        pool_(&pool),
        rng_{c.seed * 0x9e3779b97f4a7c15ull + 17},
        cache_(be, layout_, make_spec(c, layout_), policy_type(std::move(policy))),
        attn_(make_attention(cache_, c)) {
    const auto rows = std::size_t(c.batch) * std::size_t(layout_.num_q_heads());
    std::vector<float> q(rows * Q);
    for (float& x : q) x = rng_.uniform(-1.0f, 1.0f);
    q_ = act_buffer(q.size() * sizeof(float));
    q_.upload(q.data(), q.size() * sizeof(float));
    out_ = act_buffer(rows * V * sizeof(float));
    lse_ = act_buffer(rows * sizeof(float));
  }
  rig(const rig&) = delete;
  rig& operator=(const rig&) = delete;
  ~rig() {
    try {
      sync_all(*be_);
    } catch (...) {
    }
  }

  /// Ends the live batch (if any) and admits `batch` sequences with prompts of
  /// `prompt` tokens: each prompt's whole eviction batches are routed at write
  /// time by the policy; every layer's KV is written; pins one window ahead.
  void admit(index_t prompt) {
    release();
    if (prompt > cfg_.max_prompt) throw std::logic_error("rig: prompt longer than max_prompt");
    cache_.announce_admission(prompt * cfg_.batch);  // route against the whole batch's L (eq. 2)
    for (int i = 0; i < cfg_.batch; ++i) {
      const ws::sequence_id id = cache_.begin_sequence(prompt);
      seqs_.push_back(id);
      for (int l = 0; l < cfg_.layers && prompt > 0; ++l) cache_.append_prefill(l, id, pool_->kv(rng_.next(), prompt));
    }
    cache_.reserve_pinned_blocks(index_t(cache_.spec().window_blocks()) * cfg_.batch);
    sync_all(*be_);
  }

  void release() {
    if (seqs_.empty()) return;
    sync_all(*be_);
    for (ws::sequence_id id : seqs_) cache_.end_sequence(id);
    seqs_.clear();
  }

  /// `steps` decode steps (every layer: append one token per sequence when
  /// `append`, attend; then flush and pin one window ahead), each ended by a
  /// caller-stream synchronization.
  decode_stats decode(int steps, bool append = true) {
    decode_stats st;
    st.layers = cfg_.layers;
    auto& log = *cache_.policy().log;
    log.clear();
    const float scale = float(Preset::softmax_scale());
    const auto rows = index_t(seqs_.size()) * layout_.num_q_heads();
    const ws::mem_span<const float, act_space> q(q_.as<const float>(), rows * Q);
    const ws::step_outputs<act_space> so{ws::mem_span<float, act_space>(out_.as<float>(), rows * V),
                                         ws::mem_span<float, act_space>(lse_.as<float>(), rows), nullptr};
    for (int s = 0; s < steps; ++s) {
      const auto t0 = clock_type::now();
      for (int l = 0; l < cfg_.layers; ++l) {
        if (append) cache_.append(l, seqs_, pool_->kv(rng_.next(), index_t(seqs_.size())));
        last_ = attn_->step(l, seqs_, q, scale, so);
      }
      cache_.flush();
      cache_.reserve_pinned_blocks(index_t(cache_.spec().window_blocks()) * cfg_.batch);
      sync_caller(*be_);
      st.step_seconds.push_back(seconds_since(t0));
    }
    std::vector<double> per_layer;
    for (double x : st.step_seconds) per_layer.push_back(x / cfg_.layers * 1e3);
    st.step_ms_median = median(per_layer);
    st.step_ms_mean = mean(per_layer);
    std::vector<double> cpu, gpu, ct, gt;
    for (const ws::cost_sample& c : log) {
      if (c.cpu_tokens > 0) {
        cpu.push_back(c.cpu_seconds * 1e3);
        ct.push_back(double(c.cpu_tokens));
      }
      if (c.gpu_streamed_tokens > 0) {
        gpu.push_back(c.gpu_seconds * 1e3);
        gt.push_back(double(c.gpu_streamed_tokens));
      }
    }
    st.cpu_ms = median(cpu);
    st.gpu_ms = median(gpu);
    st.cpu_tokens = index_t(median(ct));
    st.streamed_tokens = index_t(median(gt));
    st.window_tokens = last_.window_tokens;
    st.resident_tokens = last_.resident_tokens;
    st.copies = last_.copies;
    return st;
  }

  /// Placed CPU share of the live batch: unpinned tokens / host-placed tokens
  /// (HBM-resident tokens in neither, as the policies count them).
  [[nodiscard]] double cpu_share() const {
    index_t host = 0, cpu = 0;
    for (ws::sequence_id id : seqs_) {
      host += cache_.sequence(id).placed_tokens - cache_.sequence(id).hbm_placed_tokens;
      cpu += cache_.sequence(id).cpu_placed_tokens;
    }
    return host > 0 ? double(cpu) / double(host) : 0.0;
  }
  /// Bytes of placed KV one layer-step reads out of the D-window: both host
  /// regions, and the HBM-resident region when there is one.
  [[nodiscard]] double spilled_bytes_per_layer() const {
    index_t placed = 0;
    for (ws::sequence_id id : seqs_) placed += cache_.sequence(id).placed_tokens;
    return double(placed) * double(layout_.token_bytes());
  }
  /// Of spilled_bytes_per_layer(), the bytes in the HBM-resident region.
  [[nodiscard]] double hbm_bytes_per_layer() const {
    index_t hbm = 0;
    for (ws::sequence_id id : seqs_) hbm += cache_.sequence(id).hbm_placed_tokens;
    return double(hbm) * double(layout_.token_bytes());
  }
  /// Bytes of the live batch's D-windows one layer-step reads (device memory).
  [[nodiscard]] double window_bytes_per_layer() const {
    index_t w = 0;
    for (ws::sequence_id id : seqs_) w += cache_.sequence(id).window_tokens[0];
    return double(w) * double(layout_.token_bytes());
  }
  [[nodiscard]] Policy& policy() noexcept { return cache_.policy().inner; }
  [[nodiscard]] std::vector<ws::cost_sample>& samples() noexcept { return *cache_.policy().log; }
  [[nodiscard]] cache_type& cache() noexcept { return cache_; }
  [[nodiscard]] const rig_config& config() const noexcept { return cfg_; }
  [[nodiscard]] const layout_type& layout() const noexcept { return layout_; }

  static ws::partition_spec make_spec(const rig_config& c, const layout_type& lay) {
    ws::partition_spec s;
    s.num_layers = c.layers;
    s.block_tokens = c.block_tokens;
    s.d_window_tokens = c.d_window;
    s.max_sequences = c.batch;
    const index_t per_seq = c.max_prompt + c.max_decode_steps + 2 * index_t(c.d_window);
    s.cpu_capacity_tokens = index_t(c.batch) * per_seq;  // reserved, resident on first write
    s.pinned_capacity_tokens = index_t(c.batch) * per_seq;
    s.pinned_initial_tokens = 0;  // page-locked as admissions place blocks there, in large slabs
    const index_t slab = std::max<index_t>(index_t(c.batch) * c.d_window, index_t(c.batch) * per_seq / 8);
    s.pinned_growth_tokens = (slab + c.block_tokens - 1) / c.block_tokens * c.block_tokens;
    s.first_chunk_bytes = c.first_chunk_bytes;
    s.gpu_split_blocks = c.gpu_split_blocks;
    s.hbm_capacity_tokens = c.hbm_capacity_tokens;
    (void)lay;
    return s;
  }

 private:
  static std::unique_ptr<attention_type> make_attention(cache_type& cache, const rig_config& c) {
    ws::attention_options ao;
    ao.cpu_threads = c.cpu_threads > 0 ? c.cpu_threads : default_threads();
    ao.all_gpu_steps = c.all_gpu_steps;
    return std::make_unique<attention_type>(cache, ao);
  }

  Backend* be_;
  rig_config cfg_;
  layout_type layout_;
  const kv_pool<layout_type>* pool_;
  splitmix64 rng_;
  cache_type cache_;                        // destroyed after the attention (engine) below
  std::unique_ptr<attention_type> attn_;
  act_buffer q_, out_, lse_;
  std::vector<ws::sequence_id> seqs_;
  ws::step_report last_{};
};

// ---------------------------------------------------------------------------
// Costs for the roofline policy: a calibration file, or a quick measurement
// ---------------------------------------------------------------------------

struct cost_estimate {
  ws::roofline_params params;
  std::string source;  ///< "file:<path> batch <b>" or "measured ..."
};

/// A roofline_params from per-layer-step medians: A = CPU ms / CPU tokens,
/// B = GPU ms / streamed tokens (fixed costs 0: a ratio, not a fit).
inline ws::roofline_params params_from_stats(const decode_stats& s) {
  ws::roofline_params p;
  p.cpu_cost_per_token_seconds = s.cpu_tokens > 0 ? s.cpu_ms * 1e-3 / double(s.cpu_tokens) : 1e-9;
  p.gpu_cost_per_token_seconds = s.streamed_tokens > 0 ? s.gpu_ms * 1e-3 / double(s.streamed_tokens) : 1e-9;
  p.cpu_cost_per_token_seconds = std::max(p.cpu_cost_per_token_seconds, 1e-15);
  p.gpu_cost_per_token_seconds = std::max(p.gpu_cost_per_token_seconds, 1e-15);
  return p;
}

/// Costs of `preset_name` at `batch` from the calibration file (empty path:
/// none); std::nullopt when the file has no entry for the preset.
inline std::optional<cost_estimate> costs_from_file(const std::string& path, const std::string& preset_name, int batch) {
  if (path.empty()) return std::nullopt;
  const ws::calibration cal = ws::load_calibration(path);  // a broken file is an error, not a fallback
  try {
    const ws::calibration_entry& e = cal.find(preset_name, batch);
    return cost_estimate{e.params(), "file " + path + " (batch " + std::to_string(e.batch) + ", " +
                                         std::to_string(e.cpu_threads) + " threads)"};
  } catch (const ws::config_error&) {
    return std::nullopt;
  }
}

/// The roofline parameters the benchmark's roofline rows start from: online
/// A and B (track_gpu_cost), a short window so that a few decode steps refresh it.
inline ws::roofline_params online_params(ws::roofline_params p, int window_samples) {
  p.track_gpu_cost = true;
  p.cost_window_samples = std::max(1, window_samples);
  return p;
}

// ---------------------------------------------------------------------------
// Same-run ceilings: CPU streaming read, pinned H2D, both at once
// ---------------------------------------------------------------------------

struct ceiling_result {
  double cpu_gbps = 0;        ///< CPU streaming read alone, the engine's thread count
  double h2d_gbps = 0;        ///< pinned H2D alone (64 MiB copies)
  double conc_cpu_gbps = 0;   ///< CPU read while the H2D copies run
  double conc_h2d_gbps = 0;   ///< H2D while the CPU reads
  [[nodiscard]] double concurrent_gbps() const { return conc_cpu_gbps + conc_h2d_gbps; }
  [[nodiscard]] json to_json() const {
    return json{{"cpu_read_gbps", cpu_gbps},
                {"h2d_gbps", h2d_gbps},
                {"concurrent_cpu_read_gbps", conc_cpu_gbps},
                {"concurrent_h2d_gbps", conc_h2d_gbps},
                {"concurrent_total_gbps", concurrent_gbps()}};
  }
};

class ceilings {
 public:
  /// `cpu_bytes` for the read buffer (> 4x L3), `h2d_bytes` of pinned source.
  ceilings(index_t cpu_bytes, index_t h2d_bytes) : reader_(cpu_bytes) {
#if WS_BENCH_CUDA
    src_ = ws::cuda_host_register{}.allocate(std::max<index_t>(h2d_bytes, chunk_bytes));
    std::memset(src_.data(), 1, std::size_t(src_.size_bytes()));
    WS_CUDA_TRY(cudaMalloc(&dst_, std::size_t(2 * chunk_bytes)));
    WS_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    WS_CUDA_TRY(cudaEventCreate(&ev0_));
    WS_CUDA_TRY(cudaEventCreate(&ev1_));
#else
    (void)h2d_bytes;
#endif
  }
  ceilings(const ceilings&) = delete;
  ceilings& operator=(const ceilings&) = delete;
  ~ceilings() {
#if WS_BENCH_CUDA
    (void)cudaStreamSynchronize(stream_);
    (void)cudaEventDestroy(ev0_);
    (void)cudaEventDestroy(ev1_);
    (void)cudaStreamDestroy(stream_);
    (void)cudaFree(dst_);
#endif
  }

  /// All four numbers, CPU side with `threads` threads.
  ceiling_result measure(int threads) {
    ceiling_result r;
    r.cpu_gbps = reader_.measure(threads, 3);
#if WS_BENCH_CUDA
    r.h2d_gbps = h2d_alone(0.12);
    // Both at once: enough copies for ~0.3 s at the solo rate, CPU passes until they are done.
    const int copies = std::max(8, int(0.3 * r.h2d_gbps * 1e9 / double(chunk_bytes)));
    enqueue(copies);
    double cpu_s = 0;
    index_t cpu_bytes = 0;
    do {
      cpu_s += reader_.one_pass(threads);
      cpu_bytes += reader_.bytes();
    } while (cudaEventQuery(ev1_) == cudaErrorNotReady);
    (void)cudaGetLastError();
    WS_CUDA_TRY(cudaEventSynchronize(ev1_));
    float ms = 0;
    WS_CUDA_TRY(cudaEventElapsedTime(&ms, ev0_, ev1_));
    r.conc_h2d_gbps = double(copies) * double(chunk_bytes) / (double(ms) * 1e-3) / 1e9;
    r.conc_cpu_gbps = double(cpu_bytes) / cpu_s / 1e9;
#endif
    return r;
  }

  /// Pinned H2D alone, ~`seconds` of 64 MiB copies, GB/s (0 on the host build).
  double h2d_alone(double seconds) {
#if WS_BENCH_CUDA
    enqueue(4);  // warm
    WS_CUDA_TRY(cudaEventSynchronize(ev1_));
    const int copies = std::max(8, int(seconds * 55e9 / double(chunk_bytes)));
    enqueue(copies);
    WS_CUDA_TRY(cudaEventSynchronize(ev1_));
    float ms = 0;
    WS_CUDA_TRY(cudaEventElapsedTime(&ms, ev0_, ev1_));
    return double(copies) * double(chunk_bytes) / (double(ms) * 1e-3) / 1e9;
#else
    (void)seconds;
    return 0.0;
#endif
  }

  read_ceiling& reader() noexcept { return reader_; }

 private:
  static constexpr index_t chunk_bytes = index_t{64} << 20;
#if WS_BENCH_CUDA
  void enqueue(int copies) {
    const index_t slots = std::max<index_t>(1, src_.size_bytes() / chunk_bytes);
    WS_CUDA_TRY(cudaEventRecord(ev0_, stream_));
    for (int i = 0; i < copies; ++i)
      WS_CUDA_TRY(cudaMemcpyAsync(static_cast<std::byte*>(dst_) + (i % 2) * chunk_bytes,
                                  src_.data() + (i % slots) * chunk_bytes, std::size_t(chunk_bytes),
                                  cudaMemcpyHostToDevice, stream_));
    WS_CUDA_TRY(cudaEventRecord(ev1_, stream_));
  }
  ws::host_allocation src_;
  void* dst_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev0_ = nullptr, ev1_ = nullptr;
#endif
  read_ceiling reader_;
};

}  // namespace wsb
