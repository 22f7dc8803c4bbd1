// ws_moe/report.hpp — what ws_decode shows: a progress bar on stderr, the
// final summary (prefill tok/s, TPOT P50/P99, decode tok/s, deployed CPU share,
// memory per region as in the paper's Table 2, generated tokens) and the same
// numbers as JSON for scripts. The text summary's length does not grow with
// the batch: aggregates over every sequence, and per-sequence lines only for
// the first summary_options::sequence_lines sequences (default none).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "decoder.hpp"
#include "model_config.hpp"
#include "prefill_work.hpp"
#include "roofline_init.hpp"

namespace ws_moe {

/// A one-line progress bar on stderr, redrawn at most every 50 ms; silent when
/// disabled (default: only when stderr is a terminal).
class progress_bar {
 public:
  explicit progress_bar(bool enabled) : enabled_(enabled) {}

  static bool stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }

  void update(const char* label, int done, int total, const std::string& extra = {}) {
    if (!enabled_ || total <= 0) return;
    const auto now = std::chrono::steady_clock::now();
    if (done < total && std::string(label) == last_label_ && now - last_ < std::chrono::milliseconds(50)) return;
    last_ = now;
    last_label_ = label;
    constexpr int width = 30;
    const int fill = int(double(done) / total * width);
    std::string bar(std::size_t(fill), '=');
    if (fill < width) bar += '>' + std::string(std::size_t(width - fill - 1), ' ');
    std::fprintf(stderr, "\r%-8s [%s] %d/%d %s\033[K", label, bar.c_str(), done, total, extra.c_str());
    if (done >= total) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  std::chrono::steady_clock::time_point last_{};
  std::string last_label_;
};

/// The q-th percentile (0..100) of `v`, linear interpolation; 0 for empty.
inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = q / 100.0 * double(v.size() - 1);
  const auto lo = std::size_t(std::floor(pos));
  const auto hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

/// TPOT figures. All decode steps (tpot_p50/p99, decode tok/s), and the
/// steady state: every decode step but the first (which follows prefill and
/// can pay one-time costs; it is reported on its own). With one step only, the
/// steady state is empty (zeros).
struct summary_numbers {
  double prefill_tok_s = 0, tpot_p50_ms = 0, tpot_p99_ms = 0, decode_tok_s = 0, cpu_share = 0;
  double tpot_first_step_ms = 0, tpot_steady_p50_ms = 0, tpot_steady_p99_ms = 0, decode_steady_tok_s = 0;
  index_t decode_tokens = 0;
  int steady_steps = 0;

  [[nodiscard]] double p99_over_p50() const noexcept { return tpot_p50_ms > 0 ? tpot_p99_ms / tpot_p50_ms : 0.0; }
  [[nodiscard]] double steady_p99_over_p50() const noexcept {
    return tpot_steady_p50_ms > 0 ? tpot_steady_p99_ms / tpot_steady_p50_ms : 0.0;
  }
};

inline summary_numbers summarize(const generation_result& r) {
  summary_numbers s;
  s.prefill_tok_s = r.prefill_seconds > 0 ? double(r.prefill_tokens) / r.prefill_seconds : 0.0;
  s.tpot_p50_ms = percentile(r.step_seconds, 50) * 1e3;
  s.tpot_p99_ms = percentile(r.step_seconds, 99) * 1e3;
  double t = 0;
  for (double x : r.step_seconds) t += x;
  // tokens of step k: the sequences that generated in it (fewer once EOS stopped some)
  const auto step_tokens = [&r](std::size_t k) {
    return k < r.step_sequences.size() ? index_t(r.step_sequences[k]) : index_t(r.tokens.size());
  };
  for (std::size_t k = 0; k < r.step_seconds.size(); ++k) s.decode_tokens += step_tokens(k);
  s.decode_tok_s = t > 0 ? double(s.decode_tokens) / t : 0.0;
  if (!r.step_seconds.empty()) {
    s.tpot_first_step_ms = r.step_seconds.front() * 1e3;
    const std::vector<double> steady(r.step_seconds.begin() + 1, r.step_seconds.end());
    s.steady_steps = int(steady.size());
    s.tpot_steady_p50_ms = percentile(steady, 50) * 1e3;
    s.tpot_steady_p99_ms = percentile(steady, 99) * 1e3;
    double ts = 0;
    index_t steady_tokens = 0;
    for (std::size_t k = 1; k < r.step_seconds.size(); ++k) {
      ts += r.step_seconds[k];
      steady_tokens += step_tokens(k);
    }
    s.decode_steady_tok_s = ts > 0 ? double(steady_tokens) / ts : 0.0;
  }
  index_t placed = 0, cpu = 0;
  for (const auto& q : r.sequences) {
    placed += q.placed_tokens;
    cpu += q.cpu_placed_tokens;
  }
  s.cpu_share = placed > 0 ? double(cpu) / double(placed) : 0.0;
  return s;
}

/// The prompts' lengths, in sequence order (the per-sequence summaries).
inline std::vector<index_t> prompt_lengths(const generation_result& r) {
  std::vector<index_t> v;
  v.reserve(r.sequences.size());
  for (const sequence_summary& q : r.sequences) v.push_back(q.prompt_tokens);
  return v;
}

inline std::string mib(index_t bytes) {
  char b[64];
  std::snprintf(b, sizeof b, "%10.3f MiB", double(bytes) / double(1 << 20));
  return b;
}

/// "1.25 GiB", "3.4 MiB", "12 KiB".
inline std::string human_bytes(index_t bytes) {
  char b[48];
  const double v = double(bytes);
  if (v >= double(1 << 30)) std::snprintf(b, sizeof b, "%.2f GiB", v / double(1 << 30));
  else if (v >= double(1 << 20)) std::snprintf(b, sizeof b, "%.1f MiB", v / double(1 << 20));
  else std::snprintf(b, sizeof b, "%.0f KiB", v / 1024.0);
  return b;
}

/// "0-3,7" for a sorted list of expert ids; "none" when empty.
inline std::string id_ranges(const std::vector<int>& ids) {
  if (ids.empty()) return "none";
  std::string out;
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ids[i]);
    if (j > i) {
      out += '-';
      out += std::to_string(ids[j]);
    }
    i = j + 1;
  }
  return out;
}

/// The decode step's CPU experts against their bound (CUDA path with host
/// experts; docs/DECODER-INTERNALS.md, "CPU experts against their bound"):
/// means per step over the steady steps (every decode step but the first; the
/// one step when there is one) of the per-step series of generation_result:
///   cpu_bound  = host expert bytes read / the DRAM read ceiling measured at setup
///   outside    = GPU span - overlap windows - routing round trips (the GPU
///                timeline outside the CPU experts' windows: the work that must
///                precede or follow them, and the host's issue gaps in it)
///   step_bound = cpu_bound + outside
/// Ratios: CPU expert seconds / cpu_bound, step seconds / step_bound (0 when
/// the ceiling was not measured).
struct expert_bound {
  bool present = false;  ///< the per-step series exist (the run had host experts)
  std::size_t first = 0, last = 0;  ///< the steps averaged, [first, last) (0-based)
  double host_read_bytes = 0.0, dram_read_gbps = 0.0, cpu_bound_seconds = 0.0, cpu_expert_seconds = 0.0;
  double gpu_span_seconds = 0.0, overlap_window_seconds = 0.0, routing_trip_seconds = 0.0, gpu_outside_seconds = 0.0;
  double step_seconds = 0.0, step_bound_seconds = 0.0, cpu_ratio = 0.0, step_ratio = 0.0;
  bool phases_present = false;  ///< the per-step window phases exist
  window_phases phases;         ///< their means over the same steps (layers: the mean, rounded)
  [[nodiscard]] int steps() const noexcept { return int(last - first); }
};

inline expert_bound expert_bound_of(const generation_result& r) {
  expert_bound b;
  const std::size_t n = r.step_host_expert_bytes.size();
  if (n == 0 || r.step_cpu_expert_seconds.size() != n || r.step_gpu_span_seconds.size() != n ||
      r.step_overlap_window_seconds.size() != n || r.step_routing_trip_seconds.size() != n || r.step_seconds.size() != n)
    return b;
  b.present = true;
  b.first = n > 1 ? 1 : 0;
  b.last = n;
  const double k = double(b.last - b.first);
  for (std::size_t i = b.first; i < b.last; ++i) {
    b.host_read_bytes += double(r.step_host_expert_bytes[i]) / k;
    b.cpu_expert_seconds += r.step_cpu_expert_seconds[i] / k;
    b.gpu_span_seconds += r.step_gpu_span_seconds[i] / k;
    b.overlap_window_seconds += r.step_overlap_window_seconds[i] / k;
    b.routing_trip_seconds += r.step_routing_trip_seconds[i] / k;
    b.step_seconds += r.step_seconds[i] / k;
  }
  b.gpu_outside_seconds = std::max(0.0, b.gpu_span_seconds - b.overlap_window_seconds - b.routing_trip_seconds);
  if (r.step_window_phases.size() == n) {
    b.phases_present = true;
    window_phases& m = b.phases;
    double layers = 0.0;
    for (std::size_t i = b.first; i < b.last; ++i) {
      const window_phases& w = r.step_window_phases[i];
      layers += double(w.layers) / k;
      m.stage_issue += w.stage_issue / k;
      m.device_issue += w.device_issue / k;
      m.input_wait += w.input_wait / k;
      m.cpu_setup += w.cpu_setup / k;
      m.cpu_wake += w.cpu_wake / k;
      m.cpu_experts += w.cpu_experts / k;
      m.host_window += w.host_window / k;
      m.output_issue += w.output_issue / k;
      m.gpu_window += w.gpu_window / k;
      m.gpu_device_experts += w.gpu_device_experts / k;
      m.gpu_output += w.gpu_output / k;
    }
    m.layers = int(std::lround(layers));
  }
  b.dram_read_gbps = r.device.dram_read_gbps;
  if (b.dram_read_gbps > 0) {
    b.cpu_bound_seconds = b.host_read_bytes / (b.dram_read_gbps * 1e9);
    b.step_bound_seconds = b.cpu_bound_seconds + b.gpu_outside_seconds;
    b.cpu_ratio = b.cpu_bound_seconds > 0 ? b.cpu_expert_seconds / b.cpu_bound_seconds : 0.0;
    b.step_ratio = b.step_bound_seconds > 0 ? b.step_seconds / b.step_bound_seconds : 0.0;
  }
  return b;
}

/// The CUDA path's lines of the summary: device memory by use, expert placement.
inline void print_device(std::FILE* f, const generation_result& r) {
  const device_report& d = r.device;
  std::fprintf(f, "device     %s; precision: %s\n", d.device.c_str(), d.precision.c_str());
  std::fprintf(f, "device mem total %s, budget %s, in use after setup %s: weights %s, routed experts %s, "
                  "KV regions (D-window + ping-pong) %s, HBM KV region %s, workspaces %s\n",
               human_bytes(d.total_bytes).c_str(), d.budget_bytes > 0 ? human_bytes(d.budget_bytes).c_str() : "none",
               human_bytes(d.used_bytes).c_str(),
               human_bytes(d.weights_bytes).c_str(), human_bytes(d.experts_gpu_bytes).c_str(), human_bytes(d.kv_bytes).c_str(),
               human_bytes(d.hbm_region_bytes).c_str(), human_bytes(d.workspace_bytes).c_str());
  if (d.moe_workspace_bytes > 0)
    std::fprintf(f, "           of the workspaces, %s scale with the tokens of one MoE pass (%lld: the largest prefill "
                    "wave, or --prefill-moe-chunk-tokens)\n",
                 human_bytes(d.moe_workspace_bytes).c_str(), static_cast<long long>(d.moe_pass_tokens));
  std::fprintf(f, "VRAM split --hbm-kv %s: HBM KV region %s, %lld tokens per layer of %lld planned; %d routed experts on "
                  "the GPU; left to divide %s: %s\n",
               d.hbm_kv.c_str(), human_bytes(d.hbm_region_bytes).c_str(), static_cast<long long>(d.hbm_capacity_tokens),
               static_cast<long long>(d.kv_demand_tokens), d.experts_gpu,
               d.budget_bytes > 0 ? human_bytes(d.split_avail_bytes).c_str() : "no bound",
               d.split_reason.c_str());
  std::fprintf(f, "experts    %d routed experts: %d on the GPU, %d in host memory (%s), CPU expert time %.3f s for %lld rows\n",
               d.experts_total, d.experts_gpu, d.experts_host, human_bytes(d.experts_host_bytes).c_str(), d.cpu_expert_seconds,
               static_cast<long long>(d.cpu_expert_rows));
  if (const expert_bound b = expert_bound_of(r); b.present) {
    if (b.dram_read_gbps > 0)
      std::fprintf(f, "           CPU experts vs bound: %.3f GB/step read, DRAM ceiling %.1f GB/s -> bound %.3f ms/step; "
                      "CPU experts %.3f ms (%.2fx); step %.3f ms against bound %.3f ms (%.2fx)\n",
                   b.host_read_bytes / 1e9, b.dram_read_gbps, b.cpu_bound_seconds * 1e3, b.cpu_expert_seconds * 1e3,
                   b.cpu_ratio, b.step_seconds * 1e3, b.step_bound_seconds * 1e3, b.step_ratio);
    else
      std::fprintf(f, "           CPU experts vs bound: %.3f GB/step read, DRAM ceiling %s -> no bound; CPU experts "
                      "%.3f ms; step %.3f ms\n",
                   b.host_read_bytes / 1e9, d.dram_ceiling.c_str(), b.cpu_expert_seconds * 1e3, b.step_seconds * 1e3);
    std::fprintf(f, "           (means over decode steps %zu-%zu; GPU work outside the CPU experts %.3f ms/step = span "
                    "%.3f - overlap windows %.3f - routing round trips %.3f; ceiling: %d threads, %s buffer, best of "
                    "%d passes, %.2f s at setup)\n",
                 b.first + 1, b.last, b.gpu_outside_seconds * 1e3, b.gpu_span_seconds * 1e3,
                 b.overlap_window_seconds * 1e3, b.routing_trip_seconds * 1e3, d.dram_threads,
                 human_bytes(d.dram_buffer_bytes).c_str(), d.dram_passes, d.dram_seconds);
    if (b.phases_present) {
      const window_phases& w = b.phases;
      std::fprintf(f, "           overlap windows, ms/step over %d layers (device experts enqueued %s the CPU experts): "
                      "GPU window %.3f (device experts done at %.3f), host window %.3f = device issue %.3f%s + input "
                      "wait %.3f + CPU experts %.3f (setup %.3f, team wake %.3f); outside: input D2H issue %.3f, output "
                      "issue %.3f, GPU output H2D + combine %.3f\n",
                   w.layers, d.device_experts_issue.c_str(), w.gpu_window * 1e3, w.gpu_device_experts * 1e3,
                   w.host_window * 1e3, w.device_issue * 1e3, d.device_experts_issue == "during" ? " (inside)" : "",
                   w.input_wait * 1e3, w.cpu_experts * 1e3, w.cpu_setup * 1e3, w.cpu_wake * 1e3,
                   w.stage_issue * 1e3, w.output_issue * 1e3, w.gpu_output * 1e3);
    }
  }
  std::string groups;
  if (d.batched_moe_passes > 0 && d.prefill_expert_gemm == "batched")
    groups = ", " + d.prefill_expert_groups + " groups: " + std::to_string(d.batched_groups);
  std::fprintf(f, "           device experts: %s; MoE layer passes %lld grouped, %lld per expert, %lld batched (prefill%s%s%s)"
                  "; %lld decode passes routed on the device (%lld with host experts)\n",
               d.expert_kernels.c_str(), static_cast<long long>(d.grouped_moe_passes),
               static_cast<long long>(d.per_expert_moe_passes), static_cast<long long>(d.batched_moe_passes),
               d.batched_moe_passes > 0 ? ", GEMMs issued " : "", d.batched_moe_passes > 0 ? d.prefill_expert_gemm.c_str() : "",
               groups.c_str(), static_cast<long long>(d.device_routed_moe_passes),
               static_cast<long long>(d.split_routed_moe_passes));
  if (d.experts_host > 0) {  // layers with the same host set, grouped
    for (std::size_t l = 0; l < d.host_experts.size();) {
      std::size_t m = l;
      while (m + 1 < d.host_experts.size() && d.host_experts[m + 1] == d.host_experts[l]) ++m;
      std::fprintf(f, "           host experts of layers %zu-%zu: %s\n", l, m, id_ranges(d.host_experts[l]).c_str());
      l = m + 1;
    }
  }
  std::fprintf(f, "           device memory peak %s (total - free), this process %s (%s); sampled after setup, each prefill "
                  "wave and each decode step%s\n",
               human_bytes(d.peak_used_bytes).c_str(),
               d.peak_process_bytes >= 0 ? human_bytes(d.peak_process_bytes).c_str() : "unknown",
               d.process_memory_source.c_str(),
               d.budget_bytes > 0 && std::max(d.peak_used_bytes, d.peak_process_bytes) > d.budget_bytes ? ": ABOVE THE BUDGET" : "");
  if (d.prefill_block_rows > 0)
    std::fprintf(f, "prefill    %d wave(s), attention: %s, blocks of %lld query rows\n", d.prefill_waves,
                 d.prefill_attention.c_str(), static_cast<long long>(d.prefill_block_rows));
  else
    std::fprintf(f, "prefill    %d wave(s), attention: %s\n", d.prefill_waves, d.prefill_attention.c_str());
  if (d.prefill_moe_chunk_tokens > 0)
    std::fprintf(f, "           MoE layers over chunks of at most %lld of a wave's tokens (--prefill-moe-chunk-tokens)\n",
                 d.prefill_moe_chunk_tokens);
  if (d.kv_prefault_bytes > 0)
    std::fprintf(f, "           before it (setup): the unpinned region's pages for the prompts made resident, %s in "
                    "%.3f s\n",
                 human_bytes(d.kv_prefault_bytes).c_str(), d.kv_prefault_seconds);
  if (d.kv_pinned_ahead_bytes > 0)
    std::fprintf(f, "           before it (setup): the pinned region page-locked ahead for them, %s in %.3f s\n",
                 human_bytes(d.kv_pinned_ahead_bytes).c_str(), d.kv_pinned_ahead_seconds);
  std::fprintf(f, "           phases: attention + projections %.3f s, MoE %.3f s (CPU experts %.3f s), KV write-out "
                  "(host) %.3f s\n",
               d.prefill_attention_seconds, d.prefill_moe_seconds, d.prefill_cpu_expert_seconds, d.prefill_kv_write_seconds);
  std::fprintf(f, "           MoE: routing %.3f s, gather + device experts %.3f s, streamed experts %.3f s, combine "
                  "%.3f s\n",
               d.prefill_moe_route_seconds, d.prefill_moe_device_expert_seconds, d.prefill_moe_streamed_expert_seconds,
               d.prefill_moe_combine_seconds);
  {
    const prefill_host_seconds& h = d.prefill_host;
    std::fprintf(f, "           host thread: admission %.3f s, wave set-up %.3f s, memory samples %.3f s\n",
                 h.admission_seconds, h.wave_setup_seconds, h.memory_sample_seconds);
    std::fprintf(f, "           host thread: layers issued in %.3f s (routing-count waits %.3f s, attention issue %.3f s, "
                    "MoE issue after the counts %.3f s: tables %.3f s, expert GEMMs %.3f s); wave ends: GPU drain %.3f s, head + sampling %.3f s; after the "
                    "waves (last KV bytes, decode prefault) %.3f s; expert-GEMM heuristic queries %ld in %.3f s, %ld cuBLASLt calls in %.3f s\n",
                 h.layers_seconds, h.router_wait_seconds, h.attention_issue_seconds, h.moe_issue_seconds, h.moe_tables_seconds,
                 h.moe_gemm_issue_seconds, h.drain_seconds,
                 h.head_sampling_seconds, h.final_seconds, h.gemm_heuristic_queries, h.gemm_heuristic_seconds,
                 h.gemm_lt_calls, h.gemm_lt_issue_seconds);
  }
  if (d.staging_slots > 0)
    std::fprintf(f, "           host experts streamed to the GPU in waves of >= %.0f rows per expert: %lld copies, %s, "
                    "staging ring %d slots (%s); %lld MoE passes ran them inside the batched GEMMs\n",
                 d.stream_min_rows, static_cast<long long>(d.streamed_experts), human_bytes(d.streamed_bytes).c_str(),
                 d.staging_slots, human_bytes(d.staging_bytes).c_str(), static_cast<long long>(d.streamed_batched_passes));
  auto share = [](index_t part, index_t all) { return all > 0 ? 100.0 * double(part) / double(all) : 0.0; };
  if (d.placement == "hot") {
    std::fprintf(f, "placement  hot: %lld experts migrated after the prefill (at most %d per layer, %lld pairs skipped), "
                    "%s H2D + %s D2H in %.3f s\n",
                 static_cast<long long>(d.migrations - d.decode_migrations), d.migrate_max_experts,
                 static_cast<long long>(d.migrations_skipped), human_bytes(d.migrate_h2d_bytes).c_str(),
                 human_bytes(d.migrate_d2h_bytes).c_str(), d.migrate_seconds);
    if (d.migrate_every_steps > 0)
      std::fprintf(f, "           during the decode: %lld rounds (after every %d steps, rows counted from the prefill "
                      "on), %lld experts migrated in %.3f s of the steps (bytes above: every round)\n",
                   static_cast<long long>(d.decode_migration_rounds), d.migrate_every_steps,
                   static_cast<long long>(d.decode_migrations), d.decode_migrate_seconds);
  } else if (d.placement == "layers") {
    std::fprintf(f, "placement  layers (whole MoE layers' experts on the GPU, first layers first, no migration)\n");
  } else {
    std::fprintf(f, "placement  id (experts on the GPU by id, no migration)\n");
  }
  std::fprintf(f, "           device share of routed rows: prefill %.1f%% of %lld; decode %.1f%% before migration -> "
                  "%.1f%% after, of %lld\n",
               share(d.prefill_device_rows, d.prefill_routed_rows), static_cast<long long>(d.prefill_routed_rows),
               share(d.decode_device_rows_initial, d.decode_routed_rows), share(d.decode_device_rows, d.decode_routed_rows),
               static_cast<long long>(d.decode_routed_rows));
  if (d.router_zipf > 0)
    std::fprintf(f, "router     Zipf bias, exponent %.3g, over a random permutation of each layer's experts (synthetic)\n",
                 d.router_zipf);
}

/// What the text summary lists per sequence.
struct summary_options {
  /// Per-sequence lines (placement, generated tokens) for the first this many
  /// sequences: 0 (default) none, SIZE_MAX every one (ws_decode --per-sequence N|all).
  std::size_t sequence_lines = 0;
};

/// min / mean / max of `v` as "min 1 / mean 2.5 / max 4" ("%g"-style, `digits` after the point for the mean).
inline std::string min_mean_max(const std::vector<double>& v, int digits = 1) {
  if (v.empty()) return "none";
  double lo = v.front(), hi = v.front(), sum = 0.0;
  for (double x : v) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    sum += x;
  }
  char b[128];
  std::snprintf(b, sizeof b, "min %.*f / mean %.*f / max %.*f", digits, lo, digits, sum / double(v.size()), digits, hi);
  return b;
}

/// The numbers of a roofline policy's describe() ("roofline (A=… s/token, B=…
/// s/token, K=… s/token, converged r=…)", runtime_policy.hpp); nullopt for
/// another policy.
struct roofline_figures {
  double a_seconds = 0, b_seconds = 0, k_seconds = 0, r = 0;
};
inline std::optional<roofline_figures> parse_roofline_description(const std::string& d) {
  roofline_figures x;
  if (std::sscanf(d.c_str(), "roofline (A=%lg s/token, B=%lg s/token, K=%lg s/token, converged r=%lg", &x.a_seconds,
                  &x.b_seconds, &x.k_seconds, &x.r) != 4)
    return std::nullopt;
  return x;
}

/// "roofline   init -> end: A 0.76 -> 1.9 ns/token, ..., converged r 0.43 -> 0.23: ..." when the
/// policy is the roofline (its costs are re-fitted online from the measured
/// step costs, so they and r move between init and the end); empty otherwise.
inline std::string roofline_movement(const generation_result& r) {
  const auto a = parse_roofline_description(r.policy), b = parse_roofline_description(r.policy_final);
  if (!a || !b) return {};
  char s[512];
  std::snprintf(s, sizeof s,
                "roofline   init -> end: A %.3g -> %.3g ns/token, B %.3g -> %.3g ns/token, K %.3g -> %.3g ns/token, "
                "converged r %.3f -> %.3f: A and K (B with --track-gpu-cost) are re-measured online, sliding averages "
                "of the measured per-layer step costs, and each eviction is routed by the r of that moment (placed "
                "blocks never move)",
                a->a_seconds * 1e9, b->a_seconds * 1e9, a->b_seconds * 1e9, b->b_seconds * 1e9, a->k_seconds * 1e9,
                b->k_seconds * 1e9, a->r, b->r);
  return s;
}

/// `costs`: where the roofline policy's costs came from (null: not the
/// roofline policy, no costs line).
inline void print_summary(std::FILE* f, const model_config& c, const generation_result& r, double load_seconds,
                          bool random_weights, const roofline_origin* costs = nullptr, const summary_options& so = {}) {
  const summary_numbers s = summarize(r);
  const auto& u = r.usage;
  const int L = r.spec.num_layers;
  std::fprintf(f, "== ws_decode summary ==\n");
  std::fprintf(f, "model      %s, %d layers, hidden %d, %d experts (top-%d), %s weights, loaded in %.2f s\n",
               to_string(c.kind), c.num_layers, c.hidden_size, c.num_experts, c.experts_per_tok,
               random_weights ? "random" : "checkpoint", load_seconds);
  std::fprintf(f, "cache      %s, %lld B/token/layer, block %d tokens, D %d, ping-pong %d x %lld blocks, %s\n",
               r.layout.c_str(), static_cast<long long>(r.token_bytes), r.spec.block_tokens, r.spec.d_window_tokens,
               r.spec.ping_pong_buffers, static_cast<long long>(u.ping_pong_bytes / std::max<index_t>(1, r.block_bytes) /
                                                                 std::max(1, r.spec.ping_pong_buffers)),
               r.backend.c_str());
  std::fprintf(f, "policy     %s%s%s\n", r.policy.c_str(), r.policy_final != r.policy ? "; at the end: " : "",
               r.policy_final != r.policy ? r.policy_final.c_str() : "");
  if (costs) std::fprintf(f, "costs      roofline at init from %s\n", costs->describe().c_str());
  if (const std::string m = roofline_movement(r); !m.empty()) std::fprintf(f, "%s\n", m.c_str());
  if (r.warmup_sequences > 0)
    std::fprintf(f, "warm-up    one untimed decode step on %d throw-away sequences and one untimed layer of the first "
                    "prefill wave's shape (GEMM heuristics, kernel loads, attention plan) before prefill: %.3f s "
                    "(in neither prefill nor TPOT)\n",
                 r.warmup_sequences, r.warmup_seconds);
  std::fprintf(f, "prefill    %lld tokens (%zu sequence%s) in %.3f s = %.1f tok/s\n", static_cast<long long>(r.prefill_tokens),
               r.tokens.size(), r.tokens.size() == 1 ? "" : "s", r.prefill_seconds, s.prefill_tok_s);
  {
    const prefill_work w = prefill_work_of(c, prompt_lengths(r));
    std::fprintf(f, "           work %.3g TFLOP: attention %.3g, projections %.3g, routed experts %.3g (%lld rows), "
                    "router %.3g, shared + dense MLP %.3g, LM head %.3g\n",
                 w.total_flops() / 1e12, w.attention_flops / 1e12, w.projection_flops / 1e12,
                 w.routed_expert_flops / 1e12, static_cast<long long>(w.routed_rows), w.router_flops / 1e12,
                 w.shared_dense_flops / 1e12, w.lm_head_flops / 1e12);
  }
  if (r.eos_stopped_sequences == 0)
    std::fprintf(f, "decode     %zu steps x %zu sequences: TPOT P50 %.3f ms, P99 %.3f ms (P99/P50 %.2f), %.1f tok/s\n",
                 r.step_seconds.size(), r.tokens.size(), s.tpot_p50_ms, s.tpot_p99_ms, s.p99_over_p50(), s.decode_tok_s);
  else
    std::fprintf(f, "decode     %zu steps, %lld tokens (%d of %zu sequences stopped at an EOS token): TPOT P50 %.3f ms, "
                    "P99 %.3f ms (P99/P50 %.2f), %.1f tok/s\n",
                 r.step_seconds.size(), static_cast<long long>(s.decode_tokens), r.eos_stopped_sequences,
                 r.tokens.size(), s.tpot_p50_ms, s.tpot_p99_ms, s.p99_over_p50(), s.decode_tok_s);
  if (s.steady_steps > 0)
    std::fprintf(f, "           first step %.3f ms; steady state (steps 2-%zu): TPOT P50 %.3f ms, P99 %.3f ms "
                    "(P99/P50 %.2f), %.1f tok/s\n",
                 s.tpot_first_step_ms, r.step_seconds.size(), s.tpot_steady_p50_ms, s.tpot_steady_p99_ms,
                 s.steady_p99_over_p50(), s.decode_steady_tok_s);
  std::fprintf(f, "attention  %.3f s in hybrid steps (CPU engine %.3f s, GPU side %.3f s); KV tokens attended: CPU %lld, streamed %lld, HBM %lld, D-window %lld\n",
               r.attention_seconds, r.cpu_engine_seconds, r.gpu_engine_seconds, static_cast<long long>(r.cpu_tokens),
               static_cast<long long>(r.streamed_tokens), static_cast<long long>(r.resident_tokens),
               static_cast<long long>(r.window_tokens));
  if (r.device.caller_stream_steps > 0)
    std::fprintf(f, "           %lld layer steps on the caller stream (all-GPU, nothing streamed)\n",
                 static_cast<long long>(r.device.caller_stream_steps));
  if (r.device.decode_graph_launches > 0 || r.device.decode_graph_fallbacks > 0) {
    std::fprintf(f, "graphs     %lld decode segments replayed from %lld CUDA graphs; %lld capture fallbacks%s%s\n",
                 static_cast<long long>(r.device.decode_graph_launches),
                 static_cast<long long>(r.device.decode_graph_captures),
                 static_cast<long long>(r.device.decode_graph_fallbacks),
                 r.device.decode_graph_fallback_reason.empty() ? "" : " (first: ",
                 r.device.decode_graph_fallback_reason.empty() ? "" : (r.device.decode_graph_fallback_reason + ")").c_str());
  }
  if (r.device.greedy_on_device)
    std::fprintf(f, "sampling   greedy on the device (one key per sequence copied back per step, not the logits)\n");
  if (r.assist_tokens > 0)
    std::fprintf(f, "assist     the CPU engine attended %lld pinned KV tokens in place (%.3f of the pinned tokens attended)\n",
                 static_cast<long long>(r.assist_tokens),
                 double(r.assist_tokens) / double(std::max<index_t>(1, r.assist_tokens + r.streamed_tokens)));
  std::fprintf(f, "CPU share  layer group 0 (layers 0-%d, one block table for all layers): %.3f of %lld placed tokens; "
               "decode evictions: %d to CPU, %d to GPU, %d to HBM\n",
               L - 1, s.cpu_share, static_cast<long long>([&] {
                 index_t p = 0;
                 for (const auto& q : r.sequences) p += q.placed_tokens;
                 return p;
               }()),
               r.cpu_batches, r.gpu_batches, r.hbm_batches);
  const std::size_t lines = so.sequence_lines;
  const std::size_t listed = std::min(lines, r.sequences.size());
  for (std::size_t i = 0; i < listed; ++i) {
    const auto& q = r.sequences[i];
    std::fprintf(f, "           seq %zu: prompt %lld, placed %lld (CPU %lld, share %.3f; HBM %lld), D-window %lld\n", i,
                 static_cast<long long>(q.prompt_tokens), static_cast<long long>(q.placed_tokens),
                 static_cast<long long>(q.cpu_placed_tokens),
                 q.placed_tokens ? double(q.cpu_placed_tokens) / double(q.placed_tokens) : 0.0,
                 static_cast<long long>(q.hbm_placed_tokens), static_cast<long long>(q.window_tokens));
  }
  {  // aggregates over every sequence (the lines above list `listed` of them)
    std::vector<double> prompt, placed, share, window, generated;
    for (const auto& q : r.sequences) {
      prompt.push_back(double(q.prompt_tokens));
      placed.push_back(double(q.placed_tokens));
      if (q.placed_tokens > 0) share.push_back(double(q.cpu_placed_tokens) / double(q.placed_tokens));
      window.push_back(double(q.window_tokens));
    }
    for (const auto& t : r.tokens) generated.push_back(double(t.size()));
    std::fprintf(f, "sequences  %zu: prompt tokens %s; placed %s; CPU share of placed %s; D-window %s; generated %s\n",
                 r.sequences.size(), min_mean_max(prompt).c_str(), min_mean_max(placed).c_str(),
                 min_mean_max(share, 3).c_str(), min_mean_max(window).c_str(), min_mean_max(generated).c_str());
    if (listed == 0 && !r.sequences.empty())
      std::fprintf(f, "           no per-sequence lines (seq, tokens): --per-sequence N lists the first N sequences, "
                      "--per-sequence all every one\n");
    else if (listed < r.sequences.size())
      std::fprintf(f, "           per-sequence lines (seq, tokens) for the first %zu of %zu sequences; --per-sequence all "
                      "lists every one\n",
                   listed, r.sequences.size());
  }
  std::string traj;
  for (const auto& p : r.trajectory) {
    char b[96];
    std::snprintf(b, sizeof b, "%s%d:%.3f", traj.empty() ? "" : " ", p.step, p.cpu_share);
    traj += b;
  }
  std::fprintf(f, "trajectory step:share after each eviction: %s\n", traj.c_str());
  const index_t per_block_all = r.block_bytes * L;
  std::fprintf(f, "memory     region (all %d layers)        reserved          in use\n", L);
  std::fprintf(f, "           unpinned compute (CPU)  %s  %s (%lld blocks)\n", mib(u.cpu_region_bytes).c_str(),
               mib(u.cpu_used_blocks * per_block_all).c_str(), static_cast<long long>(u.cpu_used_blocks));
  std::fprintf(f, "           pinned load (host)      %s  %s (%lld blocks)\n", mib(u.pinned_region_bytes).c_str(),
               mib(u.pinned_used_blocks * per_block_all).c_str(), static_cast<long long>(u.pinned_used_blocks));
  if (u.hbm_region_bytes > 0)
    std::fprintf(f, "           HBM-resident (GPU)      %s  %s (%lld blocks)\n", mib(u.hbm_region_bytes).c_str(),
                 mib(u.hbm_used_blocks * per_block_all).c_str(), static_cast<long long>(u.hbm_used_blocks));
  std::fprintf(f, "           D-window (GPU)          %s\n", mib(u.d_window_bytes).c_str());
  std::fprintf(f, "           ping-pong (GPU)         %s\n", mib(u.ping_pong_bytes).c_str());
  if (r.device.used) print_device(f, r);
  for (std::size_t i = 0; i < std::min(lines, r.tokens.size()); ++i) {
    std::fprintf(f, "tokens %zu  ", i);
    for (std::size_t j = 0; j < r.tokens[i].size(); ++j) std::fprintf(f, "%s%d", j ? "," : "", r.tokens[i][j]);
    std::fputc('\n', f);
  }
}

/// The overlap windows' phases of expert_bound (milliseconds per step, means
/// over its steps; window_phases says what each is), or null without them.
inline nlohmann::json window_phases_json(const expert_bound& b) {
  if (!b.phases_present) return nullptr;
  const window_phases& w = b.phases;
  return {{"layers", w.layers},
          {"stage_issue", w.stage_issue * 1e3},
          {"device_issue", w.device_issue * 1e3},
          {"input_wait", w.input_wait * 1e3},
          {"cpu_setup", w.cpu_setup * 1e3},
          {"cpu_wake", w.cpu_wake * 1e3},
          {"cpu_experts", w.cpu_experts * 1e3},
          {"host_window", w.host_window * 1e3},
          {"output_issue", w.output_issue * 1e3},
          {"gpu_window", w.gpu_window * 1e3},
          {"gpu_device_experts", w.gpu_device_experts * 1e3},
          {"gpu_output", w.gpu_output * 1e3}};
}

inline nlohmann::json summary_json(const model_config& c, const generation_result& r, double load_seconds,
                                   const roofline_origin* costs = nullptr) {
  const summary_numbers s = summarize(r);
  nlohmann::json j;
  j["arch"] = to_string(c.kind);
  j["layers"] = c.num_layers;
  j["layout"] = r.layout;
  j["policy"] = r.policy;
  j["policy_final"] = r.policy_final;
  j["batch"] = r.tokens.size();
  j["load_seconds"] = load_seconds;
  j["prefill_tokens"] = r.prefill_tokens;
  j["prefill_seconds"] = r.prefill_seconds;
  {
    const prefill_work w = prefill_work_of(c, prompt_lengths(r));
    j["prefill_work"] = {{"attention_flops", w.attention_flops},   {"projection_flops", w.projection_flops},
                         {"router_flops", w.router_flops},         {"routed_expert_flops", w.routed_expert_flops},
                         {"shared_dense_flops", w.shared_dense_flops}, {"lm_head_flops", w.lm_head_flops},
                         {"total_flops", w.total_flops()},         {"routed_rows", w.routed_rows},
                         {"token_bytes_per_layer", r.token_bytes}};
  }
  j["cpu_prefault_bytes"] = r.cpu_prefault_bytes;
  j["prefill_tok_s"] = s.prefill_tok_s;
  j["tpot_p50_ms"] = s.tpot_p50_ms;
  j["tpot_p99_ms"] = s.tpot_p99_ms;
  j["tpot_p99_over_p50"] = s.p99_over_p50();
  j["decode_tok_s"] = s.decode_tok_s;
  j["decode_tokens"] = s.decode_tokens;
  j["eos_stopped_sequences"] = r.eos_stopped_sequences;
  j["step_sequences"] = r.step_sequences;
  // steady state: every decode step but the first (step_seconds[1:])
  j["tpot_first_step_ms"] = s.tpot_first_step_ms;
  j["tpot_steady_steps"] = s.steady_steps;
  j["tpot_steady_p50_ms"] = s.tpot_steady_p50_ms;
  j["tpot_steady_p99_ms"] = s.tpot_steady_p99_ms;
  j["tpot_steady_p99_over_p50"] = s.steady_p99_over_p50();
  j["decode_steady_tok_s"] = s.decode_steady_tok_s;
  j["warmup"] = {{"sequences", r.warmup_sequences}, {"seconds", r.warmup_seconds}};
  if (costs) j["roofline_init"] = costs->to_json();
  j["step_seconds"] = r.step_seconds;
  j["step_cpu_engine_seconds"] = r.step_cpu_engine_seconds;
  j["step_gpu_side_seconds"] = r.step_gpu_side_seconds;
  j["step_assist_tokens"] = r.step_assist_tokens;
  j["step_minor_faults"] = r.step_minor_faults;
  j["step_involuntary_switches"] = r.step_involuntary_switches;
  j["step_host_phases"] = {{"attention_seconds", r.step_attention_seconds},
                           {"launch_seconds", r.step_launch_seconds},
                           {"query_wait_seconds", r.step_query_wait_seconds},
                           {"finish_seconds", r.step_finish_seconds},
                           {"router_wait_seconds", r.step_router_wait_seconds},
                           {"flush_seconds", r.step_flush_seconds},
                           {"head_seconds", r.step_head_seconds}};
  j["cpu_share"] = s.cpu_share;
  j["decode_evictions"] = {{"cpu", r.cpu_batches}, {"gpu", r.gpu_batches}, {"hbm", r.hbm_batches}};
  j["attention"] = {{"seconds", r.attention_seconds},     {"cpu_engine_seconds", r.cpu_engine_seconds},
                    {"launch_seconds", r.launch_seconds},   {"query_wait_seconds", r.query_wait_seconds},
                    {"finish_seconds", r.finish_seconds},   {"router_wait_seconds", r.router_wait_seconds},
                    {"gpu_side_seconds", r.gpu_engine_seconds}, {"cpu_tokens", r.cpu_tokens},
                    {"streamed_tokens", r.streamed_tokens}, {"window_tokens", r.window_tokens},
                    {"hbm_tokens", r.resident_tokens},
                    {"assist_tokens", r.assist_tokens},
                    {"caller_stream_steps", r.device.caller_stream_steps}};
  j["greedy_on_device"] = r.device.greedy_on_device;
  j["decode_graph_segments"] = {{"launches", r.device.decode_graph_launches},
                                {"captures", r.device.decode_graph_captures},
                                {"fallbacks", r.device.decode_graph_fallbacks},
                                {"first_fallback", r.device.decode_graph_fallback_reason}};
  nlohmann::json traj = nlohmann::json::array();
  for (const auto& p : r.trajectory)
    traj.push_back({{"step", p.step}, {"placed_tokens", p.placed_tokens}, {"cpu_share", p.cpu_share}, {"target", p.target}});
  j["share_trajectory"] = traj;
  nlohmann::json seqs = nlohmann::json::array();
  for (const auto& q : r.sequences)
    seqs.push_back({{"prompt_tokens", q.prompt_tokens}, {"placed_tokens", q.placed_tokens},
                    {"cpu_placed_tokens", q.cpu_placed_tokens}, {"hbm_placed_tokens", q.hbm_placed_tokens},
                    {"window_tokens", q.window_tokens}});
  j["sequences"] = seqs;
  const auto& u = r.usage;
  const index_t per_block_all = r.block_bytes * r.spec.num_layers;
  j["memory_bytes"] = {{"unpinned_reserved", u.cpu_region_bytes},
                       {"unpinned_used", u.cpu_used_blocks * per_block_all},
                       {"pinned_reserved", u.pinned_region_bytes},
                       {"pinned_used", u.pinned_used_blocks * per_block_all},
                       {"d_window", u.d_window_bytes},
                       {"ping_pong", u.ping_pong_bytes},
                       {"hbm_reserved", u.hbm_region_bytes},
                       {"hbm_used", u.hbm_used_blocks * per_block_all}};
  j["spec"] = {{"block_tokens", r.spec.block_tokens},       {"d_window_tokens", r.spec.d_window_tokens},
               {"ping_pong_bytes", r.spec.ping_pong_bytes}, {"ping_pong_buffers", r.spec.ping_pong_buffers},
               {"first_chunk_bytes", r.spec.first_chunk_bytes},
               {"gpu_split_blocks", r.spec.gpu_split_blocks}, {"cpu_task_blocks", r.spec.cpu_task_blocks},
               {"hbm_capacity_tokens", r.spec.hbm_capacity_tokens}};
  j["backend"] = r.backend;
  if (r.device.used) {
    const device_report& d = r.device;
    j["device"] = {{"name", d.device},
                   {"precision", d.precision},
                   {"total_bytes", d.total_bytes},
                   {"budget_bytes", d.budget_bytes},
                   {"used_bytes", d.used_bytes},
                   {"weights_bytes", d.weights_bytes},
                   {"experts_gpu_bytes", d.experts_gpu_bytes},
                   {"experts_host_bytes", d.experts_host_bytes},
                   {"kv_bytes", d.kv_bytes},
                   {"workspace_bytes", d.workspace_bytes},
                   {"moe_workspace_bytes", d.moe_workspace_bytes},
                   {"moe_pass_tokens", d.moe_pass_tokens},
                   {"peak_used_bytes", d.peak_used_bytes},
                   {"peak_process_bytes", d.peak_process_bytes},
                   {"process_memory_source", d.process_memory_source},
                   {"prefill_waves", d.prefill_waves},
                   {"prefill_moe_chunk_tokens", d.prefill_moe_chunk_tokens},
                   {"prefill_block_rows", d.prefill_block_rows},
                   {"prefill_attention", d.prefill_attention}};
    j["vram_split"] = {{"hbm_kv", d.hbm_kv},
                       {"avail_bytes", d.split_avail_bytes},
                       {"hbm_region_bytes", d.hbm_region_bytes},
                       {"hbm_capacity_tokens", d.hbm_capacity_tokens},
                       {"kv_demand_tokens", d.kv_demand_tokens},
                       {"experts_gpu", d.experts_gpu},
                       {"experts_gpu_bytes", d.experts_gpu_bytes},
                       {"expert_use_probability", d.expert_use_probability},
                       {"expert_seconds_per_gib", d.expert_seconds_per_gib},
                       {"kv_seconds_per_gib", d.kv_seconds_per_gib},
                       {"first", d.split_first},
                       {"reason", d.split_reason}};
    j["kv_prefault"] = {{"bytes", d.kv_prefault_bytes}, {"seconds", d.kv_prefault_seconds}};
    j["kv_pinned_ahead"] = {{"bytes", d.kv_pinned_ahead_bytes}, {"seconds", d.kv_pinned_ahead_seconds}};
    j["prefill_phases_seconds"] = {{"attention", d.prefill_attention_seconds},
                                   {"moe", d.prefill_moe_seconds},
                                   {"cpu_experts", d.prefill_cpu_expert_seconds},
                                   {"kv_write_host", d.prefill_kv_write_seconds},
                                   {"moe_route", d.prefill_moe_route_seconds},
                                   {"moe_device_experts", d.prefill_moe_device_expert_seconds},
                                   {"moe_streamed_experts", d.prefill_moe_streamed_expert_seconds},
                                   {"moe_combine", d.prefill_moe_combine_seconds}};
    j["prefill_host_seconds"] = {{"admission", d.prefill_host.admission_seconds},
                                 {"wave_setup", d.prefill_host.wave_setup_seconds},
                                 {"memory_sample", d.prefill_host.memory_sample_seconds},
                                 {"layers", d.prefill_host.layers_seconds},
                                 {"router_wait", d.prefill_host.router_wait_seconds},
                                 {"attention_issue", d.prefill_host.attention_issue_seconds},
                                 {"moe_issue", d.prefill_host.moe_issue_seconds},
                                 {"moe_tables", d.prefill_host.moe_tables_seconds},
                                 {"moe_gemm_issue", d.prefill_host.moe_gemm_issue_seconds},
                                 {"drain", d.prefill_host.drain_seconds},
                                 {"head_sampling", d.prefill_host.head_sampling_seconds},
                                 {"final", d.prefill_host.final_seconds},
                                 {"gemm_heuristic", d.prefill_host.gemm_heuristic_seconds},
                                 {"gemm_heuristic_queries", d.prefill_host.gemm_heuristic_queries},
                                 {"gemm_lt_issue", d.prefill_host.gemm_lt_issue_seconds},
                                 {"gemm_lt_calls", d.prefill_host.gemm_lt_calls}};
    j["expert_streaming"] = {{"staging_slots", d.staging_slots},
                             {"staging_bytes", d.staging_bytes},
                             {"min_rows", d.stream_min_rows},
                             {"copies", d.streamed_experts},
                             {"bytes", d.streamed_bytes},
                             {"batched_passes", d.streamed_batched_passes}};
    j["placement"] = {{"mode", d.placement},
                      {"migrations", d.migrations},
                      {"migrations_skipped", d.migrations_skipped},
                      {"migrate_h2d_bytes", d.migrate_h2d_bytes},
                      {"migrate_d2h_bytes", d.migrate_d2h_bytes},
                      {"migrate_seconds", d.migrate_seconds},
                      {"migrate_max_experts", d.migrate_max_experts},
                      {"migrate_every_steps", d.migrate_every_steps},
                      {"decode_migration_rounds", d.decode_migration_rounds},
                      {"decode_migrations", d.decode_migrations},
                      {"decode_migrate_seconds", d.decode_migrate_seconds},
                      {"router_zipf", d.router_zipf},
                      {"prefill_routed_rows", d.prefill_routed_rows},
                      {"prefill_device_rows", d.prefill_device_rows},
                      {"decode_routed_rows", d.decode_routed_rows},
                      {"decode_device_rows_before_migration", d.decode_device_rows_initial},
                      {"decode_device_rows", d.decode_device_rows}};
    j["experts"] = {{"total", d.experts_total},
                    {"gpu", d.experts_gpu},
                    {"host", d.experts_host},
                    {"host_per_layer", d.host_experts},
                    {"cpu_seconds", d.cpu_expert_seconds},
                    {"cpu_rows", d.cpu_expert_rows},
                    {"kernels", d.expert_kernels},
                    {"batched_prefill_passes", d.batched_moe_passes},
                    {"prefill_expert_gemm", d.prefill_expert_gemm},
                    {"prefill_expert_groups", d.prefill_expert_groups},
                    {"batched_groups", d.batched_groups},
                    {"grouped_passes", d.grouped_moe_passes},
                    {"device_routed_passes", d.device_routed_moe_passes},
                    {"split_routed_passes", d.split_routed_moe_passes},
                    {"per_expert_passes", d.per_expert_moe_passes}};
    {  // the decode step's CPU experts against their bound (expert_bound_of); null: not measured
      const expert_bound b = expert_bound_of(r);
      const bool bounded = b.present && b.dram_read_gbps > 0;
      auto num = [](bool ok, double v) { return ok ? nlohmann::json(v) : nlohmann::json(nullptr); };
      j["cpu_expert_bound"] = {
          {"dram_ceiling", d.dram_ceiling},
          {"dram_read_gbps", num(d.dram_read_gbps > 0, d.dram_read_gbps)},
          {"dram_buffer_bytes", d.dram_buffer_bytes},
          {"dram_threads", d.dram_threads},
          {"dram_passes", d.dram_passes},
          {"dram_seconds", d.dram_seconds},
          {"steps_first", b.present ? int(b.first) : 0},
          {"steps", b.steps()},
          {"host_read_bytes_per_step", num(b.present, b.host_read_bytes)},
          {"cpu_bound_seconds_per_step", num(bounded, b.cpu_bound_seconds)},
          {"cpu_expert_seconds_per_step", num(b.present, b.cpu_expert_seconds)},
          {"cpu_ratio", num(bounded, b.cpu_ratio)},
          {"gpu_span_seconds_per_step", num(b.present, b.gpu_span_seconds)},
          {"overlap_window_seconds_per_step", num(b.present, b.overlap_window_seconds)},
          {"routing_trip_seconds_per_step", num(b.present, b.routing_trip_seconds)},
          {"gpu_outside_seconds_per_step", num(b.present, b.gpu_outside_seconds)},
          {"step_seconds_per_step", num(b.present, b.step_seconds)},
          {"step_bound_seconds_per_step", num(bounded, b.step_bound_seconds)},
          {"step_ratio", num(bounded, b.step_ratio)},
          {"device_experts_issue", d.device_experts_issue},
          {"window_phases_ms_per_step", window_phases_json(b)},
          {"per_step", {{"host_read_bytes", r.step_host_expert_bytes},
                        {"cpu_expert_seconds", r.step_cpu_expert_seconds},
                        {"gpu_span_seconds", r.step_gpu_span_seconds},
                        {"overlap_window_seconds", r.step_overlap_window_seconds},
                        {"routing_trip_seconds", r.step_routing_trip_seconds}}}};
    }
  }
  j["tokens"] = r.tokens;
  return j;
}

}  // namespace ws_moe
