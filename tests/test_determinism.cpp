// SPDX-License-Identifier: Apache-2.0
// Determinism and batch invariance (FAULT-KINDS K10), beyond test_faults.cpp
// (reruns and thread counts in one process) and test_cache.cpp (one fixed
// batch vs solo runs):
//   * a sequence alone vs inside *any* batch — batchmates joining and leaving
//     mid-run, random batch order and membership every step, pools recycled
//     and fragmented by earlier sequences, 1-3 CPU threads — is bit-identical
//     at a fixed split (fixed_ratio r, and the gpu_only / cpu_only extremes);
//   * reruns across processes are bit-identical: the hash of every output and
//     LSE of a fixed scenario is the same in this process and in child
//     processes (fresh address-space layout, other malloc patterns, other
//     thread counts).
// docs/RELIABILITY.md describes the deterministic mode these tests pin down.
#include <doctest/doctest.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "support/harness.hpp"

extern char** environ;

using namespace wstest;

namespace {

using G = gqa_layout<128>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

partition_spec det_spec(int layers, int max_seqs) {
  partition_spec s = small_spec(layers, max_seqs);  // block 16, D 32, split 4, CPU task 3
  set_ping_pong_blocks(s, G(8, 2), 6);
  s.pinned_growth_tokens = 64;  // several slabs: blocks of one sequence in different mappings
  return s;
}

std::uint64_t fnv1a(std::uint64_t h, const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/// The outputs of the tracked sequence (seed 4242, prompt `prompt`) alone, per step and layer.
std::vector<std::vector<float>> solo_run(double r, index_t prompt, int steps, std::vector<std::vector<float>>& lses) {
  host_backend be;
  host_cache<G, fixed_ratio> cache(be, G(8, 2), det_spec(2, 1), fixed_ratio(r), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 0, gqa_scale);
  const std::vector<sequence_id> one{d.add(prompt, 4242)};
  std::vector<std::vector<float>> outs;
  for (int s = 0; s < steps; ++s) {
    REQUIRE(d.step(one, s % 10 == 0).ok());
    for (int l = 0; l < 2; ++l) {
      outs.push_back(d.layer_out[std::size_t(l)]);
      lses.push_back(d.layer_lse[std::size_t(l)]);
    }
  }
  return outs;
}

/// The fixed scenario of the cross-process test: a ragged batch with a
/// sequence joining and one leaving, 2 layers, fixed_ratio(0.5), `threads`
/// CPU threads; returns the FNV-1a hash of every output and LSE bit.
std::uint64_t scenario_hash(int threads) {
  host_backend be;
  host_cache<G, fixed_ratio> cache(be, G(8, 2), det_spec(2, 4), fixed_ratio(0.5), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{threads, true}, 0, gqa_scale);
  std::vector<sequence_id> batch{d.add(5 * 32 + 3, 11), d.add(1, 12), d.add(97, 13)};
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (int s = 0; s < 60; ++s) {
    if (s == 20) batch.push_back(d.add(40, 14));
    if (s == 35) {
      d.remove(batch[1]);
      batch.erase(batch.begin() + 1);
    }
    REQUIRE(d.step(batch, s % 15 == 0).ok());
    for (int l = 0; l < 2; ++l) {
      h = fnv1a(h, d.layer_out[std::size_t(l)].data(), d.layer_out[std::size_t(l)].size() * sizeof(float));
      h = fnv1a(h, d.layer_lse[std::size_t(l)].data(), d.layer_lse[std::size_t(l)].size() * sizeof(float));
    }
  }
  return h;
}

}  // namespace

TEST_CASE("K10: a sequence alone and inside any batch (mates joining and leaving, recycled pools) is bit-identical") {
  const G lay(8, 2);
  const int steps = 40;
  const std::size_t row = 8 * 128;
  for (const double r : {0.0, 0.5, 1.0}) {
    for (const index_t prompt : {index_t{37}, index_t{100}}) {
      CAPTURE(r);
      CAPTURE(prompt);
      std::vector<std::vector<float>> solo_lse;
      const auto solo = solo_run(r, prompt, steps, solo_lse);
      for (int trial = 0; trial < 2; ++trial) {
        CAPTURE(trial);
        std::mt19937_64 rng(std::uint64_t(trial) * 7919 + std::uint64_t(prompt));
        auto coin = [&](int one_in) { return std::uniform_int_distribution<int>(0, one_in - 1)(rng) == 0; };
        host_backend be;
        host_cache<G, fixed_ratio> cache(be, lay, det_spec(2, 6), fixed_ratio(r), {}, cache_options{true});
        decode_driver<decltype(cache)> d(cache, attention_options{1 + trial, true}, 0, gqa_scale);
        // Recycle and fragment the pools first: junk sequences, some ended.
        std::vector<sequence_id> mates;
        for (int j = 0; j < 1 + trial; ++j) mates.push_back(d.add(index_t(33 + 41 * j), 900 + std::uint64_t(j)));
        for (int s = 0; s < 10 + 7 * trial; ++s) d.step(mates, false);
        std::vector<sequence_id> kept;
        for (std::size_t j = 0; j < mates.size(); ++j) {
          if (j % 2 == 0) d.remove(mates[j]);
          else kept.push_back(mates[j]);
        }
        mates = kept;
        const sequence_id tracked = d.add(prompt, 4242);
        std::uint64_t next_seed = 1000;
        for (int s = 0; s < steps; ++s) {
          // Mates join and leave; each step a random subset of them, in random order, runs with the tracked one.
          if (int(mates.size()) < 5 && coin(4)) mates.push_back(d.add(index_t(rng() % 130), next_seed++));
          if (!mates.empty() && coin(6)) {
            const std::size_t k = rng() % mates.size();
            d.remove(mates[k]);
            mates.erase(mates.begin() + std::ptrdiff_t(k));
          }
          std::vector<sequence_id> batch{tracked};
          for (sequence_id m : mates)
            if (coin(2)) batch.push_back(m);
          std::shuffle(batch.begin(), batch.end(), rng);
          const std::size_t pos = std::size_t(std::find(batch.begin(), batch.end(), tracked) - batch.begin());
          REQUIRE(d.step(batch, s % 12 == 0).ok());
          for (int l = 0; l < 2; ++l) {
            CAPTURE(s);
            CAPTURE(l);
            CAPTURE(batch.size());
            REQUIRE(same_bits(d.layer_out[std::size_t(l)].data() + pos * row, solo[std::size_t(s * 2 + l)].data(), row));
            REQUIRE(same_bits(d.layer_lse[std::size_t(l)].data() + pos * 8, solo_lse[std::size_t(s * 2 + l)].data(), 8));
          }
        }
      }
    }
  }
}

TEST_CASE("determinism scenario: hash of every output bit") {
  const char* t = std::getenv("WS_DET_THREADS");
  const int threads = t ? std::atoi(t) : 1;
  const std::uint64_t h = scenario_hash(threads);
  MESSAGE("scenario hash with " << threads << " CPU threads: " << std::hex << h);
  if (const char* out = std::getenv("WS_DET_HASH_OUT")) std::ofstream(out) << std::hex << h << "\n";
}

TEST_CASE("K10: reruns across processes are bit-identical (fresh address layout, malloc patterns, thread counts)") {
  const std::uint64_t here = scenario_hash(2);
  CHECK(scenario_hash(2) == here);  // and in this process again, after the first run's pools
  struct variant {
    const char* threads;
    const char* perturb;
  };
  for (const variant& v : {variant{"1", "0"}, variant{"2", "165"}, variant{"3", "90"}}) {
    CAPTURE(v.threads);
    const std::string file = "ws_det_hash_" + std::to_string(::getpid()) + "_" + v.threads;
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    env_strings.push_back(std::string("WS_DET_THREADS=") + v.threads);
    env_strings.push_back("WS_DET_HASH_OUT=" + file);
    env_strings.push_back(std::string("MALLOC_PERTURB_=") + v.perturb);
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string self = "/proc/self/exe", filter = "-tc=determinism scenario*", quiet = "--no-intro";
    char* argv[] = {self.data(), filter.data(), quiet.data(), nullptr};
    pid_t pid = 0;
    REQUIRE(::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) == 0);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
    std::ifstream in(file);
    std::uint64_t there = 0;
    in >> std::hex >> there;
    std::remove(file.c_str());
    CHECK(there == here);
  }
}
