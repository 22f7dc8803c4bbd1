// SPDX-License-Identifier: Apache-2.0
// writescope/assist.hpp — the CPU assist over the pinned load region: the CPU
// engine also attends some pinned blocks in place on a dense step, so that
// both sides of hybrid_attention finish together when the CPU engine's speed
// drifts from what placement assumed (beyond the paper, whose engines each
// read only their own region, §4.1).
//
// Values only: hybrid_attention (attention_options::assist) applies them;
// roofline_params::placement_headroom leaves the share the assist takes back.
// Host code; no threads, no allocation.
#pragma once

#include <cstdint>

#include "config.hpp"

namespace writescope {

/// How the CPU engine helps with the pinned load region, per dense step
/// (hybrid_attention's "CPU assist"; docs/DECISIONS.md). Beyond the paper,
/// whose engines each read only their own region (§4.1): placement is not
/// touched and nothing moves; the assist only picks which engine reads some
/// pinned blocks, which are host memory in the same block format.
enum class assist_mode : std::uint8_t {
  off,       ///< the CPU engine attends the unpinned blocks only (the paper's split)
  fixed,     ///< it also attends a fixed fraction of each sequence's pinned blocks (tests, benchmarks)
  adaptive,  ///< that fraction follows the measured per-token times of both sides, each dense step
};

[[nodiscard]] constexpr const char* to_string(assist_mode m) noexcept {
  return m == assist_mode::off ? "off" : m == assist_mode::fixed ? "fixed" : "adaptive";
}

/// CPU assist over the pinned load region (dense steps; a sparse step never assists).
struct assist_options {
  assist_mode mode = assist_mode::off;
  /// fixed mode: the fraction of each sequence's pinned blocks (rounded to
  /// whole blocks, the newest first) the CPU engine attends, in [0, 1].
  double fixed_fraction = 0.0;
  /// adaptive mode: at most this fraction of each sequence's pinned blocks
  /// (rounded down to whole blocks), in [0, 1]. Below 1 the GPU keeps
  /// streaming, so its cost stays measured.
  double max_pinned_fraction = 0.5;
  /// adaptive mode: weight of the newest step in the smoothed per-token times
  /// (exponential average over layer steps), in (0, 1].
  double rate_smoothing = 0.25;
  /// adaptive mode: the per-token times (seconds per KV token, batch summed)
  /// to start from before a step has measured them, e.g. the roofline's
  /// calibrated A and B; 0 = unknown: no assist until both sides have been
  /// measured, which never happens for the CPU if no sequence has unpinned
  /// blocks (e.g. gpu_only placement) — give an initial CPU rate there.
  double initial_cpu_seconds_per_token = 0.0;
  double initial_gpu_seconds_per_token = 0.0;
  /// adaptive mode: GPU seconds per KV token of the HBM-resident region
  /// (partition_spec::hbm_capacity_tokens), e.g. the roofline's
  /// roofline_params::hbm_cost_per_token_seconds; >= 0 and finite. The GPU side
  /// attends those tokens in place before its streamed chunks, so the assist
  /// takes H × (the step's resident tokens) off the GPU side's measured time
  /// before dividing by the streamed tokens, and counts it as a fixed cost of
  /// the GPU side in the balance. 0: resident time is not separated (it then
  /// inflates the streamed per-token time, and the assist takes too much).
  double resident_seconds_per_token = 0.0;
};

/// adaptive assist's balance (pure; exposed for tests): the fraction f of the
/// `pinned_tokens` the CPU engine should take so that, at `cpu_seconds_per_token`
/// and `gpu_seconds_per_token`, cpu·(cpu_tokens + f·pinned) = gpu·(1 − f)·pinned
/// + gpu_fixed_seconds (the GPU side's work besides streaming, e.g. its
/// HBM-resident tokens); clamped to [0, max_fraction]; 0 without pinned tokens
/// or without both rates.
[[nodiscard]] constexpr double assist_balance_fraction(double cpu_seconds_per_token, double gpu_seconds_per_token,
                                                       index_t cpu_tokens, index_t pinned_tokens,
                                                       double max_fraction, double gpu_fixed_seconds = 0.0) noexcept {
  if (pinned_tokens <= 0 || !(cpu_seconds_per_token > 0.0) || !(gpu_seconds_per_token > 0.0)) return 0.0;
  const double x = (gpu_seconds_per_token * double(pinned_tokens) + gpu_fixed_seconds -
                    cpu_seconds_per_token * double(cpu_tokens)) /
                   ((cpu_seconds_per_token + gpu_seconds_per_token) * double(pinned_tokens));
  return x < 0.0 ? 0.0 : x > max_fraction ? max_fraction : x;
}

}  // namespace writescope
