// SPDX-License-Identifier: Apache-2.0
// python/csrc/engine_cuda.cpp — the CUDA-backend engines of the binding
// (engine.hpp), host code for the host compiler; their kernels are
// instantiated by kernels.cu (nvcc). Built only when torch's CUDA major
// version equals nvcc's (setup.py).
//
// Streams: the backend is bound at creation to torch's current stream on the
// current device (its caller stream: appends, the step's outputs and the merge
// are ordered on it). A call made while another stream is current is ordered
// after that stream's work, and that stream after the call's (two events), so
// tensors handed in or returned follow torch's usual stream semantics.
#include <ATen/cuda/CUDAContext.h>
#include <array>
#include <c10/cuda/CUDAGuard.h>

#include <writescope/cuda/cuda_backend.hpp>
#include <writescope/cuda/pinned_allocators.hpp>

#include "engine.hpp"

namespace writescope_py {
namespace {

struct cuda_traits {
  static constexpr const char* device_name = "cuda";

  static void check_device(ws::cuda_backend& b, const at::Tensor& t, const char* call, const char* what) {
    if (!t.is_cuda() || t.device().index() != b.device())
      throw ws::shape_error(std::string(call) + ": " + what + " is on " + t.device().str() +
                            "; this cache uses the CUDA backend on cuda:" + std::to_string(b.device()));
  }

  /// Around every call: the backend's device current, and, when torch's
  /// current stream is not the caller stream, event waits both ways.
  template <class Backend>
  class scope {
   public:
    explicit scope(Backend& b) : guard_(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(b.device()))), b_(b) {
      current_ = at::cuda::getCurrentCUDAStream(c10::DeviceIndex(b.device())).stream();
      if (current_ != b.caller_stream()) {
        WS_CUDA_TRY(cudaEventRecord(events().first, current_));
        WS_CUDA_TRY(cudaStreamWaitEvent(b.caller_stream(), events().first, 0));
      }
    }
    ~scope() {
      if (current_ == b_.caller_stream()) return;
      try {  // the events exist (the constructor made them); nothing here may throw out of a destructor
        if (cudaEventRecord(events().second, b_.caller_stream()) == cudaSuccess)
          (void)cudaStreamWaitEvent(current_, events().second, 0);
      } catch (...) {
      }
      (void)cudaGetLastError();
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    // Two events per device for this thread (created on first use, with that device current).
    std::pair<cudaEvent_t, cudaEvent_t>& events() {
      thread_local std::array<std::pair<cudaEvent_t, cudaEvent_t>, 64> per_device{};
      if (b_.device() < 0 || b_.device() >= int(per_device.size()))
        throw ws::config_error("cuda backend: device " + std::to_string(b_.device()) + " beyond the 64 this binding orders");
      auto& ev = per_device[std::size_t(b_.device())];
      if (ev.first == nullptr) {
        WS_CUDA_TRY(cudaEventCreateWithFlags(&ev.first, cudaEventDisableTiming));
        WS_CUDA_TRY(cudaEventCreateWithFlags(&ev.second, cudaEventDisableTiming));
      }
      return ev;
    }
    c10::cuda::CUDAGuard guard_;
    Backend& b_;
    cudaStream_t current_ = nullptr;
  };
};

}  // namespace

std::unique_ptr<engine> make_cuda_engine(const engine_config& c) {
  ws::cpu::require_cpu_support();
  ws::cuda_backend::require_device();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  return build_engine<ws::cuda_backend, ws::cuda_host_register, cuda_traits>(c, stream);
}

bool cuda_built() { return true; }

}  // namespace writescope_py
