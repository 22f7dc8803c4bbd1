// SPDX-License-Identifier: Apache-2.0
// docs/ERRORS.md, entry by entry, where test_errors.cpp, test_block_pool.cpp,
// test_merge.cpp, test_policy.cpp and test_layout.cpp do not already check it:
// the remaining partition_spec rules, failed construction leaving nothing
// mapped, pinned-memory refusals at init / admission / eviction / reserve, a
// user policy throwing from route() and observe(), a backend whose eviction
// copies fail (cuda_error from copy_blocks_to_host), and std::bad_alloc at
// every allocation of begin_sequence / append_prefill / append / flush (a
// replaced global operator new fails the n-th allocation of the arming
// thread). After each refusal the cache is unchanged (snapshots), no block or
// D-window slot leaked (usage() and a full admission afterwards), and decoding
// goes on matching the fp64 reference.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <stdexcept>
#include <typeinfo>

#include "support/harness.hpp"

// --- allocation failure injection ----------------------------------------------
// Every replaceable form is defined (a sanitizer runtime must not supply some
// of them). Only the thread that armed the counter sees a failure.
namespace {
thread_local long fail_countdown = -1;  // n >= 0: the n-th next allocation fails
thread_local long allocations_seen = 0;

void* allocate_or_fail(std::size_t n, std::size_t align) {
  if (fail_countdown >= 0 && fail_countdown-- == 0) throw std::bad_alloc();
  ++allocations_seen;
  if (n == 0) n = 1;
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(n);
  } else if (::posix_memalign(&p, align, n) != 0) {
    p = nullptr;
  }
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t n) { return allocate_or_fail(n, 0); }
void* operator new[](std::size_t n) { return allocate_or_fail(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return allocate_or_fail(n, std::size_t(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate_or_fail(n, std::size_t(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return allocate_or_fail(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return allocate_or_fail(n, std::size_t(a));
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept { return operator new(n, a, t); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

using namespace wstest;

namespace {

using G = gqa_layout<128>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

/// Calls `call` with the 0th, 1st, 2nd, ... allocation of this thread failing
/// until it succeeds; after each std::bad_alloc, `check` verifies the state.
/// Returns how many allocation points were exercised.
template <class F, class C>
int every_allocation_failure(F&& call, C&& check) {
  for (long n = 0;; ++n) {
    bool threw = false;
    fail_countdown = n;
    try {
      call();
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    fail_countdown = -1;
    if (!threw) return int(n);
    check(n);
  }
}

/// Runs f, which must throw exactly E whose message contains every part.
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
  } catch (const std::exception& e) {
    FAIL("threw " << std::string(typeid(e).name()) << " (" << std::string(e.what()) << "), expected "
                  << std::string(typeid(E).name()));
  }
  FAIL("no exception thrown; expected " << std::string(typeid(E).name()));
}

/// Virtual memory of this process (kB), from /proc/self/status.
long vm_size_kb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmSize:", 0) == 0) return std::atol(line.c_str() + 7);
  return -1;
}

partition_spec base_spec(int layers = 2, int max_seqs = 3) {
  partition_spec s = small_spec(layers, max_seqs);  // block 16, D 32
  set_ping_pong_blocks(s, G(8, 2), 6);
  return s;
}

/// The host backend whose eviction copies fail on demand, the way the CUDA
/// backend's cudaMemcpyAsync can: half the copies land, then cuda_error.
struct faulty_copy_backend : host_backend {
  using backend_concept = backend_tag;
  int fail_next_copies = 0;
  int copy_calls = 0;
  void copy_blocks_to_host(std::span<const block_copy> copies) {
    ++copy_calls;
    if (fail_next_copies > 0) {
      --fail_next_copies;
      host_backend::copy_blocks_to_host(copies.first(copies.size() / 2));
      throw cuda_error("cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, d2h) failed: cudaErrorLaunchFailure "
                       "(injected by the test)",
                       719);
    }
    host_backend::copy_blocks_to_host(copies);
  }
};
static_assert(backend<faulty_copy_backend>);

/// A page-locking allocator that grants `*slabs_left` more slabs, then refuses.
struct refusing_allocator {
  using allocator_concept = pinned_allocator_tag;
  static constexpr const char* name = "refusing (test)";
  static constexpr bool page_locked = true;
  std::shared_ptr<int> slabs_left = std::make_shared<int>(1 << 30);
  host_allocation allocate(index_t bytes) const {
    if (*slabs_left <= 0)
      throw pinned_memory_error("pinned memory: page-locking " + format_bytes(bytes) + " refused (test)");
    --*slabs_left;
    return detail::map_pageable(bytes, "pinned load region");
  }
};
static_assert(pinned_allocator<refusing_allocator>);

/// A policy that throws from route() on its n-th call and/or from observe().
struct throwing_policy {
  using policy_concept = routing_policy_tag;
  std::shared_ptr<int> route_calls_left = std::make_shared<int>(1 << 30);
  bool throw_in_observe = false;
  route_decision route(const route_query& q) const {
    if (*route_calls_left <= 0) throw std::runtime_error("user policy: route() refused");
    --*route_calls_left;
    return {(q.placed_tokens / q.batch_tokens) % 2 == 0 ? placement::cpu_compute : placement::gpu_load, {}};
  }
  void observe(const cost_sample&) {
    if (throw_in_observe) throw std::runtime_error("user policy: observe() refused");
  }
};
static_assert(routing_policy<throwing_policy>);

/// Appends + attends (every layer, no flush) to the sequences of `batch` whose
/// D-window is not yet full, until every window is full.
template <class Cache>
void fill_windows(decode_driver<Cache>& d, std::span<const sequence_id> batch) {
  for (;;) {
    std::vector<sequence_id> open;
    for (sequence_id s : batch)
      if (d.cache().sequence(s).window_tokens[0] < d.cache().spec().d_window_tokens) open.push_back(s);
    if (open.empty()) return;
    for (int l = 0; l < d.cache().spec().num_layers; ++l) {
      d.append_layer(l, open);
      compare_result r;
      d.attend_layer(l, open, true, r);
      REQUIRE(r.ok());
    }
  }
}

template <class Cache>
void decode_checked(decode_driver<Cache>& d, std::span<const sequence_id> batch, int steps) {
  for (int s = 0; s < steps; ++s) {
    const compare_result r = d.step(batch);
    INFO("step " << s << " rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
    REQUIRE(r.ok());
  }
}

/// Blocks held by live sequences == blocks the pools count as used.
template <class Cache>
void check_accounting(const Cache& c, std::span<const sequence_id> live) {
  index_t cpu = 0, pin = 0;
  for (sequence_id s : live) {
    cpu += index_t(c.sequence(s).cpu_blocks.size());
    pin += index_t(c.sequence(s).pinned_blocks.size());
  }
  CHECK(c.usage().cpu_used_blocks == cpu);
  CHECK(c.usage().pinned_used_blocks == pin);
  CHECK(c.live_sequences() == int(live.size()));
}

}  // namespace

// --- construction and configuration ---------------------------------------------

TEST_CASE("partition_spec: the rules test_errors.cpp leaves out") {
  host_backend be;
  const G lay(8, 2);
  auto make = [&](const partition_spec& s) { host_cache<G, gpu_only> c(be, lay, s, gpu_only{}); };
  partition_spec s = base_spec();
  s.pinned_capacity_tokens = -5;
  expect_error<config_error>([&] { make(s); }, {"region capacities", "pinned -5"});
  s = base_spec();
  s.cpu_capacity_tokens = index_t{16} << 31;  // 2^31 blocks of 16 tokens
  expect_error<config_error>([&] { make(s); }, {"2^31-1 blocks", "block_tokens"});
  s = base_spec();
  s.pinned_growth_tokens = -1;
  expect_error<config_error>([&] { make(s); }, {"pinned_growth_tokens"});
  s = base_spec();
  s.gpu_split_blocks = 0;
  expect_error<config_error>([&] { make(s); }, {"gpu_split_blocks"});
  s = base_spec();
  s.first_chunk_bytes = -1;
  expect_error<config_error>([&] { make(s); }, {"first_chunk_bytes -1", ">= 0"});
}

TEST_CASE("a construction that fails on any region leaves nothing mapped") {
  host_backend be;
  const G lay(8, 2);
  struct region_case {
    const char* name;
    std::function<void(partition_spec&)> set;
  };
  const region_case cases[] = {
      {"D-window", [](partition_spec& s) {  // 2^30 slots of 8 MiB
         s.max_sequences = 1 << 30;
         s.block_tokens = s.d_window_tokens = 4096;
         s.pinned_capacity_tokens = 0;
         s.gpu_split_blocks = 1;
         s.ping_pong_bytes = 4 << 20;
       }},
      {"ping-pong", [](partition_spec& s) { s.ping_pong_bytes = index_t{1} << 52; }},
      {"pinned load region", [](partition_spec& s) {  // 2^28 blocks of 4 MiB in one slab
         s.block_tokens = s.d_window_tokens = 4096;
         s.gpu_split_blocks = 1;
         s.ping_pong_bytes = 4 << 20;
         s.pinned_capacity_tokens = index_t{1} << 40;
         s.pinned_initial_tokens = -1;
         s.pinned_growth_tokens = s.pinned_capacity_tokens;
       }},
  };
  for (const region_case& rc : cases) {
    const std::string name = rc.name;
    CAPTURE(name);
    partition_spec s = base_spec();
    s.cpu_capacity_tokens = 1 << 20;  // mapped first: must be unmapped again
    rc.set(s);
    const long before = vm_size_kb();
    expect_error<resource_error>([&] { host_cache<G, gpu_only> c(be, lay, s, gpu_only{}); }, {rc.name, "bytes"});
    CHECK(vm_size_kb() == before);
  }
  SUBCASE("a page-locking allocator refusing the initial slab: pinned_memory_error, nothing mapped") {
    partition_spec s = base_spec();
    s.pinned_initial_tokens = -1;
    refusing_allocator alloc;
    *alloc.slabs_left = 0;
    const long before = vm_size_kb();
    expect_error<pinned_memory_error>(
        [&] { inplace_kv_cache<G, host_backend, refusing_allocator, gpu_only> c(be, lay, s, gpu_only{}, alloc); },
        {"pinned memory", "refused"});
    CHECK(vm_size_kb() == before);
  }
}

TEST_CASE("cpu::require_cpu_support names the missing instruction set") {
  struct future_arch {
    static constexpr unsigned version() noexcept { return ~0u; }
    static constexpr const char* name() noexcept { return "future_isa"; }
  };
  CHECK_NOTHROW(cpu::require_cpu_support());
  expect_error<config_error>([] { cpu::require_cpu_support<future_arch>(); }, {"future_isa", "WRITESCOPE_CPU_ARCH"});
}

// --- the cache -------------------------------------------------------------------

TEST_CASE("append_prefill: layer out of range, null plane and too small a stride change nothing") {
  host_backend be;
  const G lay(8, 2);
  host_cache<G, fixed_ratio> cache(be, lay, base_spec(), fixed_ratio(0.5), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 11, gqa_scale);
  const sequence_id a = d.add(40);
  const sequence_id b = cache.begin_sequence(70);  // prefilled below, after the refusals
  const std::vector<sequence_id> ids{a, b};
  const cache_snapshot before = snapshot(cache, ids);
  std::vector<bf16> kbuf(70 * 2 * 128, bf16::from_float(0.25f));
  kv_tokens<G, pageable_host_space> kv;
  kv.planes = {kbuf.data(), kbuf.data()};
  kv.num_tokens = 70;
  expect_error<shape_error>([&] { cache.append_prefill(2, b, kv); }, {"append_prefill", "layer 2", "[0, 2)"});
  expect_error<shape_error>([&] { cache.append_prefill(-1, b, kv); }, {"layer -1"});
  auto nul = kv;
  nul.planes[0] = nullptr;
  expect_error<shape_error>([&] { cache.append_prefill(0, b, nul); }, {"plane 0", "null"});
  auto strided = kv;
  strided.token_stride = 255;
  expect_error<shape_error>([&] { cache.append_prefill(1, b, strided); }, {"token_stride 255", "256"});
  CHECK(snapshot(cache, ids) == before);
  d.remove(a);
  cache.end_sequence(b);
  check_accounting(cache, {});
}

TEST_CASE("flush: a cuda_error from the eviction copies leaves the cache unchanged (strong guarantee)") {
  faulty_copy_backend be;
  const G lay(8, 2);
  inplace_kv_cache<G, faulty_copy_backend, pageable_allocator, fixed_ratio> cache(be, lay, base_spec(), fixed_ratio(0.5),
                                                                                  {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 21, gqa_scale);
  const std::vector<sequence_id> batch{d.add(2 * 32 + 7), d.add(3), d.add(32 + 20)};
  decode_checked(d, batch, 30);
  fill_windows(d, std::span<const sequence_id>(batch).first(2));  // two full windows, the third not
  const cache_snapshot before = snapshot(cache, batch);
  const region_usage u0 = cache.usage();
  be.fail_next_copies = 1;
  expect_error<cuda_error>([&] { cache.flush(); }, {"cudaMemcpyAsync", "cudaErrorLaunchFailure"});
  CHECK(snapshot(cache, batch) == before);
  CHECK(cache.usage().cpu_used_blocks == u0.cpu_used_blocks);
  CHECK(cache.usage().pinned_used_blocks == u0.pinned_used_blocks);
  check_accounting(cache, batch);
  // The windows still hold their tokens: every layer attends exactly what was written.
  for (int l = 0; l < 2; ++l) {
    compare_result r;
    d.attend_layer(l, batch, true, r);
    REQUIRE(r.ok());
  }
  // Retried, the eviction goes through; the evicted blocks are byte-exact (the
  // failed attempt's half-written blocks were returned and are written again).
  const flush_report rep = cache.flush();
  CHECK(rep.evicted_sequences == 2);
  check_accounting(cache, batch);
  for (sequence_id s : batch)
    for (int l = 0; l < 2; ++l) {
      const auto& h = d.history(s, l);
      std::vector<bf16> tok(2 * 2 * 128);
      for (index_t t = 0; t < h.tokens; ++t) {
        cache.read_token(l, s, t, tok);
        REQUIRE(std::memcmp(tok.data(), h.planes[0].data() + t * 256, 256 * sizeof(bf16)) == 0);
        REQUIRE(std::memcmp(tok.data() + 256, h.planes[1].data() + t * 256, 256 * sizeof(bf16)) == 0);
      }
    }
  decode_checked(d, batch, 70);
  check_accounting(cache, batch);
}

TEST_CASE("a user policy throwing from route() changes nothing: admission and eviction") {
  host_backend be;
  const G lay(8, 2);
  throwing_policy pol;
  host_cache<G, throwing_policy> cache(be, lay, base_spec(), pol, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 31, gqa_scale);
  const sequence_id a = d.add(32 + 9);
  std::vector<sequence_id> batch{a};
  const cache_snapshot before = snapshot(cache, batch);
  *pol.route_calls_left = 2;  // the third batch of a 3-batch prompt is refused
  expect_error<std::runtime_error>([&] { cache.begin_sequence(3 * 32); }, {"route() refused"});
  CHECK(snapshot(cache, batch) == before);
  check_accounting(cache, batch);
  *pol.route_calls_left = 1 << 30;
  const sequence_id b = d.add(32 + 1);
  batch.push_back(b);
  fill_windows(d, std::span<const sequence_id>(batch));
  const cache_snapshot full = snapshot(cache, batch);
  *pol.route_calls_left = 1;  // the second window's batch is refused
  expect_error<std::runtime_error>([&] { cache.flush(); }, {"route() refused"});
  CHECK(snapshot(cache, batch) == full);
  check_accounting(cache, batch);
  *pol.route_calls_left = 1 << 30;
  CHECK(cache.flush().evicted_sequences == 2);
  decode_checked(d, batch, 40);
  check_accounting(cache, batch);
}

TEST_CASE("step: a user policy throwing from observe() leaves the outputs written and valid") {
  host_backend be;
  const G lay(8, 2);
  throwing_policy pol;
  host_cache<G, throwing_policy> cache(be, lay, base_spec(1), pol, {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 41, gqa_scale);
  const std::vector<sequence_id> batch{d.add(3 * 32 + 5), d.add(17)};
  decode_checked(d, batch, 5);
  cache.policy().throw_in_observe = true;
  d.append_layer(0, batch);
  compare_result r;
  expect_error<std::runtime_error>([&] { d.attend_layer(0, batch, false, r); }, {"observe() refused"});
  // attend_layer filled q and called step, which wrote out/lse before observe() threw.
  std::vector<double> ro, rl;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    reference_attention(lay, d.history(batch[i], 0), d.q.data() + i * 8 * 128, gqa_scale, ro, rl);
    compare_rows(8, 128, d.out.data() + i * 8 * 128, d.lse.data() + i * 8, ro, rl, r);
  }
  CHECK(r.ok());
  cache.policy().throw_in_observe = false;
  cache.flush();
  decode_checked(d, batch, 40);
}

TEST_CASE("pinned region growth refused at admission, eviction and reserve: typed error, nothing else changes") {
  host_backend be;
  const G lay(8, 2);
  partition_spec s = base_spec();
  s.pinned_initial_tokens = 0;
  s.pinned_growth_tokens = 32;  // one slab per eviction batch
  refusing_allocator alloc;
  *alloc.slabs_left = 3;
  using cache_t = inplace_kv_cache<G, host_backend, refusing_allocator, gpu_only>;
  cache_t cache(be, lay, s, gpu_only{}, alloc, cache_options{true});
  decode_driver<cache_t> d(cache, attention_options{1, true}, 51, gqa_scale);
  std::vector<sequence_id> batch{d.add(2 * 32 + 4)};  // two slabs
  cache_snapshot before = snapshot(cache, batch);
  // Admission: a 2-batch prompt needs 2 slabs, 1 is granted, the 2nd refused.
  expect_error<pinned_memory_error>([&] { cache.begin_sequence(2 * 32); }, {"pinned memory", "refused"});
  CHECK(snapshot(cache, batch) == before);
  check_accounting(cache, batch);
  CHECK(cache.usage().pinned_capacity_blocks == 3 * 2);  // the granted slab stays, as free capacity
  // Eviction: the free slab takes one window; the second needs a new slab, refused.
  const sequence_id b = d.add(5);
  batch.push_back(b);
  fill_windows(d, std::span<const sequence_id>(batch));
  before = snapshot(cache, batch);
  expect_error<pinned_memory_error>([&] { cache.flush(); }, {"pinned memory", "refused"});
  CHECK(snapshot(cache, batch) == before);
  check_accounting(cache, batch);
  // Pinning ahead: refused the same way, nothing else changes.
  expect_error<pinned_memory_error>([&] { cache.reserve_pinned_blocks(4); }, {"pinned memory"});
  CHECK(snapshot(cache, batch) == before);
  // Granted again, the eviction goes through and decoding goes on.
  *alloc.slabs_left = 100;
  CHECK(cache.flush().evicted_sequences == 2);
  decode_checked(d, batch, 40);
  check_accounting(cache, batch);
}

// --- std::bad_alloc at every allocation point ----------------------------------------

TEST_CASE("begin_sequence: std::bad_alloc at any allocation leaks no block and no D-window slot") {
  host_backend be;
  const G lay(8, 2);
  for (int tenths : {0, 5, 10}) {
    CAPTURE(tenths);
    partition_spec s = base_spec(2, 2);
    s.pinned_growth_tokens = 32;
    host_cache<G, fixed_ratio> cache(be, lay, s, fixed_ratio(tenths / 10.0), {}, cache_options{true});
    decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 61, gqa_scale);
    sequence_id got = -1;
    // A fresh cache: the first admission also grows the sequence table.
    const int points = every_allocation_failure([&] { got = cache.begin_sequence(3 * 32 + 3); }, [&](long n) {
      CAPTURE(n);
      REQUIRE(cache.live_sequences() == 0);
      REQUIRE(cache.usage().cpu_used_blocks == 0);
      REQUIRE(cache.usage().pinned_used_blocks == 0);
      REQUIRE(cache.total_placed_tokens() == 0);
    });
    MESSAGE("begin_sequence: " << points << " allocation points failed one by one");
    CHECK(points >= 3);
    const std::vector<sequence_id> one{got};
    check_accounting(cache, one);
    // Both slots are usable: a leaked slot would make the second admission fail.
    const sequence_id other = cache.begin_sequence(7);
    CHECK(cache.live_sequences() == 2);
    expect_error<capacity_error>([&] { cache.begin_sequence(0); }, {"D-window slots"});
    cache.end_sequence(other);
    cache.end_sequence(got);
    check_accounting(cache, {});
  }
}

TEST_CASE("append_prefill, append and flush: std::bad_alloc at any allocation changes nothing") {
  host_backend be;
  const G lay(8, 2);
  partition_spec s = base_spec(2, 4);
  s.pinned_growth_tokens = 32;
  host_cache<G, fixed_ratio> cache(be, lay, s, fixed_ratio(0.5), {}, cache_options{true});
  decode_driver<decltype(cache)> d(cache, attention_options{1, true}, 71, gqa_scale);
  std::vector<sequence_id> batch{d.add(2 * 32 + 1), d.add(30)};

  // append_prefill of a new sequence, layer 0 then 1.
  const sequence_id c = cache.begin_sequence(32 + 5);
  kv_batch<G> pk = d.gen.make(lay, 32 + 5, d.source());
  std::vector<sequence_id> all{batch[0], batch[1], c};
  for (int l = 0; l < 2; ++l) {
    const cache_snapshot before = snapshot(cache, all);
    every_allocation_failure([&] { cache.append_prefill(l, c, pk.view()); },
                             [&](long) { REQUIRE(snapshot(cache, all) == before); });
  }
  cache.end_sequence(c);

  // append of one decode token (a fresh, larger batch grows the write list).
  for (int step = 0; step < 40; ++step) {
    for (int l = 0; l < 2; ++l) {
      kv_batch<G> b = d.gen.make(lay, index_t(batch.size()), d.source());
      const cache_snapshot before = snapshot(cache, batch);
      every_allocation_failure([&] { cache.append(l, batch, b.view()); },
                               [&](long) { REQUIRE(snapshot(cache, batch) == before); });
      // Recorded only now that the append went through (the harness keeps its history const).
      for (std::size_t i = 0; i < batch.size(); ++i)
        record(const_cast<kv_history<G>&>(d.history(batch[i], l)), lay, b, index_t(i), 1);
      compare_result r;
      d.attend_layer(l, batch, true, r);
      REQUIRE(r.ok());
    }
    // flush: every allocation of staging, reserving, pinned growth and copies.
    const cache_snapshot before = snapshot(cache, batch);
    int evicted = 0;
    every_allocation_failure([&] { evicted = cache.flush().evicted_sequences; }, [&](long n) {
      CAPTURE(n);
      REQUIRE(snapshot(cache, batch) == before);
      check_accounting(cache, batch);
    });
    check_accounting(cache, batch);
    (void)evicted;
  }
  decode_checked(d, batch, 40);
  check_accounting(cache, batch);
}
