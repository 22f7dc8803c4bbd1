// SPDX-License-Identifier: Apache-2.0
// ws_moe/roofline_init.hpp — where ws_decode's roofline policy gets its costs
// at init (paper eq. 1-2): A (CPU seconds per KV token), B (GPU seconds per
// streamed token), C_CPU and C_GPU (fixed seconds per step of one layer).
//
//   defaults      A = KV bytes per token / --cpu-bw-gbps, B = … / --h2d-bw-gbps,
//                 C_CPU = --cpu-fixed-us, C_GPU = --gpu-fixed-us
//   calibration   --calibration FILE (bench/calibrate --out; the format of
//                 writescope/calibration.hpp): the entry of the preset whose
//                 attention geometry the model has, at the calibrated batch
//                 nearest to the run's batch (calibration::find: log scale,
//                 ties to the larger)
//
// Matching rule. An entry describes one attention geometry, not a model name:
// the model matches a preset when its cache layout is the preset's exactly —
// GQA: query heads, KV heads and head_dim; MLA: query heads, kv_lora_rank and
// the RoPE dim (the absorbed kernel's work per token depends on all of them).
// Architecture name and layer count do not enter: the costs are per KV token of
// ONE layer (bench/calibrate fits the policy's own per-layer cost samples) and
// the policy observes per-layer steps, so `--layers 8` of a 48-layer model uses
// the entry unchanged. A model of another geometry has no entry; then
// --calibration-preset NAME uses that preset's entry anyway, with A and B
// scaled by (model KV bytes per token) / (preset KV bytes per token) — the
// bandwidth-bound approximation (for MLA on the CPU, compute-bound, it is only
// a starting point; the online loop corrects A). C_CPU and C_GPU are kept.
//
// Errors (ws_decode prints each as one line and exits 1): a missing,
// unreadable or malformed file (checkpoint_error from load_calibration); a
// model whose geometry matches no preset without --calibration-preset, an
// unknown --calibration-preset, or a file without an entry for the preset
// (config_error).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>
#include <writescope/calibration.hpp>
#include <writescope/policy.hpp>
#include <writescope/presets.hpp>

#include "model_config.hpp"

namespace ws_moe {

/// The HBM read rate (GB/s) behind H, the GPU's time for a KV token attended
/// in place in the HBM-resident region (token bytes / this), where nothing
/// measures it: an H100 PCIe's HBM2e; an H100 SXM reads about 3350, an H200
/// about 4800. H is two orders of magnitude below the host tiers' A and B, so
/// the VRAM split and the roofline barely move with it.
inline constexpr double nominal_hbm_read_gbps = 2000.0;

/// The attention geometry that decides the cost of a KV token.
struct attention_geometry {
  bool mla = false;
  int q_heads = 0;
  int kv_heads = 0;      ///< GQA only
  int head_dim = 0;      ///< GQA only
  int kv_lora_rank = 0;  ///< MLA only
  int rope_dim = 0;      ///< MLA only
  long long token_bytes = 0;  ///< bf16 KV bytes per token and layer

  [[nodiscard]] bool same_shape(const attention_geometry& o) const noexcept {
    if (mla != o.mla || q_heads != o.q_heads) return false;
    return mla ? (kv_lora_rank == o.kv_lora_rank && rope_dim == o.rope_dim)
               : (kv_heads == o.kv_heads && head_dim == o.head_dim);
  }
  [[nodiscard]] std::string describe() const {
    if (mla)
      return "MLA " + std::to_string(q_heads) + " heads, kv_lora_rank " + std::to_string(kv_lora_rank) + ", rope " +
             std::to_string(rope_dim);
    return "GQA " + std::to_string(q_heads) + " q / " + std::to_string(kv_heads) + " kv heads, head_dim " +
           std::to_string(head_dim);
  }
};

inline attention_geometry geometry_of(const model_config& c) {
  attention_geometry g;
  g.mla = c.kind == arch::deepseek_v2;
  g.q_heads = c.num_heads;
  if (g.mla) {
    g.kv_lora_rank = c.kv_lora_rank;
    g.rope_dim = c.qk_rope_head_dim;
    g.token_bytes = (long long)(c.kv_lora_rank + c.qk_rope_head_dim) * 2;
  } else {
    g.kv_heads = c.num_kv_heads;
    g.head_dim = c.head_dim;
    g.token_bytes = 2LL * c.num_kv_heads * c.head_dim * 2;
  }
  return g;
}

/// A preset bench/calibrate measures, with its geometry.
struct calibrated_preset {
  std::string name;
  attention_geometry geometry;
};

/// The three presets of writescope/presets.hpp (bench/calibrate's --presets).
inline std::vector<calibrated_preset> calibrated_presets() {
  namespace P = writescope::presets;
  auto gqa = [](auto p) {
    using T = decltype(p);
    attention_geometry g;
    g.q_heads = T::num_q_heads;
    g.kv_heads = T::num_kv_heads;
    g.head_dim = T::layout_type::head_dim;
    g.token_bytes = (long long)T::layout().token_bytes();
    return calibrated_preset{std::string(T::name), g};
  };
  attention_geometry m;
  m.mla = true;
  m.q_heads = P::deepseek_v2_lite::num_q_heads;
  m.kv_lora_rank = P::deepseek_v2_lite::layout_type::kv_lora_rank;
  m.rope_dim = P::deepseek_v2_lite::layout_type::rope_dim;
  m.token_bytes = (long long)P::deepseek_v2_lite::layout().token_bytes();
  return {gqa(P::qwen3_30b_a3b{}), gqa(P::mixtral_8x7b{}), {std::string(P::deepseek_v2_lite::name), m}};
}

/// Where the roofline costs came from, and what they are at init.
struct roofline_origin {
  bool from_file = false;
  writescope::roofline_params params;
  // defaults
  double cpu_bw_gbps = 0.0, h2d_bw_gbps = 0.0;
  // calibration file
  std::string file, preset, matched_by;  ///< matched_by: "attention geometry" or "--calibration-preset"
  int entry_batch = 0, run_batch = 0;
  int entry_cpu_threads = 0, run_cpu_threads = 0;
  int entry_block_tokens = 0, run_block_tokens = 0;  ///< the entry's KV plan (0: not recorded) and the run's
  int entry_split_blocks = 0, run_split_blocks = 0;
  double kv_bytes_scale = 1.0;  ///< A and B multiplied by this (1 unless the geometry differs; K is per block, kept)
  std::string device, cpu, date_utc;

  [[nodiscard]] double converged_share() const noexcept {
    return writescope::roofline_converged_share(params.cpu_cost_per_token_seconds, params.gpu_cost_per_token_seconds,
                                                params.launch_cost_per_token_seconds);
  }

  /// One line for the summary.
  [[nodiscard]] std::string describe() const {
    char costs[240];
    std::snprintf(costs, sizeof costs,
                  "A %.4g ns/token, B %.4g ns/token, K %.4g ns/token, C_CPU %.4g us, C_GPU %.4g us, "
                  "p = (B-K)/(A+B-K) %.3f",
                  params.cpu_cost_per_token_seconds * 1e9, params.gpu_cost_per_token_seconds * 1e9,
                  params.launch_cost_per_token_seconds * 1e9, params.cpu_fixed_seconds * 1e6,
                  params.gpu_fixed_seconds * 1e6, converged_share());
    if (!from_file) {
      char b[120];
      std::snprintf(b, sizeof b, "defaults (--cpu-bw-gbps %g, --h2d-bw-gbps %g): ", cpu_bw_gbps, h2d_bw_gbps);
      return b + std::string(costs);
    }
    std::string s = "calibration " + file + ": entry " + preset + " batch " + std::to_string(entry_batch);
    if (entry_batch != run_batch) s += " (nearest to batch " + std::to_string(run_batch) + ")";
    s += ", matched by " + matched_by;
    if (kv_bytes_scale != 1.0) {
      char b[96];
      std::snprintf(b, sizeof b, ", A and B scaled by KV bytes x%.4g", kv_bytes_scale);
      s += b;
    }
    if (entry_cpu_threads > 0) {
      s += ", " + std::to_string(entry_cpu_threads) + " CPU engine threads";
      if (entry_cpu_threads != run_cpu_threads) s += " (this run: " + std::to_string(run_cpu_threads) + ")";
    }
    if (entry_block_tokens > 0) {  // B and K depend on the KV plan: say when the run's differs
      s += ", block " + std::to_string(entry_block_tokens) + " tokens";
      if (entry_block_tokens != run_block_tokens) s += " (this run: " + std::to_string(run_block_tokens) + ")";
    }
    if (entry_split_blocks > 0) {
      s += ", " + std::to_string(entry_split_blocks) + "-block GPU splits";
      if (entry_split_blocks != run_split_blocks) s += " (this run: " + std::to_string(run_split_blocks) + ")";
    }
    if (!device.empty()) s += ", measured on " + device;
    if (!date_utc.empty()) s += " " + date_utc;
    return s + ": " + costs;
  }

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j{{"source", from_file ? "calibration" : "defaults"},
                     {"cpu_cost_per_token_seconds", params.cpu_cost_per_token_seconds},
                     {"gpu_cost_per_token_seconds", params.gpu_cost_per_token_seconds},
                     {"cpu_fixed_seconds", params.cpu_fixed_seconds},
                     {"gpu_fixed_seconds", params.gpu_fixed_seconds},
                     {"launch_cost_per_token_seconds", params.launch_cost_per_token_seconds},
                     {"converged_share", converged_share()},
                     {"track_gpu_cost", params.track_gpu_cost}};
    if (from_file) {
      j["file"] = file;
      j["preset"] = preset;
      j["matched_by"] = matched_by;
      j["entry_batch"] = entry_batch;
      j["run_batch"] = run_batch;
      j["entry_cpu_threads"] = entry_cpu_threads;
      j["run_cpu_threads"] = run_cpu_threads;
      j["entry_block_tokens"] = entry_block_tokens;
      j["run_block_tokens"] = run_block_tokens;
      j["entry_split_blocks"] = entry_split_blocks;
      j["run_split_blocks"] = run_split_blocks;
      j["kv_bytes_scale"] = kv_bytes_scale;
      j["device"] = device;
      j["cpu"] = cpu;
      j["date_utc"] = date_utc;
    } else {
      j["cpu_bw_gbps"] = cpu_bw_gbps;
      j["h2d_bw_gbps"] = h2d_bw_gbps;
    }
    return j;
  }
};

/// The bandwidth priors: A = KV bytes per token / cpu_bw, B = … / h2d_bw.
inline roofline_origin roofline_from_defaults(const model_config& c, double cpu_bw_gbps, double h2d_bw_gbps,
                                              double cpu_fixed_us, double gpu_fixed_us, bool track_gpu_cost) {
  roofline_origin o;
  const double tb = double(geometry_of(c).token_bytes);
  o.cpu_bw_gbps = cpu_bw_gbps;
  o.h2d_bw_gbps = h2d_bw_gbps;
  o.params.cpu_cost_per_token_seconds = tb / (cpu_bw_gbps * 1e9);
  o.params.gpu_cost_per_token_seconds = tb / (h2d_bw_gbps * 1e9);
  o.params.cpu_fixed_seconds = cpu_fixed_us * 1e-6;
  o.params.gpu_fixed_seconds = gpu_fixed_us * 1e-6;
  o.params.track_gpu_cost = track_gpu_cost;
  return o;
}

/// The costs of calibration `cal` (read from `path`) for model `c` at `batch`
/// sequences (see the file comment for the rule). `forced_preset` (may be
/// empty): --calibration-preset. `engine_threads`, `block_tokens`,
/// `split_blocks`: this run's CPU engine threads and KV plan (reported next to
/// the entry's). Throws config_error.
inline roofline_origin roofline_from_calibration(const writescope::calibration& cal, const std::string& path,
                                                 const model_config& c, int batch, int engine_threads,
                                                 const std::string& forced_preset, bool track_gpu_cost,
                                                 int block_tokens = 0, int split_blocks = 0) {
  const attention_geometry g = geometry_of(c);
  const std::vector<calibrated_preset> presets = calibrated_presets();
  const calibrated_preset* match = nullptr;
  std::string how;
  if (!forced_preset.empty()) {
    const std::string key = writescope::detail::preset_key(forced_preset);
    for (const auto& p : presets)
      if (writescope::detail::preset_key(p.name) == key) match = &p;
    if (!match) {
      std::string names;
      for (const auto& p : presets) names += (names.empty() ? "" : ", ") + p.name;
      throw writescope::config_error("--calibration-preset " + forced_preset + " is not one of " + names +
                                     " (or their short names qwen3, mixtral, dsv2)");
    }
    how = "--calibration-preset";
  } else {
    for (const auto& p : presets)
      if (p.geometry.same_shape(g)) match = &p;
    if (!match) {
      std::string have;
      for (const auto& p : presets) have += (have.empty() ? "" : "; ") + p.name + ": " + p.geometry.describe();
      throw writescope::config_error("--calibration " + path + ": the model's attention (" + g.describe() +
                                     ") matches none of the calibrated presets (" + have +
                                     "); give --calibration-preset NAME to use one of them with A and B scaled by KV "
                                     "bytes per token, or the bandwidth priors (--cpu-bw-gbps, --h2d-bw-gbps)");
    }
    how = "attention geometry";
  }
  const writescope::calibration_entry* e = nullptr;
  try {
    e = &cal.find(match->name, batch);
  } catch (const writescope::config_error& x) {
    throw writescope::config_error("--calibration " + path + ": " + x.what());
  }
  roofline_origin o;
  o.from_file = true;
  o.file = path;
  o.preset = e->preset;
  o.matched_by = how;
  o.entry_batch = e->batch;
  o.run_batch = batch;
  o.entry_cpu_threads = e->cpu_threads;
  o.run_cpu_threads = engine_threads;
  o.entry_block_tokens = e->block_tokens;
  o.run_block_tokens = block_tokens;
  o.entry_split_blocks = e->gpu_split_blocks;
  o.run_split_blocks = split_blocks;
  o.device = cal.device;
  o.cpu = cal.cpu;
  o.date_utc = cal.date_utc;
  writescope::roofline_params base;
  base.track_gpu_cost = track_gpu_cost;
  o.params = e->params(base);
  if (!match->geometry.same_shape(g)) {
    o.kv_bytes_scale = double(g.token_bytes) / double(match->geometry.token_bytes);
    o.params.cpu_cost_per_token_seconds *= o.kv_bytes_scale;
    o.params.gpu_cost_per_token_seconds *= o.kv_bytes_scale;
  }
  return o;
}

}  // namespace ws_moe
