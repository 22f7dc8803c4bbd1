// SPDX-License-Identifier: Apache-2.0
// ws_moe/vram_split.hpp — how the CUDA decoder divides the device memory left
// after the non-expert weights, the workspaces, the D-window and ping-pong
// between routed experts and the HBM-resident KV region (ws_decode --hbm-kv;
// docs/DECODER-INTERNALS.md, "One VRAM allocation model").
//
// Each use is worth the decode-step time its bytes save:
//
//   expert  P·t_cpu per MoE layer it serves, P = 1 − (1 − k/E)^batch the
//           probability that a decode step routes a row to it (top-k of E,
//           uniform routing: the placement is decided before any routing is
//           seen), t_cpu = its host bytes / the CPU's expert read rate;
//   KV      per token (all layers), the roofline's change of the step time
//           when one token leaves the host tiers for HBM while both sides are
//           busy: L·A·(B' − H)/(A + B'), B' = B − K (docs/ARCHITECTURE.md §2a);
//           A, B, K, H per token and layer.
//
// Divided by their device bytes these are benefit densities (seconds saved per
// step per byte). The denser use is filled first up to its demand — every
// routed expert; the planned KV, each sequence's prompt + max_new_tokens
// rounded up to whole eviction batches — and the other gets what is left. The
// whole workload is known at init, so the split is computed once from the
// planned final context; the region is then never resized.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <writescope/config.hpp>
#include <writescope/error.hpp>
#include <writescope/host_memory.hpp>

namespace ws_moe {

/// ws_decode --hbm-kv: the HBM-resident KV region's size.
enum class hbm_kv_mode {
  off,        ///< no region (the decoder as without the tier)
  automatic,  ///< the joint split below (capped by vram_split_inputs::cap_bytes when > 0)
  fixed,      ///< exactly vram_split_inputs::cap_bytes (whole eviction batches), refused when it does not fit
};

/// What the split weighs (all per decode step).
struct vram_split_inputs {
  writescope::index_t avail_bytes = 0;  ///< device bytes for routed experts + HBM KV
  bool sized = true;                    ///< false: the device has no size to split (emulated, no --vram-budget)
  // routed experts
  writescope::index_t experts_total = 0;      ///< routed experts over all MoE layers
  writescope::index_t expert_slab_bytes = 0;  ///< one expert's device footprint
  writescope::index_t expert_host_bytes = 0;  ///< one expert's bytes read by the CPU per use
  /// Device bytes the experts' side needs as soon as one expert stays on the
  /// host (the staging ring, the fp32 input rows): the KV leaves them free.
  writescope::index_t host_expert_floor_bytes = 0;
  int num_experts = 0, experts_per_token = 0, batch = 0;
  double cpu_expert_bytes_per_second = 0.0;
  // KV
  writescope::index_t kv_demand_tokens = 0;     ///< per layer, whole eviction batches
  writescope::index_t batch_tokens = 0;         ///< one eviction batch (D-window tokens)
  writescope::index_t kv_token_bytes = 0;       ///< one token over all layers, in the region's block format
  int num_layers = 0;
  double cpu_seconds_per_token = 0.0;     ///< A (one layer)
  double gpu_seconds_per_token = 0.0;     ///< B (one layer, streamed)
  double launch_seconds_per_token = 0.0;  ///< K (one layer)
  double hbm_seconds_per_token = 0.0;     ///< H (one layer, attended in place)
  hbm_kv_mode mode = hbm_kv_mode::automatic;
  writescope::index_t cap_bytes = 0;  ///< automatic: at most this (0: no cap); fixed: this
  /// What --kv-vram-budget-mib leaves for the region after the D-window and
  /// ping-pong (< 0: no KV budget): automatic caps the region there, fixed is
  /// refused above it.
  writescope::index_t kv_budget_left_bytes = -1;
};

/// The split and why.
struct vram_split {
  writescope::index_t hbm_tokens = 0;  ///< per layer (partition_spec::hbm_capacity_tokens)
  writescope::index_t hbm_bytes = 0;   ///< the region, all layers
  writescope::index_t kv_demand_tokens = 0;
  double expert_use_probability = 0.0;      ///< P
  double expert_seconds_per_gib = 0.0;      ///< step seconds 1 GiB of GPU experts saves
  double kv_seconds_per_gib = 0.0;          ///< step seconds 1 GiB of HBM KV saves
  std::string first;                        ///< "KV", "experts", or "" (no split made)
  std::string reason;                       ///< one line
};

inline std::string format_ms(double seconds) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g ms", seconds * 1e3);
  return b;
}

/// The split of `in` (see the file comment). Throws config_error when a fixed
/// region does not fit avail_bytes.
inline vram_split split_vram(const vram_split_inputs& in) {
  using writescope::index_t;
  constexpr double gib = double(index_t{1} << 30);
  vram_split s;
  s.kv_demand_tokens = in.kv_demand_tokens;
  const index_t batch_bytes = in.batch_tokens * in.kv_token_bytes;
  // densities
  if (in.num_experts > 0 && in.batch > 0) {
    const double miss = 1.0 - double(in.experts_per_token) / double(in.num_experts);
    s.expert_use_probability = 1.0 - std::pow(std::max(0.0, miss), double(in.batch));
  }
  if (in.expert_slab_bytes > 0 && in.cpu_expert_bytes_per_second > 0)
    s.expert_seconds_per_gib = s.expert_use_probability * double(in.expert_host_bytes) /
                               in.cpu_expert_bytes_per_second / double(in.expert_slab_bytes) * gib;
  const double A = in.cpu_seconds_per_token, Bp = in.gpu_seconds_per_token - in.launch_seconds_per_token;
  if (in.kv_token_bytes > 0 && A + Bp > 0) {
    const double per_token = double(in.num_layers) * std::max(0.0, A * (Bp - in.hbm_seconds_per_token) / (A + Bp));
    s.kv_seconds_per_gib = per_token / double(in.kv_token_bytes) * gib;
  }
  const std::string densities = "1 GiB of KV in HBM saves " + format_ms(s.kv_seconds_per_gib) +
                                "/step, 1 GiB of routed experts on the GPU " + format_ms(s.expert_seconds_per_gib) + "/step";
  if (in.mode == hbm_kv_mode::off) {
    s.reason = "no HBM KV region (--hbm-kv off)";
    return s;
  }
  if (batch_bytes <= 0) return s;
  const index_t avail = std::max<index_t>(0, in.avail_bytes);
  if (in.mode == hbm_kv_mode::fixed) {
    const index_t batches = in.cap_bytes / batch_bytes;
    if (batches < 1)
      throw writescope::config_error("--hbm-kv fixed: --hbm-kv-gib " + writescope::format_bytes(in.cap_bytes) +
                                     " holds no whole eviction batch of " + writescope::format_bytes(batch_bytes) +
                                     " (--d-window tokens over all layers)");
    s.hbm_tokens = batches * in.batch_tokens;
    s.hbm_bytes = batches * batch_bytes;
    if (in.kv_budget_left_bytes >= 0 && s.hbm_bytes > in.kv_budget_left_bytes)
      throw writescope::config_error("--hbm-kv fixed: the HBM KV region of --hbm-kv-gib needs " +
                                     writescope::format_bytes(s.hbm_bytes) + ", but --kv-vram-budget-mib leaves " +
                                     writescope::format_bytes(in.kv_budget_left_bytes) +
                                     " after the D-window and ping-pong (a smaller --hbm-kv-gib or a larger "
                                     "--kv-vram-budget-mib)");
    if (s.hbm_bytes > avail)
      throw writescope::config_error(
          "--hbm-kv fixed: the HBM KV region of --hbm-kv-gib needs " + writescope::format_bytes(s.hbm_bytes) + ", " +
          std::to_string(batches) + " eviction batches of " + std::to_string(batch_bytes) +
          " bytes, but the VRAM budget has " + writescope::format_bytes(avail) +
          " left after the non-expert weights, the D-window, ping-pong and the workspaces (a smaller --hbm-kv-gib or a "
          "larger --vram-budget)");
    s.first = "KV";
    s.reason = "fixed region (--hbm-kv fixed): " + densities;
    return s;
  }
  if (!in.sized) {
    s.reason = "no HBM KV region: the emulated device has no size without --vram-budget";
    return s;
  }
  const index_t demand_bytes = (in.kv_demand_tokens / in.batch_tokens) * batch_bytes;
  index_t cap = in.cap_bytes > 0 ? std::min(in.cap_bytes, demand_bytes) : demand_bytes;
  if (in.kv_budget_left_bytes >= 0) cap = std::min(cap, in.kv_budget_left_bytes);
  const index_t experts_bytes = in.experts_total * in.expert_slab_bytes;
  index_t kv_bytes = 0;
  if (s.kv_seconds_per_gib <= 0.0) {
    s.first = "experts";
    s.reason = "experts first: a KV token in HBM saves nothing (" + densities + ")";
  } else if (s.kv_seconds_per_gib >= s.expert_seconds_per_gib) {
    kv_bytes = std::min(cap, avail);
    if (avail - kv_bytes < experts_bytes)  // an expert stays on the host: its side's floor stays free
      kv_bytes = std::min(kv_bytes, std::max<index_t>(0, avail - in.host_expert_floor_bytes));
    s.first = "KV";
    s.reason = "KV first: " + densities;
  } else {
    kv_bytes = std::min(cap, std::max<index_t>(0, avail - experts_bytes));
    s.first = "experts";
    s.reason = "experts first: " + densities;
  }
  const index_t batches = kv_bytes / batch_bytes;
  s.hbm_tokens = batches * in.batch_tokens;
  s.hbm_bytes = batches * batch_bytes;
  if (batches == 0 && s.first == "KV") {  // say which bound left less than one whole batch
    const char* by = in.cap_bytes > 0 && in.cap_bytes < batch_bytes                   ? "--hbm-kv-gib"
                     : in.kv_budget_left_bytes >= 0 && in.kv_budget_left_bytes < batch_bytes ? "--kv-vram-budget-mib"
                     : demand_bytes < batch_bytes                                       ? "the planned KV"
                                                                                        : "the budget left";
    s.reason += "; no region: " + std::string(by) + " holds no whole eviction batch of " +
                writescope::format_bytes(batch_bytes);
  }
  return s;
}

}  // namespace ws_moe
