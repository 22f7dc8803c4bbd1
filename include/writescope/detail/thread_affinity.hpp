// SPDX-License-Identifier: Apache-2.0
// writescope/detail/thread_affinity.hpp — the threads writescope starts
// itself (the host backend's emulated GPU worker, the CUDA backend's sparse
// gather threads, the pre-touch threads of cuda_host_register) must not run
// on the one core their creator happens to be bound to.
//
// A new thread inherits its creator's CPU affinity. Under OMP_PROC_BIND
// (the usual setting for the CPU attention team, docs/CPU-KERNEL.md) libgomp
// binds the initial thread to the first place, so every std::thread the
// engine starts afterwards would share that one core with OpenMP thread 0,
// and N gather threads would copy no faster than one (docs/DECISIONS.md).
// Each library thread therefore calls widen_thread_affinity() first; the
// kernel intersects the mask with the process's cpuset (a container's CPU
// limit still holds). Best effort: a refusal leaves the inherited mask.
#pragma once

#if defined(__linux__)
#  include <sched.h>
#  include <unistd.h>
#endif

namespace writescope::detail {

/// Lets the calling thread run on every configured CPU (within its cpuset).
/// Host only; thread-safe (affects the calling thread alone); never throws.
/// Returns false where the call is unsupported or refused.
inline bool widen_thread_affinity() noexcept {
#if defined(__linux__)
  cpu_set_t all;
  CPU_ZERO(&all);
  const long n = ::sysconf(_SC_NPROCESSORS_CONF);
  for (long c = 0; c < n && c < CPU_SETSIZE; ++c) CPU_SET(int(c), &all);
  return ::sched_setaffinity(0, sizeof all, &all) == 0;
#else
  return false;
#endif
}

}  // namespace writescope::detail
