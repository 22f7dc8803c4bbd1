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
