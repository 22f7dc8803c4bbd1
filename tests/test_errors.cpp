// SPDX-License-Identifier: Apache-2.0
// Bad input -> a typed exception (error.hpp) whose message names the offending
// value and the rule; the cache is unchanged afterwards (strong guarantee:
// same usage, same sequence state) and a following decode step still matches
// the fp64 reference.
#include <doctest/doctest.h>

#include <typeinfo>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<128>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

/// Runs f, which must throw exactly E (a subclass of writescope::error) whose
/// message contains every part.
template <class E, class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const E& e) {
    const std::string what = e.what();
    INFO("message: " << what);
    CHECK(typeid(e) == typeid(E));
    CHECK(mentions(what, parts));
    return;
  }
  FAIL("no exception thrown; expected " << typeid(E).name());
}

partition_spec base_spec() {
  partition_spec s = small_spec(2, 3);  // block 16, D 32
  set_ping_pong_blocks(s, G(8, 2), 6);
  return s;
}

}  // namespace

TEST_CASE("configuration errors name the value and the rule") {
  expect_error<config_error>([] { dispatch_head_dim(80, [](auto) {}); }, {"head dim", "80", "64, 128, 256"});
  expect_error<config_error>([] { G(30, 4); }, {"Hq=30", "Hkv=4", "multiple"});
  expect_error<config_error>([] { G(0, 4); }, {"Hq=0", "positive"});
  expect_error<config_error>([] { mla_layout<512, 64>(-2); }, {"Hq=-2"});
  expect_error<config_error>([] { fixed_ratio(1.5); }, {"1.5", "[0, 1]"});
  roofline_params rp;
  rp.cpu_cost_per_token_seconds = -3e-9;
  rp.gpu_cost_per_token_seconds = 1e-9;
  expect_error<config_error>([&] { roofline_policy p(rp); }, {"positive", "A=-3e-09 s"});
  rp.cpu_cost_per_token_seconds = 1e-9;
  rp.gpu_cost_per_token_seconds = -1.0;
  expect_error<config_error>([&] { roofline_policy p(rp); }, {"B=-1 s"});

  host_backend be;
  const G lay(8, 2);
  auto make = [&](const partition_spec& s) { host_cache<G, gpu_only> c(be, lay, s, gpu_only{}); };
  SUBCASE("D not a multiple of the block size") {
    partition_spec s = base_spec();
    s.d_window_tokens = 40;
    expect_error<config_error>([&] { make(s); }, {"partition_spec", "40", "16", "multiple"});
    s.d_window_tokens = 8;  // smaller than a block
    expect_error<config_error>([&] { make(s); }, {"8", "16"});
  }
  SUBCASE("ping-pong buffer smaller than one split") {
    partition_spec s = base_spec();
    s.gpu_split_blocks = 7;
    expect_error<config_error>([&] { make(s); }, {"ping-pong", "6 blocks", "gpu_split_blocks=7"});
  }
  SUBCASE("other fields") {
    partition_spec s = base_spec();
    s.num_layers = 0;
    expect_error<config_error>([&] { make(s); }, {"num_layers 0"});
    s = base_spec();
    s.max_sequences = 0;
    expect_error<config_error>([&] { make(s); }, {"max_sequences 0"});
    s = base_spec();
    s.cpu_capacity_tokens = -1;
    expect_error<config_error>([&] { make(s); }, {"cpu -1"});
    s = base_spec();
    s.pinned_initial_tokens = s.pinned_capacity_tokens + 1;
    expect_error<config_error>([&] { make(s); }, {"pinned_initial_tokens 8193", "8192"});
    s = base_spec();
    s.ping_pong_buffers = 1;
    expect_error<config_error>([&] { make(s); }, {"ping_pong_buffers 1", ">= 2"});
    s = base_spec();
    s.cpu_task_blocks = 0;
    expect_error<config_error>([&] { make(s); }, {"cpu_task_blocks"});
    s = base_spec();
    s.block_tokens = 0;
    expect_error<config_error>([&] { make(s); }, {"block_tokens 0"});
    s = base_spec();  // no host region: nothing could ever be evicted
    s.cpu_capacity_tokens = 0;
    s.pinned_capacity_tokens = 0;
    expect_error<config_error>([&] { make(s); }, {"cpu_capacity_tokens and pinned_capacity_tokens are both 0",
                                                  "d_window_tokens (32)", "set either"});
    s.pinned_capacity_tokens = 16;  // one region is enough
    CHECK_NOTHROW(make(s));
  }
  SUBCASE("a default partition_spec is refused, naming the two capacities") {
    expect_error<config_error>([&] { make(partition_spec{}); }, {"cpu_capacity_tokens", "pinned_capacity_tokens", "both 0"});
  }
  SUBCASE("a region the system cannot reserve fails at init, naming region and size") {
    partition_spec s;
    s.block_tokens = 4096;
    s.d_window_tokens = 4096;
    s.cpu_capacity_tokens = index_t{4096} * (index_t{1} << 30);  // 2^30 blocks of 4 MiB: 4 PiB
    s.gpu_split_blocks = 4;
    expect_error<resource_error>([&] { make(s); }, {"unpinned compute region", "bytes"});
  }
}

TEST_CASE("bad calls on a live cache throw typed errors and leave it unchanged") {
  host_backend be;
  const G lay(8, 2);
  host_cache<G, fixed_ratio> cache(be, lay, base_spec(), fixed_ratio(0.5), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 3, gqa_scale);
  const sequence_id a = d.add(3 * 32 + 5), b = d.add(20);
  std::vector<sequence_id> batch{a, b};
  for (int s = 0; s < 4; ++s) REQUIRE(d.step(batch).ok());
  const std::vector<sequence_id> ids{a, b};
  const cache_snapshot before = snapshot(cache, ids);

  // One token per sequence of `seqs`, valid data.
  std::vector<bf16> kbuf(4 * 2 * 128, bf16::from_float(0.5f));
  auto kv = [&](index_t n) {
    kv_tokens<G, pageable_host_space> t;
    t.planes = {kbuf.data(), kbuf.data()};
    t.num_tokens = n;
    return t;
  };
  std::vector<float> q(2 * 8 * 128, 0.1f), out(2 * 8 * 128), lse(2 * 8);
  auto outs = [&](std::size_t o_n, std::size_t l_n) {
    return step_outputs<pageable_host_space>{host_span<float>(out.data(), index_t(o_n)), host_span<float>(lse.data(), index_t(l_n)),
                                             nullptr};
  };
  auto qs = [&](std::size_t n) { return host_span<const float>(q.data(), index_t(n)); };

  SUBCASE("append: token count differs from the batch") {
    expect_error<shape_error>([&] { cache.append(0, batch, kv(3)); }, {"3 tokens", "2 sequences"});
  }
  SUBCASE("append: unknown, ended and repeated sequences; bad layer; null plane; bad stride") {
    const std::vector<sequence_id> unknown{a, 7};
    expect_error<shape_error>([&] { cache.append(0, unknown, kv(2)); }, {"sequence 7", "not a live sequence"});
    const std::vector<sequence_id> twice{b, b};
    expect_error<shape_error>([&] { cache.append(1, twice, kv(2)); }, {"sequence " + std::to_string(b), "twice"});
    const std::vector<sequence_id> neg{-1};
    expect_error<shape_error>([&] { cache.append(0, neg, kv(1)); }, {"sequence -1"});
    expect_error<shape_error>([&] { cache.append(2, batch, kv(2)); }, {"layer 2", "[0, 2)"});
    auto nul = kv(2);
    nul.planes[1] = nullptr;
    expect_error<shape_error>([&] { cache.append(0, batch, nul); }, {"plane 1", "null"});
    auto strided = kv(2);
    strided.token_stride = 100;
    expect_error<shape_error>([&] { cache.append(0, batch, strided); }, {"token_stride 100", "256"});
  }
  SUBCASE("append_prefill: twice, wrong token count, unknown sequence") {
    expect_error<state_error>([&] { cache.append_prefill(0, a, kv(101)); }, {"layer 0", "already holds its prompt"});
    const sequence_id c = cache.begin_sequence(4);
    expect_error<shape_error>([&] { cache.append_prefill(1, c, kv(3)); }, {"3 tokens given", "prompt of 4"});
    const std::vector<sequence_id> cb{c};
    expect_error<state_error>([&] { cache.append(1, cb, kv(1)); }, {"no prompt KV yet"});  // before its prefill
    cache.end_sequence(c);
    expect_error<shape_error>([&] { cache.append_prefill(0, c, kv(4)); }, {"sequence " + std::to_string(c), "not a live"});
    expect_error<shape_error>([&] { cache.append_prefill(0, 42, kv(4)); }, {"sequence 42"});
  }
  SUBCASE("sequence lifetime: ended, duplicate end, negative prompt, introspection of a dead id") {
    const sequence_id c = cache.begin_sequence(0);
    cache.end_sequence(c);
    expect_error<shape_error>([&] { cache.end_sequence(c); }, {"end_sequence", "sequence " + std::to_string(c)});
    expect_error<shape_error>([&] { (void)cache.sequence(c); }, {"not a live sequence"});
    expect_error<shape_error>([&] { cache.begin_sequence(-1); }, {"prompt_tokens -1"});
    std::vector<bf16> tok(2 * 2 * 128);
    expect_error<shape_error>([&] { cache.read_token(0, a, 10000, tok); }, {"position 10000"});
    std::vector<bf16> small(10);
    expect_error<shape_error>([&] { cache.read_token(0, a, 0, small); }, {"10 elements", "512"});
    expect_error<shape_error>([&] { (void)cache.views(5); }, {"layer 5"});
  }
  SUBCASE("step: wrong q, out and lse sizes; too large a batch; bad layer; bad scale; a dead sequence") {
    auto& attn = d.attention();
    expect_error<shape_error>([&] { attn.step(0, batch, qs(2 * 8 * 128 - 1), 0.1f, outs(out.size(), lse.size())); },
                              {"q has 2047", "2048"});
    expect_error<shape_error>([&] { attn.step(0, batch, qs(q.size()), 0.1f, outs(out.size() - 128, lse.size())); },
                              {"out has 1920", "2048"});
    expect_error<shape_error>([&] { attn.step(0, batch, qs(q.size()), 0.1f, outs(out.size(), 3)); }, {"lse has 3", "16"});
    const std::vector<sequence_id> four{a, b, 2, 3};
    expect_error<shape_error>([&] { attn.step(0, four, qs(q.size()), 0.1f, outs(out.size(), lse.size())); },
                              {"batch of 4", "max_sequences 3"});
    expect_error<shape_error>([&] { attn.step(-1, batch, qs(q.size()), 0.1f, outs(out.size(), lse.size())); }, {"layer -1"});
    expect_error<config_error>([&] { attn.step(0, batch, qs(q.size()), 0.0f, outs(out.size(), lse.size())); },
                               {"softmax scale", "positive"});
    expect_error<config_error>(
        [&] { attn.step(0, batch, qs(q.size()), std::numeric_limits<float>::quiet_NaN(), outs(out.size(), lse.size())); },
        {"softmax scale"});
    const std::vector<sequence_id> dead{a, 2};
    expect_error<shape_error>([&] { attn.step(0, dead, qs(q.size()), 0.1f, outs(out.size(), lse.size())); }, {"sequence 2"});
    const std::vector<sequence_id> dup{a, a};
    expect_error<shape_error>([&] { attn.step(1, dup, qs(q.size()), 0.1f, outs(out.size(), lse.size())); }, {"twice"});
  }
  SUBCASE("no free D-window slot") {
    const sequence_id c = d.add(1);
    const cache_snapshot with_c = snapshot(cache, std::vector<sequence_id>{a, b, c});
    expect_error<capacity_error>([&] { cache.begin_sequence(0); },
                                 {"begin_sequence: a prompt of 0 tokens", "all 3 D-window slots", "partition_spec::max_sequences"});
    CHECK(snapshot(cache, std::vector<sequence_id>{a, b, c}) == with_c);
    d.remove(c);
  }
  // Whatever was refused, the cache is as it was and decoding goes on correctly.
  CHECK(snapshot(cache, ids) == before);
  for (int s = 0; s < 40; ++s) REQUIRE(d.step(batch).ok());
}

TEST_CASE("capacity errors leave the cache unchanged: admission, flush, and the full D-window") {
  host_backend be;
  const G lay(8, 2);
  SUBCASE("unpinned region full at admission and at eviction (cpu_only)") {
    partition_spec s = base_spec();
    s.cpu_capacity_tokens = 3 * 32;  // three eviction batches
    host_cache<G, cpu_only> cache(be, lay, s, cpu_only{}, {}, cache_options{true});
    decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 5, gqa_scale);
    const sequence_id a = d.add(2 * 32 + 31);  // 2 batches placed, window 31
    const sequence_id b = d.add(31);           // window 31
    const std::vector<sequence_id> ids{a, b};
    cache_snapshot before = snapshot(cache, ids);
    // 3 batches of 2 blocks, 2 used: the prompt's first batch fits, its second does not.
    expect_error<capacity_error>([&] { cache.begin_sequence(2 * 32); },
                                 {"begin_sequence: a prompt of 64 tokens (eviction batch 2 of 2, D = 32 tokens)",
                                  "unpinned compute region: 2 blocks requested, 0 free of 6",
                                  "raise partition_spec::cpu_capacity_tokens", "now 96 tokens per layer"});
    CHECK(snapshot(cache, ids) == before);
    CHECK(cache.live_sequences() == 2);

    // The next token fills both windows: their eviction needs 2 batches, 1 is free.
    std::vector<sequence_id> batch{a, b};
    for (int l = 0; l < 2; ++l) {
      d.append_layer(l, batch);
      compare_result r;
      d.attend_layer(l, batch, true, r);
      REQUIRE(r.ok());
    }
    before = snapshot(cache, ids);
    expect_error<capacity_error>([&] { cache.flush(); },
                                 {"flush: the full D-window of sequence " + std::to_string(b) + " (32 tokens with this eviction)",
                                  "unpinned compute region: 2 blocks requested, 0 free of 6",
                                  "raise partition_spec::cpu_capacity_tokens", "now 96 tokens per layer"});
    CHECK(snapshot(cache, ids) == before);  // nothing evicted, a's staged batch returned
    CHECK(cache.sequence(a).window_tokens == std::vector<int>{32, 32});
    // Appending to a full D-window without a successful flush is a state error.
    expect_error<state_error>([&] { d.append_layer(0, batch); }, {"D-window", "full", "flush"});
    CHECK(snapshot(cache, ids) == before);
    // Attention still sees every token; then free b and evict a.
    for (int l = 0; l < 2; ++l) {
      compare_result r;
      d.attend_layer(l, batch, true, r);
      REQUIRE(r.ok());
    }
    d.remove(b);
    const flush_report rep = cache.flush();
    CHECK(rep.evicted_sequences == 1);
    CHECK(cache.usage().cpu_used_blocks == 6);
    batch = {a};
    for (int s = 0; s < 31; ++s) REQUIRE(d.step(batch).ok());  // up to the next full window
  }
  SUBCASE("pinned region at its maximum (gpu_only): the capacity never passes the maximum") {
    partition_spec s = base_spec();
    s.pinned_capacity_tokens = 3 * 32;
    s.pinned_initial_tokens = 0;
    s.pinned_growth_tokens = 32;
    host_cache<G, gpu_only> cache(be, lay, s, gpu_only{}, {}, cache_options{true});
    decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 6, gqa_scale);
    const sequence_id a = d.add(2 * 32 + 3);
    const std::vector<sequence_id> ids{a};
    const cache_snapshot before = snapshot(cache, ids);
    expect_error<capacity_error>([&] { cache.begin_sequence(2 * 32); },
                                 {"begin_sequence: a prompt of 64 tokens (eviction batch 2 of 2", "pinned load region",
                                  "raise partition_spec::pinned_capacity_tokens", "now 96 tokens per layer"});
    CHECK(snapshot(cache, ids) == before);
    CHECK(cache.usage().pinned_capacity_blocks <= cache.usage().pinned_max_blocks);
    const std::vector<sequence_id> batch{a};
    for (int st = 0; st < 10; ++st) REQUIRE(d.step(batch).ok());
    const sequence_id c = d.add(32);  // exactly the last free batch
    CHECK(cache.usage().pinned_used_blocks == 6);
    d.remove(c);
  }
}
