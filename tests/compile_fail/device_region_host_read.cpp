// SPDX-License-Identifier: Apache-2.0
// Must not compile: a device region's block has no element access on the
// host (only host-accessible spaces do); its bytes reach the host through the
// backend's copies.
// expect-error: no match for .+operator\[\].+mem_span<writescope::bf16, writescope::device_space>.+Space::host_accessible \[with Space = writescope::device_space\].+evaluated to .+false
#include <writescope/writescope.hpp>

namespace ws = writescope;
using layout = ws::gqa_layout<128>;

ws::bf16 first_element(const ws::device_region<layout>& window) { return window.block(0)[0]; }
