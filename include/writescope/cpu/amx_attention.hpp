// SPDX-License-Identifier: Apache-2.0
// writescope/cpu/amx_attention.hpp — the CPU engine's decode attention on
// Intel AMX-BF16 tiles (paper §6.1; docs/CPU-KERNEL.md, "AMX"). Host compiler
// only, like cpu/attention.hpp.
//
// Why: absorbed MLA does ≈ 15 multiply-adds per KV byte (16 query heads share
// one 576-element latent row), so the fp32-FMA kernel of cpu/attention.hpp is
// compute-bound, far below a core's share of the memory bandwidth
// (docs/CPU-KERNEL.md). One AMX TDPBF16PS does 16 × 16 × 32 bf16 multiply-adds.
//
// Shapes per call: the `group` query heads of one KV head, in head blocks of
// 16 (a tile's 16 rows / 16 fp32 columns; a short block is padded with zero
// queries). The KV is walked in tiles of 16 rows of one segment (a segment's
// last tile may be partial), four tiles (64 tokens, possibly of several
// segments) per chunk:
//
//   QK   S^T [64 tokens × 16 heads] fp32 = K [64 × R] · Q^T. A = 16 K rows ×
//        32 bf16 loaded straight from the block (stride R); B = the queries in
//        VNNI pairs, prepared once per call. The fp32 queries (pre-scaled) are
//        split into two bf16 parts, q = q0 + q1 to 2^-17 relative; every bf16
//        × bf16 product is exact in fp32 and sums are fp32, so the scores are
//        fp32-class (test_amx_kernel bounds the error against fp64 after the
//        softmax; docs/CPU-KERNEL.md). Two token tiles × two parts = four
//        independent accumulators per pass, the parts added after.
//   soft online softmax per head over the chunk, vectors of the 16 heads of
//        one token (running max, running sum, natural-base exp).
//   PV   O [16 heads × V] fp32 += P [16 × 64] · V [64 × V]. P is split into two
//        bf16 parts (p = p0 + p1 to 2^-17 relative) and transposed to [head]
//        [token] (A tiles); V is read from the same block rows and interleaved
//        in token pairs (B tiles, VNNI) per 32-column slice: even columns form
//        one tile, odd columns the other, so O is kept de-interleaved
//        (column 2k + parity of the slice at tile `parity`, column k) and put
//        back in order once at the end. O lives in memory (L1/L2) as C tiles,
//        rescaled only when a head's running max moved.
//
// A partial tile (a segment whose token count is not a multiple of 16) is
// copied into a zero-padded buffer for QK and its V rows are read one by one
// for PV: the kernel reads exactly the rows [0, tokens) of each segment. The
// result is deterministic (fixed order of every sum) and independent of the
// other sequences of a batch. The next chunk's rows are prefetched during PV.
//
// The tile instructions are written as inline assembly (AT&T and Intel
// dialects), so no compiler target flag is needed; they run only when
// amx_available() says the CPU has AMX-TILE and AMX-BF16 and Linux granted
// this process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM). The same
// kernel runs on a portable emulation of the tiles (emulated_tiles: the
// instruction semantics in scalar C++), which is how machines without AMX test
// the algorithm; the tests compare both with the fp64 reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string_view>

#include "attention.hpp"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#  include <cpuid.h>
#  include <sys/syscall.h>
#  include <unistd.h>
#  define WS_AMX_ASM 1
#else
#  define WS_AMX_ASM 0
#endif

namespace writescope::cpu {

/// Which layouts the dispatching kernel (auto_decode_kernel) runs on AMX when
/// the CPU has it. Read once from the environment variable WRITESCOPE_CPU_AMX:
/// "0"/"off" = none, "mla" (default) = MLA layouts only, "all"/"1" = every
/// layout. Any other value is treated as the default.
enum class amx_use : std::uint8_t { off, mla, all };

namespace amx_detail {

/// Tile configuration (palette 1): 64 bytes, as ldtilecfg reads it.
struct alignas(64) tile_config {
  std::uint8_t palette_id = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(tile_config) == 64, "tile_config must be the 64-byte ldtilecfg operand");

/// All eight tiles 16 rows × 64 bytes (16 fp32, or 32 bf16 = 16 pairs).
inline const tile_config& full_tiles() noexcept {
  static const tile_config c = [] {
    tile_config t;
    for (int i = 0; i < 8; ++i) {
      t.colsb[i] = 64;
      t.rows[i] = 16;
    }
    return t;
  }();
  return c;
}

inline amx_use amx_use_from_env() noexcept {
  const char* v = std::getenv("WRITESCOPE_CPU_AMX");
  if (!v) return amx_use::mla;
  const std::string_view s(v);
  if (s == "0" || s == "off" || s == "OFF") return amx_use::off;
  if (s == "all" || s == "1" || s == "ALL") return amx_use::all;
  return amx_use::mla;
}

/// CPUID.(7,0):EDX bit 24 AMX-TILE, bit 22 AMX-BF16; then Linux's permission
/// for the tile data state (process-wide, so every thread may use tiles).
inline bool probe_amx() noexcept {
#if WS_AMX_ASM
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
  constexpr long arch_req_xcomp_perm = 0x1023, arch_get_xcomp_perm = 0x1022, xfeature_xtiledata = 18;
  if (::syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) != 0) return false;
  unsigned long long granted = 0;
  if (::syscall(SYS_arch_prctl, arch_get_xcomp_perm, &granted) != 0) return false;
  return (granted >> xfeature_xtiledata) & 1u;
#else
  return false;
#endif
}

#define WS_AMX_EACH_TILE(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)

/// The hardware: one inline-assembly instruction per operation. Tile numbers
/// are template arguments because the instructions encode them.
struct hw_tiles {
  static constexpr bool emulated = false;
  static void configure(const tile_config& c) noexcept {
#if WS_AMX_ASM
    asm volatile("ldtilecfg %0" ::"m"(c) : "memory");
#else
    (void)c;
#endif
  }
  static void release() noexcept {
#if WS_AMX_ASM
    asm volatile("tilerelease" ::: "memory");
#endif
  }
  template <int T>
  static void zero() noexcept {
    static_assert(T >= 0 && T < 8);
#if WS_AMX_ASM
#  define WS_AMX_ZERO(n) \
    if constexpr (T == n) asm volatile("tilezero %%tmm" #n ::);
    WS_AMX_EACH_TILE(WS_AMX_ZERO)
#  undef WS_AMX_ZERO
#endif
  }
  template <int T>
  static void load(const void* p, index_t stride_bytes) noexcept {
    move<T, false>(p, stride_bytes);
  }
  template <int T>
  static void store(void* p, index_t stride_bytes) noexcept {
    move<T, true>(p, stride_bytes);
  }
  /// C += A · B (TDPBF16PS): C [16 × 16] fp32, A [16 × 32] bf16, B [16 pairs × 16 × 2] bf16.
  template <int C, int A, int B>
  static void dp() noexcept {
    static_assert(C >= 0 && C < 8 && A >= 0 && A < 8 && B >= 0 && B < 8 && C != A && C != B && A != B);
#if WS_AMX_ASM
#  define WS_AMX_DP_B(c, a, b)                                                                       \
    if constexpr (C == c && A == a && B == b)                                                        \
      asm volatile("{tdpbf16ps\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c "|tdpbf16ps\t%%tmm" #c ", %%tmm" #a \
                   ", %%tmm" #b "}" ::);
#  define WS_AMX_DP_A(c, a) \
    WS_AMX_DP_B(c, a, 0) WS_AMX_DP_B(c, a, 1) WS_AMX_DP_B(c, a, 2) WS_AMX_DP_B(c, a, 3) \
    WS_AMX_DP_B(c, a, 4) WS_AMX_DP_B(c, a, 5) WS_AMX_DP_B(c, a, 6) WS_AMX_DP_B(c, a, 7)
#  define WS_AMX_DP_C(c) \
    WS_AMX_DP_A(c, 0) WS_AMX_DP_A(c, 1) WS_AMX_DP_A(c, 2) WS_AMX_DP_A(c, 3) \
    WS_AMX_DP_A(c, 4) WS_AMX_DP_A(c, 5) WS_AMX_DP_A(c, 6) WS_AMX_DP_A(c, 7)
    WS_AMX_EACH_TILE(WS_AMX_DP_C)
#  undef WS_AMX_DP_C
#  undef WS_AMX_DP_A
#  undef WS_AMX_DP_B
#endif
  }

 private:
  /// TILELOADD (tile T := 16 rows of 64 bytes at p, row stride stride_bytes)
  /// or, for Store, TILESTORED (the same rows := tile T).
  template <int T, bool Store>
  static void move(const void* p, index_t stride_bytes) noexcept {
    static_assert(T >= 0 && T < 8);
#if WS_AMX_ASM
    const long s = static_cast<long>(stride_bytes);
#  define WS_AMX_MOVE(n)                                                                                    \
    if constexpr (T == n && Store)                                                                          \
      asm volatile("{tilestored\t%%tmm" #n ", (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm" #n "}" ::"r"(p), "r"(s) \
                   : "memory");                                                                             \
    if constexpr (T == n && !Store)                                                                         \
      asm volatile("{tileloadd\t(%0,%1,1), %%tmm" #n "|tileloadd\t%%tmm" #n ", [%0+%1*1]}" ::"r"(p), "r"(s)   \
                   : "memory");
    WS_AMX_EACH_TILE(WS_AMX_MOVE)
#  undef WS_AMX_MOVE
#else
    (void)p;
    (void)stride_bytes;
#endif
  }
};

/// The same operations in scalar C++ on a thread-local register file, with the
/// instruction's order of operations: per C element, for each pair k of the
/// reduction, c += a[2k]·b[2k], then c += a[2k+1]·b[2k+1], in fp32 (each bf16
/// product is exact in fp32). Hardware flushes fp32 denormals (inputs and
/// results) to zero; the emulation does not, which only matters below 1e-38.
struct emulated_tiles {
  static constexpr bool emulated = true;
  struct file {
    alignas(64) unsigned char t[8][16 * 64];
  };
  static file& regs() noexcept {
    thread_local file f;
    return f;
  }
  static void configure(const tile_config&) noexcept {}
  static void release() noexcept {}
  template <int T>
  static void zero() noexcept {
    std::memset(regs().t[T], 0, sizeof regs().t[T]);
  }
  template <int T>
  static void load(const void* p, index_t stride_bytes) noexcept {
    for (int r = 0; r < 16; ++r)
      std::memcpy(regs().t[T] + r * 64, static_cast<const unsigned char*>(p) + r * stride_bytes, 64);
  }
  template <int T>
  static void store(void* p, index_t stride_bytes) noexcept {
    for (int r = 0; r < 16; ++r)
      std::memcpy(static_cast<unsigned char*>(p) + r * stride_bytes, regs().t[T] + r * 64, 64);
  }
  template <int C, int A, int B>
  static void dp() noexcept {
    static_assert(C != A && C != B && A != B);
    auto& f = regs();
    float c[16][16];
    std::uint16_t a[16][32], b[16][32];
    std::memcpy(c, f.t[C], sizeof c);
    std::memcpy(a, f.t[A], sizeof a);
    std::memcpy(b, f.t[B], sizeof b);
    auto fl = [](std::uint16_t x) { return bf16{x}.to_float(); };
    for (int m = 0; m < 16; ++m)
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 16; ++n) {
          c[m][n] += fl(a[m][2 * k]) * fl(b[k][2 * n]);
          c[m][n] += fl(a[m][2 * k + 1]) * fl(b[k][2 * n + 1]);
        }
    std::memcpy(f.t[C], c, sizeof c);
  }
};

/// Per-thread buffers of the AMX kernel (grown once, reused by every call).
struct amx_scratch {
  detail::aligned_vector<std::uint32_t> qt;     // [head block][part][d chunk][16 pairs][16 heads] Q^T (B tiles)
  detail::aligned_vector<float> o;              // [head block][slice][parity][16 heads][16] O (C tiles)
  detail::aligned_vector<float> m, l;           // [head block][16] running max / sum
  detail::aligned_vector<bf16> kpad;            // [4][16][R] partial tiles' K rows, zero-padded
  alignas(64) float s[2][64 * 16];              // S^T of the chunk per q part, [token][head]
  alignas(64) float alpha[16];                  // rescale of O for this chunk, per head
  alignas(64) std::uint32_t pair[2][32][16];    // [part][token pair][head] P pairs before the transpose
  alignas(64) std::uint32_t pa[2][16][32];      // [part][head][token pair] P (A tiles; half h at column 16h)
  alignas(64) std::uint32_t vb[2][32][16];      // [parity][token pair][column] one slice of V (B tiles)

  static amx_scratch& local() {
    thread_local amx_scratch s;
    return s;
  }
};

/// out[c][r] = in[r][c] for a 16 x 16 block of 32-bit words (row strides in words).
inline void transpose16(const std::uint32_t* in, int in_stride, std::uint32_t* out, int out_stride) noexcept {
#if defined(__AVX512F__)
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + i * in_stride);
  for (int i = 0; i < 8; ++i) {  // 32-bit interleave of row pairs, per 128-bit lane
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int j = 0; j < 4; ++j) {  // 64-bit interleave: r[4j+k] lane L = column 4L+k of rows 4j..4j+3
    r[4 * j + 0] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
    r[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
    r[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
    r[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather lane L of r[k], r[4+k], r[8+k], r[12+k]: output row 4L+k
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88), d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
    _mm512_storeu_si512(out + (0 + k) * out_stride, _mm512_shuffle_i32x4(a, c, 0x88));
    _mm512_storeu_si512(out + (4 + k) * out_stride, _mm512_shuffle_i32x4(b, d, 0x88));
    _mm512_storeu_si512(out + (8 + k) * out_stride, _mm512_shuffle_i32x4(a, c, 0xdd));
    _mm512_storeu_si512(out + (12 + k) * out_stride, _mm512_shuffle_i32x4(b, d, 0xdd));
  }
#else
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) out[c * out_stride + r] = in[r * in_stride + c];
#endif
}

/// Round-to-nearest-even of fp32 bits to bf16, kept in the upper half (lower half zero).
template <class U>
inline U round_bf16_bits(U u) noexcept {
  return (u + (U(0x7fffu) + ((u >> 16) & U(1u)))) & U(0xffff0000u);
}

}  // namespace amx_detail

/// Whether AMX tiles can be used by this process (see the file comment); the
/// probe (CPUID + one arch_prctl) runs once. Never throws.
inline bool amx_available() noexcept {
  static const bool ok = amx_detail::probe_amx();
  return ok;
}

/// The WRITESCOPE_CPU_AMX setting (read once).
inline amx_use amx_setting() noexcept {
  static const amx_use u = amx_detail::amx_use_from_env();
  return u;
}

/// Decode attention of one KV head's query group over a list of blocks, on
/// AMX-BF16 tiles. Same contract as decode_kernel::run (cpu/attention.hpp):
///
///   q        [group][q_dim] fp32, head g at q + g*q_head_stride (unscaled queries)
///   segs     blocks of this sequence in this layer, any memory the host can read
///   o        [group][v_dim] fp32 out, head g at o + g*o_head_stride: normalised output
///   lse      [group] fp32 out: natural-log sum of exp(scale·q·k) over all attended keys
///
/// Any group size ≥ 1; an empty list yields o = 0, lse = -inf. Reads exactly
/// rows [0, tokens) of each segment. Deterministic. Thread-safe (thread-local
/// scratch; configures and releases the tiles of the calling thread).
/// Memory: q, o, lse and the blocks are host memory (the unpinned CPU region
/// or any host-readable block). Errors: none of its own — shapes are checked
/// at compile time (row width and v_dim multiples of 32); only the first call
/// on a thread (or one with a larger group) allocates its scratch and may
/// throw std::bad_alloc. Precondition for Tiles = hw_tiles: amx_available()
/// (otherwise the first tile instruction raises SIGILL); auto_decode_kernel
/// checks it.
/// Numerics: scores and sums fp32-class (q split in two bf16 parts, 2^-17
/// relative), P in two bf16 parts (2^-17), fp32 accumulation of O; fp32-class
/// against fp64 (test_amx_kernel; docs/CPU-KERNEL.md). Paper §6.1.
template <kv_layout Layout, class Tiles = amx_detail::hw_tiles, class Arch = default_arch>
struct amx_decode_kernel {
  using kernel_concept = cpu_attention_kernel_tag;
  using precision = fp32_scores;
  using fbatch = xsimd::batch<float, Arch>;
  using ubatch = xsimd::batch<std::uint32_t, Arch>;
  static constexpr int W = static_cast<int>(fbatch::size);
  static constexpr int R = Layout::row_elems;
  static constexpr int V = Layout::v_dim;
  static constexpr int TB = 64;          ///< tokens per chunk
  static constexpr int HB = 16;          ///< heads per head block
  static constexpr int DC = R / 32;      ///< QK d-chunks (one A tile each)
  static constexpr int VS = V / 32;      ///< PV slices (two C tiles each)
  static constexpr int QP = 2;           ///< bf16 parts of q
  static constexpr int NV = HB / W;      ///< vectors per 16-head row
  static_assert(R % 32 == 0 && V % 32 == 0, "amx_decode_kernel: row width and v_dim must be multiples of 32");
  static_assert(W <= HB && HB % W == 0, "amx_decode_kernel: SIMD width must divide 16");
  /// "emulated tiles" or "AMX tiles" (for logs).
  static constexpr const char* emulated_tiles_name() noexcept { return Tiles::emulated ? "emulated tiles" : "AMX tiles"; }

  static void run(const block_format<Layout>& fmt, int kv_head, const float* q, index_t q_head_stride, int group,
                  float scale, std::span<const kv_segment> segs, float* o, index_t o_head_stride, float* lse) {
    auto& s = amx_detail::amx_scratch::local();
    const int nhb = (group + HB - 1) / HB;
    prepare(s, q, q_head_stride, group, scale, nhb);
    tile_cursor cursor{segs, fmt.slice_offset(Layout::key_plane, kv_head), fmt.slice_offset(Layout::value_plane, kv_head)};
    chunk cur, next;
    cursor.fill(cur);
    cursor.fill(next);
    Tiles::configure(amx_detail::full_tiles());
    while (cur.tiles > 0) {
      for (int i = 0; i < cur.tiles; ++i)
        if (cur.t[i].rows < 16) {  // a partial tile, zero-padded: tiles load 16 whole rows
          bf16* pad = s.kpad.data() + std::size_t(i) * 16 * R;
          std::fill(pad, pad + 16 * R, bf16{0});
          std::memcpy(pad, cur.t[i].k, std::size_t(cur.t[i].rows) * R * sizeof(bf16));
          cur.t[i].k_load = pad;
        }
      for (int hb = 0; hb < nhb; ++hb) {
        qk(s, hb, cur);
        softmax(s, hb, cur);
        pv(s, hb, cur, hb == 0 ? &next : nullptr);
      }
      cur = next;
      cursor.fill(next);
    }
    Tiles::release();
    finish(s, group, o, o_head_stride, lse);
  }

 private:
  /// 16 rows (or fewer: `rows`) of one segment: K at k (loaded from k_load,
  /// the padded copy for a partial tile), V at v; row stride R.
  struct tile_ref {
    const bf16* k = nullptr;
    const bf16* k_load = nullptr;
    const bf16* v = nullptr;
    int rows = 0;
  };
  /// Up to four tiles, possibly of several segments: one QK/PV pass.
  struct chunk {
    tile_ref t[4];
    int tiles = 0;
    bool valid(int token) const noexcept { return token / 16 < tiles && token % 16 < t[token / 16].rows; }
    int tokens_used() const noexcept { return tiles > 2 ? 64 : 32; }  ///< tokens the PV A tiles cover
  };
  /// Walks the segments in order, 16 rows at a time (a segment's last tile may be partial).
  struct tile_cursor {
    std::span<const kv_segment> segs;
    index_t k_off = 0, v_off = 0;
    std::size_t si = 0;
    int row = 0;
    bool next(tile_ref& t) noexcept {
      while (si < segs.size() && row >= segs[si].tokens) {
        ++si;
        row = 0;
      }
      if (si >= segs.size()) return false;
      const bf16* base = segs[si].block + index_t(row) * R;
      t.k = t.k_load = base + k_off;
      t.v = base + v_off;
      t.rows = std::min(16, segs[si].tokens - row);
      row += 16;
      return true;
    }
    void fill(chunk& c) noexcept {
      c.tiles = 0;
      while (c.tiles < 4 && next(c.t[c.tiles])) ++c.tiles;
    }
  };

  static void prepare(amx_detail::amx_scratch& s, const float* q, index_t q_head_stride, int group, float scale,
                      int nhb) {
    const auto NHB = std::size_t(nhb);
    s.qt.assign(NHB * QP * DC * 256, 0u);
    s.o.assign(NHB * VS * 2 * 256, 0.0f);
    s.m.assign(NHB * HB, -std::numeric_limits<float>::infinity());
    s.l.assign(NHB * HB, 0.0f);
    s.kpad.resize(std::size_t(4) * 16 * R);
    for (int g = 0; g < group; ++g) {
      const int hb = g / HB, h = g % HB;
      const float* src = q + g * q_head_stride;
      for (int i = 0; i < R; i += 2) {
        float r0 = src[i] * scale, r1 = src[i + 1] * scale;
        for (int part = 0; part < QP; ++part) {  // q ≈ Σ parts, each a bf16
          const bf16 b0 = bf16::from_float(r0), b1 = bf16::from_float(r1);
          r0 -= b0.to_float();
          r1 -= b1.to_float();
          const int c = i / 32, pr = (i % 32) / 2;
          s.qt[((std::size_t(hb) * QP + part) * DC + c) * 256 + std::size_t(pr) * 16 + h] =
              std::uint32_t(b0.bits) | (std::uint32_t(b1.bits) << 16);
        }
      }
    }
  }

  /// The two q parts' scores S^T [64][16] of head block hb into s.s[0], s.s[1]
  /// (tiles of the chunk only). Two token tiles at a time, four independent
  /// accumulators (tile, part), so no TDPBF16PS waits on the one before.
  WS_KERNEL_NOINLINE static void qk(amx_detail::amx_scratch& s, int hb, const chunk& ch) noexcept {
    static_assert(QP == 2, "qk: two q parts (tiles 2, 3)");
    const std::uint32_t* qt = s.qt.data() + std::size_t(hb) * QP * DC * 256;
    const index_t kstride = index_t(R) * index_t(sizeof(bf16));
    for (int i0 = 0; i0 < ch.tiles; i0 += 2) {
      const bool two = i0 + 1 < ch.tiles;
      const bf16* ka = ch.t[i0].k_load;
      const bf16* kb = two ? ch.t[i0 + 1].k_load : nullptr;
      Tiles::template zero<4>();
      Tiles::template zero<5>();
      Tiles::template zero<6>();
      Tiles::template zero<7>();
      for (int c = 0; c < DC; ++c) {
        Tiles::template load<2>(qt + (0 * DC + c) * 256, 64);
        Tiles::template load<3>(qt + (1 * DC + c) * 256, 64);
        Tiles::template load<0>(ka + c * 32, kstride);
        if (two) Tiles::template load<1>(kb + c * 32, kstride);
        Tiles::template dp<4, 0, 2>();
        if (two) Tiles::template dp<5, 1, 2>();
        Tiles::template dp<6, 0, 3>();
        if (two) Tiles::template dp<7, 1, 3>();
      }
      Tiles::template store<4>(s.s[0] + i0 * 256, 64);
      Tiles::template store<6>(s.s[1] + i0 * 256, 64);
      if (two) {
        Tiles::template store<5>(s.s[0] + (i0 + 1) * 256, 64);
        Tiles::template store<7>(s.s[1] + (i0 + 1) * 256, 64);
      }
    }
  }

  /// Online softmax of the chunk's valid tokens for head block hb; writes the
  /// P tiles (two bf16 parts, [head][token]) and rescales O when a max moved.
  WS_KERNEL_NOINLINE static void softmax(amx_detail::amx_scratch& s, int hb, const chunk& ch) noexcept {
    float* m = s.m.data() + std::size_t(hb) * HB;
    float* l = s.l.data() + std::size_t(hb) * HB;
    const int used = ch.tokens_used();
    const fbatch ninf(-std::numeric_limits<float>::infinity());
    bool rescale = false;
    for (int v = 0; v < NV; ++v) {
      auto score = [&](int t) {
        return fbatch::load_aligned(s.s[0] + t * HB + v * W) + fbatch::load_aligned(s.s[1] + t * HB + v * W);
      };
      fbatch mx = ninf;
      for (int t = 0; t < ch.tiles * 16; ++t)
        if (ch.valid(t)) mx = xsimd::max(mx, score(t));
      const fbatch m_old = fbatch::load_aligned(m + v * W);
      const fbatch m_new = xsimd::max(m_old, mx);
      // m_old = -inf on the first chunk: alpha = exp(-inf) = 0 (O and l are still zero).
      const fbatch al = xsimd::select(m_old == m_new, fbatch(1.0f), xsimd::exp(m_old - m_new));
      al.store_aligned(s.alpha + v * W);
      m_new.store_aligned(m + v * W);
      rescale = rescale || xsimd::any(al != fbatch(1.0f));
      fbatch sum(0.0f);
      for (int t = 0; t < used; t += 2) {
        const fbatch p0 = ch.valid(t) ? xsimd::exp(score(t) - m_new) : fbatch(0.0f);
        const fbatch p1 = ch.valid(t + 1) ? xsimd::exp(score(t + 1) - m_new) : fbatch(0.0f);
        sum += p0;
        sum += p1;
        // Two bf16 parts of each probability, paired by token (VNNI order).
        const ubatch h0 = amx_detail::round_bf16_bits(xsimd::bitwise_cast<ubatch>(p0));
        const ubatch h1 = amx_detail::round_bf16_bits(xsimd::bitwise_cast<ubatch>(p1));
        const ubatch r0 = amx_detail::round_bf16_bits(xsimd::bitwise_cast<ubatch>(p0 - xsimd::bitwise_cast<fbatch>(h0)));
        const ubatch r1 = amx_detail::round_bf16_bits(xsimd::bitwise_cast<ubatch>(p1 - xsimd::bitwise_cast<fbatch>(h1)));
        ((h0 >> 16) | h1).store_aligned(&s.pair[0][t / 2][v * W]);
        ((r0 >> 16) | r1).store_aligned(&s.pair[1][t / 2][v * W]);
      }
      (fbatch::load_aligned(l + v * W) * al + sum).store_aligned(l + v * W);
    }
    for (int part = 0; part < 2; ++part)  // [token pair][head] -> [head][token pair], 16 x 16 blocks
      for (int tp0 = 0; tp0 < used / 2; tp0 += 16) amx_detail::transpose16(&s.pair[part][tp0][0], 16, &s.pa[part][0][tp0], 32);
    if (rescale) {
      float* ob = s.o.data() + std::size_t(hb) * VS * 2 * 256;
      for (int tile = 0; tile < VS * 2; ++tile)
        for (int h = 0; h < HB; ++h) {
          const fbatch a(s.alpha[h]);
          float* row = ob + tile * 256 + h * 16;
          for (int v = 0; v < NV; ++v) (fbatch::load_aligned(row + v * W) * a).store_aligned(row + v * W);
        }
    }
  }

  /// O += P · V for head block hb over the chunk (V rows of valid tokens read
  /// from their blocks, the others zero). Prefetches the K and V rows of
  /// `next`, a share of the lines per slice.
  WS_KERNEL_NOINLINE static void pv(amx_detail::amx_scratch& s, int hb, const chunk& ch, const chunk* next) noexcept {
    float* ob = s.o.data() + std::size_t(hb) * VS * 2 * 256;
    const int used = ch.tokens_used();
    const bool second_half = used > 32;
    Tiles::template load<0>(&s.pa[0][0][0], 128);   // p0, tokens 0-31
    Tiles::template load<1>(&s.pa[1][0][0], 128);   // p1, tokens 0-31
    if (second_half) {
      Tiles::template load<2>(&s.pa[0][0][16], 128);  // p0, tokens 32-63
      Tiles::template load<3>(&s.pa[1][0][16], 128);  // p1, tokens 32-63
    }
    // Prefetch: the next chunk's rows, whole (K and, when it is elsewhere, V), a share per slice.
    constexpr int lines_per_row = R * int(sizeof(bf16)) / 64;
    const int next_rows = next ? next->tiles * 16 : 0;
    const int rows_per_slice = (next_rows + VS - 1) / VS;
    const bf16* vr[64];
    for (int t = 0; t < used; ++t) vr[t] = ch.valid(t) ? ch.t[t / 16].v + index_t(t % 16) * R : nullptr;
    const ubatch lo_mask(0x0000ffffu), hi_mask(0xffff0000u);
    for (int sl = 0; sl < VS; ++sl) {
      for (int r = sl * rows_per_slice; r < std::min(next_rows, (sl + 1) * rows_per_slice); ++r) {
        const tile_ref& nt = next->t[r / 16];
        if (r % 16 >= nt.rows) continue;
        const char* krow = reinterpret_cast<const char*>(nt.k + index_t(r % 16) * R);
        for (int i = 0; i < lines_per_row; ++i) detail::prefetch_l1(krow + i * 64);
        if constexpr (!Layout::is_mla) {
          const char* vrow = reinterpret_cast<const char*>(nt.v + index_t(r % 16) * R);
          for (int i = 0; i < lines_per_row; ++i) detail::prefetch_l1(vrow + i * 64);
        }
      }
      // V slice in token pairs: parity 0 = even columns, 1 = odd columns.
      for (int tp = 0; tp < used / 2; ++tp) {
        const auto* w0p = vr[2 * tp] ? reinterpret_cast<const std::uint32_t*>(vr[2 * tp] + sl * 32) : nullptr;
        const auto* w1p = vr[2 * tp + 1] ? reinterpret_cast<const std::uint32_t*>(vr[2 * tp + 1] + sl * 32) : nullptr;
        for (int v = 0; v < NV; ++v) {
          const ubatch w0 = w0p ? ubatch::load_unaligned(w0p + v * W) : ubatch(0u);
          const ubatch w1 = w1p ? ubatch::load_unaligned(w1p + v * W) : ubatch(0u);
          ((w0 & lo_mask) | (w1 << 16)).store_aligned(&s.vb[0][tp][v * W]);
          ((w0 >> 16) | (w1 & hi_mask)).store_aligned(&s.vb[1][tp][v * W]);
        }
      }
      // Two accumulators (even, odd columns) in turn: consecutive TDPBF16PS are independent.
      float* o_even = ob + (sl * 2 + 0) * 256;
      float* o_odd = ob + (sl * 2 + 1) * 256;
      Tiles::template load<6>(o_even, 64);
      Tiles::template load<7>(o_odd, 64);
      pv_half<0>(s);
      if (second_half) pv_half<1>(s);
      Tiles::template store<6>(o_even, 64);
      Tiles::template store<7>(o_odd, 64);
    }
  }

  /// One half (tokens 32·Half .. 32·Half + 31) of a V slice's PV product: the
  /// slice's token pairs 16·Half .. 16·Half + 15 into B tiles 4 (even columns)
  /// and 5 (odd columns), then O_even (tile 6) and O_odd (tile 7) += P's two
  /// bf16 parts of those tokens (A tiles 2·Half, 2·Half + 1) times each.
  template <int Half>
  static void pv_half(const amx_detail::amx_scratch& s) noexcept {
    Tiles::template load<4>(&s.vb[0][16 * Half][0], 64);
    Tiles::template load<5>(&s.vb[1][16 * Half][0], 64);
    Tiles::template dp<6, 2 * Half, 4>();
    Tiles::template dp<7, 2 * Half, 5>();
    Tiles::template dp<6, 2 * Half + 1, 4>();
    Tiles::template dp<7, 2 * Half + 1, 5>();
  }

  static void finish(const amx_detail::amx_scratch& s, int group, float* o, index_t o_head_stride, float* lse) {
    for (int g = 0; g < group; ++g) {
      const int hb = g / HB, h = g % HB;
      const float sum = s.l[std::size_t(hb) * HB + h];
      float* dst = o + g * o_head_stride;
      if (!detail::finish_attended<V>(dst, lse[g], sum)) continue;
      const float inv = 1.0f / sum;
      const float* ob = s.o.data() + std::size_t(hb) * VS * 2 * 256;
      for (int sl = 0; sl < VS; ++sl)
        for (int k = 0; k < 16; ++k) {
          dst[sl * 32 + 2 * k] = ob[(sl * 2 + 0) * 256 + h * 16 + k] * inv;
          dst[sl * 32 + 2 * k + 1] = ob[(sl * 2 + 1) * 256 + h * 16 + k] * inv;
        }
      lse[g] = s.m[std::size_t(hb) * HB + h] + std::log(sum);
    }
  }
};

/// The CPU engine's default kernel: amx_decode_kernel when amx_available()
/// and WRITESCOPE_CPU_AMX allows it for this layout (default: MLA only),
/// otherwise decode_kernel<Layout, Arch> (fp32 FMA). Same contract as both.
/// The choice is made per call from two values cached at first use (the
/// CPUID/arch_prctl probe and the environment variable); errors as the kernel
/// it runs. Host memory, any thread.
template <kv_layout Layout, class Arch = default_arch>
struct auto_decode_kernel {
  using kernel_concept = cpu_attention_kernel_tag;
  using precision = fp32_scores;
  static bool uses_amx() noexcept {
    const amx_use u = amx_setting();
    return u != amx_use::off && (u == amx_use::all || Layout::is_mla) && amx_available();
  }
  static void run(const block_format<Layout>& fmt, int kv_head, const float* q, index_t q_head_stride, int group,
                  float scale, std::span<const kv_segment> segs, float* o, index_t o_head_stride, float* lse) {
    if (uses_amx())
      amx_decode_kernel<Layout, amx_detail::hw_tiles, Arch>::run(fmt, kv_head, q, q_head_stride, group, scale, segs, o,
                                                                 o_head_stride, lse);
    else
      decode_kernel<Layout, Arch>::run(fmt, kv_head, q, q_head_stride, group, scale, segs, o, o_head_stride, lse);
  }
};

static_assert(cpu_attention_kernel<auto_decode_kernel<mla_layout<512, 64>>, mla_layout<512, 64>>);
static_assert(cpu_attention_kernel<amx_decode_kernel<mla_layout<512, 64>, amx_detail::emulated_tiles>, mla_layout<512, 64>>);

}  // namespace writescope::cpu
