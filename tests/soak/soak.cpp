// SPDX-License-Identifier: Apache-2.0
// ws_soak — the soak loop of soak_core.hpp on the host backend (no GPU needed;
// CI runs a 5,000-step version through ctest, test "soak_host").
//   ws_soak --steps 100000 --json soak.json
#include "soak_core.hpp"

int main(int argc, char** argv) {
  using namespace writescope;
  wssoak::options o;
  if (!wssoak::parse(argc, argv, o)) return 2;
  try {
    using G = gqa_layout<128>;
    const G lay(o.hq, o.hkv);
    host_backend be;
    return wssoak::with_policy(o, [&](auto policy) {
      using cache_t = wstest::host_cache<G, decltype(policy)>;
      cache_t cache(be, lay, wssoak::soak_spec(o), policy);
      wstest::decode_driver<cache_t> d(cache, attention_options{o.threads, false}, o.seed, 1.0 / std::sqrt(128.0));
      return wssoak::run(d, o, [] { return index_t{0}; }, "host backend");
    });
  } catch (const writescope::error& e) {
    std::fprintf(stderr, "ws_soak: %s\n", e.what());
    return 1;
  }
}
