// SPDX-License-Identifier: Apache-2.0
// writescope/layout.hpp — what one token's KV is (GQA, MLA) and how a block
// stores it (paper §4.1, §6.1). Layouts are types: kernels never branch on a
// runtime layout value.
//
// A layout type fixes the per-head row width at compile time (the kernels are
// instantiated per row width) and keeps the head counts as runtime values.
//
// Block format (the same in every region: unpinned compute, pinned load,
// D-window and ping-pong), for a block of `block_tokens` tokens:
//
//     block[plane][kv_head][token_in_block][row_elem]      bf16, row-major
//
// GQA: plane 0 = K, plane 1 = V, kv_head in [0, Hkv), row = head_dim.
// MLA (absorbed, DeepSeek-V2): one plane, one shared "head", row = c_kv ‖ k_pe
// (kv_lora_rank + rope_dim); the value of a token is the first kv_lora_rank
// elements of its row (the latent), so V costs no extra bytes.
//
// Each (plane, kv_head) slice of a block is contiguous — the per-head layout the
// CPU kernel streams — and each block is contiguous as a whole, which is what a
// DMA engine moves. Eviction and streaming are therefore whole-block copies.
//
// `placement` names the region a placed block lives in (unpinned compute,
// pinned load, or the HBM-resident region on the device); routing policies
// (policy.hpp) choose it, the cache's block tables record it.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "bf16.hpp"
#include "config.hpp"
#include "error.hpp"

namespace writescope {

/// Opt-in tag: a type is a kv_layout only if it declares `using layout_concept = kv_layout_tag;`.
struct kv_layout_tag {};

// -----------------------------------------------------------------------------
// GQA
// -----------------------------------------------------------------------------

/// Grouped-query attention: Hq query heads share Hkv KV heads; query head h reads
/// KV head h / (Hq / Hkv) (PyTorch `enable_gqa` rule). K and V rows are HeadDim
/// wide. HeadDim is a compile-time constant; see `supported_gqa_head_dims`.
template <int HeadDim>
class gqa_layout {
  static_assert(HeadDim > 0 && HeadDim % 32 == 0,
                "gqa_layout: HeadDim must be a positive multiple of 32 so that a row is whole SIMD vectors");

 public:
  using layout_concept = kv_layout_tag;
  static constexpr int planes = 2;               ///< K and V
  static constexpr int key_plane = 0;
  static constexpr int value_plane = 1;
  static constexpr int row_elems = HeadDim;      ///< elements of one (plane, kv_head, token) row
  static constexpr int head_dim = HeadDim;
  static constexpr int q_dim = HeadDim;          ///< elements of one query head
  static constexpr int v_dim = HeadDim;          ///< elements of one output head
  static constexpr bool is_mla = false;

  /// One query head, one KV head (a valid placeholder; value-initialised aggregates need it).
  constexpr gqa_layout() noexcept = default;

  /// Throws config_error unless 0 < num_kv_heads, 0 < num_q_heads and
  /// num_q_heads % num_kv_heads == 0.
  constexpr gqa_layout(int num_q_heads, int num_kv_heads) : hq_(num_q_heads), hkv_(num_kv_heads) {
    if (num_q_heads <= 0 || num_kv_heads <= 0)
      throw config_error("gqa_layout: head counts must be positive (Hq=" + std::to_string(num_q_heads) +
                         ", Hkv=" + std::to_string(num_kv_heads) + ")");
    if (num_q_heads % num_kv_heads != 0)
      throw config_error("gqa_layout: Hq=" + std::to_string(num_q_heads) + " is not a multiple of Hkv=" +
                         std::to_string(num_kv_heads) + " (each KV head must serve a whole group of query heads)");
  }

  [[nodiscard]] constexpr int num_q_heads() const noexcept { return hq_; }
  /// KV heads stored per token (the second index of the block format).
  [[nodiscard]] constexpr int kv_heads() const noexcept { return hkv_; }
  /// Query heads per KV head.
  [[nodiscard]] constexpr int group_size() const noexcept { return hq_ / hkv_; }
  /// bf16 bytes of one token's K and V in one layer.
  [[nodiscard]] constexpr index_t token_bytes() const noexcept {
    return index_t{planes} * hkv_ * row_elems * index_t{sizeof(bf16)};
  }

  friend constexpr bool operator==(const gqa_layout&, const gqa_layout&) = default;

 private:
  int hq_ = 1;
  int hkv_ = 1;
};

// -----------------------------------------------------------------------------
// MLA (absorbed form)
// -----------------------------------------------------------------------------

/// Multi-head latent attention in absorbed form (DeepSeek-V2, paper §6.1): one
/// cache row per token, c_kv[KvLoraRank] ‖ k_pe[RopeDim], shared by all heads.
/// The caller folds W_UK into the query (q' = q_nope·W_UK ‖ q_pe, KvLoraRank +
/// RopeDim wide) and expands the latent output (KvLoraRank wide) with W_UV.
template <int KvLoraRank, int RopeDim>
class mla_layout {
  static_assert(KvLoraRank > 0 && KvLoraRank % 32 == 0, "mla_layout: kv_lora_rank must be a multiple of 32");
  static_assert(RopeDim >= 0 && RopeDim % 32 == 0, "mla_layout: rope dim must be a multiple of 32");

 public:
  using layout_concept = kv_layout_tag;
  static constexpr int planes = 1;
  static constexpr int key_plane = 0;
  static constexpr int value_plane = 0;          ///< values are the first kv_lora_rank elements of the row
  static constexpr int kv_lora_rank = KvLoraRank;
  static constexpr int rope_dim = RopeDim;
  static constexpr int row_elems = KvLoraRank + RopeDim;
  static constexpr int q_dim = KvLoraRank + RopeDim;
  static constexpr int v_dim = KvLoraRank;
  static constexpr bool is_mla = true;

  /// One query head (a valid placeholder; value-initialised aggregates need it).
  constexpr mla_layout() noexcept = default;

  /// Throws config_error unless num_q_heads > 0.
  explicit constexpr mla_layout(int num_q_heads) : hq_(num_q_heads) {
    if (num_q_heads <= 0)
      throw config_error("mla_layout: Hq must be positive (Hq=" + std::to_string(num_q_heads) + ")");
  }

  [[nodiscard]] constexpr int num_q_heads() const noexcept { return hq_; }
  [[nodiscard]] constexpr int kv_heads() const noexcept { return 1; }
  [[nodiscard]] constexpr int group_size() const noexcept { return hq_; }
  [[nodiscard]] constexpr index_t token_bytes() const noexcept { return index_t{row_elems} * index_t{sizeof(bf16)}; }

  friend constexpr bool operator==(const mla_layout&, const mla_layout&) = default;

 private:
  int hq_ = 1;
};

// -----------------------------------------------------------------------------
// Concept
// -----------------------------------------------------------------------------

template <class L>
concept kv_layout = std::same_as<typename L::layout_concept, kv_layout_tag> && requires(const L& l) {
  { L::planes } -> std::convertible_to<int>;
  { L::key_plane } -> std::convertible_to<int>;
  { L::value_plane } -> std::convertible_to<int>;
  { L::row_elems } -> std::convertible_to<int>;
  { L::q_dim } -> std::convertible_to<int>;
  { L::v_dim } -> std::convertible_to<int>;
  { L::is_mla } -> std::convertible_to<bool>;
  { l.num_q_heads() } -> std::same_as<int>;
  { l.kv_heads() } -> std::same_as<int>;
  { l.group_size() } -> std::same_as<int>;
  { l.token_bytes() } -> std::same_as<index_t>;
};

static_assert(kv_layout<gqa_layout<128>>);
static_assert(kv_layout<mla_layout<512, 64>>);

// -----------------------------------------------------------------------------
// Block format
// -----------------------------------------------------------------------------

/// Address arithmetic of one block (see the file comment). All results are
/// element counts (bf16 elements), 64-bit.
template <kv_layout Layout>
struct block_format {
  Layout layout{};
  int block_tokens = 1;

  /// Elements of one (plane, kv_head) slice: block_tokens rows.
  [[nodiscard]] constexpr index_t slice_elems() const noexcept { return index_t{block_tokens} * Layout::row_elems; }
  /// Elements of one whole block.
  [[nodiscard]] constexpr index_t block_elems() const noexcept {
    return index_t{Layout::planes} * layout.kv_heads() * slice_elems();
  }
  [[nodiscard]] constexpr index_t block_bytes() const noexcept { return block_elems() * index_t{sizeof(bf16)}; }
  /// Offset of element (plane, kv_head, token, elem) from the start of a block
  /// of `kv_heads` heads and `block_tokens` rows: the in-block address formula,
  /// for code that holds the two counts as values (the CUDA kernels).
  [[nodiscard]] WS_HOST_DEVICE static constexpr index_t offset_in(int kv_heads, int block_tokens, int plane,
                                                                  int kv_head, int token, int elem) noexcept {
    return ((index_t{plane} * kv_heads + kv_head) * block_tokens + token) * Layout::row_elems + elem;
  }
  /// Offset of element (plane, kv_head, token, elem) from the block's start.
  [[nodiscard]] constexpr index_t offset(int plane, int kv_head, int token, int elem) const noexcept {
    return offset_in(layout.kv_heads(), block_tokens, plane, kv_head, token, elem);
  }
  /// Offset of the first row of (plane, kv_head).
  [[nodiscard]] constexpr index_t slice_offset(int plane, int kv_head) const noexcept {
    return offset(plane, kv_head, 0, 0);
  }
};

// constexpr checks of the layout arithmetic.
static_assert(block_format<gqa_layout<128>>{gqa_layout<128>(32, 4), 16}.block_elems() == 2 * 4 * 16 * 128);
static_assert(block_format<gqa_layout<128>>{gqa_layout<128>(32, 4), 16}.offset(1, 3, 15, 127) ==
              2 * 4 * 16 * 128 - 1);
static_assert(block_format<mla_layout<512, 64>>{mla_layout<512, 64>(16), 64}.block_bytes() == 64 * 576 * 2);
static_assert(gqa_layout<128>(32, 4).token_bytes() == 2048);   // Qwen3-30B-A3B
static_assert(gqa_layout<128>(32, 8).token_bytes() == 4096);   // Mixtral-8x7B
static_assert(mla_layout<512, 64>(16).token_bytes() == 1152);  // DeepSeek-V2-Lite

// -----------------------------------------------------------------------------
// Host regions
// -----------------------------------------------------------------------------

/// The region a placed block lives in, chosen for good when its eviction batch
/// is written (the write-time principle, paper §4.1, §5). Every region holds
/// blocks in the block format above; a block's id indexes its region.
enum class placement : std::uint8_t {
  cpu_compute = 0,   ///< unpinned compute region, attended in place by the CPU engine
  gpu_load = 1,      ///< pinned load region, streamed to the GPU through ping-pong
  gpu_resident = 2,  ///< HBM-resident region (device memory), attended in place by the GPU engine
};

/// "cpu_compute" / "gpu_load" / "gpu_resident".
[[nodiscard]] constexpr const char* to_string(placement p) noexcept {
  return p == placement::cpu_compute ? "cpu_compute" : p == placement::gpu_load ? "gpu_load" : "gpu_resident";
}

// -----------------------------------------------------------------------------
// Runtime -> compile-time dispatch (one small table per parameter)
// -----------------------------------------------------------------------------

/// Head dims for which GQA kernels are instantiated. Keep this short: every
/// entry multiplies compile time.
inline constexpr std::array<int, 3> supported_gqa_head_dims{64, 128, 256};

/// Calls f(std::integral_constant<int, D>{}) for the D in `Values` equal to
/// `value`; throws config_error naming `what`, the value and the supported set
/// otherwise.
template <int... Values, class F>
  requires(sizeof...(Values) > 0)
decltype(auto) dispatch_value(int value, const char* what, F&& f) {
  constexpr int first = std::array<int, sizeof...(Values)>{Values...}[0];
  using result_t = decltype(std::forward<F>(f)(std::integral_constant<int, first>{}));
  if constexpr (std::is_void_v<result_t>) {
    bool hit =
        ((value == Values ? (std::forward<F>(f)(std::integral_constant<int, Values>{}), true) : false) || ...);
    if (hit) return;
  } else {
    std::optional<result_t> r;
    (void)((value == Values ? (r.emplace(std::forward<F>(f)(std::integral_constant<int, Values>{})), true) : false) || ...);
    if (r) return result_t(std::move(*r));  // a prvalue: decltype(auto) must not deduce result_t&& to a local
  }
  std::string supported;
  ((supported += (supported.empty() ? "" : ", ") + std::to_string(Values)), ...);
  throw config_error(std::string(what) + " " + std::to_string(value) + " is not supported; supported: " + supported);
}

/// dispatch_value over supported_gqa_head_dims.
template <class F>
decltype(auto) dispatch_head_dim(int head_dim, F&& f) {
  return dispatch_value<64, 128, 256>(head_dim, "head dim", std::forward<F>(f));
}

}  // namespace writescope
