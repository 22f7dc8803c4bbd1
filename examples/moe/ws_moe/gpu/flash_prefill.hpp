// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/flash_prefill.hpp — causal self-attention of a ragged batch of
// prompts (prefill), with bf16 q/k/v and fp32 output: the parameter block, its
// checks, and the host twin. The CUDA kernel is declared in
// flash_prefill_launch.hpp and defined in flash_prefill.cu (nvcc); this header
// needs no CUDA headers and compiles with g++ and nvcc.
//
// Contract (both implementations)
//   Sequence s owns the token rows [seq_offsets[s], seq_offsets[s+1]) of q, k,
//   v, out and lse. Query token t of a sequence (t counted from the sequence's
//   first row) attends the keys 0..t of the same sequence, nothing else:
//     out[t][h] = sum_{j<=t} softmax_j(scale * q[t][h] . k[j][h/g]) * v[j][h/g],  g = hq / hkv
//     lse[t][h] = ln sum_{j<=t} exp(scale * q[t][h] . k[j][h/g])      (natural log)
//   Element (token, head, e) of q is at q[token*q_token_stride + head*q_head_stride + e]
//   (strides in elements), likewise k, v and out; lse is dense [tokens][hq].
//   Rows outside every sequence (before seq_offsets[0], in no [start, end))
//   and the padding between heads or tokens of out are never written.
//   out and lse must not overlap q, k, v or each other.
//
// The CUDA kernel (flash_prefill.cu, sm_90), a FlashAttention-2-style forward
// pass (Dao, "FlashAttention-2", 2023, section 3.1: Algorithm 1 with the
// causal block skip):
//   * A CTA is 8 warps and owns 128 (query head, query position) rows of one
//     sequence and one KV head: 8 query heads x 16 positions when the GQA group
//     (hq / hkv) is a multiple of 8, 4 x 32 for a multiple of 4, 2 x 64 when it
//     is even, 1 x 128 otherwise (MLA, hq == hkv). The heads of a CTA share one
//     KV head, so every K/V tile brought into shared memory serves all 128 rows
//     (128 FLOP per byte read from L2). Each warp owns 16 rows of one head.
//   * Keys are walked in tiles of 64 from key 0 to the tile holding the CTA's
//     last query row; tiles above the diagonal are never loaded. A warp stops
//     at the tile holding its own 16 rows and masks only that one (key > query
//     -> -inf); with 16 or 32 positions per CTA every warp needs the same
//     tiles, with 64 or 128 the warps of the lower rows skip the last ones.
//   * S = Q K^T and O += P V run on tensor cores (mma.sync m16n8k16, bf16 in,
//     fp32 accumulate); Q fragments stay in registers for the whole pass, K/V
//     fragments come from shared memory through ldmatrix (.trans for V). The
//     scores of a tile never leave registers: online softmax in fp32 (running
//     max and sum per row, exp2 with the scale folded in), P rounded to bf16
//     only as the A operand of P V, the row sum taken from the unrounded P.
//   * K/V tiles are triple-buffered in shared memory and filled with cp.async
//     (16-byte copies, zero-fill past the sequence end): tiles j+1 and j+2
//     stream in while tile j is computed; one CTA barrier per tile.
//     Shared-memory rows are padded by 16 bytes, which makes every ldmatrix
//     conflict-free.
//   * The grid is one-dimensional and ordered longest work first: block b
//     takes query tile (q_tiles - 1 - b / W) of work item b % W, W = sequences
//     x KV heads x head groups, so the CTAs with the most key tiles start first
//     and the short ones fill the tail; consecutive blocks share a sequence and
//     differ in KV head or head group.
//   * Output: fp32, divided by the row sum once at the end; lse on request.
//   Shared memory per CTA: 2 x 128 x (dqk + 8) + 3 x 2 x 64 x (dqk + dv + 16)
//   bytes (136 KiB at 128/128, 176 KiB at 192/128): one CTA of 8 warps per SM.
//   Supported (dqk, dv): (64, 64), (128, 128), (192, 128), (48, 16).
//   Not done: no dropout, no sliding window, no paged K/V, no bf16 output, no
//   backward pass, no split over keys (a long query tile is one CTA), no
//   Hopper-only wgmma/TMA path, no overlap of softmax with the next tile's
//   products inside a warp (the other warps of the SM fill those gaps).
//
// The host twin (flash_prefill_host) runs the same contract in fp32 on the
// host (scores, softmax and products in float), OpenMP over (token, head),
// for the emulated executor (--device emulated) and CI. It accepts any head
// dims.
//
// Errors: writescope::config_error naming the value and the rule; nothing is
// written when a check fails.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <writescope/error.hpp>

#include "kernel_math.hpp"

namespace ws_moe::gpu {

/// Causal self-attention of a ragged batch of prompts (each sequence attends
/// only itself; token t of a sequence attends tokens 0..t of the same
/// sequence). bf16 inputs, fp32 accumulation. Pointers are device memory for
/// launch_flash_prefill, host memory for flash_prefill_host.
struct flash_prefill_params {
  const std::uint16_t* q = nullptr;  ///< bf16 bits, [tokens][hq][dqk] with the strides below (elements)
  const std::uint16_t* k = nullptr;  ///< bf16 bits, [tokens][hkv][dqk]
  const std::uint16_t* v = nullptr;  ///< bf16 bits, [tokens][hkv][dv]
  float* out = nullptr;              ///< fp32, [tokens][hq][dv]
  float* lse = nullptr;              ///< optional fp32 [tokens][hq]: natural-log LSE of the scaled scores; null = not written
  const int* seq_offsets = nullptr;  ///< [num_seqs+1] token offsets of the sequences (device memory for the CUDA launch, host memory for the host twin)
  int num_seqs = 0;
  idx max_seq_tokens = 0;            ///< longest sequence (grid sizing)
  int hq = 0, hkv = 0;               ///< query heads; KV heads (hq % hkv == 0; query head h reads KV head h / (hq/hkv))
  int dqk = 0, dv = 0;               ///< head dims of q/k and of v/out
  idx q_token_stride = 0, q_head_stride = 0;  ///< elements
  idx k_token_stride = 0, k_head_stride = 0;
  idx v_token_stride = 0, v_head_stride = 0;
  idx o_token_stride = 0, o_head_stride = 0;
  float scale = 0;                   ///< softmax scale applied to q·k
};

/// The (dqk, dv) pairs the CUDA kernel is built for.
struct flash_prefill_dims {
  int dqk, dv;
};
inline constexpr flash_prefill_dims flash_prefill_supported_dims[] = {{64, 64}, {128, 128}, {192, 128}, {48, 16}};

/// Query heads and positions per CTA of the CUDA kernel for a GQA group of
/// `group` query heads per KV head (8 warps x 16 rows: 8 heads x 16 positions,
/// 4 x 32, 2 x 64 or 1 x 128).
[[nodiscard]] inline int flash_prefill_heads_per_cta(int group) {
  return group % 8 == 0 ? 8 : (group % 4 == 0 ? 4 : (group % 2 == 0 ? 2 : 1));
}
[[nodiscard]] inline int flash_prefill_positions_per_cta(int group) { return 128 / flash_prefill_heads_per_cta(group); }

namespace flash_detail {

[[noreturn]] inline void fail(const std::string& rule) { throw writescope::config_error("flash prefill: " + rule); }

inline std::string dims_list() {
  std::string s;
  for (const auto& d : flash_prefill_supported_dims)
    s += (s.empty() ? "" : ", ") + std::string("(") + std::to_string(d.dqk) + ", " + std::to_string(d.dv) + ")";
  return s;
}

/// The rules both implementations share (shapes, strides, pointers, scale).
inline void check_common(const flash_prefill_params& p) {
  if (p.num_seqs < 0) fail("num_seqs " + std::to_string(p.num_seqs) + " is negative");
  if (p.max_seq_tokens < 0) fail("max_seq_tokens " + std::to_string(p.max_seq_tokens) + " is negative");
  if (p.max_seq_tokens > std::numeric_limits<int>::max())
    fail("max_seq_tokens " + std::to_string(p.max_seq_tokens) + " exceeds 2^31-1 (token offsets are int)");
  if (p.hq <= 0 || p.hkv <= 0)
    fail("hq " + std::to_string(p.hq) + " and hkv " + std::to_string(p.hkv) + " must be positive");
  if (p.hq % p.hkv != 0)
    fail("hq " + std::to_string(p.hq) + " is not a multiple of hkv " + std::to_string(p.hkv));
  if (p.dqk <= 0 || p.dv <= 0)
    fail("head dims dqk " + std::to_string(p.dqk) + " and dv " + std::to_string(p.dv) + " must be positive");
  const struct {
    const char* name;
    idx value;
  } strides[] = {{"q_token_stride", p.q_token_stride}, {"q_head_stride", p.q_head_stride},
                 {"k_token_stride", p.k_token_stride}, {"k_head_stride", p.k_head_stride},
                 {"v_token_stride", p.v_token_stride}, {"v_head_stride", p.v_head_stride},
                 {"o_token_stride", p.o_token_stride}, {"o_head_stride", p.o_head_stride}};
  for (const auto& s : strides)
    if (s.value < 0) fail(std::string(s.name) + " " + std::to_string(s.value) + " is negative");
  if (!(std::isfinite(p.scale) && p.scale > 0.0f))
    fail("scale " + std::to_string(p.scale) + " must be finite and positive");
  if (p.num_seqs == 0) return;
  if (p.seq_offsets == nullptr) fail("seq_offsets is null with num_seqs " + std::to_string(p.num_seqs));
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr) fail("q, k, v or out is null");
}

}  // namespace flash_detail

/// Checks what the CUDA kernel needs, on the host, without touching device
/// memory: the shared rules (num_seqs, max_seq_tokens >= 0; hq, hkv > 0 and
/// hq % hkv == 0; positive dims; no negative stride; finite scale > 0;
/// non-null pointers when num_seqs > 0), a supported (dqk, dv) pair, q/k/v
/// strides that are multiples of 8 elements with 16-byte aligned q/k/v (the
/// 16-byte cp.async copies), out strides that are even with an 8-byte aligned
/// out (float2 stores), and a grid of at most 2^31-1 CTAs. The offsets
/// themselves live in device memory and are not read: see
/// check_flash_prefill_offsets. Throws writescope::config_error naming the
/// value and the rule.
inline void check_flash_prefill(const flash_prefill_params& p) {
  using flash_detail::fail;
  flash_detail::check_common(p);
  bool supported = false;
  for (const auto& d : flash_prefill_supported_dims) supported = supported || (d.dqk == p.dqk && d.dv == p.dv);
  if (!supported)
    fail("head dims (dqk " + std::to_string(p.dqk) + ", dv " + std::to_string(p.dv) +
         ") are not built; supported (dqk, dv): " + flash_detail::dims_list());
  const struct {
    const char* name;
    idx value;
    idx multiple;
  } strides[] = {{"q_token_stride", p.q_token_stride, 8}, {"q_head_stride", p.q_head_stride, 8},
                 {"k_token_stride", p.k_token_stride, 8}, {"k_head_stride", p.k_head_stride, 8},
                 {"v_token_stride", p.v_token_stride, 8}, {"v_head_stride", p.v_head_stride, 8},
                 {"o_token_stride", p.o_token_stride, 2}, {"o_head_stride", p.o_head_stride, 2}};
  for (const auto& s : strides)
    if (s.value % s.multiple != 0)
      fail(std::string(s.name) + " " + std::to_string(s.value) + " is not a multiple of " + std::to_string(s.multiple) +
           " elements");
  const auto misaligned = [](const void* ptr, std::uintptr_t bytes) {
    return reinterpret_cast<std::uintptr_t>(ptr) % bytes != 0;
  };
  if (misaligned(p.q, 16) || misaligned(p.k, 16) || misaligned(p.v, 16))
    fail("q, k and v must be 16-byte aligned");
  if (misaligned(p.out, 8)) fail("out must be 8-byte aligned");
  if (misaligned(p.lse, 4)) fail("lse must be 4-byte aligned");
  const int group = p.hq / p.hkv;
  const idx positions = flash_prefill_positions_per_cta(group);
  const idx q_tiles = (p.max_seq_tokens + positions - 1) / positions;
  const idx work = idx(p.num_seqs) * p.hkv * (group / flash_prefill_heads_per_cta(group));
  if (q_tiles > 0 && work > 0 && q_tiles > idx(std::numeric_limits<int>::max()) / work)
    fail("grid of " + std::to_string(q_tiles) + " query tiles x " + std::to_string(work) +
         " (sequence, KV head, head group) items exceeds 2^31-1 CTAs");
}

/// Checks host-side copies of the offsets the CUDA launch will read:
/// offsets[0] >= 0, non-decreasing (empty sequences allowed), and no sequence
/// longer than p.max_seq_tokens (longer ones would be cut short by the grid).
/// `host_offsets` has p.num_seqs + 1 entries, host memory. The host twin runs
/// this on p.seq_offsets itself.
inline void check_flash_prefill_offsets(const flash_prefill_params& p, const int* host_offsets) {
  using flash_detail::fail;
  if (p.num_seqs <= 0) return;
  if (host_offsets == nullptr) fail("seq_offsets is null");
  if (host_offsets[0] < 0) fail("seq_offsets[0] " + std::to_string(host_offsets[0]) + " is negative");
  for (int s = 0; s < p.num_seqs; ++s) {
    const idx len = idx(host_offsets[s + 1]) - host_offsets[s];
    if (len < 0)
      fail("seq_offsets decrease at sequence " + std::to_string(s) + ": " + std::to_string(host_offsets[s]) + " then " +
           std::to_string(host_offsets[s + 1]));
    if (len > p.max_seq_tokens)
      fail("sequence " + std::to_string(s) + " has " + std::to_string(len) + " tokens, more than max_seq_tokens " +
           std::to_string(p.max_seq_tokens));
  }
}

/// Host twin (the emulated executor and CI): same contract, fp32 arithmetic,
/// OpenMP over (token, head); any head dims. Host pointers, seq_offsets
/// included. Throws config_error for the shared rules of check_flash_prefill
/// (not the dims, strides' multiples or alignment) and for bad offsets
/// (check_flash_prefill_offsets), before writing anything.
inline void flash_prefill_host(const flash_prefill_params& p) {
  flash_detail::check_common(p);
  check_flash_prefill_offsets(p, p.seq_offsets);
  if (p.num_seqs == 0) return;
  const int* off = p.seq_offsets;
  const idx first = off[0];
  const idx rows = (idx(off[p.num_seqs]) - first) * p.hq;
  const int group = p.hq / p.hkv;
#if defined(_OPENMP)
#  pragma omp parallel
#endif
  {
    std::vector<float> s(std::size_t(std::max<idx>(p.max_seq_tokens, 1)));
    std::vector<float> q(std::size_t(p.dqk));
    std::vector<float> acc(std::size_t(p.dv));
#if defined(_OPENMP)
#  pragma omp for schedule(dynamic, 16)
#endif
    for (idx r = 0; r < rows; ++r) {
      const idx token = first + r / p.hq;
      const int h = int(r % p.hq), kvh = h / group;
      // The sequence holding `token`: the last s with off[s] <= token (empty sequences skipped).
      const int seq = int(std::upper_bound(off, off + p.num_seqs + 1, int(token)) - off) - 1;
      const idx start = off[seq], t = token - start;
      const std::uint16_t* qr = p.q + token * p.q_token_stride + idx(h) * p.q_head_stride;
      for (int e = 0; e < p.dqk; ++e) q[std::size_t(e)] = bf16_to_float(qr[e]);
      float m = -std::numeric_limits<float>::infinity();
      for (idx j = 0; j <= t; ++j) {
        const std::uint16_t* kr = p.k + (start + j) * p.k_token_stride + idx(kvh) * p.k_head_stride;
        float d = 0.0f;
        for (int e = 0; e < p.dqk; ++e) d += q[std::size_t(e)] * bf16_to_float(kr[e]);
        s[std::size_t(j)] = d * p.scale;
        m = std::max(m, s[std::size_t(j)]);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float l = 0.0f;
      for (idx j = 0; j <= t; ++j) {
        const float w = std::exp(s[std::size_t(j)] - m);
        l += w;
        const std::uint16_t* vr = p.v + (start + j) * p.v_token_stride + idx(kvh) * p.v_head_stride;
        for (int e = 0; e < p.dv; ++e) acc[std::size_t(e)] += w * bf16_to_float(vr[e]);
      }
      float* o = p.out + token * p.o_token_stride + idx(h) * p.o_head_stride;
      for (int e = 0; e < p.dv; ++e) o[e] = acc[std::size_t(e)] / l;
      if (p.lse != nullptr) p.lse[token * p.hq + h] = m + std::log(l);
    }
  }
}

}  // namespace ws_moe::gpu
