// SPDX-License-Identifier: Apache-2.0
// python/csrc/kernels.cu — the one .cu of the extension (nvcc): the GPU
// launchers of writescope/cuda/kernels.cuh for every layout engine.hpp
// instantiates (GQA head dims 64, 128, 256; MLA 512 + 64).
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE_COMMON()
WS_CUDA_INSTANTIATE(writescope::gqa_layout<64>)
WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
WS_CUDA_INSTANTIATE(writescope::gqa_layout<256>)
WS_CUDA_INSTANTIATE(writescope::mla_layout<512, 64>)
