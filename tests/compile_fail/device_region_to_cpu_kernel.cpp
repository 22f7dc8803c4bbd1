// SPDX-License-Identifier: Apache-2.0
// Must not compile: a block of a device region (the D-window, ping-pong) is
// not host memory, so it cannot become a CPU kernel's kv_segment; only blocks
// of host-accessible regions can.
// expect-error: no matching function for call to .+kv_segment::kv_segment\(.+device_space.+host_accessible_space<Space>.+S::host_accessible \[with S = writescope::device_space\].+evaluated to .+false
#include <writescope/writescope.hpp>

namespace ws = writescope;
using layout = ws::gqa_layout<128>;

ws::cpu::kv_segment segment_of(const ws::device_region<layout>& window) {
  return ws::cpu::kv_segment(window.block(0), 16);
}
