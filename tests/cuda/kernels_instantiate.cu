// tests/cuda/kernels_instantiate.cu — the one .cu file of the device tests:
// explicit instantiations of the GPU kernels' launchers (kernels.cuh) for the
// layouts the tests use. Compiled by nvcc; everything else is host code.
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE_COMMON()
WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
WS_CUDA_INSTANTIATE(writescope::mla_layout<512, 64>)
