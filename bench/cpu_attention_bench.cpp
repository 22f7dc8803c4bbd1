// SPDX-License-Identifier: Apache-2.0
// bench/cpu_attention_bench.cpp — effective bandwidth of the CPU engine's decode
// attention (paper §6.1; docs/CPU-KERNEL.md), next to a streaming-read ceiling
// measured in the same run with the same thread count.
//
// For every preset × batch × length it builds an inplace_kv_cache (host_backend,
// cpu_only policy: every placed token is in the unpinned compute region),
// prefills the sequences with random bf16 KV in as many layers as it takes to
// hold at least --min-kv-mib of KV (so that successive steps rotate through more
// distinct KV than the caches hold), and then, for every thread count:
//   ceiling  the best of --ceiling-reps OpenMP reads of a --ceiling-mib buffer
//            (64-bit words summed with SIMD), with that many threads;
//   step     hybrid_attention::step over the layers in rotation: KV bytes read
//            per second of step_report::cpu_seconds (the CPU engine: tasks +
//            their merge) and of the whole step;
//   kernel   (--bare) the kernel alone over the same blocks, same task split,
//            same OpenMP schedule, no merge.
// Rates use the median step time (a shared or virtualised machine stalls a
// few steps for milliseconds); the JSON also has the mean-time rates and the
// load average, which says whether anything else was running.
// Output: a table on stdout, progress on stderr, and (--json) a JSON file
// rewritten after every row, so that a run cut short still leaves its data.
//
// Threads: the calling thread is OpenMP thread 0 of each team, as in a real
// step. Pin with OMP_PROC_BIND=close OMP_PLACES=cores and use at most cores-1
// threads so that a core stays free for the GPU-driving thread (FAULT-KINDS K9).
#include <writescope/writescope.hpp>

#include "bench_util.hpp"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace ws = writescope;
using json = nlohmann::json;
using ws::index_t;

namespace {

using namespace wsb;  // bench_util.hpp: number and list parsing, presets, machine facts, statistics, RNG

constexpr const char* usage_text = R"(cpu_attention_bench — CPU decode-attention bandwidth vs a streaming-read ceiling

  --presets LIST       qwen3,mixtral,dsv2 (aliases of qwen3-30b-a3b, mixtral-8x7b,
                       deepseek-v2-lite; default: all three)
  --batch LIST         sequences per step (default 1,4,8,16)
  --lengths LIST       tokens per sequence, K = 1024 (default 2K,8K,32K); multiples
                       of --block-tokens
  --threads LIST       CPU engine threads (default 1,2,4,... up to cores-1, and cores-1)
  --precision LIST     kernels: fp32 (cpu::decode_kernel, fp32 FMA), bf16 (its
                       cpu::bf16_scores variant), amx (cpu::amx_decode_kernel on
                       AMX-BF16 tiles; refused where amx_available() is false)
                       (default fp32)
  --min-kv-mib N       rotate over at least this much KV per configuration, by
                       adding layers (default 1024)
  --max-kv-mib N       skip a configuration whose KV exceeds this (default 24576)
  --min-time S         timed seconds per measurement, at least one full rotation
                       (default 0.2)
  --ceiling-mib N      streaming-read buffer, > 4x L3 (default 1280)
  --ceiling-reps N     best of N reads (default 3)
  --block-tokens N     tokens per block (default 64)
  --task-blocks N      blocks per CPU task, partition_spec::cpu_task_blocks (default 16)
  --bare               also time the bare kernel over the same task split
  --budget-seconds S   stop starting new configurations after S seconds (default 0: none)
  --json PATH          write results + machine info as JSON (rewritten after every row)
  --seed N             RNG seed (default 1)
  --help

Example (16-core GPU machine, about 3 minutes):
  OMP_PROC_BIND=close OMP_PLACES=cores cpu_attention_bench --threads 1,2,4,8,15 --bare \
      --budget-seconds 170 --json bench.json
)";

struct options {
  std::vector<std::string> presets{"qwen3", "mixtral", "dsv2"};
  std::vector<int> batch{1, 4, 8, 16};
  std::vector<index_t> lengths{2048, 8192, 32768};
  std::vector<int> threads;  // empty: default list
  std::vector<std::string> precision{"fp32"};
  double min_kv_mib = 1024;
  double max_kv_mib = 24576;
  double min_time = 0.2;
  double ceiling_mib = 1280;
  int ceiling_reps = 3;
  int block_tokens = 64;
  int task_blocks = 16;
  bool bare = false;
  double budget_seconds = 0;
  std::string json_path;
  std::uint64_t seed = 1;
};

// ---------------------------------------------------------------------------
// Command line (hand-written: the GPU machine stages only xsimd, Eigen,
// doctest and nlohmann-json, so no CLI library)
// ---------------------------------------------------------------------------

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (const auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto next = [&]() -> const std::string& {
      if (!has_value) {
        if (i + 1 >= argc) throw usage_error(arg + " needs a value");
        value = argv[++i];
        has_value = true;
      }
      return value;
    };
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    } else if (arg == "--presets") {
      o.presets.clear();
      for (const auto& p : split_list(next())) o.presets.push_back(canonical_preset(p));
    } else if (arg == "--batch") {
      o.batch = parse_list<int>(arg, next());
    } else if (arg == "--lengths") {
      o.lengths = parse_list<index_t>(arg, next());
    } else if (arg == "--threads") {
      o.threads = parse_list<int>(arg, next());
    } else if (arg == "--precision") {
      o.precision = split_list(next());
      for (const auto& p : o.precision)
        if (p != "fp32" && p != "bf16" && p != "amx")
          throw usage_error("--precision: '" + p + "' is not fp32, bf16 or amx");
        else if (p == "amx" && !ws::cpu::amx_available())
          throw usage_error("--precision amx: this CPU (or kernel) offers no AMX-BF16 tiles");
    } else if (arg == "--min-kv-mib") {
      o.min_kv_mib = parse_number<double>(arg, next());
    } else if (arg == "--max-kv-mib") {
      o.max_kv_mib = parse_number<double>(arg, next());
    } else if (arg == "--min-time") {
      o.min_time = parse_number<double>(arg, next());
    } else if (arg == "--ceiling-mib") {
      o.ceiling_mib = parse_number<double>(arg, next());
    } else if (arg == "--ceiling-reps") {
      o.ceiling_reps = parse_number<int>(arg, next());
    } else if (arg == "--block-tokens") {
      o.block_tokens = parse_number<int>(arg, next());
    } else if (arg == "--task-blocks") {
      o.task_blocks = parse_number<int>(arg, next());
    } else if (arg == "--bare") {
      o.bare = true;
    } else if (arg == "--budget-seconds") {
      o.budget_seconds = parse_number<double>(arg, next());
    } else if (arg == "--json") {
      o.json_path = next();
    } else if (arg == "--seed") {
      o.seed = parse_number<std::uint64_t>(arg, next());
    } else {
      throw usage_error("unknown flag '" + arg + "' (--help lists them)");
    }
  }
  for (int b : o.batch)
    if (b < 1) throw usage_error("--batch: values must be >= 1");
  for (int t : o.threads)
    if (t < 1) throw usage_error("--threads: values must be >= 1");
  if (o.block_tokens < 1) throw usage_error("--block-tokens must be >= 1");
  for (index_t l : o.lengths)
    if (l < o.block_tokens || l % o.block_tokens != 0)
      throw usage_error("--lengths: " + std::to_string(l) + " is not a positive multiple of --block-tokens " +
                        std::to_string(o.block_tokens));
  if (o.task_blocks < 1) throw usage_error("--task-blocks must be >= 1");
  if (o.ceiling_reps < 1) throw usage_error("--ceiling-reps must be >= 1");
  if (o.ceiling_mib <= 0 || o.min_kv_mib < 0 || o.min_time <= 0) throw usage_error("sizes and times must be positive");
  if (o.threads.empty()) {
    const int cores = std::max(1, int(std::thread::hardware_concurrency()));
    const int top = std::max(1, cores - 1);
    for (int t = 1; t < top; t *= 2) o.threads.push_back(t);
    o.threads.push_back(top);
  }
  return o;
}

// ---------------------------------------------------------------------------
// Machine facts
// ---------------------------------------------------------------------------

/// wsb::machine_info plus what this benchmark's figures depend on.
json bench_machine_info(int argc, char** argv) {
  json m = wsb::machine_info(argc, argv);
  m["bf16_dot_native"] = ws::cpu::has_native_bf16_dot<ws::cpu::default_arch>;
  m["omp_max_threads"] = omp_get_max_threads();
  return m;
}

// ---------------------------------------------------------------------------
// Random data
// ---------------------------------------------------------------------------

/// A pool of random bf16 rows the prefill copies from (at varying offsets):
/// generating every layer's KV anew would dominate the run time.
struct kv_pool {
  std::vector<ws::bf16> values;
  kv_pool(index_t elems, std::uint64_t seed) : values(std::size_t(elems)) {
#pragma omp parallel
    {
      splitmix64 rng{seed * 0x2545f4914f6cdd1dull + std::uint64_t(omp_get_thread_num()) * 0x9e3779b97f4a7c15ull};
#pragma omp for schedule(static)
      for (index_t i = 0; i < elems; ++i) values[std::size_t(i)] = ws::bf16::from_float(rng.uniform(-2.0f, 2.0f));
    }
  }
};

// ---------------------------------------------------------------------------
// One configuration
// ---------------------------------------------------------------------------

struct config {
  std::string preset;
  std::string precision;
  int batch = 0;
  index_t tokens = 0;
};

struct row {
  config cfg;
  int threads = 0;
  int layers = 0;
  int steps = 0;
  int cpu_tasks = 0;
  double kv_bytes_per_step = 0;
  double total_kv_bytes = 0;
  double cpu_gbps = 0, step_gbps = 0, kernel_gbps = 0, ceiling_gbps = 0;   // median step time
  double cpu_gbps_mean = 0, step_gbps_mean = 0, kernel_gbps_mean = 0;     // mean step time
  double cpu_step_ms_p50 = 0, step_ms_p50 = 0, kernel_ms_p50 = 0;
  double ns_per_token_head_thread = 0;
  double loadavg_1m = 0;
};

/// --precision amx: the AMX kernel on hardware tiles.
struct amx_tiles {};
template <class Layout, class Precision>
struct kernel_for {
  using type = ws::cpu::decode_kernel<Layout, ws::cpu::default_arch, Precision>;
};
template <class Layout>
struct kernel_for<Layout, amx_tiles> {
  using type = ws::cpu::amx_decode_kernel<Layout>;
};

template <class Preset, class Precision>
class bench_case {
 public:
  using layout_type = typename Preset::layout_type;
  using cache_type = ws::inplace_kv_cache<layout_type, ws::host_backend, ws::pageable_allocator, ws::cpu_only>;
  using kernel_type = typename kernel_for<layout_type, Precision>::type;
  using attention_type = ws::hybrid_attention<cache_type, kernel_type>;
  static constexpr int Q = layout_type::q_dim;
  static constexpr int V = layout_type::v_dim;

  bench_case(const options& o, const config& c, int layers, const kv_pool& pool)
      : opt_(o), cfg_(c), layout_(Preset::layout()), spec_(make_spec(o, c, layers)),
        cache_(backend_, layout_, spec_, ws::cpu_only{}) {
    const index_t row = index_t(layout_.kv_heads()) * layout_type::row_elems;  // elements per token and plane
    const index_t pool_tokens = index_t(pool.values.size()) / row;
    splitmix64 rng{o.seed * 31 + 7};
    for (int i = 0; i < c.batch; ++i) {
      const ws::sequence_id id = cache_.begin_sequence(c.tokens);
      seqs_.push_back(id);
      for (int l = 0; l < layers; ++l) {
        ws::kv_tokens<layout_type, ws::pageable_host_space> kv;
        for (int p = 0; p < layout_type::planes; ++p) {
          const index_t off = index_t(rng.next() % std::uint64_t(pool_tokens - c.tokens + 1));
          kv.planes[std::size_t(p)] = pool.values.data() + off * row;
        }
        kv.num_tokens = c.tokens;
        cache_.append_prefill(l, id, kv);
      }
    }
    const int hq = layout_.num_q_heads();
    q_.resize(std::size_t(c.batch) * std::size_t(hq) * Q);
    for (auto& x : q_) x = rng.uniform(-2.0f, 2.0f);
    out_.resize(std::size_t(c.batch) * std::size_t(hq) * V);
    lse_.resize(std::size_t(c.batch) * std::size_t(hq));
    if (cache_.usage().cpu_used_blocks * o.block_tokens != index_t(c.batch) * c.tokens)
      throw std::logic_error("bench: not every token was placed in the unpinned compute region");
  }

  /// Times hybrid_attention::step (and, with --bare, the bare kernel) with `threads` threads.
  void measure(int threads, row& r) {
    const int layers = spec_.num_layers;
    const float scale = float(Preset::softmax_scale());
    ws::attention_options ao;
    ao.cpu_threads = threads;
    auto attn_ptr = std::make_unique<attention_type>(cache_, ao);  // its worker thread widens its own affinity
    attention_type& attn = *attn_ptr;
    ws::step_outputs<ws::pageable_host_space> so{ws::host_span<float>(out_.data(), index_t(out_.size())),
                                                 ws::host_span<float>(lse_.data(), index_t(lse_.size())), nullptr};
    const ws::host_span<const float> q(q_.data(), index_t(q_.size()));
    const double token_bytes = double(layout_.token_bytes());

    for (int l = 0; l < std::min(layers, 3); ++l) attn.step(l, seqs_, q, scale, so);  // warm-up (team, scratch)
    double cpu_s = 0, total_s = 0, bytes = 0;
    std::vector<double> cpu_ms, step_ms;
    int steps = 0, tasks = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (;; ++steps) {
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if ((el >= opt_.min_time && steps >= layers) || steps >= 100000) break;
      const ws::step_report rep = attn.step(steps % layers, seqs_, q, scale, so);
      cpu_s += rep.cpu_seconds;
      total_s += rep.total_seconds;
      bytes += double(rep.cpu_tokens) * token_bytes;
      cpu_ms.push_back(rep.cpu_seconds * 1e3);
      step_ms.push_back(rep.total_seconds * 1e3);
      tasks = rep.cpu_tasks;
    }
    r.threads = threads;
    r.layers = layers;
    r.steps = steps;
    r.cpu_tasks = tasks;
    const double step_bytes = bytes / std::max(steps, 1);  // every step attends the same token count
    r.kv_bytes_per_step = step_bytes;
    r.total_kv_bytes = double(cache_.usage().cpu_used_blocks) * double(layers) * double(spec_.block_tokens) *
                       token_bytes;
    r.cpu_step_ms_p50 = median(cpu_ms);
    r.step_ms_p50 = median(step_ms);
    r.cpu_gbps = step_bytes / (r.cpu_step_ms_p50 * 1e-3) / 1e9;
    r.step_gbps = step_bytes / (r.step_ms_p50 * 1e-3) / 1e9;
    r.cpu_gbps_mean = bytes / cpu_s / 1e9;
    r.step_gbps_mean = bytes / total_s / 1e9;
    r.ns_per_token_head_thread =
        r.cpu_step_ms_p50 * 1e6 * threads / (step_bytes / token_bytes) / double(layout_.kv_heads());
    if (opt_.bare) measure_bare(threads, scale, r);
    r.loadavg_1m = loadavg_1m();
  }

 private:
  static ws::partition_spec make_spec(const options& o, const config& c, int layers) {
    ws::partition_spec s;
    s.num_layers = layers;
    s.block_tokens = o.block_tokens;
    s.d_window_tokens = o.block_tokens;  // prompts are whole blocks: nothing stays in the D-window
    s.max_sequences = c.batch;
    s.cpu_capacity_tokens = index_t(c.batch) * c.tokens;
    s.pinned_capacity_tokens = 0;
    s.pinned_initial_tokens = 0;
    s.gpu_split_blocks = 1;
    s.cpu_task_blocks = o.task_blocks;
    s.ping_pong_bytes = ws::block_format<layout_type>{Preset::layout(), o.block_tokens}.block_bytes();
    return s;
  }

  /// The kernel alone over the same blocks, split into the same tasks
  /// (sequence × KV head × cpu_task_blocks blocks), dynamic schedule, no merge.
  void measure_bare(int threads, float scale, row& r) {
    struct task {
      int seq, kv_head;
      index_t first;
      int count;
    };
    const int layers = spec_.num_layers;
    const int hq = layout_.num_q_heads(), hkv = layout_.kv_heads(), group = layout_.group_size();
    std::vector<task> tasks;
    {
      const auto v = cache_.views(0);
      for (int i = 0; i < cfg_.batch; ++i) {
        const index_t n = index_t(v.sequences[std::size_t(seqs_[std::size_t(i)])].cpu_blocks.size());
        for (int h = 0; h < hkv; ++h)
          for (index_t b0 = 0; b0 < n; b0 += opt_.task_blocks)
            tasks.push_back({i, h, b0, int(std::min<index_t>(opt_.task_blocks, n - b0))});
      }
    }
    std::vector<float> task_o(tasks.size() * std::size_t(group) * V), task_lse(tasks.size() * std::size_t(group));
    auto run_layer = [&](int layer) {
      const auto v = cache_.views(layer);
      const int ntasks = int(tasks.size());
#pragma omp parallel num_threads(threads)
      {
        std::vector<ws::cpu::kv_segment> segs;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < ntasks; ++t) {
          const task& tk = tasks[std::size_t(t)];
          const auto& st = v.sequences[std::size_t(seqs_[std::size_t(tk.seq)])];
          segs.clear();
          for (int b = 0; b < tk.count; ++b)
            segs.push_back({v.cpu_block(st.cpu_blocks[std::size_t(tk.first + b)]), v.format.block_tokens});
          const std::size_t row0 = std::size_t(tk.seq) * std::size_t(hq) + std::size_t(tk.kv_head) * std::size_t(group);
          kernel_type::run(v.format, tk.kv_head, q_.data() + row0 * Q, Q, group, scale, segs,
                           task_o.data() + std::size_t(t) * std::size_t(group) * V, V,
                           task_lse.data() + std::size_t(t) * std::size_t(group));
        }
      }
    };
    for (int l = 0; l < std::min(layers, 3); ++l) run_layer(l);
    const double layer_bytes = double(cfg_.batch) * double(cfg_.tokens) * double(layout_.token_bytes());
    double secs = 0;
    std::vector<double> ms;
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0;; ++s) {
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if ((el >= opt_.min_time && s >= layers) || s >= 100000) break;
      const auto a = std::chrono::steady_clock::now();
      run_layer(s % layers);
      const double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
      secs += d;
      ms.push_back(d * 1e3);
    }
    r.kernel_ms_p50 = median(ms);
    r.kernel_gbps = layer_bytes / (r.kernel_ms_p50 * 1e-3) / 1e9;
    r.kernel_gbps_mean = layer_bytes * double(ms.size()) / secs / 1e9;
  }

  const options& opt_;
  config cfg_;
  ws::host_backend backend_;
  layout_type layout_;
  ws::partition_spec spec_;
  cache_type cache_;
  std::vector<ws::sequence_id> seqs_;
  std::vector<float> q_, out_, lse_;
};

// ---------------------------------------------------------------------------
// Sweep
// ---------------------------------------------------------------------------

struct sweep_state {
  const options* opt;
  json doc;
  std::vector<row> rows;
  read_ceiling* ceiling;
  std::chrono::steady_clock::time_point start;
  int done = 0, total = 0;
  bool out_of_budget = false;

  double elapsed() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
};

void print_header() {
  std::printf("%-9s %-4s %5s %6s %3s %5s %4s %9s %9s %9s %9s %6s %8s\n", "preset", "prec", "batch", "L", "thr",
              "tasks", "lay", "cpu GB/s", "step GB/s", "kern GB/s", "ceil GB/s", "ratio", "ns/tk·h");
  std::fflush(stdout);
}

void print_row(const row& r) {
  char kern[16] = "-";
  if (r.kernel_gbps > 0) std::snprintf(kern, sizeof kern, "%9.2f", r.kernel_gbps);
  std::printf("%-9s %-4s %5d %6lld %3d %5d %4d %9.2f %9.2f %9s %9.2f %6.3f %8.2f\n", r.cfg.preset.c_str(),
              r.cfg.precision.c_str(), r.cfg.batch, static_cast<long long>(r.cfg.tokens), r.threads, r.cpu_tasks,
              r.layers, r.cpu_gbps, r.step_gbps, kern, r.ceiling_gbps, r.cpu_gbps / r.ceiling_gbps,
              r.ns_per_token_head_thread);
  std::fflush(stdout);
}

json to_json(const row& r) {
  json j{{"preset", r.cfg.preset},
         {"precision", r.cfg.precision},
         {"batch", r.cfg.batch},
         {"tokens_per_sequence", r.cfg.tokens},
         {"threads", r.threads},
         {"layers", r.layers},
         {"steps", r.steps},
         {"cpu_tasks_per_step", r.cpu_tasks},
         {"kv_bytes_per_step", r.kv_bytes_per_step},
         {"kv_bytes_total", r.total_kv_bytes},
         {"cpu_gbps", r.cpu_gbps},
         {"step_gbps", r.step_gbps},
         {"ceiling_gbps", r.ceiling_gbps},
         {"ratio_cpu_to_ceiling", r.cpu_gbps / r.ceiling_gbps},
         {"cpu_gbps_mean", r.cpu_gbps_mean},
         {"step_gbps_mean", r.step_gbps_mean},
         {"cpu_step_ms_p50", r.cpu_step_ms_p50},
         {"step_ms_p50", r.step_ms_p50},
         {"ns_per_token_kvhead_thread", r.ns_per_token_head_thread},
         {"loadavg_1m", r.loadavg_1m}};
  if (r.kernel_gbps > 0) {
    j["kernel_gbps"] = r.kernel_gbps;
    j["kernel_gbps_mean"] = r.kernel_gbps_mean;
    j["kernel_ms_p50"] = r.kernel_ms_p50;
    j["ratio_kernel_to_ceiling"] = r.kernel_gbps / r.ceiling_gbps;
  }
  return j;
}

void write_json(const sweep_state& st) {
  if (st.opt->json_path.empty()) return;
  json doc = st.doc;
  doc["results"] = json::array();
  for (const row& r : st.rows) doc["results"].push_back(to_json(r));
  doc["complete"] = st.done == st.total && !st.out_of_budget;
  doc["elapsed_seconds"] = st.elapsed();
  const std::string tmp = st.opt->json_path + ".tmp";
  {
    std::ofstream f(tmp);
    if (!f) throw std::runtime_error("cannot write " + tmp);
    f << doc.dump(2) << '\n';
  }
  if (std::rename(tmp.c_str(), st.opt->json_path.c_str()) != 0)
    throw std::runtime_error("cannot rename " + tmp + " to " + st.opt->json_path);
}

template <class Preset, class Precision>
void run_preset(sweep_state& st, const std::string& precision) {
  const options& o = *st.opt;
  const auto lay = Preset::layout();
  const double token_bytes = double(lay.token_bytes());
  index_t max_tokens = 0;
  for (index_t l : o.lengths) max_tokens = std::max(max_tokens, l);
  // Random KV rows shared by every configuration of the preset (copied at varying offsets).
  const kv_pool pool(2 * max_tokens * lay.kv_heads() * Preset::layout_type::row_elems, o.seed);
  for (int b : o.batch)
    for (index_t L : o.lengths) {
      config c{preset_key<Preset>(), precision, b, L};
      const double layer_bytes = double(b) * double(L) * token_bytes;
      const int layers = std::max(1, int(std::ceil(o.min_kv_mib * 1048576.0 / layer_bytes)));
      const double kv_mib = layer_bytes * layers / 1048576.0;
      if (o.budget_seconds > 0 && st.elapsed() > o.budget_seconds) {
        st.out_of_budget = true;
        std::fprintf(stderr, "budget of %.0f s spent: skipping %s b=%d L=%lld and the rest\n", o.budget_seconds,
                     c.preset.c_str(), b, static_cast<long long>(L));
        return;
      }
      if (kv_mib > o.max_kv_mib) {
        std::fprintf(stderr, "skip %s b=%d L=%lld: %.0f MiB of KV exceeds --max-kv-mib\n", c.preset.c_str(), b,
                     static_cast<long long>(L), kv_mib);
        st.done += int(o.threads.size());
        continue;
      }
      std::fprintf(stderr, "[%3d/%3d %6.1fs] %s %s b=%d L=%lld: prefill %d layer(s), %.0f MiB of KV\n", st.done,
                   st.total, st.elapsed(), c.preset.c_str(), precision.c_str(), b, static_cast<long long>(L), layers,
                   kv_mib);
      bench_case<Preset, Precision> bc(o, c, layers, pool);
      for (int t : o.threads) {
        row r;
        r.cfg = c;
        r.ceiling_gbps = st.ceiling->measure(t, o.ceiling_reps);
        bc.measure(t, r);
        ++st.done;
        std::fprintf(stderr, "[%3d/%3d %6.1fs]   threads %2d: cpu %.2f GB/s, ceiling %.2f GB/s\n", st.done, st.total,
                     st.elapsed(), t, r.cpu_gbps, r.ceiling_gbps);
        print_row(r);
        st.rows.push_back(r);
        write_json(st);
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    ws::cpu::require_cpu_support();
    const int cores = int(std::thread::hardware_concurrency());
    for (int t : o.threads)
      if (t >= cores)
        std::fprintf(stderr,
                     "warning: %d threads on %d logical CPUs leaves no core for the GPU-driving thread and the "
                     "emulated GPU worker (FAULT-KINDS K9)\n",
                     t, cores);
    if (!std::getenv("OMP_PROC_BIND"))
      std::fprintf(stderr, "note: OMP_PROC_BIND is not set; OMP_PROC_BIND=close OMP_PLACES=cores pins the threads\n");

    sweep_state st;
    st.opt = &o;
    st.start = std::chrono::steady_clock::now();
    st.total = int(o.presets.size() * o.precision.size() * o.batch.size() * o.lengths.size() * o.threads.size());
    st.doc["machine"] = bench_machine_info(argc, argv);
    st.doc["options"] = json{{"presets", o.presets},        {"batch", o.batch},
                             {"lengths", o.lengths},        {"threads", o.threads},
                             {"precision", o.precision},    {"min_kv_mib", o.min_kv_mib},
                             {"min_time_seconds", o.min_time}, {"ceiling_mib", o.ceiling_mib},
                             {"ceiling_reps", o.ceiling_reps}, {"block_tokens", o.block_tokens},
                             {"cpu_task_blocks", o.task_blocks}, {"bare", o.bare},
                             {"seed", o.seed}};
    st.doc["units"] = json{
        {"gbps", "1e9 bytes of KV read per second"},
        {"cpu_gbps", "KV bytes per step / median step_report::cpu_seconds (CPU engine: tasks + merge)"},
        {"step_gbps", "KV bytes per step / median step_report::total_seconds (the whole step)"},
        {"kernel_gbps", "KV bytes per step / median wall time of the bare kernel over the same task split"},
        {"*_gbps_mean", "the same with the mean step time (includes stalls)"},
        {"ceiling_gbps", "best streaming read of the ceiling buffer, same thread count, just before the row"},
        {"ns_per_token_kvhead_thread", "median cpu_seconds x threads / (tokens x KV heads), in ns"}};

    std::fprintf(stderr, "cpu_attention_bench: %s, %d logical CPUs, kernels for %s; ceiling buffer %.0f MiB\n",
                 st.doc["machine"]["cpu_model"].get<std::string>().c_str(), cores, ws::cpu::default_arch::name(),
                 o.ceiling_mib);
    read_ceiling ceiling(index_t(o.ceiling_mib * 1048576.0));
    st.ceiling = &ceiling;
    write_json(st);
    print_header();
    for (const std::string& prec : o.precision)
      for (const std::string& p : o.presets) {
        auto run = [&]<class Preset>() {
          if (prec == "bf16") run_preset<Preset, ws::cpu::bf16_scores>(st, prec);
          else if (prec == "amx") run_preset<Preset, amx_tiles>(st, prec);
          else run_preset<Preset, ws::cpu::fp32_scores>(st, prec);
        };
        if (p == "qwen3") run.template operator()<ws::presets::qwen3_30b_a3b>();
        else if (p == "mixtral") run.template operator()<ws::presets::mixtral_8x7b>();
        else run.template operator()<ws::presets::deepseek_v2_lite>();
      }
    write_json(st);
    std::fprintf(stderr, "done: %d of %d measurements in %.1f s%s%s\n", int(st.rows.size()), st.total, st.elapsed(),
                 o.json_path.empty() ? "" : ", JSON in ", o.json_path.c_str());
    return 0;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "cpu_attention_bench: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpu_attention_bench: error: %s\n", e.what());
    return 3;
  }
}
