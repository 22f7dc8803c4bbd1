// SPDX-License-Identifier: Apache-2.0
// End-to-end decode loops over a split cache against the fp64 reference.
#include <doctest/doctest.h>

#include "support/harness.hpp"

using namespace wstest;

TEST_CASE("GQA decode loop over a split cache matches fp64 attention at every step") {
  using L = gqa_layout<128>;
  host_backend be;
  L lay(8, 2);
  auto spec = small_spec(2, 3);
  set_ping_pong_blocks(spec, lay, 8);
  inplace_kv_cache<L, host_backend, pageable_allocator, fixed_ratio> cache(be, lay, spec, fixed_ratio(0.5), {},
                                                                            cache_options{true});
  decode_driver<decltype(cache)> d(cache, {2, true}, 42, 1.0 / std::sqrt(128.0));
  std::vector<sequence_id> batch{d.add(100), d.add(5), d.add(64)};
  for (int s = 0; s < 80; ++s) {
    const compare_result r = d.step(batch);
    INFO("step " << s << " rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
    REQUIRE(r.ok());
  }
  CHECK(cache.usage().cpu_used_blocks > 0);
  CHECK(cache.usage().pinned_used_blocks > 0);
}

TEST_CASE("task workspace: reserved at construction for a full cache, else grown in steps by at least half") {
  using L = gqa_layout<128>;
  host_backend be;
  L lay(8, 2);
  auto spec = small_spec(1, 3);  // CPU capacity 8192 tokens = 512 blocks, task 3 blocks
  set_ping_pong_blocks(spec, lay, 8);
  inplace_kv_cache<L, host_backend, pageable_allocator, cpu_only> cache(be, lay, spec, cpu_only{}, {}, cache_options{true});
  const index_t full = (spec.cpu_capacity_blocks() / spec.cpu_task_blocks + 2 * spec.max_sequences) * lay.kv_heads();
  SUBCASE("reserved: no growth while the cache fills") {
    attention_options o{2, true};
    o.task_workspace_reserve_bytes = index_t{1} << 30;
    decode_driver<decltype(cache)> d(cache, o, 7, 1.0 / std::sqrt(128.0));
    CHECK(d.attention().task_workspace_tasks() == full);
    std::vector<sequence_id> batch{d.add(2000), d.add(2500), d.add(3000)};
    for (int s = 0; s < 40; ++s) REQUIRE(d.step(batch, s % 10 == 0).ok());
    CHECK(d.attention().task_workspace_tasks() == full);
  }
  SUBCASE("capped by the option's bytes") {
    attention_options o{2, true};
    o.task_workspace_reserve_bytes = 100 * index_t(lay.group_size()) * (128 + 1) * 4;
    hybrid_attention<decltype(cache)> h(cache, o);
    CHECK(h.task_workspace_tasks() == 100);
  }
  SUBCASE("default: nothing at init; grows to what a step needs") {
    decode_driver<decltype(cache)> d(cache, {2, true}, 7, 1.0 / std::sqrt(128.0));
    CHECK(d.attention().task_workspace_tasks() == 0);
    std::vector<sequence_id> batch{d.add(300), d.add(40)};
    REQUIRE(d.step(batch).ok());
    const index_t first = d.attention().task_workspace_tasks();
    CHECK(first >= d.last_report.cpu_tasks);
    batch.push_back(d.add(3000));
    REQUIRE(d.step(batch).ok());
    CHECK(d.attention().task_workspace_tasks() >= std::max<index_t>(d.last_report.cpu_tasks, first + first / 2));
  }
}
