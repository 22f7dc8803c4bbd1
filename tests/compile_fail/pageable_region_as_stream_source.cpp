// SPDX-License-Identifier: Apache-2.0
// Must not compile: a stream plan's runs are DMA sources and must lie in the
// page-locked load region; a block of the pageable compute region does not
// convert to one.
// expect-error: conversion from .+mem_span<writescope::bf16, ?writescope::pageable_host_space>.+ to non-scalar type .+mem_span<const writescope::bf16, ?writescope::pinned_host_space>.+ requested
#include <writescope/writescope.hpp>

namespace ws = writescope;
using layout = ws::gqa_layout<128>;

void plan_from_pageable(ws::stream_plan& plan, const ws::cpu_region<layout>& cpu, std::span<const ws::block_id> ids) {
  plan.build(
      1, [&](int) { return ids; }, [&](ws::block_id id) { return cpu.block(id); }, cpu.format.block_elems(), 8, 4, 2);
}
