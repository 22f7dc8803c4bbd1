// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/context.hpp — what one basic_cuda_backend shares with its
// host-write path (host_writes.hpp) and its engines (dense_engine.hpp,
// sparse_engine.hpp): the device, the three backend streams, the two events
// that order host-block writes against streamed reads, the Hooks switches and
// the completion list of launches. Host compiler only.
//
// Streams (all created non-blocking):
//   caller  the caller's stream (given at construction, or created): appends,
//           prefill scatter, the final merge.
//   h2d     streamed copies pinned -> ping-pong (shared by all engines).
//   d2h     eviction and prefill copies device -> host.
// Events:
//   h2d_done  recorded on h2d at the end of every launch's chunk loop; every
//             D2H into host blocks waits for it (C9: no D2H rewrites a recycled
//             pinned block an earlier H2D still reads).
//   d2h_done  recorded on d2h after host-block writes; every launch's copies
//             wait for it (evicted / prefilled pinned blocks land first), and
//             the caller stream after an eviction (the D-window slots).
// Threads: one thread drives the backend; only a launcher thread (set_launch_thread)
// enqueues on h2d and records h2d_done besides it, between post and join.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "cuda_error.hpp"
#include "handles.hpp"
#include "hooks.hpp"
#include "launch_thread.hpp"

namespace writescope::cuda_detail {

/// Most ping-pong buffers an engine supports (its events are created up front).
inline constexpr int max_ping_pong_buffers = 16;

/// The constructors' first call: throws cuda_error whose message starts
/// "no CUDA device: " and names the CUDA status (code(): that status, or
/// cudaErrorNoDevice for 0 devices) when the runtime sees no device: no
/// driver (cudaErrorInsufficientDriver), none visible (cudaErrorNoDevice,
/// e.g. CUDA_VISIBLE_DEVICES=-1) or a count of 0. Other failures of
/// cudaGetDeviceCount throw the usual WS_CUDA_TRY error.
inline void require_device() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || (e == cudaSuccess && count == 0)) {
    (void)cudaGetLastError();
    throw cuda_error(std::string("no CUDA device: cudaGetDeviceCount ") +
                         (e == cudaSuccess ? std::string("found 0 devices")
                                           : std::string("returned ") + cudaGetErrorName(e) + " (" +
                                                 cudaGetErrorString(e) + ")"),
                     static_cast<int>(e == cudaSuccess ? cudaErrorNoDevice : e));
  }
  if (e != cudaSuccess) throw_cuda_error(e, "cudaGetDeviceCount(&count)", __FILE__, __LINE__);
}

template <cuda_hooks Hooks>
struct backend_context {
  /// Uses the current device; `caller` is the caller stream, or, with
  /// `create`, a new one owned here. Throws cuda_error (require_device first).
  backend_context(cudaStream_t caller_stream, bool create) {
    require_device();
    WS_CUDA_TRY(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    WS_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    name = std::string("cuda (") + prop.name + ", device " + std::to_string(device) + ")";
    if (create) {
      own_caller = unique_stream::create();
      caller = own_caller.get();
    } else {
      caller = caller_stream;
    }
    h2d = unique_stream::create();
    d2h = unique_stream::create();
    h2d_done = unique_event::create();
    d2h_done = unique_event::create();
  }
  backend_context(const backend_context&) = delete;
  backend_context& operator=(const backend_context&) = delete;

  /// C9: the launches whose copies a launcher thread may not have enqueued yet
  /// are joined before a D2H into host blocks waits on h2d_done.
  void join_pending_launches() {
    if (debug.skip_pending_launch_join) return;  // mutation test only
    pending.join_all();
  }

  int device = 0;
  std::string name;
  unique_stream own_caller;
  cudaStream_t caller = nullptr;
  unique_stream h2d, d2h;
  unique_event h2d_done, d2h_done;
  [[no_unique_address]] typename Hooks::switches debug{};
  [[no_unique_address]] typename Hooks::ablation ablation{};
  bool launch_thread = false;  ///< set_launch_thread
  bool resident_kernel = false;  ///< set_resident_kernel
  bool caller_stream_steps = true;  ///< set_caller_stream_steps
  completion_list pending;
};

}  // namespace writescope::cuda_detail
