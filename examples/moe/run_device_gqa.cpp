// SPDX-License-Identifier: Apache-2.0
// CUDA-path instantiations for GQA (Qwen3-MoE, Mixtral): head_dim 64 (the
// transformers fixtures) and 128 (the public models), on the GPU (cuda_exec,
// CUDA builds only) and emulated on the host (emulated_exec).
#include "ws_moe/gpu/device_run.hpp"
#include "ws_moe/gpu/emulated_exec.hpp"
#if defined(WS_MOE_HAS_CUDA)
#  include "ws_moe/gpu/cuda_exec.hpp"
#endif

namespace ws_moe {

bool cuda_path_built() noexcept {
#if defined(WS_MOE_HAS_CUDA)
  return true;
#else
  return false;
#endif
}

int cuda_devices() noexcept {
#if defined(WS_MOE_HAS_CUDA)
  return gpu::cuda_device_count();
#else
  return 0;
#endif
}

generation_result run_gqa_device(device_kind kind, const model_config& c, const weight_source& src,
                                 const std::vector<std::vector<int>>& prompts, runtime_policy policy,
                                 const run_options& o, const device_options& d, const load_hooks& hooks) {
  return writescope::dispatch_value<64, 128>(c.head_dim, "the CUDA path's GQA head dim", [&](auto hd) {
    using L = writescope::gqa_layout<decltype(hd)::value>;
    if (kind == device_kind::emulated)
      return detail::run_on<L, gpu::emulated_exec>(c, src, prompts, std::move(policy), o, d, hooks);
#if defined(WS_MOE_HAS_CUDA)
    return detail::run_on<L, gpu::cuda_exec>(c, src, prompts, std::move(policy), o, d, hooks);
#else
    throw writescope::config_error("--device cuda: this ws_decode was built without CUDA (no CUDA toolkit or cuBLAS at configure time)");
#endif
  });
}

}  // namespace ws_moe
