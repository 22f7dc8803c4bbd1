// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/device_run.hpp — the CUDA path behind ws_decode's --device:
// runtime model config -> compile-time cache layout (docs/ARCHITECTURE.md §6) -> the
// device decoder on an executor:
//   cuda      cuda_exec: the GPU (built only where CMake found CUDA and cuBLAS)
//   emulated  emulated_exec: the same decoder on the host (always built; CI)
// Layouts: GQA head_dim in {64, 128} (run_device_gqa.cpp), MLA
// (kv_lora_rank, rope) in {(512, 64), (128, 32)} (run_device_mla.cpp); the
// writescope kernels are instantiated for exactly these (gpu/ws_kernels_*.cu).
#pragma once

#include <vector>

#include "../decoder.hpp"
#include "../model_config.hpp"
#include "../run.hpp"
#include "../runtime_policy.hpp"
#include "../weights.hpp"
#include "device_decoder.hpp"

namespace ws_moe {

enum class device_kind { host, emulated, cuda };

/// True when ws_decode was built with the CUDA path (CUDA toolkit + cuBLAS).
bool cuda_path_built() noexcept;
/// Usable CUDA devices (0 without a driver, a device, or the CUDA build).
int cuda_devices() noexcept;

generation_result run_gqa_device(device_kind kind, const model_config& c, const weight_source& src,
                                 const std::vector<std::vector<int>>& prompts, runtime_policy policy,
                                 const run_options& o, const device_options& d, const load_hooks& hooks);
generation_result run_mla_device(device_kind kind, const model_config& c, const weight_source& src,
                                 const std::vector<std::vector<int>>& prompts, runtime_policy policy,
                                 const run_options& o, const device_options& d, const load_hooks& hooks);

inline generation_result run_model_device(device_kind kind, const model_config& c, const weight_source& src,
                                          const std::vector<std::vector<int>>& prompts, runtime_policy policy,
                                          const run_options& o, const device_options& d, const load_hooks& hooks) {
  return c.kind == arch::deepseek_v2 ? run_mla_device(kind, c, src, prompts, std::move(policy), o, d, hooks)
                                     : run_gqa_device(kind, c, src, prompts, std::move(policy), o, d, hooks);
}

namespace detail {
template <class Layout, class Exec>
generation_result run_on(const model_config& c, const weight_source& src, const std::vector<std::vector<int>>& prompts,
                         runtime_policy policy, const run_options& o, const device_options& d, const load_hooks& hooks) {
  device_decoder<Layout, Exec> dec(c, src, d);
  generation_result r = dec.generate(prompts, std::move(policy), o, hooks.on_layer_loaded, hooks.on_loaded);
  if constexpr (Layout::is_mla)
    r.layout = "mla_layout<" + std::to_string(Layout::kv_lora_rank) + ", " + std::to_string(Layout::rope_dim) + ">";
  else
    r.layout = "gqa_layout<" + std::to_string(Layout::head_dim) + ">";
  return r;
}
}  // namespace detail

}  // namespace ws_moe
