// SPDX-License-Identifier: Apache-2.0
// bench/prefill_write_bench.cpp — the prefill's write path on cuda_backend
// (paper §4.2: each prompt block goes to its final home at write time): one
// inplace_kv_cache::append_prefill per layer for a batch of prompts whose
// eviction batches a fixed_ratio policy routes between the unpinned and the
// pinned host regions, as a decoder's prefill writes them, against the
// device-to-host copy rate measured in the same run.
//
// Arms: the D2H copies into page-locked memory submitted in one
// cudaMemcpyBatchAsync per staging group (the default, copy_batch.hpp) and one
// cudaMemcpyAsync per piece (set_batched_host_copies(false)). Per arm and
// rep: admit the batch, time every layer's append_prefill (host "enqueue"
// time) and then the wait for every host block to land (synchronize_host_writes);
// `GB/s` is the KV bytes written to host regions over that whole time and
// `ratio` that over the ceiling, one D2H cudaMemcpyAsync of 256 MiB into
// page-locked memory (CUDA events, best of 5). With --load-ms the caller stream
// also runs a spin kernel of that many milliseconds before each layer's write
// (the model's layer compute), so that the copies queue behind GPU work as in a
// real prefill. The last rep's first and last layers are read back and
// compared with the source (every 61st token of every sequence, both arms).
//
// Table on stdout, JSON (--json) rewritten after every row.
#include "bench_util.hpp"

#include <cuda_runtime_api.h>

#include <writescope/cuda/cuda_backend.hpp>
#include <writescope/cuda/cuda_error.hpp>
#include <writescope/cuda/pinned_allocators.hpp>

namespace {

using namespace wsb;

constexpr const char* usage_text = R"(prefill_write_bench — the prefill's host-block writes: batched vs per-copy D2H

  --presets LIST      qwen3,mixtral,dsv2 (default qwen3,mixtral)
  --batch N           sequences (default 4)
  --prompt N          prompt tokens per sequence (default 32768)
  --layers N          layers written per rep (default 4)
  --cpu-share R       fixed_ratio share of the unpinned region (default 0.6)
  --d-window N        D-window tokens = one eviction batch (default 64)
  --block-tokens N    tokens per block (default 64)
  --load-ms X         GPU work (spin kernel) before each layer's write (default 0)
  --reps N            timed repetitions per arm (default 3)
  --json FILE         results (rewritten after every row)
  --help
)";

struct options {
  std::vector<std::string> presets{"qwen3", "mixtral"};
  int batch = 4;
  index_t prompt = 32768;
  int layers = 4;
  double cpu_share = 0.6;
  int d_window = 64;
  int block_tokens = 64;
  double load_ms = 0;
  int reps = 3;
  std::string json_path;
};

options parse(int argc, char** argv) {
  options o;
  arg_reader a(argc, argv);
  while (a.next()) {
    const std::string& f = a.flag();
    if (f == "--help" || f == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    } else if (f == "--presets") {
      o.presets.clear();
      for (const std::string& p : split_list(a.value())) o.presets.push_back(canonical_preset(p));
    } else if (f == "--batch") {
      o.batch = parse_number<int>(f, a.value());
    } else if (f == "--prompt") {
      o.prompt = parse_number<index_t>(f, a.value());
    } else if (f == "--layers") {
      o.layers = parse_number<int>(f, a.value());
    } else if (f == "--cpu-share") {
      o.cpu_share = parse_number<double>(f, a.value());
    } else if (f == "--d-window") {
      o.d_window = parse_number<int>(f, a.value());
    } else if (f == "--block-tokens") {
      o.block_tokens = parse_number<int>(f, a.value());
    } else if (f == "--load-ms") {
      o.load_ms = parse_number<double>(f, a.value());
    } else if (f == "--reps") {
      o.reps = parse_number<int>(f, a.value());
    } else if (f == "--json") {
      o.json_path = a.value();
    } else {
      throw usage_error("unknown flag '" + f + "' (--help lists them)");
    }
  }
  if (o.batch < 1 || o.prompt < 1 || o.layers < 1 || o.reps < 1 || o.block_tokens < 1 || o.d_window < 1)
    throw usage_error("--batch, --prompt, --layers, --reps, --block-tokens and --d-window must be >= 1");
  if (!(o.cpu_share >= 0 && o.cpu_share <= 1)) throw usage_error("--cpu-share must be in [0, 1]");
  if (!(o.load_ms >= 0)) throw usage_error("--load-ms must be >= 0");
  return o;
}

/// D2H rate into page-locked memory: one 256 MiB copy, best of 5 (GB/s).
double d2h_ceiling_gbps() {
  const std::size_t bytes = std::size_t{256} << 20;
  void* dev = nullptr;
  void* host = nullptr;
  WS_CUDA_TRY(cudaMalloc(&dev, bytes));
  WS_CUDA_TRY(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
  WS_CUDA_TRY(cudaMemset(dev, 1, bytes));
  cudaStream_t s{};
  cudaEvent_t a{}, b{};
  WS_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  WS_CUDA_TRY(cudaEventCreate(&a));
  WS_CUDA_TRY(cudaEventCreate(&b));
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    WS_CUDA_TRY(cudaEventRecord(a, s));
    WS_CUDA_TRY(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s));
    WS_CUDA_TRY(cudaEventRecord(b, s));
    WS_CUDA_TRY(cudaEventSynchronize(b));
    float ms = 0;
    WS_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
    best = std::max(best, double(bytes) / (double(ms) * 1e-3) / 1e9);
  }
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  (void)cudaStreamDestroy(s);
  (void)cudaFreeHost(host);
  (void)cudaFree(dev);
  return best;
}

}  // namespace

// The spin kernel (prefill_write_bench_kernels.cu).
namespace wsb {
void launch_spin(double milliseconds, cudaStream_t stream);
}

namespace {

struct arm_result {
  double enqueue_ms = 0, total_ms = 0, host_gb = 0;
  std::uint64_t copies = 0, api_calls = 0;
  double max_abs_err = 0;
  index_t host_tokens = 0;
};

template <class Preset>
arm_result run_arm(const options& o, bool batched, const ws::bf16* kv_dev_k, const ws::bf16* kv_dev_v,
                   const std::vector<ws::bf16>& kv_host_k, const std::vector<ws::bf16>& kv_host_v) {
  using layout_t = typename Preset::layout_type;
  using cache_t = ws::inplace_kv_cache<layout_t, ws::cuda_backend, ws::cuda_host_register, ws::fixed_ratio>;
  const layout_t lay = Preset::layout();
  ws::cuda_backend be;
  be.set_batched_host_copies(batched);
  be.set_deferred_host_writes(index_t{512} << 20);
  ws::partition_spec spec;
  spec.num_layers = o.layers;
  spec.block_tokens = o.block_tokens;
  spec.d_window_tokens = o.d_window;
  spec.max_sequences = o.batch;
  const index_t per_seq = o.prompt + 2 * index_t(o.d_window);
  spec.cpu_capacity_tokens = index_t(o.batch) * per_seq;
  spec.pinned_capacity_tokens = index_t(o.batch) * per_seq;
  spec.pinned_initial_tokens = -1;
  cache_t cache(be, lay, spec, ws::fixed_ratio(o.cpu_share));
  cache.reserve_deferred_host_writes(index_t{512} << 20);
  cache.prefault_cpu_region(cache.usage().cpu_capacity_blocks);
  cudaStream_t caller = be.caller_stream();
  const index_t total_tokens = index_t(o.batch) * o.prompt;
  typename cache_t::kv_input kv;
  kv.planes[0] = kv_dev_k;
  if constexpr (layout_t::planes == 2) kv.planes[1] = kv_dev_v;
  kv.num_tokens = total_tokens;
  arm_result best;
  best.total_ms = 1e300;
  for (int rep = 0; rep < o.reps; ++rep) {
    std::vector<ws::sequence_id> seqs;
    std::vector<index_t> firsts;
    cache.announce_admission(total_tokens);
    for (int i = 0; i < o.batch; ++i) {
      seqs.push_back(cache.begin_sequence(o.prompt));
      firsts.push_back(index_t(i) * o.prompt);
    }
    WS_CUDA_TRY(cudaDeviceSynchronize());
    const auto c0 = be.host_copy_counters();
    const auto t0 = clock_type::now();
    for (int l = 0; l < o.layers; ++l) {
      if (o.load_ms > 0) launch_spin(o.load_ms, caller);
      cache.append_prefill(l, seqs, firsts, kv);
    }
    const double enqueue = seconds_since(t0) * 1e3;
    be.synchronize_host_writes();
    WS_CUDA_TRY(cudaStreamSynchronize(caller));
    const double total = seconds_since(t0) * 1e3;
    const auto c1 = be.host_copy_counters();
    const ws::region_usage u = cache.usage();
    const index_t host_blocks = u.cpu_used_blocks + u.pinned_used_blocks;
    if (total < best.total_ms) {
      best.total_ms = total;
      best.enqueue_ms = enqueue;
      best.copies = c1[1] - c0[1];
      best.api_calls = c1[2] - c0[2];
      best.host_tokens = host_blocks * o.block_tokens;
      best.host_gb = double(host_blocks) * o.block_tokens * double(lay.token_bytes()) * o.layers / 1e9;
    }
    if (rep + 1 == o.reps) {  // the written tokens against the source: layer 0 and the last layer
      const int planes = layout_t::planes;
      const index_t row = index_t(lay.kv_heads()) * layout_t::row_elems;
      std::vector<ws::bf16> tok(std::size_t(planes * row));
      for (int l : {0, o.layers - 1})
        for (int i = 0; i < o.batch; ++i)
          for (index_t t = 0; t < o.prompt; t += 61) {  // a stride that visits every block offset
            cache.read_token(l, seqs[std::size_t(i)], t, tok);
            for (int p = 0; p < planes; ++p) {
              const std::vector<ws::bf16>& src = p == 0 ? kv_host_k : kv_host_v;
              for (index_t e = 0; e < row; ++e) {
                const float want = src[std::size_t((index_t(i) * o.prompt + t) * row + e)].to_float();
                const float got = tok[std::size_t(p * row + e)].to_float();
                best.max_abs_err = std::max(best.max_abs_err, double(std::fabs(want - got)));
              }
            }
          }
    }
    for (ws::sequence_id s : seqs) cache.end_sequence(s);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    json_file out(o.json_path);
    out.doc["benchmark"] = "prefill_write_bench";
    out.doc["machine"] = machine_info(argc, argv);
    {
      int dev = 0, runtime = 0, driver = 0;
      cudaDeviceProp p{};
      WS_CUDA_TRY(cudaGetDevice(&dev));
      WS_CUDA_TRY(cudaGetDeviceProperties(&p, dev));
      (void)cudaRuntimeGetVersion(&runtime);
      (void)cudaDriverGetVersion(&driver);
      out.doc["device"] = json{{"gpu", p.name}, {"cuda_runtime", runtime}, {"cuda_driver", driver},
                               {"batch_memcpy_available", ws::cuda_detail::copy_batch::batch_available()}};
      std::printf("%s, CUDA runtime %d, driver %d, cudaMemcpyBatchAsync %s\n", p.name, runtime, driver,
                  ws::cuda_detail::copy_batch::batch_available() ? "available" : "not available");
    }
    const double ceiling = d2h_ceiling_gbps();
    out.doc["d2h_ceiling_gbps"] = ceiling;
    out.doc["rows"] = json::array();
    std::printf("D2H ceiling (256 MiB into page-locked memory, best of 5): %.1f GB/s\n", ceiling);
    std::printf("%-18s %5s %7s %6s %5s %8s  %-9s %8s %8s %9s %6s %8s %9s\n", "preset", "batch", "prompt", "layers",
                "r", "load ms", "arm", "enq ms", "total ms", "host GB/s", "ratio", "copies", "api calls");
    for (const std::string& key : o.presets) {
      with_preset(key, [&](auto preset) {
        using P = decltype(preset);
        const auto lay = P::layout();
        const index_t row = index_t(lay.kv_heads()) * P::layout_type::row_elems;
        const index_t elems = index_t(o.batch) * o.prompt * row;
        const std::vector<ws::bf16> hk = random_bf16(elems, 11), hv = random_bf16(elems, 12);
        ws::bf16 *dk = nullptr, *dv = nullptr;
        WS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&dk), std::size_t(elems) * sizeof(ws::bf16)));
        WS_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&dv), std::size_t(elems) * sizeof(ws::bf16)));
        WS_CUDA_TRY(cudaMemcpy(dk, hk.data(), std::size_t(elems) * sizeof(ws::bf16), cudaMemcpyHostToDevice));
        WS_CUDA_TRY(cudaMemcpy(dv, hv.data(), std::size_t(elems) * sizeof(ws::bf16), cudaMemcpyHostToDevice));
        for (bool batched : {true, false}) {
          const arm_result r = run_arm<P>(o, batched, dk, dv, hk, hv);
          const double gbps = r.host_gb / (r.total_ms * 1e-3);
          const char* arm = batched ? "batched" : "per-copy";
          std::printf("%-18s %5d %7lld %6d %5.2f %8.2f  %-9s %8.2f %8.2f %9.1f %6.3f %8llu %9llu%s\n", std::string(P::name).c_str(), o.batch,
                      static_cast<long long>(o.prompt), o.layers, o.cpu_share, o.load_ms, arm, r.enqueue_ms,
                      r.total_ms, gbps, gbps / ceiling, static_cast<unsigned long long>(r.copies),
                      static_cast<unsigned long long>(r.api_calls), r.max_abs_err == 0 ? "" : "  MISMATCH");
          std::fflush(stdout);
          out.doc["rows"].push_back(json{{"preset", key},
                                         {"batch", o.batch},
                                         {"prompt_tokens", o.prompt},
                                         {"layers", o.layers},
                                         {"cpu_share", o.cpu_share},
                                         {"d_window_tokens", o.d_window},
                                         {"load_ms", o.load_ms},
                                         {"arm", arm},
                                         {"enqueue_ms", r.enqueue_ms},
                                         {"total_ms", r.total_ms},
                                         {"host_gb", r.host_gb},
                                         {"host_gbps", gbps},
                                         {"ratio_of_d2h_ceiling", gbps / ceiling},
                                         {"d2h_copies", r.copies},
                                         {"d2h_api_calls", r.api_calls},
                                         {"max_abs_err", r.max_abs_err}});
          out.write();
          if (r.max_abs_err != 0) throw std::runtime_error("written blocks differ from the source");
        }
        (void)cudaFree(dk);
        (void)cudaFree(dv);
      });
    }
    return 0;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "prefill_write_bench: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prefill_write_bench: %s\n", e.what());
    return 1;
  }
}
