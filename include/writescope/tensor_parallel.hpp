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
// every rank has finished. Each rank's CPU engine gets
// its share of attention_options::cpu_threads (the total, split as evenly as
// possible, at least 1 each), so the ranks' steps running at once do not
// oversubscribe the host. Prefill, append, flush and end_sequence run the
// ranks one after the other on the calling thread.
//
// Memory spaces: K/V inputs are in each rank's backend's activation space
// (host_backend: host memory) and are sliced without copies where the slice
// is a strided view (GQA heads); the MLA prefill and both steps gather
// queries and merge outputs with host memcpy, so step() (and the MLA prefill)
// require a backend whose activations are host-accessible (host_backend);
// a device backend needs device-side gathers, not provided here.
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
#include "hybrid_attention.hpp"
#include "inplace_kv_cache.hpp"
#include "layout.hpp"
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

/// The per-rank caches and steps and the sequence-id map shared by both
/// compositions (not a public API).
template <kv_layout Layout, backend Backend, pinned_allocator PinnedAllocator, routing_policy Policy,
          block_allocator BlockAllocator, class CpuKernel>
class tp_ranks {
 public:
  using cache_type = inplace_kv_cache<Layout, Backend, PinnedAllocator, Policy, BlockAllocator>;
  using attention_type = hybrid_attention<cache_type, CpuKernel>;

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
    ranks_.reserve(std::size_t(n));
    ids_.resize(std::size_t(n));
    id_buf_.resize(std::size_t(n));
    for (int r = 0; r < n; ++r) {
      attention_options ao = options;
      ao.cpu_threads = rank_cpu_threads(total_cpu_threads_, n, r);
      ranks_.push_back(std::make_unique<rank>(*backends[std::size_t(r)], rank_layout, spec, policy, pinned, co, ao));
    }
    team_ = std::make_unique<rank_team>(n);
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
      for (int r = 0; r < n; ++r) got.push_back(at(r).cache.begin_sequence(prompt_of(r)));
      const sequence_id id = got[0];
      for (int r = 0; r < n; ++r) {
        auto& m = ids_[std::size_t(r)];
        if (std::size_t(id) >= m.size()) m.resize(std::size_t(id) + 1, -1);
        m[std::size_t(id)] = got[std::size_t(r)];
      }
      return id;
    } catch (...) {
      for (std::size_t r = 0; r < got.size(); ++r) at(int(r)).cache.end_sequence(got[r]);
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
    at(0).cache.end_sequence(seq);  // validates (shape_error for an unknown id) before any rank changes
    for (int r = 1; r < size(); ++r) at(r).cache.end_sequence(id_on(r, seq));
    for (auto& m : ids_)
      if (std::size_t(seq) < m.size()) m[std::size_t(seq)] = -1;
  }

  flush_report flush() {
    flush_report sum;
    for (int r = 0; r < size(); ++r) {
      const flush_report f = at(r).cache.flush();
      sum.evicted_sequences += f.evicted_sequences;
      sum.cpu_batches += f.cpu_batches;
      sum.gpu_batches += f.gpu_batches;
      sum.hbm_batches += f.hbm_batches;
    }
    return sum;
  }

 private:
  std::vector<std::unique_ptr<rank>> ranks_;
  std::vector<std::vector<sequence_id>> ids_;  // [rank][composite id] -> the rank's id (-1: none)
  std::vector<std::vector<sequence_id>> id_buf_;  // [rank] ids_on()'s result
  int total_cpu_threads_ = 1;
  std::unique_ptr<rank_team> team_;  // after ranks_: its threads end (idle) before the ranks go
};

inline void check_ranks(int n, const char* what) {
  if (n < 1)
    throw config_error(std::string(what) + ": " + std::to_string(n) + " ranks (backends) given; at least 1 is needed");
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
    q_.resize(n);
    o_.resize(n);
    lse_.resize(n);
    for (std::size_t r = 0; r < n; ++r) {
      const std::size_t rows = std::size_t(spec.max_sequences) * std::size_t(rank_q_heads());
      q_[r].resize(rows * Layout::q_dim);
      o_[r].resize(rows * Layout::v_dim);
      lse_[r].resize(rows);
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
  void append_prefill(int layer, sequence_id seq, const kv_input& kv) {
    for (int r = 0; r < ranks(); ++r) cache(r).append_prefill(layer, ranks_.id_on(r, seq), slice(kv, r));
  }
  /// One decode token per sequence (token i of `kv`, full heads, belongs to seqs[i]).
  void append(int layer, std::span<const sequence_id> seqs, const kv_input& kv) {
    for (int r = 0; r < ranks(); ++r) cache(r).append(layer, ranks_.ids_on(r, seqs), slice(kv, r));
  }
  /// Every rank's flush(); the reports summed (a batch of a sequence counts once per rank).
  flush_report flush() { return ranks_.flush(); }

  /// One layer's step for `seqs` on every rank at once (see the file comment).
  ///   q    [batch][Hq][q_dim] fp32, host-accessible activation space
  ///   out  [batch][Hq][v_dim] fp32 (+ optional lse [batch][Hq]); head h of a
  ///        row is written by the rank that holds it
  /// Returns each rank's step_report (rank order), valid until the next step.
  /// Throws shape_error for sizes before any work; what a rank's step throws.
  std::span<const step_report> step(int layer, std::span<const sequence_id> seqs,
                                    mem_span<const float, activation_space> q, float scale,
                                    const step_outputs<activation_space>& out) {
    static_assert(host_accessible_space<activation_space>,
                  "tensor_parallel_gqa::step gathers query heads with host memcpy: host-accessible activations only");
    const int n = ranks();
    const index_t batch = index_t(seqs.size());
    const int hq = layout_.num_q_heads(), hr = rank_q_heads();
    check_sizes("tensor_parallel_gqa::step", batch, q.size(), out, hq, cache(0).spec().max_sequences);
    reports_.resize(std::size_t(n));
    step_ids_.resize(std::size_t(n));
    for (int r = 0; r < n; ++r) step_ids_[std::size_t(r)] = ranks_.ids_on(r, seqs);  // before the threads start
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
    return reports_;
  }

 private:
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
  std::vector<std::vector<float>> q_, o_, lse_;  // [rank] gathered queries, rank outputs (host)
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
  static_assert(host_accessible_space<activation_space>,
                "tensor_parallel_mla gathers prompt rows and queries with host memcpy: host-accessible activations only");

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
    q_.resize(n);
    o_.resize(n);
    lse_.resize(n);
    rows_.resize(n);
    for (std::size_t r = 0; r < n; ++r) {
      q_[r].resize(rows * Layout::q_dim);
      o_[r].resize(rows * Layout::v_dim);
      lse_[r].resize(rows);
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

  /// The prompt KV of `seq` for `layer` (all P tokens, host-accessible): each
  /// rank's tokens are gathered into a host buffer and written by its
  /// append_prefill. Throws shape_error (layer, sequence, token count, null
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

  /// Every rank's flush(); the reports summed.
  flush_report flush() { return ranks_.flush(); }

  /// One layer's step for `seqs` (see the class comment).
  ///   q    [batch][Hq][q_dim] fp32 (absorbed q'), host-accessible
  ///   out  [batch][Hq][v_dim] fp32 (+ optional lse [batch][Hq]): the merge of the ranks' partials
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
    return reports_;
  }

 private:
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
  std::vector<std::vector<float>> q_, o_, lse_;   // [rank] gathered queries, rank partials (host)
  std::vector<std::vector<int>> rows_;            // [rank] batch rows the rank attends
  std::vector<std::vector<sequence_id>> step_ids_;  // [rank] those rows' sequences, the rank's ids
  std::vector<std::size_t> next_;
  std::vector<float> row_lse_;
  std::vector<step_report> reports_;
};

}  // namespace writescope
