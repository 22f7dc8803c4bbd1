// SPDX-License-Identifier: Apache-2.0
// The pinned load region on a real GPU (fault kind K8, docs/RELIABILITY.md):
// cuda_host_alloc and cuda_host_register page-lock what they claim, account
// their time, refuse cleanly (a message naming pinned memory and the size,
// nothing left registered) and serve streamed copies that cross
// cudaHostRegister chunk boundaries; the C11 case pins 3.9 GiB, 4 GiB,
// 4 GiB + 4 KiB and 6 GiB regions and decodes a copy from each one's last
// block (opt-in: WS_TEST_LARGE_PINNED=1, ~20 GB of host memory).
//
// K8 mutation checks (the guard removed by a test-only switch, the test's
// check must fail; "K8 mutation: ..." cases, each with a guarded twin):
//   cuda_host_register::skip_refusal_check  a refused chunk (injected with
//       inject_refusal_chunk) no longer fails at cache init; the first decode
//       step meets the unpinned block instead (debug builds, as here)
//   cuda_debug_options::skip_registration_split (mutation_backend)  copies across cudaHostRegister
//       chunk boundaries reach the driver whole; detected when the driver
//       refuses them (cudaErrorInvalidValue) or a result goes wrong. The case
//       reports what the driver answers to one such raw copy.
// Pinning at init keeps the step path free of page-locking: a plain check
// (no guard to remove: the step path has no pinning call).
// copy_batch (the write path's gathered D2H / H2D submissions): scattered,
// merged and registration-crossing pieces land byte for byte against a host
// reference, batched and one copy each, over poisoned destinations.
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <optional>

#include "device_harness.hpp"

#include <writescope/cuda/copy_batch.hpp>
#include <writescope/cuda/numa.hpp>

using namespace wstest;
using namespace wstest::dev;

namespace {

using G = gqa_layout<128>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

bool page_locked(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

template <class Alloc>
void check_allocator(const Alloc& alloc) {
  const std::size_t ranges0 = registered_pinned_ranges();
  const pin_statistics s0 = Alloc::statistics();
  const index_t bytes = (index_t{3} << 20) + 4096;  // not a multiple of any chunk
  {
    host_allocation a = alloc.allocate(bytes);
    REQUIRE(a);
    CHECK(a.size_bytes() == bytes);
    CHECK(page_locked(a.data()));
    CHECK(page_locked(a.data() + bytes - 1));
    CHECK(registered_pinned_ranges() > ranges0);
    std::memset(a.data(), 0x5a, std::size_t(bytes));  // writable, host-accessible
    const pin_statistics s1 = Alloc::statistics();
    CHECK(s1.bytes - s0.bytes == bytes);
    CHECK(s1.allocations - s0.allocations == 1);
    CHECK(s1.pin_seconds >= s0.pin_seconds);
  }
  CHECK(registered_pinned_ranges() == ranges0);
  CHECK(!alloc.allocate(0));
}

template <class Alloc>
void check_refusal(const Alloc& alloc) {
  const std::size_t ranges0 = registered_pinned_ranges();
  const index_t absurd = index_t{1} << 50;  // 1 PiB
  const pin_statistics s0 = Alloc::statistics();
  try {
    (void)alloc.allocate(absurd);
    FAIL("a 1 PiB pinned allocation succeeded");
  } catch (const pinned_memory_error& e) {
    INFO(e.what());
    CHECK(mentions(e.what(), {"pinned memory", format_bytes(absurd)}));
  }
  CHECK(Alloc::statistics().failures == s0.failures + 1);
  CHECK(registered_pinned_ranges() == ranges0);
}

}  // namespace

TEST_CASE("pinned allocators page-lock, account and release") {
  SUBCASE("cuda_host_alloc") { check_allocator(cuda_host_alloc{}); }
  SUBCASE("cuda_host_register, 1 GiB chunks") { check_allocator(cuda_host_register{}); }
  SUBCASE("cuda_host_register, 64 KiB chunks") { check_allocator(cuda_host_register{index_t{64} << 10, 2}); }
}

TEST_CASE("NUMA: cuda_host_register with a node binds its pages there (MPOL_BIND) and registers them; the device's node") {
  // The device's node: one the host has online, or none where the platform does not say.
  const int dev_node = cuda_device_numa_node(0);
  const std::vector<int> online = numa_online_nodes();
  MESSAGE("device 0: NUMA node " << dev_node << " (online nodes " << format_numa_node_list(online) << ")");
  CHECK((dev_node == no_numa_node || std::find(online.begin(), online.end(), dev_node) != online.end()));

  const int node = dev_node == no_numa_node ? online.front() : dev_node;
  cuda_host_register alloc{index_t{64} << 10, 2};
  alloc.numa_node = node;
  const std::size_t ranges0 = registered_pinned_ranges();
  const index_t bytes = (index_t{1} << 20) + 100;
  {
    host_allocation a = alloc.allocate(bytes);
    CHECK(page_locked(a.data()));
    CHECK(page_locked(a.data() + bytes - 1));
    for (index_t off : {index_t{0}, bytes - 1}) {
      const numa_page_info info = numa_page_policy(a.data() + off);
      CHECK(info.mode == MPOL_BIND);
      CHECK(info.nodes == std::vector<int>{node});
      CHECK(info.node == node);
    }
  }
  CHECK(registered_pinned_ranges() == ranges0);
  alloc.numa_node = online.back() + 1;  // not online: refused before anything is mapped or registered
  CHECK_THROWS_AS((void)alloc.allocate(bytes), config_error);
  CHECK(registered_pinned_ranges() == ranges0);
}

TEST_CASE("pinned allocators refuse with a message naming pinned memory and the size, nothing half-registered") {
  SUBCASE("cuda_host_alloc") { check_refusal(cuda_host_alloc{}); }
  SUBCASE("cuda_host_register") { check_refusal(cuda_host_register{}); }
  SUBCASE("at cache init") {
    const G L(32, 4);
    cuda_backend be;
    partition_spec spec = small_spec(1, 1, 1024, 1024);  // 2 MiB blocks
    spec.pinned_capacity_tokens = index_t{1} << 39;       // 1 PiB per layer, all pinned at init
    spec.pinned_initial_tokens = -1;
    spec.pinned_growth_tokens = spec.pinned_capacity_tokens;
    spec.cpu_capacity_tokens = 0;
    set_ping_pong_blocks(spec, L, 4);
    const std::size_t ranges0 = registered_pinned_ranges();
    try {
      device_cache<G, gpu_only> cache(be, L, spec, gpu_only{});
      FAIL("a 1 PiB pinned load region was accepted");
    } catch (const pinned_memory_error& e) {
      INFO(e.what());
      CHECK(mentions(e.what(), {"pinned memory", format_bytes(index_t{1} << 50)}));
    }
    CHECK(registered_pinned_ranges() == ranges0);
  }
}

TEST_CASE("streamed and evicted copies that cross cudaHostRegister chunk boundaries") {
  // 16 KiB blocks, 64 KiB chunks: every run of more than 4 blocks crosses one;
  // the backend splits copies at registration boundaries.
  const G L(8, 2);
  cuda_backend be;
  auto spec = small_spec(1, 3);
  spec.pinned_growth_tokens = 512;  // 32 blocks = 8 chunks per slab
  set_ping_pong_blocks(spec, L, 12);
  spec.gpu_split_blocks = 4;
  using cache_t = device_cache<G, fixed_ratio, cuda_host_register>;
  cache_t cache(be, L, spec, fixed_ratio(0.3), cuda_host_register{index_t{64} << 10, 2}, cache_options{true});
  device_decode_driver<cache_t> d(cache, attention_options{2, true}, 71, gqa_scale);
  std::vector<sequence_id> batch{d.add(400), d.add(130), d.add(7)};
  CHECK(d.count_mismatches(batch[0], 0, 0, 400) == 0);
  for (int s = 0; s < scaled(70, 20, 8); ++s) {
    const auto placed = d.placed(batch);
    const compare_result r = d.step(batch);
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2);
    REQUIRE(r.ok());
    REQUIRE(d.check_evicted(batch, placed) == 0);
  }
  const pin_statistics st = cuda_host_register::statistics();
  MESSAGE("cuda_host_register: " << format_bytes(st.bytes) << " in " << st.pin_seconds << " s pin + "
                                 << st.touch_seconds << " s touch (" << st.seconds_per_gib() * 1e3 << " ms/GiB)");
}

// -----------------------------------------------------------------------------
// K8 guards and their mutations
// -----------------------------------------------------------------------------

namespace {

/// 16 KiB blocks (G(8, 2), block 16); pinned slabs of 32 blocks (512 KiB), all
/// `pinned_tokens` pinned at init; 12-block ping-pong buffers, splits of 4.
partition_spec k8_spec(const G& L, int seqs, index_t pinned_tokens) {
  auto spec = small_spec(1, seqs);
  spec.pinned_capacity_tokens = pinned_tokens;
  spec.pinned_initial_tokens = -1;
  spec.pinned_growth_tokens = 512;
  set_ping_pong_blocks(spec, L, 12);
  spec.gpu_split_blocks = 4;
  return spec;
}

/// Decode steps (40; fewer under WS_TEST_QUICK / WS_TEST_SANITIZER), each checked against
/// fp64; returns the sequences evicted.
template <class Cache>
index_t checked_steps(device_decode_driver<Cache>& d, const std::vector<sequence_id>& batch) {
  index_t evicted = 0;
  for (int s = 0; s < scaled(40, 12, 6); ++s) {
    const compare_result r = d.step(batch);
    INFO("step " << s << ": rel_l2 " << r.max_rel_l2);
    REQUIRE(r.ok());
    evicted += d.last_flush.evicted_sequences;
  }
  return evicted;
}

/// cudaHostRegister in 64 KiB chunks (4 blocks of 16 KiB), 2 pre-touch threads.
cuda_host_register small_chunks() { return cuda_host_register{index_t{64} << 10, 2}; }

/// Pairs of consecutive pinned blocks of a sequence that lie back to back in
/// memory but not inside one registration: a coalesced run over them crosses
/// a cudaHostRegister chunk boundary.
template <class Cache>
int straddling_pairs(const Cache& cache, std::span<const sequence_id> batch) {
  const auto v = cache.views(0);
  const index_t block_bytes = v.format.block_bytes();
  const auto& reg = cuda_detail::pinned_registry::instance();
  int n = 0;
  for (const sequence_id s : batch) {
    const std::vector<block_id>& ids = cache.sequence(s).pinned_blocks;
    for (std::size_t i = 0; i + 1 < ids.size(); ++i) {
      const bf16* a = v.pinned_block(ids[i]);
      if (v.pinned_block(ids[i + 1]) == a + v.format.block_elems() && !reg.contains(a, 2 * block_bytes)) ++n;
    }
  }
  return n;
}

/// What the driver answers to ONE cudaMemcpyAsync (H2D, 32 KiB) whose host range
/// straddles the boundary between two back-to-back cudaHostRegister
/// registrations (cuda_host_register, 64 KiB chunks): "accepted" or the error.
std::string raw_crossing_copy() {
  host_allocation a = small_chunks().allocate(index_t{128} << 10);
  REQUIRE(!cuda_detail::pinned_registry::instance().contains(a.data() + (48 << 10), index_t{32} << 10));
  device_scratch dst;
  cuda_backend be;
  void* d = dst.get<std::byte>(std::size_t{32} << 10, be.copy_stream());
  const cudaError_t e =
      cudaMemcpyAsync(d, a.data() + (48 << 10), std::size_t{32} << 10, cudaMemcpyHostToDevice, be.copy_stream());
  (void)cudaGetLastError();
  WS_CUDA_TRY(cudaStreamSynchronize(be.copy_stream()));
  return e == cudaSuccess ? std::string("accepted") : cuda_detail::cuda_error_text(e);
}

/// When the skip_registration_split switch is set: never (the guarded twin),
/// before the prefill, or right before the first decode step.
enum class split_off { never, from_prefill, from_first_step };

/// The skip_registration_split scenario: gpu_only, so each sequence's blocks
/// are consecutive and its prefill D2H and streamed runs cross 64 KiB chunk
/// boundaries; three steps, the third evicting the first sequence's window.
/// Returns how a failure showed ("" if none: every step and eviction right).
std::string registration_split_case(split_off when) {
  const G L(8, 2);
  mutation_backend be;  // the switch of cuda_test_hooks
  using cache_t = device_cache<G, gpu_only, cuda_host_register, mutation_backend>;
  cache_t cache(be, L, k8_spec(L, 2, 1024), gpu_only{}, small_chunks(), cache_options{true});
  device_decode_driver<cache_t> d(cache, attention_options{2, true}, 77, gqa_scale);
  std::string shown;
  try {
    be.debug().skip_registration_split = when == split_off::from_prefill;
    const std::vector<sequence_id> batch{d.add(413), d.add(130)};  // windows of 29 and 2 tokens
    REQUIRE(straddling_pairs(cache, batch) > 0);  // the step has runs to cross a boundary with
    be.debug().skip_registration_split = when != split_off::never;
    for (int s = 0; s < 3 && shown.empty(); ++s) {
      const auto placed = d.placed(batch);
      const compare_result r = d.step(batch);
      if (!r.ok())
        shown = "a wrong result at step " + std::to_string(s) + " (rel_l2 " + std::to_string(r.max_rel_l2) + ")";
      else if (d.check_evicted(batch, placed) != 0)
        shown = "wrong evicted blocks at step " + std::to_string(s);
    }
    if (when == split_off::never) CHECK(cache.sequence(batch[0]).placed_tokens == 416);  // the eviction happened
  } catch (const cuda_error& e) {
    shown = e.what();
  }
  be.debug() = {};
  be.synchronize();
  return shown;
}

/// The skip_refusal_check scenario: chunk `refused` of every slab refused
/// (injected) while the cache pins its region at init; `mutate` removes the
/// refusal check. Reports where the refusal showed.
struct refusal_outcome {
  std::string at_init;    ///< pinned_memory_error of the cache constructor ("" if none)
  std::string at_decode;  ///< pinned_memory_error of the first decode step ("" if none)
  bool first_block_pinned = true;
  bool decoded_right = false;
};

refusal_outcome injected_refusal(index_t refused, bool mutate) {
  const G L(8, 2);
  mutation_backend be;  // the switch of cuda_test_hooks
  using cache_t = device_cache<G, gpu_only, cuda_host_register, mutation_backend>;
  cuda_host_register alloc = small_chunks();
  alloc.inject_refusal_chunk = refused;
  alloc.skip_refusal_check = mutate;
  refusal_outcome o;
  std::optional<cache_t> cache;
  try {
    cache.emplace(be, L, k8_spec(L, 1, 1024), gpu_only{}, alloc, cache_options{true});
  } catch (const pinned_memory_error& e) {
    o.at_init = e.what();
    return o;
  }
  device_decode_driver<cache_t> d(*cache, attention_options{2, true}, 79, gqa_scale);
  const std::vector<sequence_id> batch{d.add(200)};  // 12 pinned blocks from block 0: chunks 0-2 of slab 0
  const auto v = cache->views(0);
  o.first_block_pinned =
      cuda_detail::pinned_registry::instance().covers(v.pinned_block(cache->sequence(batch[0]).pinned_blocks[0]),
                                                      v.format.block_bytes());
  try {
    o.decoded_right = d.step(batch).ok();
  } catch (const pinned_memory_error& e) {
    o.at_decode = e.what();
  }
  be.synchronize();
  return o;
}

}  // namespace

TEST_CASE("K8: a cudaHostRegister refusal in the middle of a slab (injected) fails at cache init, nothing registered") {
  const std::size_t ranges0 = registered_pinned_ranges();
  const pin_statistics s0 = cuda_host_register::statistics();
  const refusal_outcome o = injected_refusal(2, false);  // chunks 0 and 1 registered first, then undone
  INFO(o.at_init);
  CHECK(mentions(o.at_init, {"pinned memory", "cudaHostRegister", format_bytes(index_t{512} << 10), "chunk 3 of 8",
                             "cudaErrorMemoryAllocation"}));
  CHECK(o.at_decode.empty());
  CHECK(cuda_host_register::statistics().failures == s0.failures + 1);
  CHECK(registered_pinned_ranges() == ranges0);
}

TEST_CASE("K8 mutation: cuda_host_register::skip_refusal_check -> the refusal is not at init, the first decode step "
          "meets an unpinned block (expected late)") {
  const std::size_t ranges0 = registered_pinned_ranges();
  const refusal_outcome o = injected_refusal(0, true);
  INFO("at init: '" << o.at_init << "'; at decode: '" << o.at_decode << "'; decoded right: " << o.decoded_right);
  CHECK(o.at_init.empty());           // the guard's check fails: no refusal at init ...
  CHECK_FALSE(o.first_block_pinned);  // ... the refused chunk was handed out as pinned ...
  // ... and the step that streams it finds out (WS_DEBUG_CHECKS, as every device
  // test; a release build would copy it as pageable memory, silently).
  CHECK(mentions(o.at_decode, {"pinned memory", "not page-locked"}));
  CHECK(registered_pinned_ranges() == ranges0);
}

TEST_CASE("K8: gpu_only over 64 KiB cudaHostRegister chunks: prefill, streamed and evicted copies split, right") {
  // The guarded twin of the skip_registration_split mutation below.
  const std::string shown = registration_split_case(split_off::never);
  INFO(shown);
  CHECK(shown.empty());
}

TEST_CASE("K8 mutation: skip_registration_split -> copies across cudaHostRegister chunk boundaries reach the driver "
          "whole (expected refused)") {
  // What the driver says to one such copy decides whether the mutation is
  // detectable at all (the CUDA documentation promises CUDA_ERROR_INVALID_VALUE
  // for ranges over registered and unregistered memory; for two back-to-back
  // registrations this probe is the evidence).
  const std::string raw = raw_crossing_copy();
  MESSAGE("driver, one H2D copy across two back-to-back cudaHostRegister chunks: " << raw);
  SUBCASE("from the prefill on (prefill D2H into pinned blocks)") {
    const std::string shown = registration_split_case(split_off::from_prefill);
    MESSAGE("mutation shown by: " << (shown.empty() ? std::string("nothing (undetected)") : shown));
    CHECK(!shown.empty());
  }
  SUBCASE("from the first decode step on (streamed H2D runs, the eviction D2H)") {
    const std::string shown = registration_split_case(split_off::from_first_step);
    MESSAGE("mutation shown by: " << (shown.empty() ? std::string("nothing (undetected)") : shown));
    CHECK(!shown.empty());
  }
}

namespace {

/// copy_batch over `pieces` (offset into the host buffer, offset into the
/// device buffer, bytes) in one direction: the host buffer is 256 KiB in 64
/// KiB cudaHostRegister chunks (pieces cross them), the device buffer random.
/// Returns {bytes equal to the reference, copy_batch counters}.
struct batch_outcome {
  bool right = false;
  std::size_t merged_pieces = 0;
  std::uint64_t copies = 0, api_calls = 0;
};

batch_outcome run_copy_batch(const std::vector<std::array<index_t, 3>>& pieces, cuda_detail::copy_direction dir,
                             bool batched) {
  const index_t bytes = index_t{256} << 10;
  host_allocation host = small_chunks().allocate(bytes);
  const auto n_bytes = static_cast<std::size_t>(bytes);
  std::vector<std::uint8_t> dev_init(n_bytes), host_init(n_bytes, 0xAB);
  std::uint64_t x = 0x1234567;
  for (auto& b : dev_init) b = std::uint8_t((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 56);
  std::vector<std::uint8_t> host_src(n_bytes);  // H2D: the host side's bytes
  for (std::size_t i = 0; i < host_src.size(); ++i) host_src[i] = std::uint8_t(i * 7 + 3);
  void* dev = nullptr;
  WS_CUDA_TRY(cudaMalloc(&dev, std::size_t(bytes)));
  cudaStream_t s{};
  WS_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const bool d2h = dir == cuda_detail::copy_direction::device_to_host;
  // poison the destination; the source holds the pattern
  if (d2h) {
    WS_CUDA_TRY(cudaMemcpy(dev, dev_init.data(), std::size_t(bytes), cudaMemcpyHostToDevice));
    std::memset(host.data(), 0xAB, std::size_t(bytes));
  } else {
    std::memcpy(host.data(), host_src.data(), std::size_t(bytes));
    // on the copies' stream: cudaMemset into device memory may return before it ran, and the
    // legacy stream does not order a non-blocking stream's copies after it
    WS_CUDA_TRY(cudaMemsetAsync(dev, 0xAB, std::size_t(bytes), s));
  }
  cuda_detail::copy_batch cb;
  cb.set_batched(batched);
  std::vector<std::uint8_t> want = d2h ? host_init : std::vector<std::uint8_t>(std::size_t(bytes), 0xAB);
  for (const auto& [h, d, n] : pieces) {
    if (d2h) {
      cb.add(host.data() + h, static_cast<std::byte*>(dev) + d, n);
      std::memcpy(want.data() + h, dev_init.data() + d, std::size_t(n));
    } else {
      cb.add(static_cast<std::byte*>(dev) + d, host.data() + h, n);
      std::memcpy(want.data() + d, host_src.data() + h, std::size_t(n));
    }
  }
  batch_outcome o;
  o.merged_pieces = cb.pieces();
  cb.submit(s, dir);
  CHECK(cb.empty());
  WS_CUDA_TRY(cudaStreamSynchronize(s));
  std::vector<std::uint8_t> got(n_bytes);
  if (d2h)
    std::memcpy(got.data(), host.data(), std::size_t(bytes));
  else
    WS_CUDA_TRY(cudaMemcpy(got.data(), dev, std::size_t(bytes), cudaMemcpyDeviceToHost));
  o.right = got == want;
  o.copies = cb.copies();
  o.api_calls = cb.api_calls();
  WS_CUDA_TRY(cudaStreamDestroy(s));
  WS_CUDA_TRY(cudaFree(dev));
  return o;
}

}  // namespace

TEST_CASE("copy_batch: scattered, adjacent and registration-crossing pieces land right, batched and one by one") {
  // host offset, device offset, bytes: 40 scattered 1 KiB pieces in a shuffled
  // order, a run of 4 adjacent pieces (one merged piece), a piece across the
  // 64 KiB registration boundary at 128 KiB, and an empty one
  std::vector<std::array<index_t, 3>> pieces;
  for (int i = 0; i < 40; ++i) {
    const index_t k = (i * 17) % 40;
    pieces.push_back({k * 3072, (39 - k) * 2048 + 512, 1024});
  }
  for (int i = 0; i < 4; ++i) pieces.push_back({index_t{200} << 10 | index_t(i) * 512, 100000 + index_t(i) * 512, 512});
  pieces.push_back({(index_t{128} << 10) - 1000, 150000, 3000});
  pieces.push_back({0, 0, 0});
  for (const auto dir : {cuda_detail::copy_direction::device_to_host, cuda_detail::copy_direction::host_to_device}) {
    CAPTURE(int(dir));
    const batch_outcome one = run_copy_batch(pieces, dir, false);
    const batch_outcome all = run_copy_batch(pieces, dir, true);
    CHECK(one.right);
    CHECK(all.right);
    CHECK(all.merged_pieces == 42);  // 40 + the merged run + the crossing piece
    CHECK(one.copies == 43);         // the crossing piece split in two
    CHECK(all.copies == 43);
    CHECK(one.api_calls == 43);
    const std::string availability = cuda_detail::copy_batch::batch_available() ? "available" : "not available";
    MESSAGE("cudaMemcpyBatchAsync: " << availability);
    CHECK(all.api_calls == (cuda_detail::copy_batch::batch_available() ? 1u : 43u));
  }
}

TEST_CASE("K8: the region pinned at init (pinned_initial_tokens = -1): decode steps and evictions pin nothing") {
  const G L(8, 2);
  cuda_backend be;
  using cache_t = device_cache<G, fixed_ratio, cuda_host_register>;
  const pin_statistics s0 = cuda_host_register::statistics();
  cache_t cache(be, L, k8_spec(L, 3, 2048), fixed_ratio(0.3), small_chunks(), cache_options{true});
  const pin_statistics s1 = cuda_host_register::statistics();
  CHECK(s1.allocations - s0.allocations == 4);  // 2048 tokens in slabs of 512, all at init
  device_decode_driver<cache_t> d(cache, attention_options{2, true}, 83, gqa_scale);
  const std::vector<sequence_id> batch{d.add(300), d.add(77), d.add(31)};
  const std::size_t ranges1 = registered_pinned_ranges();  // the region and the engine's staging
  CHECK(checked_steps(d, batch) > 0);  // evictions happened
  CHECK(cuda_host_register::statistics().allocations == s1.allocations);
  CHECK(cuda_host_register::statistics().bytes == s1.bytes);
  CHECK(registered_pinned_ranges() == ranges1);
  MESSAGE("pinned at init: " << format_bytes(s1.bytes - s0.bytes) << " in " << (s1.pin_seconds - s0.pin_seconds)
                             << " s pin + " << (s1.touch_seconds - s0.touch_seconds) << " s touch");
}

TEST_CASE("prefault_cpu_region page-locks the eviction bounce buffer between steps (pinned region grown lazily)") {
  const G L(8, 2);
  cuda_backend be;
  using cache_t = device_cache<G, cpu_only, cuda_host_register>;
  partition_spec spec = k8_spec(L, 3, 2048);
  spec.pinned_initial_tokens = 0;  // grown on demand: the cache does not reserve the bounce buffer at construction
  cache_t cache(be, L, spec, cpu_only{}, small_chunks());
  CHECK_FALSE(be.eviction_bounce_active());
  device_decode_driver<cache_t> d(cache, attention_options{2, true}, 85, gqa_scale);
  const std::vector<sequence_id> batch{d.add(300), d.add(77), d.add(31)};
  const index_t touched = cache.prefault_cpu_region(3 * 8);
  CHECK(touched > 0);
  CHECK(be.eviction_bounce_active());  // page-locked here, not inside the first eviction's step
  CHECK(checked_steps(d, batch) > 0);  // evictions happened
  CHECK(be.eviction_bounce_active());
}

TEST_CASE("reserve_deferred_host_writes page-locks the deferred writes' staging whole; no prefill page-locks it") {
  const G L(8, 2);
  cuda_backend be;
  using cache_t = device_cache<G, cpu_only, cuda_host_register>;
  partition_spec spec = k8_spec(L, 3, 2048);
  spec.pinned_initial_tokens = 0;  // nothing page-locked at init but what the test reserves
  const index_t max_bytes = index_t{4} << 20;
  be.set_deferred_host_writes(max_bytes);
  cache_t cache(be, L, spec, cpu_only{}, small_chunks());
  CHECK(be.deferred_host_writes_reserved_bytes() == 0);
  CHECK_THROWS_AS(cache.reserve_deferred_host_writes(max_bytes + 1), config_error);
  CHECK_THROWS_AS(cache.reserve_deferred_host_writes(-1), config_error);
  CHECK(be.deferred_host_writes_reserved_bytes() == 0);
  CHECK(cache.reserve_deferred_host_writes(max_bytes) == max_bytes);
  device_decode_driver<cache_t> d(cache, attention_options{2, true}, 86, gqa_scale);  // the engine page-locks its own staging
  const std::size_t ranges = registered_pinned_ranges();
  const std::vector<sequence_id> batch{d.add(300), d.add(77), d.add(31)};  // deferred writes into the CPU region
  CHECK(registered_pinned_ranges() == ranges);  // the prefill page-locked nothing
  CHECK(be.deferred_host_writes_reserved_bytes() == max_bytes);
  CHECK(checked_steps(d, batch) >= 0);  // the deferred bytes landed before the CPU side read them
  // a refusal (1 PiB) is a pinned_memory_error and keeps the buffer
  be.set_deferred_host_writes(index_t{1} << 50);
  CHECK_THROWS_AS(cache.reserve_deferred_host_writes(index_t{1} << 50), pinned_memory_error);
  CHECK(be.deferred_host_writes_reserved_bytes() == max_bytes);
}

namespace {

/// Pins `bytes` with `alloc`; on success writes one block of random KV into
/// the LAST block_bytes of the region (crossing 4 GiB for 4 GiB + 4 KiB),
/// streams it through the engine as the only pinned block of one sequence and
/// compares with fp64. On refusal checks the message. Returns false if refused.
template <class Alloc>
bool large_region_case(const Alloc& alloc, index_t bytes) {
  const G L(32, 4);
  const int bt = 16;
  const block_format<G> fmt{L, bt};
  cuda_backend be;
  host_allocation region;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    region = alloc.allocate(bytes);
  } catch (const pinned_memory_error& e) {
    MESSAGE(Alloc::name << " refused " << format_bytes(bytes) << ": " << e.what());
    CHECK(mentions(e.what(), {"pinned memory", format_bytes(bytes)}));
    return false;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE(Alloc::name << " pinned " << format_bytes(bytes) << " in " << secs << " s");
  REQUIRE(region.size_bytes() == bytes);

  // One block of KV in block format at the very end of the region.
  bf16_source src(81);
  kv_generator<G> gen;
  const kv_batch<G> kv = gen.make(L, bt, src);
  kv_history<G> hist;
  record(hist, L, kv, 0, bt);
  bf16* block = reinterpret_cast<bf16*>(region.data() + (bytes - fmt.block_bytes()));
  for (int p = 0; p < G::planes; ++p)
    for (int h = 0; h < L.kv_heads(); ++h)
      for (int t = 0; t < bt; ++t)
        std::memcpy(block + fmt.offset(p, h, t, 0),
                    kv.planes[p].data() + (std::size_t(t) * std::size_t(L.kv_heads()) + std::size_t(h)) * G::row_elems,
                    G::row_elems * sizeof(bf16));

  // A one-chunk, one-run, one-split plan; an empty D-window; an empty CPU side.
  stream_plan plan;
  plan.runs.push_back({pinned_span<const bf16>(block, fmt.block_elems()), 0, 1});
  plan.splits.push_back({0, 0, 1});
  plan.chunks.push_back({0, 0, 1, 0, 1, 1});
  cuda_backend::device_buffer pp = be.allocate_device(2 * fmt.block_bytes(), "ping-pong");
  const ping_pong_view<G> pp_view{contiguous_region(fmt, device_span<bf16>(pp.as<bf16>(), 2 * fmt.block_elems())), 2, 1};
  const window_ref<G> win{pp_view.buffer_region(0), 0};
  cuda_backend::gpu_engine<G> eng(be, L, 1);
  std::vector<float> q(std::size_t(L.num_q_heads()) * G::q_dim);
  for (auto& x : q) x = src.next_float();
  device_scratch q_dev, out_dev, lse_dev;
  float* dq = q_dev.get<float>(q.size(), be.caller_stream());
  WS_CUDA_TRY(cudaMemcpy(dq, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice));
  gpu_step_args<G, device_space> a;
  a.format = fmt;
  a.softmax_scale = float(gqa_scale);
  a.batch = 1;
  a.q = mem_span<const float, device_space>(dq, index_t(q.size()));
  a.plan = &plan;
  a.windows = std::span<const window_ref<G>>(&win, 1);
  a.ping_pong = pp_view;
  a.poison_workspaces = true;
  eng.launch(a);
  (void)eng.host_queries();
  host_partial_view<float> cp = eng.cpu_partial(1);
  for (int h = 0; h < L.num_q_heads(); ++h) {
    std::fill(cp.o_row(0, h), cp.o_row(0, h) + G::v_dim, 0.0f);
    cp.lse_at(0, h) = empty_lse;
  }
  const std::size_t rows = std::size_t(L.num_q_heads());
  float* out = out_dev.get<float>(rows * G::v_dim, be.caller_stream());
  float* lse = lse_dev.get<float>(rows, be.caller_stream());
  (void)eng.finish({device_span<float>(out, index_t(rows * G::v_dim)), device_span<float>(lse, index_t(rows)), nullptr});
  std::vector<float> o, l;
  download(o, out, rows * G::v_dim, be.caller_stream());
  download(l, lse, rows, be.caller_stream());
  std::vector<double> ro, rl;
  reference_attention(L, hist, q.data(), gqa_scale, ro, rl);
  compare_result r;
  compare_rows(L.num_q_heads(), G::v_dim, o.data(), l.data(), ro, rl, r);
  INFO(Alloc::name << " " << format_bytes(bytes) << ": rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
  CHECK(r.ok());
  return true;
}

bool large_pinned_enabled() {
  const char* v = std::getenv("WS_TEST_LARGE_PINNED");
  return v != nullptr && *v == '1';
}

}  // namespace

TEST_CASE("K8/C11: 3.9 GiB, 4 GiB, 4 GiB + 4 KiB, 6 GiB pinned regions either work or fail at init (opt-in)") {
  if (!large_pinned_enabled()) {
    MESSAGE("skipped: set WS_TEST_LARGE_PINNED=1 to pin ~20 GB of host memory");
    return;
  }
  const index_t gib = index_t{1} << 30;
  const index_t sizes[] = {gib * 39 / 10 / 4096 * 4096, 4 * gib, 4 * gib + 4096, 6 * gib};
  for (const index_t bytes : sizes) {
    CAPTURE(bytes);
    (void)large_region_case(cuda_host_alloc{}, bytes);
    (void)large_region_case(cuda_host_register{}, bytes);
  }
  for (const pin_statistics& st : {cuda_host_alloc::statistics(), cuda_host_register::statistics()})
    MESSAGE("pinned " << format_bytes(st.bytes) << ": " << st.seconds_per_gib() * 1e3 << " ms/GiB (pin "
                      << st.pin_seconds << " s, touch " << st.touch_seconds << " s), " << st.failures << " refusals");
}
