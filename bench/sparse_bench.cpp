// SPDX-License-Identifier: Apache-2.0
// bench/sparse_bench.cpp — block-level sparse selection on cuda_backend
// (paper §4.4, Fig. 6, §7.5; docs/SPARSE.md): attention step time against the
// keep ratio, for the hybrid split and the two single-engine baselines on the
// SAME selection, and the cost of the staging gather.
//
// Model shape: Qwen3-30B-A3B attention (GQA 32 q / 4 kv heads, d 128, bf16:
// 2 KiB of KV per token), one layer. For every length L and batch B:
//   1. gpu_only and cpu_only caches (every placed block pinned / unpinned) are
//      prefilled with B prompts of L + D/2 tokens (device KV, routed at write
//      time), and the dense step is timed on each: T_gpu, T_cpu;
//   2. the hybrid cache is a fixed_ratio(r) split with r = T_gpu/(T_cpu+T_gpu)
//      (the balance of the two measured engines: the roofline share at this
//      point), dense step timed too;
//   3. for every keep ratio k, a selection of ceil(k·n) of each sequence's n
//      placed blocks (random, fixed seed; the same for every KV head unless
//      --per-head, the same logical blocks in every cache) is replayed by a
//      selector, and the sparse step is timed on all three caches;
//   4. on the gpu_only cache, for k < 1, two controls isolate the staging cost:
//      "contiguous" selects the same number of blocks as one prefix per
//      sequence (long runs: copied straight from the pinned region, no
//      gather), and "no-staging" replays the scattered selection with
//      direct_run_bytes = 0 (one cudaMemcpyAsync per run of adjacent blocks,
//      the discrete transfers staging avoids); the scattered selection
//      again with each --gather-sweep thread count ("gpu g=N"): how many
//      gather threads it takes to hide the gather under the copies; and the
//      scattered selection in the other transfer mode (sparse_transfer): "gpu
//      pull" (device_pull: a copy kernel reads the blocks out of the pinned
//      region, no host gather, --pull-ctas CTAs) when the main rows use
//      host_gather, "gpu gather" (host_gather) when --transfer device_pull.
// Staging overhead = T(scattered, gathered) / T(contiguous) - 1 on gpu_only,
// the step where the gather sits on the critical path; target < 5%. The same
// column is given for the g=N, pull and gather control rows.
// Each step is timed host-side from step() to a synchronize of the caller
// stream (the whole step: selection replay, launch, CPU side, merge); the
// GPU side (copy-stream start to the last kernel, CUDA events) and the gather
// (first to last gather memcpy) are reported next to it. Ceilings measured in
// the same run: pinned H2D bandwidth (64 MiB copies), the scattered-block
// gather bandwidth of --gather-threads threads, and the scattered-block pull
// kernel's bandwidth (random blocks of a 1 GiB page-locked buffer) for a few
// CTA counts.
//
// Output: a table on stdout, progress on stderr, JSON (--json) rewritten
// after every row. --budget-seconds stops starting new configurations.
//
// Example (GPU machine, ~2 minutes):
//   build-device/bench/sparse_bench --json $OUT/sparse_bench.json --budget-seconds 150
#include <writescope/cuda/cuda_backend.hpp>
#include <writescope/writescope.hpp>

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace ws = writescope;
using json = nlohmann::json;
using ws::index_t;
using clock_type = std::chrono::steady_clock;
using G = ws::gqa_layout<128>;

namespace {

constexpr const char* usage_text = R"(sparse_bench — sparse (block-selected) attention step on cuda_backend, Qwen3-30B-A3B shape

  --lengths LIST        tokens per sequence, K = 1024 (default 16K,64K)
  --batch LIST          sequences per step (default 4,16,32)
  --keep LIST           keep ratios (default 1,0.5,0.2,0.05)
  --per-head            each KV head selects its own blocks (default: one set per sequence)
  --steps N             timed steps per point (default 5)
  --warmup N            untimed steps per point (default 2)
  --threads N           CPU engine threads (default cores - 1 - the main rows' gather
                        threads: --gather-threads with host_gather, 1 with device_pull)
  --gather-threads N    host threads that gather into staging (default 4)
  --block-tokens N      tokens per block (default 64)
  --ping-pong-mib N     bytes of one ping-pong buffer (= one staging buffer) (default 64)
  --split-blocks N      blocks per GPU split (default 16)
  --gather-sweep LIST   gpu_only re-runs of the scattered selection in host_gather mode
                        with these gather thread counts (default 1,8; empty: none)
  --transfer MODE       how gathered chunks move in the main rows: device_pull (a copy
                        kernel reads the pinned blocks; default) or host_gather (staging)
  --pull-ctas N         CTAs of one pull-kernel launch (default 64)
  --no-controls         skip the contiguous / no-staging / gather-sweep / pull (gather) controls
  --budget-seconds S    stop starting new (L, batch) configurations after S s (default 150)
  --json PATH           results + machine info as JSON (rewritten after every row)
  --seed N              selection seed (default 1)
  --help
)";

struct options {
  std::vector<index_t> lengths{16384, 65536};
  std::vector<int> batches{4, 16, 32};
  std::vector<double> keeps{1.0, 0.5, 0.2, 0.05};
  bool per_head = false;
  int steps = 5;
  int warmup = 2;
  int threads = 0;
  int gather_threads = 4;
  int block_tokens = 64;
  index_t ping_pong_mib = 64;
  int split_blocks = 16;
  bool controls = true;
  std::vector<int> gather_sweep{1, 8};
  ws::sparse_transfer transfer = ws::sparse_transfer::device_pull;
  int pull_ctas = 64;
  double budget_seconds = 150;
  std::string json_path;
  std::uint64_t seed = 1;
};

index_t parse_int(const std::string& flag, std::string t) {
  index_t mult = 1;
  if (!t.empty() && (t.back() == 'K' || t.back() == 'k')) {
    mult = 1024;
    t.pop_back();
  } else if (!t.empty() && (t.back() == 'M' || t.back() == 'm')) {
    mult = 1024 * 1024;
    t.pop_back();
  }
  std::size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(t, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  if (pos != t.size() || t.empty()) throw std::invalid_argument(flag + ": '" + t + "' is not an integer");
  return index_t(v) * mult;
}
double parse_double(const std::string& flag, const std::string& t) {
  std::size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(t, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  if (pos != t.size() || t.empty()) throw std::invalid_argument(flag + ": '" + t + "' is not a number");
  return v;
}
std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> r;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ','))
    if (!x.empty()) r.push_back(x);
  return r;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    } else if (a == "--lengths") {
      o.lengths.clear();
      for (const auto& x : split(value())) o.lengths.push_back(parse_int(a, x));
    } else if (a == "--batch") {
      o.batches.clear();
      for (const auto& x : split(value())) o.batches.push_back(int(parse_int(a, x)));
    } else if (a == "--keep") {
      o.keeps.clear();
      for (const auto& x : split(value())) o.keeps.push_back(parse_double(a, x));
    } else if (a == "--per-head") {
      o.per_head = true;
    } else if (a == "--steps") {
      o.steps = int(parse_int(a, value()));
    } else if (a == "--warmup") {
      o.warmup = int(parse_int(a, value()));
    } else if (a == "--threads") {
      o.threads = int(parse_int(a, value()));
    } else if (a == "--gather-threads") {
      o.gather_threads = int(parse_int(a, value()));
    } else if (a == "--block-tokens") {
      o.block_tokens = int(parse_int(a, value()));
    } else if (a == "--ping-pong-mib") {
      o.ping_pong_mib = parse_int(a, value());
    } else if (a == "--split-blocks") {
      o.split_blocks = int(parse_int(a, value()));
    } else if (a == "--gather-sweep") {
      o.gather_sweep.clear();
      for (const auto& x : split(value())) o.gather_sweep.push_back(int(parse_int(a, x)));
    } else if (a == "--transfer") {
      const std::string m = value();
      if (m == "host_gather") {
        o.transfer = ws::sparse_transfer::host_gather;
      } else if (m == "device_pull") {
        o.transfer = ws::sparse_transfer::device_pull;
      } else {
        throw std::invalid_argument("--transfer: '" + m + "' is neither host_gather nor device_pull");
      }
    } else if (a == "--pull-ctas") {
      o.pull_ctas = int(parse_int(a, value()));
    } else if (a == "--no-controls") {
      o.controls = false;
    } else if (a == "--budget-seconds") {
      o.budget_seconds = parse_double(a, value());
    } else if (a == "--json") {
      o.json_path = value();
    } else if (a == "--seed") {
      o.seed = std::uint64_t(parse_int(a, value()));
    } else {
      throw std::invalid_argument("unknown flag " + a + " (see --help)");
    }
  }
  for (double k : o.keeps)
    if (!(k > 0.0 && k <= 1.0)) throw std::invalid_argument("--keep: ratios must be in (0, 1]");
  if (o.steps < 1 || o.warmup < 0 || o.gather_threads < 1 || o.block_tokens < 1 || o.split_blocks < 1 ||
      o.pull_ctas < 1)
    throw std::invalid_argument("--steps, --gather-threads, --block-tokens, --split-blocks, --pull-ctas must be >= 1");
  if (o.threads <= 0) {  // device_pull starts one gather thread (block lists only), host_gather --gather-threads
    const int gather = o.transfer == ws::sparse_transfer::device_pull ? 1 : o.gather_threads;
    o.threads = std::max(1, int(std::thread::hardware_concurrency()) - 1 - gather);
  }
  return o;
}

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }
double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
std::string first_line_with(const char* path, const char* key) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (line.find(key) != std::string::npos) {
      const auto p = line.find(':');
      return p == std::string::npos ? line : line.substr(p + 2);
    }
  return "";
}

/// Replays a fixed selection: sets[batch index][kv head] = logical blocks.
struct replay_selector {
  using selector_concept = ws::block_selector_tag;
  const std::vector<std::vector<std::vector<index_t>>>* sets = nullptr;
  template <ws::kv_layout Layout>
  void select(const ws::selection_input<Layout>& in, ws::block_selection& out) const {
    const auto& s = (*sets)[std::size_t(in.batch_index)];
    for (int h = 0; h < in.kv_heads(); ++h) out.blocks(h) = s[std::size_t(h)];
  }
};

/// kind: 0 random (scattered), 1 contiguous prefix. Per sequence of n blocks,
/// ceil(keep·n) blocks per KV head (one set for all heads unless per_head).
std::vector<std::vector<std::vector<index_t>>> make_selection(int batch, int hkv, index_t n, double keep, int kind,
                                                              bool per_head, std::uint64_t seed) {
  const index_t k = std::min(n, index_t(std::ceil(keep * double(n) - 1e-9)));
  std::vector<std::vector<std::vector<index_t>>> r(static_cast<std::size_t>(batch));
  std::vector<index_t> perm(static_cast<std::size_t>(n));
  for (int i = 0; i < batch; ++i) {
    for (int h = 0; h < hkv; ++h) {
      std::vector<index_t> sel;
      if (h > 0 && !per_head) {
        sel = r[std::size_t(i)][0];
      } else if (kind == 1) {
        for (index_t b = 0; b < k; ++b) sel.push_back(b);
      } else {
        std::iota(perm.begin(), perm.end(), index_t{0});
        std::mt19937_64 rng(seed * 1000003u + std::uint64_t(i) * 131u + std::uint64_t(h));
        for (index_t j = 0; j < k; ++j) {  // partial Fisher-Yates
          std::uniform_int_distribution<index_t> d(j, n - 1);
          std::swap(perm[std::size_t(j)], perm[std::size_t(d(rng))]);
        }
        sel.assign(perm.begin(), perm.begin() + std::ptrdiff_t(k));
        std::sort(sel.begin(), sel.end());
      }
      r[std::size_t(i)].push_back(std::move(sel));
    }
  }
  return r;
}

class json_out {
 public:
  explicit json_out(std::string path) : path_(std::move(path)) {}
  json doc;
  void flush() const {
    if (path_.empty()) return;
    std::ofstream f(path_ + ".tmp");
    f << doc.dump(1) << "\n";
    f.close();
    std::rename((path_ + ".tmp").c_str(), path_.c_str());
  }

 private:
  std::string path_;
};

/// Pinned H2D bandwidth: 4 copies of 64 MiB, best of 3.
double measure_h2d_gbs() {
  const std::size_t bytes = std::size_t(64) << 20;
  void* h = nullptr;
  void* d = nullptr;
  WS_CUDA_TRY(cudaHostAlloc(&h, bytes, cudaHostAllocDefault));
  WS_CUDA_TRY(cudaMalloc(&d, bytes));
  std::memset(h, 1, bytes);
  cudaStream_t s = nullptr;
  WS_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = clock_type::now();
    for (int k = 0; k < 4; ++k) WS_CUDA_TRY(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s));
    WS_CUDA_TRY(cudaStreamSynchronize(s));
    if (rep > 0) best = std::max(best, 4.0 * double(bytes) / seconds_since(t0) * 1e-9);
  }
  WS_CUDA_TRY(cudaStreamDestroy(s));
  WS_CUDA_TRY(cudaFree(d));
  WS_CUDA_TRY(cudaFreeHost(h));
  return best;
}

/// Scattered-block gather bandwidth per thread count: `threads` threads memcpy
/// random blocks of `block_bytes` from a 1 GiB pageable buffer into a 64 MiB
/// pinned buffer (what the gather threads do), best of 3.
std::vector<double> measure_gather_gbs(const std::vector<int>& thread_counts, index_t block_bytes) {
  const index_t src_bytes = index_t(1) << 30, dst_bytes = index_t(64) << 20;
  std::vector<std::byte> src(std::size_t(src_bytes), std::byte{1});
  void* dst = nullptr;
  WS_CUDA_TRY(cudaHostAlloc(&dst, std::size_t(dst_bytes), cudaHostAllocDefault));
  const index_t nblk = dst_bytes / block_bytes, srcblk = src_bytes / block_bytes;
  std::vector<index_t> pick(static_cast<std::size_t>(nblk));
  std::mt19937_64 rng(7);
  for (auto& p : pick) p = index_t(rng() % std::uint64_t(srcblk));
  std::vector<double> result;
  for (const int threads : thread_counts) {
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = clock_type::now();
      std::vector<std::thread> ts;
      for (int j = 0; j < threads; ++j)
        ts.emplace_back([&, j] {
          writescope::detail::widen_thread_affinity();  // as the engine's gather threads do
          for (index_t b = nblk * j / threads; b < nblk * (j + 1) / threads; ++b)
            writescope::detail::stream_copy(static_cast<std::byte*>(dst) + b * block_bytes,
                                            src.data() + pick[std::size_t(b)] * block_bytes,
                                            std::size_t(block_bytes));
          writescope::detail::stream_copy_fence();
        });
      for (auto& t : ts) t.join();
      best = std::max(best, double(dst_bytes) / seconds_since(t0) * 1e-9);
    }
    result.push_back(best);
  }
  WS_CUDA_TRY(cudaFreeHost(dst));
  return result;
}

/// Scattered-block pull bandwidth per CTA cap: gpu::launch_pull_blocks of
/// 64 MiB of random `block_bytes` blocks out of a 1 GiB page-locked buffer
/// into device memory (what a pulled chunk does), timed with CUDA events,
/// best of 3 after a warm-up.
std::vector<double> measure_pull_gbs(const std::vector<int>& cta_counts, index_t block_bytes) {
  const index_t src_bytes = index_t(1) << 30, dst_bytes = index_t(64) << 20;
  void* src = nullptr;
  void* dst = nullptr;
  WS_CUDA_TRY(cudaHostAlloc(&src, std::size_t(src_bytes), cudaHostAllocDefault));
  std::memset(src, 1, std::size_t(src_bytes));
  WS_CUDA_TRY(cudaMalloc(&dst, std::size_t(dst_bytes)));
  const index_t nblk = dst_bytes / block_bytes, srcblk = src_bytes / block_bytes;
  std::vector<const void*> blocks(static_cast<std::size_t>(nblk));
  std::mt19937_64 rng(7);
  for (auto& b : blocks) b = static_cast<const std::byte*>(src) + index_t(rng() % std::uint64_t(srcblk)) * block_bytes;
  cudaStream_t s = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  WS_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  WS_CUDA_TRY(cudaEventCreate(&e0));
  WS_CUDA_TRY(cudaEventCreate(&e1));
  std::vector<double> result;
  for (const int ctas : cta_counts) {
    double best = 0;
    for (int rep = 0; rep < 4; ++rep) {
      WS_CUDA_TRY(cudaEventRecord(e0, s));
      ws::gpu::launch_pull_blocks(blocks.data(), nblk, dst, block_bytes, ctas, s);
      WS_CUDA_TRY(cudaEventRecord(e1, s));
      WS_CUDA_TRY(cudaEventSynchronize(e1));
      float ms = 0;
      WS_CUDA_TRY(cudaEventElapsedTime(&ms, e0, e1));
      if (rep > 0 && ms > 0) best = std::max(best, double(nblk * block_bytes) / (double(ms) * 1e-3) * 1e-9);
    }
    result.push_back(best);
  }
  WS_CUDA_TRY(cudaEventDestroy(e0));
  WS_CUDA_TRY(cudaEventDestroy(e1));
  WS_CUDA_TRY(cudaStreamDestroy(s));
  WS_CUDA_TRY(cudaFree(dst));
  WS_CUDA_TRY(cudaFreeHost(src));
  return result;
}

struct point {
  double step_ms = 0, cpu_ms = 0, gpu_ms = 0, gather_ms = 0, select_ms = 0;
  index_t gathered_bytes = 0, pulled_bytes = 0, streamed_tokens = 0, cpu_tokens = 0, selected_blocks = 0,
          placed_blocks = 0;
  index_t copies = 0, chunks = 0;
};

/// One cache (one policy) of B sequences of L + D/2 tokens, prefilled with
/// device KV, and its attention objects.
template <class Policy>
class rig {
 public:
  using cache_type = ws::inplace_kv_cache<G, ws::cuda_backend, ws::cuda_host_register, Policy>;
  using attention_type = ws::hybrid_attention<cache_type>;

  rig(ws::cuda_backend& be, const options& o, const G& L, index_t length, int batch, Policy pol, double cpu_share,
      const ws::bf16* kv_dev, const float* q_dev, float* out_dev)
      : be_(be), batch_(batch), q_dev_(q_dev), out_dev_(out_dev) {
    ws::partition_spec s;
    s.num_layers = 1;
    s.block_tokens = o.block_tokens;
    s.d_window_tokens = 256;
    s.max_sequences = batch;
    // Each sequence places `length` tokens, split by marginal share: r·length ± D per region.
    const index_t slack = 2 * index_t(s.d_window_tokens) * batch;
    s.cpu_capacity_tokens = cpu_share <= 0.0 ? 0 : index_t(std::ceil(cpu_share * double(length))) * batch + slack;
    s.pinned_capacity_tokens =
        cpu_share >= 1.0 ? 0 : index_t(std::ceil((1.0 - cpu_share) * double(length))) * batch + slack;
    s.pinned_initial_tokens = -1;
    s.pinned_growth_tokens = s.pinned_capacity_tokens;  // one slab: a sequence's blocks are one contiguous range
    s.ping_pong_bytes = o.ping_pong_mib << 20;
    s.ping_pong_buffers = 2;
    s.gpu_split_blocks = o.split_blocks;
    s.cpu_task_blocks = 16;
    cache_ = std::make_unique<cache_type>(be, L, s, std::move(pol), ws::cuda_host_register{});
    attn_ = std::make_unique<attention_type>(*cache_, main_options(o));
    const index_t prompt = length + s.d_window_tokens / 2;
    ws::kv_tokens<G, ws::device_space> kv;
    kv.planes = {kv_dev, kv_dev + prompt * L.kv_heads() * 128};
    kv.num_tokens = prompt;
    cache_->announce_admission(prompt * batch);  // route against the whole batch's L (eq. 2)
    for (int i = 0; i < batch; ++i) {
      const ws::sequence_id id = cache_->begin_sequence(prompt);
      cache_->append_prefill(0, id, kv);
      seqs_.push_back(id);
    }
    be.synchronize();
    placed_blocks_ = index_t(cache_->sequence(seqs_[0]).block_table.size());
  }

  /// The main rows' attention options (CPU engine threads, reserved sparse
  /// pipeline, gather threads, transfer mode, pull CTAs); the controls change one field.
  static ws::attention_options main_options(const options& o) {
    ws::attention_options ao;
    ao.cpu_threads = o.threads;
    ao.sparse.reserve = true;
    ao.sparse.gather_threads = o.gather_threads;
    ao.sparse.transfer = o.transfer;
    ao.sparse.pull_ctas = o.pull_ctas;
    return ao;
  }

  /// A second attention object with direct_run_bytes = 0 (the no-staging control).
  attention_type& no_staging(const options& o) {
    if (!discrete_) {
      WS_CUDA_TRY(cudaDeviceSynchronize());
      ws::attention_options ao = main_options(o);
      ao.sparse.direct_run_bytes = 0;  // no chunk is gathered: the transfer mode does not matter
      discrete_ = std::make_unique<attention_type>(*cache_, ao);
    }
    return *discrete_;
  }

  /// An attention object in the other transfer mode than the main rows' (the
  /// "gpu pull" / "gpu gather" control): device_pull with --pull-ctas CTAs, or
  /// host_gather with --gather-threads threads.
  attention_type& other_transfer(const options& o) {
    if (!other_) {
      WS_CUDA_TRY(cudaDeviceSynchronize());
      ws::attention_options ao = main_options(o);
      ao.sparse.transfer = o.transfer == ws::sparse_transfer::device_pull ? ws::sparse_transfer::host_gather
                                                                          : ws::sparse_transfer::device_pull;
      other_ = std::make_unique<attention_type>(*cache_, ao);
    }
    return *other_;
  }

  /// An attention object with `threads` gather threads (the gather sweep, host_gather).
  attention_type& with_gather_threads(const options& o, int threads) {
    for (auto& [n, a] : swept_)
      if (n == threads) return *a;
    WS_CUDA_TRY(cudaDeviceSynchronize());
    ws::attention_options ao = main_options(o);
    ao.sparse.gather_threads = threads;
    ao.sparse.transfer = ws::sparse_transfer::host_gather;  // the sweep is of host gather threads
    swept_.emplace_back(threads, std::make_unique<attention_type>(*cache_, ao));
    return *swept_.back().second;
  }

  [[nodiscard]] index_t placed_blocks() const { return placed_blocks_; }
  [[nodiscard]] attention_type& attention() { return *attn_; }

  /// Times `steps` steps after `warmup`; sel == nullptr: the dense step.
  point run(attention_type& attn, const replay_selector* sel, int warmup, int steps) {
    const G& L = cache_->layout();
    const index_t rows = index_t(batch_) * L.num_q_heads();
    ws::step_outputs<ws::device_space> so{ws::device_span<float>(out_dev_, rows * 128), {}, nullptr};
    const ws::device_span<const float> q(q_dev_, rows * 128);
    std::vector<double> step, cpu, gpu, gather, select;
    point p;
    for (int s = 0; s < warmup + steps; ++s) {
      const auto t0 = clock_type::now();
      ws::step_report r;
      if (sel != nullptr) {
        replay_selector local = *sel;
        r = attn.step(0, seqs_, q, 0.0883883f, so, local);
      } else {
        r = attn.step(0, seqs_, q, 0.0883883f, so);
      }
      WS_CUDA_TRY(cudaStreamSynchronize(be_.caller_stream()));
      const double t = seconds_since(t0);
      const double g = attn.engine().gpu_seconds_sync();
      if (s < warmup) continue;
      step.push_back(t);
      cpu.push_back(r.cpu_seconds);
      gpu.push_back(g);
      gather.push_back(r.gather_seconds);
      select.push_back(r.select_seconds);
      p.gathered_bytes = r.gathered_bytes;
      p.pulled_bytes = r.pulled_bytes;
      p.streamed_tokens = r.streamed_tokens;
      p.cpu_tokens = r.cpu_tokens;
      p.selected_blocks = sel ? r.selected_blocks : r.placed_blocks;
      p.placed_blocks = sel ? r.placed_blocks : index_t(batch_) * placed_blocks_;
      p.copies = r.copies;
      p.chunks = r.chunks;
    }
    p.step_ms = 1e3 * median(step);
    p.cpu_ms = 1e3 * median(cpu);
    p.gpu_ms = 1e3 * median(gpu);
    p.gather_ms = 1e3 * median(gather);
    p.select_ms = 1e3 * median(select);
    return p;
  }

 private:
  ws::cuda_backend& be_;
  int batch_;
  const float* q_dev_;
  float* out_dev_;
  std::unique_ptr<cache_type> cache_;
  std::unique_ptr<attention_type> attn_, discrete_, other_;
  std::vector<std::pair<int, std::unique_ptr<attention_type>>> swept_;
  std::vector<ws::sequence_id> seqs_;
  index_t placed_blocks_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sparse_bench: %s\n%s", e.what(), usage_text);
    return 2;
  }
  try {
    const auto t_start = clock_type::now();
    int dev_count = 0;
    if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
      std::fprintf(stderr, "sparse_bench: no usable CUDA device\n");
      return 77;
    }
    cudaDeviceProp prop{};
    WS_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
    const G L = ws::presets::qwen3_30b_a3b::layout();
    const index_t block_bytes = ws::block_format<G>{L, o.block_tokens}.block_bytes();

    json_out out(o.json_path);
    {
      char host[256] = {0};
      gethostname(host, sizeof host - 1);
      std::string cmd;
      for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
      const std::time_t now = std::time(nullptr);
      char date[64];
      std::strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
      out.doc["machine"] = {{"host", host},
                            {"date", date},
                            {"command", cmd},
                            {"cpu_model", first_line_with("/proc/cpuinfo", "model name")},
                            {"cores", int(std::thread::hardware_concurrency())},
                            {"gpu", prop.name}};
    }
    std::fprintf(stderr, "sparse_bench: measuring ceilings...\n");
    const double h2d = measure_h2d_gbs();
    std::vector<int> counts{o.gather_threads};
    for (int n : o.gather_sweep)
      if (n >= 1 && n != o.gather_threads) counts.push_back(n);
    const std::vector<double> gather_gbs = measure_gather_gbs(counts, block_bytes);
    const double gather_ceiling = gather_gbs[0];
    json by_threads = json::object();
    for (std::size_t k = 0; k < counts.size(); ++k) by_threads[std::to_string(counts[k])] = gather_gbs[k];
    std::vector<int> cta_counts{o.pull_ctas};
    for (int n : {16, 32, 64, 132, 264})
      if (n != o.pull_ctas) cta_counts.push_back(n);
    const std::vector<double> pull_gbs = measure_pull_gbs(cta_counts, block_bytes);
    json by_ctas = json::object();
    for (std::size_t k = 0; k < cta_counts.size(); ++k) by_ctas[std::to_string(cta_counts[k])] = pull_gbs[k];
    out.doc["ceilings"] = {{"pinned_h2d_gbs", h2d},
                           {"gather_gbs", gather_ceiling},
                           {"gather_threads", o.gather_threads},
                           {"gather_gbs_by_threads", by_threads},
                           {"gather_block_bytes", block_bytes},
                           {"pull_gbs", pull_gbs[0]},
                           {"pull_ctas", o.pull_ctas},
                           {"pull_gbs_by_ctas", by_ctas}};
    out.doc["config"] = {{"model", "Qwen3-30B-A3B attention, GQA 32/4, d 128, 1 layer"},
                         {"block_tokens", o.block_tokens},
                         {"d_window_tokens", 256},
                         {"ping_pong_mib", o.ping_pong_mib},
                         {"split_blocks", o.split_blocks},
                         {"cpu_threads", o.threads},
                         {"gather_threads", o.gather_threads},
                         {"transfer", ws::to_string(o.transfer)},
                         {"pull_ctas", o.pull_ctas},
                         {"per_head", o.per_head},
                         {"steps", o.steps},
                         {"warmup", o.warmup}};
    out.doc["rows"] = json::array();
    out.flush();
    std::printf("# %s, %s, %d cores; pinned H2D %.1f GB/s, gather (%d threads, %lld-byte blocks) %.1f GB/s, "
                "pull (%d CTAs) %.1f GB/s; main rows: %s\n",
                prop.name, out.doc["machine"]["cpu_model"].get<std::string>().c_str(),
                int(std::thread::hardware_concurrency()), h2d, o.gather_threads, static_cast<long long>(block_bytes),
                gather_ceiling, o.pull_ctas, pull_gbs[0], ws::to_string(o.transfer));
    std::printf("%6s %5s %5s %-12s %9s %8s %8s %8s %9s %7s %8s %9s\n", "L", "batch", "keep", "mode", "step ms",
                "cpu ms", "gpu ms", "gather", "gather GB/s", "union", "stream GB", "overhead");

    const index_t max_len = *std::max_element(o.lengths.begin(), o.lengths.end());
    const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
    // Device KV for one prompt (every sequence gets the same values) and the queries.
    const index_t prompt_max = max_len + 128;
    std::vector<ws::bf16> kv_host(std::size_t(2 * prompt_max * 4 * 128));
    std::mt19937_64 rng(o.seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : kv_host) x = ws::bf16::from_float(nd(rng));
    std::vector<float> q_host(std::size_t(max_batch) * 32 * 128);
    for (auto& x : q_host) x = nd(rng);
    void* mem[3] = {nullptr, nullptr, nullptr};
    WS_CUDA_TRY(cudaMalloc(&mem[0], kv_host.size() * sizeof(ws::bf16)));
    WS_CUDA_TRY(cudaMalloc(&mem[1], q_host.size() * sizeof(float)));
    WS_CUDA_TRY(cudaMalloc(&mem[2], q_host.size() * sizeof(float)));
    auto* kv_dev = static_cast<ws::bf16*>(mem[0]);
    auto* q_dev = static_cast<float*>(mem[1]);
    auto* out_dev = static_cast<float*>(mem[2]);
    WS_CUDA_TRY(cudaMemcpy(q_dev, q_host.data(), q_host.size() * sizeof(float), cudaMemcpyHostToDevice));

    bool out_of_time = false;
    for (const index_t len : o.lengths) {
      // planes K and V back to back for this prompt length
      const index_t prompt = len + 128;
      WS_CUDA_TRY(cudaMemcpy(kv_dev, kv_host.data(), std::size_t(prompt * 4 * 128) * sizeof(ws::bf16),
                             cudaMemcpyHostToDevice));
      WS_CUDA_TRY(cudaMemcpy(kv_dev + prompt * 4 * 128, kv_host.data() + prompt_max * 4 * 128,
                             std::size_t(prompt * 4 * 128) * sizeof(ws::bf16), cudaMemcpyHostToDevice));
      for (const int batch : o.batches) {
        if (seconds_since(t_start) > o.budget_seconds) {
          out_of_time = true;
          break;
        }
        std::fprintf(stderr, "sparse_bench: L %lld batch %d (%.0f s so far)\n", static_cast<long long>(len), batch,
                     seconds_since(t_start));
        ws::cuda_backend be;
        // transfer: the sparse_transfer of the row's attention object ("none": a dense step).
        auto emit = [&](double keep, const char* mode, const point& p, double union_frac, double overhead,
                        const char* transfer) {
          const double gather_gbs = p.gather_ms > 0 ? double(p.gathered_bytes) / (p.gather_ms * 1e-3) * 1e-9 : 0.0;
          const double stream_gb = double(p.streamed_tokens) * 2048.0 * 1e-9;
          char ov[32] = "";
          if (!std::isnan(overhead)) std::snprintf(ov, sizeof ov, "%+.1f%%", 100.0 * overhead);
          std::printf("%6lld %5d %5.2f %-12s %9.2f %8.2f %8.2f %8.2f %9.1f %7.3f %8.3f %9s\n",
                      static_cast<long long>(len), batch, keep, mode, p.step_ms, p.cpu_ms, p.gpu_ms, p.gather_ms,
                      gather_gbs, union_frac, stream_gb, ov);
          std::fflush(stdout);
          json row = {{"length", len},
                      {"batch", batch},
                      {"keep", keep},
                      {"mode", mode},
                      {"step_ms", p.step_ms},
                      {"cpu_ms", p.cpu_ms},
                      {"gpu_ms", p.gpu_ms},
                      {"gather_ms", p.gather_ms},
                      {"select_ms", p.select_ms},
                      {"gather_gbs", gather_gbs},
                      {"gathered_bytes", p.gathered_bytes},
                      {"pulled_bytes", p.pulled_bytes},
                      {"transfer", transfer},
                      {"streamed_tokens", p.streamed_tokens},
                      {"cpu_tokens", p.cpu_tokens},
                      {"selected_blocks", p.selected_blocks},
                      {"placed_blocks", p.placed_blocks},
                      {"selected_fraction", union_frac},
                      {"copies", p.copies},
                      {"chunks", p.chunks}};
          if (!std::isnan(overhead)) row["staging_overhead"] = overhead;
          out.doc["rows"].push_back(row);
          out.flush();
        };
        const double nan = std::nan("");
        const char* main_transfer = ws::to_string(o.transfer);
        auto union_of = [](const point& p) {
          return p.placed_blocks > 0 ? double(p.selected_blocks) / double(p.placed_blocks) : 0.0;
        };

        // 1. Single-engine caches: dense T_gpu, T_cpu; then every keep ratio.
        std::vector<std::vector<std::vector<std::vector<index_t>>>> selections;
        double t_gpu = 0, t_cpu = 0;
        index_t n = 0;
        {
          rig<ws::gpu_only> g(be, o, L, len, batch, ws::gpu_only{}, 0.0, kv_dev, q_dev, out_dev);
          n = g.placed_blocks();
          for (double keep : o.keeps)
            selections.push_back(make_selection(batch, L.kv_heads(), n, keep, 0, o.per_head, o.seed));
          const point d = g.run(g.attention(), nullptr, o.warmup, o.steps);
          t_gpu = d.step_ms;
          emit(1.0, "gpu dense", d, 1.0, nan, "none");
          for (std::size_t k = 0; k < o.keeps.size(); ++k) {
            replay_selector sel{&selections[k]};
            const point p = g.run(g.attention(), &sel, o.warmup, o.steps);
            double overhead = nan;
            if (o.controls && o.keeps[k] < 1.0 && !o.per_head) {
              const auto contiguous = make_selection(batch, L.kv_heads(), n, o.keeps[k], 1, false, o.seed);
              replay_selector csel{&contiguous};
              const point c = g.run(g.attention(), &csel, o.warmup, o.steps);
              overhead = c.step_ms > 0 ? p.step_ms / c.step_ms - 1.0 : nan;
              emit(o.keeps[k], "gpu contig", c, union_of(c), nan, main_transfer);
              const point ns = g.run(g.no_staging(o), &sel, o.warmup, o.steps);
              emit(o.keeps[k], "gpu nostage", ns, union_of(ns), nan, "host_gather");
              for (const int gt : o.gather_sweep) {
                if (gt < 1 || gt == o.gather_threads) continue;
                const point sw = g.run(g.with_gather_threads(o, gt), &sel, o.warmup, o.steps);
                char mode[32];
                std::snprintf(mode, sizeof mode, "gpu g=%d", gt);
                emit(o.keeps[k], mode, sw, union_of(sw), c.step_ms > 0 ? sw.step_ms / c.step_ms - 1.0 : nan,
                     "host_gather");
              }
              // The scattered selection in the other transfer mode, overhead against the same contig.
              const bool main_pulls = o.transfer == ws::sparse_transfer::device_pull;
              const point ot = g.run(g.other_transfer(o), &sel, o.warmup, o.steps);
              emit(o.keeps[k], main_pulls ? "gpu gather" : "gpu pull", ot, union_of(ot),
                   c.step_ms > 0 ? ot.step_ms / c.step_ms - 1.0 : nan, main_pulls ? "host_gather" : "device_pull");
            }
            emit(o.keeps[k], "gpu_only", p, union_of(p), overhead, main_transfer);
          }
        }
        {
          rig<ws::cpu_only> c(be, o, L, len, batch, ws::cpu_only{}, 1.0, kv_dev, q_dev, out_dev);
          const point d = c.run(c.attention(), nullptr, o.warmup, o.steps);
          t_cpu = d.step_ms;
          emit(1.0, "cpu dense", d, 1.0, nan, "none");
          for (std::size_t k = 0; k < o.keeps.size(); ++k) {
            replay_selector sel{&selections[k]};
            const point p = c.run(c.attention(), &sel, o.warmup, o.steps);
            emit(o.keeps[k], "cpu_only", p, union_of(p), nan, main_transfer);
          }
        }
        // 2. The hybrid split at the measured balance point.
        {
          const double r = t_gpu / (t_cpu + t_gpu);
          rig<ws::fixed_ratio> h(be, o, L, len, batch, ws::fixed_ratio(r), r, kv_dev, q_dev, out_dev);
          const point d = h.run(h.attention(), nullptr, o.warmup, o.steps);
          char mode[32];
          emit(1.0, "hyb dense", d, 1.0, nan, "none");
          out.doc["rows"].back()["cpu_share"] = r;
          for (std::size_t k = 0; k < o.keeps.size(); ++k) {
            replay_selector sel{&selections[k]};
            const point p = h.run(h.attention(), &sel, o.warmup, o.steps);
            std::snprintf(mode, sizeof mode, "hybrid %.2f", r);
            emit(o.keeps[k], mode, p, union_of(p), nan, main_transfer);
            out.doc["rows"].back()["cpu_share"] = r;
          }
          out.flush();
        }
      }
      if (out_of_time) break;
    }
    if (out_of_time) {
      std::printf("# stopped: --budget-seconds %.0f reached\n", o.budget_seconds);
      out.doc["stopped_by_budget"] = true;
    }
    out.doc["seconds"] = seconds_since(t_start);
    out.flush();
    WS_CUDA_TRY(cudaFree(kv_dev));
    WS_CUDA_TRY(cudaFree(q_dev));
    WS_CUDA_TRY(cudaFree(out_dev));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sparse_bench: %s\n", e.what());
    return 1;
  }
}
