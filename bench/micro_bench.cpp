// SPDX-License-Identifier: Apache-2.0
// bench/micro_bench.cpp — the paper's §3 microbenchmarks on this machine:
//
//   transfer   pinned vs pageable H2D of a single-layer KV buffer (DeepSeek-V2-Lite,
//              batch 16, seq 2K..32K), and pinned H2D by copy size (footnote 5)
//   strided    a 32K-capacity per-head buffer holding L valid tokens: 2-D copy
//              (cudaMemcpy2DAsync) and a per-segment loop vs an exactly
//              allocated contiguous buffer (§3.2, Fig. 3); plus 256-byte rows
//              (a token-major source gathered per head) through the 2-D engine
//   pin        cudaHostAlloc vs cudaHostRegister (pre-touched or not), per GiB,
//              and the release calls (§4.3, §7.7)
//   cpu_read   CPU streaming read of page-locked vs pageable memory with 1..N
//              threads (§3.1: the pin-state seesaw)
//   rebuild    a monolithic cache rebuilt every step — allocate + pin, splice,
//              chunked H2D, free (what a DynamicCache-style offload wrapper does,
//              §3.3) — vs the partitioned format, whose pinned blocks stream as
//              they are, from 2K to 64K tokens (DeepSeek-V2-Lite, batch 16)
//
// Every section writes its rows to one JSON file (rewritten after each row);
// progress on stderr, a table on stdout. CUDA only (no kernels are launched).
#include "bench_util.hpp"

#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <writescope/cuda/cuda_error.hpp>
#include <writescope/cuda/pinned_allocators.hpp>

#include "cuda_timing.hpp"
#include "monolithic.hpp"

namespace {

using namespace wsb;

constexpr const char* usage_text = R"(micro_bench — the paper's §3 microbenchmarks (docs/BENCHMARKS.md)

  --sections LIST     transfer,strided,pin,cpu_read,rebuild (default: all)
  --threads LIST      cpu_read thread counts (default 1,4,8,cores-1)
  --splice-threads N  threads of the monolithic splice (default cores-1)
  --rebuild-lengths L rebuild: tokens per sequence (default 2K,4K,8K,16K,32K,64K)
  --reps N            timed repetitions per point (default 3)
  --budget-seconds S  stop starting new points after S seconds (0: none)
  --json FILE         results (rewritten after every row)
  --help
)";

struct options {
  std::vector<std::string> sections{"transfer", "strided", "pin", "cpu_read", "rebuild"};
  std::vector<int> threads;
  int splice_threads = default_threads();
  std::vector<index_t> rebuild_lengths{2048, 4096, 8192, 16384, 32768, 65536};
  int reps = 3;
  double budget_seconds = 0;
  std::string json_path;
  [[nodiscard]] bool has(const std::string& s) const {
    return std::find(sections.begin(), sections.end(), s) != sections.end();
  }
};

options parse(int argc, char** argv) {
  options o;
  arg_reader a(argc, argv);
  while (a.next()) {
    const std::string& f = a.flag();
    if (f == "--help" || f == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    } else if (f == "--sections") {
      o.sections = split_list(a.value());
    } else if (f == "--threads") {
      o.threads = parse_list<int>(f, a.value());
    } else if (f == "--splice-threads") {
      o.splice_threads = parse_number<int>(f, a.value());
    } else if (f == "--rebuild-lengths") {
      o.rebuild_lengths = parse_list<index_t>(f, a.value());
    } else if (f == "--reps") {
      o.reps = parse_number<int>(f, a.value());
    } else if (f == "--budget-seconds") {
      o.budget_seconds = parse_number<double>(f, a.value());
    } else if (f == "--json") {
      o.json_path = a.value();
    } else {
      throw usage_error("unknown flag '" + f + "' (--help lists them)");
    }
  }
  if (o.threads.empty()) {
    const int top = default_threads();
    for (int t : {1, 4, 8})
      if (t < top) o.threads.push_back(t);
    o.threads.push_back(top);
  }
  if (o.reps < 1) throw usage_error("--reps must be >= 1");
  return o;
}

/// mmap'ed pageable memory, touched in parallel (resident), unmapped on destruction.
class pageable_buffer {
 public:
  explicit pageable_buffer(index_t bytes, bool touch = true) : bytes_(std::size_t(bytes)) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of " + ws::format_bytes(bytes) + " failed");
    p_ = static_cast<std::byte*>(p);
    if (touch) {
#pragma omp parallel for schedule(static)
      for (index_t i = 0; i < bytes; i += 4096) p_[i] = std::byte{1};
    }
  }
  pageable_buffer(const pageable_buffer&) = delete;
  pageable_buffer& operator=(const pageable_buffer&) = delete;
  ~pageable_buffer() { ::munmap(p_, bytes_); }
  [[nodiscard]] std::byte* data() const noexcept { return p_; }

 private:
  std::byte* p_ = nullptr;
  std::size_t bytes_;
};

/// cudaHostAlloc'ed memory, freed on destruction.
class host_alloc_buffer {
 public:
  explicit host_alloc_buffer(index_t bytes) { WS_CUDA_TRY(cudaHostAlloc(&p_, std::size_t(bytes), cudaHostAllocDefault)); }
  host_alloc_buffer(const host_alloc_buffer&) = delete;
  host_alloc_buffer& operator=(const host_alloc_buffer&) = delete;
  ~host_alloc_buffer() { (void)cudaFreeHost(p_); }
  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(p_); }

 private:
  void* p_ = nullptr;
};



/// Best and median of `reps` timings after one warm-up.
template <class F>
std::pair<double, double> best_median(int reps, F&& f) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) t.push_back(f());
  return {*std::min_element(t.begin(), t.end()), median(t)};
}

struct run_state {
  const options* o;
  budget bud;
  json_file out;
  bool complete = true;
  void add(const char* section, json row) {
    out.doc[section].push_back(std::move(row));
    out.doc["elapsed_seconds"] = bud.elapsed();
    out.write();
  }
  bool skip(const std::string& what) {
    if (!bud.spent()) return false;
    complete = false;
    progress(bud, "budget spent: skipping %s", what.c_str());
    return true;
  }
};

constexpr double gb(double bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0.0; }

// --- transfer -------------------------------------------------------------------

void transfer(run_state& st) {
  const index_t token_bytes = ws::presets::deepseek_v2_lite::layout().token_bytes();
  const index_t max_bytes = 16 * 32768 * token_bytes;
  ws::host_allocation pinned = ws::cuda_host_register{}.allocate(max_bytes);
  std::memset(pinned.data(), 1, std::size_t(max_bytes));
  pageable_buffer pageable(max_bytes);
  device_buffer dev(max_bytes);
  timer_stream ts;
  for (index_t L : {index_t(2048), index_t(8192), index_t(32768)}) {
    if (st.skip("transfer L " + std::to_string(L))) return;
    const index_t bytes = 16 * L * token_bytes;
    const auto pin = best_median(st.o->reps, [&] {
      return ts.time([&](cudaStream_t s) {
        WS_CUDA_TRY(cudaMemcpyAsync(dev.data(), pinned.data(), std::size_t(bytes), cudaMemcpyHostToDevice, s));
      });
    });
    const auto pag = best_median(st.o->reps, [&] {
      const auto t0 = clock_type::now();
      WS_CUDA_TRY(cudaMemcpy(dev.data(), pageable.data(), std::size_t(bytes), cudaMemcpyHostToDevice));
      WS_CUDA_TRY(cudaDeviceSynchronize());
      return seconds_since(t0);
    });
    json row{{"kind", "layer_buffer"},       {"preset", "DeepSeek-V2-Lite"},     {"batch", 16},
             {"tokens_per_sequence", L},     {"bytes", bytes},                   {"pinned_gbps", gb(double(bytes), pin.second)},
             {"pinned_gbps_best", gb(double(bytes), pin.first)},                 {"pageable_gbps", gb(double(bytes), pag.second)},
             {"pageable_gbps_best", gb(double(bytes), pag.first)}};
    row["pinned_over_pageable"] = row["pinned_gbps"].get<double>() / std::max(1e-9, row["pageable_gbps"].get<double>());
    progress(st.bud, "transfer L %lld (%.0f MiB): pinned %.1f GB/s, pageable %.1f GB/s", static_cast<long long>(L),
             double(bytes) / 1048576.0, row["pinned_gbps"].get<double>(), row["pageable_gbps"].get<double>());
    std::printf("transfer %6lld %8.1f MiB  pinned %6.1f GB/s  pageable %6.1f GB/s\n", static_cast<long long>(L),
                double(bytes) / 1048576.0, row["pinned_gbps"].get<double>(), row["pageable_gbps"].get<double>());
    st.add("transfer", std::move(row));
  }
  // Pinned H2D by copy size: 256 MiB moved as copies of each size.
  for (index_t sz : {index_t(16) << 10, index_t(192) << 10, index_t(1) << 20, index_t(8) << 20, index_t(64) << 20}) {
    if (st.skip("transfer copy size")) return;
    const index_t total = std::min<index_t>(max_bytes, index_t(256) << 20) / sz * sz;
    const auto t = best_median(st.o->reps, [&] {
      return ts.time([&](cudaStream_t s) {
        for (index_t off = 0; off < total; off += sz)
          WS_CUDA_TRY(cudaMemcpyAsync(dev.data() + off, pinned.data() + off, std::size_t(sz), cudaMemcpyHostToDevice, s));
      });
    });
    json row{{"kind", "copy_size"}, {"copy_bytes", sz}, {"total_bytes", total}, {"pinned_gbps", gb(double(total), t.second)},
             {"us_per_copy", t.second / double(total / sz) * 1e6}};
    std::printf("transfer copy %8lld B  pinned %6.1f GB/s  %.2f us/copy\n", static_cast<long long>(sz),
                row["pinned_gbps"].get<double>(), row["us_per_copy"].get<double>());
    st.add("transfer", std::move(row));
  }
}

// --- strided --------------------------------------------------------------------

void strided(run_state& st) {
  // Qwen3-30B-A3B batch 16: 16 × 2 planes × 4 KV heads = 128 (sequence, plane, head) segments.
  const int segments = 16 * 2 * 4;
  const index_t row = 128 * 2;  // bytes of one token's row in one head
  const index_t cap = 32768;
  const index_t total = index_t(segments) * cap * row;  // 1 GiB
  ws::host_allocation src = ws::cuda_host_register{}.allocate(total);
  std::memset(src.data(), 1, std::size_t(total));
  device_buffer dev(total);
  timer_stream ts;
  for (index_t L : {index_t(2048), index_t(8192), index_t(16384), index_t(32768)}) {
    if (st.skip("strided L " + std::to_string(L))) return;
    const index_t valid = index_t(segments) * L * row;
    const auto seg_w = std::size_t(L * row);
    const auto copy2d = best_median(st.o->reps, [&] {
      return ts.time([&](cudaStream_t s) {
        WS_CUDA_TRY(cudaMemcpy2DAsync(dev.data(), seg_w, src.data(), std::size_t(cap * row), seg_w, std::size_t(segments),
                                      cudaMemcpyHostToDevice, s));
      });
    });
    const auto loop = best_median(st.o->reps, [&] {
      return ts.time([&](cudaStream_t s) {
        for (int g = 0; g < segments; ++g)
          WS_CUDA_TRY(cudaMemcpyAsync(dev.data() + std::size_t(g) * seg_w, src.data() + index_t(g) * cap * row, seg_w,
                                      cudaMemcpyHostToDevice, s));
      });
    });
    const auto exact = best_median(st.o->reps, [&] {
      return ts.time([&](cudaStream_t s) {
        WS_CUDA_TRY(cudaMemcpyAsync(dev.data(), src.data(), std::size_t(valid), cudaMemcpyHostToDevice, s));
      });
    });
    // A token-major source [seq][cap][plane·head][row] gathered per head: 256-byte rows, 2-D engine.
    const auto rows256 = best_median(st.o->reps, [&] {
      return ts.time([&](cudaStream_t s) {
        const int heads = 8;  // planes × KV heads per token
        for (int seq = 0; seq < 16; ++seq)
          for (int h = 0; h < heads; ++h)
            WS_CUDA_TRY(cudaMemcpy2DAsync(dev.data() + (index_t(seq) * heads + h) * L * row, std::size_t(row),
                                          src.data() + index_t(seq) * cap * heads * row + index_t(h) * row,
                                          std::size_t(heads * row), std::size_t(row), std::size_t(L),
                                          cudaMemcpyHostToDevice, s));
      });
    });
    json row_j{{"preset", "Qwen3-30B-A3B"},  {"batch", 16},
               {"capacity", cap},            {"tokens_per_sequence", L},
               {"bytes", valid},             {"segment_bytes", L * row},
               {"copy2d_gbps", gb(double(valid), copy2d.second)},
               {"segment_loop_gbps", gb(double(valid), loop.second)},
               {"exact_gbps", gb(double(valid), exact.second)},
               {"rows256_2d_gbps", gb(double(valid), rows256.second)}};
    progress(st.bud, "strided L %lld: 2-D %.1f, loop %.1f, exact %.1f, 256-B rows %.1f GB/s", static_cast<long long>(L),
             row_j["copy2d_gbps"].get<double>(), row_j["segment_loop_gbps"].get<double>(), row_j["exact_gbps"].get<double>(),
             row_j["rows256_2d_gbps"].get<double>());
    std::printf("strided %6lld  2d %6.1f  loop %6.1f  exact %6.1f  rows256 %6.1f GB/s\n", static_cast<long long>(L),
                row_j["copy2d_gbps"].get<double>(), row_j["segment_loop_gbps"].get<double>(),
                row_j["exact_gbps"].get<double>(), row_j["rows256_2d_gbps"].get<double>());
    st.add("strided", std::move(row_j));
  }
}

// --- pin ------------------------------------------------------------------------

void pin(run_state& st) {
  for (index_t bytes : {index_t(256) << 20, index_t(1) << 30}) {
    if (st.skip("pin " + std::to_string(bytes))) return;
    const double gib = double(bytes) / double(index_t(1) << 30);
    json row{{"bytes", bytes}};
    {
      void* p = nullptr;
      auto t0 = clock_type::now();
      WS_CUDA_TRY(cudaHostAlloc(&p, std::size_t(bytes), cudaHostAllocDefault));
      row["host_alloc_ms_per_gib"] = seconds_since(t0) * 1e3 / gib;
      t0 = clock_type::now();
      WS_CUDA_TRY(cudaFreeHost(p));
      row["free_host_ms_per_gib"] = seconds_since(t0) * 1e3 / gib;
    }
    for (bool touch : {true, false}) {
      pageable_buffer b(bytes, touch);
      auto t0 = clock_type::now();
      WS_CUDA_TRY(cudaHostRegister(b.data(), std::size_t(bytes), cudaHostRegisterDefault));
      row[touch ? "register_touched_ms_per_gib" : "register_untouched_ms_per_gib"] = seconds_since(t0) * 1e3 / gib;
      t0 = clock_type::now();
      WS_CUDA_TRY(cudaHostUnregister(b.data()));
      row[touch ? "unregister_ms_per_gib" : "unregister_untouched_ms_per_gib"] = seconds_since(t0) * 1e3 / gib;
    }
    {  // the library's strategy: parallel pre-touch + chunked register, all included
      ws::cuda_host_register::reset_statistics();
      { ws::host_allocation a = ws::cuda_host_register{}.allocate(bytes); }
      row["cuda_host_register_allocator_ms_per_gib"] = ws::cuda_host_register::statistics().seconds_per_gib() * 1e3;
    }
    progress(st.bud, "pin %.2f GiB: cudaHostAlloc %.0f ms/GiB, register (touched) %.0f ms/GiB, allocator %.0f ms/GiB", gib,
             row["host_alloc_ms_per_gib"].get<double>(), row["register_touched_ms_per_gib"].get<double>(),
             row["cuda_host_register_allocator_ms_per_gib"].get<double>());
    std::printf("pin %6.2f GiB  cudaHostAlloc %7.1f  register(touched) %7.1f  register(untouched) %7.1f  allocator %7.1f ms/GiB\n",
                gib, row["host_alloc_ms_per_gib"].get<double>(), row["register_touched_ms_per_gib"].get<double>(),
                row["register_untouched_ms_per_gib"].get<double>(), row["cuda_host_register_allocator_ms_per_gib"].get<double>());
    st.add("pin", std::move(row));
  }
}

// --- cpu_read -------------------------------------------------------------------

/// Best GB/s of `reps` parallel reads of [p, p + bytes) with `threads` threads.
double read_gbps(const std::byte* p, index_t bytes, int threads, int reps) {
  using batch = xsimd::batch<std::uint64_t>;
  const auto* w = reinterpret_cast<const std::uint64_t*>(p);
  const std::size_t step = 4 * batch::size;
  const std::size_t n = std::size_t(bytes / 8) / step * step;
  double best = 0;
  static std::uint64_t sink = 0;
  for (int r = 0; r < reps; ++r) {
    std::uint64_t total = 0;
    const auto t0 = clock_type::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      batch a0(std::uint64_t(0)), a1(std::uint64_t(0)), a2(std::uint64_t(0)), a3(std::uint64_t(0));
#pragma omp for schedule(static)
      for (std::size_t i = 0; i < n; i += step) {
        a0 += batch::load_unaligned(w + i);
        a1 += batch::load_unaligned(w + i + batch::size);
        a2 += batch::load_unaligned(w + i + 2 * batch::size);
        a3 += batch::load_unaligned(w + i + 3 * batch::size);
      }
      total += xsimd::hadd((a0 + a1) + (a2 + a3));
    }
    best = std::max(best, gb(double(n * 8), seconds_since(t0)));
    sink += total;
  }
  return best;
}

void cpu_read(run_state& st) {
  const index_t bytes = index_t(1) << 30;
  host_alloc_buffer pinned(bytes);
  std::memset(pinned.data(), 1, std::size_t(bytes));
  pageable_buffer pageable(bytes);
  std::memset(pageable.data(), 1, std::size_t(bytes));
  for (int t : st.o->threads) {
    if (st.skip("cpu_read " + std::to_string(t))) return;
    // Alternate the two so that a slow moment of the machine hits both.
    double pin = 0, pag = 0;
    for (int k = 0; k < 2; ++k) {
      pag = std::max(pag, read_gbps(pageable.data(), bytes, t, 2));
      pin = std::max(pin, read_gbps(pinned.data(), bytes, t, 2));
    }
    json row{{"threads", t}, {"bytes", bytes}, {"pageable_gbps", pag}, {"pinned_gbps", pin}, {"pinned_over_pageable", pin / pag}};
    progress(st.bud, "cpu_read %d threads: pageable %.1f GB/s, pinned %.1f GB/s", t, pag, pin);
    std::printf("cpu_read %3d threads  pageable %6.1f GB/s  pinned %6.1f GB/s  ratio %.3f\n", t, pag, pin, pin / pag);
    st.add("cpu_read", std::move(row));
  }
}

// --- rebuild --------------------------------------------------------------------

void rebuild(run_state& st) {
  using P = ws::presets::deepseek_v2_lite;
  const auto lay = P::layout();
  const int batch = 16;
  index_t cap = 0;
  for (index_t l : st.o->rebuild_lengths) cap = std::max(cap, l);
  monolithic_cache<P::layout_type> mono(lay, batch, cap, 1, st.o->splice_threads, 7);
  // The partitioned format: the same KV already in page-locked blocks, each
  // sequence's blocks contiguous (as prefill places them), streamed through two
  // ping-pong buffers of 64 MiB, copies of at most one buffer.
  const index_t max_bytes = index_t(batch) * cap * lay.token_bytes();
  ws::host_allocation pinned = ws::cuda_host_register{}.allocate(max_bytes);
  std::memset(pinned.data(), 1, std::size_t(max_bytes));
  const index_t pp = index_t(64) << 20;
  device_buffer pingpong(2 * pp);
  timer_stream ts;
  for (index_t L : st.o->rebuild_lengths) {
    if (st.skip("rebuild L " + std::to_string(L))) return;
    const index_t bytes = mono.step_bytes(L);
    std::vector<double> tot;
    rebuild_times last;
    mono.step(0, std::min<index_t>(L, 2048));  // warm the allocation paths
    for (int r = 0; r < std::max(2, st.o->reps - 1); ++r) {
      last = mono.step(0, L);
      tot.push_back(last.total() * 1e3);
    }
    const index_t seq_bytes = L * lay.token_bytes();
    const auto part = best_median(st.o->reps, [&] {
      return ts.time([&](cudaStream_t s) {
        int b = 0;
        for (int q = 0; q < batch; ++q)
          for (index_t off = 0; off < seq_bytes; off += pp, b ^= 1) {
            // A copy may not span two page-locked registrations (cuda_host_register
            // registers in chunks): split it where one ends, as the backend does.
            const std::byte* src = pinned.data() + index_t(q) * seq_bytes + off;
            const index_t n = std::min(pp, seq_bytes - off);
            ws::cuda_detail::pinned_registry::instance().split(src, n, [&](index_t o, index_t len) {
              WS_CUDA_TRY(cudaMemcpyAsync(pingpong.data() + b * pp + o, src + o, std::size_t(len),
                                          cudaMemcpyHostToDevice, s));
            });
          }
      });
    });
    json row{{"preset", std::string(P::name)},
             {"batch", batch},
             {"tokens_per_sequence", L},
             {"bytes", bytes},
             {"monolithic_ms", median(tot)},
             {"monolithic", last.to_json()},
             {"partitioned_ms", part.second * 1e3},
             {"partitioned_gbps", gb(double(bytes), part.second)}};
    row["monolithic_over_partitioned"] = row["monolithic_ms"].get<double>() / std::max(1e-9, row["partitioned_ms"].get<double>());
    progress(st.bud, "rebuild L %lld: monolithic %.2f ms (pin %.2f, splice %.2f, H2D %.2f, free %.2f), partitioned %.2f ms",
             static_cast<long long>(L), row["monolithic_ms"].get<double>(), last.alloc_pin * 1e3, last.splice * 1e3,
             last.h2d * 1e3, last.release * 1e3, row["partitioned_ms"].get<double>());
    std::printf("rebuild %6lld  monolithic %9.2f ms  partitioned %7.2f ms  x%.1f\n", static_cast<long long>(L),
                row["monolithic_ms"].get<double>(), row["partitioned_ms"].get<double>(),
                row["monolithic_over_partitioned"].get<double>());
    st.add("rebuild", std::move(row));
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    run_state st{&o, budget(o.budget_seconds), json_file(o.json_path)};
    st.out.doc["tool"] = "micro_bench";
    st.out.doc["machine"] = machine_info(argc, argv);
    {
      int dev = 0;
      cudaDeviceProp p{};
      WS_CUDA_TRY(cudaGetDevice(&dev));
      WS_CUDA_TRY(cudaGetDeviceProperties(&p, dev));
      st.out.doc["device"] = json{{"gpu", p.name}, {"backend", "cuda"}};
      WS_CUDA_TRY(cudaFree(nullptr));  // context creation out of the timings
    }
    for (const char* s : {"transfer", "strided", "pin", "cpu_read", "rebuild"}) st.out.doc[s] = json::array();
    st.out.write();
    progress(st.bud, "micro_bench: %s", st.out.doc["device"]["gpu"].get<std::string>().c_str());
    if (o.has("transfer")) transfer(st);
    if (o.has("strided")) strided(st);
    if (o.has("pin")) pin(st);
    if (o.has("cpu_read")) cpu_read(st);
    if (o.has("rebuild")) rebuild(st);
    st.out.doc["complete"] = st.complete;
    st.out.doc["elapsed_seconds"] = st.bud.elapsed();
    st.out.write();
    progress(st.bud, "done");
    return 0;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "micro_bench: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "micro_bench: error: %s\n", e.what());
    return 3;
  }
}
