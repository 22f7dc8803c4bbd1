// SPDX-License-Identifier: Apache-2.0
// inplace_kv_cache::append_prefill over several sequences in one write (a
// prefill wave's packed KV) against one append_prefill per sequence: the same
// placement, and every token of every layer reads back the source value from
// wherever it landed (unpinned, pinned, D-window); bad calls throw the typed
// error naming the value and leave nothing written.
#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<64>;

partition_spec wave_spec() {
  partition_spec s = small_spec(/*layers=*/3, /*max_seqs=*/6, /*block_tokens=*/16, /*d_window=*/32);
  set_ping_pong_blocks(s, G(4, 2), 6);
  return s;
}

// A distinct bf16 value per (token, plane, head, element) of the packed wave.
bf16 source_value(index_t token, int plane, int head, int e, int layer) {
  const int v = int((token * 131 + plane * 37 + head * 17 + e * 3 + layer * 1009) % 2039) - 1019;
  return bf16::from_float(float(v) / 64.0f);
}

struct wave_kv {
  std::vector<bf16> k, v;
  kv_tokens<G, pageable_host_space> kv;
  wave_kv(index_t tokens, int layer) : k(std::size_t(tokens) * 2 * 64), v(k.size()) {
    for (index_t t = 0; t < tokens; ++t)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 64; ++e) {
          k[std::size_t((t * 2 + h) * 64 + e)] = source_value(t, 0, h, e, layer);
          v[std::size_t((t * 2 + h) * 64 + e)] = source_value(t, 1, h, e, layer);
        }
    kv.planes = {k.data(), v.data()};
    kv.num_tokens = tokens;
  }
  /// The sub-range [t0, t0 + n) as its own input (what a per-sequence append gets).
  kv_tokens<G, pageable_host_space> slice(index_t t0, index_t n) const {
    kv_tokens<G, pageable_host_space> s = kv;
    s.planes = {k.data() + t0 * 2 * 64, v.data() + t0 * 2 * 64};
    s.num_tokens = n;
    return s;
  }
};

}  // namespace

TEST_CASE("append_prefill over a wave = one append_prefill per sequence; every token reads back its source") {
  const std::vector<index_t> prompts = {37, 64, 130, 5, 16};  // partial blocks, whole blocks, D-window remainders
  std::vector<index_t> first(prompts.size());
  std::exclusive_scan(prompts.begin(), prompts.end(), first.begin(), index_t{0});
  const index_t total = first.back() + prompts.back();
  host_backend be_a, be_b;
  const G lay(4, 2);
  host_cache<G, fixed_ratio> one(be_a, lay, wave_spec(), fixed_ratio(0.5));
  host_cache<G, fixed_ratio> wave(be_b, lay, wave_spec(), fixed_ratio(0.5));
  std::vector<sequence_id> ids_a, ids_b;
  for (index_t p : prompts) {
    ids_a.push_back(one.begin_sequence(p));
    ids_b.push_back(wave.begin_sequence(p));
  }
  for (int l = 0; l < 3; ++l) {
    const wave_kv src(total, l);
    for (std::size_t i = 0; i < prompts.size(); ++i) one.append_prefill(l, ids_a[i], src.slice(first[i], prompts[i]));
    wave.append_prefill(l, ids_b, first, src.kv);
  }
  CHECK(snapshot(one, ids_a) == snapshot(wave, ids_b));
  // both regions and the D-window hold prompt tokens (fixed_ratio 0.5 places some of each)
  const region_usage u = wave.usage();
  CHECK(u.cpu_used_blocks > 0);
  CHECK(u.pinned_used_blocks > 0);
  std::vector<bf16> got(2 * 2 * 64), ref(got.size());
  int mismatches = 0;
  for (int l = 0; l < 3; ++l)
    for (std::size_t i = 0; i < prompts.size(); ++i)
      for (index_t t = 0; t < prompts[i]; ++t) {
        wave.read_token(l, ids_b[i], t, got);
        one.read_token(l, ids_a[i], t, ref);
        for (int p = 0; p < 2; ++p)
          for (int h = 0; h < 2; ++h)
            for (int e = 0; e < 64; ++e) {
              const std::size_t at = std::size_t((p * 2 + h) * 64 + e);
              const bf16 want = source_value(first[i] + t, p, h, e, l);
              mismatches += got[at].bits != want.bits || ref[at].bits != want.bits ? 1 : 0;
            }
      }
  CHECK(mismatches == 0);
}

TEST_CASE("append_prefill over a wave: bad calls throw the typed error naming the value; nothing is written") {
  host_backend be;
  const G lay(4, 2);
  host_cache<G, fixed_ratio> cache(be, lay, wave_spec(), fixed_ratio(0.5));
  const sequence_id a = cache.begin_sequence(20), b = cache.begin_sequence(30);
  const wave_kv src(50, 0);
  const std::vector<sequence_id> ab = {a, b}, aa = {a, a};
  const std::vector<index_t> ok = {0, 20}, outside = {0, 21}, negative = {-1, 20}, one_first = {0};
  const std::vector<sequence_id> both = {a, b};
  const cache_snapshot before = snapshot(cache, both);
  auto message_of = [](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THROWS_AS(cache.append_prefill(0, aa, ok, src.kv), shape_error);
  CHECK(mentions(message_of([&] { cache.append_prefill(0, aa, ok, src.kv); }), {"sequence " + std::to_string(a), "twice"}));
  CHECK_THROWS_AS(cache.append_prefill(0, ab, outside, src.kv), shape_error);
  CHECK(mentions(message_of([&] { cache.append_prefill(0, ab, outside, src.kv); }), {"token 21", "50 tokens"}));
  CHECK_THROWS_AS(cache.append_prefill(0, ab, negative, src.kv), shape_error);
  CHECK_THROWS_AS(cache.append_prefill(0, ab, one_first, src.kv), shape_error);
  CHECK_THROWS_AS(cache.append_prefill(3, ab, ok, src.kv), shape_error);
  CHECK(snapshot(cache, both) == before);  // no layer marked written
  cache.append_prefill(0, ab, ok, src.kv);
  CHECK_THROWS_AS(cache.append_prefill(0, ab, ok, src.kv), state_error);
  std::vector<bf16> got(2 * 2 * 64);
  cache.read_token(0, b, 29, got);
  CHECK(got[0].bits == source_value(20 + 29, 0, 0, 0, 0).bits);
}
