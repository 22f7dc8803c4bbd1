// SPDX-License-Identifier: Apache-2.0
// Device memory exhausted at init (FAULT-KINDS K8/K9 on the device side,
// docs/RELIABILITY.md): a cache or an attention engine asking for more device
// memory than the card has fails in its constructor with resource_error naming
// the region, cudaMalloc and the size — and nothing stays half-built: the
// device memory in use (cudaMemGetInfo) and the registered pinned ranges are
// what they were before, and a normal cache built right after decodes
// correctly. Regions allocated before the one that failed (the pinned load
// region, the unpinned region, the D-window) are released on the way out.
#include <doctest/doctest.h>

#include "device_harness.hpp"

using namespace wstest;
using namespace wstest::dev;

namespace {

using G = gqa_layout<128>;
const double gqa_scale = 1.0 / std::sqrt(128.0);

index_t device_used() {
  std::size_t free_b = 0, total_b = 0;
  WS_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  return index_t(total_b - free_b);
}

index_t device_total() {
  std::size_t free_b = 0, total_b = 0;
  WS_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  return index_t(total_b);
}

/// Constructs what `make` builds, expects resource_error mentioning every part,
/// and checks that device memory and pinned registrations are back where they were.
template <class F>
void expect_refused_cleanly(F&& make, std::initializer_list<std::string> parts) {
  WS_CUDA_TRY(cudaDeviceSynchronize());
  const index_t used0 = device_used();
  const std::size_t ranges0 = registered_pinned_ranges();
  try {
    make();
    FAIL("more device memory than the card has was granted");
  } catch (const resource_error& e) {
    MESSAGE("refused: " << std::string(e.what()));
    CHECK(mentions(e.what(), parts));
  }
  WS_CUDA_TRY(cudaDeviceSynchronize());
  // cudaMalloc/cudaFree work at 2 MiB granularity and the runtime keeps small pools: allow 4 MiB.
  CHECK(std::abs(device_used() - used0) <= (index_t{4} << 20));
  CHECK(registered_pinned_ranges() == ranges0);
}

}  // namespace

TEST_CASE("device memory exhausted at init: typed error naming the region, nothing half-built") {
  const G L(32, 4);
  const index_t total = device_total();
  MESSAGE("device memory: " << format_bytes(total) << ", in use before: " << format_bytes(device_used()));
  const index_t token_bytes = block_format<G>{L, 16}.block_bytes() / 16;

  SUBCASE("D-window larger than the card, after a pinned region was allocated") {
    expect_refused_cleanly(
        [&] {
          cuda_backend be;
          partition_spec s = small_spec(1, 1, 64, 64);
          set_ping_pong_blocks(s, L, 4);
          s.pinned_capacity_tokens = 1 << 16;  // 128 MiB pinned first, must be released again
          s.pinned_initial_tokens = -1;
          s.max_sequences = int(std::min<index_t>(total / (64 * token_bytes) + 16, INT32_MAX));
          device_cache<G, gpu_only> cache(be, L, s, gpu_only{});
        },
        {"D-window", "cudaMalloc", "device memory"});
  }
  SUBCASE("ping-pong buffers larger than the card, after the D-window") {
    expect_refused_cleanly(
        [&] {
          cuda_backend be;
          partition_spec s = small_spec(1, 4, 64, 64);
          s.ping_pong_bytes = total / 2 + (index_t{1} << 30);  // two buffers: more than the card
          s.pinned_capacity_tokens = 1 << 14;
          device_cache<G, gpu_only> cache(be, L, s, gpu_only{});
        },
        {"ping-pong", "cudaMalloc"});
  }
  SUBCASE("attention engine workspaces for more sequences than the card holds") {
    cuda_backend be;
    partition_spec s = small_spec(1, 1, 64, 64);
    set_ping_pong_blocks(s, L, 4);
    // Workspaces are [max_sequences][Hq][v_dim] fp32 each; the D-window is
    // sized by max_sequences too, so keep the window tiny: block 1, D 1.
    s.block_tokens = 1;
    s.d_window_tokens = 1;
    s.gpu_split_blocks = 1;
    set_ping_pong_blocks(s, L, 4);
    const index_t per_seq_ws = index_t(L.num_q_heads()) * G::v_dim * 4 * 3;
    s.max_sequences = int(std::min<index_t>(total / per_seq_ws, INT32_MAX));
    try {
      device_cache<G, gpu_only> cache(be, L, s, gpu_only{});
      expect_refused_cleanly([&] { hybrid_attention<device_cache<G, gpu_only>> attn(cache); }, {"cudaMalloc"});
    } catch (const resource_error& e) {  // the D-window alone did not fit: also a clean refusal
      MESSAGE("the cache itself was refused: " << std::string(e.what()));
    }
  }
  // Afterwards the device works: a normal cache decodes correctly.
  cuda_backend be;
  auto spec = small_spec(1, 2);
  set_ping_pong_blocks(spec, L, 6);
  device_cache<G, fixed_ratio> cache(be, L, spec, fixed_ratio(0.5), {}, cache_options{true});
  device_decode_driver<decltype(cache)> d(cache, attention_options{2, true}, 7, gqa_scale);
  const std::vector<sequence_id> batch{d.add(70), d.add(5)};
  for (int s = 0; s < scaled(40, 10); ++s) REQUIRE(d.step(batch).ok());
}
