// SPDX-License-Identifier: Apache-2.0
// writescope/calibration.hpp — roofline calibration files (paper §5.3): the
// per-token costs A (CPU engine) and B (GPU transfer + attention) and the fixed
// per-step costs C_CPU, C_GPU of one machine, per model preset and batch size,
// fitted offline by bench/calibrate in a few minutes and loaded at init so
// that the roofline policy starts on target; the online loop (roofline_policy
// observe(), A and — with roofline_params::track_gpu_cost — B) then only tracks
// drift and contention (paper §7.8).
//
// This header needs nlohmann-json (header-only; Debian nlohmann-json3-dev). It
// is not included by <writescope/writescope.hpp>, so the rest of the library
// does not depend on it.
//
// File format (JSON, written by save_calibration / bench/calibrate):
//
//   { "format": "writescope-calibration", "version": 1,
//     "device": "...", "cpu": "...", "date_utc": "...", "command": "...",
//     "entries": [
//       { "preset": "Qwen3-30B-A3B", "batch": 16, "cpu_threads": 15,
//         "cpu_cost_per_token_seconds": 1.9e-11,  "gpu_cost_per_token_seconds": 3.9e-11,
//         "cpu_fixed_seconds": 6.0e-5,            "gpu_fixed_seconds": 4.0e-5,
//         "launch_cost_per_token_seconds": 2.7e-9,                          // optional (K; 0)
//         "block_tokens": 32, "gpu_split_blocks": 4,                         // optional (the KV plan)
//         "points": [ { "engine": "cpu", "tokens_per_sequence": 8192,
//                       "tokens": 131072, "seconds": 0.0025 }, ... ] },   // optional
//       ... ] }
//
// Costs are seconds: A and B per KV token summed over the batch (the units of
// roofline_params), C_CPU and C_GPU per step of one layer; K (the host's
// enqueue of the GPU side per streamed token, roofline_params::
// launch_cost_per_token_seconds) likewise per token, absent in older files
// (read as 0). Unknown fields are ignored (tools may add fit
// statistics).
//
// Errors: a missing, unreadable or malformed file, or an entry that breaks a
// rule (A or B not positive and finite, a fixed cost not finite, batch < 1,
// K negative, a recorded block size or split below 1),
// throws checkpoint_error naming the file, the entry and the field; asking for
// a preset the file does not calibrate throws config_error listing the
// calibrated presets and batches.
#pragma once

#if !__has_include(<nlohmann/json.hpp>)
#  error "writescope/calibration.hpp needs nlohmann-json (Debian: nlohmann-json3-dev; header-only); <writescope/writescope.hpp> does not include this header"
#endif

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "policy.hpp"

namespace writescope {

/// One raw measurement behind a calibration entry: `seconds` of one engine for
/// one step of one layer that attended `tokens` KV tokens (batch summed).
struct calibration_point {
  std::string engine;                ///< "cpu" or "gpu"
  index_t tokens_per_sequence = 0;   ///< placed tokens per sequence of the run
  index_t tokens = 0;                ///< tokens that engine attended (batch summed)
  double seconds = 0.0;              ///< median step time of that engine
};

/// The calibrated costs of one (preset, batch) on one machine.
struct calibration_entry {
  std::string preset;    ///< presets::*::name, e.g. "Qwen3-30B-A3B"
  int batch = 0;         ///< sequences per step
  int cpu_threads = 0;   ///< CPU engine threads of the measurement (A depends on it); 0 = unknown
  double cpu_cost_per_token_seconds = 0.0;  ///< A
  double gpu_cost_per_token_seconds = 0.0;  ///< B
  double cpu_fixed_seconds = 0.0;           ///< C_CPU (may be negative: a fit intercept)
  double gpu_fixed_seconds = 0.0;           ///< C_GPU (likewise)
  double launch_cost_per_token_seconds = 0.0;  ///< K (>= 0; 0 when the file has none)
  /// The KV plan of the measurement (B and K depend on both): tokens per block
  /// and blocks per GPU split (partition_spec::gpu_split_blocks); 0 = not
  /// recorded (older files).
  int block_tokens = 0;
  int gpu_split_blocks = 0;
  std::vector<calibration_point> points;    ///< the measurements (optional)

  /// `base` (window, track_gpu_cost, headroom) with this entry's five costs.
  [[nodiscard]] roofline_params params(roofline_params base = {}) const {
    base.cpu_cost_per_token_seconds = cpu_cost_per_token_seconds;
    base.gpu_cost_per_token_seconds = gpu_cost_per_token_seconds;
    base.cpu_fixed_seconds = cpu_fixed_seconds;
    base.gpu_fixed_seconds = gpu_fixed_seconds;
    base.launch_cost_per_token_seconds = launch_cost_per_token_seconds;
    return base;
  }
  /// The converged share of eq. 2 with these costs (roofline_policy::converged_share).
  [[nodiscard]] double converged_share() const noexcept {
    return roofline_converged_share(cpu_cost_per_token_seconds, gpu_cost_per_token_seconds,
                                    launch_cost_per_token_seconds);
  }
};

namespace detail {

inline std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = char(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

/// Canonical lower-case preset key: the three paper presets also answer to
/// their short names (qwen3, mixtral, dsv2 / deepseek-v2-lite).
inline std::string preset_key(std::string_view name) {
  const std::string l = lower(name);
  if (l == "qwen3" || l == "qwen3-30b-a3b") return "qwen3-30b-a3b";
  if (l == "mixtral" || l == "mixtral-8x7b") return "mixtral-8x7b";
  if (l == "dsv2" || l == "dsv2-lite" || l == "deepseek-v2-lite") return "deepseek-v2-lite";
  return l;
}

}  // namespace detail

/// A calibration file in memory.
struct calibration {
  static constexpr const char* format_name = "writescope-calibration";
  static constexpr int format_version = 1;

  std::string device;    ///< GPU the costs were measured on (free text)
  std::string cpu;       ///< CPU model (free text)
  std::string date_utc;  ///< when (free text, ISO 8601 by the tool)
  std::string command;   ///< how (free text)
  std::vector<calibration_entry> entries;

  /// The entry of `preset` (name or short alias, case-insensitive) for
  /// `batch`: the exact batch if calibrated, else the calibrated batch nearest
  /// in log scale (ties to the larger); entry.batch says which. Throws
  /// config_error listing the calibrated presets when none matches.
  [[nodiscard]] const calibration_entry& find(std::string_view preset, int batch) const {
    const std::string key = detail::preset_key(preset);
    const calibration_entry* best = nullptr;
    double best_dist = std::numeric_limits<double>::infinity();
    for (const calibration_entry& e : entries) {
      if (detail::preset_key(e.preset) != key) continue;
      const double d = std::abs(std::log(double(std::max(e.batch, 1))) - std::log(double(std::max(batch, 1))));
      if (d < best_dist - 1e-12 || (std::abs(d - best_dist) <= 1e-12 && best != nullptr && e.batch > best->batch)) {
        best = &e;
        best_dist = d;
      }
    }
    if (best == nullptr) {
      std::string have;
      for (const calibration_entry& e : entries)
        have += (have.empty() ? "" : ", ") + e.preset + " batch " + std::to_string(e.batch);
      throw config_error("calibration: no entry for preset '" + std::string(preset) + "' (calibrated: " +
                         (have.empty() ? std::string("none") : have) + "); run bench/calibrate for it");
    }
    return *best;
  }
};

namespace detail {

[[noreturn]] inline void calibration_fail(const std::string& path, const std::string& what) {
  throw checkpoint_error("calibration file '" + path + "': " + what);
}

template <class T>
T calibration_field(const nlohmann::json& obj, const char* key, const std::string& path, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end()) calibration_fail(path, where + ": missing field \"" + key + "\"");
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    calibration_fail(path, where + ": field \"" + key + "\" has the wrong type (" + std::string(it->type_name()) + ")");
  }
}

}  // namespace detail

/// Parses a calibration from JSON text; `path` names the source in messages.
/// Throws checkpoint_error (see the file comment).
[[nodiscard]] inline calibration parse_calibration(std::string_view text, const std::string& path = "<memory>") {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    detail::calibration_fail(path, std::string("not valid JSON (") + e.what() + ")");
  }
  if (!j.is_object()) detail::calibration_fail(path, "the top level is not a JSON object");
  const auto fmt = j.find("format");
  if (fmt == j.end() || !fmt->is_string() || fmt->get<std::string>() != calibration::format_name)
    detail::calibration_fail(path, std::string("\"format\" is not \"") + calibration::format_name +
                                       "\" (not a writescope calibration file)");
  const int version = detail::calibration_field<int>(j, "version", path, "header");
  if (version != calibration::format_version)
    detail::calibration_fail(path, "version " + std::to_string(version) + " is not supported (this writescope reads " +
                                       std::to_string(calibration::format_version) + ")");
  calibration c;
  auto text_field = [&](const char* k) { return j.contains(k) && j[k].is_string() ? j[k].get<std::string>() : std::string(); };
  c.device = text_field("device");
  c.cpu = text_field("cpu");
  c.date_utc = text_field("date_utc");
  c.command = text_field("command");
  const auto ents = j.find("entries");
  if (ents == j.end() || !ents->is_array()) detail::calibration_fail(path, "\"entries\" is missing or not an array");
  for (std::size_t i = 0; i < ents->size(); ++i) {
    const nlohmann::json& e = (*ents)[i];
    std::string where = "entry " + std::to_string(i);
    if (!e.is_object()) detail::calibration_fail(path, where + " is not an object");
    calibration_entry x;
    x.preset = detail::calibration_field<std::string>(e, "preset", path, where);
    where += " (" + x.preset + ")";
    x.batch = detail::calibration_field<int>(e, "batch", path, where);
    x.cpu_threads = e.contains("cpu_threads") ? detail::calibration_field<int>(e, "cpu_threads", path, where) : 0;
    x.cpu_cost_per_token_seconds = detail::calibration_field<double>(e, "cpu_cost_per_token_seconds", path, where);
    x.gpu_cost_per_token_seconds = detail::calibration_field<double>(e, "gpu_cost_per_token_seconds", path, where);
    x.cpu_fixed_seconds = detail::calibration_field<double>(e, "cpu_fixed_seconds", path, where);
    x.gpu_fixed_seconds = detail::calibration_field<double>(e, "gpu_fixed_seconds", path, where);
    for (const char* f : {"block_tokens", "gpu_split_blocks"}) {
      if (!e.contains(f)) continue;
      const int v = detail::calibration_field<int>(e, f, path, where);
      if (v < 1) detail::calibration_fail(path, where + ": " + f + " " + std::to_string(v) + " must be >= 1");
      (std::string_view(f) == "block_tokens" ? x.block_tokens : x.gpu_split_blocks) = v;
    }
    if (e.contains("launch_cost_per_token_seconds")) {
      x.launch_cost_per_token_seconds =
          detail::calibration_field<double>(e, "launch_cost_per_token_seconds", path, where);
      if (!(x.launch_cost_per_token_seconds >= 0.0 && std::isfinite(x.launch_cost_per_token_seconds)))
        detail::calibration_fail(path, where + ": launch_cost_per_token_seconds " +
                                           detail::format_double(x.launch_cost_per_token_seconds) +
                                           " must be >= 0 and finite");
    }
    if (x.preset.empty()) detail::calibration_fail(path, where + ": empty \"preset\"");
    if (x.batch < 1) detail::calibration_fail(path, where + ": batch " + std::to_string(x.batch) + " must be >= 1");
    auto positive = [](double v) { return v > 0.0 && std::isfinite(v); };
    if (!positive(x.cpu_cost_per_token_seconds) || !positive(x.gpu_cost_per_token_seconds))
      detail::calibration_fail(path, where + ": per-token costs must be positive and finite (A=" +
                                         detail::format_double(x.cpu_cost_per_token_seconds) +
                                         " s, B=" + detail::format_double(x.gpu_cost_per_token_seconds) + " s)");
    if (!std::isfinite(x.cpu_fixed_seconds) || !std::isfinite(x.gpu_fixed_seconds))
      detail::calibration_fail(path, where + ": fixed costs must be finite");
    if (const auto pts = e.find("points"); pts != e.end()) {
      if (!pts->is_array()) detail::calibration_fail(path, where + ": \"points\" is not an array");
      for (std::size_t k = 0; k < pts->size(); ++k) {
        const nlohmann::json& p = (*pts)[k];
        const std::string pw = where + " point " + std::to_string(k);
        if (!p.is_object()) detail::calibration_fail(path, pw + " is not an object");
        calibration_point cp;
        cp.engine = detail::calibration_field<std::string>(p, "engine", path, pw);
        cp.tokens_per_sequence = detail::calibration_field<index_t>(p, "tokens_per_sequence", path, pw);
        cp.tokens = detail::calibration_field<index_t>(p, "tokens", path, pw);
        cp.seconds = detail::calibration_field<double>(p, "seconds", path, pw);
        x.points.push_back(std::move(cp));
      }
    }
    c.entries.push_back(std::move(x));
  }
  return c;
}

/// Reads a calibration file. Throws checkpoint_error for a missing,
/// unreadable or malformed file (see the file comment).
[[nodiscard]] inline calibration load_calibration(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) detail::calibration_fail(path, std::string("cannot open it (") + std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) detail::calibration_fail(path, "read error");
  return parse_calibration(ss.str(), path);
}

/// The calibration as JSON (the format of the file comment).
[[nodiscard]] inline nlohmann::json to_json(const calibration& c) {
  nlohmann::json j;
  j["format"] = calibration::format_name;
  j["version"] = calibration::format_version;
  j["device"] = c.device;
  j["cpu"] = c.cpu;
  j["date_utc"] = c.date_utc;
  j["command"] = c.command;
  j["entries"] = nlohmann::json::array();
  for (const calibration_entry& e : c.entries) {
    nlohmann::json x{{"preset", e.preset},
                     {"batch", e.batch},
                     {"cpu_threads", e.cpu_threads},
                     {"cpu_cost_per_token_seconds", e.cpu_cost_per_token_seconds},
                     {"gpu_cost_per_token_seconds", e.gpu_cost_per_token_seconds},
                     {"cpu_fixed_seconds", e.cpu_fixed_seconds},
                     {"gpu_fixed_seconds", e.gpu_fixed_seconds},
                     {"launch_cost_per_token_seconds", e.launch_cost_per_token_seconds},
                     {"converged_share", e.converged_share()}};
    if (e.block_tokens > 0) x["block_tokens"] = e.block_tokens;
    if (e.gpu_split_blocks > 0) x["gpu_split_blocks"] = e.gpu_split_blocks;
    x["points"] = nlohmann::json::array();
    for (const calibration_point& p : e.points)
      x["points"].push_back({{"engine", p.engine},
                             {"tokens_per_sequence", p.tokens_per_sequence},
                             {"tokens", p.tokens},
                             {"seconds", p.seconds}});
    j["entries"].push_back(std::move(x));
  }
  return j;
}

/// Writes `c` to `path` (through a temporary file renamed over it, so a reader
/// never sees half a file). Throws checkpoint_error when it cannot.
inline void save_calibration(const std::string& path, const calibration& c) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) detail::calibration_fail(tmp, std::string("cannot create it (") + std::strerror(errno) + ")");
    out << to_json(c).dump(2) << '\n';
    if (!out) detail::calibration_fail(tmp, "write error");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    detail::calibration_fail(path, std::string("cannot rename the temporary file onto it (") + std::strerror(errno) + ")");
}

/// roofline_params for `preset` at `batch` from the calibration file `path`
/// (calibration::find picks the entry), on top of `base` (its window and
/// track_gpu_cost are kept). Throws checkpoint_error for the file,
/// config_error for a preset it does not calibrate.
[[nodiscard]] inline roofline_params load_roofline_params(const std::string& path, std::string_view preset, int batch,
                                                          roofline_params base = {}) {
  return load_calibration(path).find(preset, batch).params(base);
}

/// Least-squares line y = slope·x + intercept (the calibration fit of step
/// seconds against tokens, paper eq. 1); r2 is the coefficient of determination.
struct linear_fit {
  double slope = 0.0;
  double intercept = 0.0;
  double r2 = 0.0;
  int n = 0;
};

/// Fits y = slope·x + intercept. Throws config_error for fewer than two
/// points, mismatched sizes or all x equal.
[[nodiscard]] inline linear_fit fit_line(std::span<const double> x, std::span<const double> y) {
  if (x.size() != y.size()) throw config_error("fit_line: " + std::to_string(x.size()) + " x values for " + std::to_string(y.size()) + " y values");
  if (x.size() < 2) throw config_error("fit_line: needs at least 2 points, got " + std::to_string(x.size()));
  const double n = double(x.size());
  double mx = 0, my = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    mx += x[i];
    my += y[i];
  }
  mx /= n;
  my /= n;
  double sxx = 0, sxy = 0, syy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxx += (x[i] - mx) * (x[i] - mx);
    sxy += (x[i] - mx) * (y[i] - my);
    syy += (y[i] - my) * (y[i] - my);
  }
  if (!(sxx > 0.0)) throw config_error("fit_line: all x values are equal; measure at two token counts at least");
  linear_fit f;
  f.slope = sxy / sxx;
  f.intercept = my - f.slope * mx;
  f.r2 = syy > 0.0 ? (sxy * sxy) / (sxx * syy) : 1.0;
  f.n = int(x.size());
  return f;
}

}  // namespace writescope
