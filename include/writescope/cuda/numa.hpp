// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/numa.hpp — the NUMA node of a CUDA device (numa.hpp,
// docs/MULTI-GPU.md, NUMA placement).
//
//   cuda_device_numa_node(device)  the host NUMA node the device's PCI slot
//                                  hangs off: cudaDeviceGetPCIBusId, then
//                                  /sys/bus/pci/devices/<bus id>/numa_node
//                                  (pci_device_numa_node); no_numa_node where
//                                  the platform does not report one (-1, no
//                                  such file): then place nothing
//
// Use it to give a page-owning pinned allocator (cuda_host_register,
// numa_placeable_allocator) the node of the GPU that streams its region; the
// tensor-parallel compositions do it for each rank on a host with more than
// one online node (cuda/tensor_parallel.hpp).
//
// Errors: cuda_error when cudaDeviceGetPCIBusId fails (an invalid device
// ordinal); a device whose node is not reported is not an error.
// Threads: any thread; it does not change the current device.
#pragma once

#include <cuda_runtime_api.h>

#include "../numa.hpp"
#include "cuda_error.hpp"

namespace writescope {

/// The NUMA node of CUDA device `device` (an ordinal of this process), or
/// no_numa_node when the platform does not report it. Throws cuda_error when
/// cudaDeviceGetPCIBusId fails.
inline int cuda_device_numa_node(int device) {
  char bus_id[64] = {};
  WS_CUDA_TRY(cudaDeviceGetPCIBusId(bus_id, int(sizeof bus_id), device));
  return pci_device_numa_node(bus_id);
}

}  // namespace writescope
