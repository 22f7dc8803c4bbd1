// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/pinned_allocators.hpp — page-locking strategies for the pinned
// load region on a real GPU (paper §4.3, §7.7; fault kind K8, docs/RELIABILITY.md).
//
//   cuda_host_alloc     cudaHostAlloc(cudaHostAllocPortable): one call, the driver
//                       allocates and pins; the slower of the two (pin times:
//                       docs/CUDA-ENGINE.md).
//   cuda_host_register  mmap pageable memory, pre-touch it with several threads,
//                       then cudaHostRegister(cudaHostRegisterPortable |
//                       cudaHostRegisterMapped) in chunks of at most
//                       `chunk_bytes` (1 GiB by default) so that no single call
//                       pins an unbounded range; with the pages pre-touched,
//                       several times faster than cudaHostAlloc
//                       (docs/CUDA-ENGINE.md).
//
// NUMA placement (numa.hpp, docs/MULTI-GPU.md). cuda_host_register owns its
// pages, so it can place them: with `numa_node` set to an online node it binds
// the fresh mapping to that node (mbind, MPOL_BIND) before the pre-touch, so
// every page is allocated there; cuda/numa.hpp gives a device's node.
// cuda_host_alloc cannot: the driver allocates its pages, and where they land
// follows the driver and the calling thread's memory policy, not the allocator. It
// has no `numa_node`, so asking it for a node does not compile
// (numa_placeable_allocator is false for it); place a region with
// cuda_host_register instead.
//
// Device mapping. Both make the region addressable by kernels, which the
// sparse pipeline's device pull needs (sparse_transfer::device_pull: a copy
// kernel reads selected blocks straight out of the region over PCIe;
// docs/SPARSE.md §4.1). cudaHostAlloc memory is mapped into every device's
// address space automatically under unified addressing (all 64-bit Linux
// processes), whatever the flags, at the same address as on the host.
// cudaHostRegister maps only with cudaHostRegisterMapped (cudaHostRegisterDefault
// would imply it under unified addressing, cudaHostRegisterPortable alone does
// not promise it), hence the flag; on a device with
// cudaDevAttrCanUseHostPointerForRegisteredMem the host pointer is then the
// device address too (cuda_backend checks that attribute before it pulls).
// Mapping adds no copy and no page-locking cost: DMA copies behave as before.
//
// Both satisfy pinned_allocator (host_memory.hpp). They run at cache init and
// when the pinned region grows (never inside a step). A refusal throws
// pinned_memory_error naming "pinned memory", the size (format_bytes) and the
// CUDA error, and leaves nothing allocated or registered. Time spent pinning is
// accumulated per strategy (statistics()) so caches and benchmarks can report
// it; with the environment variable WRITESCOPE_LOG_PINNING set, each pinning is
// also logged to stderr.
//
// Registered ranges. Every range these allocators page-lock (one per
// cudaHostAlloc, one per cudaHostRegister chunk) is recorded in a process-wide
// registry. The CUDA driver rejects a copy whose host range spans two
// registrations, or registered and unregistered memory (CUDA_ERROR_INVALID_VALUE),
// and such spans happen: a coalesced run of blocks can cross a 1 GiB register
// chunk or two slabs that mmap placed next to each other. cuda_backend splits
// every host-side copy at registration boundaries (split_at_registrations).
//
// Release: synchronizes the device first (an eviction D2H or a streamed H2D may
// still use the memory), then unregisters / frees. Release happens when the
// cache is destroyed, off the step path.
//
// Threading: allocate() and release may run on any thread; the registry is
// guarded by a shared mutex (readers: the copy issuers of cuda_backend).
#pragma once

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "../detail/thread_affinity.hpp"
#include "../error.hpp"
#include "../host_memory.hpp"
#include "../numa.hpp"
#include "cuda_error.hpp"

namespace writescope {

/// Accumulated cost of one pinning strategy since the program started (or the
/// last reset_statistics()).
struct pin_statistics {
  double pin_seconds = 0.0;    ///< inside cudaHostAlloc / cudaHostRegister
  double touch_seconds = 0.0;  ///< pre-touching pages (cuda_host_register only)
  index_t bytes = 0;           ///< bytes successfully page-locked
  std::int64_t allocations = 0;
  std::int64_t failures = 0;

  /// (pin + touch) seconds per GiB pinned; 0 when nothing was pinned.
  [[nodiscard]] double seconds_per_gib() const noexcept {
    return bytes > 0 ? (pin_seconds + touch_seconds) / (double(bytes) / double(index_t{1} << 30)) : 0.0;
  }
};

namespace cuda_detail {

struct pin_counters {
  std::atomic<std::int64_t> pin_ns{0}, touch_ns{0}, bytes{0}, allocations{0}, failures{0};

  pin_statistics read() const noexcept {
    pin_statistics s;
    s.pin_seconds = double(pin_ns.load()) * 1e-9;
    s.touch_seconds = double(touch_ns.load()) * 1e-9;
    s.bytes = bytes.load();
    s.allocations = allocations.load();
    s.failures = failures.load();
    return s;
  }
  void reset() noexcept {
    pin_ns = 0;
    touch_ns = 0;
    bytes = 0;
    allocations = 0;
    failures = 0;
  }
};

/// The counters of one pinning strategy (Strategy: its allocator type), shared
/// by all its instances.
template <class Strategy>
inline pin_counters& counters_of() noexcept {
  static pin_counters c;
  return c;
}

inline std::int64_t elapsed_ns(std::chrono::steady_clock::time_point t0) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

inline void log_pinning(const char* how, index_t bytes, double pin_s, double touch_s) {
  if (std::getenv("WRITESCOPE_LOG_PINNING") == nullptr) return;
  std::fprintf(stderr, "writescope: pinned %s with %s in %.3f s (touch %.3f s, %.0f ms/GiB)\n",
               format_bytes(bytes).c_str(), how, pin_s + touch_s, touch_s,
               1e3 * (pin_s + touch_s) / std::max(1e-30, double(bytes) / double(index_t{1} << 30)));
}

/// Process-wide set of page-locked host ranges made by the allocators of this
/// file (see the file comment).
class pinned_registry {
 public:
  static pinned_registry& instance() {
    static pinned_registry r;
    return r;
  }

  void add(const void* p, index_t bytes) {
    std::unique_lock lk(mu_);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    ranges_[a] = a + static_cast<std::uintptr_t>(bytes);
  }
  void remove(const void* p) {
    std::unique_lock lk(mu_);
    ranges_.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  /// Starts of all registered ranges inside [p, p + bytes).
  std::vector<void*> starts_within(const void* p, index_t bytes) const {
    std::shared_lock lk(mu_);
    std::vector<void*> out;
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    for (auto it = ranges_.lower_bound(a); it != ranges_.end() && it->first < a + std::uintptr_t(bytes); ++it)
      out.push_back(reinterpret_cast<void*>(it->first));
    return out;
  }
  [[nodiscard]] std::size_t size() const {
    std::shared_lock lk(mu_);
    return ranges_.size();
  }
  /// The largest span [first, second) of back-to-back registered ranges that
  /// holds address p (several when p's range ends where the next one starts: a
  /// cudaHostRegister region of several chunks); {0, 0} when p is in none.
  [[nodiscard]] std::pair<std::uintptr_t, std::uintptr_t> covering_span(const void* p) const {
    std::shared_lock lk(mu_);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = ranges_.upper_bound(a);  // first range starting after a
    if (it == ranges_.begin()) return {0, 0};
    --it;  // the last range starting at or before a
    if (a >= it->second) return {0, 0};
    std::uintptr_t lo = it->first, hi = it->second;
    for (auto next = std::next(it); next != ranges_.end() && next->first == hi; ++next) hi = next->second;
    for (auto prev = it; prev != ranges_.begin();) {
      --prev;
      if (prev->second != lo) break;
      lo = prev->first;
    }
    return {lo, hi};
  }
  /// True when every byte of [p, p + bytes) lies in registered ranges
  /// (possibly several back-to-back ones: a run of blocks across two
  /// cudaHostRegister chunks). bytes <= 0: true.
  [[nodiscard]] bool covers(const void* p, index_t bytes) const {
    if (bytes <= 0) return true;
    const auto span = covering_span(p);
    return reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(bytes) <= span.second;
  }
  /// True when [p, p + bytes) lies inside one registered range.
  [[nodiscard]] bool contains(const void* p, index_t bytes) const {
    std::shared_lock lk(mu_);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    --it;
    return a >= it->first && a + std::uintptr_t(bytes) <= it->second;
  }

  /// Calls f(offset, length) for consecutive pieces of [p, p + bytes) such that
  /// no piece crosses the start or end of a registered range. A range with no
  /// registration inside is one piece. f runs under a shared lock; it must not
  /// call back into the registry.
  template <class F>
  void split(const void* p, index_t bytes, F&& f) const {
    std::shared_lock lk(mu_);
    const auto begin = reinterpret_cast<std::uintptr_t>(p);
    const auto end = begin + static_cast<std::uintptr_t>(bytes);
    std::uintptr_t a = begin;
    while (a < end) {
      std::uintptr_t piece_end = end;
      auto next = ranges_.upper_bound(a);  // first range starting after a
      if (next != ranges_.begin()) {
        auto cur = std::prev(next);
        if (a < cur->second) piece_end = std::min(piece_end, cur->second);  // inside a range: stop at its end
      }
      if (next != ranges_.end()) piece_end = std::min(piece_end, next->first);  // stop where the next one starts
      f(index_t(a - begin), index_t(piece_end - a));
      a = piece_end;
    }
  }

 private:
  mutable std::shared_mutex mu_;
  std::map<std::uintptr_t, std::uintptr_t> ranges_;  // start -> end (exclusive)
};

inline void release_host_alloc(void* p, index_t, void*) noexcept {
  ignore(cudaDeviceSynchronize());
  try {
    pinned_registry::instance().remove(p);
  } catch (...) {
  }
  ignore(cudaFreeHost(p));
}

inline index_t page_bytes() noexcept {
  const long ps = ::sysconf(_SC_PAGESIZE);
  return ps > 0 ? index_t(ps) : index_t{4096};
}

inline index_t round_up(index_t v, index_t m) noexcept { return (v + m - 1) / m * m; }

inline void release_registered(void* p, index_t bytes, void*) noexcept {
  ignore(cudaDeviceSynchronize());
  try {
    auto& reg = pinned_registry::instance();
    for (void* s : reg.starts_within(p, bytes)) {
      ignore(cudaHostUnregister(s));
      reg.remove(s);
    }
  } catch (...) {
  }
  ::munmap(p, static_cast<std::size_t>(round_up(bytes, page_bytes())));
}

[[noreturn]] inline void throw_pin_error(pin_counters& c, const std::string& msg) {
  ++c.failures;
  throw pinned_memory_error(msg);
}

inline std::string cuda_error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

}  // namespace cuda_detail

/// Number of page-locked ranges currently registered by cuda_host_alloc and
/// cuda_host_register (tests: nothing half-registered is left after a refusal).
inline std::size_t registered_pinned_ranges() { return cuda_detail::pinned_registry::instance().size(); }

/// Pinned load region through cudaHostAlloc (portable, write-back cached;
/// device-mapped under unified addressing, see the file comment). No NUMA
/// placement: the driver allocates the pages (file comment); there is no
/// `numa_node` member to set.
struct cuda_host_alloc {
  using allocator_concept = pinned_allocator_tag;
  static constexpr const char* name = "cudaHostAlloc";
  static constexpr bool page_locked = true;

  /// Page-locks `bytes` (0 gives an empty allocation). Throws
  /// pinned_memory_error ("pinned memory: cudaHostAlloc of <size> failed: <CUDA error>").
  host_allocation allocate(index_t bytes) const {
    if (bytes <= 0) return {};
    // Past the memory cgroup's limit the OOM killer, not an error, would answer.
    if (std::string m = detail::memory_cgroup_refusal(bytes, "cudaHostAlloc"); !m.empty())
      cuda_detail::throw_pin_error(counters(), m);
    void* p = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    const cudaError_t e = cudaHostAlloc(&p, static_cast<std::size_t>(bytes), cudaHostAllocPortable);
    const std::int64_t ns = cuda_detail::elapsed_ns(t0);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      cuda_detail::throw_pin_error(counters(), "pinned memory: cudaHostAlloc of " + format_bytes(bytes) +
                                                   " for the pinned load region failed: " +
                                                   cuda_detail::cuda_error_text(e));
    }
    try {
      cuda_detail::pinned_registry::instance().add(p, bytes);
    } catch (...) {
      cuda_detail::ignore(cudaFreeHost(p));
      throw;
    }
    counters().pin_ns += ns;
    counters().bytes += bytes;
    ++counters().allocations;
    cuda_detail::log_pinning(name, bytes, double(ns) * 1e-9, 0.0);
    return host_allocation(p, bytes, &cuda_detail::release_host_alloc);
  }

  /// Time and bytes pinned by this strategy so far (all instances).
  static pin_statistics statistics() noexcept { return counters().read(); }
  static void reset_statistics() noexcept { counters().reset(); }

 private:
  static cuda_detail::pin_counters& counters() noexcept { return cuda_detail::counters_of<cuda_host_alloc>(); }
};

/// Pinned load region through mmap + pre-touch + cudaHostRegister in chunks
/// (portable and device-mapped, see the file comment).
struct cuda_host_register {
  using allocator_concept = pinned_allocator_tag;
  static constexpr const char* name = "cudaHostRegister";
  static constexpr bool page_locked = true;

  /// Most bytes one cudaHostRegister call page-locks (rounded up to pages).
  index_t chunk_bytes = index_t{1} << 30;
  /// Threads that pre-touch the pages; 0 = the hardware threads, at most 16.
  int touch_threads = 0;
  /// Fault injection, for tests only (fault kind K8): in every allocation,
  /// chunk number `inject_refusal_chunk` (0-based) is not registered and counts
  /// as refused by cudaHostRegister with cudaErrorMemoryAllocation, so that the
  /// refusal path runs at a size a test machine can pin (a real refusal needs
  /// more memory than it has). -1 (the default): no injection.
  index_t inject_refusal_chunk = -1;
  /// Mutation switch, for tests only (fault kind K8: with the guard removed,
  /// the test must fail): a refused chunk is skipped and left pageable, and
  /// allocate() succeeds, instead of undoing the chunks registered so far and
  /// throwing pinned_memory_error. The refusal then no longer shows at init:
  /// debug builds report it at the first step with a streamed run that starts
  /// or ends in the skipped chunk (gpu_engine's page-lock check looks at run
  /// ends), release builds silently copy from it as pageable memory. Off by
  /// default; never set it in production.
  bool skip_refusal_check = false;
  /// The NUMA node the pages are bound to (mbind, MPOL_BIND) between the mmap
  /// and the pre-touch, so that every page is allocated there; no_numa_node
  /// (the default): no placement. A node that is not online throws
  /// config_error (naming it and the online nodes) before anything is mapped;
  /// a refused mbind throws pinned_memory_error naming the size, the node and
  /// the errno text, with nothing left mapped.
  int numa_node = no_numa_node;

  /// Page-locks `bytes` (0 gives an empty allocation). Throws
  /// pinned_memory_error naming pinned memory, the size and the CUDA error (or
  /// the system error of mmap); then nothing stays mapped or registered.
  host_allocation allocate(index_t bytes) const {
    if (bytes <= 0) return {};
    using namespace cuda_detail;
    if (numa_node != no_numa_node) require_online_numa_node(numa_node, "cuda_host_register");
    const index_t page = page_bytes();
    const index_t mapped = round_up(bytes, page);
    // The pre-touch below would meet the cgroup OOM killer past the memory cgroup's limit.
    if (std::string m = detail::memory_cgroup_refusal(mapped, "cudaHostRegister"); !m.empty())
      throw_pin_error(counters(), m);
    const long phys_pages = ::sysconf(_SC_PHYS_PAGES);
    if (phys_pages > 0 && mapped > index_t(phys_pages) * page)
      throw_pin_error(counters(), "pinned memory: cannot page-lock " + format_bytes(bytes) +
                                      " with cudaHostRegister: the machine has " +
                                      format_bytes(index_t(phys_pages) * page) + " of physical memory");
    void* p = ::mmap(nullptr, static_cast<std::size_t>(mapped), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw_pin_error(counters(), "pinned memory: reserving " + format_bytes(bytes) +
                                      " of host memory for cudaHostRegister failed: " + std::strerror(errno));
    auto* base = static_cast<unsigned char*>(p);
    if (numa_node != no_numa_node)
      if (std::string m = detail::numa_place_pinned(p, mapped, numa_node, "cudaHostRegister"); !m.empty()) {
        ::munmap(p, static_cast<std::size_t>(mapped));
        throw_pin_error(counters(), m);
      }

    // Pre-touch: fault every page in now, in parallel, so that registration
    // only pins resident pages, which is several times faster than pinning
    // untouched ones (docs/CUDA-ENGINE.md).
    const auto t_touch = std::chrono::steady_clock::now();
    pre_touch(base, mapped, page);
    const std::int64_t touch_ns = elapsed_ns(t_touch);

    const index_t chunk = round_up(std::max(chunk_bytes, page), page);
    const index_t num_chunks = (mapped + chunk - 1) / chunk;
    const auto t_pin = std::chrono::steady_clock::now();
    auto& reg = pinned_registry::instance();
    for (index_t k = 0; k < num_chunks; ++k) {
      const index_t off = k * chunk;
      const index_t len = std::min(chunk, mapped - off);
      // Mapped: kernels may read the region through its host addresses (device pull; file comment).
      const bool injected = k == inject_refusal_chunk;  // tests only
      const cudaError_t e = injected ? cudaErrorMemoryAllocation
                                     : cudaHostRegister(base + off, static_cast<std::size_t>(len),
                                                        cudaHostRegisterPortable | cudaHostRegisterMapped);
      if (e == cudaSuccess) {
        try {
          reg.add(base + off, len);
          continue;
        } catch (...) {
          ignore(cudaHostUnregister(base + off));
        }
      } else {
        if (!injected) (void)cudaGetLastError();
        if (skip_refusal_check) continue;  // mutation only: the chunk stays pageable
      }
      // Undo: unregister the chunks registered so far, unmap, report.
      for (index_t j = 0; j < k; ++j) {
        ignore(cudaHostUnregister(base + j * chunk));
        reg.remove(base + j * chunk);
      }
      ::munmap(p, static_cast<std::size_t>(mapped));
      throw_pin_error(counters(), "pinned memory: cudaHostRegister of " + format_bytes(bytes) + " failed at chunk " +
                                      std::to_string(k + 1) + " of " + std::to_string(num_chunks) + " (" +
                                      format_bytes(len) + " at offset " + format_bytes(off) + "): " +
                                      (e == cudaSuccess ? std::string("registry insertion failed")
                                                        : cuda_error_text(e)) +
                                      (injected ? " (injected: cuda_host_register::inject_refusal_chunk)" : ""));
    }
    const std::int64_t pin_ns = elapsed_ns(t_pin);
    counters().pin_ns += pin_ns;
    counters().touch_ns += touch_ns;
    counters().bytes += bytes;
    ++counters().allocations;
    log_pinning(name, bytes, double(pin_ns) * 1e-9, double(touch_ns) * 1e-9);
    return host_allocation(p, bytes, &release_registered);
  }

  /// Time and bytes pinned by this strategy so far (all instances).
  static pin_statistics statistics() noexcept { return counters().read(); }
  static void reset_statistics() noexcept { counters().reset(); }

 private:
  static cuda_detail::pin_counters& counters() noexcept { return cuda_detail::counters_of<cuda_host_register>(); }

  void pre_touch(unsigned char* base, index_t bytes, index_t page) const {
    const index_t pages = bytes / page;
    int threads = touch_threads > 0 ? touch_threads : int(std::thread::hardware_concurrency());
    threads = std::clamp(threads, 1, 16);
    threads = int(std::min<index_t>(threads, std::max<index_t>(1, bytes >> 26)));  // >= 64 MiB per thread
    auto touch = [base, page](index_t first, index_t last) {
      for (index_t i = first; i < last; ++i) static_cast<volatile unsigned char*>(base)[i * page] = 0;
    };
    if (threads == 1) {
      touch(0, pages);
      return;
    }
    std::vector<std::thread> pool;
    pool.reserve(std::size_t(threads));
    const index_t per = (pages + threads - 1) / threads;
    try {
      for (int t = 0; t < threads; ++t) {
        const index_t first = std::min(pages, index_t(t) * per);
        const index_t last = std::min(pages, first + per);
        pool.emplace_back([touch, first, last] {
          detail::widen_thread_affinity();
          touch(first, last);
        });
      }
    } catch (...) {  // could not start a thread: finish on this one
      for (auto& th : pool) th.join();
      touch(0, pages);
      return;
    }
    for (auto& th : pool) th.join();
  }
};

static_assert(pinned_allocator<cuda_host_alloc>);
static_assert(pinned_allocator<cuda_host_register>);
static_assert(!numa_placeable_allocator<cuda_host_alloc>);  // the driver places its pages
static_assert(numa_placeable_allocator<cuda_host_register>);

}  // namespace writescope
