// SPDX-License-Identifier: Apache-2.0
// python/csrc/engine_host.cpp — the host-backend engines of the binding
// (engine.hpp): every layout on writescope::host_backend, the pinned load
// region in pageable memory (the host backend's default).
#include "engine.hpp"

namespace writescope_py {

std::unique_ptr<engine> make_host_engine(const engine_config& c) {
  ws::cpu::require_cpu_support();
  return build_engine<ws::host_backend, ws::pageable_allocator, host_traits>(c);
}

}  // namespace writescope_py
