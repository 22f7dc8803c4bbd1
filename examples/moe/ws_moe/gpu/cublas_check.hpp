// SPDX-License-Identifier: Apache-2.0
// examples/moe/ws_moe/gpu/cublas_check.hpp — cuBLAS / cuBLASLt status to a
// typed exception (writescope::cuda_error carrying the status).
#pragma once

#include <cublas_v2.h>

#include <string>

#include <writescope/cuda/cuda_error.hpp>

namespace ws_moe::gpu {

/// Throws writescope::cuda_error for a cuBLAS status other than success.
inline void cublas_check(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw writescope::cuda_error(std::string(call) + " failed: " + cublasGetStatusName(s) + " (" +
                                   cublasGetStatusString(s) + ") at " + writescope::cuda_detail::base_name(file) + ":" +
                                   std::to_string(line),
                               int(s));
}

}  // namespace ws_moe::gpu

/// Calls a cuBLAS function; throws writescope::cuda_error unless it returns CUBLAS_STATUS_SUCCESS.
#define WS_CUBLAS_TRY(call) ::ws_moe::gpu::cublas_check((call), #call, __FILE__, __LINE__)
