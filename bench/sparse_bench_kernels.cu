// SPDX-License-Identifier: Apache-2.0
// bench/sparse_bench_kernels.cu — the one .cu file of sparse_bench: the GPU
// kernels' launchers (writescope/cuda/kernels.cuh) for the Qwen3-30B-A3B
// layout (GQA d 128). Compiled by nvcc.
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE_COMMON()
WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
