// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/flash_prefill_launch.hpp — the CUDA launch of the causal prefill
// attention (definition in flash_prefill.cu, nvcc; design and contract in
// flash_prefill.hpp). CUDA builds only: includes <cuda_runtime_api.h>; the
// host part (parameters, checks, host twin) is flash_prefill.hpp alone.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_prefill.hpp"

namespace ws_moe::gpu {

/// Runs the attention of flash_prefill_params on the device: every pointer,
/// seq_offsets included, is device memory; asynchronous on `stream` (returns
/// after the launch; out and lse are complete when the stream reaches it).
/// Checks the parameters first (check_flash_prefill: config_error, nothing
/// launched) and the launch with WS_CUDA_CHECK_LAST (writescope::cuda_error);
/// execution errors surface at the next synchronising call. The offsets are
/// read by the kernel and cannot be checked here: a sequence of negative
/// length is skipped, one longer than max_seq_tokens is left partly unwritten
/// (check_flash_prefill_offsets checks a host copy). One kernel launch per
/// call, no allocation; safe to call from several host threads on different
/// streams.
void launch_flash_prefill(const flash_prefill_params& p, cudaStream_t stream);

}  // namespace ws_moe::gpu
