// SPDX-License-Identifier: Apache-2.0
// bench/ws_bench.cpp — the writescope attention benchmarks of docs/BENCHMARKS.md,
// each a mode of one binary (--mode, comma-separated), all writing one JSON
// file rewritten after every row, a progress line per row on stderr and a
// table on stdout:
//
//   policies  for every preset × batch × length: the same-run ceilings (CPU
//             streaming read, pinned H2D, both at once), then one decode run
//             per policy: gpu_only, cpu_only, fixed shares, fixed at the
//             calibrated converged share, roofline (calibrated, A and B online).
//             Headline: roofline step vs spilled bytes / concurrent bandwidth.
//   track     paper Fig. 12: at points L along a decode (batch 16), the share
//             the roofline policy deploys (its estimates carried from point to
//             point, re-measured online) against the best of a sweep of fixed
//             shares, each timed over the same decode steps.
//   ablate    paper Fig. 10: the full system against one design point replaced
//             at a time: fixed share, per-block and per-slice DMA, per-step
//             ping-pong allocation, pageable pinned region, monolithic per-step
//             rebuild (bench/monolithic.hpp). Normalised throughput. The
//             DMA, allocation and pageable arms run on a second backend with
//             the run-time switches (basic_cuda_backend<cuda_test_hooks>), the
//             DMA and allocation arms on one cache admitted and warmed up as
//             the full system's; the full system on cuda_backend.
//   contend   paper Table 3: two caches decoding at once on two threads (each
//             its own backend, cores and OpenMP team): solo, both frozen at the
//             solo share, both adaptive (A and B online).
//   hbm       the HBM-resident tier (partition_spec::hbm_capacity_tokens): a
//             region of --hbm-gib across the rig's layers, the batch's context
//             grown from a small one, through the region's capacity, to several
//             times past it (--hbm-fill), the roofline policy with the HBM cost
//             H (the step per resident token of the last row that fitted,
//             measured per path: the default one, and the resident kernels'
//             own with --hbm-resident-kernel). Each row's bound: max(HBM bytes / the same-run HBM read rate,
//             host bytes / the same-run concurrent host ceiling); headline
//             bound / step (while the KV fits: the fraction of the HBM read rate
//             the step reaches). --hbm-compare adds the same row with the region
//             disabled; --hbm-sweep, past the region, the same row at fixed host
//             shares, and the roofline's step against the best of them. The
//             first row (--hbm-small-length, every token in HBM) is timed
//             again with attention_options::all_gpu_steps off (the fixed cost
//             of the CPU side that an all-GPU step skips).
//
// Timing: a decode step is every layer's append + hybrid_attention::step, then
// flush, then a synchronization of the caller stream; "step_ms" is a decode
// step divided by its layers (one layer's attention), median over the timed
// steps. Layers are added until a step reads --rotation-mib of KV, so that
// steps stream from DRAM and not from the 300 MiB L3 (docs/BENCHMARKS.md, "What a number means").
//
// Built against cuda_backend as `ws_bench` and against the emulated host
// backend as `ws_bench_host` (CI smoke tests; the CUDA-only ablation arms and
// the H2D ceilings are skipped there).
#include "bench_rig.hpp"

#include <atomic>
#include <barrier>
#include <functional>
#include <optional>

#if WS_BENCH_CUDA
#  include "hbm_ceiling.hpp"
#  include "monolithic.hpp"
#endif

namespace {

using namespace wsb;

constexpr const char* usage_text = R"(ws_bench — writescope attention benchmarks (docs/BENCHMARKS.md)

  --mode LIST           policies,track,ablate,contend,hbm (default: the first four)
  --presets LIST        qwen3,mixtral,dsv2 (policies, track; default all three)
  --batch LIST          policies: sequences per step (default 16)
  --lengths LIST        policies: tokens per sequence, multiples of 256 (default 8K,32K)
  --policies LIST       policies: gpu_only,cpu_only,fixed:R,fixed:cal,roofline (default: all
                        of these with fixed:0.5)
  --track-batch N       track: sequences (default 16)
  --track-lengths LIST  track: decode points L (default 2K,8K,32K)
  --track-shares LIST   track: the coarse sweep (default 0,0.2,0.4,0.6,0.8,1; the two
                        0.1-neighbours of the best are added)
  --ablate-presets LIST ablate (default dsv2,qwen3)
  --ablate-batch LIST   ablate (default 16,4)
  --ablate-lengths LIST ablate (default 32K,8K)
  --contend-preset P    contend (default qwen3)
  --contend-configs L   contend: BATCHxLENGTH list (default 8x8K,16x16K)
  --hbm-presets LIST    hbm (default qwen3,dsv2)
  --hbm-gib G           hbm: HBM-resident region, GiB over all the rig's layers (default 16)
  --hbm-batch N         hbm: sequences (default 16)
  --hbm-fill LIST       hbm: the batch's context per layer as a multiple of the region's
                        capacity (default 0.05,0.25,0.5,0.9,1.1,1.5,2,3,4); a row at
                        --hbm-small-length tokens per sequence comes first
  --hbm-small-length N  hbm: tokens per sequence of the first row, the fixed cost (default 512)
  --hbm-compare         hbm: also time every row with the region disabled
  --hbm-resident-kernel hbm: also time every row with the split-K resident kernels
  --hbm-sweep LIST      hbm: past the region, also time these fixed host CPU shares (fixed_ratio, the
                        region filled first as by every policy) and compare the roofline with the best
                        (cuda_backend::set_resident_kernel; CUDA build only)
  --contend-kinds K     contend: tenant (a second cache), cpu (a CPU-side neighbour
                        streaming memory on half the tenant's cores), pcie (a
                        neighbour saturating H2D) (default tenant,cpu,pcie)
  --tenant-threads N    contend: CPU threads per tenant (default (cores-2)/2)
  --threads N           CPU engine threads (default cores-1)
  --steps N             timed decode steps per row (default 12)
  --warmup N            untimed decode steps first (default 2)
  --window N            roofline sliding window, cost samples (default 64)
  --rotation-mib N      KV read per decode step at least, by adding layers (default 640)
  --layers N            at least N attention layers per decode step (e.g. 48: a whole
                        Qwen3-30B-A3B step; default 1)
  --first-chunk-mib N   first ping-pong fill of a step (the ramp; 0, the default: none)
  --ceiling-mib N       CPU read-ceiling buffer (default 1280)
  --calibration FILE    roofline costs (bench/calibrate --out); without it (or without
                        an entry for a preset) the costs are measured first
  --budget-seconds S    stop starting new rows after S seconds (0: none)
  --json FILE           results (rewritten after every row)
  --seed N              (default 1)
  --help
)";

struct options {
  std::vector<std::string> modes{"policies", "track", "ablate", "contend"};
  std::vector<std::string> presets{"qwen3", "mixtral", "dsv2"};
  std::vector<int> batch{16};
  std::vector<index_t> lengths{8192, 32768};
  std::vector<std::string> policies{"gpu_only", "cpu_only", "fixed:0.5", "fixed:cal", "roofline"};
  int track_batch = 16;
  std::vector<index_t> track_lengths{2048, 8192, 32768};
  std::vector<double> track_shares{0.0, 0.2, 0.4, 0.6, 0.8, 1.0};
  std::vector<std::string> ablate_presets{"dsv2", "qwen3"};
  std::vector<int> ablate_batch{16, 4};
  std::vector<index_t> ablate_lengths{32768, 8192};
  std::string contend_preset = "qwen3";
  std::vector<std::pair<int, index_t>> contend_configs{{8, 8192}, {16, 16384}};
  std::vector<std::string> contend_kinds{"tenant", "cpu", "pcie"};
  std::vector<std::string> hbm_presets{"qwen3", "dsv2"};
  double hbm_gib = 16;
  int hbm_batch = 16;
  std::vector<double> hbm_fill{0.05, 0.25, 0.5, 0.9, 1.1, 1.5, 2, 3, 4};
  index_t hbm_small_length = 512;
  bool hbm_compare = false;
  bool hbm_resident_kernel = false;
  std::vector<double> hbm_sweep;  // fixed host shares timed past the region (the three-way rule's accuracy)
  int tenant_threads = std::max(1, (int(std::thread::hardware_concurrency()) - 2) / 2);
  int threads = default_threads();
  int steps = 12;
  int warmup = 2;
  int window = 64;
  double rotation_mib = 640;
  int min_layers = 1;
  double first_chunk_mib = 0;
  double ceiling_mib = 1280;
  std::string calibration;
  double budget_seconds = 0;
  std::string json_path;
  std::uint64_t seed = 1;

  [[nodiscard]] bool has_mode(const std::string& m) const {
    return std::find(modes.begin(), modes.end(), m) != modes.end();
  }
};

void check_lengths(const char* flag, const std::vector<index_t>& v) {
  for (index_t l : v)
    if (l < 256 || l % 256 != 0)
      throw usage_error(std::string(flag) + ": " + std::to_string(l) + " is not a positive multiple of 256 (D)");
}

options parse(int argc, char** argv) {
  options o;
  arg_reader a(argc, argv);
  auto presets_of = [](const std::string& v) {
    std::vector<std::string> r;
    for (const auto& p : split_list(v)) r.push_back(canonical_preset(p));
    return r;
  };
  while (a.next()) {
    const std::string& f = a.flag();
    if (f == "--help" || f == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    } else if (f == "--mode") {
      o.modes = split_list(a.value());
      for (const auto& m : o.modes)
        if (m != "policies" && m != "track" && m != "ablate" && m != "contend" && m != "hbm")
          throw usage_error("--mode: unknown mode '" + m + "' (policies, track, ablate, contend, hbm)");
    } else if (f == "--presets") {
      o.presets = presets_of(a.value());
    } else if (f == "--batch") {
      o.batch = parse_list<int>(f, a.value());
    } else if (f == "--lengths") {
      o.lengths = parse_list<index_t>(f, a.value());
    } else if (f == "--policies") {
      o.policies = split_list(a.value());
    } else if (f == "--track-batch") {
      o.track_batch = parse_number<int>(f, a.value());
    } else if (f == "--track-lengths") {
      o.track_lengths = parse_list<index_t>(f, a.value());
    } else if (f == "--track-shares") {
      o.track_shares = parse_list<double>(f, a.value());
    } else if (f == "--ablate-presets") {
      o.ablate_presets = presets_of(a.value());
    } else if (f == "--ablate-batch") {
      o.ablate_batch = parse_list<int>(f, a.value());
    } else if (f == "--ablate-lengths") {
      o.ablate_lengths = parse_list<index_t>(f, a.value());
    } else if (f == "--hbm-presets") {
      o.hbm_presets = presets_of(a.value());
    } else if (f == "--hbm-gib") {
      o.hbm_gib = parse_number<double>(f, a.value());
      if (!(o.hbm_gib > 0 && o.hbm_gib < 1e6)) throw usage_error("--hbm-gib must be > 0 (GiB)");
    } else if (f == "--hbm-batch") {
      o.hbm_batch = parse_number<int>(f, a.value());
      if (o.hbm_batch < 1) throw usage_error("--hbm-batch must be >= 1");
    } else if (f == "--hbm-fill") {
      o.hbm_fill = parse_list<double>(f, a.value());
      for (double x : o.hbm_fill)
        if (!(x > 0 && x <= 64)) throw usage_error("--hbm-fill: " + std::to_string(x) + " is not in (0, 64]");
    } else if (f == "--hbm-small-length") {
      o.hbm_small_length = parse_number<index_t>(f, a.value());
    } else if (f == "--hbm-compare") {
      o.hbm_compare = true;
    } else if (f == "--hbm-sweep") {
      o.hbm_sweep = parse_list<double>(f, a.value());
      for (double x : o.hbm_sweep)
        if (!(x >= 0 && x <= 1)) throw usage_error("--hbm-sweep: share " + std::to_string(x) + " is not in [0, 1]");
    } else if (f == "--hbm-resident-kernel") {
      if (!has_cuda) throw usage_error("--hbm-resident-kernel: the resident kernels run on cuda_backend only (ws_bench)");
      o.hbm_resident_kernel = true;
    } else if (f == "--contend-kinds") {
      o.contend_kinds = split_list(a.value());
    } else if (f == "--contend-preset") {
      o.contend_preset = canonical_preset(a.value());
    } else if (f == "--contend-configs") {
      o.contend_configs.clear();
      for (const auto& c : split_list(a.value())) {
        const auto x = c.find('x');
        if (x == std::string::npos) throw usage_error("--contend-configs: '" + c + "' is not BATCHxLENGTH");
        o.contend_configs.emplace_back(parse_number<int>(f, c.substr(0, x)), parse_number<index_t>(f, c.substr(x + 1)));
      }
    } else if (f == "--tenant-threads") {
      o.tenant_threads = parse_number<int>(f, a.value());
    } else if (f == "--threads") {
      o.threads = parse_number<int>(f, a.value());
    } else if (f == "--steps") {
      o.steps = parse_number<int>(f, a.value());
    } else if (f == "--warmup") {
      o.warmup = parse_number<int>(f, a.value());
    } else if (f == "--window") {
      o.window = parse_number<int>(f, a.value());
    } else if (f == "--rotation-mib") {
      o.rotation_mib = parse_number<double>(f, a.value());
    } else if (f == "--layers") {
      o.min_layers = parse_number<int>(f, a.value());
      if (o.min_layers < 1 || o.min_layers > 256) throw usage_error("--layers must be in [1, 256]");
    } else if (f == "--first-chunk-mib") {
      o.first_chunk_mib = parse_number<double>(f, a.value());
      if (!(o.first_chunk_mib >= 0)) throw usage_error("--first-chunk-mib must be >= 0");
    } else if (f == "--ceiling-mib") {
      o.ceiling_mib = parse_number<double>(f, a.value());
    } else if (f == "--calibration") {
      o.calibration = a.value();
    } else if (f == "--budget-seconds") {
      o.budget_seconds = parse_number<double>(f, a.value());
    } else if (f == "--json") {
      o.json_path = a.value();
    } else if (f == "--seed") {
      o.seed = parse_number<std::uint64_t>(f, a.value());
    } else {
      throw usage_error("unknown flag '" + f + "' (--help lists them)");
    }
  }
  check_lengths("--lengths", o.lengths);
  check_lengths("--track-lengths", o.track_lengths);
  check_lengths("--ablate-lengths", o.ablate_lengths);
  check_lengths("--hbm-small-length", {o.hbm_small_length});
  for (const auto& c : o.contend_configs) check_lengths("--contend-configs", {c.second});
  for (const auto& p : o.policies)
    if (p != "gpu_only" && p != "cpu_only" && p != "roofline" && p != "fixed:cal" && p.rfind("fixed:", 0) != 0)
      throw usage_error("--policies: unknown policy '" + p + "'");
  for (double r : o.track_shares)
    if (!(r >= 0 && r <= 1)) throw usage_error("--track-shares: values must be in [0, 1]");
  if (o.steps < 1 || o.warmup < 0 || o.window < 1 || o.threads < 1 || o.tenant_threads < 1 || o.track_batch < 1)
    throw usage_error("--steps, --window, --threads, --tenant-threads, --track-batch must be >= 1, --warmup >= 0");
  return o;
}

// ---------------------------------------------------------------------------
// Shared machinery
// ---------------------------------------------------------------------------

struct context {
  const options* opt;
  budget bud;
  json_file out;
  backend_t* be;
  ceilings* ceil;
  bool complete = true;

  /// Appends `row` to section `name` and rewrites the file.
  void add(const char* name, json row) {
    out.doc[name].push_back(std::move(row));
    out.doc["elapsed_seconds"] = bud.elapsed();
    out.write();
  }
  /// True (and notes it) when the budget does not allow another row of ~`reserve` s.
  bool skip(const std::string& what, double reserve = 0) {
    if (!bud.spent(reserve)) return false;
    complete = false;
    progress(bud, "budget spent: skipping %s", what.c_str());
    return true;
  }
};

template <class Preset>
rig_config make_rig_config(const options& o, int batch, index_t L, int threads, std::uint64_t salt) {
  rig_config rc;
  rc.batch = batch;
  rc.max_prompt = L;
  rc.max_decode_steps = o.warmup + o.steps + 64;
  rc.cpu_threads = threads;
  rc.seed = o.seed * 1000003 + salt;
  rc.layers = std::max(o.min_layers, rotation_layers(index_t(batch) * L * Preset::layout().token_bytes(),
                                                     o.rotation_mib * 1048576.0));
  rc.first_chunk_bytes = index_t(o.first_chunk_mib * 1048576.0);
  return rc;
}

/// Decode steps that let the roofline policy's online estimates replace the
/// starting costs: about a window of samples (one per layer and step), at most
/// 24 steps (the ratio of sums is measured-only after the first step anyway).
int online_warmup(const options& o, int layers) {
  return std::max(o.warmup, std::min(24, (o.window + layers - 1) / layers + 1));
}

/// The JSON of a timed decode run.
template <class Rig>
json stats_json(Rig& r, const decode_stats& s) {
  const double spilled = r.spilled_bytes_per_layer();
  return json{{"layers", s.layers},
              {"cpu_share", r.cpu_share()},
              {"step_ms", s.step_ms_median},
              {"step_ms_mean", s.step_ms_mean},
              {"cpu_ms", s.cpu_ms},
              {"gpu_ms", s.gpu_ms},
              {"cpu_tokens", s.cpu_tokens},
              {"streamed_tokens", s.streamed_tokens},
              {"window_tokens", s.window_tokens},
              {"copies", s.copies},
              {"spilled_mib", spilled / 1048576.0},
              {"kv_gbps", s.step_ms_median > 0 ? spilled / (s.step_ms_median * 1e-3) / 1e9 : 0.0}};
}

/// A quick cost measurement when no calibration covers a preset: a fixed 0.5
/// split at length L (both engines at once), A and B as per-token ratios.
template <class Preset>
cost_estimate measure_costs(context& cx, const kv_pool<typename Preset::layout_type>& pool, int batch, index_t L,
                            int threads) {
  const options& o = *cx.opt;
  rig<Preset, ws::fixed_ratio> r(*cx.be, make_rig_config<Preset>(o, batch, L, threads, 99), ws::fixed_ratio(0.5), pool);
  r.admit(L);
  r.decode(std::max(1, o.warmup));
  const decode_stats s = r.decode(std::max(3, o.steps / 2));
  return {params_from_stats(s), "measured (fixed 0.5, batch " + std::to_string(batch) + ", L " + std::to_string(L) + ")"};
}

template <class Preset>
cost_estimate costs_for(context& cx, const kv_pool<typename Preset::layout_type>& pool, int batch, index_t L, int threads) {
  if (auto c = costs_from_file(cx.opt->calibration, std::string(Preset::name), batch)) return *c;
  progress(cx.bud, "  no calibration for %s batch %d: measuring A and B first", std::string(Preset::name).c_str(), batch);
  return measure_costs<Preset>(cx, pool, batch, L, threads);
}

json costs_json(const cost_estimate& c) {
  return json{{"source", c.source},
              {"A_ns_per_token", c.params.cpu_cost_per_token_seconds * 1e9},
              {"B_ns_per_token", c.params.gpu_cost_per_token_seconds * 1e9},
              {"C_cpu_us", c.params.cpu_fixed_seconds * 1e6},
              {"C_gpu_us", c.params.gpu_fixed_seconds * 1e6},
              {"converged_share", c.params.gpu_cost_per_token_seconds /
                                      (c.params.cpu_cost_per_token_seconds + c.params.gpu_cost_per_token_seconds)}};
}

/// The roofline's costs and its target share of the host tokens (the HBM-resident ones in Δ').
template <class Cache>
json policy_state(const ws::roofline_policy& p, const Cache& cache) {
  const index_t hbm = cache.total_hbm_placed_tokens();
  return json{{"A_ns_per_token", p.cpu_cost_per_token_seconds() * 1e9},
              {"B_ns_per_token", p.gpu_cost_per_token_seconds() * 1e9},
              {"H_ns_per_token", p.hbm_cost_per_token_seconds() * 1e9},
              {"converged_share", p.converged_share()},
              {"target_share", p.target_share(cache.total_placed_tokens() - hbm, hbm)}};
}

// ---------------------------------------------------------------------------
// policies
// ---------------------------------------------------------------------------

template <class Preset>
void run_policies(context& cx) {
  const options& o = *cx.opt;
  const auto lay = Preset::layout();
  const std::string name(Preset::name);
  index_t max_len = 0;
  for (index_t l : o.lengths) max_len = std::max(max_len, l);
  const kv_pool<typename Preset::layout_type> pool(lay, max_len, o.seed);
  for (int batch : o.batch)
    for (index_t L : o.lengths) {
      if (cx.skip("policies " + name + " batch " + std::to_string(batch) + " L " + std::to_string(L))) return;
      const rig_config rc = make_rig_config<Preset>(o, batch, L, o.threads, 1);
      progress(cx.bud, "policies %s batch %d L %lld (%d layers): ceilings", name.c_str(), batch,
               static_cast<long long>(L), rc.layers);
      const ceiling_result ce = cx.ceil->measure(o.threads);
      progress(cx.bud, "  ceilings: CPU read %.1f GB/s, H2D %.1f GB/s, together %.1f + %.1f GB/s", ce.cpu_gbps,
               ce.h2d_gbps, ce.conc_cpu_gbps, ce.conc_h2d_gbps);
      std::optional<cost_estimate> costs = costs_from_file(o.calibration, name, batch);
      std::optional<decode_stats> cpu_alone, gpu_alone;
      for (const std::string& pol : o.policies) {
        if (cx.skip("policies " + name + " " + pol)) return;
        json row{{"preset", name}, {"batch", batch}, {"tokens_per_sequence", L}, {"policy", pol},
                 {"threads", o.threads}, {"ceilings", ce.to_json()}};
        auto run = [&](auto policy) {
          rig<Preset, decltype(policy)> r(*cx.be, rc, std::move(policy), pool);
          r.admit(L);
          if (o.warmup > 0) r.decode(o.warmup);
          const decode_stats s = r.decode(o.steps);
          json j = stats_json(r, s);
          const double spilled = r.spilled_bytes_per_layer();
          const double ceil_ms = ce.concurrent_gbps() > 0 ? spilled / (ce.concurrent_gbps() * 1e9) * 1e3 : 0.0;
          j["ceiling_ms"] = ceil_ms;
          j["ratio_to_ceiling"] = s.step_ms_median > 0 ? ceil_ms / s.step_ms_median : 0.0;
          if constexpr (std::is_same_v<decltype(policy), ws::roofline_policy>)
            j["roofline"] = policy_state(r.policy(), r.cache());
          row.update(j);
          return s;
        };
        if (pol == "gpu_only") {
          gpu_alone = run(ws::gpu_only{});
        } else if (pol == "cpu_only") {
          cpu_alone = run(ws::cpu_only{});
        } else if (pol == "fixed:cal" || pol == "roofline") {
          if (!costs) {
            if (cpu_alone && gpu_alone) {  // A from the cpu_only row, B from the gpu_only row
              ws::roofline_params p;
              p.cpu_cost_per_token_seconds = std::max(1e-15, cpu_alone->cpu_ms * 1e-3 / double(std::max<index_t>(1, cpu_alone->cpu_tokens)));
              p.gpu_cost_per_token_seconds = std::max(1e-15, gpu_alone->gpu_ms * 1e-3 / double(std::max<index_t>(1, gpu_alone->streamed_tokens)));
              costs = cost_estimate{p, "measured (cpu_only and gpu_only rows above)"};
            } else {
              costs = measure_costs<Preset>(cx, pool, batch, L, o.threads);
            }
          }
          row["costs"] = costs_json(*costs);
          if (pol == "fixed:cal") {
            const double p = costs->params.gpu_cost_per_token_seconds /
                             (costs->params.cpu_cost_per_token_seconds + costs->params.gpu_cost_per_token_seconds);
            row["fixed_share"] = p;
            run(ws::fixed_ratio(p));
          } else {
            run(ws::roofline_policy(online_params(costs->params, o.window)));
          }
        } else {
          const double r = parse_number<double>("--policies", pol.substr(6));
          row["fixed_share"] = r;
          run(ws::fixed_ratio(r));
        }
        progress(cx.bud, "  %-10s share %.3f  %.3f ms/layer  %.1f GB/s  (%.2f of the concurrent ceiling)", pol.c_str(),
                 row["cpu_share"].get<double>(), row["step_ms"].get<double>(), row["kv_gbps"].get<double>(),
                 row["ratio_to_ceiling"].get<double>());
        std::printf("%-17s %5d %6lld %-10s %6.3f %9.3f %9.3f %8.1f %7.3f\n", name.c_str(), batch,
                    static_cast<long long>(L), pol.c_str(), row["cpu_share"].get<double>(), row["step_ms"].get<double>(),
                    row["ceiling_ms"].get<double>(), row["kv_gbps"].get<double>(), row["ratio_to_ceiling"].get<double>());
        std::fflush(stdout);
        cx.add("policies", std::move(row));
      }
    }
}

// ---------------------------------------------------------------------------
// track (Fig. 12)
// ---------------------------------------------------------------------------

template <class Preset>
void run_track(context& cx) {
  const options& o = *cx.opt;
  const auto lay = Preset::layout();
  const std::string name(Preset::name);
  const int batch = o.track_batch;
  index_t max_len = 0;
  for (index_t l : o.track_lengths) max_len = std::max(max_len, l);
  const kv_pool<typename Preset::layout_type> pool(lay, max_len, o.seed + 5);
  std::optional<ws::roofline_policy> carried;  // the deployed policy, its online state carried along the decode
  cost_estimate start;
  for (index_t L : o.track_lengths) {
    if (cx.skip("track " + name + " L " + std::to_string(L))) return;
    const rig_config rc = make_rig_config<Preset>(o, batch, L, o.threads, 2);
    progress(cx.bud, "track %s batch %d L %lld (%d layers)", name.c_str(), batch, static_cast<long long>(L), rc.layers);
    if (!carried) {
      start = costs_for<Preset>(cx, pool, batch, L, o.threads);
      carried = ws::roofline_policy(online_params(start.params, o.window));
    }
    json row{{"preset", name}, {"batch", batch}, {"tokens_per_sequence", L}, {"layers", rc.layers},
             {"threads", o.threads}, {"start_costs", costs_json(start)}};
    // Deployed: admitted with the carried estimates, decoded (estimates re-measured
    // online), re-admitted with what it measured (the placement a long decode
    // converges to under these costs), then timed.
    {
      rig<Preset, ws::roofline_policy> r(*cx.be, rc, *carried, pool);
      r.admit(L);
      row["initial_share"] = r.cpu_share();
      row["initial_policy"] = policy_state(r.policy(), r.cache());
      r.decode(online_warmup(o, rc.layers));
      r.admit(L);
      if (o.warmup > 0) r.decode(1);
      const decode_stats s = r.decode(o.steps);
      row["deployed"] = stats_json(r, s);
      row["deployed_share"] = r.cpu_share();
      row["deployed_policy"] = policy_state(r.policy(), r.cache());
      carried = r.policy();
    }
    // Sweep of fixed shares: the coarse grid, then the 0.1-neighbours of its best.
    std::vector<std::pair<double, json>> sweep;
    auto time_share = [&](double share) {
      for (const auto& [x, j] : sweep)
        if (std::abs(x - share) < 1e-9) return;
      rig<Preset, ws::fixed_ratio> r(*cx.be, rc, ws::fixed_ratio(share), pool);
      r.admit(L);
      if (o.warmup > 0) r.decode(o.warmup);
      const decode_stats s = r.decode(o.steps);
      json j = stats_json(r, s);
      j["fixed_share"] = share;
      sweep.emplace_back(share, std::move(j));
    };
    auto best = [&] {
      std::size_t b = 0;
      for (std::size_t i = 1; i < sweep.size(); ++i)
        if (sweep[i].second["step_ms"].get<double>() < sweep[b].second["step_ms"].get<double>()) b = i;
      return b;
    };
    for (double share : o.track_shares) {
      if (cx.skip("track sweep")) break;
      time_share(share);
    }
    if (!sweep.empty() && !cx.bud.spent()) {
      const double c = sweep[best()].first;
      for (double d : {-0.1, 0.1})
        if (c + d >= -1e-9 && c + d <= 1 + 1e-9) time_share(std::clamp(c + d, 0.0, 1.0));
    }
    row["sweep"] = json::array();
    for (const auto& [x, j] : sweep) row["sweep"].push_back(j);
    if (!sweep.empty()) {
      const json& b = sweep[best()].second;
      const double dep = row["deployed"]["step_ms"].get<double>();
      row["best_share"] = b["fixed_share"];
      row["best_placed_share"] = b["cpu_share"];
      row["best_step_ms"] = b["step_ms"];
      row["deployed_over_best"] = dep / b["step_ms"].get<double>();
      row["share_gap"] = std::abs(row["deployed_share"].get<double>() - b["cpu_share"].get<double>());
      progress(cx.bud, "  deployed R=%.3f %.3f ms; best swept r=%.2f %.3f ms: ratio %.3f", row["deployed_share"].get<double>(),
               dep, b["fixed_share"].get<double>(), b["step_ms"].get<double>(), row["deployed_over_best"].get<double>());
      std::printf("track %-17s %6lld  R %.3f  r_opt %.2f  deployed %.3f ms  best %.3f ms  ratio %.3f\n", name.c_str(),
                  static_cast<long long>(L), row["deployed_share"].get<double>(), b["fixed_share"].get<double>(), dep,
                  b["step_ms"].get<double>(), row["deployed_over_best"].get<double>());
      std::fflush(stdout);
    }
    cx.add("track", std::move(row));
  }
}

// ---------------------------------------------------------------------------
// ablate (Fig. 10)
// ---------------------------------------------------------------------------

template <class Preset>
void run_ablate(context& cx) {
  const options& o = *cx.opt;
  const auto lay = Preset::layout();
  const std::string name(Preset::name);
  index_t max_len = 0;
  for (index_t l : o.ablate_lengths) max_len = std::max(max_len, l);
  const kv_pool<typename Preset::layout_type> pool(lay, max_len, o.seed + 9);
  for (index_t L : o.ablate_lengths)
    for (int batch : o.ablate_batch) {
      if (cx.skip("ablate " + name + " batch " + std::to_string(batch) + " L " + std::to_string(L))) return;
      const rig_config rc = make_rig_config<Preset>(o, batch, L, o.threads, 3);
      progress(cx.bud, "ablate %s batch %d L %lld (%d layers)", name.c_str(), batch, static_cast<long long>(L), rc.layers);
      const cost_estimate costs = costs_for<Preset>(cx, pool, batch, L, o.threads);
      const ws::roofline_policy full_policy(online_params(costs.params, o.window));
      json base{{"preset", name}, {"batch", batch}, {"tokens_per_sequence", L}, {"threads", o.threads}};
      double full_ms = 0;
      auto emit = [&](const std::string& arm, json j) {
        json row = base;
        row["arm"] = arm;
        row.update(j);
        const double ms = row["step_ms"].get<double>();
        row["normalized_throughput"] = ms > 0 && full_ms > 0 ? full_ms / ms : 0.0;
        progress(cx.bud, "  %-18s %.3f ms/layer  normalized %.3f", arm.c_str(), ms, row["normalized_throughput"].get<double>());
        std::printf("ablate %-17s %3d %6lld %-18s %9.3f %7.3f\n", name.c_str(), batch, static_cast<long long>(L),
                    arm.c_str(), ms, row["normalized_throughput"].get<double>());
        std::fflush(stdout);
        cx.add("ablate", std::move(row));
      };
      {  // the full system (cuda_backend)
        rig<Preset, ws::roofline_policy> r(*cx.be, rc, full_policy, pool);
        r.admit(L);
        if (o.warmup > 0) r.decode(o.warmup);
        json j = stats_json(r, r.decode(o.steps));
        full_ms = j["step_ms"].get<double>();
        j["costs"] = costs_json(costs);
        emit("full", j);
      }
#if WS_BENCH_CUDA
      // The arms that flip a switch of the ablation backend (cuda_test_hooks;
      // with every switch off it runs the production code path), on one cache
      // admitted and warmed up as the full system's.
      ablation_backend_t abe;
      if (!cx.skip("ablate arms per_block_dma, per_slice_dma, per_step_alloc")) {
        rig<Preset, ws::roofline_policy, pinned_t, ablation_backend_t> r(abe, rc, full_policy, pool);
        r.admit(L);
        if (o.warmup > 0) r.decode(o.warmup);
        using cg = ws::cuda_ablation_options::copy_granularity;
        struct arm {
          const char* name;
          cg copies;
          bool alloc;
        };
        std::vector<arm> arms{{"per_block_dma", cg::per_block, false}};
        if constexpr (!Preset::layout_type::is_mla) arms.push_back({"per_slice_dma", cg::per_slice, false});
        arms.push_back({"per_step_alloc", cg::coalesced_runs, true});
        for (const arm& a : arms) {
          if (cx.skip(std::string("ablate arm ") + a.name)) break;
          abe.ablation().copies = a.copies;
          abe.ablation().per_step_allocation = a.alloc;
          try {
            r.decode(1);
            emit(a.name, stats_json(r, r.decode(o.steps)));
          } catch (...) {
            abe.ablation() = {};
            throw;
          }
          abe.ablation() = {};
        }
      }
#endif
      if (!cx.skip("ablate arm fixed_share")) {
        const double p = full_policy.converged_share();
        rig<Preset, ws::fixed_ratio> r(*cx.be, rc, ws::fixed_ratio(p), pool);
        r.admit(L);
        if (o.warmup > 0) r.decode(o.warmup);
        json j = stats_json(r, r.decode(o.steps));
        j["fixed_share"] = p;
        emit("fixed_share", j);
      }
#if WS_BENCH_CUDA
      if (!cx.skip("ablate arm pageable_source")) {
        abe.debug().allow_pageable_sources = true;  // debug builds refuse pageable H2D sources otherwise
        try {
          rig<Preset, ws::roofline_policy, ws::pageable_allocator, ablation_backend_t> r(abe, rc, full_policy, pool);
          r.admit(L);
          r.decode(1);
          emit("pageable_source", stats_json(r, r.decode(std::max(3, o.steps / 2))));
        } catch (...) {
          abe.debug().allow_pageable_sources = false;
          throw;
        }
        abe.debug().allow_pageable_sources = false;
      }
      if (!cx.skip("ablate arm monolithic_rebuild")) {
        // One layer: the rebuild touches everything anyway; pinning dominates.
        monolithic_cache<typename Preset::layout_type> m(lay, batch, L, 1, o.threads, o.seed + 11);
        const auto rows = std::size_t(batch) * std::size_t(lay.num_q_heads());
        act_buffer q(rows * Preset::layout_type::q_dim * sizeof(float)), out(rows * Preset::layout_type::v_dim * sizeof(float)),
            lse(rows * sizeof(float));
        {
          std::vector<float> hq(rows * Preset::layout_type::q_dim);
          splitmix64 rng{o.seed + 13};
          for (float& x : hq) x = rng.uniform();
          q.upload(hq.data(), hq.size() * sizeof(float));
        }
        const float scale = float(Preset::softmax_scale());
        m.step(0, L, q.as<float>(), scale, out.as<float>(), lse.as<float>());  // warm-up
        std::vector<double> tot;
        rebuild_times last;
        for (int s = 0; s < 3; ++s) {
          last = m.step(0, L, q.as<float>(), scale, out.as<float>(), lse.as<float>());
          tot.push_back(last.total() * 1e3);
        }
        json j{{"step_ms", median(tot)}, {"layers", 1}, {"rebuild", last.to_json()},
               {"spilled_mib", double(m.step_bytes(L)) / 1048576.0}};
        emit("monolithic_rebuild", j);
      }
#endif
    }
}

// ---------------------------------------------------------------------------
// contend (Table 3)
// ---------------------------------------------------------------------------

/// Runs steps until this tenant has `n` and the other one has finished its
/// `n` too (so every counted step ran under contention); returns the counted
/// per-layer step times (ms).
template <class Rig>
std::vector<double> contended_steps(Rig& r, int n, std::atomic<int>& done, int tenants) {
  std::vector<double> ms;
  bool counted = false;
  for (int s = 0; s < 8 * n + 8; ++s) {
    const decode_stats st = r.decode(1);
    if (int(ms.size()) < n) ms.push_back(st.step_ms_median);
    if (!counted && int(ms.size()) == n) {
      counted = true;
      done.fetch_add(1);
    }
    if (counted && done.load() >= tenants) break;
  }
  if (!counted) done.fetch_add(1);
  return ms;
}

/// A neighbour that loads one resource the way MoE expert work does (paper
/// §2.2): `cpu` — `threads` threads on the tenant's own cores streaming a
/// 512 MiB buffer (experts' weight reads and GEMMs on the CPU); `pcie` — one
/// thread issuing back-to-back 64 MiB pinned H2D copies on its own stream
/// (expert loading). Runs until destroyed.
class background_load {
 public:
  background_load(const std::string& kind, int first_core, int threads) {
    if (kind == "cpu") {
      buf_.assign(std::size_t(512) << 20 >> 3, 1);
      for (int i = 0; i < threads; ++i)
        threads_.emplace_back([this, first_core, i] {
          pin_current_thread(first_core + i, 1);
          const std::size_t n = buf_.size();
          const std::size_t lo = n / 64 * std::size_t(i % 64), len = n / 4;
          std::uint64_t acc = 0;
          while (!stop_.load(std::memory_order_relaxed))
            for (std::size_t k = 0; k < len; k += 8) acc += buf_[(lo + k) % n];
          sink_.fetch_add(acc, std::memory_order_relaxed);
        });
    } else if (kind == "pcie") {
#if WS_BENCH_CUDA
      threads_.emplace_back([this] {
        const std::size_t bytes = std::size_t(64) << 20;
        void* host = nullptr;
        void* dev = nullptr;
        cudaStream_t s = nullptr;
        if (cudaHostAlloc(&host, bytes, cudaHostAllocDefault) != cudaSuccess || cudaMalloc(&dev, bytes) != cudaSuccess ||
            cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
          failed_ = true;
        } else {
          while (!stop_.load(std::memory_order_relaxed)) {
            (void)cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s);
            (void)cudaStreamSynchronize(s);
          }
        }
        if (s) (void)cudaStreamDestroy(s);
        if (dev) (void)cudaFree(dev);
        if (host) (void)cudaFreeHost(host);
      });
#else
      failed_ = true;  // no device on the host backend
#endif
    } else {
      throw usage_error("--contend-kinds: unknown kind '" + kind + "' (tenant, cpu, pcie)");
    }
  }
  background_load(const background_load&) = delete;
  background_load& operator=(const background_load&) = delete;
  ~background_load() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }
  [[nodiscard]] bool failed() const noexcept { return failed_; }

 private:
  std::vector<std::uint64_t> buf_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> sink_{0};
  bool failed_ = false;
};

template <class Preset>
void run_contend(context& cx) {
  const options& o = *cx.opt;
  const auto lay = Preset::layout();
  const std::string name(Preset::name);
  const int T = o.tenant_threads;
  const int cores = int(std::thread::hardware_concurrency());
  if (std::getenv("OMP_PROC_BIND") != nullptr)
    progress(cx.bud, "contend: note: OMP_PROC_BIND is set; the tenants' OpenMP teams may share cores (run contend without it)");
  index_t max_len = 0;
  for (const auto& c : o.contend_configs) max_len = std::max(max_len, c.second);
  const kv_pool<typename Preset::layout_type> pool(lay, max_len, o.seed + 21);
  for (const auto& [batch, L] : o.contend_configs) {
    if (cx.skip("contend " + name + " " + std::to_string(batch) + "x" + std::to_string(L))) return;
    const rig_config rc = make_rig_config<Preset>(o, batch, L, T, 4);
    const int warm = online_warmup(o, rc.layers);
    progress(cx.bud, "contend %s batch %d L %lld (%d layers, %d threads per tenant)", name.c_str(), batch,
             static_cast<long long>(L), rc.layers, T);
    const cost_estimate costs = costs_for<Preset>(cx, pool, batch, L, T);
    json row{{"preset", name}, {"batch", batch}, {"tokens_per_sequence", L}, {"layers", rc.layers},
             {"tenant_threads", T}, {"start_costs", costs_json(costs)}};
    auto first_core = [&](int tenant) { return std::min(cores - 1, 1 + tenant * T); };

    // Solo, adaptive: tenant 0 alone on its cores.
    double solo_share = 0, solo_ms = 0;
    std::optional<ws::roofline_policy> solo_policy;
    std::exception_ptr err;
    std::thread([&] {
      try {
        pin_current_thread(first_core(0), T);
        backend_t be;
        rig<Preset, ws::roofline_policy> r(be, rc, ws::roofline_policy(online_params(costs.params, o.window)), pool);
        r.admit(L);
        r.decode(warm);
        r.admit(L);  // placement by what it measured alone
        r.decode(1);
        solo_ms = median(r.decode(o.steps).step_seconds) / rc.layers * 1e3;
        solo_share = r.cpu_share();
        solo_policy = r.policy();
        row["solo_policy"] = policy_state(r.policy(), r.cache());
      } catch (...) {
        err = std::current_exception();
      }
    }).join();
    if (err) std::rethrow_exception(err);
    row["solo_ms"] = solo_ms;
    row["solo_share"] = solo_share;
    progress(cx.bud, "  solo: share %.3f, %.3f ms/layer", solo_share, solo_ms);

    // Two tenants at once: frozen at the solo share, then adaptive.
    auto pair = [&](bool adaptive) {
      std::barrier sync(2);
      std::atomic<int> done{0};
      std::vector<double> ms[2];
      double share[2] = {0, 0};
      json pol[2];
      std::exception_ptr errs[2];
      auto tenant = [&](int t) {
        try {
          pin_current_thread(first_core(t), T);
          backend_t be;
          rig_config c = rc;
          c.seed += std::uint64_t(t) * 7919;
          if (adaptive) {
            rig<Preset, ws::roofline_policy> r(be, c, *solo_policy, pool);
            r.admit(L);
            sync.arrive_and_wait();
            r.decode(warm);  // both decoding: the estimates take in the contention
            sync.arrive_and_wait();
            r.admit(L);  // placement by the contended estimates
            r.decode(1);
            sync.arrive_and_wait();
            ms[t] = contended_steps(r, o.steps, done, 2);
            share[t] = r.cpu_share();
            pol[t] = policy_state(r.policy(), r.cache());
          } else {
            rig<Preset, ws::fixed_ratio> r(be, c, ws::fixed_ratio(solo_share), pool);
            r.admit(L);
            r.decode(1);
            sync.arrive_and_wait();
            ms[t] = contended_steps(r, o.steps, done, 2);
            share[t] = r.cpu_share();
          }
        } catch (...) {
          errs[t] = std::current_exception();
          // Keep the other tenant from waiting forever at a barrier.
          sync.arrive_and_drop();
          done.fetch_add(2);
        }
      };
      // Both tenants on fresh threads: each gets its own OpenMP team, started
      // after its affinity is set (the main thread's team is bound elsewhere).
      std::thread t0(tenant, 0), t1(tenant, 1);
      t0.join();
      t1.join();
      for (auto& e : errs)
        if (e) std::rethrow_exception(e);
      json j{{"tenant_ms", {median(ms[0]), median(ms[1])}}, {"tenant_share", {share[0], share[1]}},
             {"mean_ms", 0.5 * (median(ms[0]) + median(ms[1]))}};
      if (adaptive) j["tenant_policy"] = {pol[0], pol[1]};
      return j;
    };
    const json frozen = pair(false);
    progress(cx.bud, "  frozen pair: %.3f ms/layer (share %.3f)", frozen["mean_ms"].get<double>(), solo_share);
    const json adaptive = pair(true);
    progress(cx.bud, "  adaptive pair: %.3f ms/layer (shares %.3f, %.3f)", adaptive["mean_ms"].get<double>(),
             adaptive["tenant_share"][0].get<double>(), adaptive["tenant_share"][1].get<double>());
    row["frozen"] = frozen;
    row["adaptive"] = adaptive;

    // One tenant under an asymmetric neighbour (CPU-side or PCIe-side load):
    // frozen at the solo share vs adaptive (online A and B).
    for (const std::string& kind : o.contend_kinds) {
      if (kind == "tenant") continue;
#if !WS_BENCH_CUDA
      if (kind == "pcie") continue;  // the emulated device has no PCIe
#endif
      if (cx.skip("contend " + name + " " + kind + " neighbour")) break;
      auto single = [&](bool adaptive_policy) {
        double ms_out = 0, share_out = 0;
        std::exception_ptr e;
        std::thread([&] {
          try {
            pin_current_thread(first_core(0), T);
            backend_t be;
            background_load load(kind, first_core(0), std::max(1, T / 2));
            if (load.failed()) throw std::runtime_error("background " + kind + " load could not start");
            if (adaptive_policy) {
              rig<Preset, ws::roofline_policy> r(be, rc, *solo_policy, pool);
              r.admit(L);
              r.decode(warm);  // the estimates take in the neighbour
              r.admit(L);      // placement by the contended estimates
              r.decode(1);
              ms_out = median(r.decode(o.steps).step_seconds) / rc.layers * 1e3;
              share_out = r.cpu_share();
            } else {
              rig<Preset, ws::fixed_ratio> r(be, rc, ws::fixed_ratio(solo_share), pool);
              r.admit(L);
              r.decode(1);
              ms_out = median(r.decode(o.steps).step_seconds) / rc.layers * 1e3;
              share_out = r.cpu_share();
            }
          } catch (...) {
            e = std::current_exception();
          }
        }).join();
        if (e) std::rethrow_exception(e);
        return std::pair<double, double>(ms_out, share_out);
      };
      const auto [f_ms, f_share] = single(false);
      const auto [a_ms, a_share] = single(true);
      row["neighbour_" + kind] = {{"frozen_ms", f_ms}, {"frozen_share", f_share}, {"adaptive_ms", a_ms},
                                  {"adaptive_share", a_share}, {"adaptive_over_frozen", a_ms / f_ms},
                                  {"neighbour_threads", kind == "cpu" ? std::max(1, T / 2) : 1}};
      progress(cx.bud, "  %s neighbour: frozen %.3f ms (r %.3f), adaptive %.3f ms (r %.3f)", kind.c_str(), f_ms, f_share,
               a_ms, a_share);
      std::printf("contend %-17s %3dx%-6lld %s neighbour: frozen %.3f ms (r %.3f)  adaptive %.3f ms (r %.3f)  x%.3f\n",
                  name.c_str(), batch, static_cast<long long>(L), kind.c_str(), f_ms, f_share, a_ms, a_share, a_ms / f_ms);
      std::fflush(stdout);
    }
    row["frozen_over_solo"] = frozen["mean_ms"].get<double>() / solo_ms;
    row["adaptive_over_solo"] = adaptive["mean_ms"].get<double>() / solo_ms;
    row["adaptive_over_frozen"] = adaptive["mean_ms"].get<double>() / frozen["mean_ms"].get<double>();
    std::printf("contend %-17s %3dx%-6lld solo %.3f ms (r %.3f)  frozen %.3f ms  adaptive %.3f ms (r %.3f/%.3f)\n",
                name.c_str(), batch, static_cast<long long>(L), solo_ms, solo_share, frozen["mean_ms"].get<double>(),
                adaptive["mean_ms"].get<double>(), adaptive["tenant_share"][0].get<double>(),
                adaptive["tenant_share"][1].get<double>());
    std::fflush(stdout);
    cx.add("contend", std::move(row));
  }
}

// ---------------------------------------------------------------------------
// hbm (the HBM-resident tier)
// ---------------------------------------------------------------------------

template <class Preset>
void run_hbm(context& cx, double hbm_gbps) {
  const options& o = *cx.opt;
  const auto lay = Preset::layout();
  const std::string name(Preset::name);
  const int batch = o.hbm_batch;
  const int layers = o.min_layers;
  const index_t D = 256;
  const double token_bytes = double(lay.token_bytes());
  // the region in whole eviction batches of every layer
  const index_t cap_tokens =
      index_t(o.hbm_gib * double(index_t{1} << 30) / (token_bytes * double(layers))) / D * D;
  if (cap_tokens < D) throw usage_error("--hbm-gib " + std::to_string(o.hbm_gib) + " holds no eviction batch of " + name);
  auto length_of = [&](double fill) {  // tokens per sequence, a multiple of D
    const double per_seq = fill * double(cap_tokens) / double(batch);
    return std::max<index_t>(D, index_t(std::llround(per_seq / double(D))) * D);
  };
  std::vector<index_t> lengths{o.hbm_small_length};
  for (double f : o.hbm_fill) lengths.push_back(length_of(f));
  const index_t max_len = *std::max_element(lengths.begin(), lengths.end());
  const kv_pool<typename Preset::layout_type> pool(lay, max_len, o.seed + 13);
  progress(cx.bud, "hbm %s: region %.2f GiB = %lld tokens per layer, %d layers, batch %d", name.c_str(), o.hbm_gib,
           static_cast<long long>(cap_tokens), layers, batch);
  // A and B (host tiers) from a short host-only run, H from the fitting rows
  // (until one ran: the token's bytes at the same-run HBM read rate).
  const index_t cost_len = std::min(max_len, std::max<index_t>(D, index_t(std::ceil(
      double(index_t{1} << 30) / token_bytes / double(batch) / double(D))) * D));
  const cost_estimate costs = costs_for<Preset>(cx, pool, batch, cost_len, o.threads);
  double hbm_cost = hbm_gbps > 0 ? token_bytes / (hbm_gbps * 1e9) : 1e-12;
  std::string hbm_cost_source = "token bytes / the same-run HBM read rate";
  // the resident kernels' own H: the policy's cost of an HBM token must be that of the path it runs on
  double hbm_cost_rk = hbm_cost;
  std::string hbm_cost_rk_source = hbm_cost_source;
  for (index_t L : lengths) {
    if (cx.skip("hbm " + name + " L " + std::to_string(L))) return;
    const double fill = double(L) * double(batch) / double(cap_tokens);
    progress(cx.bud, "hbm %s batch %d L %lld (%.2f of the region): ceilings", name.c_str(), batch,
             static_cast<long long>(L), fill);
    const ceiling_result ce = cx.ceil->measure(o.threads);
    rig_config rc;
    rc.batch = batch;
    rc.layers = layers;
    rc.max_prompt = L;
    rc.max_decode_steps = o.warmup + o.steps + 64;
    rc.cpu_threads = o.threads;
    rc.seed = o.seed * 1000003 + 7;
    rc.first_chunk_bytes = index_t(o.first_chunk_mib * 1048576.0);
    json row{{"preset", name}, {"batch", batch}, {"tokens_per_sequence", L}, {"layers", layers},
             {"region_tokens_per_layer", cap_tokens}, {"region_gib", o.hbm_gib}, {"fill", fill},
             {"threads", o.threads}, {"ceilings", ce.to_json()}, {"hbm_read_gbps", hbm_gbps},
             {"costs", costs_json(costs)}, {"H_ns_per_token", hbm_cost * 1e9}, {"H_source", hbm_cost_source}};
    auto timed = [&](index_t region_tokens, double H, bool resident_kernel = false, bool all_gpu_steps = true,
                     bool caller_stream_steps = true) {
#if WS_BENCH_CUDA
      cx.be->set_resident_kernel(resident_kernel);
      cx.be->set_caller_stream_steps(caller_stream_steps);
#else
      (void)resident_kernel;  // refused at parsing on the host build
      (void)caller_stream_steps;  // the host backend has one stream
#endif
      rig_config c = rc;
      c.hbm_capacity_tokens = region_tokens;
      c.all_gpu_steps = all_gpu_steps;
      ws::roofline_params p = online_params(costs.params, o.window);
      p.hbm_cost_per_token_seconds = H;
      rig<Preset, ws::roofline_policy> r(*cx.be, c, ws::roofline_policy(p), pool);
      r.admit(L);
      if (o.warmup > 0) r.decode(o.warmup);
      const decode_stats s = r.decode(o.steps);
      json j = stats_json(r, s);
      const double spilled = r.spilled_bytes_per_layer(), hbm = r.hbm_bytes_per_layer();
      const double device_bytes = hbm + r.window_bytes_per_layer();
      const double host = spilled - hbm;
      const double hbm_ms = hbm_gbps > 0 ? device_bytes / (hbm_gbps * 1e9) * 1e3 : 0.0;
      const double host_ms = ce.concurrent_gbps() > 0 ? host / (ce.concurrent_gbps() * 1e9) * 1e3 : 0.0;
      j["resident_tokens"] = s.resident_tokens;
      j["hbm_mib"] = hbm / 1048576.0;
      j["host_mib"] = host / 1048576.0;
      j["device_kv_gbps"] = s.step_ms_median > 0 ? device_bytes / (s.step_ms_median * 1e-3) / 1e9 : 0.0;
      j["hbm_bound_ms"] = hbm_ms;
      j["host_bound_ms"] = host_ms;
      j["bound_ms"] = std::max(hbm_ms, host_ms);
      j["ratio_to_bound"] = s.step_ms_median > 0 ? std::max(hbm_ms, host_ms) / s.step_ms_median : 0.0;
      j["roofline"] = policy_state(r.policy(), r.cache());
      return j;
    };
    json hb = timed(cap_tokens, hbm_cost);
    const double hbm_frac = hb["spilled_mib"].get<double>() > 0
                                ? hb["hbm_mib"].get<double>() / hb["spilled_mib"].get<double>() : 1.0;
    if (hbm_frac > 0.999 && hb["resident_tokens"].get<index_t>() > 0 && L >= index_t(8) * D) {
      // every placed token is resident: H = the step's time per resident token
      hbm_cost = hb["step_ms"].get<double>() * 1e-3 / double(hb["resident_tokens"].get<index_t>());
      hbm_cost_source = "measured: step / resident tokens at " + std::to_string(L) + " tokens per sequence";
    }
    row["with_hbm"] = hb;
    std::string compare = "";
    std::string fixed_cost_note;
    if (L == lengths.front()) {
      // the small row once more with the CPU side in every step (the ablation of the all-GPU step),
      // then the default once more (an order check: A, B, A)
      json cs = timed(cap_tokens, hbm_cost, false, false);
      json two = timed(cap_tokens, hbm_cost, false, true, false);  // all-GPU on the engine's two streams
      json again = timed(cap_tokens, hbm_cost);
      char buf[224];
      std::snprintf(buf, sizeof buf,
                    "  (every step with a CPU side: %.3f ms; all-GPU on two streams: %.3f ms; all-GPU again after "
                    "them: %.3f ms)",
                    cs["step_ms"].get<double>(), two["step_ms"].get<double>(), again["step_ms"].get<double>());
      fixed_cost_note = buf;
      row["with_hbm_cpu_side"] = std::move(cs);
      row["with_hbm_two_streams"] = std::move(two);
      row["with_hbm_again"] = std::move(again);
    }
    if (o.hbm_resident_kernel) {
      json rk = timed(cap_tokens, hbm_cost_rk, true);
#if WS_BENCH_CUDA
      cx.be->set_resident_kernel(false);
#endif
      rk["H_ns_per_token"] = hbm_cost_rk * 1e9;
      rk["H_source"] = hbm_cost_rk_source;
      const double rk_frac = rk["spilled_mib"].get<double>() > 0
                                 ? rk["hbm_mib"].get<double>() / rk["spilled_mib"].get<double>() : 1.0;
      if (rk_frac > 0.999 && rk["resident_tokens"].get<index_t>() > 0 && L >= index_t(8) * D) {
        hbm_cost_rk = rk["step_ms"].get<double>() * 1e-3 / double(rk["resident_tokens"].get<index_t>());
        hbm_cost_rk_source = "measured on the resident kernels: step / resident tokens at " + std::to_string(L) +
                             " tokens per sequence";
      }
      char buf[64];
      std::snprintf(buf, sizeof buf, " %9.3f %6.3f", rk["step_ms"].get<double>(), rk["ratio_to_bound"].get<double>());
      compare += buf;
      row["with_hbm_resident_kernel"] = std::move(rk);
    }
    if (o.hbm_compare) {
      json off = timed(0, 0.0);
      row["without_hbm"] = off;
      row["speedup"] = hb["step_ms"].get<double>() > 0 ? off["step_ms"].get<double>() / hb["step_ms"].get<double>() : 0.0;
      char buf[64];
      std::snprintf(buf, sizeof buf, " %9.3f %7.2f", off["step_ms"].get<double>(), row["speedup"].get<double>());
      compare += buf;
    }
    if (!o.hbm_sweep.empty() && hb["host_mib"].get<double>() > 0) {
      // the three-way rule against its swept optimum: the same region, fixed host shares
      json sweep = json::array();
      std::size_t best = 0;
      for (double share : o.hbm_sweep) {
        if (cx.skip("hbm sweep")) break;
        rig_config c = rc;
        c.hbm_capacity_tokens = cap_tokens;
        rig<Preset, ws::fixed_ratio> r(*cx.be, c, ws::fixed_ratio(share), pool);
        r.admit(L);
        if (o.warmup > 0) r.decode(o.warmup);
        json j = stats_json(r, r.decode(o.steps));
        j["fixed_share"] = share;
        sweep.push_back(std::move(j));
        if (sweep.back()["step_ms"].get<double>() < sweep[best]["step_ms"].get<double>()) best = sweep.size() - 1;
      }
      if (!sweep.empty()) {
        const json& b = sweep[best];
        row["best_share"] = b["fixed_share"];
        row["best_step_ms"] = b["step_ms"];
        row["deployed_over_best"] = hb["step_ms"].get<double>() / b["step_ms"].get<double>();
        char buf[96];
        std::snprintf(buf, sizeof buf, "  r %.3f vs r_opt %.2f: x%.3f", hb["cpu_share"].get<double>(),
                      b["fixed_share"].get<double>(), row["deployed_over_best"].get<double>());
        compare += buf;
      }
      row["sweep"] = std::move(sweep);
    }
    progress(cx.bud, "  %.3f ms/layer, HBM %.0f MiB + host %.0f MiB, bound %.3f ms: %.2f of it", hb["step_ms"].get<double>(),
             hb["hbm_mib"].get<double>(), hb["host_mib"].get<double>(), hb["bound_ms"].get<double>(),
             hb["ratio_to_bound"].get<double>());
    std::printf("%-17s %5d %7lld %5.2f %8.0f %8.0f %9.3f %9.3f %8.1f %6.3f%s\n", name.c_str(), batch,
                static_cast<long long>(L), fill, hb["hbm_mib"].get<double>(), hb["host_mib"].get<double>(),
                hb["step_ms"].get<double>(), hb["bound_ms"].get<double>(), hb["device_kv_gbps"].get<double>(),
                hb["ratio_to_bound"].get<double>(), (compare + fixed_cost_note).c_str());
    std::fflush(stdout);
    cx.add("hbm", std::move(row));
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    ws::cpu::require_cpu_support();
    context cx{&o, budget(o.budget_seconds), json_file(o.json_path), nullptr, nullptr};
    cx.out.doc["tool"] = "ws_bench";
    cx.out.doc["machine"] = machine_info(argc, argv);
    cx.out.doc["device"] = device_info();
    cx.out.doc["options"] = json{{"modes", o.modes},
                                 {"presets", o.presets},
                                 {"batch", o.batch},
                                 {"lengths", o.lengths},
                                 {"policies", o.policies},
                                 {"track_batch", o.track_batch},
                                 {"track_lengths", o.track_lengths},
                                 {"track_shares", o.track_shares},
                                 {"ablate_presets", o.ablate_presets},
                                 {"ablate_batch", o.ablate_batch},
                                 {"ablate_lengths", o.ablate_lengths},
                                 {"contend_preset", o.contend_preset},
                                 {"tenant_threads", o.tenant_threads},
                                 {"threads", o.threads},
                                 {"steps", o.steps},
                                 {"warmup", o.warmup},
                                 {"window", o.window},
                                 {"rotation_mib", o.rotation_mib},
                                 {"calibration", o.calibration},
                                 {"hbm_presets", o.hbm_presets},
                                 {"hbm_gib", o.hbm_gib},
                                 {"hbm_batch", o.hbm_batch},
                                 {"hbm_fill", o.hbm_fill},
                                 {"hbm_small_length", o.hbm_small_length},
                                 {"hbm_compare", o.hbm_compare},
                                 {"hbm_resident_kernel", o.hbm_resident_kernel},
                                 {"hbm_sweep", o.hbm_sweep}};
    cx.out.doc["units"] = json{{"step_ms", "one layer's attention: median decode step (append + step per layer, flush, "
                                           "sync) divided by its layers"},
                               {"kv_gbps", "spilled KV bytes of one layer (both host regions) per step_ms"},
                               {"ceiling_ms", "spilled bytes / (concurrent H2D + concurrent CPU read GB/s), same run"},
                               {"ratio_to_ceiling", "ceiling_ms / step_ms (1 = the physical limit)"},
                               {"normalized_throughput", "full system step_ms / arm step_ms"},
                               {"hbm.bound_ms", "max(HBM-resident + D-window bytes / hbm_read_gbps, host bytes / "
                                                "concurrent_total_gbps), one layer, same run"},
                               {"hbm.ratio_to_bound", "bound_ms / step_ms (1 = the physical limit)"},
                               {"hbm.device_kv_gbps", "HBM-resident + D-window bytes of one layer per step_ms"},
                               {"hbm.speedup", "step_ms with the region disabled / step_ms with it"},
                               {"hbm.with_hbm_resident_kernel", "the same row with the split-K resident kernels "
                                                                "(set_resident_kernel)"},
                               {"hbm.with_hbm_cpu_side", "the first (small) row with "
                                                         "attention_options::all_gpu_steps off: the CPU side in "
                                                         "every step"},
                               {"hbm.with_hbm_two_streams", "the first row's all-GPU steps with "
                                                            "set_caller_stream_steps off: on the engine's "
                                                            "compute and copy streams, events between them"},
                               {"hbm.with_hbm_again", "the first row's default run repeated after "
                                                      "with_hbm_cpu_side and with_hbm_two_streams (an order "
                                                      "check)"},
                               {"hbm.deployed_over_best", "the roofline's step_ms / the best swept fixed share's "
                                                          "(--hbm-sweep; 1 = the sweep's optimum)"}};
    for (const char* s : {"policies", "track", "ablate", "contend", "hbm"}) cx.out.doc[s] = json::array();
    cx.out.write();

    backend_t be;
    cx.be = &be;
    ceilings ceil(index_t(o.ceiling_mib * 1048576.0), index_t{1} << 30);
    cx.ceil = &ceil;
    progress(cx.bud, "ws_bench: %s; modes:%s", cx.out.doc["device"]["gpu"].get<std::string>().c_str(),
             [&] {
               std::string m;
               for (const auto& x : o.modes) m += " " + x;
               return m;
             }()
                 .c_str());
    if (o.has_mode("policies")) {
      std::printf("%-17s %5s %6s %-10s %6s %9s %9s %8s %7s\n", "preset", "batch", "L", "policy", "share", "step ms",
                  "ceil ms", "GB/s", "ratio");
      for (const auto& p : o.presets) with_preset(p, [&](auto preset) { run_policies<decltype(preset)>(cx); });
    }
    if (o.has_mode("track"))
      for (const auto& p : o.presets) with_preset(p, [&](auto preset) { run_track<decltype(preset)>(cx); });
    if (o.has_mode("ablate"))
      for (const auto& p : o.ablate_presets) with_preset(p, [&](auto preset) { run_ablate<decltype(preset)>(cx); });
    if (o.has_mode("contend"))
      with_preset(o.contend_preset, [&](auto preset) { run_contend<decltype(preset)>(cx); });
    if (o.has_mode("hbm")) {
#if WS_BENCH_CUDA
      const double hbm_gbps = hbm_read_gbps(std::size_t{4} << 30, 5);
#else
      const double hbm_gbps = 0.0;  // the emulated device has no HBM: bounds are host-only
#endif
      cx.out.doc["hbm_read_gbps"] = hbm_gbps;
      progress(cx.bud, "hbm: device read rate %.1f GB/s (cub::DeviceReduce::Sum over 4 GiB)", hbm_gbps);
      std::printf("%-17s %5s %7s %5s %8s %8s %9s %9s %8s %6s%s\n", "preset", "batch", "L", "fill", "HBM MiB",
                  "host MiB", "step ms", "bound ms", "dev GB/s", "ratio",
                  (std::string(o.hbm_resident_kernel ? "  split-K ms  ratio" : "") +
                   (o.hbm_compare ? "    off ms speedup" : "")).c_str());
      for (const auto& p : o.hbm_presets) with_preset(p, [&](auto preset) { run_hbm<decltype(preset)>(cx, hbm_gbps); });
    }
    cx.out.doc["complete"] = cx.complete;
    cx.out.doc["elapsed_seconds"] = cx.bud.elapsed();
    cx.out.write();
    progress(cx.bud, "done%s", cx.complete ? "" : " (budget cut some rows)");
    return 0;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "ws_bench: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ws_bench: error: %s\n", e.what());
    return 3;
  }
}
