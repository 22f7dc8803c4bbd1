// SPDX-License-Identifier: Apache-2.0
// ws_moe/runtime_policy.hpp — a routing policy chosen on the command line:
// one of the library's four policies held by value in a std::variant (no
// virtual dispatch), so the decoder is instantiated once per layout rather
// than once per (layout, policy). The wrapped policy decides every route.
#pragma once

#include <cstdio>
#include <string>
#include <variant>

#include <writescope/error.hpp>
#include <writescope/policy.hpp>

namespace ws_moe {

class runtime_policy {
 public:
  using policy_concept = writescope::routing_policy_tag;
  using variant_type =
      std::variant<writescope::gpu_only, writescope::cpu_only, writescope::fixed_ratio, writescope::roofline_policy>;

  runtime_policy() = default;
  explicit runtime_policy(variant_type p) : p_(std::move(p)) {}

  [[nodiscard]] writescope::route_decision route(const writescope::route_query& q) const {
    return std::visit([&](const auto& p) { return p.route(q); }, p_);
  }
  void observe(const writescope::cost_sample& s) {
    std::visit([&](auto& p) { p.observe(s); }, p_);
  }

  [[nodiscard]] const variant_type& get() const noexcept { return p_; }

  /// "roofline (A=…, B=…, K=…[, H=…])", "fixed r=0.25", "gpu_only (r=0)", "cpu_only (r=1)".
  [[nodiscard]] std::string describe() const {
    char buf[160];
    if (const auto* r = std::get_if<writescope::roofline_policy>(&p_)) {
      std::snprintf(buf, sizeof buf, "roofline (A=%.3g s/token, B=%.3g s/token, K=%.3g s/token, converged r=%.3f)",
                    r->cpu_cost_per_token_seconds(), r->gpu_cost_per_token_seconds(),
                    r->launch_cost_per_token_seconds(), r->converged_share());
      std::string d = buf;
      if (r->hbm_cost_per_token_seconds() > 0.0) {  // the HBM-resident region's H (prior, or measured)
        std::snprintf(buf, sizeof buf, ", H=%.3g s/token%s", r->hbm_cost_per_token_seconds(),
                      r->params().track_hbm_cost ? " (online)" : "");
        d.insert(d.size() - 1, buf);
      }
      if (r->params().placement_headroom_z > 0.0) {  // A planned above its mean by z·σ_A
        std::snprintf(buf, sizeof buf, ", planned A=%.3g = A + %.2g·σ_A", r->planned_cpu_cost_per_token_seconds(),
                      r->params().placement_headroom_z);
        d.insert(d.size() - 1, buf);
      }
      if (r->params().placement_headroom > 0.0) {
        std::snprintf(buf, sizeof buf, ", placed %.3f below it", r->params().placement_headroom);
        d.insert(d.size() - 1, buf);
      }
      return d;
    }
    if (const auto* f = std::get_if<writescope::fixed_ratio>(&p_)) {
      std::snprintf(buf, sizeof buf, "fixed r=%.3f", f->cpu_share());
      return buf;
    }
    if (std::holds_alternative<writescope::cpu_only>(p_)) return "cpu_only (r=1)";
    return "gpu_only (r=0)";
  }

 private:
  variant_type p_{};
};

static_assert(writescope::routing_policy<runtime_policy>);

/// Parses "roofline", "fixed:R", "gpu_only", "cpu_only" (also "r=0", "r=1").
/// `roofline` builds a roofline_policy from `params`. Throws config_error.
inline runtime_policy parse_policy(const std::string& s, const writescope::roofline_params& params) {
  if (s == "gpu_only" || s == "r=0") return runtime_policy(writescope::gpu_only{});
  if (s == "cpu_only" || s == "r=1") return runtime_policy(writescope::cpu_only{});
  if (s == "roofline") return runtime_policy(writescope::roofline_policy(params));
  if (s.rfind("fixed:", 0) == 0) {
    std::size_t used = 0;
    double r = 0.0;
    try {
      r = std::stod(s.substr(6), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != s.size() - 6)
      throw writescope::config_error("--policy " + s + ": expected fixed:R with R a number in [0, 1]");
    return runtime_policy(writescope::fixed_ratio(r));
  }
  throw writescope::config_error("--policy " + s + " is not one of roofline, fixed:R, gpu_only, cpu_only");
}

/// Parses --cpu-assist: "off", "adaptive", "fixed:F" with F in [0, 1].
/// Throws config_error.
inline writescope::assist_options parse_assist(const std::string& s) {
  writescope::assist_options o;
  if (s == "off") return o;
  if (s == "adaptive") {
    o.mode = writescope::assist_mode::adaptive;
    return o;
  }
  if (s.rfind("fixed:", 0) == 0) {
    std::size_t used = 0;
    double f = -1.0;
    try {
      f = std::stod(s.substr(6), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != s.size() - 6 || !(f >= 0.0 && f <= 1.0))
      throw writescope::config_error("--cpu-assist " + s + ": expected fixed:F with F a number in [0, 1]");
    o.mode = writescope::assist_mode::fixed;
    o.fixed_fraction = f;
    return o;
  }
  throw writescope::config_error("--cpu-assist " + s + " is not one of off, adaptive, fixed:F");
}

}  // namespace ws_moe
