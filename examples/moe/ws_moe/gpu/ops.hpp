// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/ops.hpp — host-visible declarations of the CUDA path's model
// kernels (definitions in ops.cu, nvcc) and of the GEMM descriptor both
// executors run (cuda_exec.hpp: cuBLAS; emulated_exec.hpp: a reference loop).
// Compiles with the host compiler (plus <cuda_runtime_api.h>) and with nvcc.
//
// All pointers are device memory; every launch is asynchronous on `stream` and
// checks the launch with WS_CUDA_CHECK_LAST (execution errors surface at the
// next synchronising call, as writescope::cuda_error).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernel_math.hpp"

namespace ws_moe::gpu {

/// Runs op(i) for every i in [0, n) (grid-stride loop). Explicitly
/// instantiated in ops.cu for the functors of kernel_math.hpp.
template <class Op>
void launch_elementwise(const Op& op, idx n, cudaStream_t stream);

/// RMSNorm (double sum of squares): one warp per row up to 512 elements, one CTA per row above.
void launch_rms_norm(const rms_norm_params& p, cudaStream_t stream);

/// The router's softmax + top-k of n token rows (route_op's semantics; one warp
/// per row; only the order of the double sum of exponentials differs from the
/// serial functor). Throws config_error for more than route_op::max_experts
/// experts, k outside [1, experts], or group-limited routing whose groups do not
/// divide the experts or exceed route_op::max_groups.
void launch_route(const route_op& p, idx n, cudaStream_t stream);

/// Causal softmax of a prefill score block, one CTA per row.
void launch_causal_softmax(const softmax_params& p, cudaStream_t stream);

/// The routed experts of one MoE layer, all in one launch (kernel_math.hpp
/// expert_gemv_params): grid (out / 8, experts), or (out / 8, blocks) over the
/// routed pairs' sorted experts (block_experts), a warp per output column.
/// Device pointers, asynchronous on `stream`. Throws config_error when in is
/// not a multiple of 8 or x_stride not of 4 (the 16-byte loads), for more
/// than 65535 experts, or block_experts with blocks outside [1, 65535]; the
/// pointers must be 16-byte aligned.
void launch_expert_gemv(const expert_gemv_params& p, cudaStream_t stream);

/// Device scratch bytes launch_sort_pairs needs for n items (CUB's query).
[[nodiscard]] std::size_t sort_pairs_temp_bytes(idx n);

/// Stable sort of n (key, value) pairs by key, all 32 bits (CUB device radix
/// sort): keys_out/values_out receive the sorted pairs; the inputs are not
/// modified. temp: device scratch of sort_pairs_temp_bytes(n) bytes or more.
/// Asynchronous on `stream`; throws config_error for n beyond 2^31-1 or too
/// little scratch.
void launch_sort_pairs(const unsigned* keys_in, unsigned* keys_out, const int* values_in, int* values_out, idx n,
                       void* temp, std::size_t temp_bytes, cudaStream_t stream);

/// Greedy sampling on the device: keys[r] = the largest argmax_key of row r of
/// x [rows][cols] fp32 (kernel_math.hpp; argmax_key_column gives its column,
/// the first maximum among the numbers, NaN never chosen), for rows in [0, 65535]. keys: [rows]
/// device memory, zeroed by the launch itself. Asynchronous on `stream`
/// (a memset and one kernel); throws config_error for rows or cols outside
/// their ranges.
void launch_argmax_rows(const float* x, idx rows, idx cols, std::uint64_t* keys, cudaStream_t stream);

/// Pairs launch_group_pairs takes in one launch (one CTA, a thread per pair).
inline constexpr idx group_pairs_max = 1024;

/// A decode step's grouping of its n = tokens * k routed (token, slot) pairs by
/// expert in one launch, for n <= group_pairs_max: the tables that
/// launch_sort_pairs (keys = experts, values = pair ids 0..n-1) followed by
/// expert_bounds_op and scatter_rows_op (row0 = first, no padding) write,
/// element for element: sorted_keys / sorted_pairs [n] (stable by expert),
/// first [E + 1], src_rows [n], comb_rows / comb_w [n]. experts / weights: the
/// router's [tokens][k]. Throws config_error for n outside [1, group_pairs_max]
/// or E outside [1, route_op::max_experts]. Asynchronous on `stream`.
void launch_group_pairs(const int* experts, const float* weights, idx n, int k, int E, unsigned* sorted_keys,
                        int* sorted_pairs, int* first, int* src_rows, int* comb_rows, float* comb_w,
                        cudaStream_t stream);

}  // namespace ws_moe::gpu
