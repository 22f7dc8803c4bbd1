// SPDX-License-Identifier: Apache-2.0
// Must not compile: an eviction copies D-window blocks to a host region; a
// device destination does not satisfy host_accessible_space.
// expect-error: no matching function for call to .+block_copy::evict\(.+device_space.+host_accessible_space<S>.+S::host_accessible \[with S = writescope::device_space\].+evaluated to .+false
#include <writescope/writescope.hpp>

namespace ws = writescope;
using layout = ws::gqa_layout<128>;

ws::block_copy evict_to_device(const ws::device_region<layout>& window, const ws::device_region<layout>& other) {
  return ws::block_copy::evict(window.blocks(0, 2), other.blocks(0, 2));
}
