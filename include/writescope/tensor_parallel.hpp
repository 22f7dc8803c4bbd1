// SPDX-License-Identifier: Apache-2.0
// writescope/tensor_parallel.hpp — one decode-attention layer over several
// GPUs of one host (beyond the paper, whose §4 system drives one GPU;
// docs/MULTI-GPU.md): one inplace_kv_cache and one
// hybrid_attention per GPU ("rank"), each on its own backend (its own pinned
// region, ping-pong buffers, D-window and HBM region on its own device).
//
//   tensor_parallel_gqa  GQA: the KV heads are split across the ranks (tensor
//                        parallel). Rank r holds KV heads [r·Hkv/N, (r+1)·Hkv/N)
//                        and their query heads [r·Hq/N, (r+1)·Hq/N) for every
//                        token; its output heads are the full output's heads
//                        of that range, nothing is merged.
//   tensor_parallel_mla  MLA (one latent KV head): each sequence's tokens are
//                        split across the ranks by eviction batch, batch k
//                        (tokens [k·D, (k+1)·D)) to rank k mod N; every rank
//                        attends all query heads over its own tokens, and the
//                        ranks' partial states are merged by merge_state_row
//                        (partial_state.hpp) in rank order 0, 1, ..., N−1.
//
// Both are compositions of the single-GPU types: nothing in the cache or the
// step knows about ranks, every rank's result is exact on its own (the merge
// contract, docs/MERGE-CONTRACT.md), no virtual dispatch.
//
// Sequence ids: begin_sequence() begins the sequence on every rank and
// returns rank 0's id; the other ranks' ids are kept in a map (they are equal
// in practice: every rank sees the same begins and ends).
//
// Threading: drive an object from one thread. step() runs rank 0 on the
// calling thread and ranks 1..N−1 on one persistent std::thread each, started
// with the object and joined at its destruction (none when N = 1; a rank whose
// thread could not start runs on the calling thread); step() returns when
// every rank has finished (device backends: has enqueued its work; see
// Streams). Each rank's CPU engine gets
// its share of attention_options::cpu_threads (the total, split as evenly as
// possible, at least 1 each), so the ranks' steps running at once do not
// oversubscribe the host. Prefill, append, flush and end_sequence run the
// ranks one after the other on the calling thread.
//
// Shapes (fp32 unless noted; batch = the step's sequences):
//   K/V       kv_tokens of the full layer: GQA plane p [tokens][Hkv][head_dim]
//             bf16 (K, V), MLA [tokens][kv_lora_rank + rope_dim] bf16
//   q         [batch][Hq][q_dim]          (MLA: absorbed q')
//   out, lse  [batch][Hq][v_dim], [batch][Hq] (lse optional)
//
// Memory spaces: every input and output is in the backends' activation space.
//   host_backend (host-accessible activations): K/V slices are strided views
//     (GQA heads) or host gathers (MLA prompt rows); queries are gathered,
//     outputs scattered (GQA) or merged (MLA, merge_state_row) with host memcpy
//     into host buffers sized at construction (max_sequences rows).
//   cuda_backend (device activations; include writescope/cuda/tensor_parallel.hpp,
//     which specializes detail::tp_device): K/V, q, out and lse are device
//     memory of rank 0's device. Per rank, allocated at construction on its
//     device: its gathered queries, its outputs or partial state and LSEs
//     (max_sequences rows of its heads), and a KV staging buffer (MLA: every
//     rank, max_sequences rows, grown to the longest prompt share it is given;
//     GQA: ranks on another device than rank 0's, max_sequences tokens of its
//     heads, grown for a longer prompt); MLA, per rank on another device, its
//     partial state's landing buffer on rank 0's device, and there the merge's
//     LSE state. Gathers and scatters are device copies (cudaMemcpy2DAsync,
//     cudaMemcpyAsync; between devices cudaMemcpy3DPeerAsync,
//     cudaMemcpyPeerAsync), the MLA merge the kernel launch_merge_rows
//     (kernels.hpp) in rank order from the empty state.
//
// Streams (device backends): the caller's stream is rank 0's backend's
// caller stream; the inputs must be written, and the outputs are read, in its
// order. Every composite call (append_prefill, append, step) records an event
// on it at its start; rank r's work runs on rank r's caller stream, which
// first waits for that event, and records an event of its own at the end that
// rank 0's caller stream waits for before the call returns (no events where
// rank r's caller stream is rank 0's). So a step's outputs, and the ranks'
// reads of the call's K/V and q, are ordered before anything enqueued on the
// caller's stream afterwards; the MLA merge runs on it after those waits.
// Nothing blocks the host except growing a staging buffer (a prompt longer
// than any before: the rank's stream is synchronized before the old buffer
// is freed) and what the ranks' own calls block on.
// Devices: every call into rank r (construction, begin, prefill, append,
// flush, step, end, destruction) runs with rank r's device current (restored
// afterwards), on the calling thread or on rank r's thread in step().
//
// NUMA placement: each rank gets its own copy of the pinned allocator. When
// that allocator can place its pages (numa_placeable_allocator:
// mlock_allocator, cuda_host_register), its numa_node is no_numa_node and the
// host has more than one online node, rank r's copy gets the node of rank r's
// device (tp_device::numa_node; cuda_device_numa_node for cuda_backend, none
// for host_backend's emulated devices) when that node is reported and online.
// Otherwise every rank's copy is the allocator as given: one-node hosts,
// allocators without a node (pageable_allocator, cuda_host_alloc) and a node
// set by the caller are left as they are.
//
// Errors: typed exceptions (error.hpp) from any rank propagate unchanged.
// Validation is identical on every rank (the ranks' bookkeeping is the same
// for the same calls), so a shape_error / state_error / config_error of the
// input is thrown by rank 0 before any rank changes (the cache's strong
// guarantee). begin_sequence() ends the sequence on the ranks that began it
// when a later rank refuses it. For a resource refusal of a later rank in
// flush() the ranks before it have evicted; a retried flush() evicts only
// what is left. In step(), the lowest rank's exception is rethrown after every
// rank has finished; the caches are unchanged and the outputs unspecified.
// The constructors throw config_error naming the values for no ranks, a null
// backend, one backend given to two ranks, and Hkv or Hq not a multiple of N
// (GQA); resource_error when a device buffer cannot be
// allocated. A failing CUDA call of the device path throws cuda_error.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "block_pool.hpp"
#include "cpu/kernel.hpp"
#include "error.hpp"
#include "host_memory.hpp"
#include "hybrid_attention.hpp"
#include "inplace_kv_cache.hpp"
#include "layout.hpp"
#include "numa.hpp"
#include "partial_state.hpp"
#include "region.hpp"

namespace writescope {

namespace detail {

/// Rank r's share of `total` CPU threads over `ranks` ranks: total / ranks,
/// plus one for the first total mod ranks ranks; at least 1.
[[nodiscard]] inline int rank_cpu_threads(int total, int ranks, int r) noexcept {
  const int share = total / ranks + (r < total % ranks ? 1 : 0);
  return std::max(1, share);
}

/// Rank r's copy of the pinned allocator (the file comment's NUMA placement):
/// `pinned` with numa_node set to `device_node` when the allocator can place
/// its pages, the caller left its node unset, `online` (the host's online
/// nodes) has more than one node and holds `device_node`; otherwise `pinned`
/// unchanged.
template <pinned_allocator PinnedAllocator>
[[nodiscard]] PinnedAllocator tp_rank_allocator(const PinnedAllocator& pinned, int device_node,
                                                std::span<const int> online) {
  PinnedAllocator pa = pinned;
  if constexpr (numa_placeable_allocator<PinnedAllocator>) {
    if (pa.numa_node == no_numa_node && online.size() > 1 && device_node != no_numa_node &&
        std::find(online.begin(), online.end(), device_node) != online.end())
      pa.numa_node = device_node;
  }
  return pa;
}

/// One persistent thread per rank 1..n−1 (rank 0 is the caller's): run(f)
/// runs f(r) for every rank at once, returns when all have finished and then
/// rethrows the lowest rank's exception. The threads live as long as the team,
/// so each keeps its OpenMP thread pool between steps instead of a new thread
/// (and pool) per rank and call. A thread that cannot be started leaves its
/// rank to the calling thread (after rank 0's peers are posted). run() is not
/// reentrant: one caller at a time (the composite's driving thread).
class rank_team {
 public:
  explicit rank_team(int n) : n_(n), errors_(std::size_t(std::max(n, 1))) {
    threads_.reserve(std::size_t(std::max(n - 1, 0)));
    for (int r = 1; r < n; ++r) {
      try {
        threads_.emplace_back([this, r] { serve(r); });
      } catch (...) {
        break;  // ranks from here on run on the calling thread
      }
    }
  }
  rank_team(const rank_team&) = delete;
  rank_team& operator=(const rank_team&) = delete;
  ~rank_team() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    posted_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  /// Threads started (ranks 1..workers() have one).
  [[nodiscard]] int workers() const noexcept { return int(threads_.size()); }

  template <class F>
  void run(F&& f) {
    std::fill(errors_.begin(), errors_.end(), nullptr);
    auto call = [&](int r) {
      try {
        f(r);
      } catch (...) {
        errors_[std::size_t(r)] = std::current_exception();
      }
    };
    using call_type = decltype(call);
    if (!threads_.empty()) {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = [](void* c, int r) { (*static_cast<call_type*>(c))(r); };
      job_ctx_ = &call;
      pending_ = int(threads_.size());
      ++generation_;
    }
    posted_.notify_all();
    for (int r = workers() + 1; r < n_; ++r) call(r);
    call(0);
    if (!threads_.empty()) {
      std::unique_lock<std::mutex> lk(mu_);
      finished_.wait(lk, [&] { return pending_ == 0; });
      job_ = nullptr;
      job_ctx_ = nullptr;
    }
    for (const std::exception_ptr& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void serve(int r) {
    std::uint64_t seen = 0;
    for (;;) {
      void (*job)(void*, int) = nullptr;
      void* ctx = nullptr;
      {
        std::unique_lock<std::mutex> lk(mu_);
        posted_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
        ctx = job_ctx_;
      }
      job(ctx, r);  // never throws: the call wrapper keeps the exception
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) finished_.notify_one();
    }
  }

  int n_;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable posted_, finished_;
  void (*job_)(void*, int) = nullptr;
  void* job_ctx_ = nullptr;
  int pending_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
};

/// What the compositions need of a backend besides `backend` (not a public
/// API). This primary template serves backends whose activations are host
/// memory (host_backend): the gathers, scatters and the MLA merge are host
/// memcpy and merge_state_row, no device is made current (`scope` does
/// nothing). A device backend specializes it: writescope/cuda/tensor_parallel.hpp
/// for basic_cuda_backend (device scope, the rank and caller streams, events,
/// strided and peer copies, the merge kernel). `available` is false for a
/// device backend without one, and the compositions refuse it at compile time.
template <class Backend>
struct tp_device {
  static constexpr bool available = host_accessible_space<typename Backend::activation_space>;
  /// Makes the backend's device current for its lifetime (here: nothing).
  struct scope {
    explicit scope(const Backend&, bool /*quiet*/ = false) noexcept {}
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() {}  // NOLINT(modernize-use-equals-default): a guard, not "set but unused"
  };
  void attach(std::span<Backend* const>, const char*) noexcept {}
  /// The host NUMA node of the backend's device (here: none; an emulated
  /// device has no PCI slot).
  static int numa_node(const Backend&) noexcept { return no_numa_node; }
};

/// A device buffer of one rank's backend, allocated and freed with that
/// backend's device current (device path only; empty on the host path).
template <class Backend>
struct tp_buffer {
  Backend* owner = nullptr;
  typename Backend::device_buffer mem;

  tp_buffer() = default;
  tp_buffer(tp_buffer&& o) noexcept : owner(std::exchange(o.owner, nullptr)), mem(std::move(o.mem)) {}
  tp_buffer& operator=(tp_buffer&& o) noexcept {
    if (this != &o) {
      release();
      owner = std::exchange(o.owner, nullptr);
      mem = std::move(o.mem);
    }
    return *this;
  }
  ~tp_buffer() { release(); }

  /// At least `bytes` on `be`'s device; `before_free` runs before an older,
  /// smaller buffer is freed (it waits for the work that may still read it).
  template <class BeforeFree>
  void ensure(Backend& be, index_t bytes, const char* what, BeforeFree&& before_free) {
    if (owner != nullptr && mem.size_bytes() >= bytes) return;
    typename tp_device<Backend>::scope g(be);
    if (owner != nullptr) {
      before_free();
      auto drop = std::move(mem);  // freed here, with its device current
    }
    owner = &be;
    mem = be.allocate_device(std::max<index_t>(bytes, 16), what);
  }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return reinterpret_cast<T*>(mem.data());
  }
  void release() noexcept {
    if (owner == nullptr) return;
    typename tp_device<Backend>::scope g(*owner, true);
    auto drop = std::move(mem);
    owner = nullptr;
  }
};

/// The per-rank caches and steps and the sequence-id map shared by both
/// compositions (not a public API).
template <kv_layout Layout, backend Backend, pinned_allocator PinnedAllocator, routing_policy Policy,
          block_allocator BlockAllocator, class CpuKernel>
class tp_ranks {
 public:
  using cache_type = inplace_kv_cache<Layout, Backend, PinnedAllocator, Policy, BlockAllocator>;
  using attention_type = hybrid_attention<cache_type, CpuKernel>;
  using device_type = tp_device<Backend>;
  using device_scope = typename device_type::scope;

  struct rank {
    cache_type cache;
    attention_type attention;
    rank(Backend& be, const Layout& l, const partition_spec& spec, const Policy& pol, const PinnedAllocator& pa,
         cache_options co, attention_options ao)
        : cache(be, l, spec, pol, pa, co), attention(cache, ao) {}
  };

  tp_ranks(std::span<Backend* const> backends, const Layout& rank_layout, const partition_spec& spec,
           const Policy& policy, attention_options options, const PinnedAllocator& pinned, cache_options co,
           const char* what) {
    const int n = int(backends.size());
    if (options.cpu_threads <= 0) options.cpu_threads = std::max(1, int(std::thread::hardware_concurrency()) - 1);
    total_cpu_threads_ = options.cpu_threads;
    for (int r = 0; r < n; ++r)
      if (backends[std::size_t(r)] == nullptr)
        throw config_error(std::string(what) + ": the backend of rank " + std::to_string(r) + " is null");
    for (int r = 0; r < n; ++r)
      for (int s = 0; s < r; ++s)
        if (backends[std::size_t(r)] == backends[std::size_t(s)]) {
          std::string where;
          if constexpr (requires(Backend& b) { b.device(); })
            where = " (device " + std::to_string(backends[std::size_t(r)]->device()) + ")";
          throw config_error(std::string(what) + ": ranks " + std::to_string(s) + " and " + std::to_string(r) +
                             " were given the same backend" + where +
                             "; each rank needs a backend of its own (one backend is driven from one thread)");
        }
    device_.attach(backends, what);  // a device backend's own refusals, before anything is allocated
    std::vector<int> online;  // read only where a node may be given (the file comment's NUMA placement)
    if constexpr (numa_placeable_allocator<PinnedAllocator>)
      if (pinned.numa_node == no_numa_node) online = numa_online_nodes();
    ranks_.reserve(std::size_t(n));
    ids_.resize(std::size_t(n));
    id_buf_.resize(std::size_t(n));
    try {
      for (int r = 0; r < n; ++r) {
        attention_options ao = options;
        ao.cpu_threads = rank_cpu_threads(total_cpu_threads_, n, r);
        const device_scope g(*backends[std::size_t(r)]);  // the rank's device regions on its device
        const int node = online.size() > 1 ? device_type::numa_node(*backends[std::size_t(r)]) : no_numa_node;
        ranks_.push_back(std::make_unique<rank>(*backends[std::size_t(r)], rank_layout, spec, policy,
                                                tp_rank_allocator(pinned, node, online), co, ao));
      }
      team_ = std::make_unique<rank_team>(n);
    } catch (...) {
      release_ranks();
      throw;
    }
  }
  tp_ranks(const tp_ranks&) = delete;
  tp_ranks& operator=(const tp_ranks&) = delete;
  tp_ranks(tp_ranks&&) noexcept = default;  // the ranks and the team are held by pointer
  tp_ranks& operator=(tp_ranks&&) = delete;
  ~tp_ranks() {
    team_.reset();  // its threads end (idle) before the ranks go
    release_ranks();
  }

  /// Makes rank r's device current until the returned guard goes (a device
  /// backend; nothing on the host path).
  [[nodiscard]] device_scope on(int r) const { return device_scope(at(r).cache.backend()); }
  /// The device path's streams, events and copies (tp_device).
  [[nodiscard]] device_type& device() noexcept { return device_; }

  /// Device path: body() between begin_call() (the caller stream's work so
  /// far is what every rank's work of this call comes after) and end_call()
  /// (the caller stream waits for every rank's work of this call), the latter
  /// also when body throws.
  template <class F>
  void device_call(F&& body) {
    device_.begin_call();
    try {
      body();
    } catch (...) {
      device_.end_call_quiet();
      throw;
    }
    device_.end_call();
  }
  /// Device path, inside device_call: f() with rank r's device current and
  /// its stream ordered after the caller's work; the work f enqueues on rank
  /// r's stream is then what the caller stream waits for (also when f throws).
  template <class F>
  void device_rank_call(int r, F&& f) {
    const device_scope g = on(r);
    device_.rank_begin(r);
    try {
      f();
    } catch (...) {
      device_.rank_end_quiet(r);
      throw;
    }
    device_.rank_end(r);
  }

  /// f(r) for every rank at once on the rank threads (rank_team::run).
  template <class F>
  void run(F&& f) {
    team_->run(std::forward<F>(f));
  }
  /// Rank threads running (ranks beyond them run on the calling thread).
  [[nodiscard]] int rank_threads() const noexcept { return team_->workers(); }

  [[nodiscard]] int size() const noexcept { return int(ranks_.size()); }
  [[nodiscard]] rank& at(int r) noexcept { return *ranks_[std::size_t(r)]; }
  [[nodiscard]] const rank& at(int r) const noexcept { return *ranks_[std::size_t(r)]; }
  [[nodiscard]] int total_cpu_threads() const noexcept { return total_cpu_threads_; }

  /// Begins a sequence of prompt_tokens(r) tokens on every rank; returns rank
  /// 0's id. A refusal by rank r ends the sequence on ranks < r and rethrows.
  template <class PromptOf>
  sequence_id begin(PromptOf&& prompt_of) {
    const int n = size();
    std::vector<sequence_id> got;
    got.reserve(std::size_t(n));
    try {
      for (int r = 0; r < n; ++r) {
        const device_scope g = on(r);
        got.push_back(at(r).cache.begin_sequence(prompt_of(r)));
      }
      const sequence_id id = got[0];
      for (int r = 0; r < n; ++r) {
        auto& m = ids_[std::size_t(r)];
        if (std::size_t(id) >= m.size()) m.resize(std::size_t(id) + 1, -1);
        m[std::size_t(id)] = got[std::size_t(r)];
      }
      return id;
    } catch (...) {
      for (std::size_t r = 0; r < got.size(); ++r) {
        const device_scope g(at(int(r)).cache.backend(), true);
        at(int(r)).cache.end_sequence(got[r]);
      }
      throw;
    }
  }

  /// Rank r's id of composite sequence `seq` (unknown ids pass through, so
  /// that rank 0's cache names them in its error).
  [[nodiscard]] sequence_id id_on(int r, sequence_id seq) const noexcept {
    const auto& m = ids_[std::size_t(r)];
    return seq >= 0 && std::size_t(seq) < m.size() && m[std::size_t(seq)] >= 0 ? m[std::size_t(seq)] : seq;
  }

  /// `seqs` translated to rank r's ids, in a buffer of rank r (valid until
  /// the next call for r; calls for different ranks may run at once).
  std::span<const sequence_id> ids_on(int r, std::span<const sequence_id> seqs) {
    if (r == 0) return seqs;  // rank 0's ids are the composite ids
    auto& buf = id_buf_[std::size_t(r)];
    buf.clear();
    for (sequence_id s : seqs) buf.push_back(id_on(r, s));
    return buf;
  }

  void end(sequence_id seq) {
    {
      const device_scope g = on(0);
      at(0).cache.end_sequence(seq);  // validates (shape_error for an unknown id) before any rank changes
    }
    for (int r = 1; r < size(); ++r) {
      const device_scope g = on(r);
      at(r).cache.end_sequence(id_on(r, seq));
    }
    for (auto& m : ids_)
      if (std::size_t(seq) < m.size()) m[std::size_t(seq)] = -1;
  }

  flush_report flush() {
    flush_report sum;
    for (int r = 0; r < size(); ++r) {
      const device_scope g = on(r);
      const flush_report f = at(r).cache.flush();
      sum.evicted_sequences += f.evicted_sequences;
      sum.cpu_batches += f.cpu_batches;
      sum.gpu_batches += f.gpu_batches;
      sum.hbm_batches += f.hbm_batches;
    }
    return sum;
  }

 private:
  // Each rank's step and cache go with its device current (engine workspaces, regions).
  void release_ranks() noexcept {
    for (auto& p : ranks_) {
      if (!p) continue;
      const device_scope g(p->cache.backend(), true);
      p.reset();
    }
  }

  device_type device_;  // first: its events outlive the ranks' work
  std::vector<std::unique_ptr<rank>> ranks_;
  std::vector<std::vector<sequence_id>> ids_;  // [rank][composite id] -> the rank's id (-1: none)
  std::vector<std::vector<sequence_id>> id_buf_;  // [rank] ids_on()'s result
  int total_cpu_threads_ = 1;
  std::unique_ptr<rank_team> team_;  // its threads end (idle) before the ranks go (~tp_ranks)
};

inline void check_ranks(int n, const char* what) {
  if (n < 1)
    throw config_error(std::string(what) + ": " + std::to_string(n) + " ranks (backends) given; at least 1 is needed");
}

/// The host path's per-rank buffers: n ranks of q_elems gathered query
/// elements, o_elems output elements and lse_elems LSEs (fp32, host memory).
inline void size_host_rank_buffers(std::vector<std::vector<float>>& q, std::vector<std::vector<float>>& o,
                                   std::vector<std::vector<float>>& lse, std::size_t n, std::size_t q_elems,
                                   std::size_t o_elems, std::size_t lse_elems) {
  q.assign(n, std::vector<float>(q_elems));
  o.assign(n, std::vector<float>(o_elems));
  lse.assign(n, std::vector<float>(lse_elems));
}

}  // namespace detail

// =============================================================================
// GQA: KV heads split across the ranks
// =============================================================================

/// GQA over N ranks (tensor parallel by KV head). Rank r holds KV heads
/// [r·Hkv/N, (r+1)·Hkv/N) of every token in an inplace_kv_cache over
/// Layout(Hq/N, Hkv/N), and attends query heads [r·Hq/N, (r+1)·Hq/N), which
/// read exactly those KV heads (query head h reads KV head h / (Hq/Hkv)).
/// Each rank routes its own eviction batches with its own copy of the policy;
/// with a policy that does not observe costs (fixed_ratio, gpu_only, cpu_only)
/// every rank places each batch where one cache of the full layout would.
template <kv_layout Layout, backend Backend, pinned_allocator PinnedAllocator, routing_policy Policy,
          block_allocator BlockAllocator = block_pool,
          cpu_attention_kernel<Layout> CpuKernel = cpu::auto_decode_kernel<Layout>>
class tensor_parallel_gqa {
  static_assert(!Layout::is_mla, "tensor_parallel_gqa: an MLA layout has one KV head; use tensor_parallel_mla");
  using ranks_type = detail::tp_ranks<Layout, Backend, PinnedAllocator, Policy, BlockAllocator, CpuKernel>;

 public:
  using layout_type = Layout;
  using backend_type = Backend;
  using cache_type = typename ranks_type::cache_type;
  using attention_type = typename ranks_type::attention_type;
  using activation_space = typename Backend::activation_space;
  using kv_input = kv_tokens<Layout, activation_space>;
  static_assert(detail::tp_device<Backend>::available,
                "tensor_parallel_gqa on a device backend: include <writescope/cuda/tensor_parallel.hpp> "
                "(the device gathers, scatters and events of basic_cuda_backend)");

  /// One rank per backend (`backends[r]` holds rank r's device regions; each
  /// must outlive this object). `layout` is the full layer (Hq, Hkv); `spec`,
  /// `policy`, `pinned` and `cache_opts` are each rank's (capacities are per
  /// rank, in tokens of the rank's heads). options.cpu_threads is the total
  /// for all ranks (0: hardware threads − 1), split as evenly as possible.
  /// Throws config_error naming the numbers when backends.size() < 1, a
  /// backend is null, or Hkv or Hq is not a multiple of N; what a rank's cache
  /// or step constructor throws otherwise (nothing stays allocated).
  tensor_parallel_gqa(std::span<Backend* const> backends, const Layout& layout, const partition_spec& spec,
                      Policy policy, attention_options options = {}, PinnedAllocator pinned = {},
                      cache_options cache_opts = {})
      : layout_(layout),
        ranks_(backends, rank_layout_of(int(backends.size()), layout), spec, policy, options, pinned, cache_opts,
               "tensor_parallel_gqa") {
    const std::size_t n = backends.size();
    const std::size_t rows = std::size_t(spec.max_sequences) * std::size_t(rank_q_heads());
    if constexpr (host_path) {
      detail::size_host_rank_buffers(q_, o_, lse_, n, rows * Layout::q_dim, rows * Layout::v_dim, rows);
    } else {
      // per rank, on its device: gathered queries and its output heads; a KV
      // staging buffer for a rank on another device than rank 0's (appends:
      // max_sequences tokens; grows for a longer prompt)
      dq_ = std::vector<buffer>(n);
      do_ = std::vector<buffer>(n);
      dl_ = std::vector<buffer>(n);
      dkv_ = std::vector<buffer>(n);
      const index_t kv_bytes = index_t(spec.max_sequences) * rank_kv_heads() * Layout::row_elems * Layout::planes *
                               index_t(sizeof(bf16));
      for (std::size_t r = 0; r < n; ++r) {
        Backend& be = rank_backend(int(r));
        auto none = [] {};
        dq_[r].ensure(be, index_t(rows * Layout::q_dim * sizeof(float)), "tensor_parallel_gqa: rank queries", none);
        do_[r].ensure(be, index_t(rows * Layout::v_dim * sizeof(float)), "tensor_parallel_gqa: rank outputs", none);
        dl_[r].ensure(be, index_t(rows * sizeof(float)), "tensor_parallel_gqa: rank LSEs", none);
        if (!ranks_.device().same_device(int(r))) dkv_[r].ensure(be, kv_bytes, "tensor_parallel_gqa: rank KV staging", none);
      }
    }
  }

  [[nodiscard]] int ranks() const noexcept { return ranks_.size(); }
  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  /// Rank r's layout: Hq/N query heads, Hkv/N KV heads.
  [[nodiscard]] const Layout& rank_layout() const noexcept { return ranks_.at(0).cache.layout(); }
  [[nodiscard]] int rank_q_heads() const noexcept { return layout_.num_q_heads() / ranks(); }
  [[nodiscard]] int rank_kv_heads() const noexcept { return layout_.kv_heads() / ranks(); }
  /// Rank r's cache and step (introspection; driving them directly desynchronises the ranks).
  [[nodiscard]] cache_type& cache(int r) noexcept { return ranks_.at(r).cache; }
  [[nodiscard]] attention_type& attention(int r) noexcept { return ranks_.at(r).attention; }
  /// Rank r's id of composite sequence `seq`.
  [[nodiscard]] sequence_id rank_sequence(int r, sequence_id seq) const noexcept { return ranks_.id_on(r, seq); }

  /// Begins a sequence with a prompt of `prompt_tokens` tokens on every rank
  /// (inplace_kv_cache::begin_sequence); returns its id. Throws what a rank's
  /// begin_sequence throws; then no rank holds the sequence.
  sequence_id begin_sequence(index_t prompt_tokens) {
    return ranks_.begin([&](int) { return prompt_tokens; });
  }
  /// Ends `seq` on every rank. Throws shape_error for an unknown or ended sequence.
  void end_sequence(sequence_id seq) { ranks_.end(seq); }

  /// The prompt KV of `seq` for `layer`, full heads ([token][Hkv][head_dim]
  /// per plane, activation space of the backends); each rank gets its heads
  /// as a strided view (no copy). Throws what inplace_kv_cache::append_prefill throws.
  /// Device backends: each rank reads its heads on its own stream after the
  /// caller's work (a rank on another device than rank 0's from a staging copy
  /// of them on its device), and the caller stream waits for the ranks' reads.
  void append_prefill(int layer, sequence_id seq, const kv_input& kv) {
    if constexpr (host_path) {
      for (int r = 0; r < ranks(); ++r) cache(r).append_prefill(layer, ranks_.id_on(r, seq), slice(kv, r));
    } else {
      ranks_.device_call([&] {
        for (int r = 0; r < ranks(); ++r)
          ranks_.device_rank_call(r, [&] { cache(r).append_prefill(layer, ranks_.id_on(r, seq), rank_input(kv, r)); });
      });
    }
  }
  /// One decode token per sequence (token i of `kv`, full heads, belongs to seqs[i]).
  void append(int layer, std::span<const sequence_id> seqs, const kv_input& kv) {
    if constexpr (host_path) {
      for (int r = 0; r < ranks(); ++r) cache(r).append(layer, ranks_.ids_on(r, seqs), slice(kv, r));
    } else {
      ranks_.device_call([&] {
        for (int r = 0; r < ranks(); ++r)
          ranks_.device_rank_call(r, [&] { cache(r).append(layer, ranks_.ids_on(r, seqs), rank_input(kv, r)); });
      });
    }
  }
  /// Every rank's flush(); the reports summed (a batch of a sequence counts once per rank).
  flush_report flush() { return ranks_.flush(); }

  /// One layer's step for `seqs` on every rank at once (see the file comment).
  ///   q    [batch][Hq][q_dim] fp32, activation space (a device backend: on rank 0's device)
  ///   out  [batch][Hq][v_dim] fp32 (+ optional lse [batch][Hq]); head h of a
  ///        row is written by the rank that holds it
  /// Device backends: ordered after the work on rank 0's caller stream, and
  /// the outputs are complete in that stream's order (file comment).
  /// Returns each rank's step_report (rank order), valid until the next step.
  /// Throws shape_error for sizes before any work; what a rank's step throws.
  std::span<const step_report> step(int layer, std::span<const sequence_id> seqs,
                                    mem_span<const float, activation_space> q, float scale,
                                    const step_outputs<activation_space>& out) {
    const int n = ranks();
    const index_t batch = index_t(seqs.size());
    const int hq = layout_.num_q_heads(), hr = rank_q_heads();
    check_sizes("tensor_parallel_gqa::step", batch, q.size(), out, hq, cache(0).spec().max_sequences);
    reports_.resize(std::size_t(n));
    step_ids_.resize(std::size_t(n));
    for (int r = 0; r < n; ++r) step_ids_[std::size_t(r)] = ranks_.ids_on(r, seqs);  // before the threads start
    if constexpr (!host_path) {
      step_on_devices(layer, q, scale, out, batch);
    } else {
      ranks_.run([&](int r) {
        float* qr = q_[std::size_t(r)].data();
        for (index_t i = 0; i < batch; ++i)
          std::memcpy(qr + std::size_t(i * hr) * Layout::q_dim, q.data() + std::size_t(i * hq + r * hr) * Layout::q_dim,
                      sizeof(float) * std::size_t(hr) * Layout::q_dim);
        const std::size_t rows = std::size_t(batch * hr);
        step_outputs<activation_space> so{mem_span<float, activation_space>(o_[std::size_t(r)].data(), index_t(rows * Layout::v_dim)),
                                          mem_span<float, activation_space>(lse_[std::size_t(r)].data(), index_t(rows)),
                                          nullptr};
        reports_[std::size_t(r)] =
            attention(r).step(layer, step_ids_[std::size_t(r)], mem_span<const float, activation_space>(qr, index_t(rows) * Layout::q_dim),
                              scale, so);
        for (index_t i = 0; i < batch; ++i) {
          std::memcpy(out.out.data() + std::size_t(i * hq + r * hr) * Layout::v_dim,
                      o_[std::size_t(r)].data() + std::size_t(i * hr) * Layout::v_dim,
                      sizeof(float) * std::size_t(hr) * Layout::v_dim);
          if (!out.lse.empty())
            std::memcpy(out.lse.data() + std::size_t(i * hq + r * hr), lse_[std::size_t(r)].data() + std::size_t(i * hr),
                        sizeof(float) * std::size_t(hr));
        }
      });
    }
    return reports_;
  }

 private:
  static constexpr bool host_path = host_accessible_space<activation_space>;
  using buffer = detail::tp_buffer<Backend>;

  [[nodiscard]] Backend& rank_backend(int r) noexcept { return ranks_.at(r).cache.backend(); }

  // The device path of step(): per rank (its thread, its device current, its
  // caller stream after rank 0's): its query heads of every row gathered by a
  // strided copy, its step, its output heads (and LSEs) scattered back into
  // `out` by strided copies; rank 0's caller stream then waits for every rank.
  void step_on_devices(int layer, mem_span<const float, activation_space> q, float scale,
                       const step_outputs<activation_space>& out, index_t batch) {
    const int hq = layout_.num_q_heads(), hr = rank_q_heads();
    constexpr std::size_t F = sizeof(float), Q = Layout::q_dim, V = Layout::v_dim;
    const std::size_t rows = std::size_t(batch) * std::size_t(hr), h = std::size_t(batch);
    auto& dev = ranks_.device();
    ranks_.device_call([&] {
      ranks_.run([&](int r) {
        ranks_.device_rank_call(r, [&] {
          const std::size_t ur = std::size_t(r);
          float* qr = dq_[ur].template as<float>();
          float* orr = do_[ur].template as<float>();
          float* lr = dl_[ur].template as<float>();
          dev.copy_rows(r, qr, hr * Q * F, r, q.data() + std::size_t(r * hr) * Q, std::size_t(hq) * Q * F, 0,
                        hr * Q * F, h);
          step_outputs<activation_space> so{mem_span<float, activation_space>(orr, index_t(rows * V)),
                                            mem_span<float, activation_space>(lr, index_t(rows)), nullptr};
          reports_[ur] = attention(r).step(layer, step_ids_[ur],
                                           mem_span<const float, activation_space>(qr, index_t(rows * Q)), scale, so);
          dev.copy_rows(r, out.out.data() + std::size_t(r * hr) * V, std::size_t(hq) * V * F, 0, orr, hr * V * F, r,
                        hr * V * F, h);
          if (!out.lse.empty())
            dev.copy_rows(r, out.lse.data() + std::size_t(r * hr), std::size_t(hq) * F, 0, lr, hr * F, r, hr * F, h);
        });
      });
    });
  }

  // Device path: rank r's heads of `kv` where rank r's device can read them:
  // the strided view of slice() on rank 0's device, else a copy of them
  // (dense, by strided peer copies on rank r's stream) in its staging buffer.
  kv_input rank_input(const kv_input& kv, int r) {
    if (ranks_.device().same_device(r) || kv.num_tokens <= 0) return slice(kv, r);
    const index_t row = index_t(rank_kv_heads()) * Layout::row_elems;
    const std::size_t plane = std::size_t(kv.num_tokens) * std::size_t(row);
    buffer& b = dkv_[std::size_t(r)];
    b.ensure(rank_backend(r), index_t(plane * Layout::planes * sizeof(bf16)), "tensor_parallel_gqa: rank KV staging",
             [&] { ranks_.device().synchronize_rank(r); });
    const std::size_t w = std::size_t(row) * sizeof(bf16), sp = std::size_t(kv.stride(layout_)) * sizeof(bf16);
    kv_input s;
    s.num_tokens = kv.num_tokens;
    for (int p = 0; p < Layout::planes; ++p) {
      if (kv.planes[std::size_t(p)] == nullptr) continue;
      bf16* d = b.template as<bf16>() + std::size_t(p) * plane;
      ranks_.device().copy_rows(r, d, w, r, kv.planes[std::size_t(p)] + std::size_t(r) * std::size_t(row), sp, 0, w,
                                std::size_t(kv.num_tokens));
      s.planes[std::size_t(p)] = d;
    }
    return s;
  }

  // Rank r's layout (Hq/N, Hkv/N), after the checks.
  static Layout rank_layout_of(int n, const Layout& l) {
    detail::check_ranks(n, "tensor_parallel_gqa");
    if (l.kv_heads() % n != 0 || l.num_q_heads() % n != 0)
      throw config_error("tensor_parallel_gqa: Hkv = " + std::to_string(l.kv_heads()) + " KV heads and Hq = " +
                         std::to_string(l.num_q_heads()) + " query heads must both be multiples of the " +
                         std::to_string(n) + " ranks (each rank holds whole KV heads and their query groups)");
    return Layout(l.num_q_heads() / n, l.kv_heads() / n);
  }

  // Rank r's KV heads of `kv`: a strided view, token stride of the full input.
  [[nodiscard]] kv_input slice(const kv_input& kv, int r) const noexcept {
    kv_input s = kv;
    s.token_stride = kv.stride(layout_);
    const index_t off = index_t(r) * rank_kv_heads() * Layout::row_elems;
    for (int p = 0; p < Layout::planes; ++p)
      if (kv.planes[std::size_t(p)] != nullptr) s.planes[std::size_t(p)] = kv.planes[std::size_t(p)] + off;
    return s;
  }

  static void check_sizes(const char* what, index_t batch, index_t q_size, const step_outputs<activation_space>& out,
                          int hq, int max_sequences) {
    if (batch > max_sequences)
      throw shape_error(std::string(what) + ": batch of " + std::to_string(batch) + " sequences exceeds max_sequences " +
                        std::to_string(max_sequences));
    const index_t rows = batch * hq;
    if (q_size != rows * Layout::q_dim)
      throw shape_error(std::string(what) + ": q has " + std::to_string(q_size) +
                        " elements, expected batch*Hq*q_dim = " + std::to_string(rows * Layout::q_dim));
    if (out.out.size() != rows * Layout::v_dim)
      throw shape_error(std::string(what) + ": out has " + std::to_string(out.out.size()) +
                        " elements, expected batch*Hq*v_dim = " + std::to_string(rows * Layout::v_dim));
    if (!out.lse.empty() && out.lse.size() != rows)
      throw shape_error(std::string(what) + ": lse has " + std::to_string(out.lse.size()) +
                        " elements, expected batch*Hq = " + std::to_string(rows));
  }

  Layout layout_;
  ranks_type ranks_;
  std::vector<std::vector<float>> q_, o_, lse_;  // [rank] gathered queries, rank outputs (host path)
  std::vector<buffer> dq_, do_, dl_, dkv_;       // [rank] the same on the rank's device; KV staging (device path)
  std::vector<step_report> reports_;
  std::vector<std::span<const sequence_id>> step_ids_;  // [rank] the step's batch in the rank's ids
};

// =============================================================================
// MLA: tokens split across the ranks by eviction batch
// =============================================================================

/// MLA over N ranks (one latent KV head, so the ranks split the tokens). Rule:
/// token t of a sequence belongs to eviction batch k = t / D (D =
/// partition_spec::d_window_tokens) and lives on rank k mod N. Each rank's
/// cache (the full layout, all query heads) holds the sequence's tokens of its
/// batches, in order, as one sequence of its own: whole eviction batches that
/// its own policy places, and, on the rank of the batch being filled, the
/// D-window. So every rank holds whole batches, the D-window being filled is
/// on one rank (appends go to one place), and no cache needs to know about
/// ranks. Each rank keeps a D-window slot per sequence (N slots per sequence
/// in all: D tokens of one latent row each, per layer).
///
/// A step attends, on every rank at once, the sequences of the batch of which
/// the rank holds at least one token, and merges the ranks' partial states per
/// (sequence, query head) with merge_state_row in rank order 0..N−1 from the
/// empty state: deterministic, and with N = 1 bit-identical to one cache.
///
/// Every rank's policy sees only its own tokens (route_query counts them);
/// flush() must run after the last layer of every step, as for one cache.
template <kv_layout Layout, backend Backend, pinned_allocator PinnedAllocator, routing_policy Policy,
          block_allocator BlockAllocator = block_pool,
          cpu_attention_kernel<Layout> CpuKernel = cpu::auto_decode_kernel<Layout>>
class tensor_parallel_mla {
  static_assert(Layout::is_mla, "tensor_parallel_mla: for a GQA layout split the KV heads (tensor_parallel_gqa)");
  using ranks_type = detail::tp_ranks<Layout, Backend, PinnedAllocator, Policy, BlockAllocator, CpuKernel>;

 public:
  using layout_type = Layout;
  using backend_type = Backend;
  using cache_type = typename ranks_type::cache_type;
  using attention_type = typename ranks_type::attention_type;
  using activation_space = typename Backend::activation_space;
  using kv_input = kv_tokens<Layout, activation_space>;
  static_assert(detail::tp_device<Backend>::available,
                "tensor_parallel_mla on a device backend: include <writescope/cuda/tensor_parallel.hpp> "
                "(the device gathers, the merge kernel and the events of basic_cuda_backend)");

  /// One rank per backend (each must outlive this object); `layout`, `spec`,
  /// `policy`, `pinned` and `cache_opts` are each rank's (every rank holds all
  /// query heads; capacities are per rank, about 1/N of the tokens).
  /// options.cpu_threads is the total for all ranks (0: hardware threads − 1).
  /// Throws config_error when backends.size() < 1 or a backend is null; what a
  /// rank's constructors throw otherwise.
  tensor_parallel_mla(std::span<Backend* const> backends, const Layout& layout, const partition_spec& spec,
                      Policy policy, attention_options options = {}, PinnedAllocator pinned = {},
                      cache_options cache_opts = {})
      : layout_(layout),
        ranks_((detail::check_ranks(int(backends.size()), "tensor_parallel_mla"), backends), layout, spec, policy,
               options, pinned, cache_opts, "tensor_parallel_mla") {  // one argument: checked before anything else
    const std::size_t n = backends.size(), rows = std::size_t(spec.max_sequences) * std::size_t(layout.num_q_heads());
    rows_.resize(n);
    if constexpr (host_path) {
      detail::size_host_rank_buffers(q_, o_, lse_, n, rows * Layout::q_dim, rows * Layout::v_dim, rows);
    } else {
      // per rank, on its device: gathered queries, its partial state, a KV
      // staging buffer (appends: max_sequences rows; grows for the longest
      // prompt share); per rank on another device than rank 0's, a landing
      // buffer for its partial state on rank 0's device; there, the merge's
      // LSE state when the caller asks for no LSE
      dq_ = std::vector<buffer>(n);
      do_ = std::vector<buffer>(n);
      dl_ = std::vector<buffer>(n);
      dkv_ = std::vector<buffer>(n);
      land_o_ = std::vector<buffer>(n);
      land_l_ = std::vector<buffer>(n);
      auto none = [] {};
      constexpr std::size_t F = sizeof(float);
      for (std::size_t r = 0; r < n; ++r) {
        Backend& be = rank_backend(int(r));
        dq_[r].ensure(be, index_t(rows * Layout::q_dim * F), "tensor_parallel_mla: rank queries", none);
        do_[r].ensure(be, index_t(rows * Layout::v_dim * F), "tensor_parallel_mla: rank partial outputs", none);
        dl_[r].ensure(be, index_t(rows * F), "tensor_parallel_mla: rank partial LSEs", none);
        dkv_[r].ensure(be, index_t(spec.max_sequences) * Layout::row_elems * index_t(sizeof(bf16)),
                       "tensor_parallel_mla: rank KV staging", none);
        if (!ranks_.device().same_device(int(r))) {
          land_o_[r].ensure(rank_backend(0), index_t(rows * Layout::v_dim * F), "tensor_parallel_mla: partial landing", none);
          land_l_[r].ensure(rank_backend(0), index_t(rows * F), "tensor_parallel_mla: partial landing", none);
        }
      }
      state_lse_.ensure(rank_backend(0), index_t(rows * F), "tensor_parallel_mla: merge LSE state", none);
    }
  }

  [[nodiscard]] int ranks() const noexcept { return ranks_.size(); }
  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  [[nodiscard]] cache_type& cache(int r) noexcept { return ranks_.at(r).cache; }
  [[nodiscard]] attention_type& attention(int r) noexcept { return ranks_.at(r).attention; }
  [[nodiscard]] sequence_id rank_sequence(int r, sequence_id seq) const noexcept { return ranks_.id_on(r, seq); }
  /// Tokens per eviction batch (D), the unit of the split.
  [[nodiscard]] index_t batch_tokens() const noexcept { return ranks_.at(0).cache.spec().d_window_tokens; }
  /// The rank that holds token `position` of any sequence: (position / D) mod N.
  [[nodiscard]] int rank_of_token(index_t position) const noexcept { return int((position / batch_tokens()) % ranks()); }
  /// Of a prompt of `prompt_tokens` tokens, the tokens rank r holds.
  [[nodiscard]] index_t rank_prompt_tokens(int r, index_t prompt_tokens) const noexcept {
    const index_t D = batch_tokens(), b = prompt_tokens / D, n = ranks();
    return (b / n + (r < b % n ? 1 : 0)) * D + (b % n == r ? prompt_tokens % D : 0);
  }
  /// Tokens of `seq` in `layer`, all ranks. Throws shape_error for an unknown sequence or layer.
  [[nodiscard]] index_t tokens(sequence_id seq, int layer) const { return state(seq, layer, "tokens").length[std::size_t(layer)]; }

  /// Begins a sequence with a prompt of `prompt_tokens` tokens: rank r's cache
  /// begins one of rank_prompt_tokens(r, P) tokens. Throws shape_error for
  /// P < 0; what a rank's begin_sequence throws (then no rank holds it).
  sequence_id begin_sequence(index_t prompt_tokens) {
    if (prompt_tokens < 0)
      throw shape_error("tensor_parallel_mla::begin_sequence: prompt_tokens " + std::to_string(prompt_tokens) + " < 0");
    const int layers = ranks_.at(0).cache.spec().num_layers;
    const sequence_id id = ranks_.begin([&](int r) { return rank_prompt_tokens(r, prompt_tokens); });
    if (std::size_t(id) >= seqs_.size()) seqs_.resize(std::size_t(id) + 1);
    seq_state& st = seqs_[std::size_t(id)];
    st.live = true;
    st.prompt = prompt_tokens;
    st.length.assign(std::size_t(layers), prompt_tokens);
    st.ready.assign(std::size_t(layers), prompt_tokens == 0 ? 1 : 0);
    return id;
  }
  void end_sequence(sequence_id seq) {
    ranks_.end(seq);
    seqs_[std::size_t(seq)] = seq_state{};
  }

  /// The prompt KV of `seq` for `layer` (all P tokens, activation space): each
  /// rank's tokens are gathered into a buffer (host path: host memory; device
  /// backends: the rank's KV staging on its device, by copies on its stream)
  /// and written by its append_prefill. Throws shape_error (layer, sequence, token count, null
  /// plane), state_error (layer already written) before any rank writes.
  void append_prefill(int layer, sequence_id seq, const kv_input& kv) {
    seq_state& st = state(seq, layer, "append_prefill");
    if (st.ready[std::size_t(layer)])
      throw state_error("tensor_parallel_mla::append_prefill: layer " + std::to_string(layer) + " of sequence " +
                        std::to_string(seq) + " already holds its prompt (" + std::to_string(st.prompt) + " tokens)");
    if (kv.num_tokens != st.prompt)
      throw shape_error("tensor_parallel_mla::append_prefill: " + std::to_string(kv.num_tokens) +
                        " tokens given, sequence " + std::to_string(seq) + " was begun with a prompt of " +
                        std::to_string(st.prompt));
    if (kv.num_tokens > 0 && kv.planes[0] == nullptr)
      throw shape_error("tensor_parallel_mla::append_prefill: KV plane 0 is null");
    const index_t stride = kv.stride(layout_), D = batch_tokens();
    if constexpr (!host_path) {
      prefill_on_devices(layer, seq, kv, st.prompt, stride, D);
    } else {
      for (int r = 0; r < ranks(); ++r) {
        gather_.clear();
        for (index_t t0 = index_t(r) * D; t0 < st.prompt; t0 += index_t(ranks()) * D) {
          const index_t n = std::min(D, st.prompt - t0);
          for (index_t t = t0; t < t0 + n; ++t)
            gather_.insert(gather_.end(), kv.planes[0] + t * stride, kv.planes[0] + t * stride + Layout::row_elems);
        }
        if (gather_.empty()) continue;  // a rank without tokens of the prompt has nothing to write
        kv_input part;
        part.planes[0] = gather_.data();
        part.num_tokens = index_t(gather_.size()) / Layout::row_elems;
        cache(r).append_prefill(layer, ranks_.id_on(r, seq), part);
      }
    }
    st.ready[std::size_t(layer)] = 1;
  }

  /// One decode token per sequence (token i of `kv` belongs to seqs[i]), each
  /// to the rank of its position. Throws shape_error (sizes, unknown or
  /// repeated sequence), state_error (prompt not written; the rank's D-window
  /// still full: flush() after every step's last layer) before any write.
  void append(int layer, std::span<const sequence_id> seqs, const kv_input& kv) {
    if (kv.num_tokens != index_t(seqs.size()))
      throw shape_error("tensor_parallel_mla::append: " + std::to_string(kv.num_tokens) + " tokens for " +
                        std::to_string(seqs.size()) + " sequences (one token per sequence)");
    if (kv.num_tokens > 0 && kv.planes[0] == nullptr) throw shape_error("tensor_parallel_mla::append: KV plane 0 is null");
    const index_t D = batch_tokens();
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const seq_state& st = state(seqs[i], layer, "append");
      for (std::size_t j = 0; j < i; ++j)
        if (seqs[j] == seqs[i])
          throw shape_error("tensor_parallel_mla::append: sequence " + std::to_string(seqs[i]) + " appears twice in the batch");
      if (!st.ready[std::size_t(layer)])
        throw state_error("tensor_parallel_mla::append: layer " + std::to_string(layer) + " of sequence " +
                          std::to_string(seqs[i]) + " has no prompt KV yet (append_prefill first)");
      const index_t pos = st.length[std::size_t(layer)];
      const int r = rank_of_token(pos);
      const int w = cache(r).sequence(ranks_.id_on(r, seqs[i])).window_tokens[std::size_t(layer)];
      if (w >= D)
        throw state_error("tensor_parallel_mla::append: token " + std::to_string(pos) + " of sequence " +
                          std::to_string(seqs[i]) + " belongs to rank " + std::to_string(r) +
                          ", whose D-window in layer " + std::to_string(layer) + " is still full (" + std::to_string(w) +
                          " tokens); call flush() after the last layer of each step");
    }
    const index_t stride = kv.stride(layout_);
    if constexpr (!host_path) {
      append_on_devices(layer, seqs, kv, stride);
    } else {
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        seq_state& st = seqs_[std::size_t(seqs[i])];
        const int r = rank_of_token(st.length[std::size_t(layer)]);
        kv_input one;
        one.planes[0] = kv.planes[0] + index_t(i) * stride;
        one.num_tokens = 1;
        const sequence_id id = ranks_.id_on(r, seqs[i]);
        cache(r).append(layer, std::span<const sequence_id>(&id, 1), one);
        ++st.length[std::size_t(layer)];
      }
    }
  }

  /// Every rank's flush(); the reports summed.
  flush_report flush() { return ranks_.flush(); }

  /// One layer's step for `seqs` (see the class comment).
  ///   q    [batch][Hq][q_dim] fp32 (absorbed q'), activation space (a device backend: on rank 0's device)
  ///   out  [batch][Hq][v_dim] fp32 (+ optional lse [batch][Hq]): the merge of the ranks' partials
  /// Device backends: ordered after the work on rank 0's caller stream; the
  /// merge runs on that stream (file comment).
  /// Returns each rank's step_report (rank order; a rank that holds no token
  /// of the batch does not step and reports zeros). Throws shape_error /
  /// state_error for the input before any work; what a rank's step throws.
  std::span<const step_report> step(int layer, std::span<const sequence_id> seqs,
                                    mem_span<const float, activation_space> q, float scale,
                                    const step_outputs<activation_space>& out) {
    const int n = ranks(), hq = layout_.num_q_heads();
    const index_t batch = index_t(seqs.size());
    const index_t max_seqs = ranks_.at(0).cache.spec().max_sequences;
    if (batch > max_seqs)
      throw shape_error("tensor_parallel_mla::step: batch of " + std::to_string(batch) +
                        " sequences exceeds max_sequences " + std::to_string(max_seqs));
    const index_t rows = batch * hq;
    if (q.size() != rows * Layout::q_dim || out.out.size() != rows * Layout::v_dim ||
        (!out.lse.empty() && out.lse.size() != rows))
      throw shape_error("tensor_parallel_mla::step: q, out, lse have " + std::to_string(q.size()) + ", " +
                        std::to_string(out.out.size()) + ", " + std::to_string(out.lse.size()) +
                        " elements; expected batch*Hq*q_dim = " + std::to_string(rows * Layout::q_dim) +
                        ", batch*Hq*v_dim = " + std::to_string(rows * Layout::v_dim) + ", batch*Hq = " +
                        std::to_string(rows) + " (or 0)");
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const seq_state& st = state(seqs[i], layer, "step");
      for (std::size_t j = 0; j < i; ++j)
        if (seqs[j] == seqs[i])
          throw shape_error("tensor_parallel_mla::step: sequence " + std::to_string(seqs[i]) + " appears twice in the batch");
      if (!st.ready[std::size_t(layer)])
        throw state_error("tensor_parallel_mla::step: layer " + std::to_string(layer) + " of sequence " +
                          std::to_string(seqs[i]) + " has no prompt KV yet (append_prefill first)");
    }
    // Each rank's sub-batch: the sequences it holds tokens of, in batch order.
    for (int r = 0; r < n; ++r) {
      auto& sub = rows_[std::size_t(r)];
      sub.clear();
      for (std::size_t i = 0; i < seqs.size(); ++i)
        if (cache(r).sequence(ranks_.id_on(r, seqs[i])).total_tokens(layer) > 0) sub.push_back(int(i));
    }
    step_ids_.resize(std::size_t(n));
    for (int r = 0; r < n; ++r) {
      auto& ids = step_ids_[std::size_t(r)];
      ids.clear();
      for (int i : rows_[std::size_t(r)]) ids.push_back(ranks_.id_on(r, seqs[std::size_t(i)]));
    }
    reports_.assign(std::size_t(n), step_report{});
    if constexpr (!host_path) {
      step_on_devices(layer, q, scale, out, batch);
    } else {
      const std::size_t qrow = std::size_t(hq) * Layout::q_dim, orow = std::size_t(hq) * Layout::v_dim;
      ranks_.run([&](int r) {
        const auto& sub = rows_[std::size_t(r)];
        if (sub.empty()) return;
        float* qr = q_[std::size_t(r)].data();
        for (std::size_t k = 0; k < sub.size(); ++k)
          std::memcpy(qr + k * qrow, q.data() + std::size_t(sub[k]) * qrow, sizeof(float) * qrow);
        const index_t m = index_t(sub.size());
        step_outputs<activation_space> so{
            mem_span<float, activation_space>(o_[std::size_t(r)].data(), m * index_t(orow)),
            mem_span<float, activation_space>(lse_[std::size_t(r)].data(), m * hq), nullptr};
        reports_[std::size_t(r)] = attention(r).step(layer, step_ids_[std::size_t(r)],
                                                     mem_span<const float, activation_space>(qr, m * index_t(qrow)), scale, so);
      });
      // Merge in rank order from the empty state (merge_state_row(empty, x) == x).
      next_.assign(std::size_t(n), 0);
      for (index_t i = 0; i < batch; ++i) {
        float* o = out.out.data() + std::size_t(i) * orow;
        std::fill(o, o + orow, 0.0f);
        row_lse_.assign(std::size_t(hq), empty_lse);
        for (int r = 0; r < n; ++r) {
          const auto& sub = rows_[std::size_t(r)];
          std::size_t& k = next_[std::size_t(r)];
          if (k >= sub.size() || index_t(sub[k]) != i) continue;
          for (int h = 0; h < hq; ++h)
            merge_state_row(o + std::size_t(h) * Layout::v_dim, row_lse_[std::size_t(h)],
                            o_[std::size_t(r)].data() + k * orow + std::size_t(h) * Layout::v_dim,
                            lse_[std::size_t(r)][k * std::size_t(hq) + std::size_t(h)], o + std::size_t(h) * Layout::v_dim,
                            &row_lse_[std::size_t(h)], Layout::v_dim);
          ++k;
        }
        if (!out.lse.empty()) std::copy(row_lse_.begin(), row_lse_.end(), out.lse.data() + std::size_t(i) * std::size_t(hq));
      }
    }
    return reports_;
  }

 private:
  static constexpr bool host_path = host_accessible_space<activation_space>;
  using buffer = detail::tp_buffer<Backend>;

  [[nodiscard]] Backend& rank_backend(int r) noexcept { return ranks_.at(r).cache.backend(); }

  // Device path of append_prefill: rank r's rows of the prompt gathered into
  // its KV staging on its device (one copy per eviction batch, on its stream
  // after the caller's work), then its append_prefill from there.
  void prefill_on_devices(int layer, sequence_id seq, const kv_input& kv, index_t prompt, index_t stride, index_t D) {
    constexpr std::size_t row_bytes = std::size_t(Layout::row_elems) * sizeof(bf16);
    auto& dev = ranks_.device();
    ranks_.device_call([&] {
      for (int r = 0; r < ranks(); ++r) {
        const index_t m = rank_prompt_tokens(r, prompt);
        if (m == 0) continue;  // a rank without tokens of the prompt has nothing to write
        ranks_.device_rank_call(r, [&] {
          buffer& b = dkv_[std::size_t(r)];
          b.ensure(rank_backend(r), m * index_t(row_bytes), "tensor_parallel_mla: rank KV staging",
                   [&] { dev.synchronize_rank(r); });
          bf16* g = b.template as<bf16>();
          index_t k = 0;
          for (index_t t0 = index_t(r) * D; t0 < prompt; t0 += index_t(ranks()) * D) {
            const index_t c = std::min(D, prompt - t0);
            dev.copy_rows(r, g + std::size_t(k) * Layout::row_elems, row_bytes, r, kv.planes[0] + std::size_t(t0 * stride),
                          std::size_t(stride) * sizeof(bf16), 0, row_bytes, std::size_t(c));
            k += c;
          }
          kv_input part;
          part.planes[0] = g;
          part.num_tokens = k;
          cache(r).append_prefill(layer, ranks_.id_on(r, seq), part);
        });
      }
    });
  }

  // Device path of append (after validation): per rank, its tokens of the
  // batch in batch order, read where they are (a rank on rank 0's device) or
  // from a copy in its KV staging (row i of the batch in row i).
  void append_on_devices(int layer, std::span<const sequence_id> seqs, const kv_input& kv, index_t stride) {
    constexpr std::size_t row_bytes = std::size_t(Layout::row_elems) * sizeof(bf16);
    auto& dev = ranks_.device();
    owner_.resize(seqs.size());
    for (std::size_t i = 0; i < seqs.size(); ++i)
      owner_[i] = rank_of_token(seqs_[std::size_t(seqs[i])].length[std::size_t(layer)]);
    ranks_.device_call([&] {
      for (int r = 0; r < ranks(); ++r) {
        if (std::find(owner_.begin(), owner_.end(), r) == owner_.end()) continue;
        ranks_.device_rank_call(r, [&] {
          for (std::size_t i = 0; i < seqs.size(); ++i) {
            if (owner_[i] != r) continue;
            kv_input one;
            one.num_tokens = 1;
            const bf16* src = kv.planes[0] + std::size_t(index_t(i) * stride);
            if (dev.same_device(r)) {
              one.planes[0] = src;
            } else {
              bf16* d = dkv_[std::size_t(r)].template as<bf16>() + i * std::size_t(Layout::row_elems);
              dev.copy_rows(r, d, row_bytes, r, src, row_bytes, 0, row_bytes, 1);
              one.planes[0] = d;
            }
            const sequence_id id = ranks_.id_on(r, seqs[i]);
            cache(r).append(layer, std::span<const sequence_id>(&id, 1), one);
            ++seqs_[std::size_t(seqs[i])].length[std::size_t(layer)];
          }
        });
      }
    });
  }

  // Device path of step(): per rank (its thread, its device current, its
  // caller stream after rank 0's): the query rows of its sub-batch gathered
  // (one copy per run of consecutive rows), its step, its partial state copied
  // to rank 0's device when it lies on another (peer copy); then on rank 0's
  // caller stream, after every rank's copies: the states set to empty and the
  // ranks' partials merged in rank order (launch_merge_rows).
  void step_on_devices(int layer, mem_span<const float, activation_space> q, float scale,
                       const step_outputs<activation_space>& out, index_t batch) {
    const int hq = layout_.num_q_heads();
    constexpr std::size_t F = sizeof(float);
    const std::size_t qrow = std::size_t(hq) * Layout::q_dim, orow = std::size_t(hq) * Layout::v_dim;
    auto& dev = ranks_.device();
    ranks_.device_call([&] {
      ranks_.run([&](int r) {
        const auto& sub = rows_[std::size_t(r)];
        if (sub.empty()) return;
        ranks_.device_rank_call(r, [&] {
          const std::size_t ur = std::size_t(r), m = sub.size();
          float* qr = dq_[ur].template as<float>();
          float* orr = do_[ur].template as<float>();
          float* lr = dl_[ur].template as<float>();
          for (std::size_t k = 0; k < m;) {
            std::size_t e = k + 1;
            while (e < m && sub[e] == sub[e - 1] + 1) ++e;
            const std::size_t bytes = (e - k) * qrow * F;
            dev.copy_rows(r, qr + k * qrow, bytes, r, q.data() + std::size_t(sub[k]) * qrow, bytes, 0, bytes, 1);
            k = e;
          }
          step_outputs<activation_space> so{mem_span<float, activation_space>(orr, index_t(m * orow)),
                                            mem_span<float, activation_space>(lr, index_t(m) * hq), nullptr};
          reports_[ur] = attention(r).step(layer, step_ids_[ur],
                                           mem_span<const float, activation_space>(qr, index_t(m * qrow)), scale, so);
          if (!dev.same_device(r)) {
            dev.copy_rows(r, land_o_[ur].template as<float>(), m * orow * F, 0, orr, m * orow * F, r, m * orow * F, 1);
            dev.copy_rows(r, land_l_[ur].template as<float>(), m * std::size_t(hq) * F, 0, lr, m * std::size_t(hq) * F,
                          r, m * std::size_t(hq) * F, 1);
          }
        });
      });
    });
    float* lse = out.lse.empty() ? state_lse_.template as<float>() : out.lse.data();
    dev.template init_states<Layout>(out.out.data(), lse, batch * hq);
    for (int r = 0; r < ranks(); ++r) {  // rank order 0..N-1, from the empty state
      const std::size_t ur = std::size_t(r);
      if (rows_[ur].empty()) continue;
      const bool here = dev.same_device(r);
      dev.template merge_rows<Layout>(out.out.data(), lse, (here ? do_[ur] : land_o_[ur]).template as<float>(),
                                      (here ? dl_[ur] : land_l_[ur]).template as<float>(), hq,
                                      std::span<const int>(rows_[ur]));
    }
  }

  struct seq_state {
    bool live = false;
    index_t prompt = 0;
    std::vector<index_t> length;       // [layer] tokens, all ranks
    std::vector<std::uint8_t> ready;   // [layer] prompt written
  };

  seq_state& state(sequence_id seq, int layer, const char* what) {
    return const_cast<seq_state&>(std::as_const(*this).state(seq, layer, what));
  }
  const seq_state& state(sequence_id seq, int layer, const char* what) const {
    const int layers = ranks_.at(0).cache.spec().num_layers;
    if (layer < 0 || layer >= layers)
      throw shape_error(std::string("tensor_parallel_mla::") + what + ": layer " + std::to_string(layer) +
                        " outside [0, " + std::to_string(layers) + ")");
    if (seq < 0 || std::size_t(seq) >= seqs_.size() || !seqs_[std::size_t(seq)].live)
      throw shape_error(std::string("tensor_parallel_mla::") + what + ": sequence " + std::to_string(seq) +
                        " is not a live sequence");
    return seqs_[std::size_t(seq)];
  }

  Layout layout_;
  ranks_type ranks_;
  std::vector<seq_state> seqs_;                   // [composite id]
  std::vector<bf16> gather_;                      // append_prefill: one rank's prompt rows
  std::vector<std::vector<float>> q_, o_, lse_;   // [rank] gathered queries, rank partials (host path)
  std::vector<buffer> dq_, do_, dl_, dkv_;        // [rank] the same on the rank's device; KV staging (device path)
  std::vector<buffer> land_o_, land_l_;           // [rank] its partials on rank 0's device (ranks on other devices)
  buffer state_lse_;                              // the merge's LSE state on rank 0's device (no lse asked for)
  std::vector<int> owner_;                        // append: the rank of each token of the batch
  std::vector<std::vector<int>> rows_;            // [rank] batch rows the rank attends
  std::vector<std::vector<sequence_id>> step_ids_;  // [rank] those rows' sequences, the rank's ids
  std::vector<std::size_t> next_;
  std::vector<float> row_lse_;
  std::vector<step_report> reports_;
};

}  // namespace writescope
