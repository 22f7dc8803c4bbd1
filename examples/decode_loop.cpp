// SPDX-License-Identifier: Apache-2.0
// examples/decode_loop.cpp — an engine-shaped decode loop over a split KV cache,
// on the host backend (no GPU needed), checked against an fp64 reference.
//
// What it does, in the order an inference engine would:
//   1. builds an inplace_kv_cache for a model-shaped attention config (Qwen3-30B-A3B
//      GQA 32/4 d128 by default; Mixtral-8x7B and DeepSeek-V2-Lite MLA too) with a
//      routing policy (the roofline policy of paper §5.3 by default, with
//      calibration numbers derived from the bandwidths in docs/BENCHMARKS.md, "Machine facts");
//   2. admits a ragged batch of sequences with prompts of different lengths:
//      each prompt's whole eviction batches are routed at write time, the rest
//      waits in the D-window;
//   3. runs decode steps: per layer, append one token per sequence, attend
//      (CPU engine on the unpinned blocks, emulated GPU engine on streamed pinned
//      blocks + D-window, merged by LSE); after the last layer, flush full
//      D-windows to the side the policy picks and pin one window ahead;
//      half way through, one sequence ends and a new one takes its blocks;
//   4. at sampled steps compares every (sequence, layer, head) with fp64
//      attention over its own copy of every token written, and exits non-zero
//      if any output or LSE is outside the bar.
//
// Run `decode_loop --help` for the options. Exit status: 0 agreement, 1
// disagreement, 2 bad command line, 3 a writescope error (message printed).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <writescope/reference.hpp>
#include <writescope/writescope.hpp>

namespace ws = writescope;

namespace {

// -----------------------------------------------------------------------------
// Command line
// -----------------------------------------------------------------------------

struct options {
  std::string model = "qwen3-30b-a3b";
  int layers = 2;
  std::vector<ws::index_t> prompts{1500, 700, 333, 2100};
  int steps = 600;
  int block_tokens = 64;
  int d_window = 256;
  std::string policy = "roofline";
  double cpu_share = 0.5;
  double cpu_gbps = 80.0;
  double pcie_gbps = 54.5;
  double cpu_fixed_us = 10.0;
  double gpu_fixed_us = 30.0;
  bool track_gpu_cost = false;
  int check_every = 50;
  int join_at = -1;  // -1: steps / 2
  ws::index_t join_prompt = 900;
  double ping_pong_mib = 4.0;
  int threads = 0;
  std::uint64_t seed = 2026;
  bool quiet = false;
};

constexpr const char* usage_text = R"(usage: decode_loop [options]

An example decode loop over an InplaceKVCache split between the CPU (unpinned
compute region, attended in place) and the GPU side (pinned load region
streamed through ping-pong buffers, plus the D-window), on the host backend,
checked against fp64 attention.

model and batch
  --model NAME          qwen3-30b-a3b (GQA 32/4, d 128), mixtral-8x7b (GQA 32/8,
                        d 128) or deepseek-v2-lite (MLA absorbed, 16 heads, 512+64)
                        [qwen3-30b-a3b]
  --layers N            attention layers sharing the cache [2]
  --prompts A,B,...     prompt lengths of the ragged batch [1500,700,333,2100]
  --steps N             decode steps [600]
  --join-at N           at step N the first sequence ends and a new one is admitted
                        in its blocks; -1 = steps/2, 0 = never [-1]
  --join-prompt N       prompt length of that new sequence [900]

cache
  --block N             tokens per block [64]
  --d-window N          D: D-window size and eviction batch, a multiple of --block [256]
  --ping-pong-mib X     size of one ping-pong buffer, MiB [4]

routing policy
  --policy NAME         roofline, fixed, gpu-only or cpu-only [roofline]
  --cpu-share R         CPU share of the fixed policy [0.5]
  --cpu-gbps X          roofline calibration: CPU engine's KV read rate, GB/s -> A [80]
  --pcie-gbps X         roofline calibration: pinned H2D rate, GB/s -> B [54.5]
  --cpu-fixed-us X      roofline calibration: C_CPU, fixed CPU cost per step, us [10]
  --gpu-fixed-us X      roofline calibration: C_GPU, fixed GPU cost per step, us [30]
  --track-gpu-cost      also re-estimate B online (A always is)

run
  --check-every N       compare with fp64 every N steps (and at the first and last) [50]
  --threads N           CPU engine threads, 0 = hardware threads - 1 [0]
  --seed N              seed of the random KV and queries [2026]
  --quiet               print only the summary
  --help                this text

Exit status: 0 agreement, 1 disagreement with the reference, 2 bad command
line, 3 a writescope error (printed).
)";

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class T>
T parse_number(std::string_view flag, const std::string& text) {
  try {
    std::size_t used = 0;
    T v{};
    if constexpr (std::same_as<T, double>)
      v = std::stod(text, &used);
    else if constexpr (std::same_as<T, std::uint64_t>)
      v = std::stoull(text, &used);
    else
      v = static_cast<T>(std::stoll(text, &used));
    if (used != text.size()) throw std::invalid_argument(text);
    return v;
  } catch (const std::logic_error&) {
    throw usage_error(std::string(flag) + ": '" + text + "' is not a number");
  }
}

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
    } else if (arg == "--quiet") {
      o.quiet = true;
    } else if (arg == "--track-gpu-cost") {
      o.track_gpu_cost = true;
    } else if (arg == "--model") {
      o.model = next();
    } else if (arg == "--layers") {
      o.layers = parse_number<int>(arg, next());
    } else if (arg == "--prompts") {
      o.prompts.clear();
      const std::string& list = next();
      std::size_t pos = 0;
      while (pos <= list.size()) {
        const std::size_t comma = std::min(list.find(',', pos), list.size());
        o.prompts.push_back(parse_number<ws::index_t>(arg, list.substr(pos, comma - pos)));
        pos = comma + 1;
      }
    } else if (arg == "--steps") {
      o.steps = parse_number<int>(arg, next());
    } else if (arg == "--join-at") {
      o.join_at = parse_number<int>(arg, next());
    } else if (arg == "--join-prompt") {
      o.join_prompt = parse_number<ws::index_t>(arg, next());
    } else if (arg == "--block") {
      o.block_tokens = parse_number<int>(arg, next());
    } else if (arg == "--d-window") {
      o.d_window = parse_number<int>(arg, next());
    } else if (arg == "--ping-pong-mib") {
      o.ping_pong_mib = parse_number<double>(arg, next());
    } else if (arg == "--policy") {
      o.policy = next();
    } else if (arg == "--cpu-share") {
      o.cpu_share = parse_number<double>(arg, next());
    } else if (arg == "--cpu-gbps") {
      o.cpu_gbps = parse_number<double>(arg, next());
    } else if (arg == "--pcie-gbps") {
      o.pcie_gbps = parse_number<double>(arg, next());
    } else if (arg == "--cpu-fixed-us") {
      o.cpu_fixed_us = parse_number<double>(arg, next());
    } else if (arg == "--gpu-fixed-us") {
      o.gpu_fixed_us = parse_number<double>(arg, next());
    } else if (arg == "--check-every") {
      o.check_every = parse_number<int>(arg, next());
    } else if (arg == "--threads") {
      o.threads = parse_number<int>(arg, next());
    } else if (arg == "--seed") {
      o.seed = parse_number<std::uint64_t>(arg, next());
    } else {
      throw usage_error("unknown option '" + arg + "' (try --help)");
    }
  }
  if (o.layers < 1) throw usage_error("--layers must be >= 1");
  if (o.prompts.empty()) throw usage_error("--prompts needs at least one length");
  for (ws::index_t p : o.prompts)
    if (p < 0) throw usage_error("--prompts: lengths must be >= 0");
  if (o.steps < 1) throw usage_error("--steps must be >= 1");
  if (o.check_every < 1) throw usage_error("--check-every must be >= 1");
  if (o.join_prompt < 0) throw usage_error("--join-prompt must be >= 0");
  if (o.join_at < 0) o.join_at = o.steps / 2;
  if (!(o.ping_pong_mib > 0)) throw usage_error("--ping-pong-mib must be > 0");
  if (!(o.cpu_gbps > 0) || !(o.pcie_gbps > 0)) throw usage_error("--cpu-gbps and --pcie-gbps must be > 0");
  return o;
}

// -----------------------------------------------------------------------------
// Small helpers
// -----------------------------------------------------------------------------

/// The share a policy steers toward at L placed tokens (for the report).
double target_of(const ws::roofline_policy& p, ws::index_t total_placed) { return p.target_share(total_placed); }
double target_of(const ws::fixed_ratio& p, ws::index_t) { return p.cpu_share(); }
double target_of(const ws::gpu_only&, ws::index_t) { return 0.0; }
double target_of(const ws::cpu_only&, ws::index_t) { return 1.0; }

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto k = static_cast<std::size_t>(std::lround(p * double(v.size() - 1)));
  return v[k];
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / double(v.size());
}

/// Worst disagreement of attention outputs with the fp64 reference.
struct agreement {
  double max_rel_l2 = 0.0;   ///< max over (sequence, head) of ||o - ref|| / ||ref||
  double max_lse_abs = 0.0;  ///< max |lse - ref|
  double max_lse_excess = -1.0;  ///< max |lse - ref| - (1e-3 + 1e-5 |ref|); <= 0 passes
  bool non_finite = false;
  int rows = 0;

  static constexpr double rel_l2_bar = 5e-3;
  [[nodiscard]] bool ok() const { return !non_finite && max_rel_l2 <= rel_l2_bar && max_lse_excess <= 0.0; }
  void add(const agreement& o) {
    max_rel_l2 = std::max(max_rel_l2, o.max_rel_l2);
    max_lse_abs = std::max(max_lse_abs, o.max_lse_abs);
    max_lse_excess = std::max(max_lse_excess, o.max_lse_excess);
    non_finite = non_finite || o.non_finite;
    rows += o.rows;
  }
};

void compare(int heads, int v_dim, const float* o, const float* lse, const std::vector<double>& ro,
             const std::vector<double>& rl, agreement& a) {
  for (int h = 0; h < heads; ++h) {
    double num = 0, den = 0;
    for (int i = 0; i < v_dim; ++i) {
      const double x = o[h * v_dim + i];
      const double r = ro[std::size_t(h * v_dim + i)];
      if (!std::isfinite(x)) a.non_finite = true;
      num += (x - r) * (x - r);
      den += r * r;
    }
    a.max_rel_l2 = std::max(a.max_rel_l2, den > 0 ? std::sqrt(num / den) : std::sqrt(num));
    const double ref = rl[std::size_t(h)];
    if (std::isnan(lse[h]) || lse[h] == INFINITY) a.non_finite = true;
    if (std::isinf(ref)) {  // empty sequence: LSE must be -inf too
      if (!(std::isinf(lse[h]) && lse[h] < 0)) a.max_lse_excess = std::max(a.max_lse_excess, 1.0);
    } else {
      const double err = std::abs(double(lse[h]) - ref);
      a.max_lse_abs = std::max(a.max_lse_abs, err);
      a.max_lse_excess = std::max(a.max_lse_excess, err - (1e-3 + 1e-5 * std::abs(ref)));
    }
    ++a.rows;
  }
}

std::string mib(ws::index_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / double(1 << 20));
  return buf;
}

// -----------------------------------------------------------------------------
// The loop
// -----------------------------------------------------------------------------

template <class Preset, ws::routing_policy Policy>
int run(const options& o, Policy policy) {
  using layout_t = typename Preset::layout_type;
  using cache_t = ws::inplace_kv_cache<layout_t, ws::host_backend, ws::pageable_allocator, Policy>;
  constexpr int P = layout_t::planes;
  constexpr int Q = layout_t::q_dim;
  constexpr int V = layout_t::v_dim;
  constexpr int R = layout_t::row_elems;

  const layout_t lay = Preset::layout();
  const int hq = lay.num_q_heads();
  const int hkv = lay.kv_heads();
  const double scale = Preset::softmax_scale();
  const int nseq = int(o.prompts.size());

  // Region capacities: room for every token this run can place, per layer.
  ws::index_t need = o.join_prompt;
  for (ws::index_t p : o.prompts) need += p;
  need += ws::index_t(nseq + 1) * (o.steps + o.d_window);

  ws::partition_spec spec;
  spec.num_layers = o.layers;
  spec.block_tokens = o.block_tokens;
  spec.d_window_tokens = o.d_window;
  spec.max_sequences = nseq;
  spec.cpu_capacity_tokens = need;
  spec.pinned_capacity_tokens = need;
  spec.pinned_initial_tokens = 0;  // pinned batch by batch, one window ahead (paper §4.3, §7.7)
  spec.ping_pong_bytes = ws::index_t(o.ping_pong_mib * double(1 << 20));
  // A GPU partial covers at most 16 blocks, and never more than one ping-pong buffer holds.
  spec.gpu_split_blocks = int(std::max<ws::index_t>(1, std::min<ws::index_t>(16, spec.ping_pong_blocks(lay))));

  ws::host_backend backend;
  cache_t cache(backend, lay, spec, std::move(policy));
  ws::hybrid_attention<cache_t> attention(cache, ws::attention_options{o.threads, false});
  const ws::block_format<layout_t>& fmt = cache.format();

  std::printf("writescope %d.%d.%d decode loop — %s, %s backend, CPU kernels for %s\n", WS_VERSION_MAJOR,
              WS_VERSION_MINOR, WS_VERSION_PATCH, std::string(Preset::name).c_str(),
              std::string(backend.name()).c_str(), ws::cpu::default_arch::name());
  if constexpr (layout_t::is_mla)
    std::printf("  layout     MLA absorbed, %d heads, row %d+%d = %lld bytes/token/layer\n", hq,
                layout_t::kv_lora_rank, layout_t::rope_dim, static_cast<long long>(lay.token_bytes()));
  else
    std::printf("  layout     GQA %d q / %d kv heads, head dim %d = %lld bytes/token/layer\n", hq, hkv,
                layout_t::head_dim, static_cast<long long>(lay.token_bytes()));
  std::printf("  cache      %d layers, block %d tokens (%s), D %d tokens, %d sequences, ping-pong %d x %lld blocks\n",
              o.layers, o.block_tokens, mib(fmt.block_bytes()).c_str(), o.d_window, nseq, spec.ping_pong_buffers,
              static_cast<long long>(spec.ping_pong_blocks(lay)));
  if constexpr (std::same_as<Policy, ws::roofline_policy>) {
    const ws::roofline_params& rp = cache.policy().params();
    std::printf("  policy     roofline: A %.3g s/token (CPU at %.1f GB/s), B %.3g s/token (H2D at %.1f GB/s),\n"
                "             C_CPU %.0f us, C_GPU %.0f us -> converged share p = B/(A+B) = %.3f; A tracked online%s\n",
                rp.cpu_cost_per_token_seconds, o.cpu_gbps, rp.gpu_cost_per_token_seconds, o.pcie_gbps,
                rp.cpu_fixed_seconds * 1e6, rp.gpu_fixed_seconds * 1e6, cache.policy().converged_share(),
                rp.track_gpu_cost ? ", B too" : "");
  } else {
    std::printf("  policy     %s (CPU share %.3f)\n", o.policy.c_str(), target_of(cache.policy(), 0));
  }
  std::printf("  threads    %d CPU engine thread(s) + 1 emulated GPU engine thread\n", attention.options().cpu_threads);

  // The reference's own copy of every token written: [sequence id][layer], token-major per plane.
  struct kv_record {
    std::array<std::vector<ws::bf16>, P> planes;
    ws::index_t tokens = 0;
  };
  std::vector<std::vector<kv_record>> history;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::array<std::vector<ws::bf16>, P> kv_buf;
  const ws::index_t token_elems = ws::index_t(hkv) * R;

  auto make_kv = [&](ws::index_t tokens) {
    typename cache_t::kv_input kv;
    for (int p = 0; p < P; ++p) {
      kv_buf[std::size_t(p)].resize(std::size_t(tokens * token_elems));
      for (ws::bf16& x : kv_buf[std::size_t(p)]) x = ws::bf16::from_float(normal(rng));
      kv.planes[std::size_t(p)] = kv_buf[std::size_t(p)].data();
    }
    kv.num_tokens = tokens;
    return kv;
  };
  auto record = [&](kv_record& r, ws::index_t first, ws::index_t count) {
    for (int p = 0; p < P; ++p) {
      const auto& src = kv_buf[std::size_t(p)];
      r.planes[std::size_t(p)].insert(r.planes[std::size_t(p)].end(), src.begin() + std::ptrdiff_t(first * token_elems),
                                      src.begin() + std::ptrdiff_t((first + count) * token_elems));
    }
    r.tokens += count;
  };
  auto share_of = [](const ws::sequence_state& st) {
    return st.placed_tokens > 0 ? double(st.cpu_placed_tokens) / double(st.placed_tokens) : 0.0;
  };

  auto admit = [&](ws::index_t prompt) {
    const ws::sequence_id id = cache.begin_sequence(prompt);
    if (std::size_t(id) >= history.size()) history.resize(std::size_t(id) + 1);
    history[std::size_t(id)].assign(std::size_t(o.layers), kv_record{});
    for (int l = 0; prompt > 0 && l < o.layers; ++l) {  // an empty prompt has nothing to write
      cache.append_prefill(l, id, make_kv(prompt));
      record(history[std::size_t(id)][std::size_t(l)], 0, prompt);
    }
    const ws::sequence_state& st = cache.sequence(id);
    if (!o.quiet)
      std::printf("admit  seq %d: prompt %5lld -> unpinned %5lld + pinned %5lld placed at write time, "
                  "%4lld in the D-window (target %.3f at L = %lld)\n",
                  id, static_cast<long long>(prompt), static_cast<long long>(st.cpu_placed_tokens),
                  static_cast<long long>(st.placed_tokens - st.cpu_placed_tokens),
                  static_cast<long long>(st.window_tokens[0]), target_of(cache.policy(), cache.total_placed_tokens()),
                  static_cast<long long>(cache.total_placed_tokens()));
    return id;
  };

  std::vector<ws::sequence_id> batch;
  for (ws::index_t p : o.prompts) batch.push_back(admit(p));
  const double admission_target = target_of(cache.policy(), cache.total_placed_tokens());

  // Per-step statistics.
  std::vector<double> step_ms, cpu_ms, gpu_ms, flush_ms;
  ws::index_t cpu_tokens = 0, streamed_tokens = 0, window_tokens = 0, copies = 0, chunks = 0;
  int cpu_batches = 0, gpu_batches = 0, pin_growths = 0;
  agreement total;
  int checked_steps = 0;
  bool failed = false;

  std::vector<float> q, out, lse;
  std::vector<double> ref_o, ref_lse;
  std::vector<ws::index_t> placed_before(static_cast<std::size_t>(nseq)), cpu_before(static_cast<std::size_t>(nseq));
  for (int step = 0; step < o.steps; ++step) {
    if (o.join_at > 0 && step == o.join_at) {
      const ws::sequence_id gone = batch[0];
      const ws::index_t len = cache.sequence(gone).total_tokens(0);
      cache.end_sequence(gone);  // its blocks and D-window slot return for in-place reuse
      if (!o.quiet) std::printf("end    seq %d after %lld tokens: blocks returned to the pools\n", gone,
                                static_cast<long long>(len));
      batch[0] = admit(o.join_prompt);
    }
    const bool check = step % o.check_every == 0 || step == o.steps - 1;
    agreement a;
    double t_step = 0, t_cpu = 0, t_gpu = 0;
    for (int l = 0; l < o.layers; ++l) {
      // The model produced one new token per sequence for this layer.
      cache.append(l, batch, make_kv(nseq));
      for (int i = 0; i < nseq; ++i) record(history[std::size_t(batch[std::size_t(i)])][std::size_t(l)], i, 1);

      q.resize(std::size_t(nseq) * std::size_t(hq) * Q);
      for (float& x : q) x = normal(rng);
      out.assign(std::size_t(nseq) * std::size_t(hq) * V, 0.0f);
      lse.assign(std::size_t(nseq) * std::size_t(hq), 0.0f);
      const ws::step_outputs<ws::pageable_host_space> so{ws::host_span<float>(out.data(), ws::index_t(out.size())),
                                                         ws::host_span<float>(lse.data(), ws::index_t(lse.size())),
                                                         nullptr};
      const ws::step_report rep =
          attention.step(l, batch, ws::host_span<const float>(q.data(), ws::index_t(q.size())), float(scale), so);
      t_step += rep.total_seconds;
      t_cpu += rep.cpu_seconds;
      t_gpu += rep.gpu_seconds;
      cpu_tokens += rep.cpu_tokens;
      streamed_tokens += rep.streamed_tokens;
      window_tokens += rep.window_tokens;
      copies += rep.copies;
      chunks += rep.chunks;

      if (check) {
        for (int i = 0; i < nseq; ++i) {
          const kv_record& h = history[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
          const float* qi = q.data() + std::size_t(i) * std::size_t(hq) * Q;
          ref_o.assign(std::size_t(hq) * V, 0.0);
          ref_lse.assign(std::size_t(hq), 0.0);
          if constexpr (layout_t::is_mla)
            ws::reference::mla_absorbed_decode(hq, layout_t::kv_lora_rank, layout_t::rope_dim, qi,
                                               h.planes[0].data(), h.tokens, scale, ref_o.data(), ref_lse.data());
          else
            ws::reference::gqa_decode(hq, hkv, layout_t::head_dim, qi, h.planes[0].data(), h.planes[1].data(),
                                      h.tokens, scale, ref_o.data(), ref_lse.data());
          compare(hq, V, out.data() + std::size_t(i) * std::size_t(hq) * V, lse.data() + std::size_t(i) * std::size_t(hq),
                  ref_o, ref_lse, a);
        }
      }
    }
    step_ms.push_back(t_step * 1e3);
    cpu_ms.push_back(t_cpu * 1e3);
    gpu_ms.push_back(t_gpu * 1e3);

    // After the last layer: evict full D-windows, then pin one window ahead.
    for (int i = 0; i < nseq; ++i) {
      const ws::sequence_state& st = cache.sequence(batch[std::size_t(i)]);
      placed_before[std::size_t(i)] = st.placed_tokens;
      cpu_before[std::size_t(i)] = st.cpu_placed_tokens;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const ws::flush_report fr = cache.flush();
    const ws::index_t pinned_cap = cache.usage().pinned_capacity_blocks;
    cache.reserve_pinned_blocks(ws::index_t(spec.window_blocks()) * nseq);
    flush_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (cache.usage().pinned_capacity_blocks > pinned_cap) ++pin_growths;
    cpu_batches += fr.cpu_batches;
    gpu_batches += fr.gpu_batches;
    for (int i = 0; fr.evicted_sequences > 0 && i < nseq; ++i) {
      const ws::sequence_state& st = cache.sequence(batch[std::size_t(i)]);
      if (st.placed_tokens == placed_before[std::size_t(i)]) continue;
      const bool to_cpu = st.cpu_placed_tokens > cpu_before[std::size_t(i)];
      if (!o.quiet)
        std::printf("evict  step %4d seq %d: %d tokens x %d layers -> %-26s share %.3f, target %.3f "
                    "(L = %lld placed)\n",
                    step, batch[std::size_t(i)], o.d_window, o.layers,
                    to_cpu ? "unpinned compute (CPU)" : "pinned load (GPU)", share_of(st),
                    target_of(cache.policy(), cache.total_placed_tokens()),
                    static_cast<long long>(cache.total_placed_tokens()));
    }

    if (check) {
      ++checked_steps;
      total.add(a);
      if (!a.ok()) failed = true;
      if (!o.quiet || !a.ok())
        std::printf("check  step %4d: max rel L2 %.2e, max |dLSE| %.2e over %d rows %s | step %.2f ms "
                    "(CPU engine %.2f, GPU engine %.2f)\n",
                    step, a.max_rel_l2, a.max_lse_abs, a.rows, a.ok() ? "ok" : "DISAGREES", t_step * 1e3,
                    t_cpu * 1e3, t_gpu * 1e3);
    }
  }

  // ---------------------------------------------------------------------------
  // Summary
  // ---------------------------------------------------------------------------
  const ws::region_usage u = cache.usage();
  ws::index_t in_window = 0;
  for (ws::sequence_id id : batch) in_window += cache.sequence(id).window_tokens[0];
  std::printf("\nplacement (per layer; every token lives in exactly one region)\n");
  std::printf("  unpinned compute region (CPU, in place)  %6lld tokens  %5lld / %5lld blocks  %s reserved\n",
              static_cast<long long>(u.cpu_used_blocks * o.block_tokens), static_cast<long long>(u.cpu_used_blocks),
              static_cast<long long>(u.cpu_capacity_blocks), mib(u.cpu_region_bytes).c_str());
  std::printf("  pinned load region (GPU, streamed)       %6lld tokens  %5lld / %5lld blocks  %s pinned "
              "(max %lld blocks, grown %d times)\n",
              static_cast<long long>(u.pinned_used_blocks * o.block_tokens),
              static_cast<long long>(u.pinned_used_blocks), static_cast<long long>(u.pinned_capacity_blocks),
              mib(u.pinned_region_bytes).c_str(), static_cast<long long>(u.pinned_max_blocks), pin_growths);
  std::printf("  D-window (GPU)                           %6lld tokens  %d slots x %d blocks      %s\n",
              static_cast<long long>(in_window), u.max_sequences, spec.window_blocks(), mib(u.d_window_bytes).c_str());
  std::printf("  ping-pong (GPU)                          %d buffers x %lld blocks            %s\n",
              spec.ping_pong_buffers, static_cast<long long>(spec.ping_pong_blocks(lay)), mib(u.ping_pong_bytes).c_str());

  const ws::index_t L = cache.total_placed_tokens();
  const double target = target_of(cache.policy(), L);
  std::printf("\nCPU share of placed tokens per sequence (target %.3f at L = %lld placed tokens)\n", target,
              static_cast<long long>(L));
  std::printf("  seq  prompt  length  placed  unpinned  pinned  window   share  |share-target|  D/length\n");
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const ws::sequence_state& st = cache.sequence(batch[i]);
    std::printf("  %3d  %6lld  %6lld  %6lld  %8lld  %6lld  %6d   %.3f  %14.3f  %8.3f\n", batch[i],
                static_cast<long long>(st.prompt_tokens), static_cast<long long>(st.total_tokens(0)),
                static_cast<long long>(st.placed_tokens), static_cast<long long>(st.cpu_placed_tokens),
                static_cast<long long>(st.placed_tokens - st.cpu_placed_tokens), st.window_tokens[0], share_of(st),
                std::abs(share_of(st) - target), double(o.d_window) / double(std::max<ws::index_t>(1, st.total_tokens(0))));
  }
  std::printf("  (placed tokens never move: a share approaches the target only through new eviction batches of D\n"
              "   tokens each, so it sits within about D/length of the target the batches were routed toward)\n");
  if constexpr (std::same_as<Policy, ws::roofline_policy>) {
    const ws::roofline_policy& rp = cache.policy();
    std::printf("  roofline: A calibrated %.3g s/token, online %.3g s/token on this machine; B %.3g s/token; "
                "p = B/(A+B) now %.3f\n",
                rp.params().cpu_cost_per_token_seconds, rp.cpu_cost_per_token_seconds(), rp.gpu_cost_per_token_seconds(),
                rp.converged_share());
    const double drift = rp.cpu_cost_per_token_seconds() / rp.params().cpu_cost_per_token_seconds;
    if (drift > 2.0 || drift < 0.5)
      std::printf("  note: the CPU engine measured %.1fx the calibrated A (the calibration is for another machine),\n"
                  "        so the target moved from %.3f at admission to %.3f; prompt batches placed at admission keep\n"
                  "        their region and only later batches follow the new target (--cpu-gbps sets the calibration)\n",
                  drift, admission_target, target);
  }

  std::printf("\nevictions during decode: %d batches -> unpinned compute (CPU), %d -> pinned load (GPU)\n", cpu_batches,
              gpu_batches);
  const double layer_steps = double(o.steps) * o.layers;
  std::printf("\nstep timing (%d steps x %d layers, reference checks excluded)\n", o.steps, o.layers);
  std::printf("  per step (all layers)  mean %.2f ms  p50 %.2f  p90 %.2f  max %.2f\n", mean(step_ms),
              percentile(step_ms, 0.5), percentile(step_ms, 0.9), percentile(step_ms, 1.0));
  std::printf("  CPU engine             mean %.2f ms per step, %.0f KV tokens per layer-step\n", mean(cpu_ms),
              double(cpu_tokens) / layer_steps);
  std::printf("  GPU engine (emulated)  mean %.2f ms per step, %.0f streamed + %.0f D-window tokens per layer-step, "
              "%.1f copies in %.1f ping-pong fills\n",
              mean(gpu_ms), double(streamed_tokens) / layer_steps, double(window_tokens) / layer_steps,
              double(copies) / layer_steps, double(chunks) / layer_steps);
  std::printf("  flush + pin ahead      mean %.3f ms per step\n", mean(flush_ms));

  std::printf("\nagreement with fp64 attention at %d sampled steps (%d rows): max rel L2 %.2e (bar %.0e), "
              "max |dLSE| %.2e (bar 1e-3 + 1e-5|LSE|)%s\n",
              checked_steps, total.rows, total.max_rel_l2, agreement::rel_l2_bar, total.max_lse_abs,
              total.non_finite ? ", NON-FINITE values seen" : "");
  std::printf("%s\n", failed ? "FAIL: the split cache disagrees with the reference" : "PASS");
  return failed ? 1 : 0;
}

template <class Preset>
int run_model(const options& o) {
  const double token_bytes = double(Preset::layout().token_bytes());
  if (o.policy == "roofline") {
    ws::roofline_params p;
    p.cpu_cost_per_token_seconds = token_bytes / (o.cpu_gbps * 1e9);
    p.gpu_cost_per_token_seconds = token_bytes / (o.pcie_gbps * 1e9);
    p.cpu_fixed_seconds = o.cpu_fixed_us * 1e-6;
    p.gpu_fixed_seconds = o.gpu_fixed_us * 1e-6;
    p.track_gpu_cost = o.track_gpu_cost;
    return run<Preset>(o, ws::roofline_policy(p));
  }
  if (o.policy == "fixed") return run<Preset>(o, ws::fixed_ratio(o.cpu_share));
  if (o.policy == "gpu-only") return run<Preset>(o, ws::gpu_only{});
  if (o.policy == "cpu-only") return run<Preset>(o, ws::cpu_only{});
  throw usage_error("--policy: unknown policy '" + o.policy + "' (roofline, fixed, gpu-only, cpu-only)");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    ws::cpu::require_cpu_support();
    if (o.model == "qwen3-30b-a3b") return run_model<ws::presets::qwen3_30b_a3b>(o);
    if (o.model == "mixtral-8x7b") return run_model<ws::presets::mixtral_8x7b>(o);
    if (o.model == "deepseek-v2-lite") return run_model<ws::presets::deepseek_v2_lite>(o);
    throw usage_error("--model: unknown model '" + o.model + "' (qwen3-30b-a3b, mixtral-8x7b, deepseek-v2-lite)");
  } catch (const usage_error& e) {
    std::fprintf(stderr, "decode_loop: %s\n", e.what());
    return 2;
  } catch (const ws::error& e) {
    std::fprintf(stderr, "decode_loop: writescope error: %s\n", e.what());
    return 3;
  }
}
