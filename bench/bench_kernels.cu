// SPDX-License-Identifier: Apache-2.0
// bench/bench_kernels.cu — the one .cu file of the CUDA benchmarks: explicit
// instantiations of the GPU kernels' launchers (writescope/cuda/kernels.cuh)
// for the layouts of the three presets (Qwen3-30B-A3B and Mixtral-8x7B: GQA
// d 128; DeepSeek-V2-Lite: absorbed MLA 512 + 64), with the slow-consumer
// kernels of the ablation arms' backend (cuda_test_hooks). Compiled by nvcc.
#include <writescope/cuda/kernels.cuh>

WS_CUDA_INSTANTIATE_COMMON()
WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
WS_CUDA_INSTANTIATE(writescope::mla_layout<512, 64>)
WS_CUDA_INSTANTIATE_TEST_HOOKS(writescope::gqa_layout<128>)
WS_CUDA_INSTANTIATE_TEST_HOOKS(writescope::mla_layout<512, 64>)
