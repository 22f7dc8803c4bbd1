// SPDX-License-Identifier: Apache-2.0
// CUDA-path instantiations for MLA (DeepSeek-V2): (kv_lora_rank, rope) =
// (512, 64) — DeepSeek-V2 and V2-Lite — and (128, 32) for the transformers
// fixtures, on the GPU (cuda_exec, CUDA builds only) and emulated on the host.
#include "ws_moe/gpu/device_run.hpp"
#include "ws_moe/gpu/emulated_exec.hpp"
#if defined(WS_MOE_HAS_CUDA)
#  include "ws_moe/gpu/cuda_exec.hpp"
#endif

namespace ws_moe {

namespace {
template <class L>
generation_result run_mla_layout(device_kind kind, const model_config& c, const weight_source& src,
                                 const std::vector<std::vector<int>>& prompts, runtime_policy policy,
                                 const run_options& o, const device_options& d, const load_hooks& hooks) {
  if (kind == device_kind::emulated)
    return detail::run_on<L, gpu::emulated_exec>(c, src, prompts, std::move(policy), o, d, hooks);
#if defined(WS_MOE_HAS_CUDA)
  return detail::run_on<L, gpu::cuda_exec>(c, src, prompts, std::move(policy), o, d, hooks);
#else
  throw writescope::config_error("--device cuda: this ws_decode was built without CUDA (no CUDA toolkit or cuBLAS at configure time)");
#endif
}
}  // namespace

generation_result run_mla_device(device_kind kind, const model_config& c, const weight_source& src,
                                 const std::vector<std::vector<int>>& prompts, runtime_policy policy,
                                 const run_options& o, const device_options& d, const load_hooks& hooks) {
  if (c.kv_lora_rank == 512 && c.qk_rope_head_dim == 64)
    return run_mla_layout<writescope::mla_layout<512, 64>>(kind, c, src, prompts, std::move(policy), o, d, hooks);
  if (c.kv_lora_rank == 128 && c.qk_rope_head_dim == 32)
    return run_mla_layout<writescope::mla_layout<128, 32>>(kind, c, src, prompts, std::move(policy), o, d, hooks);
  throw writescope::config_error("MLA kv_lora_rank " + std::to_string(c.kv_lora_rank) + " with qk_rope_head_dim " +
                                 std::to_string(c.qk_rope_head_dim) +
                                 " is not supported by the CUDA path; supported: 512/64 (DeepSeek-V2, V2-Lite), 128/32 (test models)");
}

}  // namespace ws_moe
