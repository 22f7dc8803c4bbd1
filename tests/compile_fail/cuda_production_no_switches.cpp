// SPDX-License-Identifier: Apache-2.0
// Must not compile: the production backend (cuda_backend, no_hooks) has no
// mutation-test switches: debug() exists only where the Hooks are enabled
// (cuda_test_hooks), so no production build can remove an ordering guard.
// Built only where the CUDA targets exist (writescope::cuda).
// expect-error: expression .*Hooks::enabled .with Hooks = writescope::no_hooks.* evaluated to .*false
#include <writescope/cuda/cuda_backend.hpp>

void remove_a_guard(writescope::cuda_backend& be) { be.debug().skip_consumed_wait = true; }
