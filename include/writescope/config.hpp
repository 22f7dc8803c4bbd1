// SPDX-License-Identifier: Apache-2.0
// writescope/config.hpp — version, portability macros and feature probes.
//
// Every public header includes this first. It compiles under the host compiler
// and under nvcc; it never pulls in x86 intrinsic headers.
#pragma once

#include <cstdint>

#define WS_VERSION_MAJOR 0
#define WS_VERSION_MINOR 1
#define WS_VERSION_PATCH 0

// WS_HOST_DEVICE marks functions callable from host and device code.
#if defined(__CUDACC__)
#  define WS_HOST_DEVICE __host__ __device__
#  define WS_HAS_CUDA_COMPILER() 1
#else
#  define WS_HOST_DEVICE
#  define WS_HAS_CUDA_COMPILER() 0
#endif

// WS_DEBUG_CHECKS(): extra runtime assertions (page-locked sources, block ids in
// range). On in debug builds, off with NDEBUG unless WRITESCOPE_DEBUG_CHECKS=1.
#if defined(WRITESCOPE_DEBUG_CHECKS)
#  define WS_DEBUG_CHECKS() (WRITESCOPE_DEBUG_CHECKS)
#elif defined(NDEBUG)
#  define WS_DEBUG_CHECKS() 0
#else
#  define WS_DEBUG_CHECKS() 1
#endif

namespace writescope {

/// Token counts and byte offsets are 64-bit everywhere: a KV pool passes 4 GiB
/// quickly (fault kind K4, docs/RELIABILITY.md).
using index_t = std::int64_t;

/// Handle of a sequence inside one inplace_kv_cache (dense, reused after end_sequence).
using sequence_id = std::int32_t;

/// Index of a block inside one region's pool (same id in every layer's arena).
using block_id = std::int32_t;

namespace detail {
template <class...>
inline constexpr bool dependent_false = false;
}  // namespace detail

}  // namespace writescope
