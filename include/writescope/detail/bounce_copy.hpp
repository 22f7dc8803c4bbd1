// SPDX-License-Identifier: Apache-2.0
// writescope/detail/bounce_copy.hpp — the host side of a bounced device-to-host
// write (paper §4.2): pieces of a page-locked bounce buffer copied to their
// pageable destination blocks (cuda_backend's evictions and deferred prefill
// writes into the unpinned compute region, cuda/host_writes.hpp).
//
// The work is split by bytes, not by piece: a write in destination order
// merges a sequence's adjacent blocks into one piece, so a handful of pieces
// can hold hundreds of MiB, and one thread per piece would leave most cores
// idle. Each 1 MiB slice of the buffer's occupied range goes to one OpenMP
// thread; a slice covers the parts of every piece inside it.
//
// Host only; safe to include from code nvcc compiles. Threads: up to
// `max_threads` OpenMP threads of the calling thread's team; the destinations
// must not overlap each other or the buffer. Never throws.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "../config.hpp"

namespace writescope::detail {

/// A piece of a bounce buffer: bytes [offset, offset + bytes) go to dst.
struct bounce_piece {
  void* dst;
  index_t offset;
  index_t bytes;
};

/// Bytes of one thread's slice in copy_out_of_bounce.
inline constexpr index_t bounce_slice_bytes = index_t{1} << 20;

/// Copies every piece of `pieces` (sorted by offset, not overlapping; gaps
/// allowed) from `buf` to its destination, in 1 MiB slices spread over up to
/// `max_threads` OpenMP threads (one per slice at most).
inline void copy_out_of_bounce(const std::byte* buf, const std::vector<bounce_piece>& pieces,
                               int max_threads) noexcept {
  if (pieces.empty()) return;
  const index_t begin = pieces.front().offset;
  const index_t end = pieces.back().offset + pieces.back().bytes;
  const index_t slices = (end - begin + bounce_slice_bytes - 1) / bounce_slice_bytes;
  const auto slice = [&](index_t k) {
    const index_t a = begin + k * bounce_slice_bytes;
    const index_t b = std::min(end, a + bounce_slice_bytes);
    // the first piece that ends after a
    auto it = std::upper_bound(pieces.begin(), pieces.end(), a,
                               [](index_t v, const bounce_piece& p) { return v < p.offset + p.bytes; });
    for (; it != pieces.end() && it->offset < b; ++it) {
      const index_t s = std::max(a, it->offset);
      const index_t e = std::min(b, it->offset + it->bytes);
      if (e > s) std::memcpy(static_cast<std::byte*>(it->dst) + (s - it->offset), buf + s, std::size_t(e - s));
    }
  };
#if defined(_OPENMP)
  const int threads = int(std::clamp<index_t>(slices, 1, std::max(max_threads, 1)));
#  pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (index_t k = 0; k < slices; ++k) slice(k);
#else
  (void)max_threads;
  for (index_t k = 0; k < slices; ++k) slice(k);
#endif
}

}  // namespace writescope::detail
