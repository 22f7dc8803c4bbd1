// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/nvml_memory.hpp — the device memory NVML attributes to this
// process (what `nvidia-smi --query-compute-apps=used_memory` shows: the
// CUDA context included), read at run time through the driver's
// libnvidia-ml.so.1, for the VRAM budget's measured bound.
//
// The library is opened with dlopen, so ws_decode neither links nor needs
// NVML: where it cannot be loaded, initialised or asked, available() is false
// and why() says which step failed. The device is matched to the CUDA device
// by PCI bus id. The process is matched by getpid(); where NVML lists no
// process of that pid (a PID namespace: NVML reports the host's pids) and
// exactly one compute process uses the device, that one is taken, and
// source() says so.
//
// The declarations below are NVML's C ABI (nvml.h, NVML API version 12:
// nvmlProcessInfo_t with pid, usedGpuMemory, gpuInstanceId,
// computeInstanceId for the _v3 query); nvml.h itself is not needed to build.
//
// Thread semantics: one object per decoder thread; used_bytes() makes one
// NVML query (tens of microseconds).
#pragma once

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ws_moe::gpu {

class nvml_process_memory {
 public:
  /// pci_bus_id: the CUDA device's (cudaDeviceGetPCIBusId), e.g. "0000:1B:00.0".
  explicit nvml_process_memory(const std::string& pci_bus_id) {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) {
      why_ = std::string("libnvidia-ml.so.1 not loadable: ") + dlerror();
      return;
    }
    init_ = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlInit_v2"));
    shutdown_ = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlShutdown"));
    by_pci_ = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    procs_ = reinterpret_cast<int (*)(void*, unsigned*, process_info*)>(dlsym(lib_, "nvmlDeviceGetComputeRunningProcesses_v3"));
    if (init_ == nullptr || shutdown_ == nullptr || by_pci_ == nullptr || procs_ == nullptr) {
      why_ = "libnvidia-ml.so.1 lacks nvmlInit_v2, nvmlDeviceGetHandleByPciBusId_v2 or "
             "nvmlDeviceGetComputeRunningProcesses_v3";
      return;
    }
    if (const int rc = init_(); rc != 0) {
      why_ = "nvmlInit_v2 returned " + std::to_string(rc);
      return;
    }
    initialised_ = true;
    if (const int rc = by_pci_(pci_bus_id.c_str(), &device_); rc != 0) {
      why_ = "nvmlDeviceGetHandleByPciBusId_v2(" + pci_bus_id + ") returned " + std::to_string(rc);
      return;
    }
    pid_ = unsigned(getpid());
    if (used_bytes() < 0) return;  // why_ set
    available_ = true;
  }
  nvml_process_memory(const nvml_process_memory&) = delete;
  nvml_process_memory& operator=(const nvml_process_memory&) = delete;
  ~nvml_process_memory() {
    if (initialised_) (void)shutdown_();
    if (lib_ != nullptr) dlclose(lib_);
  }

  [[nodiscard]] bool available() const noexcept { return available_; }
  /// Why NVML cannot be read (empty when available()).
  [[nodiscard]] const std::string& why() const noexcept { return why_; }
  /// How the process was matched: "pid" or "the device's only compute process".
  [[nodiscard]] const std::string& source() const noexcept { return source_; }

  /// Bytes of device memory NVML attributes to this process now; -1 where it
  /// cannot say (why() then tells).
  long long used_bytes() {
    if (device_ == nullptr) return -1;
    unsigned count = unsigned(list_.size());
    int rc = procs_(device_, &count, list_.data());
    if (rc == insufficient_size) {
      list_.resize(std::size_t(count) * 2 + 8);
      count = unsigned(list_.size());
      rc = procs_(device_, &count, list_.data());
    }
    if (rc != 0) {
      why_ = "nvmlDeviceGetComputeRunningProcesses_v3 returned " + std::to_string(rc);
      return -1;
    }
    for (unsigned i = 0; i < count; ++i)
      if (list_[i].pid == pid_) {
        source_ = "pid";
        return valid(list_[i].used_bytes);
      }
    if (count == 1) {
      source_ = "the device's only compute process";
      return valid(list_[0].used_bytes);
    }
    why_ = "NVML lists " + std::to_string(count) + " compute processes on the device, none with pid " +
           std::to_string(pid_);
    return -1;
  }

 private:
  struct process_info {  // nvmlProcessInfo_t (v2/v3 layout)
    unsigned pid;
    unsigned long long used_bytes;
    unsigned gpu_instance_id;
    unsigned compute_instance_id;
  };
  static constexpr int insufficient_size = 7;                  // NVML_ERROR_INSUFFICIENT_SIZE
  static constexpr unsigned long long not_available = ~0ull;  // NVML_VALUE_NOT_AVAILABLE
  long long valid(unsigned long long b) {
    if (b == not_available) {
      why_ = "NVML reports no memory figure for the process";
      return -1;
    }
    return static_cast<long long>(b);
  }

  void* lib_ = nullptr;
  int (*init_)() = nullptr;
  int (*shutdown_)() = nullptr;
  int (*by_pci_)(const char*, void**) = nullptr;
  int (*procs_)(void*, unsigned*, process_info*) = nullptr;
  void* device_ = nullptr;
  unsigned pid_ = 0;
  bool initialised_ = false, available_ = false;
  std::string why_, source_;
  std::vector<process_info> list_ = std::vector<process_info>(16);
};

}  // namespace ws_moe::gpu
