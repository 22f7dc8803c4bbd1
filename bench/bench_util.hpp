// SPDX-License-Identifier: Apache-2.0
// bench/bench_util.hpp — what every writescope benchmark binary shares: the
// hand-written command line (the GPU machine stages only xsimd, Eigen, doctest
// and nlohmann-json, so no CLI library), machine facts for the JSON, a time
// budget, a JSON file rewritten after every row, and the CPU streaming-read
// ceiling (the same measurement as cpu_attention_bench).
//
// Host compiler only (it includes xsimd through writescope/writescope.hpp).
#pragma once

#include <writescope/calibration.hpp>
#include <writescope/writescope.hpp>

#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

namespace wsb {

namespace ws = writescope;
using json = nlohmann::json;
using ws::index_t;
using clock_type = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// "8K" = 8192, "1M" = 1048576 for integers; plain numbers otherwise.
template <class T>
T parse_number(std::string_view flag, std::string text) {
  index_t mult = 1;
  if constexpr (std::is_integral_v<T>) {
    if (!text.empty() && (text.back() == 'K' || text.back() == 'k')) {
      mult = 1024;
      text.pop_back();
    } else if (!text.empty() && (text.back() == 'M' || text.back() == 'm')) {
      mult = 1024 * 1024;
      text.pop_back();
    }
  }
  try {
    std::size_t used = 0;
    T v{};
    if constexpr (std::is_floating_point_v<T>)
      v = static_cast<T>(std::stod(text, &used));
    else if constexpr (std::is_same_v<T, std::uint64_t>)
      v = std::stoull(text, &used);
    else
      v = static_cast<T>(std::stoll(text, &used) * mult);
    if (used != text.size() || text.empty()) throw std::invalid_argument(text);
    return v;
  } catch (const std::logic_error&) {
    throw usage_error(std::string(flag) + ": '" + text + "' is not a number");
  }
}

inline std::vector<std::string> split_list(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

template <class T>
std::vector<T> parse_list(std::string_view flag, const std::string& s) {
  std::vector<T> out;
  for (const auto& item : split_list(s)) out.push_back(parse_number<T>(flag, item));
  if (out.empty()) throw usage_error(std::string(flag) + " needs at least one value");
  return out;
}

/// A tiny "--flag value" / "--flag=value" / "--switch" reader.
class arg_reader {
 public:
  arg_reader(int argc, char** argv) : argc_(argc), argv_(argv) {}
  /// Advances to the next argument; false at the end.
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    value_.clear();
    has_value_ = false;
    if (const auto eq = flag_.find('='); flag_.rfind("--", 0) == 0 && eq != std::string::npos) {
      value_ = flag_.substr(eq + 1);
      flag_ = flag_.substr(0, eq);
      has_value_ = true;
    }
    return true;
  }
  [[nodiscard]] const std::string& flag() const noexcept { return flag_; }
  const std::string& value() {
    if (!has_value_) {
      if (i_ + 1 >= argc_) throw usage_error(flag_ + " needs a value");
      value_ = argv_[++i_];
      has_value_ = true;
    }
    return value_;
  }

 private:
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string flag_, value_;
  bool has_value_ = false;
};

/// Canonical short preset key (qwen3, mixtral, dsv2); usage_error otherwise.
inline std::string canonical_preset(const std::string& name) {
  const std::string l = ws::detail::lower(name);
  if (l == "qwen3" || l == "qwen3-30b-a3b") return "qwen3";
  if (l == "mixtral" || l == "mixtral-8x7b") return "mixtral";
  if (l == "dsv2" || l == "deepseek-v2-lite" || l == "dsv2-lite") return "dsv2";
  throw usage_error("unknown preset '" + name + "' (qwen3, mixtral, dsv2)");
}

template <class Preset>
std::string preset_key() {
  if constexpr (std::is_same_v<Preset, ws::presets::qwen3_30b_a3b>)
    return "qwen3";
  else if constexpr (std::is_same_v<Preset, ws::presets::mixtral_8x7b>)
    return "mixtral";
  else
    return "dsv2";
}

/// Calls f(Preset{}) for the preset named by `key` (canonical_preset).
template <class F>
void with_preset(const std::string& key, F&& f) {
  if (key == "qwen3")
    f(ws::presets::qwen3_30b_a3b{});
  else if (key == "mixtral")
    f(ws::presets::mixtral_8x7b{});
  else if (key == "dsv2")
    f(ws::presets::deepseek_v2_lite{});
  else
    throw usage_error("unknown preset '" + key + "'");
}

inline int default_threads() { return std::max(1, int(std::thread::hardware_concurrency()) - 1); }

// ---------------------------------------------------------------------------
// Time, statistics, progress
// ---------------------------------------------------------------------------

inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  const std::size_t n = v.size();
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(n / 2), v.end());
  const double hi = v[n / 2];
  if (n % 2) return hi;
  const double lo = *std::max_element(v.begin(), v.begin() + std::ptrdiff_t(n / 2));
  return 0.5 * (lo + hi);
}

inline double mean(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  double s = 0;
  for (double x : v) s += x;
  return s / double(v.size());
}

/// A wall-clock budget for a whole run: rows are not started once it is spent.
class budget {
 public:
  explicit budget(double seconds = 0) : limit_(seconds), start_(clock_type::now()) {}
  [[nodiscard]] double elapsed() const { return seconds_since(start_); }
  /// True when a budget is set and `reserve` more seconds would exceed it.
  [[nodiscard]] bool spent(double reserve = 0.0) const { return limit_ > 0 && elapsed() + reserve > limit_; }
  [[nodiscard]] double limit() const noexcept { return limit_; }

 private:
  double limit_;
  clock_type::time_point start_;
};

/// printf to stderr, prefixed with the elapsed time: the progress line.
inline void progress(const budget& b, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
inline void progress(const budget& b, const char* fmt, ...) {
  std::fprintf(stderr, "[%6.1fs] ", b.elapsed());
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

// ---------------------------------------------------------------------------
// Machine facts and JSON output
// ---------------------------------------------------------------------------

inline std::string read_first_line_with(const char* path, const char* key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) {
      const auto colon = line.find(':');
      std::string v = colon == std::string::npos ? line : line.substr(colon + 1);
      v.erase(0, v.find_first_not_of(" \t"));
      return v;
    }
  return "unknown";
}

inline std::string read_file_trimmed(const char* path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s.empty() ? "unknown" : s;
}

inline std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

inline const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

inline double loadavg_1m() {
  std::ifstream in("/proc/loadavg");
  double v = -1;
  in >> v;
  return v;
}

inline std::string command_line(int argc, char** argv) {
  std::string cmd;
  for (int i = 0; i < argc; ++i) {
    if (i) cmd += ' ';
    cmd += argv[i];
  }
  return cmd;
}

/// Machine facts recorded with every result file (docs/BENCHMARKS.md).
inline json machine_info(int argc, char** argv) {
  char host[256] = "unknown";
  ::gethostname(host, sizeof host - 1);
  return json{{"cpu_model", read_first_line_with("/proc/cpuinfo", "model name")},
              {"logical_cpus", std::thread::hardware_concurrency()},
              {"l3_cache", read_file_trimmed("/sys/devices/system/cpu/cpu0/cache/index3/size")},
              {"transparent_hugepage", read_file_trimmed("/sys/kernel/mm/transparent_hugepage/enabled")},
              {"mem_total", read_first_line_with("/proc/meminfo", "MemTotal")},
              {"hostname", host},
              {"date_utc", utc_now()},
              {"command", command_line(argc, argv)},
              {"simd_arch", ws::cpu::default_arch::name()},
              {"compiler", __VERSION__},
              {"omp_proc_bind", env_or("OMP_PROC_BIND", "")},
              {"omp_places", env_or("OMP_PLACES", "")},
              {"loadavg_at_start", read_file_trimmed("/proc/loadavg")}};
}

/// A JSON document rewritten (temporary file + rename) after every row, so
/// that a run cut short still leaves every finished row.
class json_file {
 public:
  explicit json_file(std::string path) : path_(std::move(path)) {}
  json doc = json::object();
  void write() const {
    if (path_.empty()) return;
    const std::string tmp = path_ + ".tmp";
    {
      std::ofstream f(tmp);
      if (!f) throw std::runtime_error("cannot write " + tmp);
      f << doc.dump(1) << '\n';
    }
    if (std::rename(tmp.c_str(), path_.c_str()) != 0) throw std::runtime_error("cannot rename " + tmp + " to " + path_);
  }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

// ---------------------------------------------------------------------------
// Random numbers
// ---------------------------------------------------------------------------

struct splitmix64 {
  std::uint64_t s;
  std::uint64_t next() noexcept {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [lo, hi).
  float uniform(float lo = -1.0f, float hi = 1.0f) noexcept {
    return float(lo + (hi - lo) * (double(next() >> 11) * 0x1.0p-53));
  }
};

/// `n` random bf16 values in [-2, 2), generated in parallel (deterministic per seed).
inline std::vector<ws::bf16> random_bf16(index_t n, std::uint64_t seed) {
  std::vector<ws::bf16> v(std::size_t(std::max<index_t>(n, 0)));
  const index_t chunk = 1 << 16;
  const index_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
  for (index_t c = 0; c < chunks; ++c) {
    splitmix64 rng{seed * 0x2545f4914f6cdd1dull + std::uint64_t(c) * 0x9e3779b97f4a7c15ull};
    const index_t end = std::min(n, (c + 1) * chunk);
    for (index_t i = c * chunk; i < end; ++i) v[std::size_t(i)] = ws::bf16::from_float(rng.uniform(-2.0f, 2.0f));
  }
  return v;
}

// ---------------------------------------------------------------------------
// CPU streaming-read ceiling (as cpu_attention_bench)
// ---------------------------------------------------------------------------

class read_ceiling {
 public:
  explicit read_ceiling(index_t bytes)
      : words_(std::size_t(std::max<index_t>(bytes, 1 << 20) / 8 / 64 * 64)),
        mem_(static_cast<std::uint64_t*>(std::aligned_alloc(64, words_ * 8)), &std::free) {
    if (!mem_) throw std::runtime_error("cannot allocate the " + ws::format_bytes(index_t(words_ * 8)) + " ceiling buffer");
    std::uint64_t* p = mem_.get();
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < words_; ++i) p[i] = i * 0x9e3779b97f4a7c15ull;
  }

  [[nodiscard]] index_t bytes() const noexcept { return index_t(words_ * 8); }

  /// Seconds of one full read with `threads` threads.
  double one_pass(int threads) {
    using batch = xsimd::batch<std::uint64_t>;
    constexpr std::size_t step = 4 * batch::size;
    const std::uint64_t* p = mem_.get();
    const std::size_t n = words_ / step * step;
    std::uint64_t total = 0;
    const auto t0 = clock_type::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      batch a0(std::uint64_t(0)), a1(std::uint64_t(0)), a2(std::uint64_t(0)), a3(std::uint64_t(0));
#pragma omp for schedule(static)
      for (std::size_t i = 0; i < n; i += step) {
        a0 += batch::load_unaligned(p + i);
        a1 += batch::load_unaligned(p + i + batch::size);
        a2 += batch::load_unaligned(p + i + 2 * batch::size);
        a3 += batch::load_unaligned(p + i + 3 * batch::size);
      }
      total += xsimd::hadd((a0 + a1) + (a2 + a3));
    }
    const double s = seconds_since(t0);
    sink_ += total;
    return s;
  }

  /// Best GB/s of `reps` full reads.
  double measure(int threads, int reps) {
    double best = 0.0;
    for (int r = 0; r < reps; ++r) best = std::max(best, double(bytes()) / one_pass(threads) / 1e9);
    return best;
  }
  [[nodiscard]] std::uint64_t sink() const noexcept { return sink_; }

 private:
  std::size_t words_;
  std::unique_ptr<std::uint64_t, void (*)(void*)> mem_;
  std::uint64_t sink_ = 0;
};

// ---------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------

/// Restricts the calling thread to CPUs [first, first + count) (clamped to
/// the machine); OpenMP teams it starts afterwards inherit the mask when
/// OMP_PROC_BIND is unset. Returns false when the system refuses.
inline bool pin_current_thread(int first, int count) {
  const int n = int(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  int added = 0;
  for (int c = first; c < first + count && c < n && c < CPU_SETSIZE; ++c, ++added) CPU_SET(c, &set);
  if (added == 0) return false;
  return ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set) == 0;
}

}  // namespace wsb
