// SPDX-License-Identifier: Apache-2.0
// tests/soak/soak_core.hpp — the soak loop shared by ws_soak (host backend)
// and ws_soak_cuda (cuda_backend): N decode steps over one cache with
// sequences arriving and leaving at random prompt and decode lengths (their
// blocks and D-window slots are reused in place), checking
//   * the output of every sequence against the fp64 reference every
//     `check_every` steps (all layers) — and the last step;
//   * the block accounting every step: usage() used blocks == the blocks of
//     the live sequences, live counts agree; after the last sequence ends,
//     zero blocks are used (nothing leaked);
//   * memory: host RSS, pinned-region bytes and (CUDA) device bytes in use
//     sampled every `sample_every` steps; after the warm-up (`warmup` of the
//     steps) each must stay within 5 % (+ 8 MiB for RSS) of its value at the
//     end of the warm-up. The pinned region is fully pinned at init
//     (pinned_initial_tokens = -1), so its bytes must not move at all.
// Prints a table of samples and one summary line; writes JSON when asked.
// Exit status: 0 ok, 1 a check failed, 2 bad arguments.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "support/harness.hpp"

namespace wssoak {

using namespace writescope;
using wstest::compare_result;

struct options {
  long steps = 5000;
  int layers = 2;
  int hq = 8, hkv = 2;
  int max_sequences = 8;
  int block_tokens = 16;
  int d_window = 64;
  index_t max_prompt = 300;
  index_t max_decode = 600;
  int check_every = 100;
  int sample_every = 250;
  double warmup = 0.2;
  int threads = 1;
  std::string policy = "roofline";  // roofline | fixed | gpu | cpu
  double cpu_share = 0.5;
  std::uint64_t seed = 1;
  std::string json;
};

inline void usage(const char* argv0) {
  std::printf(
      "usage: %s [--steps N] [--layers N] [--heads HQ:HKV] [--max-seqs N] [--block N] [--d-window N]\n"
      "          [--max-prompt N] [--max-decode N] [--check-every N] [--sample-every N] [--warmup F]\n"
      "          [--threads N] [--policy roofline|fixed|gpu|cpu] [--cpu-share R] [--seed N] [--json FILE]\n",
      argv0);
}

/// Parses argv; returns false (after printing why) on a bad argument.
inline bool parse(int argc, char** argv, options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        return nullptr;
      }
      return argv[++i];
    };
    const char* v = nullptr;
    if (a == "--help" || a == "-h") {
      usage(argv[0]);
      std::exit(0);
    }
    if (!(v = next())) return false;
    if (a == "--steps") o.steps = std::atol(v);
    else if (a == "--layers") o.layers = std::atoi(v);
    else if (a == "--heads") {
      if (std::sscanf(v, "%d:%d", &o.hq, &o.hkv) != 2) return false;
    } else if (a == "--max-seqs") o.max_sequences = std::atoi(v);
    else if (a == "--block") o.block_tokens = std::atoi(v);
    else if (a == "--d-window") o.d_window = std::atoi(v);
    else if (a == "--max-prompt") o.max_prompt = std::atol(v);
    else if (a == "--max-decode") o.max_decode = std::atol(v);
    else if (a == "--check-every") o.check_every = std::atoi(v);
    else if (a == "--sample-every") o.sample_every = std::atoi(v);
    else if (a == "--warmup") o.warmup = std::atof(v);
    else if (a == "--threads") o.threads = std::atoi(v);
    else if (a == "--policy") o.policy = v;
    else if (a == "--cpu-share") o.cpu_share = std::atof(v);
    else if (a == "--seed") o.seed = std::strtoull(v, nullptr, 10);
    else if (a == "--json") o.json = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      usage(argv[0]);
      return false;
    }
  }
  if (o.steps < 1 || o.max_sequences < 1 || o.check_every < 1 || o.sample_every < 1 || o.max_prompt < 1 ||
      o.max_decode < 1 || o.warmup < 0 || o.warmup >= 1) {
    std::fprintf(stderr, "bad sizes\n");
    return false;
  }
  return true;
}

/// Resident host memory of this process (bytes), from /proc/self/statm.
inline index_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = 0;
  in >> pages >> resident;
  return index_t(resident) * index_t(::sysconf(_SC_PAGESIZE));
}

/// A region spec that holds max_sequences sequences of the longest length at
/// any split: the soak never runs out of blocks (a refusal would be a bug).
inline partition_spec soak_spec(const options& o) {
  partition_spec s;
  s.num_layers = o.layers;
  s.block_tokens = o.block_tokens;
  s.d_window_tokens = o.d_window;
  s.max_sequences = o.max_sequences;
  const index_t per_seq = o.max_prompt + o.max_decode + o.d_window;
  s.cpu_capacity_tokens = per_seq * o.max_sequences;
  s.pinned_capacity_tokens = per_seq * o.max_sequences;
  s.pinned_initial_tokens = -1;  // pinned once, at init: its bytes must stay flat
  s.gpu_split_blocks = 4;
  s.cpu_task_blocks = 8;
  return s;
}

struct sample {
  long step;
  int live;
  index_t tokens, cpu_used, pinned_used, rss, pinned_bytes, device_bytes;
  double max_rel_l2;
};

/// The loop. `Driver` is wstest::decode_driver or wstest::dev::device_decode_driver
/// (add / remove / step / cache()). `device_bytes()` returns the device memory in
/// use (0 when there is no device).
template <class Driver>
int run(Driver& d, const options& o, const std::function<index_t()>& device_bytes, const char* backend_name) {
  auto& cache = d.cache();
  std::mt19937_64 rng(o.seed);
  auto uniform = [&](index_t lo, index_t hi) { return std::uniform_int_distribution<index_t>(lo, hi)(rng); };
  struct live_seq {
    sequence_id id;
    index_t remaining;
  };
  std::vector<live_seq> live;
  long arrived = 0, left = 0, checked_steps = 0, failures = 0;
  double worst = 0.0;
  index_t tokens_checked = 0;
  std::vector<sample> samples;
  const auto t0 = std::chrono::steady_clock::now();

  auto accounting = [&](const char* when, long step) {
    index_t cpu = 0, pin = 0;
    for (const live_seq& s : live) {
      cpu += index_t(cache.sequence(s.id).cpu_blocks.size());
      pin += index_t(cache.sequence(s.id).pinned_blocks.size());
    }
    const region_usage u = cache.usage();
    if (u.cpu_used_blocks != cpu || u.pinned_used_blocks != pin || u.live_sequences != int(live.size())) {
      std::printf("FAIL accounting %s step %ld: usage cpu %lld pinned %lld live %d; sequences hold cpu %lld pinned %lld live %zu\n",
                  when, step, (long long)u.cpu_used_blocks, (long long)u.pinned_used_blocks, u.live_sequences,
                  (long long)cpu, (long long)pin, live.size());
      ++failures;
    }
  };
  auto take_sample = [&](long step) {
    sample s{};
    s.step = step;
    s.live = int(live.size());
    for (const live_seq& l : live) s.tokens += cache.sequence(l.id).total_tokens(0);
    const region_usage u = cache.usage();
    s.cpu_used = u.cpu_used_blocks;
    s.pinned_used = u.pinned_used_blocks;
    s.rss = rss_bytes();
    s.pinned_bytes = u.pinned_region_bytes;
    s.device_bytes = device_bytes();
    s.max_rel_l2 = worst;
    samples.push_back(s);
    std::printf("%8ld %5d %9lld %8lld %8lld %10.1f %10.1f %10.1f %10.2e\n", s.step, s.live, (long long)s.tokens,
                (long long)s.cpu_used, (long long)s.pinned_used, double(s.rss) / 1048576.0,
                double(s.pinned_bytes) / 1048576.0, double(s.device_bytes) / 1048576.0, s.max_rel_l2);
    std::fflush(stdout);
  };

  std::printf("soak on %s: %ld steps, %d layers, Hq %d / Hkv %d, block %d, D %d, <= %d sequences, prompts 1..%lld, "
              "decode 1..%lld tokens, policy %s, %d CPU threads, check every %d steps\n",
              backend_name, o.steps, o.layers, o.hq, o.hkv, o.block_tokens, o.d_window, o.max_sequences,
              (long long)o.max_prompt, (long long)o.max_decode, o.policy.c_str(), o.threads, o.check_every);
  std::printf("%8s %5s %9s %8s %8s %10s %10s %10s %10s\n", "step", "live", "tokens", "cpu_blk", "pin_blk", "rss_MiB",
              "pinned_MiB", "device_MiB", "max_err");

  for (long step = 0; step < o.steps; ++step) {
    // Departures: sequences that reached their length leave (blocks back to the pools).
    for (std::size_t i = 0; i < live.size();) {
      if (live[i].remaining <= 0) {
        d.remove(live[i].id);
        live.erase(live.begin() + std::ptrdiff_t(i));
        ++left;
      } else {
        ++i;
      }
    }
    // Arrivals: up to two per step while slots are free, at random.
    for (int k = 0; k < 2 && int(live.size()) < o.max_sequences; ++k) {
      if (!live.empty() && uniform(0, 3) != 0) break;
      const index_t p = uniform(1, o.max_prompt);
      const sequence_id id = d.add(p, o.seed * 1000003 + std::uint64_t(arrived));
      live.push_back({id, uniform(1, o.max_decode)});
      ++arrived;
    }
    std::vector<sequence_id> batch;
    for (const live_seq& s : live) batch.push_back(s.id);
    const bool check = step % o.check_every == 0 || step + 1 == o.steps;
    const compare_result r = d.step(batch, check);
    if (check) {
      ++checked_steps;
      for (sequence_id id : batch) tokens_checked += d.history(id, 0).tokens;
      worst = std::max(worst, r.max_rel_l2);
      if (!r.ok()) {
        std::printf("FAIL step %ld: rel_l2 %.3e lse %.3e non-finite %d (batch %zu)\n", step, r.max_rel_l2,
                    r.max_lse_err, int(r.non_finite), batch.size());
        ++failures;
      }
    }
    for (live_seq& s : live) --s.remaining;
    accounting("after step", step);
    if (step % o.sample_every == 0) take_sample(step);
    if (failures > 10) break;
  }
  take_sample(o.steps);
  for (const live_seq& s : live) d.remove(s.id);
  left += long(live.size());
  live.clear();
  accounting("after the last sequence ended", o.steps);
  const region_usage u = cache.usage();
  if (u.cpu_used_blocks != 0 || u.pinned_used_blocks != 0 || u.live_sequences != 0) {
    std::printf("FAIL leak: %lld cpu and %lld pinned blocks still used, %d sequences live after all ended\n",
                (long long)u.cpu_used_blocks, (long long)u.pinned_used_blocks, u.live_sequences);
    ++failures;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Memory after warm-up: every later sample within 5 % (+ 8 MiB RSS) of the first one after it.
  const long warm_step = long(double(o.steps) * o.warmup);
  const sample* base = nullptr;
  index_t rss_max = 0, pin_max = 0, dev_max = 0, pin_min = INT64_MAX, dev_min = INT64_MAX;
  for (const sample& s : samples) {
    if (s.step < warm_step) continue;
    if (!base) base = &s;
    rss_max = std::max(rss_max, s.rss);
    pin_max = std::max(pin_max, s.pinned_bytes);
    pin_min = std::min(pin_min, s.pinned_bytes);
    dev_max = std::max(dev_max, s.device_bytes);
    dev_min = std::min(dev_min, s.device_bytes);
  }
  const double mib = 1048576.0;
  double rss_drift = 0, dev_drift = 0;
  if (base) {
    rss_drift = double(rss_max - base->rss) / double(base->rss);
    dev_drift = base->device_bytes > 0 ? double(dev_max - dev_min) / double(base->device_bytes) : 0.0;
    if (double(rss_max) > 1.05 * double(base->rss) + 8 * mib) {
      std::printf("FAIL host RSS grew after warm-up: %.1f MiB at step %ld, up to %.1f MiB\n", double(base->rss) / mib,
                  base->step, double(rss_max) / mib);
      ++failures;
    }
    if (pin_max != pin_min) {
      std::printf("FAIL pinned region bytes moved after warm-up: %.1f .. %.1f MiB\n", double(pin_min) / mib,
                  double(pin_max) / mib);
      ++failures;
    }
    if (double(dev_max) > 1.05 * double(dev_min) + 8 * mib) {
      std::printf("FAIL device memory in use grew after warm-up: %.1f .. %.1f MiB\n", double(dev_min) / mib,
                  double(dev_max) / mib);
      ++failures;
    }
  }
  std::printf("soak %s: %ld steps in %.1f s (%.2f ms/step), %ld sequences arrived, %ld left; %ld steps checked "
              "against fp64 (%lld KV tokens of layer 0), worst rel_l2 %.2e; host RSS after warm-up %.1f MiB, max %.1f "
              "MiB (drift %+.2f %%); pinned %.1f MiB flat=%s; device in use %.1f..%.1f MiB (drift %+.2f %%); "
              "blocks leaked: %lld\n",
              failures ? "FAILED" : "ok", o.steps, secs, 1e3 * secs / double(o.steps), arrived, left, checked_steps,
              (long long)tokens_checked, worst, base ? double(base->rss) / mib : 0.0, double(rss_max) / mib,
              100.0 * rss_drift, double(pin_max) / mib, pin_max == pin_min ? "yes" : "no",
              dev_min == INT64_MAX ? 0.0 : double(dev_min) / mib, double(dev_max) / mib, 100.0 * dev_drift,
              (long long)(u.cpu_used_blocks + u.pinned_used_blocks));
  if (!o.json.empty()) {
    std::ofstream j(o.json);
    j << "{\"backend\": \"" << backend_name << "\", \"steps\": " << o.steps << ", \"seconds\": " << secs
      << ", \"arrived\": " << arrived << ", \"left\": " << left << ", \"checked_steps\": " << checked_steps
      << ", \"worst_rel_l2\": " << worst << ", \"rss_after_warmup_bytes\": " << (base ? base->rss : 0)
      << ", \"rss_max_bytes\": " << rss_max << ", \"rss_drift\": " << rss_drift << ", \"pinned_bytes\": " << pin_max
      << ", \"device_min_bytes\": " << (dev_min == INT64_MAX ? 0 : dev_min) << ", \"device_max_bytes\": " << dev_max
      << ", \"failures\": " << failures << ", \"samples\": [";
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const sample& s = samples[i];
      j << (i ? ", " : "") << "{\"step\": " << s.step << ", \"live\": " << s.live << ", \"tokens\": " << s.tokens
        << ", \"rss\": " << s.rss << ", \"pinned\": " << s.pinned_bytes << ", \"device\": " << s.device_bytes
        << ", \"cpu_blocks\": " << s.cpu_used << ", \"pinned_blocks\": " << s.pinned_used << "}";
    }
    j << "]}\n";
  }
  return failures ? 1 : 0;
}

/// Builds the policy named by o.policy and calls f(policy).
template <class F>
int with_policy(const options& o, F&& f) {
  if (o.policy == "fixed") return f(fixed_ratio(o.cpu_share));
  if (o.policy == "gpu") return f(gpu_only{});
  if (o.policy == "cpu") return f(cpu_only{});
  if (o.policy == "roofline") {
    roofline_params p;
    p.cpu_cost_per_token_seconds = 2.6e-8;
    p.gpu_cost_per_token_seconds = 3.8e-8;
    return f(roofline_policy(p));
  }
  std::fprintf(stderr, "unknown policy %s (roofline, fixed, gpu, cpu)\n", o.policy.c_str());
  return 2;
}

}  // namespace wssoak
