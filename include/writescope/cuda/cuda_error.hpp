// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/cuda_error.hpp — the one way CUDA runtime calls are checked
// (docs/ERRORS.md). Compiles with the host compiler alone (only
// <cuda_runtime_api.h>) and under nvcc.
//
//   WS_CUDA_TRY(cudaMalloc(&p, n));   // throws writescope::cuda_error on failure
//   kernel<<<g, b, 0, s>>>(...);
//   WS_CUDA_CHECK_LAST();             // a launch error (bad configuration, ...)
//
// The message names the call as written, the error's name and description and
// the source location, e.g.
//   "cudaMalloc(&p, n) failed: cudaErrorMemoryAllocation (out of memory) at cuda_backend.hpp:120".
// cuda_error::code() is the cudaError_t value. A failed call's error is cleared
// from the runtime's "last error" slot before the throw (non-sticky errors do
// not leak into the next check); sticky errors (a faulting kernel) stay, as the
// context is unusable after them.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../error.hpp"

namespace writescope::cuda_detail {

/// Keeps only the file name of a path (messages stay short).
constexpr const char* base_name(const char* path) noexcept {
  const char* b = path;
  for (const char* p = path; *p != '\0'; ++p)
    if (*p == '/' || *p == '\\') b = p + 1;
  return b;
}

/// Builds the message and throws writescope::cuda_error. Out of line of the
/// checks so that the success path stays one compare.
[[noreturn]] inline void throw_cuda_error(cudaError_t code, const char* call, const char* file, int line) {
  (void)cudaGetLastError();  // clear a non-sticky error so the next check does not see it again
  std::string msg = std::string(call) + " failed: " + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) +
                    ") at " + base_name(file) + ":" + std::to_string(line);
  throw cuda_error(msg, static_cast<int>(code));
}

inline void check(cudaError_t code, const char* call, const char* file, int line) {
  if (code != cudaSuccess) throw_cuda_error(code, call, file, line);
}

/// For destructors and release functions (noexcept): ignores the result.
/// Errors there are either the process shutting down (cudaErrorCudartUnloading)
/// or a sticky error already reported by an earlier check.
inline void ignore(cudaError_t) noexcept {}

}  // namespace writescope::cuda_detail

/// Calls a CUDA runtime API function; throws writescope::cuda_error naming the
/// call, the error and the source location when it does not return cudaSuccess.
#define WS_CUDA_TRY(call) ::writescope::cuda_detail::check((call), #call, __FILE__, __LINE__)

/// After a kernel launch: throws writescope::cuda_error for a launch error.
/// Asynchronous execution errors surface at the next synchronising call.
#define WS_CUDA_CHECK_LAST() \
  ::writescope::cuda_detail::check(cudaGetLastError(), "kernel launch (cudaGetLastError)", __FILE__, __LINE__)
