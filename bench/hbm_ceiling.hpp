// SPDX-License-Identifier: Apache-2.0
// bench/hbm_ceiling.hpp — the device-memory (HBM) read rate the HBM tier's
// benchmark (ws_bench --mode hbm) compares against, measured in the same run.
// Defined in bench_kernels.cu (CUDA builds only).
#pragma once

#include <cstddef>

namespace wsb {

/// GB/s (1e9 bytes per second) of a device-wide reduction (cub::DeviceReduce::Sum)
/// over `bytes` of device memory: the best of `passes` timed passes after one
/// untimed one. Allocates and frees its buffers (device memory, default
/// stream; synchronizes). Throws writescope::device_error on a CUDA failure.
double hbm_read_gbps(std::size_t bytes, int passes);

}  // namespace wsb
