// SPDX-License-Identifier: Apache-2.0
// writescope/memory_space.hpp — memory spaces as types: a wrong-space use is a
// compile error.
//
// A pointer into the pageable host region, the page-locked load region or device
// memory carries its space in its type, so handing a device pointer to the CPU
// kernel, or a pageable pointer to a DMA engine, is a compile error rather than
// a crash or a silently synchronous copy.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include "config.hpp"

namespace writescope {

/// Ordinary (pageable) host memory: the unpinned compute region, CPU partials.
struct pageable_host_space {
  static constexpr const char* name = "pageable host";
  static constexpr bool host_accessible = true;
};
/// Page-locked host memory: the pinned load region, staging buffers. Readable by
/// the host, and the only valid source of an asynchronous H2D copy.
struct pinned_host_space {
  static constexpr const char* name = "pinned host";
  static constexpr bool host_accessible = true;
};
/// Memory of the device the backend drives: D-window, ping-pong buffers,
/// activations of the CUDA backend. Under host_backend this is host memory that
/// only the backend's emulated device engine touches.
struct device_space {
  static constexpr const char* name = "device";
  static constexpr bool host_accessible = false;
};

template <class S>
concept memory_space = std::same_as<S, pageable_host_space> || std::same_as<S, pinned_host_space> ||
                       std::same_as<S, device_space>;

/// A non-owning, typed view of `size()` elements of T in memory space Space.
/// Construction from a raw pointer is explicit: the caller states the space.
template <class T, memory_space Space>
class mem_span {
 public:
  using element_type = T;
  using space_type = Space;

  constexpr mem_span() noexcept = default;
  WS_HOST_DEVICE constexpr explicit mem_span(T* data, index_t size) noexcept : data_(data), size_(size) {}

  /// Converts mem_span<T> to mem_span<const T> in the same space.
  template <class U>
    requires(std::is_convertible_v<U (*)[], T (*)[]>)
  WS_HOST_DEVICE constexpr mem_span(const mem_span<U, Space>& other) noexcept  // NOLINT(google-explicit-constructor)
      : data_(other.data()), size_(other.size()) {}

  [[nodiscard]] WS_HOST_DEVICE constexpr T* data() const noexcept { return data_; }
  [[nodiscard]] WS_HOST_DEVICE constexpr index_t size() const noexcept { return size_; }
  [[nodiscard]] WS_HOST_DEVICE constexpr bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] WS_HOST_DEVICE constexpr mem_span subspan(index_t offset, index_t count) const noexcept {
    return mem_span(data_ + offset, count);
  }

  /// Element access exists only for host-accessible spaces.
  [[nodiscard]] constexpr T& operator[](index_t i) const noexcept
    requires(Space::host_accessible)
  {
    return data_[i];
  }

  /// A std::span over host-accessible memory.
  [[nodiscard]] constexpr std::span<T> host() const noexcept
    requires(Space::host_accessible)
  {
    return std::span<T>(data_, static_cast<std::size_t>(size_));
  }

 private:
  T* data_ = nullptr;
  index_t size_ = 0;
};

template <class T>
using host_span = mem_span<T, pageable_host_space>;
template <class T>
using pinned_span = mem_span<T, pinned_host_space>;
template <class T>
using device_span = mem_span<T, device_space>;

}  // namespace writescope
