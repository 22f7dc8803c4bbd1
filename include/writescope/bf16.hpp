// SPDX-License-Identifier: Apache-2.0
// writescope/bf16.hpp — the bfloat16 storage type of the KV cache.
//
// bf16 is 16 bits: sign, 8-bit exponent, 7-bit mantissa (the upper half of an
// IEEE-754 binary32). Conversion from float rounds to nearest even and keeps
// NaN a NaN. The type is trivially copyable and bit-compatible with CUDA's
// __nv_bfloat16, so device code reinterprets the same bytes.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#include "config.hpp"

namespace writescope {

/// One bfloat16 value, stored as its raw bits.
struct bf16 {
  std::uint16_t bits;

  /// float -> bf16, round to nearest even; NaN stays NaN (quiet).
  WS_HOST_DEVICE static constexpr bf16 from_float(float f) noexcept {
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};
    std::uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
    return bf16{static_cast<std::uint16_t>((u + rounding_bias) >> 16)};
  }

  /// bf16 -> float, exact.
  WS_HOST_DEVICE constexpr float to_float() const noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }

  WS_HOST_DEVICE friend constexpr bool operator==(bf16 a, bf16 b) noexcept { return a.bits == b.bits; }
};

static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2, "bf16 must be two bytes, like __nv_bfloat16");

/// Rounds a float to the nearest bf16 value and returns it as float.
WS_HOST_DEVICE constexpr float round_to_bf16(float f) noexcept { return bf16::from_float(f).to_float(); }

}  // namespace writescope
