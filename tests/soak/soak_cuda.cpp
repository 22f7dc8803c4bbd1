// SPDX-License-Identifier: Apache-2.0
// ws_soak_cuda — the soak loop of soak_core.hpp on cuda_backend (GPU machine):
// pinned load region through cuda_host_alloc, inputs and outputs on the
// device, device memory in use sampled with cudaMemGetInfo. Exits 77 (ctest:
// skipped) without a usable device.
//   ws_soak_cuda --steps 100000 --heads 32:4 --max-seqs 16 --json soak_cuda.json
#include <cuda_runtime_api.h>

#include "cuda/device_harness.hpp"
#include "soak_core.hpp"

int main(int argc, char** argv) {
  using namespace writescope;
  wssoak::options o;
  if (!wssoak::parse(argc, argv, o)) return 2;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no usable CUDA device\n");
    return 77;
  }
  auto device_used = [] {
    std::size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return index_t{-1};
    return index_t(total_b - free_b);
  };
  try {
    using G = gqa_layout<128>;
    const G lay(o.hq, o.hkv);
    cuda_backend be;
    return wssoak::with_policy(o, [&](auto policy) {
      using cache_t = wstest::dev::device_cache<G, decltype(policy), cuda_host_alloc>;
      cache_t cache(be, lay, wssoak::soak_spec(o), policy);
      wstest::dev::device_decode_driver<cache_t> d(cache, attention_options{o.threads, false}, o.seed,
                                                   1.0 / std::sqrt(128.0));
      return wssoak::run(d, o, device_used, "cuda backend");
    });
  } catch (const writescope::error& e) {
    std::fprintf(stderr, "ws_soak_cuda: %s\n", e.what());
    return 1;
  }
}
