// writescope/cpu/attention.hpp — the CPU engine's decode attention kernel
// (paper §6.1). Host compiler only: this header includes xsimd, which nvcc must
// never see (STYLE.md §8, §15).
//
// One call attends the `group` query heads that share one KV head over a list
// of blocks, in one pass over the KV: each K row is loaded and widened once for
// all heads of the group, each V row once for all heads, scores of a tile of
// W tokens (W = SIMD width) live in W-lane vectors, and the softmax is online
// (running max, running sum, fp32 output rescaled per tile). MLA is the case
// kv_heads = 1, group = Hq, and V = the first kv_lora_rank elements of the same
// row, so each latent row comes from DRAM once for both products.
//
// bf16 widening without a widening instruction: a 32-bit load holds two bf16
// values; `u << 16` is the even element as fp32 and `u & 0xffff0000` the odd
// one. The kernel therefore works on de-interleaved rows: the query and the
// output accumulator are kept as [even lanes | odd lanes] per 2W elements, and
// the output is re-interleaved once at the end. Any xsimd float architecture
// works (AVX-512, AVX2+FMA, SSE, NEON).
//
// Numerics: fp32 throughout (scores, running max, sums, output); exp is
// xsimd::exp (natural base); LSE is natural log. No finite "minus infinity":
// the running max starts at -inf and an empty input returns (0, -inf).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "../detail/simd_include.hpp"
#include <xsimd/xsimd.hpp>

#include "../bf16.hpp"
#include "../config.hpp"
#include "../error.hpp"
#include "../layout.hpp"

namespace writescope::cpu {

/// One block (or the valid prefix of one) for the kernel: `block` points at the
/// block's first element in the block format of layout.hpp; `tokens` in
/// [0, block_tokens] rows of it are attended. Host-readable memory.
struct kv_segment {
  const bf16* block = nullptr;
  int tokens = 0;
};

/// The architecture the kernels are compiled for: xsimd's best for the
/// compiler flags in effect (CMake option WRITESCOPE_CPU_ARCH sets them).
using default_arch = xsimd::default_arch;

/// Throws config_error when this CPU lacks the instruction set the kernels
/// were compiled for (a binary built with -march=native moved to an older CPU).
template <class Arch = default_arch>
inline void require_cpu_support() {
  const auto avail = xsimd::available_architectures();
  if (avail.best < Arch::version())
    throw config_error(std::string("writescope CPU kernels were compiled for ") + Arch::name() +
                       ", which this CPU does not support; rebuild with -DWRITESCOPE_CPU_ARCH=<your ISA>");
}

namespace detail {

template <class T>
using aligned_vector = std::vector<T, xsimd::aligned_allocator<T, 64>>;

/// Per-thread scratch of the kernel; grows once, reused by every call on the thread.
struct kernel_scratch {
  aligned_vector<float> q;       // [group][row] de-interleaved, pre-scaled
  aligned_vector<float> out;     // [group][v_dim] de-interleaved accumulator
  aligned_vector<float> acc;     // [group][W][W] partial dot products of one tile
  aligned_vector<float> probs;   // [group][W] exp(s - m) of one tile
  std::vector<float> row_max, row_sum;

  static kernel_scratch& local() {
    thread_local kernel_scratch s;
    return s;
  }
};

}  // namespace detail

/// Decode attention of one KV head's query group over a list of blocks.
///
/// Template parameters: Layout (gqa_layout / mla_layout), Arch (xsimd architecture).
///
///   q        [group][q_dim] fp32, head g at q + g*q_head_stride (unscaled queries)
///   segs     blocks of this sequence in this layer, any memory the host can read
///   o        [group][v_dim] fp32 out, head g at o + g*o_head_stride: normalised output
///   lse      [group] fp32 out: natural-log sum of exp(scale·q·k) over all attended keys
///
/// An empty list (or only zero-token segments) yields o = 0, lse = -inf. The
/// result depends only on the inputs and the order of `segs` (deterministic).
/// Thread-safe: uses thread-local scratch; no locks, no allocation after the
/// first call on a thread with a given group size.
template <kv_layout Layout, class Arch = default_arch>
struct decode_kernel {
  using fbatch = xsimd::batch<float, Arch>;
  using ubatch = xsimd::batch<std::uint32_t, Arch>;
  static constexpr int W = static_cast<int>(fbatch::size);  ///< lanes, = tokens per score tile
  static constexpr int C = 2 * W;                            ///< elements per de-interleaved chunk
  static constexpr int R = Layout::row_elems;
  static constexpr int V = Layout::v_dim;
  static constexpr int RC = R / C;
  static constexpr int VC = V / C;
  static constexpr int KB = 4;  ///< chunks of a K/V row held in registers at once
  static_assert(R % C == 0 && V % C == 0,
                "decode_kernel: the row width and v_dim must be multiples of twice the SIMD width");

  static void run(const block_format<Layout>& fmt, int kv_head, const float* q, index_t q_head_stride, int group,
                  float scale, std::span<const kv_segment> segs, float* o, index_t o_head_stride, float* lse) {
    auto& s = detail::kernel_scratch::local();
    const auto G = static_cast<std::size_t>(group);
    s.q.resize(G * R);
    s.out.assign(G * V, 0.0f);
    s.acc.resize(G * W * W);
    s.probs.resize(G * W);
    s.row_max.assign(G, -std::numeric_limits<float>::infinity());
    s.row_sum.assign(G, 0.0f);

    // Pre-scaled, de-interleaved queries.
    for (int g = 0; g < group; ++g) {
      const float* src = q + g * q_head_stride;
      float* dst = s.q.data() + std::size_t(g) * R;
      for (int c = 0; c < RC; ++c)
        for (int i = 0; i < W; ++i) {
          dst[c * C + i] = src[c * C + 2 * i] * scale;
          dst[c * C + W + i] = src[c * C + 2 * i + 1] * scale;
        }
    }

    const index_t k_off = fmt.slice_offset(Layout::key_plane, kv_head);
    const index_t v_off = fmt.slice_offset(Layout::value_plane, kv_head);
    for (const kv_segment& seg : segs) {
      const bf16* kbase = seg.block + k_off;
      const bf16* vbase = seg.block + v_off;
      for (int t0 = 0; t0 < seg.tokens; t0 += W) {
        const int n = std::min(W, seg.tokens - t0);
        tile_scores(s, group, kbase + index_t(t0) * R, n);
        tile_softmax(s, group, n);
        tile_values(s, group, vbase + index_t(t0) * R, n);
      }
    }

    for (int g = 0; g < group; ++g) {
      float* dst = o + g * o_head_stride;
      const float sum = s.row_sum[std::size_t(g)];
      if (sum == 0.0f) {  // no key attended
        for (int i = 0; i < V; ++i) dst[i] = 0.0f;
        lse[g] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float inv = 1.0f / sum;
      const float* acc = s.out.data() + std::size_t(g) * V;
      for (int c = 0; c < VC; ++c)
        for (int i = 0; i < W; ++i) {
          dst[c * C + 2 * i] = acc[c * C + i] * inv;
          dst[c * C + 2 * i + 1] = acc[c * C + W + i] * inv;
        }
      lse[g] = s.row_max[std::size_t(g)] + std::log(sum);
    }
  }

 private:
  // xsimd::haddp returns the W row sums in an order that depends on the
  // architecture and the xsimd version (xsimd 8.1 on AVX-512 interleaves
  // them). Probe the order once instead of trusting it.
  static const std::array<int, W>& haddp_lane_rows() noexcept {
    static const std::array<int, W> rows = [] {
      std::array<int, W> r{};
      alignas(64) float unit[W][W];
      fbatch b[W];
      for (int i = 0; i < W; ++i) {
        for (int j = 0; j < W; ++j) unit[i][j] = j == 0 ? float(i) : 0.0f;
        b[i] = fbatch::load_aligned(unit[i]);
      }
      alignas(64) float out[W];
      xsimd::haddp(b).store_aligned(out);
      for (int j = 0; j < W; ++j) r[std::size_t(j)] = static_cast<int>(out[j]);
      return r;
    }();
    return rows;
  }

  static void widen(const bf16* p, fbatch& even, fbatch& odd) noexcept {
    const ubatch u = ubatch::load_unaligned(reinterpret_cast<const std::uint32_t*>(p));
    even = xsimd::bitwise_cast<fbatch>(u << 16);
    odd = xsimd::bitwise_cast<fbatch>(u & ubatch(0xffff0000u));
  }

  // acc[g][t] (a W-lane partial dot product) for the n tokens of the tile.
  static void tile_scores(detail::kernel_scratch& s, int group, const bf16* krows, int n) noexcept {
    for (int t = 0; t < n; ++t) {
      const bf16* krow = krows + index_t(t) * R;
      for (int cb = 0; cb < RC; cb += KB) {
        const int nc = std::min(KB, RC - cb);
        fbatch ke[KB], ko[KB];
        for (int c = 0; c < nc; ++c) widen(krow + (cb + c) * C, ke[c], ko[c]);
        for (int g = 0; g < group; ++g) {
          const float* qg = s.q.data() + std::size_t(g) * R + std::size_t(cb) * C;
          float* accp = s.acc.data() + (std::size_t(g) * W + std::size_t(t)) * W;
          fbatch a = cb == 0 ? fbatch(0.0f) : fbatch::load_aligned(accp);
          for (int c = 0; c < nc; ++c) {
            a = xsimd::fma(fbatch::load_aligned(qg + c * C), ke[c], a);
            a = xsimd::fma(fbatch::load_aligned(qg + c * C + W), ko[c], a);
          }
          a.store_aligned(accp);
        }
      }
    }
    // Lanes of tokens past n hold stale values; tile_softmax masks them out.
  }

  // Reduces the tile's scores, updates running max/sum, rescales the output.
  static void tile_softmax(detail::kernel_scratch& s, int group, int n) noexcept {
    alignas(64) float sc[W];
    for (int g = 0; g < group; ++g) {
      const fbatch* rows = reinterpret_cast<const fbatch*>(s.acc.data() + std::size_t(g) * W * W);
      alignas(64) float lanes[W];
      xsimd::haddp(rows).store_aligned(lanes);
      const auto& row_of_lane = haddp_lane_rows();
      for (int j = 0; j < W; ++j) sc[row_of_lane[std::size_t(j)]] = lanes[j];
      float tile_max = sc[0];
      for (int t = 1; t < n; ++t) tile_max = std::max(tile_max, sc[t]);
      for (int t = n; t < W; ++t) sc[t] = -std::numeric_limits<float>::infinity();
      float& m = s.row_max[std::size_t(g)];
      const float m_new = std::max(m, tile_max);
      const float alpha = std::exp(m - m_new);  // m = -inf on the first tile: alpha = 0
      const fbatch p = xsimd::exp(fbatch::load_aligned(sc) - fbatch(m_new));
      p.store_aligned(s.probs.data() + std::size_t(g) * W);
      float& l = s.row_sum[std::size_t(g)];
      l = l * alpha + xsimd::hadd(p);
      if (alpha != 1.0f) {
        float* acc = s.out.data() + std::size_t(g) * V;
        const fbatch a(alpha);
        for (int i = 0; i < V; i += W) (fbatch::load_aligned(acc + i) * a).store_aligned(acc + i);
      }
      m = m_new;
    }
  }

  static void tile_values(detail::kernel_scratch& s, int group, const bf16* vrows, int n) noexcept {
    for (int t = 0; t < n; ++t) {
      const bf16* vrow = vrows + index_t(t) * R;
      for (int cb = 0; cb < VC; cb += KB) {
        const int nc = std::min(KB, VC - cb);
        fbatch ve[KB], vo[KB];
        for (int c = 0; c < nc; ++c) widen(vrow + (cb + c) * C, ve[c], vo[c]);
        for (int g = 0; g < group; ++g) {
          const fbatch p(s.probs[std::size_t(g) * W + std::size_t(t)]);
          float* acc = s.out.data() + std::size_t(g) * V + std::size_t(cb) * C;
          for (int c = 0; c < nc; ++c) {
            xsimd::fma(p, ve[c], fbatch::load_aligned(acc + c * C)).store_aligned(acc + c * C);
            xsimd::fma(p, vo[c], fbatch::load_aligned(acc + c * C + W)).store_aligned(acc + c * C + W);
          }
        }
      }
    }
  }
};

}  // namespace writescope::cpu
