// SPDX-License-Identifier: Apache-2.0
// writescope/cpu/attention.hpp — the CPU engine's decode attention kernel
// (paper §6.1). Host compiler only: this header includes xsimd, which nvcc must
// never see (x86 intrinsic headers break its front end). Design notes and
// figures: docs/CPU-KERNEL.md.
//
// One call attends the `group` query heads that share one KV head over a list
// of blocks, in one pass over the KV. The KV is walked in tiles of TT = 2W
// tokens (W = SIMD lanes); every tile is attended by every head block (the
// group cut into blocks of 16/8/4/2/1 heads, each a compile-time size) while it
// is still in L1/L2, so DRAM sees each byte once whatever the group size.
// Per tile and head block:
//
//   QK   W dot-product accumulators at once (HBz heads × W/HBz tokens): each K
//        row is loaded and widened once per pass and each query chunk is
//        loaded once for all tokens of the pass; the W accumulators are then
//        folded by one transpose-and-add (45 shuffles/adds for 16 vectors on
//        AVX-512) into one vector of W scores, lanes in (token, head) order.
//   soft the tile's scores are exponentiated lane-wise against the running
//        max of their head; running max and running sum are kept as vectors
//        in the same lane pattern (no horizontal op per tile beyond one
//        max across the token slots of a lane pattern).
//   PV   the output of up to 8 heads × 1-4 chunks lives in 16 registers for
//        the whole tile (rescaled once per tile on load), each V chunk is
//        loaded and widened once per head block and feeds 2·heads FMAs with
//        the probability broadcast from L1.
//
// MLA is the case kv_heads = 1, group = Hq, and V = the first kv_lora_rank
// elements of the same row, so each latent row comes from DRAM once for both
// products (the tile is re-read from L1/L2 for V).
//
// bf16 widening without a widening instruction: a 32-bit load holds two bf16
// values; `u << 16` is the even element as fp32 and `u & 0xffff0000` the odd
// one. The kernel therefore works on de-interleaved rows: the query and the
// output accumulator are kept as [even lanes | odd lanes] per 2W elements, and
// the output is re-interleaved once at the end. Any xsimd float architecture
// works (AVX-512, AVX2+FMA, AVX, SSE2, NEON); AVX-512, AVX and SSE2 have a
// hand-written transpose-and-add, others use xsimd::haddp.
//
// Numerics: fp32 throughout (scores, running max, sums, output); exp is
// xsimd::exp (natural base); LSE is natural log. No finite "minus infinity":
// the running max starts at -inf and an empty input returns (0, -inf).
// Precision of the scores is a template parameter:
//   fp32_scores (default)  q·k in fp32 from the exact bf16 → fp32 widening.
//   bf16_scores            q is rounded to bf16 (the scale is applied to the
//                          fp32 scores afterwards), products and sums stay fp32.
//                          Exact (fp32-class) when q is already bf16-valued, as
//                          a bf16 model's activations are; for arbitrary fp32 q
//                          the rounding (≤ 2^-9 relative per element) moves the
//                          scores — on N(0,1) data: relative L2 ≈ 3e-3
//                          (GQA d128, scale d^-1/2) and 5e-3 with LSE error
//                          2e-3 (DeepSeek-V2-Lite MLA, scale 0.115): outside the
//                          test bar, hence opt-in. On AVX-512 with AVX512_BF16
//                          (__AVX512BF16__) q·k runs on vdpbf16ps (no widening,
//                          half the QK instructions); elsewhere the same
//                          rounding is emulated with fp32 FMAs.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../detail/simd_include.hpp"
#include <xsimd/xsimd.hpp>

#include "../bf16.hpp"
#include "../config.hpp"
#include "../error.hpp"
#include "../layout.hpp"
#include "kernel.hpp"

// Kept out of line: GCC 12 spills (to unaligned stack slots) when the QK and
// PV loops are inlined into one large function.
// Loops over compile-time register blocks are unrolled explicitly: GCC's
// default limits leave some of them rolled, which puts the blocks in memory.
// Small shared pieces of one computation (WS_SIMD_INLINE) are always inlined,
// so that they weigh in the inliner's budget as the instructions they are.
#if defined(__clang__)
#  define WS_KERNEL_NOINLINE __attribute__((noinline))
#  define WS_UNROLL _Pragma("unroll")
#  define WS_SIMD_INLINE inline __attribute__((always_inline))
#elif defined(__GNUC__)
#  define WS_KERNEL_NOINLINE __attribute__((noinline))
#  define WS_UNROLL _Pragma("GCC unroll 64")
#  define WS_SIMD_INLINE inline __attribute__((always_inline))
#else
#  define WS_KERNEL_NOINLINE
#  define WS_UNROLL
#  define WS_SIMD_INLINE inline
#endif

namespace writescope::cpu {

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

/// Score precision: q·k from fp32 queries (the default, exact up to fp32 sums).
struct fp32_scores {
  static constexpr bool rounds_queries = false;
  static constexpr const char* name = "fp32";
};
/// Score precision: q·k from queries rounded to bf16, fp32 accumulation and
/// scale (vdpbf16ps where available). Exact for bf16-valued queries. See the
/// file comment for the error on fp32 queries.
struct bf16_scores {
  static constexpr bool rounds_queries = true;
  static constexpr const char* name = "bf16";
};
template <class P>
concept score_precision = std::same_as<P, fp32_scores> || std::same_as<P, bf16_scores>;

/// Whether bf16_scores runs on vdpbf16ps for Arch in this translation unit
/// (AVX-512 architecture and the compiler targets AVX512_BF16); otherwise it
/// is emulated with fp32 FMAs on bf16-rounded queries (same precision class).
template <class Arch>
inline constexpr bool has_native_bf16_dot =
#if defined(__AVX512BF16__) && XSIMD_WITH_AVX512F
    std::is_base_of_v<xsimd::avx512f, Arch>;
#else
    false;
#endif

namespace detail {

template <class T>
using aligned_vector = std::vector<T, xsimd::aligned_allocator<T, 64>>;

/// Per-thread scratch of the kernel; grows once, reused by every call on the thread.
struct kernel_scratch {
  aligned_vector<float> q;           // [group][row] de-interleaved, pre-scaled (fp32 path)
  aligned_vector<std::uint32_t> qp;  // [group][row/2] bf16 pairs, pre-scaled (native bf16 path)
  aligned_vector<float> out;         // [group][v_dim] de-interleaved accumulator
  aligned_vector<float> m_pat;       // per head block: [sub-block][W] running max (lane pattern)
  aligned_vector<float> l_pat;       // per head block: [sub-block][W] running sum (lane pattern)

  static kernel_scratch& local() {
    thread_local kernel_scratch s;
    return s;
  }
};

/// Registers of the architecture (accumulator budget).
template <class Arch>
inline constexpr int vector_registers =
#if XSIMD_WITH_AVX512F
    std::is_base_of_v<xsimd::avx512f, Arch> ? 32 :
#endif
#if XSIMD_WITH_NEON64
    std::is_base_of_v<xsimd::neon64, Arch> ? 32 :
#endif
    16;

/// Pins a loaded vector in a register. GCC folds a load into every FMA that
/// uses it (one load per token of a QK pass instead of one per pass), which
/// saturates the load ports; an empty asm with the value as an in/out operand
/// makes the compiler materialise it once. No instruction is emitted.
template <class B>
inline void keep_in_register(B& v) noexcept {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  auto r = static_cast<typename B::register_type>(v);
#  if defined(__AVX512F__)
  asm("" : "+v"(r));
#  else
  asm("" : "+x"(r));
#  endif
  v = B(r);
#elif defined(__GNUC__) && defined(__aarch64__)
  auto r = static_cast<typename B::register_type>(v);
  asm("" : "+w"(r));
  v = B(r);
#else
  (void)v;
#endif
}

#if XSIMD_WITH_SSE2
/// The first two levels of lane_sums' transpose-and-add, per 128-bit lane:
/// one definition for __m128, __m256 and __m512 (prefix P of the intrinsics),
/// whose unpack instructions work within each 128-bit lane alike.
/// interleave_sum(x, y): each lane holds [x0+x2, y0+y2, x1+x3, y1+y3] of that
/// lane of x and y; pair_sum(a, b): [a0+a2, a1+a3, b0+b2, b1+b3].
#  define WS_LANE_SUM_LEVELS(R, RD, P)                                 \
    WS_SIMD_INLINE R interleave_sum(R x, R y) noexcept {               \
      return P##_add_ps(P##_unpacklo_ps(x, y), P##_unpackhi_ps(x, y)); \
    }                                                                  \
    WS_SIMD_INLINE R pair_sum(R a, R b) noexcept {                     \
      const RD x = P##_castps_pd(a), y = P##_castps_pd(b);             \
      return P##_add_ps(P##_castpd_ps(P##_unpacklo_pd(x, y)),          \
                        P##_castpd_ps(P##_unpackhi_pd(x, y)));         \
    }
WS_LANE_SUM_LEVELS(__m128, __m128d, _mm)
#  if XSIMD_WITH_AVX
WS_LANE_SUM_LEVELS(__m256, __m256d, _mm256)
#  endif
#  if XSIMD_WITH_AVX512F
WS_LANE_SUM_LEVELS(__m512, __m512d, _mm512)
#  endif
#  undef WS_LANE_SUM_LEVELS

/// Levels 1 and 2 of lane_sums for the N vectors v[0..N) as registers of type
/// Reg: b[i]'s 128-bit lane k holds [S_k(v[4i]), S_k(v[4i+1]), S_k(v[4i+2]),
/// S_k(v[4i+3])], S_k = the sum of lane k's four elements.
template <int N, class Reg, class Batch>
WS_SIMD_INLINE void quad_lane_sums(const Batch* v, Reg* b) noexcept {
  Reg a[N / 2];
  WS_UNROLL
  for (int i = 0; i < N / 2; ++i) a[i] = interleave_sum(Reg(v[2 * i]), Reg(v[2 * i + 1]));
  WS_UNROLL
  for (int i = 0; i < N / 4; ++i) b[i] = pair_sum(a[2 * i], a[2 * i + 1]);
}
#endif

/// Prefetches the cache line at p for reading into L1 and L2 (prefetcht0 on
/// x86; docs/CPU-KERNEL.md); nothing on a compiler without __builtin_prefetch.
WS_SIMD_INLINE void prefetch_l1(const void* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

/// The end of a call for one query head whose running sum is `sum`: false,
/// with dst[0..V) = 0 and lse = -inf, where the head attended no key (sum 0);
/// true otherwise (the kernel then stores dst · 1/sum and lse = max + ln(sum)).
template <int V>
WS_SIMD_INLINE bool finish_attended(float* dst, float& lse, float sum) noexcept {
  if (sum == 0.0f) {
    for (int i = 0; i < V; ++i) dst[i] = 0.0f;
    lse = -std::numeric_limits<float>::infinity();
    return false;
  }
  return true;
}

/// lane_sums(v)[j] = Σ_k v[j][k] for the W vectors v[0..W): one transpose-and-add.
template <class Arch>
inline xsimd::batch<float, Arch> lane_sums(const xsimd::batch<float, Arch>* v) noexcept {
  using fbatch = xsimd::batch<float, Arch>;
  constexpr int W = int(fbatch::size);
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of_v<xsimd::avx512f, Arch>) {
    __m512 b[4];
    quad_lane_sums<16>(v, b);
    // Levels 3, 4: add the four 128-bit lanes.
    __m512 c[2];
    WS_UNROLL
    for (int i = 0; i < 2; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  } else
#endif
#if XSIMD_WITH_AVX
  if constexpr (std::is_base_of_v<xsimd::avx, Arch>) {
    __m256 b[2];
    quad_lane_sums<8>(v, b);
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
  } else
#endif
#if XSIMD_WITH_SSE2
  if constexpr (std::is_base_of_v<xsimd::sse2, Arch>) {
    return pair_sum(interleave_sum(__m128(v[0]), __m128(v[1])), interleave_sum(__m128(v[2]), __m128(v[3])));
  } else
#endif
  {
    // Any other architecture: xsimd::haddp, whose lane order depends on the
    // architecture and the xsimd version — probe it once instead of trusting it.
    static const std::array<int, W> row_of_lane = [&] {  // [&]: clang 14 wants W captured (array bounds)
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
    alignas(64) float lanes[W], sorted[W];
    xsimd::haddp(v).store_aligned(lanes);
    for (int j = 0; j < W; ++j) sorted[row_of_lane[std::size_t(j)]] = lanes[j];
    return fbatch::load_aligned(sorted);
  }
}

}  // namespace detail

/// Decode attention of one KV head's query group over a list of blocks.
///
/// Template parameters: Layout (gqa_layout / mla_layout), Arch (xsimd
/// architecture), ScorePrecision (fp32_scores or bf16_scores, see above).
///
///   q        [group][q_dim] fp32, head g at q + g*q_head_stride (unscaled queries)
///   segs     blocks of this sequence in this layer, any memory the host can read
///   o        [group][v_dim] fp32 out, head g at o + g*o_head_stride: normalised output
///   lse      [group] fp32 out: natural-log sum of exp(scale·q·k) over all attended keys
///
/// Any group size ≥ 1 (cut into head blocks of 16/8/4/2/1). An empty list (or
/// only zero-token segments) yields o = 0, lse = -inf. The result depends only
/// on the inputs and the order of `segs` (deterministic; fixed summation order).
/// Reads exactly the rows [0, tokens) of each segment. Thread-safe: uses
/// thread-local scratch; no locks, no allocation after the first call on a
/// thread with a given group size.
template <kv_layout Layout, class Arch = default_arch, score_precision ScorePrecision = fp32_scores>
struct decode_kernel {
  using fbatch = xsimd::batch<float, Arch>;
  using ubatch = xsimd::batch<std::uint32_t, Arch>;
  using kernel_concept = cpu_attention_kernel_tag;
  using precision = ScorePrecision;
  static constexpr int W = static_cast<int>(fbatch::size);  ///< lanes
  static constexpr int C = 2 * W;                            ///< elements per de-interleaved chunk
  static constexpr int TT = 2 * W;                           ///< tokens per tile
  static constexpr int R = Layout::row_elems;
  static constexpr int V = Layout::v_dim;
  static constexpr int RC = R / C;
  static constexpr int VC = V / C;
  static constexpr int max_head_block = 16;
  static constexpr bool native_bf16 = ScorePrecision::rounds_queries && has_native_bf16_dot<Arch>;
  static_assert(R % C == 0 && V % C == 0,
                "decode_kernel: the row width and v_dim must be multiples of twice the SIMD width");
  static_assert(W >= 2 && (W & (W - 1)) == 0, "decode_kernel: the SIMD width must be a power of two >= 2");

  static void run(const block_format<Layout>& fmt, int kv_head, const float* q, index_t q_head_stride, int group,
                  float scale, std::span<const kv_segment> segs, float* o, index_t o_head_stride, float* lse) {
    auto& s = detail::kernel_scratch::local();
    const auto G = std::size_t(group);
    s.out.assign(G * V, 0.0f);
    s.m_pat.assign(G * W, -std::numeric_limits<float>::infinity());
    s.l_pat.assign(G * W, 0.0f);
    prepare_queries(s, q, q_head_stride, group, scale);

    const index_t k_off = fmt.slice_offset(Layout::key_plane, kv_head);
    const index_t v_off = fmt.slice_offset(Layout::value_plane, kv_head);
    for (std::size_t si = 0; si < segs.size(); ++si) {
      const kv_segment& seg = segs[si];
      const bf16* kbase = seg.block + k_off;
      const bf16* vbase = seg.block + v_off;
      for (int t0 = 0; t0 < seg.tokens; t0 += TT) {
        const int n = std::min(TT, seg.tokens - t0);
        const bf16* krows = kbase + index_t(t0) * R;
        const bf16* vrows = vbase + index_t(t0) * R;
        prefetch_ref pf = next_tile(segs, si, t0 + TT, k_off, v_off);
        for (int h0 = 0; h0 < group;) {
          const int hb = head_block(group - h0);
          const std::size_t h = std::size_t(h0);
          const float* qf = native_bf16 ? nullptr : s.q.data() + h * R;
          const std::uint32_t* qp = native_bf16 ? s.qp.data() + h * (R / 2) : nullptr;
          float* acc = s.out.data() + h * V;
          float* mp = s.m_pat.data() + h * W;
          float* lp = s.l_pat.data() + h * W;
          switch (hb) {
            case 16: tile<16>(qf, qp, acc, mp, lp, krows, vrows, n, pf, scale); break;
            case 8: tile<8>(qf, qp, acc, mp, lp, krows, vrows, n, pf, scale); break;
            case 4: tile<4>(qf, qp, acc, mp, lp, krows, vrows, n, pf, scale); break;
            case 2: tile<2>(qf, qp, acc, mp, lp, krows, vrows, n, pf, scale); break;
            default: tile<1>(qf, qp, acc, mp, lp, krows, vrows, n, pf, scale); break;
          }
          pf = {};
          h0 += hb;
        }
      }
    }

    for (int h0 = 0; h0 < group;) {
      const int hb = head_block(group - h0);
      const int hbz = pass_heads(hb);
      for (int j = 0; j < hb; ++j) {
        const int g = h0 + j;
        // Lane of head j in its block's pattern: sub-block j / hbz, lane j % hbz + slot·hbz.
        const float* mp = s.m_pat.data() + std::size_t(h0) * W + std::size_t(j / hbz) * W;
        const float* lp = s.l_pat.data() + std::size_t(h0) * W + std::size_t(j / hbz) * W;
        float sum = 0.0f;
        for (int slot = 0; slot < W / hbz; ++slot) sum += lp[slot * hbz + j % hbz];
        float* dst = o + g * o_head_stride;
        if (!detail::finish_attended<V>(dst, lse[g], sum)) continue;
        const float inv = 1.0f / sum;
        const float* acc = s.out.data() + std::size_t(g) * V;
        for (int c = 0; c < VC; ++c)
          for (int i = 0; i < W; ++i) {
            dst[c * C + 2 * i] = acc[c * C + i] * inv;
            dst[c * C + 2 * i + 1] = acc[c * C + W + i] * inv;
          }
        lse[g] = mp[j % hbz] + std::log(sum);
      }
      h0 += hb;
    }
  }

 private:
  /// Largest compile-time head block ≤ remaining heads.
  static constexpr int head_block(int remaining) noexcept {
    return remaining >= 16 ? 16 : remaining >= 8 ? 8 : remaining >= 4 ? 4 : remaining >= 2 ? 2 : 1;
  }
  /// Heads per QK pass for a head block: at most W/2, so a pass covers ≥ 2 tokens.
  static constexpr int pass_heads(int hb) noexcept { return hb < W / 2 ? hb : W / 2; }

  static void prepare_queries(detail::kernel_scratch& s, const float* q, index_t q_head_stride, int group,
                              float scale) {
    const auto G = std::size_t(group);
    if constexpr (native_bf16) {
      s.qp.resize(G * (R / 2));
      for (int g = 0; g < group; ++g) {
        const float* src = q + g * q_head_stride;
        std::uint32_t* dst = s.qp.data() + std::size_t(g) * (R / 2);
        for (int i = 0; i < R / 2; ++i)
          dst[i] = std::uint32_t(bf16::from_float(src[2 * i]).bits) |
                   (std::uint32_t(bf16::from_float(src[2 * i + 1]).bits) << 16);
      }
    } else {
      s.q.resize(G * R);
      for (int g = 0; g < group; ++g) {
        const float* src = q + g * q_head_stride;
        float* dst = s.q.data() + std::size_t(g) * R;
        for (int c = 0; c < RC; ++c)
          for (int i = 0; i < W; ++i) {
            float e = src[c * C + 2 * i], od = src[c * C + 2 * i + 1];
            if constexpr (ScorePrecision::rounds_queries) {  // round q itself; the scale goes on the scores
              e = round_to_bf16(e);
              od = round_to_bf16(od);
            } else {
              e *= scale;
              od *= scale;
            }
            dst[c * C + i] = e;
            dst[c * C + W + i] = od;
          }
      }
    }
  }

  /// The tile after the current one (the rest of this segment or the start of
  /// the next non-empty one), for software prefetch.
  struct prefetch_ref {
    const bf16* k = nullptr;
    const bf16* v = nullptr;
    int tokens = 0;
  };
  static prefetch_ref next_tile(std::span<const kv_segment> segs, std::size_t si, int t_next, index_t k_off,
                                index_t v_off) noexcept {
    std::size_t j = si;
    while (j < segs.size() && t_next >= segs[j].tokens) {
      t_next = 0;
      ++j;
    }
    if (j >= segs.size()) return {};
    const bf16* base = segs[j].block + index_t(t_next) * R;
    return {base + k_off, base + v_off, std::min(TT, segs[j].tokens - t_next)};
  }

  static void widen(const bf16* p, fbatch& even, fbatch& odd) noexcept {
    const ubatch u = ubatch::load_unaligned(reinterpret_cast<const std::uint32_t*>(p));
    even = xsimd::bitwise_cast<fbatch>(u << 16);
    odd = xsimd::bitwise_cast<fbatch>(u & ubatch(0xffff0000u));
  }

#if defined(__AVX512BF16__) && XSIMD_WITH_AVX512F
  static fbatch dot_bf16(fbatch acc, ubatch qp, ubatch kp) noexcept {
    return _mm512_dpbf16_ps(acc, (__m512bh)(__m512i)qp, (__m512bh)(__m512i)kp);
  }
#endif

  /// Scores of one pass: HBz heads × TPz tokens `rows`, stored as one vector
  /// at `dst`, lane t·HBz + h. With `pf` ([2·TPz] row pointers, null = none),
  /// chunk c of each of those rows is prefetched along with chunk c of `rows`:
  /// one line per row and chunk on AVX-512, spread evenly over the FMAs (a
  /// burst of prefetches stalls on the core's miss buffers).
  template <int HBz>
  static void qk_pass(const float* qf, const std::uint32_t* qp, const bf16* const* rows, float* dst,
                      const bf16* const* pf, float score_scale) noexcept {
    constexpr int TPz = W / HBz;
    fbatch a[W];
    WS_UNROLL
    for (int i = 0; i < W; ++i) a[i] = fbatch(0.0f);
    auto prefetch_chunk = [pf](int c) {
      if (pf) {
        WS_UNROLL
        for (int i = 0; i < 2 * TPz; ++i)
          if (pf[i]) detail::prefetch_l1(pf[i] + c * C);
      }
    };
    if constexpr (native_bf16) {
#if defined(__AVX512BF16__) && XSIMD_WITH_AVX512F
      for (int c = 0; c < RC; ++c) {
        prefetch_chunk(c);
        if constexpr (TPz <= HBz) {  // keep the K chunks of the pass, stream q
          ubatch k[TPz];
          WS_UNROLL
          for (int t = 0; t < TPz; ++t)
            k[t] = ubatch::load_unaligned(reinterpret_cast<const std::uint32_t*>(rows[t] + c * C));
          WS_UNROLL
          for (int h = 0; h < HBz; ++h) {
            ubatch qv = ubatch::load_aligned(qp + h * (R / 2) + c * W);
            if constexpr (TPz > 1) detail::keep_in_register(qv);
            WS_UNROLL
            for (int t = 0; t < TPz; ++t) a[t * HBz + h] = dot_bf16(a[t * HBz + h], qv, k[t]);
          }
        } else {  // keep the q chunks, stream K
          ubatch qv[HBz];
          WS_UNROLL
          for (int h = 0; h < HBz; ++h) {
            qv[h] = ubatch::load_aligned(qp + h * (R / 2) + c * W);
            detail::keep_in_register(qv[h]);
          }
          WS_UNROLL
          for (int t = 0; t < TPz; ++t) {
            const ubatch k = ubatch::load_unaligned(reinterpret_cast<const std::uint32_t*>(rows[t] + c * C));
            WS_UNROLL
            for (int h = 0; h < HBz; ++h) a[t * HBz + h] = dot_bf16(a[t * HBz + h], qv[h], k);
          }
        }
      }
#endif
    } else {
      (void)qp;
      for (int c = 0; c < RC; ++c) {
        prefetch_chunk(c);
        if constexpr (TPz <= HBz) {
          fbatch ke[TPz], ko[TPz];
          WS_UNROLL
          for (int t = 0; t < TPz; ++t) widen(rows[t] + c * C, ke[t], ko[t]);
          WS_UNROLL
          for (int h = 0; h < HBz; ++h) {
            fbatch qe = fbatch::load_aligned(qf + h * R + c * C);
            fbatch qo = fbatch::load_aligned(qf + h * R + c * C + W);
            if constexpr (TPz > 1) {
              detail::keep_in_register(qe);
              detail::keep_in_register(qo);
            }
            WS_UNROLL
            for (int t = 0; t < TPz; ++t) {
              a[t * HBz + h] = xsimd::fma(qe, ke[t], a[t * HBz + h]);
              a[t * HBz + h] = xsimd::fma(qo, ko[t], a[t * HBz + h]);
            }
          }
        } else {
          fbatch qe[HBz], qo[HBz];
          WS_UNROLL
          for (int h = 0; h < HBz; ++h) {
            qe[h] = fbatch::load_aligned(qf + h * R + c * C);
            qo[h] = fbatch::load_aligned(qf + h * R + c * C + W);
            detail::keep_in_register(qe[h]);
            detail::keep_in_register(qo[h]);
          }
          WS_UNROLL
          for (int t = 0; t < TPz; ++t) {
            fbatch ke, ko;
            widen(rows[t] + c * C, ke, ko);
            WS_UNROLL
            for (int h = 0; h < HBz; ++h) {
              a[t * HBz + h] = xsimd::fma(qe[h], ke, a[t * HBz + h]);
              a[t * HBz + h] = xsimd::fma(qo[h], ko, a[t * HBz + h]);
            }
          }
        }
      }
    }
    if constexpr (ScorePrecision::rounds_queries)
      (detail::lane_sums<Arch>(a) * fbatch(score_scale)).store_aligned(dst);
    else
      detail::lane_sums<Arch>(a).store_aligned(dst);
  }

  /// One tile (n ≤ TT tokens) for one head block of HB heads.
  ///   qf/qp  the block's queries; acc [HB][V] its output accumulator;
  ///   mp/lp  [HB/HBz][W] its running max / sum in lane pattern.
  template <int HB>
  static void tile(const float* qf, const std::uint32_t* qp, float* acc, float* mp, float* lp, const bf16* krows,
                   const bf16* vrows, int n, const prefetch_ref& pf, float score_scale) noexcept {
    constexpr int HBz = pass_heads(HB);  // heads per QK pass
    constexpr int TPz = W / HBz;         // tokens per QK pass
    constexpr int NSB = HB / HBz;        // QK sub-blocks (lane patterns)
    // Scores / probabilities of the tile: vector (pass p, sub-block sb) at
    // sc[(p·NSB + sb)·W], lane t·HBz + h  (token p·TPz + t, head sb·HBz + h).
    alignas(64) float sc[TT * HB];
    alignas(64) float alpha[NSB * W];
    const int passes = (n + TPz - 1) / TPz;

    // QK
    for (int p = 0; p < passes; ++p) {
      const bf16* rows[TPz];
      const bf16* pf_rows[2 * TPz] = {};  // rows p·TPz + t of the next tile: K, then V (GQA); {} silences a GCC 12 false -Wmaybe-uninitialized
      WS_UNROLL
      for (int t = 0; t < TPz; ++t) {
        const int r = p * TPz + t;
        rows[t] = krows + index_t(std::min(r, n - 1)) * R;  // clamp, masked below
        pf_rows[t] = r < pf.tokens ? pf.k + index_t(r) * R : nullptr;
        pf_rows[TPz + t] = !Layout::is_mla && r < pf.tokens ? pf.v + index_t(r) * R : nullptr;
      }
      for (int sb = 0; sb < NSB; ++sb)
        qk_pass<HBz>(native_bf16 ? nullptr : qf + sb * HBz * R, native_bf16 ? qp + sb * HBz * (R / 2) : nullptr, rows,
                     sc + (p * NSB + sb) * W, sb == 0 && pf.tokens > 0 ? pf_rows : nullptr, score_scale);
    }
    if (const int tail = n - (passes - 1) * TPz; tail < TPz)
      for (int sb = 0; sb < NSB; ++sb)
        for (int j = tail * HBz; j < W; ++j) sc[((passes - 1) * NSB + sb) * W + j] = -std::numeric_limits<float>::infinity();

    // Online softmax, lane-wise in the pattern of each sub-block.
    for (int sb = 0; sb < NSB; ++sb) {
      fbatch mx = fbatch::load_aligned(sc + sb * W);
      for (int p = 1; p < passes; ++p) mx = xsimd::max(mx, fbatch::load_aligned(sc + (p * NSB + sb) * W));
      alignas(64) float lanes[W];
      mx.store_aligned(lanes);
      for (int h = 0; h < HBz; ++h) {  // max over the token slots of each head
        float m = lanes[h];
        for (int slot = 1; slot < TPz; ++slot) m = std::max(m, lanes[slot * HBz + h]);
        for (int slot = 0; slot < TPz; ++slot) lanes[slot * HBz + h] = m;
      }
      const fbatch m_old = fbatch::load_aligned(mp + sb * W);
      const fbatch m_new = xsimd::max(m_old, fbatch::load_aligned(lanes));
      // m_old = -inf on the first tile: alpha = exp(-inf) = 0 (and 1 if both are -inf).
      const fbatch al = xsimd::select(m_old == m_new, fbatch(1.0f), xsimd::exp(m_old - m_new));
      al.store_aligned(alpha + sb * W);
      m_new.store_aligned(mp + sb * W);
      fbatch l = fbatch::load_aligned(lp + sb * W) * al;
      for (int p = 0; p < passes; ++p) {
        float* ps = sc + (p * NSB + sb) * W;
        const fbatch e = xsimd::exp(fbatch::load_aligned(ps) - m_new);
        e.store_aligned(ps);
        l += e;
      }
      l.store_aligned(lp + sb * W);
    }

    // PV: accumulators of HBv heads × NCB chunks in registers over the tile.
    constexpr int AB = detail::vector_registers<Arch> / 2;  // accumulator registers
    constexpr int HBv = HB < AB / 2 ? HB : AB / 2;
    constexpr int NCB0 = AB / (2 * HBv);
    constexpr int NCB = NCB0 < VC ? NCB0 : VC;
    for (int hv = 0; hv < HB; hv += HBv) {
      int c0 = 0;
      for (; c0 + NCB <= VC; c0 += NCB) pv_block<HB, HBv, NCB>(acc, alpha, sc, vrows, n, hv, c0);
      for (; c0 < VC; ++c0) pv_block<HB, HBv, 1>(acc, alpha, sc, vrows, n, hv, c0);
    }
  }

  template <int HB, int HBv, int NCB>
  WS_KERNEL_NOINLINE static void pv_block(float* acc, const float* alpha, const float* sc, const bf16* vrows, int n, int hv,
                       int c0) noexcept {
    constexpr int HBz = pass_heads(HB);
    constexpr int TPz = W / HBz;
    constexpr int NSB = HB / HBz;
    static_assert(HBv % HBz == 0, "decode_kernel: a PV head block must be whole QK sub-blocks");
    // Lane of head hv + h in a pattern: (hv / HBz)·W + lane(h), lane(h) = (h / HBz)·W + h % HBz.
    const int hv_lane = (hv / HBz) * W;
    fbatch a[HBv][2 * NCB];
    WS_UNROLL
    for (int h = 0; h < HBv; ++h) {
      const int g = hv + h;
      const fbatch al(alpha[hv_lane + (h / HBz) * W + h % HBz]);
      float* src = acc + g * V + c0 * C;
      WS_UNROLL
      for (int k = 0; k < 2 * NCB; ++k) a[h][k] = fbatch::load_aligned(src + k * W) * al;
    }
    for (int t0 = 0; t0 < n; t0 += TPz) {  // one QK pass of tokens at a time: compile-time lane offsets
      const float* pp = sc + (t0 / TPz) * NSB * W + hv_lane;
      const int tn = std::min(TPz, n - t0);
      for (int t = 0; t < tn; ++t) {
        const bf16* vr = vrows + index_t(t0 + t) * R + c0 * C;
        fbatch ve[NCB], vo[NCB];
        WS_UNROLL
        for (int c = 0; c < NCB; ++c) widen(vr + c * C, ve[c], vo[c]);
        const float* pt = pp + t * HBz;
        WS_UNROLL
        for (int h = 0; h < HBv; ++h) {
          const fbatch p(pt[(h / HBz) * W + h % HBz]);
          WS_UNROLL
          for (int c = 0; c < NCB; ++c) {
            a[h][2 * c] = xsimd::fma(p, ve[c], a[h][2 * c]);
            a[h][2 * c + 1] = xsimd::fma(p, vo[c], a[h][2 * c + 1]);
          }
        }
      }
    }
    WS_UNROLL
    for (int h = 0; h < HBv; ++h) {
      float* dst = acc + (hv + h) * V + c0 * C;
      WS_UNROLL
      for (int k = 0; k < 2 * NCB; ++k) a[h][k].store_aligned(dst + k * W);
    }
  }
};

static_assert(cpu_attention_kernel<decode_kernel<gqa_layout<128>>, gqa_layout<128>>);
static_assert(cpu_attention_kernel<decode_kernel<mla_layout<512, 64>, default_arch, bf16_scores>, mla_layout<512, 64>>);

}  // namespace writescope::cpu
