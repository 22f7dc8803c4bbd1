// SPDX-License-Identifier: Apache-2.0
// python/csrc/engine_nocuda.cpp — stands in for engine_cuda.cpp when the
// extension is built without the CUDA backend (setup.py says why at build
// time and passes the reason here).
#include "engine.hpp"

#ifndef WRITESCOPE_PY_NO_CUDA_REASON
#  define WRITESCOPE_PY_NO_CUDA_REASON "built without CUDA"
#endif

namespace writescope_py {

std::unique_ptr<engine> make_cuda_engine(const engine_config&) {
  throw ws::config_error(std::string("backend 'cuda': this writescope extension has no CUDA backend (") +
                         WRITESCOPE_PY_NO_CUDA_REASON + "); rebuild it where torch has CUDA and nvcc's major version matches");
}

bool cuda_built() { return false; }

}  // namespace writescope_py
