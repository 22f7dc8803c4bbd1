// SPDX-License-Identifier: Apache-2.0
// writescope/detail/stream_copy.hpp — a host copy whose destination is not
// read again by the CPU: the sparse gather into a page-locked staging buffer
// that only the DMA engine reads next.
//
// A plain memcpy of block-sized pieces (glibc switches to non-temporal stores
// only above a large threshold) reads every destination line before writing
// it (write-allocate), so the gather moves three bytes of DRAM traffic per
// byte copied. Non-temporal 16-byte stores skip that read (the gain:
// docs/DECISIONS.md).
//
// Host only; SSE2 (baseline x86-64), a plain memcpy elsewhere. Safe to
// include from code nvcc compiles (no target attributes, no xsimd).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__CUDA_ARCH__)
#  include <emmintrin.h>
#  define WRITESCOPE_STREAM_COPY_SSE2 1
#endif

namespace writescope::detail {

/// Copies `bytes` from `src` to `dst` (host memory, not overlapping) with
/// non-temporal stores where both are 16-byte aligned; the unaligned head and
/// tail (if any) by memcpy. The stores are weakly ordered: call
/// stream_copy_fence() before publishing the destination to another thread
/// or to a device copy. Thread-safe for disjoint destinations; never throws.
inline void stream_copy(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(WRITESCOPE_STREAM_COPY_SSE2)
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  if (((reinterpret_cast<std::uintptr_t>(d) | reinterpret_cast<std::uintptr_t>(s)) & 15u) != 0 || bytes < 256) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const std::size_t vec = bytes & ~std::size_t(63);
  for (std::size_t i = 0; i < vec; i += 64) {
    const __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_load_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  if (vec < bytes) std::memcpy(d + vec, s + vec, bytes - vec);
#else
  std::memcpy(dst, src, bytes);
#endif
}

/// Makes the calling thread's earlier stream_copy() stores visible before its
/// later stores (an sfence on x86; nothing elsewhere).
inline void stream_copy_fence() noexcept {
#if defined(WRITESCOPE_STREAM_COPY_SSE2)
  _mm_sfence();
#endif
}

}  // namespace writescope::detail
