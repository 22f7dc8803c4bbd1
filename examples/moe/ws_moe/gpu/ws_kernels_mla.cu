// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/ws_kernels_mla.cu — writescope's GPU attention kernels
// (kernels.cuh) for the MLA layouts of the CUDA path: (kv_lora_rank, rope) =
// (512, 64) for DeepSeek-V2 / V2-Lite and (128, 32) for the transformers
// fixtures. Compiled by nvcc.
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE(writescope::mla_layout<512, 64>)
WS_CUDA_INSTANTIATE(writescope::mla_layout<128, 32>)
