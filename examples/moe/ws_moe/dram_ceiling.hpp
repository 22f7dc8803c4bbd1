// SPDX-License-Identifier: Apache-2.0
// ws_moe/dram_ceiling.hpp — the host's DRAM read ceiling as the CPU experts see
// it: every thread of one OpenMP team stream-reads its contiguous share of a
// buffer far above the last-level cache with the widest vector loads the CPU
// has (64-byte AVX-512, 32-byte AVX2, else scalar), summing the words so the
// loads cannot be dropped; the best of a few full passes, in GB/s (1e9 bytes).
// The AVX-512 path runs three variants and keeps the fastest: one stream per
// thread with hardware prefetch alone, the same with software prefetch 2 KiB
// ahead (it crosses 4 KiB pages, where the hardware prefetchers stop), and four
// streams per thread side by side (more misses in flight per core). measure_dram_ceiling asks for transparent huge
// pages on its buffer (madvise; ignored where THP is off). A ceiling that a
// kernel beats is a weak ceiling: both measures are there to keep it tight.
//
// Used by tools/bench_cpu_experts.cpp (the decode cases' ratio_dram) and by
// the CUDA decoder (device_decoder.hpp), which measures it once at setup with
// the CPU experts' thread count when a run has host experts: the denominator
// of the decode step's CPU expert bound (host expert bytes read per step /
// this ceiling; docs/DECODER-INTERNALS.md). Host compiler only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

#include <sys/mman.h>
#include <unistd.h>

#include "cpu_experts.hpp"

namespace ws_moe::cpu {

namespace dram_detail {
#if defined(__x86_64__)
template <bool Prefetch>
__attribute__((target("avx512f"))) inline std::uint64_t read_avx512(const std::uint64_t* p, std::size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 32 <= n; i += 32) {
    if constexpr (Prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 256), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 264), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 272), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 280), _MM_HINT_T0);
    }
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 8));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 16));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 24));
  }
  return std::uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3))));
}
/// Four streams at once: the share split in four quarters read side by side, one 64-byte line
/// of each per iteration (more misses in flight per core, as a kernel reading an expert's gate
/// and up rows together has).
__attribute__((target("avx512f"))) inline std::uint64_t read_avx512_4streams(const std::uint64_t* p, std::size_t n) {
  const std::size_t q = n / 4 / 8 * 8;
  const std::uint64_t *s0 = p, *s1 = p + q, *s2 = p + 2 * q, *s3 = p + 3 * q;
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 8 <= q; i += 8) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(s0 + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(s1 + i));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(s2 + i));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(s3 + i));
  }
  std::uint64_t t = std::uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3))));
  for (std::size_t i = 4 * q; i < n; ++i) t += p[i];
  return t;
}
__attribute__((target("avx2"))) inline std::uint64_t read_avx2(const std::uint64_t* p, std::size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) std::uint64_t t[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return t[0] + t[1] + t[2] + t[3];
}
#endif
inline std::uint64_t read_plain(const std::uint64_t* p, std::size_t n) {
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < n; ++i) s += p[i];
  return s;
}
/// The sums of every pass go here, so the reads are never dead code.
inline std::uint64_t sink = 0;
}  // namespace dram_detail

/// Best GB/s of `reps` full reads of p[0, bytes) with `threads` threads, static contiguous split.
inline double dram_read_gbps(const std::uint64_t* p, std::size_t bytes, int threads, int reps) {
  const std::size_t words = bytes / 8;
  const isa_kind k = detail::probe_isa();
  double best = 0;
  // AVX-512: passes cycle through three variants (one stream, one stream with software
  // prefetch, four streams); the best pass of any counts.
  const int passes = k >= isa_kind::avx512 ? 3 * reps : reps;
  for (int r = 0; r < passes; ++r) {
    std::uint64_t total = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(_OPENMP)
      const std::size_t nt = std::size_t(omp_get_num_threads()), id = std::size_t(omp_get_thread_num());
#else
      const std::size_t nt = 1, id = 0;
#endif
      const std::size_t b = words * id / nt / 64 * 64, e = id + 1 == nt ? words : words * (id + 1) / nt / 64 * 64;
#if defined(__x86_64__)
      if (k >= isa_kind::avx512)
        total += r % 3 == 0   ? dram_detail::read_avx512<false>(p + b, e - b)
                 : r % 3 == 1 ? dram_detail::read_avx512<true>(p + b, e - b)
                              : dram_detail::read_avx512_4streams(p + b, e - b);
      else if (k >= isa_kind::avx2)
        total += dram_detail::read_avx2(p + b, e - b);
      else
#endif
        total += dram_detail::read_plain(p + b, e - b);
    }
    best = std::max(best, double(bytes) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
    dram_detail::sink += total;
  }
  (void)k;
  return best;
}

/// The buffer dram_read_ceiling() reads by default: 1 GiB, or 8 × the L3
/// cache when that is larger (sysconf's L3 size; at most 16 GiB).
inline std::size_t dram_ceiling_buffer_bytes() {
  std::size_t bytes = std::size_t{1} << 30;
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) bytes = std::max(bytes, std::size_t(l3) * 8);
#endif
  return std::min(bytes, std::size_t{16} << 30);
}

/// One measurement of the ceiling: GB/s, the buffer, threads, passes and the seconds it took (buffer included).
struct dram_ceiling {
  double gbps = 0.0;
  std::size_t buffer_bytes = 0;
  int threads = 0;
  int passes = 0;
  double seconds = 0.0;
};

/// Allocates `bytes` (0: dram_ceiling_buffer_bytes()), first-touches it with
/// the same `threads` (0: omp_get_max_threads()) and split as the reads (so its pages sit where those
/// threads run), reads it `passes` times (dram_read_gbps: the best pass) and
/// frees it.
inline dram_ceiling measure_dram_ceiling(int threads, std::size_t bytes = 0, int passes = 5) {
  const auto t0 = std::chrono::steady_clock::now();
  threads = detail::team_size(threads);
  if (bytes == 0) bytes = dram_ceiling_buffer_bytes();
  // 2 MiB-aligned (a whole number of huge pages) when large enough, else 4 KiB pages
  const std::size_t align = bytes >= (std::size_t{2} << 20) ? std::size_t{2} << 20 : 4096;
  bytes = std::max<std::size_t>(bytes / align * align, align);
  struct free_it {
    void operator()(void* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<std::uint64_t[], free_it> buf(static_cast<std::uint64_t*>(std::aligned_alloc(align, bytes)));
  if (!buf) throw std::bad_alloc();
  const std::size_t words = bytes / 8;
  std::uint64_t* p = buf.get();
#if defined(MADV_HUGEPAGE)
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // before the first touch; a refusal only costs TLB misses
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < words; ++i) p[i] = i;
  dram_ceiling c;
  c.gbps = dram_read_gbps(p, bytes, threads, passes);
  c.buffer_bytes = bytes;
  c.threads = threads;
  c.passes = passes;
  c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return c;
}

}  // namespace ws_moe::cpu
