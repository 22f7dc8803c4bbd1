// SPDX-License-Identifier: Apache-2.0
// writescope/policy.hpp — routing policies: where each eviction batch goes
// (paper §5).
//
// A routing policy is a small value type. The cache asks it once per eviction
// batch (D tokens of one sequence, all layers) whether the batch goes to the
// HBM-resident region (device memory, attended by the GPU in place; only when
// partition_spec::hbm_capacity_tokens is set), the unpinned compute region
// (attended by the CPU in place) or the pinned load region (streamed to the
// GPU); hybrid_attention reports the measured cost of every step back to it.
//
// Three destinations (docs/ARCHITECTURE.md, "The HBM tier"): every built-in
// policy sends a batch to the HBM-resident region while it has room for it
// (route_query::hbm_free_tokens >= batch_tokens) and otherwise applies its
// two-way rule to the host tiers, whose share (CPU tokens / host tokens) keeps
// the meaning it has without the HBM tier. A policy that answers gpu_resident
// when the region is full is asked once more with hbm_free_tokens = 0, and a
// second gpu_resident is taken as gpu_load: a full region never fails a step. A policy changes where work runs, never what it
// computes: every policy gives the same attention output up to fp32 rounding.
//
// Threading: the cache calls route() and observe() from the thread that calls
// flush()/begin_sequence()/step(); policies need no locks.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "assist.hpp"  // assist_options and assist_mode, reachable through this header too
#include "config.hpp"
#include "error.hpp"
#include "layout.hpp"  // placement

namespace writescope {

namespace detail {
/// "%g" formatting for messages: std::to_string prints a cost of 3e-9 s as "0.000000".
inline std::string format_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace detail

/// Target shares of the host-placed tokens per engine; they sum to 1. The
/// HBM-resident region has no target share: it is filled first (see the file
/// comment), so these split what lies in the two host regions.
struct share_plan {
  double cpu_compute = 0.0;
  double gpu_load = 1.0;
};

/// What the policy knows when it routes one eviction batch.
struct route_query {
  sequence_id seq = 0;
  index_t placed_tokens = 0;        ///< this sequence's tokens already placed (L, every region), before this batch
  index_t cpu_placed_tokens = 0;    ///< of which in the unpinned compute region
  index_t hbm_placed_tokens = 0;    ///< of which in the HBM-resident region
  index_t batch_tokens = 0;         ///< tokens in this batch (D)
  index_t total_placed_tokens = 0;  ///< placed tokens summed over all live sequences, before this batch
  index_t total_hbm_placed_tokens = 0;  ///< of which in the HBM-resident region
  /// Tokens the HBM-resident region can still take now (whole batches; the
  /// batches of this flush or prompt routed before this one already taken).
  /// 0 without the region, or when it is full.
  index_t hbm_free_tokens = 0;
  /// Tokens known to be placed right after this batch, before the next step:
  /// the later whole batches of the prompt being admitted and the prompts
  /// announced with inplace_kv_cache::announce_admission(). 0 during decode.
  index_t coming_tokens = 0;
  int live_sequences = 0;
};

/// Whether the HBM-resident region has room for the batch `q` describes.
[[nodiscard]] constexpr bool hbm_has_room(const route_query& q) noexcept {
  return q.batch_tokens > 0 && q.hbm_free_tokens >= q.batch_tokens;
}

struct route_decision {
  placement region = placement::gpu_load;
  share_plan target{};  ///< the share the policy is steering towards (reported, for tracking)
};

/// Measured cost of one attention step of one layer (both engines ran at once).
struct cost_sample {
  double cpu_seconds = 0.0;         ///< wall time of the CPU engine's share of the step
  index_t cpu_tokens = 0;           ///< KV tokens the CPU engine attended, summed over sequences
  double gpu_seconds = 0.0;         ///< time of the GPU side (stream + attend), excluding the merge
  index_t gpu_streamed_tokens = 0;  ///< KV tokens streamed through ping-pong (D-window tokens excluded)
  /// KV tokens of the same GPU side attended in place in the HBM-resident
  /// region (in gpu_seconds, at roofline_params::hbm_cost_per_token_seconds each).
  index_t gpu_resident_tokens = 0;
  int batch_size = 0;
  /// Host seconds the step spent before its CPU engine could start, building
  /// and enqueueing the GPU side (step_report::launch_seconds), and the KV
  /// tokens that launch streams. Filled for asynchronous engines
  /// (cuda_backend) on dense steps; 0 otherwise (a synchronous engine's launch
  /// is its GPU side's work, not an enqueue).
  double launch_seconds = 0.0;
  index_t launch_streamed_tokens = 0;
};

/// Opt-in tag: `using policy_concept = routing_policy_tag;` (nothing satisfies
/// the concept by accident).
struct routing_policy_tag {};

/// A routing policy: route(query) -> route_decision (const), observe(sample).
template <class P>
concept routing_policy =
    std::same_as<typename P::policy_concept, routing_policy_tag> && std::copy_constructible<P> &&
    requires(P& p, const P& cp, const route_query& q, const cost_sample& s) {
      { cp.route(q) } -> std::same_as<route_decision>;
      { p.observe(s) } -> std::same_as<void>;
    };

/// Marginal-share routing (paper §5.3): sends the batch to the host side that
/// leaves the sequence's cumulative CPU share of its host-placed tokens
/// (placed − HBM-resident) closest to `target`; ties go to the GPU (pinned).
/// The cumulative share thus stays within D/(2L) of a constant target. With
/// w = target·(host tokens after the batch), the CPU error |cpu + D − w| is
/// below the GPU's |cpu − w| exactly when cpu + D/2 < w; that is compared as
/// 2·cpu + D < 2·w, integers against one rounded product, so an exact tie
/// (r = 0.5 after an odd number of batches) goes to the GPU whatever the
/// compiler contracts (no fused multiply-add can shift it). Never answers
/// gpu_resident.
[[nodiscard]] constexpr placement route_toward(double target, const route_query& q) noexcept {
  if (q.batch_tokens <= 0) return placement::gpu_load;
  const index_t host_placed = q.placed_tokens - q.hbm_placed_tokens;
  const double want2 = 2.0 * (target * double(host_placed + q.batch_tokens));  // 2 x CPU tokens on target after the batch
  return double(2 * q.cpu_placed_tokens + q.batch_tokens) < want2 ? placement::cpu_compute : placement::gpu_load;
}

/// Everything streamed to the GPU (r = 0): the GPU-centric baseline (FlexGen /
/// SolidAttention style). The HBM-resident region first while it has room.
struct gpu_only {
  using policy_concept = routing_policy_tag;
  [[nodiscard]] route_decision route(const route_query& q) const noexcept {
    return {hbm_has_room(q) ? placement::gpu_resident : placement::gpu_load, {0.0, 1.0}};
  }
  void observe(const cost_sample&) noexcept {}
};

/// Everything on the host attended in place by the CPU (r = 1): the
/// CPU-centric baseline (FastDecode style). The HBM-resident region first
/// while it has room (none without partition_spec::hbm_capacity_tokens).
struct cpu_only {
  using policy_concept = routing_policy_tag;
  [[nodiscard]] route_decision route(const route_query& q) const noexcept {
    return {hbm_has_room(q) ? placement::gpu_resident : placement::cpu_compute, {1.0, 0.0}};
  }
  void observe(const cost_sample&) noexcept {}
};

/// A static CPU share r of each sequence's host-placed tokens (HGCA-style
/// static split), routed by marginal share; the HBM-resident region first
/// while it has room. Without that region placement depends only on the
/// sequence's own length: this is the deterministic mode (split points do not
/// depend on batchmates or load). With it, whether a batch finds room in HBM
/// depends on the other sequences too; a test that needs a fixed placement
/// gives each sequence its room (or none).
class fixed_ratio {
 public:
  using policy_concept = routing_policy_tag;
  /// Throws config_error unless 0 <= cpu_share <= 1.
  explicit fixed_ratio(double cpu_share) : r_(cpu_share) {
    if (!(cpu_share >= 0.0 && cpu_share <= 1.0))
      throw config_error("fixed_ratio: CPU share " + detail::format_double(cpu_share) + " is outside [0, 1]");
  }
  [[nodiscard]] route_decision route(const route_query& q) const noexcept {
    return {hbm_has_room(q) ? placement::gpu_resident : route_toward(r_, q), {r_, 1.0 - r_}};
  }
  void observe(const cost_sample&) noexcept {}
  [[nodiscard]] double cpu_share() const noexcept { return r_; }

 private:
  double r_;
};

/// Calibrated costs of the roofline model (paper eq. 1), all in seconds.
struct roofline_params {
  double cpu_cost_per_token_seconds = 0.0;  ///< A at admission: CPU time per KV token (batch summed)
  double gpu_cost_per_token_seconds = 0.0;  ///< B: GPU transfer + attention time per streamed token
  double cpu_fixed_seconds = 0.0;           ///< C_CPU: per-step fixed cost of the CPU side
  double gpu_fixed_seconds = 0.0;           ///< C_GPU: per-step fixed cost of the GPU side
  int cost_window_samples = 256;            ///< sliding-average length for online A (and B)
  bool track_gpu_cost = false;              ///< also re-measure B online (contention on PCIe, §7.8)
  /// Share subtracted from eq. 2's r(L) before routing, in [0, 1): places
  /// that much less on the CPU than the model's balance, for a CPU assist
  /// (hybrid_attention, assist_mode::adaptive) to take back per step from the
  /// pinned region — in either direction as the CPU engine's speed drifts.
  /// 0 (the paper's policy) without an assist.
  double placement_headroom = 0.0;
  /// A headroom from the measured spread of A, in standard deviations (>= 0;
  /// 0 = off): eq. 2 is evaluated with A + z·σ_A in place of A, σ_A the
  /// token-weighted standard deviation of the per-step A samples in the cost
  /// window, so that the CPU side is planned for a slower step than its mean
  /// by as much as its time has been seen to wander; placement_headroom is
  /// then subtracted as before. Until two samples exist σ_A is 0.
  double placement_headroom_z = 0.0;
  /// K: host seconds per streamed token spent building and enqueueing the GPU
  /// side before the CPU engine starts (cost_sample::launch_seconds). It lies
  /// on the CPU side's path but grows with the GPU's share, so eq. 2's
  /// balance uses B − K in place of B (roofline_policy::target_share). 0 = the
  /// paper's model (an engine whose enqueue is negligible, or done by another
  /// thread: cuda_backend::set_launch_thread).
  double launch_cost_per_token_seconds = 0.0;
  bool track_launch_cost = true;  ///< re-measure K online from the samples that include it
  /// H: GPU seconds per token attended in place in the HBM-resident region.
  /// HBM tokens are placed first and never move, so for the host split they
  /// are a fixed cost of the GPU side: eq. 2's Δ becomes Δ + H·L_hbm
  /// (roofline_policy). 0 = HBM attention taken as free next to the host tiers.
  /// With track_hbm_cost this is the prior, replaced by measurement.
  double hbm_cost_per_token_seconds = 0.0;
  /// Re-measure H online from the steps whose GPU side attended only
  /// HBM-resident (and D-window) tokens, no streamed ones: H = (GPU seconds −
  /// C_GPU) / resident tokens, a sliding ratio of sums like A. While the KV
  /// fits in the region every step is such a sample, so H is measured before
  /// the host split needs it.
  bool track_hbm_cost = true;

  /// Δ = C_GPU − C_CPU.
  [[nodiscard]] double fixed_overhead_gap_seconds() const noexcept { return gpu_fixed_seconds - cpu_fixed_seconds; }
};

/// The long-context limit of the roofline's target share (eq. 2 as L → ∞)
/// for per-token costs A (CPU), B (GPU) and K (the host's enqueue per
/// streamed token, on the CPU side's path): (B−K)/(A+B−K) when K < A and
/// K < B; else 1 (K >= A) or 0 (A > K >= B). See roofline_policy.
[[nodiscard]] constexpr double roofline_converged_share(double a, double b, double k) noexcept {
  if (k >= a || k >= b) return k >= a ? 1.0 : 0.0;
  return (b - k) / (a + b - k);
}

/// The roofline policy (paper §5.2–5.3, eq. 2):
///
///     r(L) = clamp( B'/(A+B') + Δ/((A+B')·L), 0, 1 ),   B' = B − K
///
/// With the HBM-resident region (docs/ARCHITECTURE.md, "The HBM tier"): a
/// batch goes there while it has room; otherwise r is eq. 2 over the host
/// tokens, L = L_host, with the HBM tokens' attention a fixed cost of the GPU
/// side: Δ' = Δ + H·L_hbm (H: roofline_params::hbm_cost_per_token_seconds
/// at first, re-measured online with track_hbm_cost).
///
/// with L the placed tokens of all live sequences after the batch and the
/// admissions in progress (route_query::coming_tokens: the length the next
/// step attends). K (roofline_params::launch_cost_per_token_seconds) is the
/// host's enqueue time per streamed token, which delays the CPU side: the
/// CPU side's path is C_CPU + A·r·L + K·(1−r)·L, the GPU's C_GPU + B·(1−r)·L,
/// and B' is what moving a token to the GPU saves on the step. K = 0 is the
/// paper's eq. 2; when K ≥ A or K ≥ B the two paths do not cross and r is 1
/// (K ≥ A: the CPU side's path shrinks as r grows) or 0 (A > K ≥ B). Each
/// batch is routed by marginal share toward r(L); A is re-estimated online
/// from measured CPU time per attended token (sliding ratio-of-sums over the
/// last `cost_window_samples` steps, fixed cost C_CPU removed), B likewise
/// when `track_gpu_cost`, K when `track_launch_cost` (samples that include a
/// launch). Not thread-safe (see file comment).
class roofline_policy {
 public:
  using policy_concept = routing_policy_tag;

  /// Throws config_error unless A > 0, B > 0 (finite) and cost_window_samples >= 1.
  explicit roofline_policy(const roofline_params& p)
      : p_(p),
        a_(p.cpu_cost_per_token_seconds),
        b_(p.gpu_cost_per_token_seconds),
        k_(p.launch_cost_per_token_seconds),
        h_(p.hbm_cost_per_token_seconds) {
    auto positive = [](double v) { return v > 0.0 && std::isfinite(v); };
    if (!positive(p.cpu_cost_per_token_seconds) || !positive(p.gpu_cost_per_token_seconds))
      throw config_error("roofline_policy: per-token costs must be positive and finite (A=" +
                         detail::format_double(p.cpu_cost_per_token_seconds) +
                         " s, B=" + detail::format_double(p.gpu_cost_per_token_seconds) + " s)");
    if (!std::isfinite(p.cpu_fixed_seconds) || !std::isfinite(p.gpu_fixed_seconds))
      throw config_error("roofline_policy: fixed costs must be finite");
    if (p.cost_window_samples < 1)
      throw config_error("roofline_policy: cost_window_samples " + std::to_string(p.cost_window_samples) +
                         " must be >= 1");
    if (!(p.placement_headroom_z >= 0.0 && std::isfinite(p.placement_headroom_z)))
      throw config_error("roofline_policy: placement_headroom_z " + detail::format_double(p.placement_headroom_z) +
                         " must be >= 0 and finite");
    if (!(p.placement_headroom >= 0.0 && p.placement_headroom < 1.0))
      throw config_error("roofline_policy: placement_headroom " + detail::format_double(p.placement_headroom) +
                         " is outside [0, 1)");
    if (!(p.launch_cost_per_token_seconds >= 0.0 && std::isfinite(p.launch_cost_per_token_seconds)))
      throw config_error("roofline_policy: launch_cost_per_token_seconds (K) " +
                         detail::format_double(p.launch_cost_per_token_seconds) + " must be >= 0 and finite");
    if (!(p.hbm_cost_per_token_seconds >= 0.0 && std::isfinite(p.hbm_cost_per_token_seconds)))
      throw config_error("roofline_policy: hbm_cost_per_token_seconds (H) " +
                         detail::format_double(p.hbm_cost_per_token_seconds) + " must be >= 0 and finite");
  }

  /// r(L) of eq. 2 for L host-placed tokens (L <= 0 gives the Δ-limited
  /// extreme), with `hbm_tokens` in the HBM-resident region adding H each to
  /// the GPU side's fixed cost (Δ' = Δ + H·hbm_tokens), less
  /// roofline_params::placement_headroom, clamped to [0, 1].
  [[nodiscard]] double target_share(index_t total_placed_tokens, index_t hbm_tokens = 0) const noexcept {
    const double a = planned_cpu_cost_per_token_seconds();
    double r = roofline_converged_share(a, b_, k_);  // 0 or 1 where the paths do not cross
    if (k_ < a && k_ < b_) {
      const double ab = a + b_ - k_;
      const double delta = p_.fixed_overhead_gap_seconds() + h_ * double(hbm_tokens);
      if (total_placed_tokens > 0)
        r += delta / (ab * double(total_placed_tokens));
      else if (delta != 0.0)
        r = delta > 0 ? 1.0 : 0.0;
    }
    return std::clamp(r - p_.placement_headroom, 0.0, 1.0);
  }

  /// The converged share p = B'/(A+B') (B' = B − K; K = 0: the paper's B/(A+B)).
  [[nodiscard]] double converged_share() const noexcept { return roofline_converged_share(a_, b_, k_); }

  [[nodiscard]] route_decision route(const route_query& q) const noexcept {
    const index_t host = q.total_placed_tokens - q.total_hbm_placed_tokens;
    const double r = target_share(host + q.batch_tokens + q.coming_tokens, q.total_hbm_placed_tokens);
    return {hbm_has_room(q) ? placement::gpu_resident : route_toward(r, q), {r, 1.0 - r}};
  }

  /// Feeds one measured step. Samples without CPU tokens leave A unchanged.
  void observe(const cost_sample& s) {
    if (s.cpu_tokens > 0 && std::isfinite(s.cpu_seconds)) {
      push(cpu_window_, cpu_sum_, std::max(0.0, s.cpu_seconds - p_.cpu_fixed_seconds), s.cpu_tokens, a_);
      if (p_.placement_headroom_z > 0.0) a_spread_ = spread(cpu_window_, a_);
    }
    if (p_.track_hbm_cost && s.gpu_resident_tokens > 0 && s.gpu_streamed_tokens == 0 && std::isfinite(s.gpu_seconds))
      push(hbm_window_, hbm_sum_, std::max(0.0, s.gpu_seconds - p_.gpu_fixed_seconds), s.gpu_resident_tokens, h_);
    if (p_.track_gpu_cost && s.gpu_streamed_tokens > 0 && std::isfinite(s.gpu_seconds))
      push(gpu_window_, gpu_sum_,
           std::max(0.0, s.gpu_seconds - p_.gpu_fixed_seconds - h_ * double(s.gpu_resident_tokens)),
           s.gpu_streamed_tokens, b_);
    if (p_.track_launch_cost && s.launch_streamed_tokens > 0 && std::isfinite(s.launch_seconds))
      push(launch_window_, launch_sum_, std::max(0.0, s.launch_seconds), s.launch_streamed_tokens, k_);
  }

  /// Current A (seconds per CPU-attended token).
  [[nodiscard]] double cpu_cost_per_token_seconds() const noexcept { return a_; }
  /// σ_A: the token-weighted standard deviation of the per-step A samples in
  /// the window (kept only with placement_headroom_z > 0, else 0).
  [[nodiscard]] double cpu_cost_spread_seconds() const noexcept { return a_spread_; }
  /// The A eq. 2 plans with: A + placement_headroom_z·σ_A.
  [[nodiscard]] double planned_cpu_cost_per_token_seconds() const noexcept {
    return a_ + p_.placement_headroom_z * a_spread_;
  }
  /// Current B (seconds per streamed token).
  [[nodiscard]] double gpu_cost_per_token_seconds() const noexcept { return b_; }
  /// Current K (host enqueue seconds per streamed token, on the CPU side's path).
  [[nodiscard]] double launch_cost_per_token_seconds() const noexcept { return k_; }
  /// Current H (GPU seconds per token attended in the HBM-resident region).
  [[nodiscard]] double hbm_cost_per_token_seconds() const noexcept { return h_; }
  [[nodiscard]] const roofline_params& params() const noexcept { return p_; }

 private:
  struct sample {
    double seconds;
    index_t tokens;
  };
  struct window_sum {
    double seconds = 0.0;
    index_t tokens = 0;
    std::size_t next = 0;
  };

  void push(std::vector<sample>& w, window_sum& sum, double seconds, index_t tokens, double& estimate) {
    const auto cap = static_cast<std::size_t>(p_.cost_window_samples);
    if (w.size() < cap) {
      w.push_back({seconds, tokens});
    } else {
      sum.seconds -= w[sum.next].seconds;
      sum.tokens -= w[sum.next].tokens;
      w[sum.next] = {seconds, tokens};
      sum.next = (sum.next + 1) % cap;
    }
    sum.seconds += seconds;
    sum.tokens += tokens;
    // Recompute the float sum exactly every full lap to stop drift from the running subtraction.
    if (sum.next == 0 && w.size() == cap) {
      sum.seconds = 0.0;
      for (const auto& x : w) sum.seconds += x.seconds;
    }
    if (sum.tokens > 0) {
      const double est = sum.seconds / double(sum.tokens);
      // A zero estimate (timer resolution) would pin the share to an extreme; keep a floor.
      estimate = std::max(est, 1e-15);
    }
  }

  // token-weighted standard deviation of the samples' ratios about `mean`
  static double spread(const std::vector<sample>& w, double mean) {
    double tokens = 0.0, sq = 0.0;
    for (const sample& x : w) {
      if (x.tokens <= 0) continue;
      const double d = x.seconds / double(x.tokens) - mean;
      tokens += double(x.tokens);
      sq += double(x.tokens) * d * d;
    }
    return w.size() >= 2 && tokens > 0.0 ? std::sqrt(sq / tokens) : 0.0;
  }

  roofline_params p_;
  double a_;
  double a_spread_ = 0.0;
  double b_;
  double k_;
  double h_;
  std::vector<sample> cpu_window_, gpu_window_, launch_window_, hbm_window_;
  window_sum cpu_sum_, gpu_sum_, launch_sum_, hbm_sum_;
};

static_assert(routing_policy<gpu_only>);
static_assert(routing_policy<cpu_only>);
static_assert(routing_policy<fixed_ratio>);
static_assert(routing_policy<roofline_policy>);

}  // namespace writescope
