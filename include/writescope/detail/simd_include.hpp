// SPDX-License-Identifier: Apache-2.0
// writescope/detail/simd_include.hpp — includes the x86 intrinsic headers
// first, with GCC 12's false -Wmaybe-uninitialized (raised inside its own
// AVX-512 headers, for the _mm512_undefined_* idiom, wherever they are
// inlined) silenced for those headers. Include this before xsimd or Eigen.
// Never included by code that nvcc compiles.
#pragma once

#if defined(__CUDACC__)
#  error "writescope: SIMD host headers must not be compiled by nvcc (x86 intrinsic headers break its front end)"
#endif

#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic push
#  pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#  pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if defined(__x86_64__) || defined(__i386__)
#  include <immintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__)
#  pragma GCC diagnostic pop
#endif
