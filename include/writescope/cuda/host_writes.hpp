// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/host_writes.hpp — the backend's writes into cache blocks
// (paper §4.2): the scatter of appended / prefilled token-major KV into blocks
// (write_blocks) and the eviction of full D-windows into the host regions
// (copy_blocks_to_host), with the device staging buffer, the page-locked
// eviction bounce buffer and the deferred pageable prefill writes. Host
// compiler only; basic_cuda_backend (cuda_backend.hpp) owns one and forwards
// its backend-concept members here.
//
// Memory spaces: appended KV and the D-window are device memory; the unpinned
// compute region is pageable host memory, the pinned load region page-locked
// host memory. Streams (context.hpp): device destinations are written on the
// caller stream; host destinations by D2H copies on the d2h stream (those
// into page-locked memory gathered and submitted together, copy_batch.hpp), ordered
// after the caller's work (RAW) and after every earlier streamed H2D read
// (h2d_done, C9; launches still with a launcher thread are joined first), and
// the d2h_done event recorded after them. Pageable destinations are complete
// when a call returns (the CPU reads them in place) unless deferred
// (set_deferred_host_writes); pinned ones land asynchronously
// (synchronize_host_writes waits). Every host-side copy is split at page-locked
// registration boundaries (pinned_registry::split; the driver refuses a copy
// across two). Threads: the thread that drives the backend; copies out of a
// bounce buffer run on up to 8 (evictions) or 16 (deferred writes) OpenMP
// threads. Errors: cuda_error for a failing CUDA call, resource_error /
// pinned_memory_error when the staging buffer cannot be allocated (a bounce
// buffer that cannot be page-locked is no error: the copies go direct, except
// from reserve_deferred_host_writes, which throws pinned_memory_error), and
// config_error for a reservation outside [0, the deferral's max_bytes].
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../backend.hpp"
#include "../config.hpp"
#include "../detail/bounce_copy.hpp"
#include "../error.hpp"
#include "../host_memory.hpp"
#include "../layout.hpp"
#include "context.hpp"
#include "copy_batch.hpp"
#include "cuda_error.hpp"
#include "handles.hpp"
#include "hooks.hpp"
#include "kernels.hpp"
#include "pinned_allocators.hpp"

namespace writescope::cuda_detail {

template <cuda_hooks Hooks>
class host_writes {
 public:
  explicit host_writes(backend_context<Hooks>& ctx)
      : ctx_(&ctx),
        staged_(unique_event::create()),
        staging_free_(unique_event::create()),
        evict_src_(unique_event::create()),
        deferred_done_(unique_event::create()) {}
  host_writes(const host_writes&) = delete;
  host_writes& operator=(const host_writes&) = delete;
  ~host_writes() {
    ignore(cudaStreamSynchronize(ctx_->caller));
    ignore(cudaStreamSynchronize(ctx_->d2h.get()));
    deferred_.clear();  // the blocks' owner (the cache) is gone or going: nothing reads them
    staging_ = device_buffer();
    eviction_bounce_ = host_allocation();
  }

  /// Largest device staging buffer write_blocks uses for host destinations.
  void set_max_staging_bytes(index_t bytes) noexcept { max_staging_bytes_ = std::max<index_t>(bytes, 1); }
  /// See basic_cuda_backend::set_batched_host_copies.
  void set_batched_host_copies(bool on) noexcept { d2h_copies_.set_batched(on); }
  [[nodiscard]] std::array<std::uint64_t, 3> host_copy_counters() const noexcept {
    return {d2h_copies_.submissions(), d2h_copies_.copies(), d2h_copies_.api_calls()};
  }

  /// Scatters token-major KV (device memory) into blocks. Device destinations
  /// (the D-window) are written by a kernel on the caller stream. Host
  /// destinations (prefill routed to the pinned / unpinned regions) go through a
  /// device staging buffer (grown once, on first use; it is the only allocation
  /// on this path) and D2H copies on the d2h stream, coalesced over consecutive
  /// destination blocks, ordered after the scatter and after every earlier H2D
  /// read (C9). Pageable destinations take the eviction path's page-locked
  /// bounce buffer (set_eviction_bounce_bytes; direct copies when it is 0 or
  /// cannot be page-locked). Returns once pageable destinations are complete;
  /// pinned ones complete asynchronously (read_token / synchronize_host_writes wait).
  template <kv_layout Layout>
  void write_blocks(const block_format<Layout>& fmt, const kv_tokens<Layout, device_space>& kv,
                    std::span<const block_write> writes) {
    if (writes.empty()) return;
    d2h_copies_.clear();            // pieces an earlier call left after an error
    ctx_->join_pending_launches();  // C9: a launched step's H2D reads are enqueued before h2d_done is waited on
    complete_host_writes();          // the previous call's deferred bytes: the bounce buffer is reused from offset 0
    gpu::scatter_params& sp = scatter_;
    bool vec = kv.stride(fmt.layout) % 8 == 0;
    for (int p = 0; p < 2; ++p) {
      const bf16* plane = kv.planes[std::size_t(p < Layout::planes ? p : 0)];
      sp.planes[p] = plane;
      vec = vec && reinterpret_cast<std::uintptr_t>(plane) % 16 == 0;
    }
    sp.token_stride = kv.stride(fmt.layout);
    sp.kv_heads = fmt.layout.kv_heads();
    sp.block_tokens = fmt.block_tokens;
    sp.vectorized = vec ? 1 : 0;
    sp.num_items = 0;
    auto push = [&](const block_write& w, bf16* dst) {
      sp.items[sp.num_items++] = {w.src_token, dst, w.num_tokens, w.dst_token};
      if (sp.num_items == gpu::max_scatter_items) {
        gpu::launch_scatter<Layout>(sp, ctx_->caller);
        sp.num_items = 0;
      }
    };
    auto flush_scatter = [&] {
      if (sp.num_items > 0) gpu::launch_scatter<Layout>(sp, ctx_->caller);
      sp.num_items = 0;
    };

    // Device destinations: straight into the blocks, on the caller stream.
    host_dst_.clear();
    for (std::size_t i = 0; i < writes.size(); ++i) {
      const block_write& w = writes[i];
      if (w.num_tokens <= 0) continue;
      if (w.dst_kind == memory_kind::device)
        push(w, w.dst);
      else
        host_dst_.push_back(i);
    }
    flush_scatter();
    if (host_dst_.empty()) return;
    // Staging images in destination order (memory kind, then address): a prompt routed one
    // eviction batch at a time alternates between the regions, so in write order few blocks
    // of one region are neighbours; sorted, a sequence's blocks of one region are, and the
    // loop below copies each such run as one piece out of adjacent images.
    std::stable_sort(host_dst_.begin(), host_dst_.end(), [&](std::size_t x, std::size_t y) {
      const block_write& a = writes[x];
      const block_write& b = writes[y];
      if (a.dst_kind != b.dst_kind) return a.dst_kind < b.dst_kind;
      return std::less<const bf16*>{}(a.dst, b.dst);
    });

    // Host destinations: scatter into staging block images, then D2H.
    const index_t block_bytes = fmt.block_bytes();
    const index_t block_elems = fmt.block_elems();
    const index_t n = index_t(host_dst_.size());
    ensure_staging(std::max(block_bytes, std::min(n * block_bytes, max_staging_bytes_ / block_bytes * block_bytes)));
    const index_t per_group = staging_.size_bytes() / block_bytes;
    const device_region<Layout> staging =  // block k: the image of the group's k-th destination
        contiguous_region(fmt, device_span<bf16>(staging_.as<bf16>(), per_group * block_elems));
    bool pageable = false;
    std::vector<block_copy>& bounced = prefill_bounce_copies_;
    for (index_t g0 = 0; g0 < n; g0 += per_group) {
      bounced.clear();
      const index_t g1 = std::min(n, g0 + per_group);
      wait(ctx_->caller, staging_free_);  // WAR: earlier D2H out of the staging buffer
      for (index_t j = g0; j < g1; ++j) push(writes[host_dst_[std::size_t(j)]], staging.block(j - g0).data());
      flush_scatter();
      record(staged_, ctx_->caller);
      wait(ctx_->d2h.get(), staged_);  // RAW: the scatter wrote the images
      if (!ctx_->debug.skip_block_reuse_wait) wait(ctx_->d2h.get(), ctx_->h2d_done);  // C9
      // Pageable destinations (the unpinned compute region): one DMA per copy
      // into the page-locked bounce buffer, then host threads copy the bytes
      // (bounce_to_pageable) instead of driver-staged pageable copies.
      auto copy_out = [&](bf16* dst, const bf16* src, index_t bytes, memory_kind kind) {
        if (kind == memory_kind::pageable_host && eviction_bounce_max_bytes_ > 0)
          bounced.push_back(block_copy{src, dst, bytes, kind});
        else
          copy_d2h(dst, src, bytes, kind);
      };
      for (index_t j = g0; j < g1;) {
        const block_write& w = writes[host_dst_[std::size_t(j)]];
        const bf16* img = staging.block(j - g0).data();
        pageable = pageable || w.dst_kind == memory_kind::pageable_host;
        const bool full = w.dst_token == 0 && w.num_tokens == fmt.block_tokens;
        if (full) {  // coalesce consecutive full destination blocks
          index_t run = 1;
          while (j + run < g1) {
            const block_write& x = writes[host_dst_[std::size_t(j + run)]];
            if (x.dst_token != 0 || x.num_tokens != fmt.block_tokens || x.dst_kind != w.dst_kind ||
                x.dst != w.dst + run * block_elems)
              break;
            ++run;
          }
          copy_out(w.dst, img, run * block_bytes, w.dst_kind);
          j += run;
        } else {  // only the written rows of every (plane, head) slice
          const index_t len = index_t(w.num_tokens) * Layout::row_elems * index_t(sizeof(bf16));
          for (int p = 0; p < Layout::planes; ++p)
            for (int h = 0; h < fmt.layout.kv_heads(); ++h) {
              const index_t at = fmt.offset(p, h, w.dst_token, 0);
              copy_out(w.dst + at, img + at, len, w.dst_kind);
            }
          ++j;
        }
      }
      if (!bounced.empty()) {
        if (deferred_max_bytes_ > 0 && !deferred_refused_) {
          defer_to_pageable(bounced);  // D2H into the prefill bounce buffer; the host copies later
        } else if (ensure_eviction_bounce(bounced)) {
          bounce_to_pageable(bounced);  // returns with the bytes in place
        } else {
          for (const block_copy& c : bounced) copy_d2h(c.dst, c.src, c.bytes, c.dst_kind);
          pageable_direct_ = true;
        }
      }
      submit_d2h();  // the group's page-locked destinations, in one submission
      record(staging_free_, ctx_->d2h.get());
      record(ctx_->d2h_done, ctx_->d2h.get());
    }
    if (pageable && (deferred_max_bytes_ == 0 || pageable_direct_)) WS_CUDA_TRY(cudaStreamSynchronize(ctx_->d2h.get()));
    pageable_direct_ = false;
  }

  /// Eviction (paper §4.2): device -> host copies on the d2h stream, ordered
  /// after everything enqueued on the caller stream so far (the appends that
  /// wrote the D-window, RAW) and after every earlier H2D read of host blocks
  /// (C9); the caller stream then waits for the copies before its next append
  /// can overwrite the slots (WAR). Returns once pageable destinations are
  /// complete (the CPU engine reads them in place); pinned ones land
  /// asynchronously and the next step's streaming waits for them.
  ///
  /// Pageable destinations (the unpinned compute region) go through a
  /// page-locked bounce buffer (set_eviction_bounce_bytes): one DMA per copy
  /// into it at full speed, one wait, then host threads copy the bytes to
  /// their blocks. A cudaMemcpyAsync straight into pageable memory is staged
  /// by the driver and returns only when done, one copy after the other, and
  /// an eviction batch is one copy per sequence and layer (docs/DECISIONS.md). If the bounce buffer cannot be
  /// page-locked, evictions fall back to direct copies (nothing else changes).
  void copy_blocks_to_host(std::span<const block_copy> copies) {
    d2h_copies_.clear();
    ctx_->join_pending_launches();  // C9, as in write_blocks
    complete_host_writes();          // deferred prefill bytes land before any later write can reach their blocks
    if (copies.empty()) return;
    record(evict_src_, ctx_->caller);
    if (!ctx_->debug.skip_eviction_wait) wait(ctx_->d2h.get(), evict_src_);
    if (!ctx_->debug.skip_block_reuse_wait) wait(ctx_->d2h.get(), ctx_->h2d_done);
    bool pageable = false;
    for (const block_copy& c : copies) pageable = pageable || (c.bytes > 0 && c.dst_kind == memory_kind::pageable_host);
    const bool bounce = pageable && ensure_eviction_bounce(copies);
    if (bounce) bounce_to_pageable(copies);  // first: its waits then cover no pinned copy
    for (const block_copy& c : copies) {
      if (c.bytes <= 0 || (bounce && c.dst_kind == memory_kind::pageable_host)) continue;
      copy_d2h(c.dst, c.src, c.bytes, c.dst_kind);
    }
    submit_d2h();
    record(ctx_->d2h_done, ctx_->d2h.get());
    wait(ctx_->caller, ctx_->d2h_done);
    if (pageable) WS_CUDA_TRY(cudaStreamSynchronize(ctx_->d2h.get()));
  }

  /// Size in bytes of the page-locked host bounce buffer for evictions into
  /// pageable memory, at most (allocated on the first such eviction, grown by
  /// doubling up to the largest batch seen, capped here); 0 = direct copies
  /// into pageable memory (the driver stages them). Default 32 MiB. Frees the
  /// current buffer (after a device synchronize); call it between steps, from
  /// the thread that drives the cache; never throws.
  void set_eviction_bounce_bytes(index_t bytes) noexcept {
    eviction_bounce_max_bytes_ = std::max<index_t>(bytes, 0);
    eviction_bounce_ = host_allocation();
    eviction_bounce_refused_ = false;
  }
  /// Page-locks the bounce buffer now at its full size (set_eviction_bounce_bytes),
  /// so that no later eviction pins memory: inplace_kv_cache calls it at
  /// construction when its pinned region is pinned at init
  /// (pinned_initial_tokens = -1; fault kind K8: nothing is page-locked inside
  /// a step). A refusal is not an error: evictions then copy directly into
  /// pageable memory, as after set_eviction_bounce_bytes(0). Between steps,
  /// from the thread that drives the cache; never throws.
  void reserve_eviction_bounce() noexcept {
    if (eviction_bounce_max_bytes_ <= 0 || eviction_bounce_refused_ ||
        eviction_bounce_.size_bytes() >= eviction_bounce_max_bytes_)
      return;
    try {
      host_allocation b = allocate_page_locked(eviction_bounce_max_bytes_);
      if (cudaStreamSynchronize(ctx_->d2h.get()) != cudaSuccess) return;  // nothing may still write the old buffer
      eviction_bounce_ = std::move(b);
    } catch (...) {
      eviction_bounce_refused_ = true;
    }
  }
  /// Whether evictions into pageable memory go through the bounce buffer (false
  /// before the first one, with set_eviction_bounce_bytes(0), or when no
  /// buffer could be page-locked).
  [[nodiscard]] bool eviction_bounce_active() const noexcept { return bool(eviction_bounce_); }

  /// Waits until every host block written by write_blocks / copy_blocks_to_host
  /// has landed (inplace_kv_cache::read_token calls it before reading host
  /// memory), deferred pageable prefill writes included.
  void synchronize_host_writes() {
    complete_host_writes();
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_->d2h.get()));
  }

  /// Deferred pageable prefill writes (off by default): write_blocks then
  /// enqueues the D2H of blocks bound for pageable memory (the unpinned
  /// compute region) into a page-locked prefill bounce buffer and returns
  /// without waiting; host threads copy those bytes to their blocks at the
  /// next write_blocks, copy_blocks_to_host, complete_host_writes,
  /// synchronize_host_writes or synchronize call (hybrid_attention::step calls
  /// complete_host_writes before its CPU engine reads). The buffer grows to the
  /// pageable bytes of one write_blocks call, at most `max_bytes` (larger calls
  /// complete in pieces of that size); 0 turns deferral off (after completing
  /// what is pending). If the buffer cannot be page-locked, writes stay
  /// synchronous (through the eviction bounce buffer). Call between steps from
  /// the thread that drives the cache; complete (or synchronize) before
  /// destroying a cache whose blocks have pending writes. The completing calls
  /// (read_token through synchronize_host_writes included) are not safe to
  /// make from two threads at once.
  void set_deferred_host_writes(index_t max_bytes) {
    complete_host_writes();
    deferred_max_bytes_ = std::max<index_t>(max_bytes, 0);
    if (deferred_max_bytes_ == 0) deferred_bounce_ = host_allocation();
  }
  [[nodiscard]] index_t deferred_host_writes() const noexcept { return deferred_max_bytes_; }

  /// Page-locks the prefill bounce buffer of the deferred writes now at
  /// `bytes` (host memory, cudaHostAlloc), so that no later write_blocks
  /// page-locks it (the buffer otherwise grows by doubling inside the first
  /// prefill calls). `bytes` is in [0, deferred_host_writes()]: pass
  /// deferred_host_writes() to reserve the whole buffer; 0, or a buffer
  /// already at least that large, changes nothing. Completes the pending
  /// deferred writes first (their bytes live in the old buffer); a later
  /// write_blocks reuses the buffer from offset 0 and grows it no further while
  /// its pageable bytes fit. A success also ends an earlier refusal (deferral
  /// resumes). Between steps, from the thread that drives the cache. Errors:
  /// config_error naming `bytes` when it is negative or above
  /// deferred_host_writes(); pinned_memory_error when `bytes` cannot be
  /// page-locked (the buffer and the deferral state are then unchanged);
  /// cuda_error from completing the pending writes.
  void reserve_deferred_host_writes(index_t bytes) {
    if (bytes < 0 || bytes > deferred_max_bytes_)
      throw config_error("reserve_deferred_host_writes: bytes = " + std::to_string(bytes) + " must be in [0, " +
                         std::to_string(deferred_max_bytes_) +
                         "] (set_deferred_host_writes' max_bytes; 0 = deferral off)");
    if (bytes == 0 || deferred_bounce_.size_bytes() >= bytes) return;
    host_allocation b = allocate_page_locked(bytes);  // throws pinned_memory_error; nothing changed yet
    complete_host_writes();                          // nothing still reads or writes the old buffer
    deferred_bounce_ = std::move(b);
    deferred_refused_ = false;
  }
  /// Bytes of the prefill bounce buffer page-locked now (0 before the first
  /// deferred write or reserve_deferred_host_writes, and with deferral off).
  [[nodiscard]] index_t deferred_host_writes_reserved_bytes() const noexcept { return deferred_bounce_.size_bytes(); }

  /// Finishes the deferred pageable writes (of the last write_blocks call):
  /// waits for their D2H, then copies
  /// the bytes to their blocks (OpenMP threads when large). A no-op when none
  /// is pending.
  void complete_host_writes() {
    if (deferred_.empty()) return;
    WS_CUDA_TRY(cudaEventSynchronize(deferred_done_.get()));
    copy_out_of_bounce(deferred_bounce_.data(), deferred_, 16);
    deferred_.clear();
  }

 private:
  // The bounce buffer for this eviction's pageable copies: grown to their
  // total (at least doubling, capped at eviction_bounce_max_bytes_); false
  // (direct copies) when disabled, when one copy alone exceeds the buffer it
  // can have, or when no buffer could ever be page-locked. A refused growth
  // keeps the buffer it had (bounce_to_pageable works in groups).
  bool ensure_eviction_bounce(std::span<const block_copy> copies) {
    if (eviction_bounce_max_bytes_ <= 0) return false;
    index_t total = 0, largest = 0;
    for (const block_copy& c : copies)
      if (c.bytes > 0 && c.dst_kind == memory_kind::pageable_host) {
        total += c.bytes;
        largest = std::max(largest, c.bytes);
      }
    const index_t have = eviction_bounce_.size_bytes();
    if (have >= std::min(total, eviction_bounce_max_bytes_) || eviction_bounce_refused_) return largest <= have;
    if (largest > eviction_bounce_max_bytes_) return false;
    const index_t want = std::min(std::max(total, 2 * have), eviction_bounce_max_bytes_);
    host_allocation grown;
    try {
      grown = allocate_page_locked(want);
    } catch (const pinned_memory_error&) {
      eviction_bounce_refused_ = true;  // no retry on every eviction; keep what we have
      return largest <= have;
    }
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_->d2h.get()));  // nothing may still write the old buffer
    eviction_bounce_ = std::move(grown);
    return true;
  }

  using bounce_piece = ::writescope::detail::bounce_piece;  // a bounce buffer's bytes and their pageable block

  // Host copies of bounce pieces to their pageable blocks, in 1 MiB slices over
  // up to `max_threads` OpenMP threads (detail/bounce_copy.hpp).
  static void copy_out_of_bounce(const std::byte* buf, const std::vector<bounce_piece>& g, int max_threads) {
    ::writescope::detail::copy_out_of_bounce(buf, g, max_threads);
  }

  // Deferred pageable prefill writes of one staging group (set_deferred_host_writes):
  // D2H of each copy into the prefill bounce buffer after what is already
  // pending there (d2h stream, after the group's waits); when the buffer is
  // full, what is pending completes first (wait + host copies).
  void defer_to_pageable(std::span<const block_copy> copies) {
    index_t total = 0;
    for (const block_copy& c : copies) total += c.bytes;
    const index_t have = deferred_bounce_.size_bytes();
    index_t used = deferred_.empty() ? 0 : deferred_.back().offset + deferred_.back().bytes;
    if (have < std::min(used + total, deferred_max_bytes_)) {
      const index_t want = std::min(std::max(used + total, 2 * have), deferred_max_bytes_);
      if (!deferred_.empty()) {  // the pending bytes live in the old buffer
        submit_d2h();
        record(deferred_done_, ctx_->d2h.get());
        complete_host_writes();
        used = 0;
      }
      deferred_bounce_ = host_allocation();
      try {
        deferred_bounce_ = allocate_page_locked(want);
      } catch (const pinned_memory_error&) {  // no page-locked buffer: these and later writes stay synchronous
        deferred_refused_ = true;
        if (ensure_eviction_bounce(copies)) {
          bounce_to_pageable(copies);
        } else {
          for (const block_copy& c : copies) copy_d2h(c.dst, c.src, c.bytes, c.dst_kind);
          pageable_direct_ = true;
        }
        return;
      }
    }
    const index_t cap = deferred_bounce_.size_bytes();
    for (const block_copy& c : copies) {
      if (c.bytes > cap) {  // a single copy larger than the buffer: direct (driver-staged)
        copy_d2h(c.dst, c.src, c.bytes, c.dst_kind);
        pageable_direct_ = true;
        continue;
      }
      if (used + c.bytes > cap) {
        submit_d2h();
        record(deferred_done_, ctx_->d2h.get());
        complete_host_writes();
        used = 0;
      }
      // into the bounce buffer: consecutive staging images land back to back, one piece
      d2h_copies_.add(deferred_bounce_.data() + used, c.src, c.bytes);
      deferred_.push_back({c.dst, used, c.bytes});
      used += c.bytes;
    }
    submit_d2h();
    // every pending D2H so far is behind this record (one stream), also when a later step throws
    if (!deferred_.empty()) record(deferred_done_, ctx_->d2h.get());
  }

  // The pageable copies of an eviction through the bounce buffer, in groups
  // that fit it: D2H of each copy into its slice (d2h stream, after the waits
  // copy_blocks_to_host enqueued), one wait, then the host copies, spread over
  // OpenMP threads where the group is large.
  void bounce_to_pageable(std::span<const block_copy> copies) {
    std::byte* const buf = eviction_bounce_.data();
    const index_t cap = eviction_bounce_.size_bytes();
    group_.clear();
    auto drain = [&] {
      if (group_.empty()) return;
      submit_d2h();
      WS_CUDA_TRY(cudaStreamSynchronize(ctx_->d2h.get()));
      copy_out_of_bounce(buf, group_, 8);
      group_.clear();
    };
    index_t used = 0;
    for (const block_copy& c : copies) {
      if (c.bytes <= 0 || c.dst_kind != memory_kind::pageable_host) continue;
      if (used + c.bytes > cap) {
        drain();
        used = 0;
      }
      d2h_copies_.add(buf + used, c.src, c.bytes);
      group_.push_back({c.dst, used, c.bytes});
      used += c.bytes;
    }
    drain();
  }

  // Device -> host. Page-locked destinations join the d2h batch (submit_d2h
  // enqueues it; every record or wait on the d2h stream after copies comes
  // after a submit_d2h). Pageable ones are one driver-staged cudaMemcpyAsync
  // now. Both are split where the host range crosses a page-locked
  // registration (the driver rejects such copies); whole with the K8 mutation
  // switch cuda_debug_options::skip_registration_split.
  void copy_d2h(void* dst, const void* src, index_t bytes, memory_kind dst_kind) {
    if (dst_kind != memory_kind::pageable_host) {
      d2h_copies_.add(dst, src, bytes);
      return;
    }
    auto issue = [&](index_t off, index_t len) {
      WS_CUDA_TRY(cudaMemcpyAsync(static_cast<std::byte*>(dst) + off, static_cast<const std::byte*>(src) + off,
                                  static_cast<std::size_t>(len), cudaMemcpyDeviceToHost, ctx_->d2h.get()));
    };
    if (ctx_->debug.skip_registration_split)
      issue(0, bytes);
    else
      pinned_registry::instance().split(dst, bytes, issue);
  }

  void submit_d2h() {
    d2h_copies_.submit(ctx_->d2h.get(), copy_direction::device_to_host, !ctx_->debug.skip_registration_split);
  }

  void ensure_staging(index_t bytes) {
    if (staging_.size_bytes() >= bytes) return;
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_->caller));  // nothing may still use the old buffer
    WS_CUDA_TRY(cudaStreamSynchronize(ctx_->d2h.get()));
    staging_ = device_buffer();
    staging_ = allocate_device_buffer(bytes, "prefill staging buffer");
  }

  backend_context<Hooks>* ctx_;
  unique_event staged_, staging_free_, evict_src_;
  index_t max_staging_bytes_ = index_t{64} << 20;
  device_buffer staging_;
  index_t eviction_bounce_max_bytes_ = index_t{32} << 20;
  host_allocation eviction_bounce_;
  bool eviction_bounce_refused_ = false;
  std::vector<bounce_piece> group_;
  std::vector<block_copy> prefill_bounce_copies_;
  index_t deferred_max_bytes_ = 0;              ///< set_deferred_host_writes; 0 = off
  host_allocation deferred_bounce_;             ///< page-locked; the pending pieces' bytes
  std::vector<bounce_piece> deferred_;          ///< pending host copies (bounce offset -> block)
  unique_event deferred_done_;                  ///< recorded on d2h after the pending D2H
  bool deferred_refused_ = false;               ///< the prefill bounce buffer could not be page-locked
  bool pageable_direct_ = false;                ///< this write_blocks made a direct pageable copy
  gpu::scatter_params scatter_{};
  std::vector<std::size_t> host_dst_;           ///< write_blocks: indices of the host-destination writes
  copy_batch d2h_copies_;                       ///< page-locked D2H pieces not yet submitted (submit_d2h)
};

}  // namespace writescope::cuda_detail
