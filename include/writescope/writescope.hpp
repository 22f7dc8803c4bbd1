// SPDX-License-Identifier: Apache-2.0
// writescope/writescope.hpp — everything a host-compiled program needs:
// layouts and presets, the partition spec, routing policies, the InplaceKVCache
// format, the host backend and the hybrid attention step. CUDA users add
// <writescope/cuda/cuda_backend.hpp>.
#pragma once

#include "assist.hpp"
#include "backend.hpp"
#include "bf16.hpp"
#include "block_allocator.hpp"
#include "block_pool.hpp"
#include "config.hpp"
#include "error.hpp"
#include "host_backend.hpp"
#include "host_memory.hpp"
#include "hybrid_attention.hpp"
#include "inplace_kv_cache.hpp"
#include "layout.hpp"
#include "memory_space.hpp"
#include "numa.hpp"
#include "partial_state.hpp"
#include "partition_spec.hpp"
#include "policy.hpp"
#include "presets.hpp"
#include "region.hpp"
#include "sparse_pipeline.hpp"
#include "stream_plan.hpp"
#include "tensor_parallel.hpp"
