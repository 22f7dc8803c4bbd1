// SPDX-License-Identifier: Apache-2.0
// bench/calibrate.cpp — roofline calibration of this machine in a few minutes
// (paper §5.3): for every model preset × batch size it runs real decode steps of
// hybrid_attention over an inplace_kv_cache at several sequence lengths and fits
// eq. 1 to what the online loop itself measures (the policy's cost samples):
//
//   T_CPU = A·tokens_CPU + C_CPU        T_GPU = B·tokens_streamed + C_GPU
//
// A: CPU engine seconds per KV token (its thread count matters: pass the one you
// will run with); B: GPU side (pinned H2D + attention) seconds per streamed
// token; C_CPU, C_GPU: fixed per-step costs (Δ = C_GPU − C_CPU). The default
// split runs both engines at once (a fixed CPU share of 0.5), so A and B are
// measured under the memory-bandwidth contention they will see in use;
// --split separate measures each engine alone (cpu_only / gpu_only).
//
// Output: --out FILE, the calibration file that writescope/calibration.hpp
// loads (load_roofline_params(path, preset, batch)); --json FILE, the full
// report (machine, every point, the fits) for bench/plot.py. Progress on
// stderr, a table on stdout. Built against cuda_backend as `calibrate`, and
// against the emulated host backend as `calibrate_host` (CI smoke test only:
// its numbers describe no GPU).
#include "bench_rig.hpp"

#include <map>

namespace {

using namespace wsb;

constexpr const char* usage_text = R"(calibrate — per-token costs A, B and fixed costs C_CPU, C_GPU of the roofline policy

  --presets LIST      qwen3,mixtral,dsv2 (default: all three)
  --batch LIST        sequences per step (default 4,16)
  --lengths LIST      tokens per sequence, multiples of 256 (default 1K,2K,4K,8K,16K)
  --threads N         CPU engine threads: the count you will run with (default cores-1)
  --split MODE        concurrent (default: CPU share 0.5, both engines at once) or
                      separate (cpu_only and gpu_only runs)
  --rotation-mib N    KV read per decode step at least (adds layers; default 640)
  --min-time S        timed seconds per point (default 0.2)
  --min-steps N       timed decode steps per point at least (default 3)
  --first-chunk-mib N first ping-pong fill of a step (the ramp; 0, the default: none)
  --split-blocks N    blocks per GPU partial (partition_spec::gpu_split_blocks; default 4)
  --block-tokens N    tokens per KV block (default 64); give the decoder's, since K (the host's
                      enqueue per streamed token) is a cost per block and split
  --out FILE          the calibration file (writescope/calibration.hpp format)
  --json FILE         full report for bench/plot.py (rewritten after every point)
  --budget-seconds S  stop starting new points after S seconds (0: none)
  --seed N            (default 1)
  --help

Example (GPU machine, ~25 s):  calibrate --out cal.json --json calibrate.json --budget-seconds 60
)";

struct options {
  std::vector<std::string> presets{"qwen3", "mixtral", "dsv2"};
  std::vector<int> batch{4, 16};
  std::vector<index_t> lengths{1024, 2048, 4096, 8192, 16384};
  int threads = default_threads();
  std::string split = "concurrent";
  double rotation_mib = 640;
  double min_time = 0.2;
  int min_steps = 3;
  double first_chunk_mib = 0;
  int split_blocks = 4;
  int block_tokens = 64;
  std::string out, json_path;
  double budget_seconds = 0;
  std::uint64_t seed = 1;
};

options parse(int argc, char** argv) {
  options o;
  arg_reader a(argc, argv);
  while (a.next()) {
    const std::string& f = a.flag();
    if (f == "--help" || f == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    } else if (f == "--presets") {
      o.presets.clear();
      for (const auto& p : split_list(a.value())) o.presets.push_back(canonical_preset(p));
    } else if (f == "--batch") {
      o.batch = parse_list<int>(f, a.value());
    } else if (f == "--lengths") {
      o.lengths = parse_list<index_t>(f, a.value());
    } else if (f == "--threads") {
      o.threads = parse_number<int>(f, a.value());
    } else if (f == "--split") {
      o.split = a.value();
      if (o.split != "concurrent" && o.split != "separate") throw usage_error("--split: concurrent or separate");
    } else if (f == "--rotation-mib") {
      o.rotation_mib = parse_number<double>(f, a.value());
    } else if (f == "--min-time") {
      o.min_time = parse_number<double>(f, a.value());
    } else if (f == "--min-steps") {
      o.min_steps = parse_number<int>(f, a.value());
    } else if (f == "--first-chunk-mib") {
      o.first_chunk_mib = parse_number<double>(f, a.value());
      if (!(o.first_chunk_mib >= 0)) throw usage_error("--first-chunk-mib must be >= 0");
    } else if (f == "--split-blocks") {
      o.split_blocks = parse_number<int>(f, a.value());
      if (o.split_blocks < 1) throw usage_error("--split-blocks must be >= 1");
    } else if (f == "--block-tokens") {
      o.block_tokens = parse_number<int>(f, a.value());
      if (o.block_tokens < 1 || 256 % o.block_tokens != 0)
        throw usage_error("--block-tokens " + std::to_string(o.block_tokens) + " must divide 256 (the D-window)");
    } else if (f == "--out") {
      o.out = a.value();
    } else if (f == "--json") {
      o.json_path = a.value();
    } else if (f == "--budget-seconds") {
      o.budget_seconds = parse_number<double>(f, a.value());
    } else if (f == "--seed") {
      o.seed = parse_number<std::uint64_t>(f, a.value());
    } else {
      throw usage_error("unknown flag '" + f + "' (--help lists them)");
    }
  }
  for (int b : o.batch)
    if (b < 1) throw usage_error("--batch: values must be >= 1");
  for (index_t l : o.lengths)
    if (l < 256 || l % 256 != 0) throw usage_error("--lengths: " + std::to_string(l) + " is not a positive multiple of 256 (D)");
  if (o.lengths.size() < 2) throw usage_error("--lengths: the fit needs at least two lengths");
  if (o.threads < 1) throw usage_error("--threads must be >= 1");
  if (o.min_steps < 1 || o.min_time <= 0) throw usage_error("--min-steps / --min-time must be positive");
  return o;
}

/// The measurements of one engine at one length.
struct point {
  index_t tokens_per_sequence = 0;
  double tokens = 0;   // median tokens per layer-step
  double seconds = 0;  // median seconds per layer-step
  int samples = 0;
};

struct engine_points {
  std::vector<point> cpu, gpu;
  std::vector<point> launch;  ///< host enqueue seconds of the GPU side (asynchronous engines only)
};

/// Runs a rig with `policy` at length L and appends its median CPU and/or GPU samples.
template <class Preset, class Policy>
void measure_length(backend_t& be, const options& o, const kv_pool<typename Preset::layout_type>& pool, int batch,
                    index_t L, Policy policy, bool want_cpu, bool want_gpu, engine_points& pts, json& rows) {
  rig_config rc;
  rc.batch = batch;
  rc.max_prompt = L;
  rc.max_decode_steps = 256;
  rc.cpu_threads = o.threads;
  rc.first_chunk_bytes = index_t(o.first_chunk_mib * 1048576.0);
  rc.gpu_split_blocks = o.split_blocks;
  rc.block_tokens = o.block_tokens;
  rc.seed = o.seed + std::uint64_t(L) * 7 + std::uint64_t(batch);
  rc.layers = rotation_layers(index_t(batch) * L * Preset::layout().token_bytes(), o.rotation_mib * 1048576.0);
  rig<Preset, Policy> r(be, rc, std::move(policy), pool);
  r.admit(L);
  r.decode(2);  // warm-up: OpenMP team, first-touch, GPU clocks
  const decode_stats probe = r.decode(1);
  const double per_step = std::max(1e-6, probe.step_seconds.empty() ? 1e-3 : probe.step_seconds[0]);
  const int steps = std::clamp(int(std::ceil(o.min_time / per_step)), o.min_steps, 256 - 3);
  r.samples().clear();
  const decode_stats st = r.decode(steps, true);
  std::vector<double> cs, ct, gs, gt, ls, lt;
  for (const ws::cost_sample& s : r.samples()) {
    if (s.launch_streamed_tokens > 0) {
      ls.push_back(s.launch_seconds);
      lt.push_back(double(s.launch_streamed_tokens));
    }
    if (s.cpu_tokens > 0) {
      cs.push_back(s.cpu_seconds);
      ct.push_back(double(s.cpu_tokens));
    }
    if (s.gpu_streamed_tokens > 0) {
      gs.push_back(s.gpu_seconds);
      gt.push_back(double(s.gpu_streamed_tokens));
    }
  }
  json row{{"preset", std::string(Preset::name)}, {"batch", batch},      {"tokens_per_sequence", L},
           {"layers", rc.layers},                 {"steps", steps},      {"cpu_share", r.cpu_share()},
           {"step_ms_per_layer", st.step_ms_median}};
  if (want_cpu && !cs.empty()) {
    pts.cpu.push_back({L, median(ct), median(cs), int(cs.size())});
    row["cpu_tokens"] = median(ct);
    row["cpu_seconds"] = median(cs);
    row["cpu_ns_per_token"] = median(cs) / median(ct) * 1e9;
  }
  if (want_gpu && !ls.empty()) {
    pts.launch.push_back({L, median(lt), median(ls), int(ls.size())});
    row["launch_seconds"] = median(ls);
    row["launch_ns_per_token"] = median(ls) / median(lt) * 1e9;
  }
  if (want_gpu && !gs.empty()) {
    pts.gpu.push_back({L, median(gt), median(gs), int(gs.size())});
    row["gpu_tokens"] = median(gt);
    row["gpu_seconds"] = median(gs);
    row["gpu_ns_per_token"] = median(gs) / median(gt) * 1e9;
  }
  rows.push_back(std::move(row));
}

/// A, C from the points of one engine: least squares over lengths; a ratio at
/// the longest length when the fit is unusable (slope <= 0: noise).
ws::linear_fit fit_engine(const std::vector<point>& pts, const char* what, const budget& b) {
  std::vector<double> x, y;
  for (const point& p : pts) {
    x.push_back(p.tokens);
    y.push_back(p.seconds);
  }
  if (pts.empty()) throw std::runtime_error(std::string("no ") + what + " samples");
  ws::linear_fit f;
  bool ok = false;
  if (pts.size() >= 2) {
    try {
      f = ws::fit_line(x, y);
      ok = f.slope > 0 && std::isfinite(f.slope);
    } catch (const ws::config_error&) {
    }
  }
  if (!ok) {
    const point& last = pts.back();
    progress(b, "  %s: fit unusable (slope %g), falling back to the ratio at the longest length", what, f.slope);
    f.slope = last.seconds / last.tokens;
    f.intercept = 0;
    f.r2 = 0;
    f.n = int(pts.size());
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    ws::cpu::require_cpu_support();
    budget bud(o.budget_seconds);
    json_file report(o.json_path);
    report.doc["tool"] = "calibrate";
    report.doc["machine"] = machine_info(argc, argv);
    report.doc["device"] = device_info();
    report.doc["options"] = json{{"presets", o.presets},
                                 {"batch", o.batch},
                                 {"lengths", o.lengths},
                                 {"threads", o.threads},
                                 {"split", o.split},
                                 {"block_tokens", o.block_tokens},
                                 {"split_blocks", o.split_blocks},
                                 {"rotation_mib", o.rotation_mib},
                                 {"min_time", o.min_time},
                                 {"min_steps", o.min_steps}};
    report.doc["points"] = json::array();
    report.doc["entries"] = json::array();
    report.write();

    ws::calibration cal;
    cal.device = report.doc["device"]["gpu"].get<std::string>();
    cal.cpu = report.doc["machine"]["cpu_model"].get<std::string>();
    cal.date_utc = utc_now();
    cal.command = command_line(argc, argv);

    backend_t be;
    progress(bud, "calibrate: %s, %d CPU engine threads, split %s", cal.device.c_str(), o.threads, o.split.c_str());
    std::printf("%-17s %5s %4s %10s %10s %9s %9s %9s %7s %6s %6s\n", "preset", "batch", "thr", "A ns/tok", "B ns/tok",
                "K ns/tok", "C_CPU us", "C_GPU us", "share", "r2 A", "r2 B");
    bool complete = true;
    for (const std::string& key : o.presets) {
      with_preset(key, [&](auto preset) {
        using P = decltype(preset);
        const auto lay = P::layout();
        index_t max_len = 0;
        for (index_t l : o.lengths) max_len = std::max(max_len, l);
        const kv_pool<typename P::layout_type> pool(lay, max_len, o.seed);
        for (int batch : o.batch) {
          if (bud.spent()) {
            complete = false;
            progress(bud, "budget spent: skipping %s batch %d", std::string(P::name).c_str(), batch);
            continue;
          }
          engine_points pts;
          for (index_t L : o.lengths) {
            if (bud.spent()) {
              complete = false;
              break;
            }
            progress(bud, "%s batch %d L %lld", std::string(P::name).c_str(), batch, static_cast<long long>(L));
            json& rows = report.doc["points"];
            if (o.split == "concurrent") {
              measure_length<P>(be, o, pool, batch, L, ws::fixed_ratio(0.5), true, true, pts, rows);
            } else {
              measure_length<P>(be, o, pool, batch, L, ws::cpu_only{}, true, false, pts, rows);
              measure_length<P>(be, o, pool, batch, L, ws::gpu_only{}, false, true, pts, rows);
            }
            report.write();
          }
          if (pts.cpu.size() < 2 || pts.gpu.size() < 2) {
            progress(bud, "%s batch %d: too few points for a fit, no entry", std::string(P::name).c_str(), batch);
            complete = false;
            continue;
          }
          const ws::linear_fit fa = fit_engine(pts.cpu, "A", bud);
          const ws::linear_fit fb = fit_engine(pts.gpu, "B", bud);
          ws::calibration_entry e;
          e.preset = std::string(P::name);
          e.batch = batch;
          e.cpu_threads = o.threads;
          e.cpu_cost_per_token_seconds = fa.slope;
          e.gpu_cost_per_token_seconds = fb.slope;
          e.cpu_fixed_seconds = fa.intercept;
          e.gpu_fixed_seconds = fb.intercept;
          // K: the enqueue's slope over the streamed tokens (its intercept, the
          // per-step part, is left out); none from a synchronous engine.
          double k_fit = 0.0;
          if (pts.launch.size() >= 2) k_fit = std::max(0.0, fit_engine(pts.launch, "K", bud).slope);
          e.launch_cost_per_token_seconds = k_fit;
          e.block_tokens = o.block_tokens;
          e.gpu_split_blocks = o.split_blocks;
          for (const point& p : pts.cpu) e.points.push_back({"cpu", p.tokens_per_sequence, index_t(p.tokens), p.seconds});
          for (const point& p : pts.gpu) e.points.push_back({"gpu", p.tokens_per_sequence, index_t(p.tokens), p.seconds});
          cal.entries.push_back(e);
          json ej = ws::to_json(cal)["entries"].back();
          ej["r2_cpu"] = fa.r2;
          ej["r2_gpu"] = fb.r2;
          ej["bytes_per_token"] = lay.token_bytes();
          ej["cpu_gbps_marginal"] = double(lay.token_bytes()) / fa.slope / 1e9;
          ej["gpu_gbps_marginal"] = double(lay.token_bytes()) / fb.slope / 1e9;
          report.doc["entries"].push_back(ej);
          report.write();
          if (!o.out.empty()) ws::save_calibration(o.out, cal);  // after every entry: a cut run keeps what it has
          std::printf("%-17s %5d %4d %10.4f %10.4f %9.4f %9.2f %9.2f %7.3f %6.3f %6.3f\n", e.preset.c_str(), batch,
                      o.threads, fa.slope * 1e9, fb.slope * 1e9, k_fit * 1e9, fa.intercept * 1e6, fb.intercept * 1e6,
                      e.converged_share(), fa.r2, fb.r2);
          std::fflush(stdout);
        }
      });
    }
    report.doc["complete"] = complete;
    report.doc["elapsed_seconds"] = bud.elapsed();
    report.write();
    if (!o.out.empty()) ws::save_calibration(o.out, cal);
    progress(bud, "done: %zu entries%s%s", cal.entries.size(), o.out.empty() ? "" : ", calibration in ", o.out.c_str());
    return cal.entries.empty() ? 1 : 0;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "calibrate: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "calibrate: error: %s\n", e.what());
    return 3;
  }
}
