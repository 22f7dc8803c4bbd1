// SPDX-License-Identifier: Apache-2.0
// tests/cuda/kernels_instantiate.cu — the one .cu file of the device tests:
// explicit instantiations of the GPU kernels' launchers (kernels.cuh) for the
// layouts the tests use, the slow-consumer kernels of the mutation tests'
// backend (basic_cuda_backend<cuda_test_hooks>) and the resident-region
// kernels (test_cuda_resident.cpp). Compiled by nvcc; everything
// else is host code.
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE_COMMON()
WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
WS_CUDA_INSTANTIATE(writescope::mla_layout<512, 64>)
WS_CUDA_INSTANTIATE_TEST_HOOKS(writescope::gqa_layout<128>)
WS_CUDA_INSTANTIATE_TEST_HOOKS(writescope::mla_layout<512, 64>)
