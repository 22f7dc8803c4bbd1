// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/ws_kernels_gqa.cu — writescope's GPU attention kernels
// (kernels.cuh) for the GQA layouts of the CUDA path: head_dim 64 (the
// transformers fixtures) and 128 (Qwen3-30B-A3B, Mixtral-8x7B). Also the
// layout-independent launchers, exactly once per program. Compiled by nvcc;
// split from the MLA layouts so the two compile in parallel.
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE_COMMON()
WS_CUDA_INSTANTIATE(writescope::gqa_layout<64>)
WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
