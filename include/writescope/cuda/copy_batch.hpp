// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/copy_batch.hpp — the host<->device copies of one backend
// call, gathered and submitted to one stream at once (paper §4.2: a prefill
// routed per eviction batch writes its host blocks as many separate pieces).
//
// add() records a piece (device address, host address, bytes) and merges it
// into the previous one when both ends continue it; submit() splits every
// piece at page-locked registration boundaries (pinned_registry::split: the
// driver refuses a copy across two) and enqueues them all with one
// cudaMemcpyBatchAsync (CUDA runtime and driver 12.8 or later; sources read in
// stream order), or with one cudaMemcpyAsync each where that call does not
// exist, where set_batched(false) asks for it, or on the legacy default
// stream. A prefill routed one eviction batch at a time alternates between the
// host regions, so in write order its blocks are rarely adjacent (4 × 32K
// tokens: about 1,660 pieces per layer); issued one by one, such pieces fill
// the driver's command queue and stall the thread that enqueues the model's
// kernels.
//
// Memory: the host side of each piece is page-locked host memory (pinned
// blocks or a bounce buffer; pageable destinations are not submitted here),
// the device side device memory. Threads: one owner thread per object (not
// thread-safe); objects on different threads may submit at once.
// Errors: cuda_error from the CUDA calls (a driver without the batch entry
// point falls back to single copies without error).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../config.hpp"
#include "cuda_error.hpp"
#include "pinned_allocators.hpp"

namespace writescope::cuda_detail {

/// Direction of every piece of one copy_batch submission.
enum class copy_direction : std::uint8_t { device_to_host, host_to_device };

class copy_batch {
 public:
  /// Records `bytes` from `src` to `dst` (bytes <= 0: nothing). For
  /// device_to_host, `dst` is the host side; for host_to_device, `src` is.
  /// Merged into the previous piece when dst and src both continue it.
  void add(void* dst, const void* src, index_t bytes) {
    if (bytes <= 0) return;
    if (!pieces_.empty()) {
      piece& p = pieces_.back();
      if (static_cast<std::byte*>(p.dst) + p.bytes == dst &&
          static_cast<const std::byte*>(p.src) + p.bytes == static_cast<const std::byte*>(src)) {
        p.bytes += bytes;
        return;
      }
    }
    pieces_.push_back({dst, src, bytes});
  }

  /// Pieces recorded since the last submit (after merging).
  [[nodiscard]] std::size_t pieces() const noexcept { return pieces_.size(); }
  [[nodiscard]] bool empty() const noexcept { return pieces_.empty(); }

  /// Enqueues every recorded piece on `stream` (after the work already there;
  /// no order among the pieces) and forgets them. `split_registrations`
  /// false is the K8 mutation (cuda_debug_options::skip_registration_split):
  /// pieces reach the driver whole.
  void submit(cudaStream_t stream, copy_direction dir, bool split_registrations = true) {
    if (pieces_.empty()) return;
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    for (const piece& p : pieces_) {
      auto push = [&](index_t off, index_t len) {
        dsts_.push_back(static_cast<std::byte*>(p.dst) + off);
        srcs_.push_back(static_cast<const std::byte*>(p.src) + off);
        sizes_.push_back(static_cast<std::size_t>(len));
      };
      if (!split_registrations)
        push(0, p.bytes);
      else
        pinned_registry::instance().split(dir == copy_direction::device_to_host ? p.dst : p.src, p.bytes, push);
    }
    pieces_.clear();
    const cudaMemcpyKind kind =
        dir == copy_direction::device_to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    ++submissions_;
    copies_ += dsts_.size();
    if (dsts_.size() > 1 && batched_ && stream != nullptr && stream != cudaStreamLegacy && batch_available()) {
      if (submit_batch(stream)) return;
    }
    for (std::size_t i = 0; i < dsts_.size(); ++i)
      WS_CUDA_TRY(cudaMemcpyAsync(dsts_[i], srcs_[i], sizes_[i], kind, stream));
    api_calls_ += dsts_.size();
  }

  /// Discards the recorded pieces (after an error, before a retry).
  void clear() noexcept { pieces_.clear(); }

  /// true (default): one cudaMemcpyBatchAsync per submission where available;
  /// false: one cudaMemcpyAsync per piece (the baseline a benchmark compares with).
  void set_batched(bool on) noexcept { batched_ = on; }
  [[nodiscard]] bool batched() const noexcept { return batched_; }

  /// Counters since construction: submissions, copies after the split, and
  /// CUDA copy calls made (equal to copies when nothing was batched).
  [[nodiscard]] std::uint64_t submissions() const noexcept { return submissions_; }
  [[nodiscard]] std::uint64_t copies() const noexcept { return copies_; }
  [[nodiscard]] std::uint64_t api_calls() const noexcept { return api_calls_; }

  /// Whether this process's runtime and driver offer cudaMemcpyBatchAsync.
  [[nodiscard]] static bool batch_available() noexcept {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
    static const bool ok = [] {
      int driver = 0;
      return cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12080;
    }();
    return ok && !batch_refused().load(std::memory_order_relaxed);
#else
    return false;
#endif
  }

 private:
  struct piece {
    void* dst;
    const void* src;
    index_t bytes;
  };

  // Set once a driver answered the batch call with "not supported"; shared by
  // every copy_batch of the process (backends may run on several threads).
  static std::atomic<bool>& batch_refused() noexcept {
    static std::atomic<bool> refused{false};
    return refused;
  }

  // One cudaMemcpyBatchAsync over dsts_/srcs_/sizes_; false when the entry
  // point is not supported here (then nothing was enqueued and later
  // submissions use single copies).
  bool submit_batch(cudaStream_t stream) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t first = 0;
#  if CUDART_VERSION >= 13000
    const cudaError_t e = cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), dsts_.size(), &attr,
                                               &first, 1, stream);
#  else
    std::size_t fail_index = 0;
    const cudaError_t e =
        cudaMemcpyBatchAsync(dsts_.data(), const_cast<void**>(srcs_.data()), sizes_.data(), dsts_.size(), &attr,
                             &first, 1, &fail_index, stream);
#  endif
    if (e == cudaErrorNotSupported || e == cudaErrorCallRequiresNewerDriver) {
      (void)cudaGetLastError();
      batch_refused().store(true, std::memory_order_relaxed);
      return false;
    }
    WS_CUDA_TRY(e);
    ++api_calls_;
    return true;
#else
    (void)stream;
    return false;
#endif
  }

  std::vector<piece> pieces_;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<std::size_t> sizes_;
  bool batched_ = true;
  std::uint64_t submissions_ = 0, copies_ = 0, api_calls_ = 0;
};

}  // namespace writescope::cuda_detail
