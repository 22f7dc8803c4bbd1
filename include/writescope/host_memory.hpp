// SPDX-License-Identifier: Apache-2.0
// writescope/host_memory.hpp — owning host allocations and the host-side
// pinned-allocation strategies (paper §4.3, §7.7; fault kind K8).
//
// host_allocation is one owning RAII type for every kind of host memory the
// library takes (pageable regions, page-locked regions, staging buffers); its
// release function is chosen by whoever allocated it. Allocation failures throw
// resource_error / pinned_memory_error naming the size, at init or at region
// growth — never in the middle of a decode step. mlock_allocator can bind its
// pages to a NUMA node (numa.hpp; numa_placeable_allocator).
#pragma once

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "config.hpp"
#include "error.hpp"
#include "numa.hpp"

namespace writescope {

/// "6.00 GiB (6442450944 bytes)".
inline std::string format_bytes(index_t bytes) {
  char buf[96];
  const double gib = double(bytes) / double(index_t{1} << 30);
  const double mib = double(bytes) / double(index_t{1} << 20);
  if (gib >= 1.0)
    std::snprintf(buf, sizeof buf, "%.2f GiB (%lld bytes)", gib, static_cast<long long>(bytes));
  else
    std::snprintf(buf, sizeof buf, "%.2f MiB (%lld bytes)", mib, static_cast<long long>(bytes));
  return buf;
}

/// An owning block of host memory with a custom release function. Movable, not copyable.
class host_allocation {
 public:
  using release_fn = void (*)(void* ptr, index_t bytes, void* context) noexcept;

  host_allocation() noexcept = default;
  host_allocation(void* ptr, index_t bytes, release_fn release, void* context = nullptr) noexcept
      : ptr_(ptr), bytes_(bytes), release_(release), context_(context) {}
  host_allocation(host_allocation&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)),
        release_(std::exchange(o.release_, nullptr)),
        context_(std::exchange(o.context_, nullptr)) {}
  host_allocation& operator=(host_allocation&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      release_ = std::exchange(o.release_, nullptr);
      context_ = std::exchange(o.context_, nullptr);
    }
    return *this;
  }
  host_allocation(const host_allocation&) = delete;
  host_allocation& operator=(const host_allocation&) = delete;
  ~host_allocation() { reset(); }

  void reset() noexcept {
    if (ptr_ && release_) release_(ptr_, bytes_, context_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  /// Gives up ownership without releasing; returns the pointer.
  [[nodiscard]] void* detach() noexcept {
    bytes_ = 0;
    return std::exchange(ptr_, nullptr);
  }
  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(ptr_); }
  [[nodiscard]] index_t size_bytes() const noexcept { return bytes_; }
  [[nodiscard]] explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  void* ptr_ = nullptr;
  index_t bytes_ = 0;
  release_fn release_ = nullptr;
  void* context_ = nullptr;
};

namespace detail {

inline void munmap_release(void* p, index_t bytes, void*) noexcept { ::munmap(p, static_cast<std::size_t>(bytes)); }
inline void munlock_munmap_release(void* p, index_t bytes, void*) noexcept {
  ::munlock(p, static_cast<std::size_t>(bytes));
  ::munmap(p, static_cast<std::size_t>(bytes));
}

/// Reserves `bytes` of pageable, zero-filled, not-yet-resident memory (pages
/// become resident on first touch). Throws resource_error naming `what`.
inline host_allocation map_pageable(index_t bytes, const char* what) {
  if (bytes <= 0) return {};
  void* p = ::mmap(nullptr, static_cast<std::size_t>(bytes), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw resource_error(std::string(what) + ": reserving " + format_bytes(bytes) +
                         " of host memory failed: " + std::strerror(errno));
  return host_allocation(p, bytes, &munmap_release);
}

/// What the memory cgroup of this process can still charge before its limit
/// (the smallest headroom over the cgroup and its ancestors, reclaimable file
/// cache counted as free), and the cgroup that binds. Page-locked memory is
/// charged like any other: past the limit the kernel's cgroup OOM killer ends
/// the process inside mlock / cudaHostAlloc / cudaHostRegister instead of
/// refusing the call, so pinning checks this first (K8). cgroup v1 (memory
/// controller at /sys/fs/cgroup/memory) and v2 (/sys/fs/cgroup); no limit,
/// no cgroup file system or an unreadable file: headroom INT64_MAX.
struct cgroup_headroom {
  index_t bytes = INT64_MAX;
  index_t limit = INT64_MAX;
  index_t usage = 0;
  std::string path;
};

inline cgroup_headroom memory_cgroup_headroom() {
  cgroup_headroom best;
  auto read_number = [](const std::string& file, index_t& v) {
    std::ifstream in(file);
    std::string w;
    if (!(in >> w) || w == "max") return false;
    char* end = nullptr;
    const unsigned long long x = std::strtoull(w.c_str(), &end, 10);
    if (end == w.c_str()) return false;
    v = x > static_cast<unsigned long long>(INT64_MAX) ? INT64_MAX : static_cast<index_t>(x);
    return true;
  };
  auto stat_field = [](const std::string& file, const char* key) {
    std::ifstream in(file);
    std::string k;
    unsigned long long v = 0;
    while (in >> k >> v)
      if (k == key) return static_cast<index_t>(v);
    return index_t{0};
  };
  std::ifstream cg("/proc/self/cgroup");
  std::string line, v1_path, v2_path;
  bool have_v2 = false;
  while (std::getline(cg, line)) {
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::stringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');)
      if (c == "memory") v1_path = path;
    if (line.compare(0, 3, "0::") == 0) {
      have_v2 = true;
      v2_path = path;
    }
  }
  const bool v1 = !v1_path.empty();
  if (!v1 && !have_v2) return best;
  const std::string root = v1 ? "/sys/fs/cgroup/memory" : "/sys/fs/cgroup";
  for (std::string p = v1 ? v1_path : v2_path;;) {
    const std::string dir = root + (p == "/" ? "" : p);
    index_t limit = 0, usage = 0;
    if (read_number(dir + (v1 ? "/memory.limit_in_bytes" : "/memory.max"), limit) &&
        read_number(dir + (v1 ? "/memory.usage_in_bytes" : "/memory.current"), usage) && limit < (index_t{1} << 60)) {
      const index_t reclaimable = stat_field(dir + "/memory.stat", v1 ? "total_inactive_file" : "inactive_file");
      const index_t room = limit > usage ? limit - usage + reclaimable : reclaimable;
      if (room < best.bytes) best = {room, limit, usage, p};
    }
    if (p.empty() || p == "/") break;
    const auto slash = p.find_last_of('/');
    p = slash == 0 || slash == std::string::npos ? "/" : p.substr(0, slash);
  }
  return best;
}

/// Empty when page-locking `bytes` more fits the memory cgroup's headroom;
/// otherwise the refusal message (naming `what`, the size and the cgroup).
inline std::string memory_cgroup_refusal(index_t bytes, const std::string& what) {
  const cgroup_headroom h = memory_cgroup_headroom();
  if (bytes <= h.bytes) return {};
  return "pinned memory: " + what + " of " + format_bytes(bytes) + " refused: the memory cgroup " + h.path +
         " (limit " + format_bytes(h.limit) + ", " + format_bytes(h.usage) + " in use) has only " +
         format_bytes(h.bytes) + " left; past it the kernel kills the process instead of refusing the lock";
}

/// Throws pinned_memory_error when memory_cgroup_refusal() refuses.
inline void require_memory_cgroup_headroom(index_t bytes, const std::string& what) {
  std::string m = memory_cgroup_refusal(bytes, what);
  if (!m.empty()) throw pinned_memory_error(m);
}

/// The page-owning allocators' NUMA step (numa.hpp): binds the freshly mapped,
/// untouched [p, p + bytes) to `node` with MPOL_BIND; empty on success,
/// otherwise the pinned-memory refusal naming `what`, the size, the node and
/// the errno text (the caller unmaps and throws).
inline std::string numa_place_pinned(void* p, index_t bytes, int node, const char* what) {
  std::string m = numa_bind_refusal(p, bytes, node);
  if (m.empty()) return m;
  return "pinned memory: placing " + format_bytes(bytes) + " for " + what + " on NUMA node " + std::to_string(node) +
         " failed: " + m;
}

}  // namespace detail

/// Opt-in tag of the pinned_allocator concept.
struct pinned_allocator_tag {};

/// How the pinned load region gets its memory: `allocate(bytes)` returns a
/// host_allocation that is page-locked for the backend's DMA engine (or, for
/// ablations and the host backend, deliberately not). Called at init and when
/// the region grows, never inside a step.
template <class A>
concept pinned_allocator = std::same_as<typename A::allocator_concept, pinned_allocator_tag> &&
                           requires(A& a, index_t bytes) {
                             { a.allocate(bytes) } -> std::same_as<host_allocation>;
                             { A::name } -> std::convertible_to<const char*>;
                             { A::page_locked } -> std::convertible_to<bool>;
                           };

/// Pageable memory standing in for the pinned region: the host backend's
/// default, and the "unpinned source" ablation on a real GPU (copies from it
/// are staged by the driver at a fraction of the pinned bandwidth).
struct pageable_allocator {
  using allocator_concept = pinned_allocator_tag;
  static constexpr const char* name = "pageable (not page-locked)";
  static constexpr bool page_locked = false;
  host_allocation allocate(index_t bytes) const { return detail::map_pageable(bytes, "pinned load region"); }
};

/// Page-locks host memory with mlock(2): the host backend's faithful stand-in
/// for cudaHostRegister (pre-touched, locked, counted against RLIMIT_MEMLOCK
/// and the memory cgroup). A refusal throws pinned_memory_error naming the
/// size and the limit; a request past the memory cgroup's headroom is refused
/// before mlock (detail::require_memory_cgroup_headroom).
///
/// NUMA placement: with `numa_node` set to an online node, the pages are
/// mmap'ed, bound to that node (mbind, MPOL_BIND; numa.hpp), then locked
/// (mlock faults them in, on that node only). A node that is not online throws
/// config_error naming it and the online nodes, before anything is mapped; a
/// refused mbind throws pinned_memory_error naming the size, the node and the
/// errno text, with nothing left mapped. no_numa_node (the default): no
/// placement, the pages land where the kernel's default policy puts them.
/// Aggregate: `mlock_allocator{}`, `mlock_allocator{1}` (node 1).
struct mlock_allocator {
  using allocator_concept = pinned_allocator_tag;
  static constexpr const char* name = "mlock";
  static constexpr bool page_locked = true;
  /// The NUMA node the pages are bound to; no_numa_node: none.
  int numa_node = no_numa_node;

  host_allocation allocate(index_t bytes) const {
    if (bytes <= 0) return {};
    if (numa_node != no_numa_node) require_online_numa_node(numa_node, "mlock_allocator");
    detail::require_memory_cgroup_headroom(bytes, "mlock");
    host_allocation a = detail::map_pageable(bytes, "pinned load region");
    if (numa_node != no_numa_node)
      if (std::string m = detail::numa_place_pinned(a.data(), bytes, numa_node, "mlock"); !m.empty())
        throw pinned_memory_error(m);  // `a` unmaps on the way out
    if (::mlock(a.data(), static_cast<std::size_t>(bytes)) != 0) {
      const int err = errno;
      struct rlimit rl {};
      ::getrlimit(RLIMIT_MEMLOCK, &rl);
      std::string limit = rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                                       : format_bytes(static_cast<index_t>(rl.rlim_cur));
      throw pinned_memory_error("pinned memory: locking " + format_bytes(bytes) + " with mlock failed: " +
                                std::strerror(err) + " (RLIMIT_MEMLOCK, ulimit -l, is " + limit + ")");
    }
    // Re-own the mapping with a release that unlocks before unmapping.
    const index_t n = a.size_bytes();
    return host_allocation(a.detach(), n, &detail::munlock_munmap_release);
  }
};

/// A pinned_allocator that can place its pages on one NUMA node: a public
/// `int numa_node` member, no_numa_node (the default) for no placement. Those
/// that own their pages model it (mlock_allocator, cuda_host_register);
/// cuda_host_alloc does not (the driver allocates its pages). The
/// tensor-parallel compositions give each rank's copy its GPU's node
/// (docs/MULTI-GPU.md, NUMA placement).
template <class A>
concept numa_placeable_allocator = pinned_allocator<A> && requires(A& a) {
  { a.numa_node } -> std::same_as<int&>;
};

static_assert(pinned_allocator<pageable_allocator>);
static_assert(pinned_allocator<mlock_allocator>);
static_assert(numa_placeable_allocator<mlock_allocator>);
static_assert(!numa_placeable_allocator<pageable_allocator>);

}  // namespace writescope
