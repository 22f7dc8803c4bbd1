// SPDX-License-Identifier: Apache-2.0
// bench/admission_bench.cpp — admission and release speed of inplace_kv_cache
// against the number of sequences: for each count N, a fresh cache of N
// D-window slots (host_backend, cpu_only policy) admits N sequences with
// begin_sequence(P) and ends them all with end_sequence; the fastest of
// --repeats runs (admission and release each) is reported as sequences per second, with the free-list
// probes per admission (inplace_kv_cache::admission_probes). O(1) admission
// shows as a rate that does not fall with N.
//
// The cache is one layer of one KV head (GQA, head_dim 64: 256 B per token)
// with blocks of --block-tokens tokens and D = one block, so 100K sequences
// take 25 MiB of D-window at the defaults; P = --prompt-tokens (default 0:
// the slot and the id only) places floor(P/D) eviction batches per sequence.
// Output: a table on stdout, progress on stderr, and (--json) a JSON file
// rewritten after every row.
//
//   admission_bench [--counts 1K,10K,100K] [--prompt-tokens 0] [--block-tokens 1] [--repeats 3] [--json PATH]
#include <writescope/writescope.hpp>

#include "bench_util.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace ws = writescope;
using ws::index_t;

namespace {

using namespace wsb;  // bench_util.hpp: number and list parsing, machine facts, JSON file

using layout = ws::gqa_layout<64>;
using cache_type = ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::cpu_only>;

struct row {
  index_t sequences = 0, prompt_tokens = 0;
  double admit_seconds = 0, release_seconds = 0;
  double admit_per_second = 0, release_per_second = 0;
  double probes_per_admission = 0;
};

/// One run: a fresh cache, N admissions, N releases (releases in admission order).
row run_once(index_t n, index_t prompt_tokens, int block_tokens) {
  ws::host_backend backend;
  const layout lay(1, 1);
  ws::partition_spec s;
  s.num_layers = 1;
  s.block_tokens = block_tokens;
  s.d_window_tokens = block_tokens;
  s.max_sequences = int(n);
  s.cpu_capacity_tokens = std::max<index_t>(block_tokens, n * (prompt_tokens / block_tokens) * block_tokens);
  s.pinned_capacity_tokens = 0;
  s.gpu_split_blocks = 1;
  s.cpu_task_blocks = 1;
  s.ping_pong_bytes = 4 * ws::block_format<layout>{lay, block_tokens}.block_bytes();
  cache_type cache(backend, lay, s, ws::cpu_only{});
  std::vector<ws::sequence_id> ids(static_cast<std::size_t>(n));
  row r;
  r.sequences = n;
  r.prompt_tokens = prompt_tokens;
  const auto t0 = clock_type::now();
  for (index_t i = 0; i < n; ++i) ids[std::size_t(i)] = cache.begin_sequence(prompt_tokens);
  r.admit_seconds = seconds_since(t0);
  r.probes_per_admission = double(cache.admission_probes()) / double(n);
  const auto t1 = clock_type::now();
  for (ws::sequence_id id : ids) cache.end_sequence(id);
  r.release_seconds = seconds_since(t1);
  return r;
}

int usage(const char* why) {
  if (why) std::fprintf(stderr, "admission_bench: %s\n", why);
  std::fputs(
      "admission_bench [--counts 1K,10K,100K] [--prompt-tokens 0] [--block-tokens 1] [--repeats 3] [--json PATH]\n"
      "  --counts N,...       sequences admitted into a fresh cache per row (K = 1024 is accepted: 1K)\n"
      "  --prompt-tokens P    prompt length of every sequence (floor(P/D) batches placed each; default 0)\n"
      "  --block-tokens T     tokens per block, and D (one block; default 1)\n"
      "  --repeats R          runs per row, the fastest reported (default 3)\n"
      "  --json PATH          results + machine info as JSON (rewritten after every row)\n",
      why ? stderr : stdout);
  return why ? 2 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<index_t> counts{1000, 10000, 100000};
  index_t prompt_tokens = 0;
  int block_tokens = 1, repeats = 3;
  std::string json_path;
  try {
    arg_reader a(argc, argv);
    while (a.next()) {
      const std::string& f = a.flag();
      if (f == "--counts") counts = parse_list<index_t>(f, a.value());
      else if (f == "--prompt-tokens") prompt_tokens = parse_number<index_t>(f, a.value());
      else if (f == "--block-tokens") block_tokens = parse_number<int>(f, a.value());
      else if (f == "--repeats") repeats = parse_number<int>(f, a.value());
      else if (f == "--json") json_path = a.value();
      else if (f == "--help" || f == "-h") return usage(nullptr);
      else throw usage_error("unknown flag '" + f + "' (--help)");
    }
    for (index_t n : counts)
      if (n < 1 || n > INT32_MAX) throw usage_error("--counts: " + std::to_string(n) + " is outside [1, 2^31-1]");
    if (prompt_tokens < 0) throw usage_error("--prompt-tokens: must be >= 0, not " + std::to_string(prompt_tokens));
    if (block_tokens < 1) throw usage_error("--block-tokens: must be >= 1, not " + std::to_string(block_tokens));
    if (repeats < 1) throw usage_error("--repeats: must be >= 1, not " + std::to_string(repeats));
  } catch (const usage_error& e) {
    return usage(e.what());
  }

  try {
    json_file out(json_path);
    out.doc["benchmark"] = "admission_bench";
    out.doc["machine"] = machine_info(argc, argv);
    out.doc["settings"] = {{"prompt_tokens", prompt_tokens}, {"block_tokens", block_tokens}, {"repeats", repeats},
                           {"layout", "GQA 1 q / 1 kv head, head_dim 64"}, {"policy", "cpu_only"}};
    out.doc["results"] = json::array();
    std::printf("admission into a fresh inplace_kv_cache (host backend, cpu_only), prompt %lld tokens, D %d tokens; "
                "best of %d\n",
                static_cast<long long>(prompt_tokens), block_tokens, repeats);
    std::printf("%10s %12s %14s %12s %14s %16s\n", "sequences", "admit s", "admit seq/s", "release s", "release seq/s",
                "probes/admission");
    for (index_t n : counts) {
      std::fprintf(stderr, "admission_bench: %lld sequences x %d\n", static_cast<long long>(n), repeats);
      row best = run_once(n, prompt_tokens, block_tokens);  // the fastest admission and the fastest release
      for (int k = 1; k < repeats; ++k) {
        const row r = run_once(n, prompt_tokens, block_tokens);
        best.admit_seconds = std::min(best.admit_seconds, r.admit_seconds);
        best.release_seconds = std::min(best.release_seconds, r.release_seconds);
      }
      best.admit_per_second = double(n) / std::max(best.admit_seconds, 1e-12);
      best.release_per_second = double(n) / std::max(best.release_seconds, 1e-12);
      std::printf("%10lld %12.6f %14.0f %12.6f %14.0f %16.2f\n", static_cast<long long>(n), best.admit_seconds,
                  best.admit_per_second, best.release_seconds, best.release_per_second, best.probes_per_admission);
      std::fflush(stdout);
      out.doc["results"].push_back({{"sequences", best.sequences},
                                    {"prompt_tokens", best.prompt_tokens},
                                    {"admit_seconds", best.admit_seconds},
                                    {"admit_sequences_per_second", best.admit_per_second},
                                    {"release_seconds", best.release_seconds},
                                    {"release_sequences_per_second", best.release_per_second},
                                    {"probes_per_admission", best.probes_per_admission}});
      out.write();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "admission_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
