// SPDX-License-Identifier: Apache-2.0
// ws_moe/cpu_experts.hpp — routed SiLU-gated MoE experts computed on the CPU
// straight from their bf16 checkpoint layout in host memory (paper §6.1: the
// CPU side of the hybrid decode; experts that do not fit the VRAM budget stay
// in host memory and run here). Host compiler only (never seen by nvcc).
//
// Per expert, with X fp32 [rows][hidden] and bf16 weights gate, up
// [inter][hidden] and down [hidden][inter] (row-major, as in the checkpoint):
//
//   A = silu(X·gateᵀ) ⊙ (X·upᵀ)      [rows][inter]    silu(g) = g / (1 + e^-g)
//   Y = A·downᵀ                      [rows][hidden]
//
// Algorithm. Both products are "activation rows times weight rows": every
// output element is the dot product of one activation row and one weight row,
// both contiguous along the reduction axis, so the weights are read in their
// stored order without any repacking. A register tile holds MR activation rows
// × NR weight rows of SIMD accumulators; each weight chunk is loaded (and
// widened) once and multiplied into all MR rows, the MR·NR vectors are summed
// horizontally once at the end of the row. The gate/up pass puts NR/2 gate
// rows and the same NR/2 up rows in one tile, so X is read once for both and
// the SiLU product is formed in the tile's epilogue.
//
//   decode  (≤ 16 rows per expert): the whole row set is one block and the
//           reduction one pass, so every weight row is streamed once from DRAM
//           (the next tile's rows prefetched into L2 meanwhile) and meets all
//           rows while in L1; bandwidth-bound.
//   batched (> 16 rows): rows are cut into blocks of ≤ 48, weights into panels
//           of ≤ 32 rows, the reduction into k-blocks of 512 elements: per
//           k-block, a row block's MR rows stay in L1 across the panel's tiles
//           and the panel's k-block stays in L2 across the row blocks; the
//           tiles' unreduced accumulators wait in a per-thread scratch between
//           k-blocks (so the sums, and the bits, are those of one pass);
//           compute-bound. Work items of one panel come one after the other,
//           so the threads that take them share the panel through L3.
//
// Work split: the layer's tasks are cut into work items (task, panel of weight
// rows, block of activation rows) for each pass; the calling thread's OpenMP
// team takes the items dynamically (busiest experts first), with a barrier
// between the X packing, the gate/up pass and the down pass. One busy expert
// thus spreads over all threads, and so do many small ones. Every output
// element is computed by one fixed sequence of operations whatever the thread
// count or split: results are bit-identical for any `threads`.
//
// Activations are packed once per call into the calling thread's workspace (X and A,
// fp32 or bf16, rows padded with zeros to the SIMD chunk, in the lane order
// the kernel wants): the weight-row tails are copied into a zeroed register
// tile buffer, so no load reads past a weight matrix and any hidden/inter size
// works.
//
// Precision (expert_precision):
//   bf16_inputs  X and A are rounded to bf16 (round to nearest even) before
//                their products; products and sums fp32. On AVX512-BF16 the
//                products run on vdpbf16ps (bf16 pairs, fp32 accumulation;
//                the instruction flushes bf16 denormal inputs and fp32
//                denormal results to zero); elsewhere the same rounded values
//                go through fp32 FMAs (every bf16 × bf16 product is exact in
//                fp32).
//   fp32         weights widened exactly, fp32 X and A, fp32 FMAs.
//
// Instruction sets (isa:: tags): scalar (portable C++), avx2 (AVX2 + FMA),
// avx512 (AVX-512F + BW), avx512bf16 (AVX-512F + BW + VL + BF16). Each kernel is
// compiled for its ISA with a function target (GCC `#pragma GCC target`, clang
// `#pragma clang attribute`), so a binary built for the x86-64 baseline carries
// all of them; best_isa() picks the best the CPU and OS support (CPUID and
// XGETBV, once). The environment variable WS_MOE_CPU_EXPERTS_ISA (scalar,
// avx2, avx512, avx512bf16) caps the choice. The kernels are generic code over
// a small per-ISA operation set (below: `ops`), stamped out once per ISA by
// including this file again inside each target region (that is why the file
// uses an include guard, not #pragma once); the AVX2 build therefore runs the
// same tiling, tail and epilogue code as the AVX-512 builds.
//
// Threads: run_experts uses `#pragma omp parallel` from the calling thread
// (any thread; OpenMP's initial thread is not required). Called inside an
// active parallel region with nested parallelism off it runs on a team of one
// (correct, serial). With a side_work, the calling thread does that work first
// while the rest of the team starts on the experts, then joins them (the
// results are the same bits either way). Memory spaces: weights, X and Y are host memory, pageable
// or page-locked; no stream semantics (blocking, returns when Y is written).
// The workspace is thread_local to the calling thread and only grows
// (release_thread_workspace() frees it): a steady state of equal or smaller
// calls allocates nothing.
//
// Errors: writescope::config_error for a non-positive hidden or inter, negative
// rows, a null pointer in a task with rows > 0, or negative threads, naming
// the task and value; nothing is written then. std::bad_alloc when the
// workspace cannot grow (nothing written either).
//
// AMX (amx_attention.hpp's tiles) is not used here: the batched pass runs on
// vdpbf16ps; tile-based GEMM is the way to go further for large row counts.
#if !defined(WS_MOE_CPU_EXPERTS_KERNEL_PASS)
#ifndef WS_MOE_CPU_EXPERTS_HPP
#define WS_MOE_CPU_EXPERTS_HPP

#if defined(__CUDACC__)
#  error "ws_moe/cpu_experts.hpp is host code: do not compile it with nvcc"
#endif

#include <writescope/bf16.hpp>
#include <writescope/detail/simd_include.hpp>
#include <writescope/error.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#  include <omp.h>
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#  include <cpuid.h>
#  define WS_MOE_CPUX_X86 1
#else
#  define WS_MOE_CPUX_X86 0
#endif

#define WS_MOE_CPUX_STR(x) #x
#if defined(__clang__)
#  define WS_MOE_CPUX_TARGET_PUSH(t) \
    _Pragma(WS_MOE_CPUX_STR(clang attribute push(__attribute__((target(t))), apply_to = function)))
#  define WS_MOE_CPUX_TARGET_POP _Pragma("clang attribute pop")
#  define WS_MOE_CPUX_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#  define WS_MOE_CPUX_TARGET_PUSH(t) _Pragma("GCC push_options") _Pragma(WS_MOE_CPUX_STR(GCC target(t)))
#  define WS_MOE_CPUX_TARGET_POP _Pragma("GCC pop_options")
#  define WS_MOE_CPUX_UNROLL _Pragma("GCC unroll 16")
#else
#  define WS_MOE_CPUX_TARGET_PUSH(t)
#  define WS_MOE_CPUX_TARGET_POP
#  define WS_MOE_CPUX_UNROLL
#endif
#if defined(__GNUC__) || defined(__clang__)
#  define WS_MOE_CPUX_INLINE inline __attribute__((always_inline))
#  define WS_MOE_CPUX_NOINLINE __attribute__((noinline))
#else
#  define WS_MOE_CPUX_INLINE inline
#  define WS_MOE_CPUX_NOINLINE
#endif

namespace ws_moe::cpu {

/// One routed SiLU-gated expert in host memory: bf16 bits, row-major, the checkpoint's layout
/// (and the layout the GPU reads when the expert is streamed to it — no repacking, one copy):
/// gate [inter][hidden], up [inter][hidden], down [hidden][inter]. Any of them may live in page-locked memory.
struct expert_view {
  const std::uint16_t* gate = nullptr;
  const std::uint16_t* up = nullptr;
  const std::uint16_t* down = nullptr;
};

/// Y[rows][hidden] = down( silu(X·gateᵀ) ⊙ (X·upᵀ) ): x fp32 [rows][hidden] (row stride hidden),
/// y fp32 [rows][hidden] (overwritten). Host memory. The y of distinct tasks must not overlap; y may
/// overlap any x, its own included (every X is packed before the first output is written).
struct expert_task {
  expert_view w;
  const float* x = nullptr;
  float* y = nullptr;
  std::int64_t rows = 0;
};

/// Model dimensions shared by all experts of a layer (elements).
struct expert_shape {
  std::int64_t hidden = 0, inter = 0;
};

enum class expert_precision {
  bf16_inputs,  ///< X and the SiLU product rounded to bf16 (round-to-nearest-even) before their products, fp32 accumulation: what the GPU's bf16 path computes
  fp32          ///< bf16 weights widened exactly, fp32 X and fp32 products/accumulation: the fp32 reference precision
};

/// Work that the calling thread (the team's thread 0) does inside run_experts'
/// parallel region before it takes its share of the experts, while the other
/// threads start on them: e.g. issuing the GPU's part of the layer, so that
/// the host time of that issue overlaps the CPU experts instead of preceding
/// them. fn(ctx) runs exactly once per call (also when no task has rows, then
/// outside any region); an exception it throws is rethrown by run_experts
/// after the experts are done. It must not write any task's x or y.
struct side_work {
  void (*fn)(void*) = nullptr;
  void* ctx = nullptr;
};

/// Host seconds of one run_experts call (optional output; steady_clock, a
/// clock reading per team thread):
struct run_stats {
  double setup_seconds = 0.0;  ///< entry to the parallel region (validation, work items, workspace)
  double wake_seconds = 0.0;   ///< the region's start (thread 0) to the last team thread inside it
  double side_seconds = 0.0;   ///< side_work::fn (0 without one)
  double total_seconds = 0.0;  ///< the whole call
};

/// Instruction-set tags: the compile-time choice of run_experts<Isa>.
namespace isa {
struct scalar {
  static constexpr std::string_view name = "scalar";
};
struct avx2 {
  static constexpr std::string_view name = "avx2";
};
struct avx512 {
  static constexpr std::string_view name = "avx512";
};
struct avx512bf16 {
  static constexpr std::string_view name = "avx512bf16";
};
}  // namespace isa

/// The run-time choice, best first-to-last: scalar < avx2 < avx512 < avx512bf16.
enum class isa_kind : int { scalar = 0, avx2 = 1, avx512 = 2, avx512bf16 = 3 };

[[nodiscard]] constexpr std::string_view isa_name(isa_kind k) noexcept {
  switch (k) {
    case isa_kind::avx2: return "avx2";
    case isa_kind::avx512: return "avx512";
    case isa_kind::avx512bf16: return "avx512bf16";
    default: return "scalar";
  }
}

namespace detail {

// ---------------------------------------------------------------------------
// CPU features
// ---------------------------------------------------------------------------

/// Highest isa_kind the CPU and the OS (XCR0 state enabled) support.
inline isa_kind probe_isa() noexcept {
#if WS_MOE_CPUX_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return isa_kind::scalar;
  const bool fma = (c >> 12) & 1u, osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u;
  if (!osxsave || !avx || !fma) return isa_kind::scalar;
  unsigned xlo = 0, xhi = 0;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  (void)xhi;
  const bool ymm_state = (xlo & 0x6u) == 0x6u;     // SSE + AVX state
  const bool zmm_state = (xlo & 0xe6u) == 0xe6u;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!ymm_state) return isa_kind::scalar;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return isa_kind::scalar;
  const bool avx2 = (b >> 5) & 1u, avx512f = (b >> 16) & 1u, avx512bw = (b >> 30) & 1u, avx512vl = (b >> 31) & 1u;
  if (!avx2) return isa_kind::scalar;
  if (!avx512f || !avx512bw || !zmm_state) return isa_kind::avx2;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && ((a1 >> 5) & 1u);
  return bf16 && avx512vl ? isa_kind::avx512bf16 : isa_kind::avx512;
#else
  return isa_kind::scalar;
#endif
}

/// WS_MOE_CPU_EXPERTS_ISA as a cap (unset or unknown: no cap).
inline isa_kind isa_cap_from_env() noexcept {
  const char* v = std::getenv("WS_MOE_CPU_EXPERTS_ISA");
  if (!v) return isa_kind::avx512bf16;
  const std::string_view s(v);
  if (s == "scalar") return isa_kind::scalar;
  if (s == "avx2") return isa_kind::avx2;
  if (s == "avx512") return isa_kind::avx512;
  return isa_kind::avx512bf16;
}

template <class Isa>
constexpr isa_kind kind_of() noexcept {
  if constexpr (std::is_same_v<Isa, isa::avx2>)
    return isa_kind::avx2;
  else if constexpr (std::is_same_v<Isa, isa::avx512>)
    return isa_kind::avx512;
  else if constexpr (std::is_same_v<Isa, isa::avx512bf16>)
    return isa_kind::avx512bf16;
  else
    return isa_kind::scalar;
}

// ---------------------------------------------------------------------------
// What the per-ISA kernels see (plain data: no vector types cross an ISA boundary)
// ---------------------------------------------------------------------------

/// One task as the kernels see it: its weights, its output, its packed activations.
struct task_ctx {
  const std::uint16_t* gate = nullptr;
  const std::uint16_t* up = nullptr;
  const std::uint16_t* down = nullptr;
  const float* x = nullptr;
  float* y = nullptr;
  void* xa = nullptr;   ///< packed X  [rows][hidden_pad], the kernel's element type and lane order
  void* act = nullptr;  ///< packed A  [rows][inter_pad]
  std::int64_t rows = 0;
};

struct shape_ctx {
  std::int64_t hidden = 0, inter = 0, hidden_pad = 0, inter_pad = 0;
  bool round_bf16 = false;  ///< round X and A to bf16 before the products
  bool prefetch = true;     ///< software-prefetch the next weight tile into L2 while streaming
};

/// Knobs for benchmarks (not part of the interface; the defaults are the tuned choice).
struct tuning_knobs {
  std::atomic<bool> prefetch{true};  ///< software prefetch of the next weight tile (decode streaming)
};
inline tuning_knobs& tuning() noexcept {
  static tuning_knobs t;
  return t;
}

/// One unit of parallel work: weight rows [n0, n1) of one pass × activation rows [m0, m1) of one task.
struct work_item {
  std::int64_t task, n0, n1, m0, m1;
};

/// The entry points of one ISA's kernels (function pointers: the driver is baseline code).
struct kernel_set {
  int chunk = 1;       ///< reduction elements per SIMD chunk: rows are padded to a multiple
  int a_bytes = 4;     ///< bytes per packed activation element
  /// Packs rows [m0, m1) of X into xa and zeroes the padding of those rows of act.
  void (*pack)(const task_ctx&, const shape_ctx&, std::int64_t m0, std::int64_t m1) = nullptr;
  /// The two passes over one work item; scratch: the calling thread's scratch_bytes(...) bytes, 64-byte aligned.
  void (*gate_up)(const task_ctx&, const shape_ctx&, const work_item&, void* scratch) = nullptr;
  void (*down)(const task_ctx&, const shape_ctx&, const work_item&, void* scratch) = nullptr;
  /// Per-thread scratch for items of at most block_rows activation rows and panel_rows weight rows.
  std::size_t (*scratch_bytes)(std::int64_t block_rows, std::int64_t panel_rows) = nullptr;
};

/// Rows per activation block of a batched task; tasks with at most `decode_rows` rows are one
/// block and one k-block (every weight row read once, whole); larger ones are k-blocked.
inline constexpr std::int64_t decode_rows = 16, batch_block_rows = 48;
/// Reduction elements per k-block of a batched task (a multiple of every ISA's chunk).
inline constexpr std::int64_t k_block_elems = 512;
/// Most weight rows per work item.
inline constexpr std::int64_t max_panel_rows = 32;

WS_MOE_CPUX_INLINE float silu(float g) { return g / (1.0f + std::exp(-g)); }
WS_MOE_CPUX_INLINE float bf16_round(float v) { return writescope::round_to_bf16(v); }
WS_MOE_CPUX_INLINE float bf16_widen(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------------------
// Per-ISA operation sets. Each `ops` says:
//   chunk      reduction elements per step (weights: one load of chunk bf16)
//   subs       sub-steps per chunk; a_sub packed activation elements per sub-step
//   mr_max     activation rows per register tile; nr(mr) weight rows per tile
//   a_pos(e)   where reduction element e of a row sits in the packed activation row
//   store_a    packs one (already rounded, if so) activation value
//   load_a     a_sub packed activations; load_b(p, s) sub-step s of chunk p
//   madd       acc += a · b (per lane, or per lane pair for vdpbf16ps); reduce: Σ lanes
// fp32 kernels use the even/odd widening of writescope/cpu/attention.hpp: a
// 32-bit lane holding two bf16 gives the even element as `u << 16` and the odd
// one as `u & 0xffff0000`, so activations are packed per chunk as [even
// elements | odd elements].
// ---------------------------------------------------------------------------

namespace k_scalar {
struct ops {
  using acc_t = float;
  using avec = float;
  using bvec = float;
  using a_elem = float;
  static constexpr int chunk = 2, subs = 2, a_sub = 1, mr_max = 4;
  static constexpr int nr(int) { return 4; }
  static constexpr std::int64_t a_pos(std::int64_t e) { return e; }
  static WS_MOE_CPUX_INLINE void store_a(a_elem* p, float v) { *p = v; }
  static WS_MOE_CPUX_INLINE acc_t zero() { return 0.0f; }
  static WS_MOE_CPUX_INLINE avec load_a(const a_elem* p) { return *p; }
  static WS_MOE_CPUX_INLINE bvec load_b(const std::uint16_t* p, int s) { return bf16_widen(p[s]); }
  static WS_MOE_CPUX_INLINE acc_t madd(acc_t c, avec a, bvec b) { return c + a * b; }
  static WS_MOE_CPUX_INLINE float reduce(acc_t c) { return c; }
};
}  // namespace k_scalar
}  // namespace detail
}  // namespace ws_moe::cpu

#define WS_MOE_CPU_EXPERTS_KERNEL_PASS k_scalar
#include "cpu_experts.hpp"
#undef WS_MOE_CPU_EXPERTS_KERNEL_PASS

#if WS_MOE_CPUX_X86
WS_MOE_CPUX_TARGET_PUSH("avx2,fma")
namespace ws_moe::cpu::detail::k_avx2 {
struct ops {
  using acc_t = __m256;
  using avec = __m256;
  using bvec = __m256;
  using a_elem = float;
  static constexpr int chunk = 16, subs = 2, a_sub = 8, mr_max = 3;
  static constexpr int nr(int mr) { return mr == 1 ? 8 : 4; }
  static constexpr std::int64_t a_pos(std::int64_t e) { return (e & ~std::int64_t(15)) + ((e & 1) << 3) + ((e & 15) >> 1); }
  static WS_MOE_CPUX_INLINE void store_a(a_elem* p, float v) { *p = v; }
  static WS_MOE_CPUX_INLINE acc_t zero() { return _mm256_setzero_ps(); }
  static WS_MOE_CPUX_INLINE avec load_a(const a_elem* p) { return _mm256_loadu_ps(p); }
  static WS_MOE_CPUX_INLINE bvec load_b(const std::uint16_t* p, int s) {
    const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return s == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(r, 16))
                  : _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u))));
  }
  static WS_MOE_CPUX_INLINE acc_t madd(acc_t c, avec a, bvec b) { return _mm256_fmadd_ps(a, b, c); }
  static WS_MOE_CPUX_INLINE float reduce(acc_t v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
}  // namespace ws_moe::cpu::detail::k_avx2
#define WS_MOE_CPU_EXPERTS_KERNEL_PASS k_avx2
#include "cpu_experts.hpp"
#undef WS_MOE_CPU_EXPERTS_KERNEL_PASS
WS_MOE_CPUX_TARGET_POP

WS_MOE_CPUX_TARGET_PUSH("avx512f,avx512bw,avx2,fma")
namespace ws_moe::cpu::detail::k_avx512 {
struct ops {
  using acc_t = __m512;
  using avec = __m512;
  using bvec = __m512;
  using a_elem = float;
  static constexpr int chunk = 32, subs = 2, a_sub = 16, mr_max = 6;
  static constexpr int nr(int mr) { return mr <= 2 ? 8 : mr <= 4 ? 6 : 4; }
  static constexpr std::int64_t a_pos(std::int64_t e) { return (e & ~std::int64_t(31)) + ((e & 1) << 4) + ((e & 31) >> 1); }
  static WS_MOE_CPUX_INLINE void store_a(a_elem* p, float v) { *p = v; }
  static WS_MOE_CPUX_INLINE acc_t zero() { return _mm512_setzero_ps(); }
  static WS_MOE_CPUX_INLINE avec load_a(const a_elem* p) { return _mm512_loadu_ps(p); }
  /// Even elements: one shift with the load folded in; odd ones: one zero-masked 16-bit load
  /// (no register for the raw chunk or a mask constant: the 6 × 4 tile needs 31 of the 32).
  static WS_MOE_CPUX_INLINE bvec load_b(const std::uint16_t* p, int s) {
    return s == 0 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16))
                  : _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(__mmask32(0xaaaaaaaau), p));
  }
  static WS_MOE_CPUX_INLINE acc_t madd(acc_t c, avec a, bvec b) { return _mm512_fmadd_ps(a, b, c); }
  static WS_MOE_CPUX_INLINE float reduce(acc_t v) { return _mm512_reduce_add_ps(v); }
};
}  // namespace ws_moe::cpu::detail::k_avx512
#define WS_MOE_CPU_EXPERTS_KERNEL_PASS k_avx512
#include "cpu_experts.hpp"
#undef WS_MOE_CPU_EXPERTS_KERNEL_PASS
WS_MOE_CPUX_TARGET_POP

WS_MOE_CPUX_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
namespace ws_moe::cpu::detail::k_avx512bf16 {
/// bf16_inputs only: X and A packed as bf16 bits in natural order; vdpbf16ps
/// multiplies 16 lane pairs and adds both products to the fp32 lane.
struct ops {
  using acc_t = __m512;
  using avec = __m512bh;
  using bvec = __m512bh;
  using a_elem = std::uint16_t;
  static constexpr int chunk = 32, subs = 1, a_sub = 32, mr_max = 6;
  static constexpr int nr(int mr) { return mr <= 2 ? 8 : mr <= 4 ? 6 : 4; }
  static constexpr std::int64_t a_pos(std::int64_t e) { return e; }
  static WS_MOE_CPUX_INLINE void store_a(a_elem* p, float v) { *p = writescope::bf16::from_float(v).bits; }
  static WS_MOE_CPUX_INLINE acc_t zero() { return _mm512_setzero_ps(); }
  static WS_MOE_CPUX_INLINE avec load_a(const a_elem* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static WS_MOE_CPUX_INLINE bvec load_b(const std::uint16_t* p, int) { return (__m512bh)_mm512_loadu_si512(p); }
  static WS_MOE_CPUX_INLINE acc_t madd(acc_t c, avec a, bvec b) { return _mm512_dpbf16_ps(c, a, b); }
  static WS_MOE_CPUX_INLINE float reduce(acc_t v) { return _mm512_reduce_add_ps(v); }
};
}  // namespace ws_moe::cpu::detail::k_avx512bf16
#define WS_MOE_CPU_EXPERTS_KERNEL_PASS k_avx512bf16
#include "cpu_experts.hpp"
#undef WS_MOE_CPU_EXPERTS_KERNEL_PASS
WS_MOE_CPUX_TARGET_POP
#endif  // WS_MOE_CPUX_X86

namespace ws_moe::cpu {
namespace detail {

template <class Isa>
inline const kernel_set& kernels_for(expert_precision prec) noexcept {
#if WS_MOE_CPUX_X86
  if constexpr (std::is_same_v<Isa, isa::avx2>) {
    return k_avx2::kernels();
  } else if constexpr (std::is_same_v<Isa, isa::avx512>) {
    return k_avx512::kernels();
  } else if constexpr (std::is_same_v<Isa, isa::avx512bf16>) {
    return prec == expert_precision::bf16_inputs ? k_avx512bf16::kernels() : k_avx512::kernels();
  } else {
    (void)prec;
    return k_scalar::kernels();
  }
#else
  (void)prec;
  return k_scalar::kernels();
#endif
}

/// Grow-only, 64-byte aligned scratch owned by one calling thread.
struct workspace {
  struct free_deleter {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<std::byte, free_deleter> mem;
  std::size_t bytes = 0;
  std::vector<task_ctx> tasks;
  std::vector<std::int64_t> order;
  std::vector<work_item> pack_items, gate_up_items, down_items;

  std::byte* reserve(std::size_t need) {
    if (need > bytes) {
      const std::size_t rounded = (need + 4095) / 4096 * 4096;
      std::byte* p = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
      if (!p) throw std::bad_alloc();
      mem.reset(p);
      bytes = rounded;
    }
    return mem.get();
  }
};

inline workspace& thread_workspace() {
  thread_local workspace ws;
  return ws;
}

inline std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }

inline void validate(std::span<const expert_task> tasks, expert_shape shape, int threads) {
  using writescope::config_error;
  const std::string fn = "ws_moe::cpu::run_experts: ";
  if (shape.hidden <= 0) throw config_error(fn + "hidden must be > 0, not " + std::to_string(shape.hidden));
  if (shape.inter <= 0) throw config_error(fn + "inter must be > 0, not " + std::to_string(shape.inter));
  if (threads < 0) throw config_error(fn + "threads must be >= 0 (0 = omp_get_max_threads()), not " + std::to_string(threads));
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const expert_task& t = tasks[i];
    const std::string at = fn + "task " + std::to_string(i) + ": ";
    if (t.rows < 0) throw config_error(at + "rows must be >= 0, not " + std::to_string(t.rows));
    if (t.rows == 0) continue;
    const char* null = !t.w.gate ? "w.gate" : !t.w.up ? "w.up" : !t.w.down ? "w.down" : !t.x ? "x" : !t.y ? "y" : nullptr;
    if (null) throw config_error(at + null + " is null with rows " + std::to_string(t.rows) + " > 0");
  }
}

inline std::int64_t row_blocks(std::int64_t rows) {
  return rows <= decode_rows ? 1 : (rows + batch_block_rows - 1) / batch_block_rows;
}

/// Weight rows per work item for a pass with `n` weight rows per task: about 8 items per
/// thread over the whole layer, between 4 and 32 rows.
inline std::int64_t panel_rows(std::int64_t n, std::int64_t units, int threads) {
  const std::int64_t want = std::max<std::int64_t>(1, units / (std::int64_t(8) * threads));
  return std::min(n, std::clamp<std::int64_t>(want, 4, max_panel_rows));
}

inline void make_items(std::vector<work_item>& out, const std::vector<std::int64_t>& order,
                       const std::vector<task_ctx>& tasks, std::int64_t n, int threads) {
  out.clear();
  std::int64_t units = 0;
  for (std::int64_t t : order) units += n * row_blocks(tasks[std::size_t(t)].rows);
  const std::int64_t nb = panel_rows(n, units, threads);
  for (std::int64_t t : order) {
    const std::int64_t rows = tasks[std::size_t(t)].rows;
    const std::int64_t blocks = row_blocks(rows);
    for (std::int64_t n0 = 0; n0 < n; n0 += nb)
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::int64_t m0 = rows * b / blocks, m1 = rows * (b + 1) / blocks;
        out.push_back(work_item{t, n0, std::min(n, n0 + nb), m0, m1});
      }
  }
}

inline int team_size(int threads) {
#if defined(_OPENMP)
  return threads > 0 ? threads : std::max(1, omp_get_max_threads());
#else
  (void)threads;
  return 1;
#endif
}

inline std::int64_t steady_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void spin_pause() noexcept {
#if WS_MOE_CPUX_X86
  __builtin_ia32_pause();
#endif
}

inline void run_with(const kernel_set& k, std::span<const expert_task> tasks, expert_shape shape,
                     expert_precision prec, int threads, const side_work* side = nullptr,
                     run_stats* stats = nullptr) {
  const std::int64_t t_entry = stats != nullptr ? steady_ns() : 0;
  const bool has_side = side != nullptr && side->fn != nullptr;
  validate(tasks, shape, threads);
  const int nt = team_size(threads);
  workspace& ws = thread_workspace();
  shape_ctx s;
  s.hidden = shape.hidden;
  s.inter = shape.inter;
  s.hidden_pad = round_up(shape.hidden, k.chunk);
  s.inter_pad = round_up(shape.inter, k.chunk);
  s.round_bf16 = prec == expert_precision::bf16_inputs;
  s.prefetch = tuning().prefetch.load(std::memory_order_relaxed);

  ws.tasks.clear();
  ws.order.clear();
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const expert_task& t = tasks[i];
    task_ctx c;
    c.gate = t.w.gate;
    c.up = t.w.up;
    c.down = t.w.down;
    c.x = t.x;
    c.y = t.y;
    c.rows = t.rows;
    ws.tasks.push_back(c);
    if (t.rows > 0) {
      ws.order.push_back(std::int64_t(i));
      bytes += std::size_t(t.rows * (s.hidden_pad + s.inter_pad) * k.a_bytes);
      bytes = (bytes + 63) / 64 * 64;
    }
  }
  if (ws.order.empty()) {
    if (has_side) {
      const std::int64_t t0 = stats != nullptr ? steady_ns() : 0;
      side->fn(side->ctx);
      if (stats != nullptr) stats->side_seconds = double(steady_ns() - t0) * 1e-9;
    }
    if (stats != nullptr) stats->total_seconds = double(steady_ns() - t_entry) * 1e-9;
    return;
  }
  const std::size_t scratch_per_thread = (k.scratch_bytes(batch_block_rows, max_panel_rows) + 63) / 64 * 64;
  const std::size_t scratch_off = bytes;
  bytes += scratch_per_thread * std::size_t(nt);
  std::byte* base = ws.reserve(bytes);
  std::size_t off = 0;
  for (std::int64_t i : ws.order) {
    task_ctx& c = ws.tasks[std::size_t(i)];
    c.xa = base + off;
    c.act = base + off + std::size_t(c.rows * s.hidden_pad * k.a_bytes);
    off += std::size_t(c.rows * (s.hidden_pad + s.inter_pad) * k.a_bytes);
    off = (off + 63) / 64 * 64;
  }
  // Busiest experts first (their items are the longest), ties in task order.
  std::stable_sort(ws.order.begin(), ws.order.end(), [&](std::int64_t a, std::int64_t b) {
    return ws.tasks[std::size_t(a)].rows > ws.tasks[std::size_t(b)].rows;
  });
  ws.pack_items.clear();
  for (std::int64_t t : ws.order) {
    const std::int64_t rows = ws.tasks[std::size_t(t)].rows;
    const std::int64_t step = std::max<std::int64_t>(1, 16384 / shape.hidden);
    for (std::int64_t m0 = 0; m0 < rows; m0 += step) ws.pack_items.push_back(work_item{t, 0, 0, m0, std::min(rows, m0 + step)});
  }
  make_items(ws.gate_up_items, ws.order, ws.tasks, shape.inter, nt);
  make_items(ws.down_items, ws.order, ws.tasks, shape.hidden, nt);

  const task_ctx* tc = ws.tasks.data();
  const work_item* pk = ws.pack_items.data();
  const work_item* gu = ws.gate_up_items.data();
  const work_item* dn = ws.down_items.data();
  const std::int64_t npk = std::int64_t(ws.pack_items.size()), ngu = std::int64_t(ws.gate_up_items.size()),
                     ndn = std::int64_t(ws.down_items.size());
  // With side work, thread 0 does it first; the packing is then dynamic and
  // followed by a count of packed items instead of a barrier, so that the
  // others go on to the products without thread 0. Every item computes the
  // same values whichever thread takes it: the results do not change.
  std::atomic<std::int64_t> packed{0}, last_in{0};
  std::int64_t t_region = 0, t_side0 = 0, t_side1 = 0;
  std::exception_ptr side_error;
#if defined(_OPENMP)
#  pragma omp parallel num_threads(nt)
#endif
  {
#if defined(_OPENMP)
    const std::size_t me = std::size_t(omp_get_thread_num());  // < nt: the team is never larger
#else
    const std::size_t me = 0;
#endif
    if (stats != nullptr) {
      const std::int64_t now = steady_ns();
      if (me == 0) t_region = now;
      std::int64_t seen = last_in.load(std::memory_order_relaxed);
      while (now > seen && !last_in.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
      }
    }
    void* scratch = base + scratch_off + me * scratch_per_thread;
    if (has_side) {
      if (me == 0) {
        t_side0 = stats != nullptr ? steady_ns() : 0;
        try {
          side->fn(side->ctx);
        } catch (...) {
          side_error = std::current_exception();
        }
        t_side1 = stats != nullptr ? steady_ns() : 0;
      }
#if defined(_OPENMP)
#  pragma omp for schedule(dynamic, 1) nowait
#endif
      for (std::int64_t i = 0; i < npk; ++i) {
        k.pack(tc[pk[i].task], s, pk[i].m0, pk[i].m1);
        packed.fetch_add(1, std::memory_order_release);
      }
      while (packed.load(std::memory_order_acquire) < npk) spin_pause();
    } else {
#if defined(_OPENMP)
#  pragma omp for schedule(static)
#endif
      for (std::int64_t i = 0; i < npk; ++i) k.pack(tc[pk[i].task], s, pk[i].m0, pk[i].m1);
    }
#if defined(_OPENMP)
#  pragma omp for schedule(dynamic, 1)
#endif
    for (std::int64_t i = 0; i < ngu; ++i) k.gate_up(tc[gu[i].task], s, gu[i], scratch);
#if defined(_OPENMP)
#  pragma omp for schedule(dynamic, 1)
#endif
    for (std::int64_t i = 0; i < ndn; ++i) k.down(tc[dn[i].task], s, dn[i], scratch);
  }
  if (stats != nullptr) {
    stats->setup_seconds = double(t_region - t_entry) * 1e-9;
    stats->wake_seconds = double(last_in.load(std::memory_order_relaxed) - t_region) * 1e-9;
    stats->side_seconds = has_side ? double(t_side1 - t_side0) * 1e-9 : 0.0;
    stats->total_seconds = double(steady_ns() - t_entry) * 1e-9;
  }
  if (side_error) std::rethrow_exception(side_error);
}

}  // namespace detail

/// Whether this CPU (and OS) can run the kernels of `Isa`.
template <class Isa>
[[nodiscard]] inline bool isa_supported() noexcept {
  static const isa_kind hw = detail::probe_isa();
  return static_cast<int>(detail::kind_of<Isa>()) <= static_cast<int>(hw);
}

/// The ISA the dispatching run_experts uses: the best this CPU and OS support, capped by
/// WS_MOE_CPU_EXPERTS_ISA. Probed once; never throws.
[[nodiscard]] inline isa_kind best_isa() noexcept {
  static const isa_kind k = [] {
    const isa_kind hw = detail::probe_isa(), cap = detail::isa_cap_from_env();
    return static_cast<int>(cap) < static_cast<int>(hw) ? cap : hw;
  }();
  return k;
}

/// Frees the calling thread's workspace (the next call allocates it again).
inline void release_thread_workspace() noexcept {
  detail::workspace& ws = detail::thread_workspace();
  ws.mem.reset();
  ws.bytes = 0;
  ws.tasks = {};
  ws.order = {};
  ws.pack_items = {};
  ws.gate_up_items = {};
  ws.down_items = {};
}

/// Runs a MoE layer's host experts (all tasks) with the kernels of `Isa` on the calling
/// thread's OpenMP team of `threads` threads (0 = omp_get_max_threads()); see the file
/// comment for the algorithm, threads, memory and errors. Also throws config_error when
/// this CPU cannot run `Isa` (isa_supported<Isa>()).
/// With `side` (may be null): its work on the calling thread inside the region (side_work);
/// with `stats` (may be null): the call's host seconds (run_stats).
template <class Isa>
inline void run_experts(std::span<const expert_task> tasks, expert_shape shape, expert_precision prec, int threads,
                        const side_work* side = nullptr, run_stats* stats = nullptr) {
  if (!isa_supported<Isa>())
    throw writescope::config_error(std::string("ws_moe::cpu::run_experts: this CPU does not support the ") +
                                   std::string(Isa::name) + " kernels (best here: " + std::string(isa_name(detail::probe_isa())) + ")");
  detail::run_with(detail::kernels_for<Isa>(prec), tasks, shape, prec, threads, side, stats);
}

/// Runs a MoE layer's host experts (all tasks) on the calling thread's OpenMP team of `threads`
/// threads (0 = omp_get_max_threads()) with the kernels of best_isa(); every weight byte is read
/// once per call; work is split across all tasks' output rows so one busy expert does not
/// serialise the layer. Thread-safe for distinct outputs; blocking; no allocation in steady
/// state (thread_local workspace). Throws writescope::config_error for bad shapes (hidden or
/// inter <= 0, null pointers with rows > 0, negative rows, negative threads), naming the value.
/// `side` and `stats` (may be null): as for run_experts<Isa>.
inline void run_experts(std::span<const expert_task> tasks, expert_shape shape, expert_precision prec, int threads,
                        const side_work* side = nullptr, run_stats* stats = nullptr) {
  switch (best_isa()) {
    case isa_kind::avx512bf16: return run_experts<isa::avx512bf16>(tasks, shape, prec, threads, side, stats);
    case isa_kind::avx512: return run_experts<isa::avx512>(tasks, shape, prec, threads, side, stats);
    case isa_kind::avx2: return run_experts<isa::avx2>(tasks, shape, prec, threads, side, stats);
    default: return run_experts<isa::scalar>(tasks, shape, prec, threads, side, stats);
  }
}

}  // namespace ws_moe::cpu

#endif  // WS_MOE_CPU_EXPERTS_HPP
#else   // WS_MOE_CPU_EXPERTS_KERNEL_PASS
// ---------------------------------------------------------------------------
// Kernel pass: the generic kernels over `ops`, compiled once per ISA inside
// that ISA's target region (see the file comment).
// ---------------------------------------------------------------------------
namespace ws_moe::cpu::detail::WS_MOE_CPU_EXPERTS_KERNEL_PASS {

using a_elem = ops::a_elem;
using acc_t = ops::acc_t;

/// One chunk step of an MR × NR register tile: a at the chunk's first packed element of row 0,
/// b[j] at the chunk's first bf16 of weight row j.
template <int MR, int NR>
WS_MOE_CPUX_INLINE void tile_step(acc_t (&acc)[MR][NR], const a_elem* a, std::int64_t a_stride,
                                  const std::uint16_t* const (&b)[NR]) {
  WS_MOE_CPUX_UNROLL
  for (int s = 0; s < ops::subs; ++s) {
    ops::avec av[MR];
    WS_MOE_CPUX_UNROLL
    for (int r = 0; r < MR; ++r) av[r] = ops::load_a(a + r * a_stride + s * ops::a_sub);
    WS_MOE_CPUX_UNROLL
    for (int j = 0; j < NR; ++j) {
      const ops::bvec bv = ops::load_b(b[j], s);
      WS_MOE_CPUX_UNROLL
      for (int r = 0; r < MR; ++r) acc[r][j] = ops::madd(acc[r][j], av[r], bv);
    }
  }
}

/// The register tile over reduction elements [e0, e1) of k: MR packed activation rows (stride
/// a_stride elements, a at row 0's element 0) against NR bf16 weight rows w[j] (k elements each;
/// read exactly, never past k: the last chunk of a row whose length is not a multiple of the
/// chunk is copied into a zeroed buffer). e0 is a multiple of the chunk, and so is e1 unless e1 = k.
/// first: start from zero, else from the unreduced accumulators in `part`; last: reduce into
/// `out`, else store the accumulators to `part`. pf (nullable): NR rows to prefetch into L2 at the
/// same offsets (the next tile's rows).
template <int MR, int NR>
WS_MOE_CPUX_NOINLINE void tile_block(acc_t* part, bool first, bool last, const a_elem* a, std::int64_t a_stride,
                                     const std::uint16_t* const (&w)[NR], const std::uint16_t* const* pf,
                                     std::int64_t e0, std::int64_t e1, std::int64_t k, float (&out)[MR][NR]) {
  acc_t acc[MR][NR];
  WS_MOE_CPUX_UNROLL
  for (int r = 0; r < MR; ++r) {
    WS_MOE_CPUX_UNROLL
    for (int j = 0; j < NR; ++j) acc[r][j] = first ? ops::zero() : part[r * NR + j];
  }
  const std::int64_t full_end = e1 == k ? k / ops::chunk * ops::chunk : e1;
  constexpr std::int64_t pf_every = ops::chunk >= 32 ? 1 : 32 / ops::chunk;  // one 64-byte line per row
  std::int64_t step = 0;
  for (std::int64_t e = e0; e < full_end; e += ops::chunk, ++step) {
    const std::uint16_t* b[NR];
    WS_MOE_CPUX_UNROLL
    for (int j = 0; j < NR; ++j) b[j] = w[j] + e;
    if (pf && step % pf_every == 0) {
      WS_MOE_CPUX_UNROLL
      for (int j = 0; j < NR; ++j) __builtin_prefetch(pf[j] + e, 0, 2);
    }
    tile_step<MR, NR>(acc, a + e, a_stride, b);
  }
  if (full_end < e1) {
    const std::int64_t rem = e1 - full_end;
    alignas(64) std::uint16_t tail[NR][ops::chunk];
    const std::uint16_t* b[NR];
    for (int j = 0; j < NR; ++j) {
      std::memset(tail[j], 0, sizeof tail[j]);
      std::memcpy(tail[j], w[j] + full_end, std::size_t(rem) * 2);
      b[j] = tail[j];
    }
    tile_step<MR, NR>(acc, a + full_end, a_stride, b);
  }
  if (last) {
    WS_MOE_CPUX_UNROLL
    for (int r = 0; r < MR; ++r) {
      WS_MOE_CPUX_UNROLL
      for (int j = 0; j < NR; ++j) out[r][j] = ops::reduce(acc[r][j]);
    }
  } else {
    WS_MOE_CPUX_UNROLL
    for (int r = 0; r < MR; ++r) {
      WS_MOE_CPUX_UNROLL
      for (int j = 0; j < NR; ++j) part[r * NR + j] = acc[r][j];
    }
  }
}

/// out[r][j] = Σ_e A[r][e] · w_j[e] over all k (one block, no partial accumulators).
template <int MR, int NR>
inline void tile(const a_elem* a, std::int64_t a_stride, const std::uint16_t* const (&w)[NR], std::int64_t k,
                 float (&out)[MR][NR]) {
  tile_block<MR, NR>(nullptr, true, true, a, a_stride, w, nullptr, 0, k, k, out);
}

inline void pack(const task_ctx& t, const shape_ctx& s, std::int64_t m0, std::int64_t m1) {
  a_elem* xa = static_cast<a_elem*>(t.xa);
  a_elem* act = static_cast<a_elem*>(t.act);
  for (std::int64_t m = m0; m < m1; ++m) {
    const float* x = t.x + m * s.hidden;
    a_elem* d = xa + m * s.hidden_pad;
    std::memset(static_cast<void*>(d), 0, std::size_t(s.hidden_pad) * sizeof(a_elem));
    if (s.round_bf16)
      for (std::int64_t e = 0; e < s.hidden; ++e) ops::store_a(d + ops::a_pos(e), bf16_round(x[e]));
    else
      for (std::int64_t e = 0; e < s.hidden; ++e) ops::store_a(d + ops::a_pos(e), x[e]);
    a_elem* ar = act + m * s.inter_pad;
    for (std::int64_t e = s.inter; e < s.inter_pad; ++e) ops::store_a(ar + ops::a_pos(e), 0.0f);
  }
}

/// One row block's pass over a work item's k-block: what the gate/up and down passes share.
struct block_args {
  const task_ctx* t;
  const shape_ctx* s;
  std::int64_t n0, n1;   ///< weight rows of the item
  std::int64_t m;        ///< first activation row of the block
  std::int64_t e0, e1;   ///< reduction elements of this k-block
  bool first, last, prefetch;
  acc_t* part;           ///< this row block's unreduced accumulators (k-blocked items)
};

template <int MR>
struct gate_up_rows {
  static void run(const block_args& b) {
    constexpr int NR = std::max(2, ops::nr(MR) / 2 * 2), HN = NR / 2;
    const task_ctx& t = *b.t;
    const shape_ctx& s = *b.s;
    const a_elem* a = static_cast<const a_elem*>(t.xa) + b.m * s.hidden_pad;
    a_elem* act = static_cast<a_elem*>(t.act) + b.m * s.inter_pad;
    acc_t* part = b.part;
    for (std::int64_t n = b.n0; n < b.n1; n += HN, part += MR * NR) {
      const std::uint16_t* w[NR];
      const std::uint16_t* pf[NR];
      for (int j = 0; j < HN; ++j) {
        const std::int64_t i = std::min(n + j, b.n1 - 1);  // a short last tile repeats its last row
        const std::int64_t ip = std::min(n + HN + j, b.n1 - 1);
        w[j] = t.gate + i * s.hidden;
        w[HN + j] = t.up + i * s.hidden;
        pf[j] = t.gate + ip * s.hidden;
        pf[HN + j] = t.up + ip * s.hidden;
      }
      float out[MR][NR];
      tile_block<MR, NR>(part, b.first, b.last, a, s.hidden_pad, w, b.prefetch && n + HN < b.n1 ? pf : nullptr, b.e0,
                         b.e1, s.hidden, out);
      if (!b.last) continue;
      const int valid = int(std::min<std::int64_t>(HN, b.n1 - n));
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < valid; ++j) {
          float v = silu(out[r][j]) * out[r][HN + j];
          if (s.round_bf16) v = bf16_round(v);
          ops::store_a(act + r * s.inter_pad + ops::a_pos(n + j), v);
        }
    }
  }
};

template <int MR>
struct down_rows {
  static void run(const block_args& b) {
    constexpr int NR = ops::nr(MR);
    const task_ctx& t = *b.t;
    const shape_ctx& s = *b.s;
    const a_elem* a = static_cast<const a_elem*>(t.act) + b.m * s.inter_pad;
    float* y = t.y + b.m * s.hidden;
    acc_t* part = b.part;
    for (std::int64_t n = b.n0; n < b.n1; n += NR, part += MR * NR) {
      const std::uint16_t* w[NR];
      const std::uint16_t* pf[NR];
      for (int j = 0; j < NR; ++j) {
        w[j] = t.down + std::min(n + j, b.n1 - 1) * s.inter;
        pf[j] = t.down + std::min(n + NR + j, b.n1 - 1) * s.inter;
      }
      float out[MR][NR];
      tile_block<MR, NR>(part, b.first, b.last, a, s.inter_pad, w, b.prefetch && n + NR < b.n1 ? pf : nullptr, b.e0,
                         b.e1, s.inter, out);
      if (!b.last) continue;
      const int valid = int(std::min<std::int64_t>(NR, b.n1 - n));
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < valid; ++j) y[r * s.hidden + n + j] = out[r][j];
    }
  }
};

template <template <int> class Rows>
inline void dispatch_rows(int mr, const block_args& b) {
  switch (mr) {
    case 1: Rows<1>::run(b); break;
    case 2: if constexpr (ops::mr_max >= 2) Rows<2>::run(b); break;
    case 3: if constexpr (ops::mr_max >= 3) Rows<3>::run(b); break;
    case 4: if constexpr (ops::mr_max >= 4) Rows<4>::run(b); break;
    case 5: if constexpr (ops::mr_max >= 5) Rows<5>::run(b); break;
    case 6: if constexpr (ops::mr_max >= 6) Rows<6>::run(b); break;
    case 7: if constexpr (ops::mr_max >= 7) Rows<7>::run(b); break;
    case 8: if constexpr (ops::mr_max >= 8) Rows<8>::run(b); break;
    default: break;
  }
}

/// Unreduced accumulators one row block of a k-blocked item needs (acc_t units): one MR × NR
/// tile per weight-row tile of the panel (gate and up rows count twice).
constexpr std::int64_t part_per_row_block(std::int64_t panel_rows) { return (2 * panel_rows + 16) * ops::mr_max; }

/// One work item: k-blocks outermost (batched tasks; one block for decode-sized tasks), then
/// row blocks of mr_max rows, then the weight-row tiles of the panel. The first row block of
/// each k-block streams the weights (prefetching the next tile); the others find them in cache.
template <template <int> class Rows>
inline void run_item(const task_ctx& t, const shape_ctx& s, const work_item& it, std::int64_t k, void* scratch) {
  const std::int64_t kc = t.rows > decode_rows ? k_block_elems : k;
  const std::int64_t stride = part_per_row_block(it.n1 - it.n0);
  for (std::int64_t e0 = 0; e0 < k; e0 += kc) {
    block_args b{&t, &s, it.n0, it.n1, 0, e0, std::min(k, e0 + kc), e0 == 0, e0 + kc >= k, true, nullptr};
    std::int64_t rb = 0;
    for (std::int64_t m = it.m0; m < it.m1; m += ops::mr_max, ++rb) {
      b.m = m;
      b.prefetch = s.prefetch && m == it.m0;
      b.part = kc < k ? static_cast<acc_t*>(scratch) + rb * stride : nullptr;
      dispatch_rows<Rows>(int(std::min<std::int64_t>(ops::mr_max, it.m1 - m)), b);
    }
  }
}

inline void gate_up(const task_ctx& t, const shape_ctx& s, const work_item& it, void* scratch) {
  run_item<gate_up_rows>(t, s, it, s.hidden, scratch);
}
inline void down(const task_ctx& t, const shape_ctx& s, const work_item& it, void* scratch) {
  run_item<down_rows>(t, s, it, s.inter, scratch);
}

/// Scratch bytes one thread needs for k-blocked items of at most `block_rows` rows and `panel_rows` weight rows.
constexpr std::size_t scratch_bytes(std::int64_t block_rows, std::int64_t panel_rows) {
  return std::size_t((block_rows / ops::mr_max + 2) * part_per_row_block(panel_rows)) * sizeof(acc_t);
}

inline const kernel_set& kernels() noexcept {
  static const kernel_set k{ops::chunk, int(sizeof(a_elem)), &pack, &gate_up, &down, &scratch_bytes};
  return k;
}

}  // namespace ws_moe::cpu::detail::WS_MOE_CPU_EXPERTS_KERNEL_PASS
#endif  // WS_MOE_CPU_EXPERTS_KERNEL_PASS
