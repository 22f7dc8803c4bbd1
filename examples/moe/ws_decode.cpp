// SPDX-License-Identifier: Apache-2.0
// ws_decode — generate tokens with a Qwen3-MoE, DeepSeek-V2 or Mixtral model
// whose KV cache is split by writescope between the unpinned CPU region and the
// GPU side. --device cuda: the model on the GPU (bf16 weights, cuBLAS), the
// cache on cuda_backend; --device host: the host path (fp32 on the CPU, GPU
// side emulated by host_backend); --device emulated: the CUDA path's code run
// on the host (CI). Default: cuda when a CUDA device is present, else host.
//
//   ws_decode MODEL_DIR --prompt 1,2,3 --max-new-tokens 32 --policy roofline
//   ws_decode --random-weights --config config.json --batch 4 --prompt-len 64
//   ws_decode fixtures/qwen3_moe --expect fixtures/qwen3_moe/expected.json --policy gpu_only
//
// Exit status: 0 ok, 1 error (one line on stderr), 3 --expect mismatch, 77
// --skip-if-no-device without a CUDA device, other non-zero values:
// command-line errors (CLI11).
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#  include <omp.h>
#endif

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "ws_moe/checkpoint.hpp"
#include "ws_moe/gpu/device_run.hpp"
#include "ws_moe/model_config.hpp"
#include "ws_moe/report.hpp"
#include "ws_moe/roofline_init.hpp"
#include "ws_moe/run.hpp"

namespace fs = std::filesystem;
using namespace ws_moe;

namespace {

struct cli {
  std::string model_dir;
  std::string arch = "auto";
  bool random_weights = false;
  std::string config;
  int layers = 0;
  double max_host_weights_gib = 0.0;
  std::vector<std::string> prompts;
  std::string prompt_file;
  int batch = 0;
  std::string prompt_len = "16";
  int max_new_tokens = 32;
  double temperature = 0.0, top_p = 1.0;
  int top_k = 0;
  std::uint64_t seed = 0;
  bool stop_at_eos = false;
  std::vector<int> eos_token_ids;  // --eos-token-id (implies --stop-at-eos)
  std::string command_line;        // argv, for the --json summary
  std::string policy = "roofline";
  int block_tokens = 64, d_window = 256, ping_pong_buffers = 2, gpu_split_blocks = 4, cpu_task_blocks = 16;
  double ping_pong_mib = 64.0, kv_vram_budget_mib = 0.0, first_chunk_mib = 0.0;
  long long ping_pong_blocks = 0;
  double cpu_bw_gbps = 80.0, h2d_bw_gbps = 54.0, cpu_fixed_us = 0.0, gpu_fixed_us = 0.0;
  bool track_gpu_cost = false;
  std::string cpu_assist = "off";
  std::string all_gpu_steps = "on";  // --all-gpu-steps: attention_options::all_gpu_steps
  double placement_headroom = -1.0;  // < 0: 0.05 with --device cuda or an adaptive assist, else 0
  double placement_headroom_z = 0.0;  // --placement-headroom-z: A planned at its mean + z standard deviations
  double assist_max_fraction = 0.5, eviction_bounce_mib = 32.0;
  std::string launch_thread = "off", grouped_experts = "on";
  std::string hbm_resident_kernel = "off";  // --hbm-resident-kernel
  std::string caller_stream_steps = "on";   // --caller-stream-steps
  std::string decode_graphs = "on";         // --decode-graphs
  int grouped_expert_max_rows = 32, grouped_expert_min_active = 16;
  std::string device_experts_issue = "auto";
  std::string stream_experts = "on", flash_prefill = "on", cudnn_prefill = "on";
  double stream_min_rows = 32.0, expert_staging_mib = 0.0, kv_write_bounce_mib = 512.0;
  std::string batched_prefill_experts = "on";
  std::string prefill_expert_gemm = "batched";
  std::string prefill_expert_groups = "fitted";
  std::string calibration, calibration_preset;
  int threads = 0;
  std::string json_out, expect, logits_out;
  double logit_tol = -1.0, logit_tol_bf16_kv = -1.0;
  bool progress = false, no_progress = false, quiet = false, poison = false;
  std::string per_sequence = "0";  // --per-sequence N|all: per-sequence summary lines for the first N sequences
  std::string device = "auto", precision = "bf16";
  double vram_budget_gib = 0.0, prefill_attn_mib = 2048.0;
  long long max_gpu_experts = -1, prefill_chunk_tokens = 32768, prefill_moe_chunk_tokens = 0;
  bool skip_if_no_device = false, teacher_force = false, no_warmup = false, no_dram_ceiling = false;
  bool allow_long_context = false;
  double router_zipf = 0.0;
  std::string expert_placement = "id", migration = "swap";
  std::string decode_routing = "auto";
  std::string hbm_kv = "auto";  // --hbm-kv auto|fixed|off: the HBM-resident KV region (CUDA path)
  double hbm_kv_gib = 0.0;      // --hbm-kv-gib: auto's cap (0 = off), fixed's size
  double hbm_read_gbps = nominal_hbm_read_gbps;  // --hbm-read-gbps: the region's attention rate (H's prior)
  int migrate_max_experts = 8;
  int migrate_every_steps = 0;  // --migrate-every-steps: hot placement during the decode (0: after the prefill only)
  /// The options the user gave, by long name, with their values as typed
  /// (several uses joined by ','): an option acts or is refused (run()).
  std::map<std::string, std::string> given;
  [[nodiscard]] bool gave(const std::string& option) const { return given.count(option) > 0; }
};

/// A refused command line: "<option>: <rule>, not <value> (ws_decode --help lists the options)".
[[noreturn]] void refuse(const std::string& option, const std::string& rule, const std::string& value) {
  throw writescope::config_error(option + ": " + rule + ", not " + value + " (ws_decode --help lists the options)");
}

/// A CLI11 check that the number is > lo (strict) or >= lo, with a message
/// naming the rule and the value ("must be > 0, not -1").
CLI::Validator at_least(double lo, bool strict) {
  char rule[48];
  std::snprintf(rule, sizeof rule, "%s %g", strict ? ">" : ">=", lo);
  const std::string r = rule;
  return CLI::Validator(
      [lo, strict, r](std::string& v) -> std::string {
        double x = 0.0;
        try {
          x = std::stod(v);
        } catch (const std::exception&) {
          return "";  // the option's own conversion reports a non-number
        }
        return (strict ? x > lo : x >= lo) ? std::string() : "must be " + r + ", not " + v;
      },
      r);
}

/// A CLI11 check that the number lies in (lo, hi], naming the interval and the value as typed.
CLI::Validator in_open_closed(double lo, double hi) {
  char rule[64];
  std::snprintf(rule, sizeof rule, "in (%g, %g]", lo, hi);
  const std::string r = rule;
  return CLI::Validator(
      [lo, hi, r](std::string& v) -> std::string {
        double x = 0.0;
        try {
          x = std::stod(v);
        } catch (const std::exception&) {
          return "";  // the option's own conversion reports a non-number
        }
        return x > lo && x <= hi ? std::string() : "must be " + r + ", not " + v;
      },
      r);
}

/// A CLI11 check that the number is at most the machine's hardware threads
/// (std::thread::hardware_concurrency; no check where it is unknown).
CLI::Validator at_most_hardware_threads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return CLI::Validator(
      [hw](std::string& v) -> std::string {
        long long x = 0;
        try {
          x = std::stoll(v);
        } catch (const std::exception&) {
          return "";  // the option's own conversion reports a non-number
        }
        return hw == 0 || x <= (long long)hw
                   ? std::string()
                   : "must be <= " + std::to_string(hw) + " (this machine's hardware threads), not " + v;
      },
      "<= hardware threads");
}

/// A CLI11 check for --per-sequence: a whole number >= 0 or "all".
CLI::Validator count_or_all() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        if (v == "all") return "";
        std::size_t used = 0;
        long long x = -1;
        try {
          x = std::stoll(v, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        return used == v.size() && !v.empty() && x >= 0 ? std::string()
                                                        : "must be a whole number >= 0 or all, not " + v;
      },
      "");
}

/// --per-sequence's value (checked by count_or_all) as summary_options::sequence_lines.
std::size_t sequence_lines(const std::string& v) {
  return v == "all" ? SIZE_MAX : std::size_t(std::stoull(v));
}

std::vector<int> parse_ids(const std::string& s, const std::string& where) {
  std::vector<int> out;
  std::string tok;
  auto flush = [&] {
    if (tok.empty()) return;
    std::size_t used = 0;
    long v = -1;
    try {
      v = std::stol(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != tok.size() || v < 0 || v > (1L << 30))
      throw writescope::config_error(where + ": \"" + tok + "\" is not a token id");
    out.push_back(int(v));
    tok.clear();
  };
  bool need_id = false;  // a ',' was read and no id after it yet
  for (char c : s) {
    if (c == ',') {
      if (tok.empty() && (need_id || out.empty()))
        throw writescope::config_error(where + ": \"" + s + "\" has an empty field (token ids separated by ',')");
      flush();
      need_id = true;
    } else if (c == ' ' || c == '\t' || c == '\r') {
      flush();
    } else {
      tok += c;
      need_id = false;
    }
  }
  if (tok.empty() && need_id) throw writescope::config_error(where + ": \"" + s + "\" ends with a ','");
  flush();
  return out;
}

std::vector<std::vector<int>> build_prompts(const cli& a, const model_config& c, const nlohmann::json* expected) {
  std::vector<std::vector<int>> given;
  for (const std::string& p : a.prompts) {
    std::stringstream ss(p);
    std::string part;
    int k = 0;
    while (std::getline(ss, part, ';')) {
      auto ids = parse_ids(part, "--prompt");
      if (ids.empty())
        throw writescope::config_error("--prompt \"" + p + "\": sequence " + std::to_string(k) +
                                       " is empty (token ids separated by ',', sequences by ';')");
      given.push_back(std::move(ids));
      ++k;
    }
    if (k == 0) throw writescope::config_error("--prompt \"" + p + "\": no token ids");
  }
  if (!a.prompt_file.empty()) {
    std::error_code file_ec;
    if (!fs::is_regular_file(a.prompt_file, file_ec))
      refuse("--prompt-file", "must be an existing file (one prompt per line)", a.prompt_file);
    const std::string text = read_text_file(a.prompt_file);
    std::stringstream ss(text);
    std::string line;
    int n = 0;
    while (std::getline(ss, line)) {
      ++n;
      if (auto ids = parse_ids(line, a.prompt_file + ":" + std::to_string(n)); !ids.empty()) given.push_back(std::move(ids));
    }
    if (given.empty()) throw writescope::config_error(a.prompt_file + ": no prompts");
  }
  if (given.empty() && expected) given = (*expected)["prompts"].get<std::vector<std::vector<int>>>();
  if (!given.empty()) {
    const int b = a.batch > 0 ? a.batch : int(given.size());
    std::vector<std::vector<int>> out;
    for (int i = 0; i < b; ++i) out.push_back(given[std::size_t(i) % given.size()]);
    return out;
  }
  // random prompts of --prompt-len N or MIN:MAX tokens
  int lo = 0, hi = 0;
  const auto colon = a.prompt_len.find(':');
  try {
    lo = std::stoi(a.prompt_len.substr(0, colon));
    hi = colon == std::string::npos ? lo : std::stoi(a.prompt_len.substr(colon + 1));
  } catch (const std::exception&) {
    lo = hi = 0;
  }
  if (lo < 1 || hi < lo) throw writescope::config_error("--prompt-len " + a.prompt_len + ": expected N or MIN:MAX with 1 <= MIN <= MAX");
  std::mt19937_64 rng(a.seed ^ 0x70726f6d7074ull);
  std::vector<std::vector<int>> out(static_cast<std::size_t>(a.batch > 0 ? a.batch : 1));
  for (auto& p : out) {
    const int len = std::uniform_int_distribution<int>(lo, hi)(rng);
    for (int t = 0; t < len; ++t) p.push_back(std::uniform_int_distribution<int>(0, c.vocab_size - 1)(rng));
  }
  return out;
}

double physical_memory_gib() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? double(pages) * double(page) / double(1ull << 30) : 0.0;
}

struct expectation {
  nlohmann::json meta;
  std::unique_ptr<safetensors_file> logits_file;
  const tensor_view* logits = nullptr;          ///< transformers, fp32 KV
  const tensor_view* logits_bf16_kv = nullptr;  ///< transformers with its KV cache rounded to bf16 (optional)
  std::vector<std::vector<int>> tokens;
  double tolerance = 0.0, tolerance_bf16_kv = 0.0;
};

expectation load_expectation(const std::string& path) {
  expectation e;
  e.meta = read_json_file(path);
  const std::string where = path + ": ";
  if (!e.meta.is_object() || !e.meta.contains("prompts") || !e.meta.contains("greedy_tokens") ||
      !e.meta.contains("logits_file") || !e.meta["logits_file"].is_string())
    throw checkpoint_error(where + "expected an object with prompts, greedy_tokens and logits_file");
  try {
    e.tokens = e.meta["greedy_tokens"].get<std::vector<std::vector<int>>>();
    (void)e.meta["prompts"].get<std::vector<std::vector<int>>>();
    e.tolerance = e.meta.value("logit_tolerance", 0.0);
    e.tolerance_bf16_kv = e.meta.value("logit_tolerance_bf16_kv", 0.0);
  } catch (const nlohmann::json::exception& x) {
    throw checkpoint_error(where + detail::one_line(x.what()));
  }
  if (e.tokens.empty() || e.tokens[0].empty()) throw checkpoint_error(where + "greedy_tokens is empty");
  for (const auto& t : e.tokens)
    if (t.size() != e.tokens[0].size()) throw checkpoint_error(where + "greedy_tokens rows differ in length");
  e.logits_file = std::make_unique<safetensors_file>(fs::path(path).parent_path() / e.meta["logits_file"].get<std::string>());
  auto get = [&](const char* name) {
    const tensor_view* v = e.logits_file->find(name);
    if (v && (v->type != dtype::f32 || v->shape.size() != 3 || v->shape[0] != std::int64_t(e.tokens.size()) ||
              v->shape[1] < std::int64_t(e.tokens[0].size())))
      throw checkpoint_error(e.logits_file->path().string() + ": \"" + name + "\" must be F32 [batch][steps][vocab] with " +
                             std::to_string(e.tokens.size()) + " sequences and >= " + std::to_string(e.tokens[0].size()) +
                             " steps, is " + std::string(info(v->type).name) + " " + shape_string(v->shape));
    return v;
  };
  e.logits = get("logits");
  e.logits_bf16_kv = get("logits_bf16_kv");
  if (!e.logits) throw checkpoint_error(e.logits_file->path().string() + ": no tensor \"logits\"");
  return e;
}

/// max |ours - reference| over every sequence, step and vocabulary entry.
double max_logit_diff(const tensor_view& ref_t, const generation_result& r, int vocab) {
  const std::size_t B = r.tokens.size(), ref_steps = std::size_t(ref_t.shape[1]);
  if (ref_t.shape[2] != vocab)
    throw checkpoint_error("expected logits have vocab " + std::to_string(ref_t.shape[2]) + ", the model " + std::to_string(vocab));
  std::vector<float> ref(static_cast<std::size_t>(vocab));
  double worst = 0.0;
  for (std::size_t i = 0; i < B; ++i)
    for (std::size_t s = 0; s < r.tokens[i].size() && s < ref_steps; ++s) {  // fewer after an EOS stop
      widen_to_f32(dtype::f32, ref_t.data + ((i * ref_steps + s) * std::size_t(vocab)) * 4, std::size_t(vocab), ref.data());
      const float* ours = r.logits[i].data() + s * std::size_t(vocab);
      for (int v = 0; v < vocab; ++v) worst = std::max(worst, double(std::fabs(ours[v] - ref[std::size_t(v)])));
    }
  return worst;
}

/// Compares logits and greedy tokens with the reference; prints one line; true = pass.
/// With stop tokens (`eos`, --stop-at-eos) each sequence must also end where
/// the reference's greedy tokens first reach one of them (or run to their end).
bool check_expectation(const expectation& e, const generation_result& r, int vocab, double tol, double tol16,
                       bool teacher_forced, const std::vector<int>& eos) {
  const std::size_t B = r.tokens.size();
  if (e.tokens.size() != B)
    throw checkpoint_error("--expect has " + std::to_string(e.tokens.size()) + " sequences, the run " + std::to_string(B));
  std::size_t stops_right = 0;
  std::string stop_miss;
  for (std::size_t i = 0; i < B; ++i) {
    std::size_t want = e.tokens[i].size();
    for (std::size_t s = 0; s < e.tokens[i].size(); ++s)
      if (std::find(eos.begin(), eos.end(), e.tokens[i][s]) != eos.end()) {
        want = s + 1;
        break;
      }
    if (r.tokens[i].size() == want) ++stops_right;
    else if (stop_miss.empty())
      stop_miss = "; seq " + std::to_string(i) + " generated " + std::to_string(r.tokens[i].size()) + " tokens, the reference stops after " + std::to_string(want);
  }
  const double d32 = max_logit_diff(*e.logits, r, vocab);
  const double d16 = e.logits_bf16_kv ? max_logit_diff(*e.logits_bf16_kv, r, vocab) : 0.0;
  std::size_t same = 0, total = 0;
  std::string first;
  for (std::size_t i = 0; i < B; ++i)
    for (std::size_t s = 0; s < e.tokens[i].size() && s < r.tokens[i].size(); ++s, ++total) {
      if (e.tokens[i][s] == r.tokens[i][s]) ++same;
      else if (first.empty()) first = " (first difference: seq " + std::to_string(i) + " step " + std::to_string(s) + ")";
    }
  const bool ok = d32 <= tol && (!e.logits_bf16_kv || d16 <= tol16) && (teacher_forced || same == total) && total > 0 &&
                  stops_right == B;
  std::printf("check      max |logit - transformers| = %.3e (tolerance %.1e); with bf16 KV: ", d32, tol);
  if (e.logits_bf16_kv) std::printf("%.3e (tolerance %.1e)", d16, tol16);
  else std::printf("n/a");
  std::size_t steps_run = 0;  // fewer than the reference's when every sequence stopped at EOS
  for (const auto& t : r.tokens) steps_run = std::max(steps_run, t.size());
  std::printf("; %zu x %zu steps; greedy tokens %zu/%zu identical%s%s", B, steps_run, same, total,
              first.c_str(), teacher_forced ? " (teacher-forced: reported, not required)" : "");
  if (!eos.empty()) std::printf("; EOS stops where the reference's: %zu/%zu%s", stops_right, B, stop_miss.c_str());
  std::printf(": %s\n", ok ? "PASS" : "FAIL");
  return ok;
}

int run(cli& a) {
  // Every refusal of the command line comes before any weights are read: an
  // option either acts or is refused, naming the option, the rule and the value.
  // ---- options that exclude each other --------------------------------------------
  if (a.gave("--prompt") && a.gave("--prompt-file"))
    refuse("--prompt-file", "excluded by --prompt (one source of prompts)", a.given["--prompt-file"]);
  for (const char* source : {"--prompt", "--prompt-file"})
    if (a.gave(source) && a.gave("--prompt-len"))
      refuse("--prompt-len", std::string("excluded by ") + source + " (the length of random prompts)", a.given["--prompt-len"]);
  if (!a.expect.empty() && a.temperature > 0.0)
    refuse("--temperature", "must be 0 with --expect (the reference is greedy)", a.given["--temperature"]);
  if (a.quiet && a.gave("--per-sequence"))
    refuse("--per-sequence", "excluded by --quiet (lines of the text summary)", a.given["--per-sequence"]);
  if (a.progress && a.no_progress) refuse("--no-progress", "excluded by --progress (one of them)", "both given");
  if (a.gave("--ping-pong-blocks") && a.gave("--ping-pong-mib"))
    refuse("--ping-pong-mib", "excluded by --ping-pong-blocks (one size of a ping-pong buffer)", a.given["--ping-pong-mib"]);
  if (a.d_window % a.block_tokens != 0)
    refuse("--d-window", "must be a multiple of --block-tokens " + std::to_string(a.block_tokens), a.given.count("--d-window")
                                                                                                     ? a.given["--d-window"]
                                                                                                     : std::to_string(a.d_window));
  // sampling: top-p and top-k shape the distribution a temperature > 0 samples from; greedy ignores them
  if (!(a.temperature > 0.0))
    for (const char* opt : {"--top-p", "--top-k"})
      if (a.gave(opt))
        refuse(opt, "acts with --temperature > 0 only (0 is greedy)", a.given[opt] + " at --temperature " +
                                                                           (a.gave("--temperature") ? a.given["--temperature"] : "0"));
  // the seed acts on random weights, random prompts and sampling: refused where there is none of them
  if (a.gave("--seed") && !a.random_weights && !(a.temperature > 0.0) &&
      (a.gave("--prompt") || a.gave("--prompt-file") || !a.expect.empty()))
    refuse("--seed", "acts on --random-weights, random prompts (--prompt-len) or --temperature > 0 only",
           a.given["--seed"] + " with the checkpoint's weights, given prompts and greedy decoding");
  // options of the comparison with a reference run
  if (a.expect.empty())
    for (const char* opt : {"--teacher-force", "--logit-tol", "--logit-tol-bf16-kv"})
      if (a.gave(opt)) refuse(opt, "acts with --expect FILE only (a comparison with a reference run)", "no --expect");
  if (!a.expect.empty() && a.gave("--batch"))
    refuse("--batch", "excluded by --expect (the reference's prompts set the batch)", a.given["--batch"]);
  // output files: a path that cannot be written is refused before the run, not after it
  for (const char* opt : {"--json", "--logits-out"})
    if (a.gave(opt)) {
      const fs::path out(a.given[opt]);
      const fs::path dir = out.has_parent_path() ? out.parent_path() : fs::path(".");
      std::error_code dir_ec;
      if (!fs::is_directory(dir, dir_ec) || ::access(dir.c_str(), W_OK) != 0 || fs::is_directory(out, dir_ec))
        refuse(opt, "must be a file in an existing writable directory", a.given[opt]);
    }
  // the costs act on the roofline only; the bandwidths also set the adaptive assist's first balance
  if (a.policy != "roofline") {
    (void)parse_policy(a.policy, writescope::roofline_params{});  // a bad --policy is named first
    const bool adaptive = parse_assist(a.cpu_assist).mode == writescope::assist_mode::adaptive;
    for (const char* opt : {"--placement-headroom", "--placement-headroom-z", "--cpu-fixed-us", "--gpu-fixed-us",
                            "--track-gpu-cost"})
      if (a.gave(opt)) refuse(opt, "acts on --policy roofline only", "--policy " + a.policy);
    for (const char* opt : {"--cpu-bw-gbps", "--h2d-bw-gbps", "--calibration", "--calibration-preset"})
      if (a.gave(opt) && !adaptive)
        refuse(opt, "acts on --policy roofline or --cpu-assist adaptive only", "--policy " + a.policy);
  }
  if (a.gave("--assist-max-fraction") && parse_assist(a.cpu_assist).mode != writescope::assist_mode::adaptive)
    refuse("--assist-max-fraction", "acts with --cpu-assist adaptive only", "--cpu-assist " + a.cpu_assist);
  // cpu_only places no block in the pinned region: nothing is streamed, nothing is there to assist
  if (a.policy == "cpu_only") {
    if (parse_assist(a.cpu_assist).mode != writescope::assist_mode::off)
      refuse("--cpu-assist", "acts on pinned blocks, which --policy cpu_only never places", a.given["--cpu-assist"]);
    if (a.gave("--first-chunk-mib"))
      refuse("--first-chunk-mib", "acts on streamed pinned blocks, which --policy cpu_only never places",
             a.given["--first-chunk-mib"]);
  }

  // ---- model -----------------------------------------------------------------
  std::optional<arch> forced;
  if (a.arch != "auto") forced = parse_arch(a.arch);
  if (a.random_weights && a.config.empty() && a.model_dir.empty())
    throw writescope::config_error("--random-weights needs --config FILE (the config.json whose shapes the weights take)");
  if (!a.random_weights && a.model_dir.empty())
    throw writescope::config_error("give a checkpoint directory, or --random-weights --config <config.json>");
  std::error_code ec;
  if (!a.random_weights && !fs::is_directory(a.model_dir, ec))
    throw checkpoint_error(a.model_dir + (fs::exists(a.model_dir, ec)
                                              ? ": not a directory (the model is a checkpoint directory: config.json + "
                                                "model.safetensors[.index.json])"
                                              : ": checkpoint directory does not exist"));
  fs::path config_path = !a.config.empty() ? fs::path(a.config) : fs::path(a.model_dir) / "config.json";
  model_config c = load_model_config(config_path, forced);
  if (a.layers > c.num_layers)
    refuse("--layers", "must be <= num_hidden_layers " + std::to_string(c.num_layers) + " of " + config_path.string(),
           a.given["--layers"]);
  if (a.layers > 0) c.num_layers = a.layers;
  device_kind kind = device_kind::host;
  if (a.device == "auto") {
    kind = cuda_devices() > 0 ? device_kind::cuda : device_kind::host;
  } else if (a.device == "host") {
    kind = device_kind::host;
  } else if (a.device == "emulated") {
    kind = device_kind::emulated;
  } else if (a.device == "cuda") {
    if (cuda_devices() == 0 && a.skip_if_no_device) {
      std::printf("SKIPPED: no usable CUDA device%s\n", cuda_path_built() ? "" : " (built without the CUDA path)");
      return 77;
    }
    if (!cuda_path_built())
      throw writescope::config_error("--device cuda: this ws_decode was built without the CUDA path (WRITESCOPE_CUDA=OFF, or CMake found no CUDA toolkit or cuBLAS; scripts/run-example turns it off where nvidia-smi lists no GPU)");
    if (cuda_devices() == 0) throw writescope::config_error("--device cuda: no usable CUDA device");
    kind = device_kind::cuda;
  } else {
    throw writescope::config_error("--device " + a.device + " is not one of auto, cuda, host, emulated");
  }
  if (a.skip_if_no_device && a.device != "cuda")
    refuse("--skip-if-no-device", "acts with --device cuda only", "--device " + a.device);
  if (kind == device_kind::host) {  // --device emulated runs the CUDA path's code: these act there
    static constexpr const char* cuda_only[] = {
        "--precision",        "--launch-thread",           "--eviction-bounce-mib",       "--vram-budget",
        "--max-gpu-experts",  "--grouped-experts",         "--grouped-expert-max-rows",   "--grouped-expert-min-active",
        "--prefill-chunk-tokens", "--prefill-attn-mib",    "--stream-experts",            "--stream-min-rows",
        "--expert-staging-mib", "--flash-prefill",         "--batched-prefill-experts",   "--kv-write-bounce-mib",
        "--cudnn-prefill",    "--no-warmup",               "--router-zipf",               "--expert-placement",
        "--migrate-max-experts", "--migration",         "--prefill-expert-gemm",       "--prefill-expert-groups",
        "--decode-routing",   "--no-dram-ceiling",         "--device-experts-issue",      "--hbm-kv",
        "--hbm-kv-gib",       "--hbm-resident-kernel",     "--hbm-read-gbps",             "--prefill-moe-chunk-tokens",
        "--caller-stream-steps", "--decode-graphs",      "--migrate-every-steps"};
    for (const char* opt : cuda_only)
      if (a.gave(opt))
        refuse(opt, "acts on the CUDA path only (--device cuda or emulated)",
               a.device == "auto" ? "--device auto, the host path here (no usable CUDA device)" : "--device " + a.device);
  }
  if (a.precision != "bf16" && a.precision != "fp32")
    throw writescope::config_error("--precision " + a.precision + " is not one of bf16, fp32");
  if (kind == device_kind::emulated)  // cuda_backend's own settings: the host backend has none of them
    for (const char* opt : {"--launch-thread", "--eviction-bounce-mib", "--kv-write-bounce-mib", "--caller-stream-steps"})
      if (a.gave(opt)) refuse(opt, "acts with --device cuda only (a setting of cuda_backend)", "--device emulated");
  if (kind == device_kind::emulated && a.gave("--decode-graphs"))  // the emulated executor has no graphs
    refuse("--decode-graphs", "acts with --device cuda only (CUDA graphs: the emulated executor has none)", "--device emulated");
  if (a.precision == "fp32")  // the fp32 precision materialises the prefill scores and runs experts per expert
    for (const char* opt : {"--flash-prefill", "--batched-prefill-experts", "--cudnn-prefill", "--prefill-expert-gemm",
                            "--prefill-expert-groups"})
      if (a.gave(opt)) refuse(opt, "acts with --precision bf16 only", "--precision fp32");
  if (a.batched_prefill_experts == "off")
    for (const char* opt : {"--prefill-expert-gemm", "--prefill-expert-groups"})
      if (a.gave(opt)) refuse(opt, "acts with --batched-prefill-experts on only", "--batched-prefill-experts off");
  if (a.prefill_expert_gemm == "grouped" && a.gave("--prefill-expert-groups"))
    refuse("--prefill-expert-groups", "acts with --prefill-expert-gemm batched only (grouped runs exact rows, no groups)",
           "--prefill-expert-gemm grouped");
  if (a.flash_prefill == "off" && a.gave("--cudnn-prefill"))
    refuse("--cudnn-prefill", "acts with --flash-prefill on only (cuDNN replaces the flash kernel)", "--flash-prefill off");
  if (a.stream_experts == "off")
    for (const char* opt : {"--stream-min-rows", "--expert-staging-mib"})
      if (a.gave(opt)) refuse(opt, "acts with --stream-experts on only", "--stream-experts off");
  if (a.gave("--router-zipf")) {
    if (!(a.router_zipf >= 0.0) || !std::isfinite(a.router_zipf))
      refuse("--router-zipf", "the Zipf exponent must be finite and >= 0 (0 = no bias)", a.given["--router-zipf"]);
    if (!a.random_weights)
      refuse("--router-zipf", "acts with --random-weights only (a synthetic bias of random routers)",
             a.given["--router-zipf"] + " with the checkpoint's routers");
  }
  if (a.decode_routing == "device" && a.grouped_experts == "off")
    refuse("--decode-routing", "device runs the grouped expert kernels", "--grouped-experts off");
  // the HBM-resident KV region: auto weighs it against the experts (a device
  // size is needed: the emulated device has one only with --vram-budget);
  // fixed takes --hbm-kv-gib as the size; off has none
  if (a.hbm_kv == "off" && a.gave("--hbm-kv-gib"))
    refuse("--hbm-kv-gib", "acts with --hbm-kv auto or fixed only", "--hbm-kv off");
  if (a.hbm_kv == "off" && a.gave("--hbm-read-gbps"))
    refuse("--hbm-read-gbps", "acts with --hbm-kv auto or fixed only", "--hbm-kv off");
  if (a.hbm_resident_kernel == "on" && a.hbm_kv == "off")
    refuse("--hbm-resident-kernel", "attends the HBM KV region, which --hbm-kv off does not build", "--hbm-kv off");
  if (a.hbm_resident_kernel == "on" && kind == device_kind::emulated)
    refuse("--hbm-resident-kernel", "is a cuda_backend kernel (the emulated device attends the region on the host)",
           "--device emulated");
  if (a.hbm_kv == "fixed" && !(a.hbm_kv_gib > 0.0))
    refuse("--hbm-kv", "fixed needs --hbm-kv-gib > 0 (the region's size)",
           "fixed with --hbm-kv-gib " + (a.gave("--hbm-kv-gib") ? a.given["--hbm-kv-gib"] : std::string("not given")));
  if (kind == device_kind::emulated && a.hbm_kv == "auto" && !(a.vram_budget_gib > 0.0))
    for (const char* opt : {"--hbm-kv", "--hbm-kv-gib", "--hbm-read-gbps"})
      if (a.gave(opt))
        refuse(opt, "auto acts on the emulated device with --vram-budget only (without it the device has no size to split)",
               std::string(opt) + " " + a.given[opt] + " without --vram-budget");
  if (a.expert_placement != "hot")
    for (const char* opt : {"--migrate-max-experts", "--migration", "--migrate-every-steps"})
      if (a.gave(opt)) refuse(opt, "acts with --expert-placement hot only", "--expert-placement " + a.expert_placement);

  // ---- expectation, prompts ------------------------------------------------------
  std::optional<expectation> expected;
  if (!a.expect.empty()) {
    expected = load_expectation(a.expect);
    // the reference must come from this architecture (make_fixtures.py records the transformers class)
    static constexpr std::pair<arch, const char*> classes[] = {{arch::qwen3_moe, "Qwen3MoeForCausalLM"},
                                                               {arch::mixtral, "MixtralForCausalLM"},
                                                               {arch::deepseek_v2, "DeepseekV2ForCausalLM"}};
    if (const auto it = expected->meta.find("architecture"); it != expected->meta.end() && it->is_string())
      for (const auto& [k, cls] : classes)
        if (k == c.kind && *it != cls)
          throw checkpoint_error("--expect " + a.expect + " was made with " + it->get<std::string>() + "; the model is " +
                                 to_string(c.kind) + " (" + cls + ")");
    const int steps = int(expected->tokens[0].size());
    if (a.gave("--max-new-tokens") && a.max_new_tokens != steps)
      refuse("--max-new-tokens", "must be " + std::to_string(steps) + " with --expect (the reference's steps)",
             a.given["--max-new-tokens"]);
    a.max_new_tokens = steps;
  }
  const auto prompts = build_prompts(a, c, expected ? &expected->meta : nullptr);
  // a sequence takes its prompt's positions and one per generated token but the last
  std::size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  const long long positions = (long long)longest + a.max_new_tokens - 1;
  if (c.max_position_embeddings > 0 && positions > c.max_position_embeddings && !a.allow_long_context)
    refuse(a.gave("--prompt") ? "--prompt" : a.gave("--prompt-file") ? "--prompt-file" : expected ? "--expect" : "--prompt-len",
           "the longest prompt + --max-new-tokens - 1 must be <= max_position_embeddings " +
               std::to_string(c.max_position_embeddings) + " of " + config_path.string() +
               " (--allow-long-context runs past it)",
           std::to_string(longest) + " + " + std::to_string(a.max_new_tokens) + " - 1 = " + std::to_string(positions));

  // ---- weights -----------------------------------------------------------------
  const double need_gib = double(c.parameter_count()) * 4.0 / double(1ull << 30);
  const double limit = a.max_host_weights_gib > 0 ? a.max_host_weights_gib : 0.8 * physical_memory_gib();
  if (kind == device_kind::host && limit > 0 && need_gib > limit) {
    char b[320];
    std::snprintf(b, sizeof b,
                  "the host path holds weights in fp32: %.4g GiB (%.0f bytes) for %d layers exceeds the limit of "
                  "%.4g GiB (%.0f bytes, %s); use --layers N, --max-host-weights-gib, or --device cuda with "
                  "--vram-budget",
                  need_gib, need_gib * double(1ull << 30), c.num_layers, limit, limit * double(1ull << 30),
                  a.max_host_weights_gib > 0 ? "--max-host-weights-gib" : "80% of the physical memory");
    throw writescope::config_error(b);
  }
  std::unique_ptr<checkpoint> ckpt;
  std::unique_ptr<weight_source> src;
  if (a.random_weights) {
    src = std::make_unique<weight_source>(a.seed, c.initializer_range);
  } else {
    ckpt = std::make_unique<checkpoint>(a.model_dir);
    src = std::make_unique<weight_source>(*ckpt);
  }

  // ---- run options -----------------------------------------------------------------
  run_options o;
  o.max_new_tokens = a.max_new_tokens;
  o.sampling = {a.temperature, a.top_p, a.top_k, a.seed};
  o.sampling.validate();
  o.kv.block_tokens = a.block_tokens;
  o.kv.d_window_tokens = a.d_window;
  o.kv.ping_pong_bytes = writescope::index_t(a.ping_pong_mib * double(1 << 20));
  o.kv.ping_pong_blocks = a.ping_pong_blocks;
  o.kv.first_chunk_bytes = writescope::index_t(a.first_chunk_mib * double(1 << 20));
  o.kv.ping_pong_buffers = a.ping_pong_buffers;
  o.kv.gpu_split_blocks = a.gpu_split_blocks;
  o.kv.cpu_task_blocks = a.cpu_task_blocks;
  o.kv.kv_vram_budget_bytes = writescope::index_t(a.kv_vram_budget_mib * double(1 << 20));
  o.kv.poison = a.poison;
  const int threads = a.threads > 0 ? a.threads : std::max(1, int(std::thread::hardware_concurrency()));
  o.threads = std::max(1, threads - 1);  // CPU attention engine: one core stays with the thread driving the GPU side
  o.record_logits = expected.has_value() || !a.logits_out.empty();
  if (a.teacher_force) o.forced_tokens = &expected->tokens;  // --expect is there (refused above otherwise)
  if (a.stop_at_eos || !a.eos_token_ids.empty()) {
    o.eos_token_ids = a.eos_token_ids.empty() ? c.eos_token_ids : a.eos_token_ids;
    if (o.eos_token_ids.empty())
      throw writescope::config_error("--stop-at-eos: " + config_path.string() +
                                     " has no eos_token_id; give the stop tokens with --eos-token-id");
    for (int t : o.eos_token_ids)
      if (t < 0 || t >= c.vocab_size)
        throw writescope::config_error("EOS token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                       std::to_string(c.vocab_size) + ")");
    if (a.teacher_force)
      throw writescope::config_error("--stop-at-eos with --teacher-force: the fed-back tokens are the reference's, so "
                                     "a stop would follow the sampled token the run does not continue from");
  }
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif
  Eigen::setNbThreads(1);  // parallelism comes from our OpenMP loops (ops.hpp), never Eigen's GEMM threads

  // Roofline costs at init: the calibration file's entry for this model's
  // attention geometry and batch, or the bandwidth priors (roofline_init.hpp).
  // On a GPU the CPU side of a layer's step has a fixed cost the bandwidth
  // prior leaves out: the query's download, the thread team's wake-up, the
  // partial's upload and the merge (about 100-150 us per layer measured at
  // batch 1, docs/DECISIONS-DECODERS.md); its prior C_CPU is 100 us there
  // unless --cpu-fixed-us says otherwise (eq. 2's fixed-cost term then keeps
  // short contexts on the GPU). 0 on the host and emulated backends.
  const double cpu_fixed_us = a.gave("--cpu-fixed-us") ? a.cpu_fixed_us : kind == device_kind::cuda ? 100.0 : 0.0;
  const roofline_origin costs =
      a.calibration.empty()
          ? roofline_from_defaults(c, a.cpu_bw_gbps, a.h2d_bw_gbps, cpu_fixed_us, a.gpu_fixed_us, a.track_gpu_cost)
          : roofline_from_calibration(writescope::load_calibration(a.calibration), a.calibration, c,
                                      int(prompts.size()), o.threads, a.calibration_preset, a.track_gpu_cost,
                                      o.kv.block_tokens, o.kv.gpu_split_blocks);
  // CPU assist (hybrid_attention; docs/DECISIONS.md): off by default (the
  // paper's split, bit-reproducible). The roofline policy places
  // --placement-headroom less on the CPU than its balance: by default 0.05
  // on a real GPU (the CPU side's time wanders ±15 % within a run, the GPU
  // side's by ~2 %, and placement cannot move: the steadier side should be
  // the long pole; docs/DECISIONS.md, the headroom entry) and with an adaptive assist
  // (left to the per-step balance); 0 on the host and emulated backends,
  // whose "GPU" side runs on the same CPU.
  o.assist = parse_assist(a.cpu_assist);
  o.all_gpu_steps = a.all_gpu_steps == "on";
  o.assist.max_pinned_fraction = a.assist_max_fraction;
  o.assist.initial_cpu_seconds_per_token = costs.params.cpu_cost_per_token_seconds;  // the roofline's A and B
  o.assist.initial_gpu_seconds_per_token = costs.params.gpu_cost_per_token_seconds;
  writescope::roofline_params params = costs.params;
  // H: a KV token attended in place in the HBM-resident region (the roofline's
  // fixed GPU cost per HBM token, its prior, and the VRAM split's), at
  // --hbm-read-gbps (default: the nominal HBM rate)
  // (0 on the host path, which has no HBM tier)
  const double hbm_seconds_per_token =
      kind == device_kind::host ? 0.0 : double(geometry_of(c).token_bytes) / (a.hbm_read_gbps * 1e9);
  params.hbm_cost_per_token_seconds = hbm_seconds_per_token;
  o.assist.resident_seconds_per_token = hbm_seconds_per_token;  // the assist's GPU side: resident time is fixed
  params.placement_headroom =
      a.placement_headroom >= 0.0                                                               ? a.placement_headroom
      : kind == device_kind::cuda || o.assist.mode == writescope::assist_mode::adaptive ? 0.05
                                                                                        : 0.0;
  params.placement_headroom_z = a.placement_headroom_z;
  runtime_policy policy = parse_policy(a.policy, params);

  const bool show = !a.no_progress && (a.progress || progress_bar::stderr_is_tty());
  progress_bar bar(show);
  o.progress = [&](phase p, int done, int total) {
    bar.update(p == phase::admission ? "admit" : p == phase::prefill ? "prefill" : "decode", done, total);
  };
  load_hooks hooks;
  const auto t_load = std::chrono::steady_clock::now();
  double load_seconds = 0.0;
  hooks.on_layer_loaded = [&](int l) { bar.update("weights", l + 1, c.num_layers); };
  hooks.on_loaded = [&] { load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count(); };

  device_options dopt;
  dopt.precision = a.precision == "fp32" ? gpu::wtype::f32 : gpu::wtype::bf16;
  dopt.vram_budget_bytes = writescope::index_t(a.vram_budget_gib * double(1ull << 30));
  dopt.max_gpu_experts = a.max_gpu_experts;
  dopt.prefill_chunk_tokens = a.prefill_chunk_tokens;
  dopt.prefill_moe_chunk_tokens = a.prefill_moe_chunk_tokens;
  dopt.prefill_attention_bytes = writescope::index_t(a.prefill_attn_mib * double(1 << 20));
  dopt.max_host_expert_gib = a.max_host_weights_gib;
  dopt.physical_memory_gib = physical_memory_gib();
  dopt.warmup = !a.no_warmup;
  dopt.dram_ceiling = !a.no_dram_ceiling;
  dopt.eviction_bounce_bytes = writescope::index_t(a.eviction_bounce_mib * double(1 << 20));
  dopt.launch_thread = a.launch_thread == "on";
  dopt.resident_kernel = a.hbm_resident_kernel == "on";
  dopt.caller_stream_steps = a.caller_stream_steps == "on";
  dopt.decode_graphs = a.decode_graphs == "on";
  dopt.grouped_experts = a.grouped_experts == "on";
  dopt.grouped_expert_max_rows = a.grouped_expert_max_rows;
  dopt.grouped_expert_min_active = a.grouped_expert_min_active;
  dopt.device_experts_during_cpu = a.device_experts_issue != "before";  // auto: during where host experts exist
  dopt.device_experts_during_cpu_default = a.device_experts_issue == "auto";
  dopt.decode_routing = a.decode_routing == "device" ? decode_routing_mode::device
                        : a.decode_routing == "host" ? decode_routing_mode::host
                                                     : decode_routing_mode::automatic;
  dopt.stream_experts = a.stream_experts == "on";
  dopt.stream_min_rows = a.stream_min_rows;
  dopt.expert_staging_bytes = writescope::index_t(a.expert_staging_mib * double(1 << 20));
  dopt.flash_prefill = a.flash_prefill == "on";
  dopt.cudnn_prefill = a.cudnn_prefill == "on";
  dopt.batched_prefill_experts = a.batched_prefill_experts == "on";
  dopt.grouped_prefill_gemm = a.prefill_expert_gemm == "grouped";
  dopt.fitted_expert_groups = a.prefill_expert_groups == "fitted";
  dopt.deferred_kv_write_bytes = writescope::index_t(a.kv_write_bounce_mib * double(1 << 20));
  dopt.router_zipf = a.router_zipf;
  dopt.router_zipf_seed = std::uint64_t(a.seed);
  dopt.hot_placement = a.expert_placement == "hot";
  dopt.layer_major_placement = a.expert_placement == "layers";
  dopt.migrate_max_experts = a.migrate_max_experts;
  dopt.migrate_reload = a.migration == "reload";
  dopt.migrate_every_steps = a.migrate_every_steps;
  dopt.hbm_kv = a.hbm_kv == "off" || (a.hbm_kv == "auto" && a.gave("--hbm-kv-gib") && !(a.hbm_kv_gib > 0.0))
                    ? hbm_kv_mode::off
                : a.hbm_kv == "fixed" ? hbm_kv_mode::fixed
                                      : hbm_kv_mode::automatic;
  dopt.hbm_kv_bytes = writescope::index_t(a.hbm_kv_gib * double(1ull << 30));
  dopt.kv_cpu_seconds_per_token = costs.params.cpu_cost_per_token_seconds;
  dopt.kv_gpu_seconds_per_token = costs.params.gpu_cost_per_token_seconds;
  dopt.kv_launch_seconds_per_token = costs.params.launch_cost_per_token_seconds;
  dopt.kv_hbm_seconds_per_token = hbm_seconds_per_token;
  dopt.cpu_expert_bytes_per_second = a.cpu_bw_gbps * 1e9;
  const generation_result r = kind == device_kind::host
                                  ? run_model(c, *src, prompts, std::move(policy), o, hooks)
                                  : run_model_device(kind, c, *src, prompts, std::move(policy), o, dopt, hooks);

  // the costs are the roofline's: under another policy no line claims them
  const roofline_origin* roofline_costs = a.policy == "roofline" ? &costs : nullptr;
  if (!a.quiet)
    print_summary(stdout, c, r, load_seconds, a.random_weights, roofline_costs,
                  summary_options{sequence_lines(a.per_sequence)});
  if (!a.json_out.empty()) {
    std::ofstream out(a.json_out);
    nlohmann::json j = summary_json(c, r, load_seconds, roofline_costs);
    j["assist"] = {{"mode", writescope::to_string(o.assist.mode)},
                   {"fixed_fraction", o.assist.fixed_fraction},
                   {"max_pinned_fraction", o.assist.max_pinned_fraction},
                   {"placement_headroom", params.placement_headroom},
                   {"placement_headroom_z", params.placement_headroom_z}};
    j["launch_thread"] = dopt.launch_thread && kind == device_kind::cuda;
    j["all_gpu_steps"] = o.all_gpu_steps;
    j["hbm_resident_kernel"] = dopt.resident_kernel && kind == device_kind::cuda;
    j["caller_stream_steps"] = dopt.caller_stream_steps && kind == device_kind::cuda;
    j["decode_graphs"] = dopt.decode_graphs && kind == device_kind::cuda;
    j["command_line"] = a.command_line;  // with the fields below, what reproduces the run
    j["model_source"] = a.random_weights ? "random weights (seed " + std::to_string(a.seed) + ") from " + config_path.string()
                                         : a.model_dir;
    j["seed"] = a.seed;
    j["eos_token_ids"] = o.eos_token_ids;
    out << j.dump(2) << "\n";
    if (!out) throw writescope::error("--json " + a.json_out + ": cannot write");
  }
  if (!a.logits_out.empty()) {  // raw fp32 [sequence][step][vocab], for bit-exact comparisons of two runs
    std::ofstream out(a.logits_out, std::ios::binary);
    for (const auto& l : r.logits) out.write(reinterpret_cast<const char*>(l.data()), std::streamsize(l.size() * sizeof(float)));
    if (!out) throw writescope::error("--logits-out " + a.logits_out + ": cannot write");
  }
  if (expected) {
    const double tol = a.logit_tol >= 0 ? a.logit_tol : expected->tolerance;
    const double tol16 = a.logit_tol_bf16_kv >= 0 ? a.logit_tol_bf16_kv : expected->tolerance_bf16_kv;
    if (!(tol > 0) || (expected->logits_bf16_kv && !(tol16 > 0)))
      throw writescope::config_error("--expect: no logit tolerance (give --logit-tol / --logit-tol-bf16-kv or set them in the file)");
    if (!check_expectation(*expected, r, c.vocab_size, tol, tol16, a.teacher_force, o.eos_token_ids)) return 3;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // libgomp reads OMP_WAIT_POLICY only at start-up, so the policy is chosen by
  // re-executing once unless the user set it:
  //  * host / emulated / auto: "passive". The host backend runs the emulated
  //    GPU side on its own thread next to the OpenMP teams; spin-waiting idle
  //    threads starve it (steps 10-100x slower on small machines).
  //  * --device cuda: "active". The CPU engine's team leaves one core to the
  //    GPU-driving thread, and waking a passive team costs every layer: on the
  //    H200 machine DeepSeek-V2-Lite 32 x 32K decoded 423 tok/s with "active"
  //    against 366 with "passive" (docs/DECISIONS.md, "OpenMP threads spin on the CUDA path").
  if (!std::getenv("OMP_WAIT_POLICY")) {
    bool cuda = false;
    for (int i = 1; i < argc; ++i) {
      const std::string_view arg(argv[i]);
      if (arg == "--device=cuda" || (arg == "--device" && i + 1 < argc && std::string_view(argv[i + 1]) == "cuda"))
        cuda = true;
    }
    ::setenv("OMP_WAIT_POLICY", cuda ? "active" : "passive", 1);
    ::execv("/proc/self/exe", argv);  // returns only on failure: then run with the default policy
  }
  cli a;
  CLI::App app{"ws_decode: Qwen3-MoE / DeepSeek-V2 / Mixtral decoding over a writescope KV cache split between the "
               "CPU region and the GPU side (--device cuda: model and cache on the GPU; --device host: fp32 on the CPU, "
               "GPU side emulated)."};
  app.get_formatter()->column_width(38);
  app.add_option("model", a.model_dir, "Hugging Face checkpoint directory (config.json + model.safetensors[.index.json])");
  auto* g_model = "Model";
  app.add_option("--arch", a.arch, "auto (config.json model_type) | qwen3_moe | deepseek_v2 | mixtral")
      ->group(g_model)->capture_default_str();
  app.add_flag("--random-weights", a.random_weights, "seeded random weights of the config's exact shapes (no checkpoint)")
      ->group(g_model);
  app.add_option("--config", a.config, "config.json (default: MODEL/config.json)")->group(g_model);
  app.add_option("--layers", a.layers, "use only the first N decoder layers (0 = all)")
      ->group(g_model)->check(at_least(0, false));
  app.add_option("--max-host-weights-gib", a.max_host_weights_gib,
                 "host path: refuse models whose fp32 weights exceed this; CUDA path: the same limit for the experts "
                 "kept in host memory (default: 80% of host RAM)")->group(g_model);
  auto* g_dev = "Device";
  app.add_option("--device", a.device,
                 "auto (cuda when a CUDA device is present, else host) | cuda | host | emulated (the CUDA path's code "
                 "on the host, for machines without a GPU)")->group(g_dev)->capture_default_str();
  app.add_option("--precision", a.precision,
                 "CUDA path GEMMs: bf16 (bf16 inputs, fp32 accumulation) | fp32 (bf16 weights widened exactly, fp32 "
                 "activations: the host path's arithmetic)")->group(g_dev)->capture_default_str();
  app.add_option("--vram-budget", a.vram_budget_gib,
                 "GiB of device memory for everything (weights, cache regions, workspaces); routed experts that do not "
                 "fit stay in host memory and run on the CPU (0 = the free device memory minus 1 GiB)")->group(g_dev);
  app.add_option("--hbm-kv", a.hbm_kv,
                 "CUDA path: the HBM-resident KV region. auto = --vram-budget (or the free device memory) divided "
                 "between it and the routed experts by the decode-step time a GiB of each saves, the denser filled "
                 "first up to its demand (the planned KV: prompts + --max-new-tokens); fixed = exactly --hbm-kv-gib; "
                 "off = none")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"auto", "fixed", "off"}));
  app.add_option("--hbm-kv-gib", a.hbm_kv_gib,
                 "CUDA path: GiB of the HBM KV region, whole eviction batches: --hbm-kv auto's cap (0 = no region), "
                 "--hbm-kv fixed's size (refused when it does not fit the budget)")
      ->group(g_dev)->check(at_least(0, false));
  app.add_option("--max-gpu-experts", a.max_gpu_experts,
                 "at most this many routed experts (all layers) on the GPU, the rest on the CPU (-1 = no cap)")
      ->group(g_dev);
  app.add_option("--grouped-experts", a.grouped_experts,
                 "CUDA path: on = a MoE layer's device experts run in two launches (gate-up, down) when no expert has "
                 "more than --grouped-expert-max-rows rows (decode); off = one cuBLAS product per expert and matrix")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--grouped-expert-max-rows", a.grouped_expert_max_rows,
                 "CUDA path: most rows an expert may have for the grouped launches (each 8 rows read the weights once more)")
      ->group(g_dev)->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--grouped-expert-min-active", a.grouped_expert_min_active,
                 "CUDA path: fewest device experts with rows for the grouped launches (below: per expert; Mixtral's 8 "
                 "wide experts run faster through cuBLAS)")
      ->group(g_dev)->capture_default_str()->check(CLI::Range(0, 4096));
  app.add_option("--device-experts-issue", a.device_experts_issue,
                 "CUDA path, decode MoE layers with host experts: before = enqueue the device experts, then run the CPU "
                 "experts; during = the CPU experts' threads start while this thread enqueues the device experts, then "
                 "it joins them (same results; refused where no routed expert is in host memory); auto = during where "
                 "routed experts are in host memory")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"auto", "before", "during"}));
  app.add_option("--decode-routing", a.decode_routing,
                 "CUDA path: host = each decode MoE layer downloads its routing and the host groups the rows; device = a "
                 "decode layer groups them on the device and runs the grouped launches from there (no routing download, "
                 "no wait for the router; a layer with bf16 host experts downloads the experts chosen and its rows once "
                 "and uploads the CPU's rows) when the batch is at most --grouped-expert-max-rows sequences and the "
                 "experts are bf16, other layers as host; refused where it cannot act; auto = device where it applies, "
                 "host elsewhere")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"auto", "host", "device"}));
  app.add_option("--stream-experts", a.stream_experts,
                 "CUDA path: on = prefill waves with at least --stream-min-rows routed rows per host expert run the host "
                 "experts on the GPU, their weights streamed from page-locked host memory through a staging ring inside "
                 "--vram-budget; off = host experts always run on the CPU (their memory stays pageable)")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--stream-min-rows", a.stream_min_rows,
                 "CUDA path: mean routed rows per host expert (wave tokens x experts per token / experts) from which a "
                 "prefill wave streams its host experts")
      ->group(g_dev)->capture_default_str()->check(at_least(0, false));
  app.add_option("--expert-staging-mib", a.expert_staging_mib,
                 "CUDA path: device MiB of the expert staging ring, inside --vram-budget (0 = two layers' host experts "
                 "where they take at most an eighth of the budget: a layer's streamed experts then run inside its "
                 "batched GEMMs; else one layer's, at most an eighth of the budget, at least 2 experts)")
      ->group(g_dev)->capture_default_str()->check(at_least(0, false));
  app.add_option("--flash-prefill", a.flash_prefill,
                 "CUDA path, --precision bf16: on = prefill attention by the flash kernel (causal, online softmax, no "
                 "score matrix); off = materialised score blocks (--prefill-attn-mib). fp32 always materialises")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--cudnn-prefill", a.cudnn_prefill,
                 "CUDA path, --flash-prefill on: on = the prefill attention through cuDNN's fused SDPA when the build "
                 "has it (WRITESCOPE_CUDNN) and cuDNN loads and accepts every wave's shape (else the flash kernel; the "
                 "summary's prefill line says which ran and why); off = always the flash kernel")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--batched-prefill-experts", a.batched_prefill_experts,
                 "CUDA path, --precision bf16: on = a prefill MoE layer's device experts run as batched GEMMs, one per "
                 "group of experts with equal rows padded to a multiple of 64; off = three cuBLAS products per expert")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--prefill-expert-gemm", a.prefill_expert_gemm,
                 "CUDA path, --batched-prefill-experts on: how the batched GEMMs are issued: batched = one "
                 "pointer-array batched cuBLASLt GEMM per group of equal padded rows and matrix; grouped = one "
                 "cublasGemmGroupedBatchedEx per matrix (gate, up, down) over every device expert at its exact rows")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"batched", "grouped"}));
  app.add_option("--prefill-expert-groups", a.prefill_expert_groups,
                 "CUDA path, --prefill-expert-gemm batched: which device experts share a batched GEMM: ladder = those "
                 "whose rows round up to the same size of a geometric ladder (8 sizes per octave); fitted = groups "
                 "fitted to the layer's loads, trading padded rows against the host issue of more calls")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"ladder", "fitted"}));
  app.add_option("--kv-write-bounce-mib", a.kv_write_bounce_mib,
                 "CUDA path: prefill KV bound for the unpinned region leaves through a page-locked bounce buffer of at "
                 "most this many MiB without the host waiting, copied to its blocks during the next layer (0 = "
                 "synchronous writes)")
      ->group(g_dev)->capture_default_str()->check(at_least(0, false));
  app.add_option("--prefill-chunk-tokens", a.prefill_chunk_tokens,
                 "CUDA path: prefill whole sequences in waves of at most this many tokens")
      ->group(g_dev)->capture_default_str()->check(at_least(0, true));
  app.add_option("--prefill-moe-chunk-tokens", a.prefill_moe_chunk_tokens,
                 "CUDA path: a prefill wave's MoE layers run over chunks of at most this many tokens (at least the "
                 "batch), so that the "
                 "routed experts' workspaces hold a chunk, not the wave (each chunk streams the layer's host experts "
                 "again); 0 = the whole wave")
      ->group(g_dev)->capture_default_str()->check(at_least(0, false));
  app.add_option("--prefill-attn-mib", a.prefill_attn_mib,
                 "CUDA path: scores + probabilities of one prefill attention block, MiB")
      ->group(g_dev)->capture_default_str()->check(at_least(0, true));
  app.add_option("--router-zipf", a.router_zipf,
                 "CUDA path, --random-weights only: S > 0 adds a synthetic per-layer bias to the router logits, "
                 "beta*ln(w_r) with w_r = r^-S for the expert of rank r in a random permutation of the layer's "
                 "experts (seeded by --seed) and beta = initializer_range*sqrt(hidden)*sqrt(6)/pi (the Gumbel scale "
                 "of a random router's logits), so that routing frequencies follow a Zipf law of exponent S "
                 "approximately; 0 = no bias")
      ->group(g_dev)->capture_default_str();
  app.add_option("--expert-placement", a.expert_placement,
                 "CUDA path: id = routed experts on the GPU by id while the budget lasts; hot = the same at load, then "
                 "after the prefill each MoE layer's hottest host experts (routed rows counted in the prefill) swap "
                 "places with its coldest GPU experts where the host one got more rows, at most "
                 "--migrate-max-experts pairs per layer (and during the decode with --migrate-every-steps); layers = whole MoE layers' "
                 "routed experts on the GPU, first layers first, while the budget lasts (the later layers' experts all "
                 "in host memory, as llama.cpp's per-layer -ot overrides put them; no migration)")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"id", "hot", "layers"}));
  app.add_option("--migrate-max-experts", a.migrate_max_experts,
                 "CUDA path, --expert-placement hot: most expert swaps per MoE layer after the prefill")
      ->group(g_dev)->capture_default_str()->check(CLI::Range(0, 1 << 20));
  app.add_option("--migrate-every-steps", a.migrate_every_steps,
                 "CUDA path, --expert-placement hot: 0 = migrate after the prefill only; N = also after every N-th "
                 "decode step, by the routed rows counted from the prefill on, at most --migrate-max-experts pairs per "
                 "layer each time (the copies run between the steps, in their time)")
      ->group(g_dev)->capture_default_str()->check(CLI::Range(0, 1 << 20));
  app.add_option("--migration", a.migration,
                 "CUDA path, --expert-placement hot: swap = move the loaded bytes (device expert to host memory, host "
                 "expert to its device slot); reload = re-read both experts from the checkpoint (or the random "
                 "generator) into their new places: the same final placement by another route, to test the swap")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"swap", "reload"}));
  app.add_flag("--no-warmup", a.no_warmup,
               "CUDA path: skip the untimed warm-up before prefill (a decode step on throw-away sequences and one "
               "layer of the first prefill wave's shape on pseudo-random tokens; the timed prefill and first decode "
               "step then pay the first-call costs)")
      ->group(g_dev);
  app.add_flag("--no-dram-ceiling", a.no_dram_ceiling,
               "CUDA path: skip the host DRAM read ceiling measured at setup when routed experts are in host memory "
               "(all CPU-expert threads stream-read a buffer of max(1 GiB, 8 x L3), best of 5 passes; about a second): "
               "the decode summary then gives the CPU experts' bytes per step but no bound; refused where every "
               "routed expert is on the device")
      ->group(g_dev);
  app.add_flag("--skip-if-no-device", a.skip_if_no_device,
               "with --device cuda: exit 77 (ctest SKIPPED) instead of failing when there is no CUDA device")
      ->group(g_dev);
  auto* g_prompt = "Prompt";
  app.add_option("--prompt", a.prompts, "token ids \"1,2,3\"; ';' separates sequences (ragged batch); repeatable")
      ->group(g_prompt)
      ->allow_extra_args(false);  // one value per use: a model directory after it stays positional
  app.add_option("--prompt-file", a.prompt_file, "one prompt per line, token ids separated by ',' or spaces")->group(g_prompt);
  app.add_option("--batch", a.batch, "sequences (default: number of prompts, or 1); prompts are cycled")
      ->group(g_prompt)
      ->check(at_least(1, false));
  app.add_option("--prompt-len", a.prompt_len, "random prompts: N tokens, or MIN:MAX (ragged)")
      ->group(g_prompt)->capture_default_str();
  app.add_option("--max-new-tokens", a.max_new_tokens, "tokens to generate per sequence (with --expect: the reference's steps)")
      ->group(g_prompt)->capture_default_str()->check(at_least(1, false));
  app.add_flag("--allow-long-context", a.allow_long_context,
               "run sequences past the config's max_position_embeddings (longest prompt + --max-new-tokens - 1 "
               "positions; refused without this flag)")
      ->group(g_prompt);
  auto* g_sample = "Sampling";
  app.add_option("--temperature", a.temperature, "0 = greedy")
      ->group(g_sample)->capture_default_str()->check(at_least(0, false));
  app.add_option("--top-p", a.top_p, "nucleus sampling mass")
      ->group(g_sample)->capture_default_str()->check(in_open_closed(0, 1));
  app.add_option("--top-k", a.top_k, "keep the K most likely (0 = all)")
      ->group(g_sample)->capture_default_str()->check(at_least(0, false));
  app.add_option("--seed", a.seed, "seed of random weights, random prompts and sampling")->group(g_sample)->capture_default_str();
  app.add_flag("--stop-at-eos", a.stop_at_eos,
               "a sequence stops after sampling an EOS token (config.json's eos_token_id) and leaves the batch, its KV "
               "blocks returned to the cache (default: every sequence generates --max-new-tokens)")
      ->group(g_sample);
  app.add_option("--eos-token-id", a.eos_token_ids,
                 "a stop token instead of the config's eos_token_id; repeatable (implies --stop-at-eos)")
      ->group(g_sample)
      ->allow_extra_args(false);
  auto* g_kv = "KV cache";
  app.add_option("--policy", a.policy, "roofline | fixed:R | gpu_only | cpu_only")->group(g_kv)->capture_default_str();
  app.add_option("--block-tokens", a.block_tokens, "tokens per block (all regions)")
      ->group(g_kv)->capture_default_str()->check(at_least(1, false));
  app.add_option("--d-window", a.d_window, "D: GPU window and eviction batch, a multiple of the block size")
      ->group(g_kv)->capture_default_str()->check(at_least(1, false));
  app.add_option("--ping-pong-mib", a.ping_pong_mib, "bytes of one ping-pong buffer, MiB")->group(g_kv)->capture_default_str();
  app.add_option("--first-chunk-mib", a.first_chunk_mib,
                 "first ping-pong fill of a step, MiB; each next fill doubles up to a buffer (0: no ramp)")
      ->group(g_kv)
      ->check(at_least(0, false))
      ->capture_default_str();
  app.add_option("--ping-pong-blocks", a.ping_pong_blocks, "blocks per ping-pong buffer (instead of --ping-pong-mib)")
      ->group(g_kv)->check(at_least(1, false));
  app.add_option("--ping-pong-buffers", a.ping_pong_buffers, "ping-pong buffers")
      ->group(g_kv)->capture_default_str()->check(at_least(2, false));
  app.add_option("--gpu-split-blocks", a.gpu_split_blocks, "streamed blocks per GPU partial")
      ->group(g_kv)->capture_default_str()->check(at_least(1, false));
  app.add_option("--cpu-task-blocks", a.cpu_task_blocks, "blocks per CPU attention task")
      ->group(g_kv)->capture_default_str()->check(at_least(1, false));
  app.add_option("--kv-vram-budget-mib", a.kv_vram_budget_mib, "D-window + ping-pong must fit (0 = no limit)")->group(g_kv);
  auto* o_cal = app.add_option("--calibration", a.calibration,
                               "roofline A, B, C_CPU, C_GPU at init from this bench/calibrate --out file: the entry of the "
                               "preset with the model's attention geometry, nearest calibrated batch (docs/DECODERS.md)")
                    ->group(g_kv);
  app.add_option("--calibration-preset", a.calibration_preset,
                 "with --calibration: use this preset's entry (qwen3 | mixtral | dsv2) even if the geometry differs; "
                 "A and B are scaled by KV bytes per token")
      ->group(g_kv)->needs(o_cal);
  app.add_option("--cpu-bw-gbps", a.cpu_bw_gbps, "roofline A at admission: KV bytes/token / this (without --calibration)")
      ->group(g_kv)->capture_default_str()->excludes(o_cal);
  app.add_option("--h2d-bw-gbps", a.h2d_bw_gbps, "roofline B: KV bytes/token / this (without --calibration)")
      ->group(g_kv)->capture_default_str()->excludes(o_cal);
  app.add_option("--cpu-fixed-us", a.cpu_fixed_us,
                 "roofline C_CPU, per step and layer (without --calibration; default 100 with --device cuda, else 0)")->group(g_kv)->excludes(o_cal);
  app.add_option("--gpu-fixed-us", a.gpu_fixed_us, "roofline C_GPU, per step (without --calibration)")->group(g_kv)->excludes(o_cal);
  app.add_flag("--track-gpu-cost", a.track_gpu_cost, "re-measure B online too")->group(g_kv);
  app.add_option("--all-gpu-steps", a.all_gpu_steps,
                 "on = a layer's attention step whose batch has no block in the unpinned region (and no assisted "
                 "block) runs without a CPU side: no query copy to the host, no wait for the device; off = every "
                 "step runs the CPU side (the same bits; the ablation)")
      ->group(g_kv)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--cpu-assist", a.cpu_assist,
                 "the CPU engine also attends pinned blocks in place, per step: off | adaptive (balanced from the "
                 "measured per-token times) | fixed:F (fraction F of each sequence's pinned blocks)")
      ->group(g_kv)->capture_default_str();
  app.add_option("--placement-headroom", a.placement_headroom,
                 "roofline policy: CPU share placed below the roofline's balance (default: 0.05 with --device "
                 "cuda, whose GPU side is steadier than the CPU side, and with --cpu-assist adaptive, which takes it "
                 "back per step; else 0 = the paper's balance)")
      ->group(g_kv)->check(CLI::Range(0.0, 0.99));
  app.add_option("--placement-headroom-z", a.placement_headroom_z,
                 "roofline policy: plan the CPU side for A + Z standard deviations of its measured per-step A "
                 "(the headroom follows how much the CPU engine's time wanders; 0 = off, A's mean)")
      ->group(g_kv)->capture_default_str()->check(CLI::Range(0.0, 10.0));
  app.add_option("--eviction-bounce-mib", a.eviction_bounce_mib,
                 "--device cuda: page-locked bounce buffer for evictions into the unpinned region "
                 "(0 = direct copies into pageable memory)")
      ->group(g_kv)->capture_default_str()->check(CLI::Range(0.0, 4096.0));
  app.add_option("--hbm-read-gbps", a.hbm_read_gbps,
                 "GB/s at which the HBM KV region's attention reads its KV: the VRAM split's and the roofline's "
                 "H (the roofline re-measures it online); e.g. ws_bench --mode hbm's device_kv_gbps")
      ->group(g_dev)->capture_default_str()->check(CLI::Range(1.0, 1e5));
  app.add_option("--hbm-resident-kernel", a.hbm_resident_kernel,
                 "--device cuda: on = the HBM KV region attended by the split-K resident kernels "
                 "(experimental); off = by the streamed-chunk kernel")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--caller-stream-steps", a.caller_stream_steps,
                 "--device cuda: on = an all-GPU attention step that streams nothing (every token of the batch "
                 "in HBM or the D-window) runs on the caller stream, no event between streams; off = on the "
                 "engine's compute and copy streams (the same bits)")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--decode-graphs", a.decode_graphs,
                 "--device cuda: on = each decode layer's device-only work (RMSNorm and projections; output "
                 "projection and FFN where the MoE is grouped on the device or the layer is dense) replayed from "
                 "CUDA graphs captured at its second step; off = every call enqueued each step (the same bits)")
      ->group(g_dev)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--launch-thread", a.launch_thread,
                 "--device cuda: on = a launcher thread enqueues each layer's streamed chunks while the "
                 "CPU engine runs; off = the host thread enqueues them before it starts the CPU engine")
      ->group(g_kv)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  app.add_option("--assist-max-fraction", a.assist_max_fraction,
                 "adaptive assist: most of a sequence's pinned blocks the CPU engine takes in one step")
      ->group(g_kv)->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_option("--threads", a.threads,
                 "CPU threads: GEMMs use N, the CPU attention engine N-1 (0 = all cores; unless OMP_WAIT_POLICY "
                 "is set, OpenMP threads spin with --device cuda and wait passively otherwise)")
      ->group(g_kv)
      ->check(at_least(0, false))
      ->check(at_most_hardware_threads());
  app.add_flag("--poison", a.poison, "fill every cache region with poison at init (debug)")->group(g_kv);
  auto* g_out = "Output";
  app.add_option("--json", a.json_out, "write the summary as JSON")->group(g_out);
  app.add_option("--logits-out", a.logits_out,
                 "write every generated token's logits, raw little-endian fp32 [sequence][step][vocab] (for bit-exact "
                 "comparisons of two runs)")
      ->group(g_out);
  app.add_flag("--progress", a.progress, "progress bar on stderr even when it is not a terminal")->group(g_out);
  app.add_flag("--no-progress", a.no_progress, "no progress bar")->group(g_out);
  app.add_flag("-q,--quiet", a.quiet, "no summary")->group(g_out);
  app.add_option("--per-sequence", a.per_sequence,
                 "the summary also lists the first N sequences (each one's placement line and its generated tokens), "
                 "or every one with all; default 0: only the aggregates over all sequences (the --json summary always "
                 "has every sequence)")
      ->group(g_out)
      ->type_name("N|all")
      ->check(count_or_all());
  app.add_option("--expect", a.expect,
                 "reference run (expected.json from tools/make_fixtures.py): greedy over the reference's prompts and steps, "
                 "compare logits and tokens, exit 3 on mismatch")
      ->group(g_out);
  app.add_flag("--teacher-force", a.teacher_force,
               "with --expect: feed the reference's greedy tokens back (logits stay comparable where a greedy choice "
               "flips); tokens are reported, not required")
      ->group(g_out);
  app.add_option("--logit-tol", a.logit_tol, "max |logit - transformers| for --expect (default: the file's logit_tolerance)")
      ->group(g_out);
  app.add_option("--logit-tol-bf16-kv", a.logit_tol_bf16_kv,
                 "max |logit - transformers with bf16 KV| for --expect (default: the file's logit_tolerance_bf16_kv)")
      ->group(g_out);
  try {
    app.parse(argc, argv);
    for (int i = 0; i < argc; ++i) a.command_line += (i ? " " : "") + std::string(argv[i]);
    for (const CLI::Option* opt : app.get_options())
      if (opt->count() > 0 && !opt->get_lnames().empty()) {
        std::string v;
        for (const std::string& r : opt->results()) v += (v.empty() ? "" : ",") + r;
        a.given["--" + opt->get_lnames().front()] = v;
      }
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "ws_decode: error: %s (ws_decode --help lists the options)\n", e.what());
    return 1;
  }
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::string m = e.what();
    for (char& ch : m)
      if (ch == '\n') ch = ' ';
    std::fprintf(stderr, "ws_decode: error: %s\n", m.c_str());
    return 1;
  }
}
