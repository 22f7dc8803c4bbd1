// SPDX-License-Identifier: Apache-2.0
// writescope/region.hpp — typed regions: one layer's blocks in one memory
// space, and the one function that computes a block's address (paper §4.1,
// §4.3 `views`; docs/ARCHITECTURE.md, "The four regions").
//
// A region view is to the cache's regions what mdspan is to an array: a
// non-owning handle made of three parts, each a part of its type or its value.
//
//   Layout   the block format (layout.hpp): what one block holds and where an
//            element lies inside it (block_format::offset)
//   Space    the memory space (memory_space.hpp): pageable host, pinned host
//            or device. Addresses come out as mem_span<bf16, Space>, so a
//            device block cannot reach code that reads host memory (the CPU
//            kernel's kv_segment accepts host spaces only)
//   Storage  where the blocks lie: arena_storage (one allocation, layer l's
//            blocks at [l * layer_blocks, ...)) or slab_storage (page-locked
//            slabs; slab k holds blocks [k * slab_blocks, (k + 1) *
//            slab_blocks) of every layer, layer after layer)
//
// The block mapping is the storage's place(layer, id) (which allocation, which
// block of it) followed by region_view::block(id), which multiplies by the
// block size: every block address in the library, on the host and in the
// engines' launch code, comes from there.
//
// The four regions of a cache (inplace_kv_cache.hpp) as types:
//   unpinned compute  cpu_region<Layout>        pageable_host_space, arena
//   pinned load       pinned_region<Layout>     pinned_host_space, slabs
//   D-window          device_region<Layout>     device_space, arena; sequence
//                     slot s's blocks are ids [s * window_blocks, (s + 1) * window_blocks)
//   ping-pong         ping_pong_view<Layout>    device_space, arena; buffer b's
//                     blocks are ids [b * buffer_blocks, (b + 1) * buffer_blocks)
//
// The views are plain values (a few words), valid while the cache's regions
// are (until its next mutating call). They never touch the memory: reading a
// device region's bytes is the backend's business. Headers compile with the
// host compiler alone (no CCCL in writescope::core; docs/DECISIONS.md).
// Thread safety: values; any number of threads may use copies at once.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>

#include "bf16.hpp"
#include "config.hpp"
#include "layout.hpp"
#include "memory_space.hpp"

namespace writescope {

/// A space whose memory the host may read: the only spaces a CPU kernel, a
/// host memcpy or a host-side summary may be handed.
template <class S>
concept host_accessible_space = memory_space<S> && S::host_accessible;

/// Where block `index` of one allocation starting at `base` lies (see
/// region_view::block, which turns it into an address).
struct block_place {
  bf16* base = nullptr;
  index_t index = 0;
};

/// Storage of one allocation: layer l's blocks at [l * layer_blocks, (l + 1) *
/// layer_blocks) from `base` (the unpinned arena, the D-window, ping-pong).
struct arena_storage {
  bf16* base = nullptr;
  index_t layer_blocks = 0;

  [[nodiscard]] WS_HOST_DEVICE constexpr block_place place(int layer, index_t id) const noexcept {
    return {base, index_t(layer) * layer_blocks + id};
  }
};

/// Storage of page-locked slabs: slab k holds blocks [k * slab_blocks, (k + 1)
/// * slab_blocks) of every layer, layer l's at [l * slab_blocks, ...) inside
/// it (the pinned load region, which grows slab by slab).
struct slab_storage {
  bf16* const* slabs = nullptr;
  index_t num_slabs = 0;
  index_t slab_blocks = 1;

  [[nodiscard]] WS_HOST_DEVICE constexpr block_place place(int layer, index_t id) const noexcept {
    return {slabs[id / slab_blocks], index_t(layer) * slab_blocks + id % slab_blocks};
  }
};

/// A region storage: place(layer, id) names the allocation and the block of it.
template <class S>
concept region_storage = std::copyable<S> && requires(const S& s, int layer, index_t id) {
  { s.place(layer, id) } -> std::same_as<block_place>;
};

/// One layer's blocks of one region (see the file comment). `format` is the
/// block format; `layer` selects the layer's arena inside the storage.
template <kv_layout Layout, memory_space Space, region_storage Storage>
struct region_view {
  using layout_type = Layout;
  using space_type = Space;
  using storage_type = Storage;
  using block_span = mem_span<bf16, Space>;

  block_format<Layout> format{};
  Storage storage{};
  int layer = 0;

  /// Block `id` of this layer: block_elems() elements in Space. The one block
  /// address computation of the library. No bounds check (ids come from the
  /// cache's block tables).
  [[nodiscard]] WS_HOST_DEVICE constexpr block_span block(index_t id) const noexcept {
    const block_place p = storage.place(layer, id);
    return block_span(p.base + p.index * format.block_elems(), format.block_elems());
  }
  /// Blocks [id, id + n) as one span: they must lie in one allocation (always
  /// so for arena storage; within one slab for slab storage).
  [[nodiscard]] WS_HOST_DEVICE constexpr block_span blocks(index_t id, index_t n) const noexcept {
    return block_span(block(id).data(), n * format.block_elems());
  }
  /// Row `token` of (plane, kv_head) in block `id`: Layout::row_elems elements.
  [[nodiscard]] WS_HOST_DEVICE constexpr block_span row(index_t id, int plane, int kv_head, int token) const noexcept {
    return block(id).subspan(format.offset(plane, kv_head, token, 0), Layout::row_elems);
  }
  /// Blocks [id, id + n) as a region of their own (block k of it is block id +
  /// k here); they must lie in one allocation, as for blocks().
  [[nodiscard]] WS_HOST_DEVICE constexpr region_view<Layout, Space, arena_storage> sub(index_t id,
                                                                                       index_t n) const noexcept {
    return {format, arena_storage{block(id).data(), n}, 0};
  }
  /// The same region at another layer.
  [[nodiscard]] constexpr region_view at_layer(int l) const noexcept {
    region_view v = *this;
    v.layer = l;
    return v;
  }
  /// Whether block `b` starts where block `a` ends (one copy can move both).
  [[nodiscard]] constexpr bool adjacent(index_t a, index_t b) const noexcept {
    return block(b).data() == block(a).data() + format.block_elems();
  }
};

template <kv_layout Layout>
using cpu_region = region_view<Layout, pageable_host_space, arena_storage>;
template <kv_layout Layout>
using pinned_region = region_view<Layout, pinned_host_space, slab_storage>;
template <kv_layout Layout>
using device_region = region_view<Layout, device_space, arena_storage>;

/// The blocks of one contiguous span as a region of their own (block k at
/// k * block_elems from its start): a stream run, a staging buffer, a buffer
/// allocated outside the cache. A view of const memory is for reading only.
template <kv_layout Layout, class T, memory_space Space>
  requires std::same_as<std::remove_const_t<T>, bf16>
[[nodiscard]] WS_HOST_DEVICE constexpr region_view<Layout, Space, arena_storage> contiguous_region(
    const block_format<Layout>& format, const mem_span<T, Space>& blocks) noexcept {
  return {format, arena_storage{const_cast<bf16*>(blocks.data()), 0}, 0};
}

/// The ping-pong buffers (device): `buffers` buffers of `buffer_blocks` blocks,
/// buffer b's block j at id b * buffer_blocks + j of `region`.
template <kv_layout Layout>
struct ping_pong_view {
  device_region<Layout> region{};
  int buffers = 0;
  index_t buffer_blocks = 0;

  /// Number of buffers.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return std::size_t(buffers); }
  /// Block j of buffer b.
  [[nodiscard]] WS_HOST_DEVICE constexpr mem_span<bf16, device_space> block(int b, index_t j) const noexcept {
    return region.block(index_t(b) * buffer_blocks + j);
  }
  /// Buffer b as a region (block j of it is block j of the buffer).
  [[nodiscard]] WS_HOST_DEVICE constexpr device_region<Layout> buffer_region(int b) const noexcept {
    return region.sub(index_t(b) * buffer_blocks, buffer_blocks);
  }
  /// The whole of buffer b.
  [[nodiscard]] WS_HOST_DEVICE constexpr mem_span<bf16, device_space> buffer(int b) const noexcept {
    return region.blocks(index_t(b) * buffer_blocks, buffer_blocks);
  }
};

/// Reinterprets a span's memory space. For a backend whose "device" memory is
/// host memory (host_backend's emulated device reads its D-window and
/// ping-pong with the CPU kernel); nothing else may use it: every other
/// crossing of spaces is a copy by the backend.
template <memory_space To, class T, memory_space From>
[[nodiscard]] constexpr mem_span<T, To> space_cast(const mem_span<T, From>& s) noexcept {
  return mem_span<T, To>(s.data(), s.size());
}

}  // namespace writescope
