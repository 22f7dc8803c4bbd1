// SPDX-License-Identifier: Apache-2.0
// examples/minimal_cuda.cu — the one .cu file of examples/minimal_cuda.cpp,
// compiled by nvcc: the GPU kernels' launchers (writescope/cuda/kernels.cuh)
// explicitly instantiated for the layout the program uses. Every program that
// uses cuda_backend has exactly one such file; a layout used but not listed
// here fails at link time (undefined writescope::gpu::launch_attend<...>).
// The program's other code includes the host-only headers (writescope.hpp:
// the xsimd CPU kernel), which nvcc must not compile, hence a separate file.
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE_COMMON()
WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
