// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/kernels_resident.cuh — split-K decode attention over the
// HBM-resident region on tensor cores (docs/CUDA-ENGINE.md, "The resident
// kernel"): launch_resident_attend (per-item partials) and
// launch_resident_fold (the in-order fold of each sequence's partials into its
// running state). nvcc only; kernels.cuh includes it, so either header gives
// it. Instantiated per layout by WS_CUDA_INSTANTIATE_RESIDENT(Layout), which
// WS_CUDA_INSTANTIATE(Layout) includes. The engine calls them only with
// basic_cuda_backend::set_resident_kernel on (experimental; off by default).
//
// Design. One CTA of 4 warps per (item, KV head, 16 query heads). The query
// heads are the M = 16 rows of mma.sync.m16n8k16 (bf16 in, fp32 accumulate);
// GQA groups under 16 are padded with zero queries whose rows are discarded.
// Tokens stream through shared memory in tiles of `tile` rows with a
// `stages`-deep cp.async pipeline (16-byte copies; rows past the item's end
// are zero-filled, never read from global memory).
//   S = Q·Kᵀ: the q_dim reduction is split over the warps (each warp holds its
//     slice of Q as A fragments in registers) and the four partial score
//     fragments are summed through shared memory in warp order, so every warp
//     ends with the same full 16 × tile score block.
//   Online softmax on the accumulator fragments (rows spread over lane quads:
//     quad shuffles), natural-base expf/logf, running max from -inf; every warp
//     computes it identically.
//   O += P·V: the v_dim columns are split over the warps; P's fragments are the
//     score accumulators re-packed as A fragments (no shared-memory round
//     trip); V fragments come from the tile by ldmatrix.trans (MLA: V is the
//     first v_dim columns of the same K tile).
// Accuracy: the queries (pre-scaled, fp32) and the probabilities are each
// split into bf16 hi + bf16 lo = x to ~2^-17 relative, and both halves are
// multiplied (two mmas); K and V are bf16 in memory, so every product is exact
// in fp32 and the result matches an fp32 CUDA-core kernel to a few fp32 ulps
// of accumulation order.
// Determinism: fixed reduction orders everywhere (warp-order score sums, quad
// butterflies, mma accumulation order); a partial depends only on its item.
#pragma once

#if !defined(__CUDACC__)
#  error "writescope/cuda/kernels_resident.cuh must be compiled by nvcc; host code includes kernels.hpp"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../layout.hpp"
#include "../partial_state.hpp"
#include "cuda_error.hpp"
#include "kernels.cuh"  // imin, merge_into (kernels.cuh includes this file at its end)
#include "kernels.hpp"

namespace writescope::gpu::detail {

// -----------------------------------------------------------------------------
// PTX wrappers (sm_80+)
// -----------------------------------------------------------------------------

// cp.async: cp_async16 / cp_async_commit / cp_async_wait (kernels.cuh).

/// Four 8×8 b16 matrices from shared memory; lane l gives the address of row
/// l % 8 of matrix l / 8. Plain (B fragments of a [n][k] tile) or transposed
/// (B fragments of a [k][n] tile).
__device__ __forceinline__ void res_ldsm_x4(unsigned (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void res_ldsm_x4_trans(unsigned (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

/// c += a·b, m16n8k16, bf16 inputs, fp32 accumulators. Fragments (g = lane/4,
/// t = lane%4): a0 (row g, k 2t..2t+1), a1 (row g+8), a2 (row g, k 2t+8..),
/// a3 (row g+8, k 2t+8..); b0 (k 2t..2t+1, col g), b1 (k 2t+8..); c0, c1
/// (row g, cols 2t, 2t+1), c2, c3 (row g+8). The low half of a register holds
/// the lower k (or column) index.
__device__ __forceinline__ void res_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// (x, y) -> bf16 pairs hi = rn(x, y), lo = rn(x - hi, y - hi): hi + lo equals
/// (x, y) to ~2^-17 relative. x goes to the low half.
__device__ __forceinline__ void res_split2(float x, float y, unsigned& hi, unsigned& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x - hf.x, y - hf.y);
  hi = (unsigned(__bfloat16_as_ushort(h.y)) << 16) | unsigned(__bfloat16_as_ushort(h.x));
  lo = (unsigned(__bfloat16_as_ushort(l.y)) << 16) | unsigned(__bfloat16_as_ushort(l.x));
}

// -----------------------------------------------------------------------------
// Configuration
// -----------------------------------------------------------------------------

/// Tile and pipeline shape of the resident kernel for layout L (the knobs to
/// tune on the GPU: tile, stages, min_ctas).
template <class L>
struct resident_cfg {
  static constexpr int threads = resident_attend_threads;
  static constexpr int warps = threads / 32;
  static constexpr int heads = 16;                       ///< query heads per CTA: the mma M
  static constexpr int tile = 32;                        ///< tokens per pipeline stage
  static constexpr int stages = L::is_mla ? 2 : 3;       ///< cp.async pipeline depth
  static constexpr int min_ctas = L::is_mla ? 2 : 3;     ///< __launch_bounds__ residency target
  static constexpr bool shared_kv = L::is_mla;           ///< V = first v_dim elements of the K row
  static constexpr int R = L::row_elems;
  static constexpr int V = L::v_dim;
  static constexpr int RP = R + 8;                       ///< padded smem row (bf16): ldmatrix rows hit distinct banks
  static constexpr int RC = R / 8;                       ///< 16-byte chunks per row
  static constexpr int KS = R / 16;                      ///< k-steps of Q·Kᵀ
  static constexpr int KPW = (KS + warps - 1) / warps;   ///< k-steps per warp
  static constexpr int NT = tile / 8;                    ///< score n-tiles (8 tokens each)
  static constexpr int VW = V / warps;                   ///< output columns per warp
  static constexpr int NTV = VW / 8;                     ///< output n-tiles per warp
  static constexpr int planes_in_smem = shared_kv ? 1 : 2;
  static constexpr unsigned tile_bytes = unsigned(sizeof(std::uint16_t)) * tile * RP;  ///< one plane, one stage
  static constexpr unsigned kv_bytes = tile_bytes * planes_in_smem * stages;
  static constexpr unsigned red_off = kv_bytes;
  static constexpr unsigned red_bytes = unsigned(sizeof(float)) * 4 * warps * NT * 32;  ///< score partials
  static constexpr unsigned smem_bytes = red_off + red_bytes;
  static constexpr int copies = tile * RC;               ///< 16-byte copies per plane and tile
  static constexpr int copies_per_thread = (copies + threads - 1) / threads;

  static_assert(L::q_dim == R, "resident: a query head is as wide as a key row");
  static_assert(R % 16 == 0 && V % 16 == 0 && V <= R, "resident: rows must be whole mma k-steps");
  static_assert(tile % 16 == 0 && stages >= 2, "resident: tiles are whole k-steps of P·V; two stages at least");
  static_assert(V % (16 * warps) == 0, "resident: v_dim must split into n-tile pairs per warp");
  static_assert(tile_bytes % 16 == 0 && (RP * 2) % 16 == 0, "resident: smem rows must be 16-byte aligned");
  static_assert(smem_bytes <= 227u * 1024u, "resident: shared memory over the sm_90 per-CTA limit");
};

// -----------------------------------------------------------------------------
// Attention
// -----------------------------------------------------------------------------

template <class L>
__global__ void __launch_bounds__(resident_attend_threads, resident_cfg<L>::min_ctas)
    resident_attend_kernel(const __grid_constant__ resident_attend_params p) {
  using C = resident_cfg<L>;
  extern __shared__ __align__(16) unsigned char res_smem[];
  std::uint16_t* kt = reinterpret_cast<std::uint16_t*>(res_smem);  // [stages][tile][RP]
  std::uint16_t* vt = C::shared_kv ? kt : kt + C::stages * C::tile * C::RP;
  float4* red = reinterpret_cast<float4*>(res_smem + C::red_off);  // [warps][NT][32 lanes]

  const resident_item it = p.items[blockIdx.x];
  const int kvh = int(blockIdx.y);
  const int g0 = int(blockIdx.z) * C::heads;
  const int gc = imin(C::heads, p.group - g0);  // real heads of this CTA
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int gr = lane >> 2;  // fragment row (head) g; the other row is g + 8
  const int tq = lane & 3;   // fragment column pair
  const int tokens = it.tokens < 0 ? 0 : it.tokens;
  const int bt = p.block_tokens;
  const int bt_shift = (bt & (bt - 1)) == 0 ? __ffs(bt) - 1 : -1;

  const int rt = p.run_tokens;
  const int rt_shift = (rt & (rt - 1)) == 0 ? __ffs(rt) - 1 : -1;
  // the KV head's key and value rows inside a block (the same in every block)
  const index_t koff = block_format<L>::offset_in(p.hkv, bt, L::key_plane, kvh, 0, 0);
  const index_t voff = block_format<L>::offset_in(p.hkv, bt, L::value_plane, kvh, 0, 0);

  // Issue the copies of tile `t` (tokens [t*tile, ...)) into stage `st`.
  auto load_tile = [&](int t, int st) {
    const int t0 = t * C::tile;
    const int n = imin(C::tile, tokens - t0);
    std::uint16_t* kd = kt + st * C::tile * C::RP;
    std::uint16_t* vd = vt + st * C::tile * C::RP;
#pragma unroll
    for (int k = 0; k < C::copies_per_thread; ++k) {
      const int i = tid + k * C::threads;
      if (C::copies % C::threads == 0 || i < C::copies) {
        const int r = i / C::RC;
        const int c = i - r * C::RC;
        const bool valid = r < n;
        // rows past the item's end read nothing (size 0) from a valid address
        const std::uint16_t* ksrc = reinterpret_cast<const std::uint16_t*>(p.q);
        const std::uint16_t* vsrc = ksrc;
        if (valid) {
          const int tok = t0 + r;
          const int run = rt_shift >= 0 ? tok >> rt_shift : tok / rt;
          const int in_run = tok - run * rt;
          const int blk = bt_shift >= 0 ? in_run >> bt_shift : in_run / bt;
          const auto* run_base = reinterpret_cast<const std::uint16_t*>(
              __ldg(reinterpret_cast<const unsigned long long*>(it.runs) + run));
          const index_t off = index_t(blk) * p.block_elems + index_t(in_run - blk * bt) * C::R + c * 8;
          ksrc = run_base + koff + off;
          vsrc = run_base + voff + off;
        }
        cp_async16(kd + r * C::RP + c * 8, ksrc, valid ? 16 : 0);
        if constexpr (!C::shared_kv) cp_async16(vd + r * C::RP + c * 8, vsrc, valid ? 16 : 0);
      }
    }
  };

  const int num_tiles = (tokens + C::tile - 1) / C::tile;
  // Prologue: the first stages - 1 tiles in flight (one commit group each,
  // empty past the end, so that the group count stays uniform).
#pragma unroll
  for (int s = 0; s < C::stages - 1; ++s) {
    if (s < num_tiles) load_tile(s, s);
    cp_async_commit();
  }

  // This warp's slice of the pre-scaled queries as A fragments, hi and lo.
  // Rows past the CTA's heads are zero (their scores are 0, never NaN).
  unsigned qhi[C::KPW][4];
  unsigned qlo[C::KPW][4];
  {
    const index_t qrow0 = index_t(it.q_seq) * p.hq + index_t(kvh) * p.group + g0;
#pragma unroll
    for (int kk = 0; kk < C::KPW; ++kk) {
      const int ks = warp * C::KPW + kk;
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // a0/a1: row g / g+8, cols 2t; a2/a3: cols 2t+8
        const int row = gr + 8 * h;
        float2 k0 = make_float2(0.0f, 0.0f);  // k 2t, 2t+1 of the k-step
        float2 k8 = make_float2(0.0f, 0.0f);  // k 2t+8, 2t+9
        if (ks < C::KS && row < gc) {
          const float* qr = p.q + (qrow0 + row) * C::R + ks * 16 + 2 * tq;
          k0 = *reinterpret_cast<const float2*>(qr);
          k8 = *reinterpret_cast<const float2*>(qr + 8);
          k0.x *= p.scale;
          k0.y *= p.scale;
          k8.x *= p.scale;
          k8.y *= p.scale;
        }
        res_split2(k0.x, k0.y, qhi[kk][h], qlo[kk][h]);
        res_split2(k8.x, k8.y, qhi[kk][2 + h], qlo[kk][2 + h]);
      }
    }
  }

  float m[2] = {-INFINITY, -INFINITY};  // running max of rows g, g+8 (same in every warp)
  float l[2] = {0.0f, 0.0f};            // running sum
  float acc[C::NTV][4];                 // O, this warp's columns [warp*VW, +VW)
#pragma unroll
  for (int j = 0; j < C::NTV; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

  const int mi = lane >> 3;  // ldmatrix: this lane addresses row (lane & 7) of matrix mi
  const int mr = lane & 7;

  for (int t = 0; t < num_tiles; ++t) {
    cp_async_wait<C::stages - 2>();  // this thread's copies of tile t have landed
    __syncthreads();                     // everyone's have; tile t-1's stage and the score buffer are free
    if (t + C::stages - 1 < num_tiles) load_tile(t + C::stages - 1, (t + C::stages - 1) % C::stages);
    cp_async_commit();

    const int st = t % C::stages;
    const std::uint16_t* ks_t = kt + st * C::tile * C::RP;
    const std::uint16_t* vs_t = vt + st * C::tile * C::RP;
    const int n = imin(C::tile, tokens - t * C::tile);

    // 1. Partial scores over this warp's k-steps, all tile tokens.
    float s[C::NT][4];
#pragma unroll
    for (int j = 0; j < C::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < C::KPW; ++kk) {
      const int ks = warp * C::KPW + kk;
      if (C::KS % C::warps == 0 || ks < C::KS) {
#pragma unroll
        for (int jp = 0; jp < C::NT / 2; ++jp) {
          unsigned b[4];  // b0, b1 of n-tile 2jp, then of 2jp+1
          res_ldsm_x4(b, ks_t + (16 * jp + 8 * (mi >> 1) + mr) * C::RP + ks * 16 + 8 * (mi & 1));
          res_mma(s[2 * jp], qhi[kk], b[0], b[1]);
          res_mma(s[2 * jp], qlo[kk], b[0], b[1]);
          res_mma(s[2 * jp + 1], qhi[kk], b[2], b[3]);
          res_mma(s[2 * jp + 1], qlo[kk], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < C::NT; ++j) red[(warp * C::NT + j) * 32 + lane] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
    __syncthreads();
    // Full scores: the warps' partials summed in warp order (identical in every warp).
#pragma unroll
    for (int j = 0; j < C::NT; ++j) {
      float4 a = red[j * 32 + lane];
#pragma unroll
      for (int w = 1; w < C::warps; ++w) {
        const float4 b = red[(w * C::NT + j) * 32 + lane];
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
      }
      s[j][0] = a.x;
      s[j][1] = a.y;
      s[j][2] = a.z;
      s[j][3] = a.w;
    }

    // 2. Online softmax of rows g (e = 0, 1) and g+8 (e = 2, 3); masked tokens -inf.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < C::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * tq + (e & 1);
        if (col >= n) s[j][e] = -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_new = fmaxf(m[h], mx[h]);  // finite: n >= 1
      alpha[h] = m[h] == -INFINITY ? 0.0f : expf(m[h] - m_new);
      m[h] = m_new;
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < C::NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = s[j][e] == -INFINITY ? 0.0f : expf(s[j][e] - m[e >> 1]);
        s[j][e] = pv;
        rs[e >> 1] += pv;
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rs[h] += __shfl_xor_sync(0xffffffffu, rs[h], 1);
      rs[h] += __shfl_xor_sync(0xffffffffu, rs[h], 2);
      l[h] = l[h] * alpha[h] + rs[h];
    }
#pragma unroll
    for (int j = 0; j < C::NTV; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1];
      acc[j][3] *= alpha[1];
    }

    // 3. O += P·V over this warp's columns; P from the score fragments, hi + lo.
#pragma unroll
    for (int kk = 0; kk < C::tile / 16; ++kk) {
      unsigned phi[4], plo[4];
      res_split2(s[2 * kk][0], s[2 * kk][1], phi[0], plo[0]);
      res_split2(s[2 * kk][2], s[2 * kk][3], phi[1], plo[1]);
      res_split2(s[2 * kk + 1][0], s[2 * kk + 1][1], phi[2], plo[2]);
      res_split2(s[2 * kk + 1][2], s[2 * kk + 1][3], phi[3], plo[3]);
#pragma unroll
      for (int jp = 0; jp < C::NTV / 2; ++jp) {
        unsigned b[4];  // b0, b1 of output n-tile 2jp, then of 2jp+1
        res_ldsm_x4_trans(b, vs_t + (16 * kk + 8 * (mi & 1) + mr) * C::RP + warp * C::VW + 16 * jp + 8 * (mi >> 1));
        res_mma(acc[2 * jp], phi, b[0], b[1]);
        res_mma(acc[2 * jp], plo, b[0], b[1]);
        res_mma(acc[2 * jp + 1], phi, b[2], b[3]);
        res_mma(acc[2 * jp + 1], plo, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

  // 4. Normalise and write this warp's columns of the partial (rows < gc).
  const index_t row0 = index_t(it.out_index) * p.hq + index_t(kvh) * p.group + g0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = gr + 8 * h;
    if (row < gc) {
      const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // no token: o = 0
      float* o = p.part_o + (row0 + row) * C::V + warp * C::VW + 2 * tq;
#pragma unroll
      for (int j = 0; j < C::NTV; ++j)
        *reinterpret_cast<float2*>(o + 8 * j) = make_float2(acc[j][2 * h] * inv, acc[j][2 * h + 1] * inv);
      if (warp == 0 && tq == 0) p.part_lse[row0 + row] = l[h] > 0.0f ? m[h] + logf(l[h]) : -INFINITY;
    }
  }
}

// -----------------------------------------------------------------------------
// Fold
// -----------------------------------------------------------------------------

/// fold_kernel over a device segment table: the same loads and merge_into
/// calls in the same order, so the same bits for the same partials.
template <class L>
__global__ void __launch_bounds__(128) resident_fold_kernel(const __grid_constant__ resident_fold_params p) {
  const fold_segment sg = p.segments[blockIdx.x];
  fold_segment_into_state<L>(sg, p.hq, p.state_o, p.state_lse, p.part_o, p.part_lse);
}

}  // namespace writescope::gpu::detail

namespace writescope::gpu {

template <class Layout>
void launch_resident_attend(const resident_attend_params& p, cudaStream_t stream) {
  using C = detail::resident_cfg<Layout>;
  if (p.num_items <= 0) return;
  static const bool configured = [] {
    WS_CUDA_TRY(cudaFuncSetAttribute(detail::resident_attend_kernel<Layout>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::smem_bytes)));
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(p.num_items), unsigned(p.hkv), unsigned((p.group + C::heads - 1) / C::heads));
  detail::resident_attend_kernel<Layout><<<grid, C::threads, C::smem_bytes, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

template <class Layout>
void launch_resident_fold(const resident_fold_params& p, cudaStream_t stream) {
  if (p.num_segments <= 0) return;
  detail::resident_fold_kernel<Layout><<<dim3(unsigned(p.num_segments), unsigned(p.hq)), 128, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

}  // namespace writescope::gpu

/// Explicitly instantiates the resident-region launchers (launch_resident_attend,
/// launch_resident_fold) for the layout given as the argument. Global namespace
/// scope; part of WS_CUDA_INSTANTIATE (do not repeat it where that is used).
#define WS_CUDA_INSTANTIATE_RESIDENT(...)                                                                  \
  template void writescope::gpu::launch_resident_attend<__VA_ARGS__>(                                      \
      const writescope::gpu::resident_attend_params&, cudaStream_t);                                       \
  template void writescope::gpu::launch_resident_fold<__VA_ARGS__>(const writescope::gpu::resident_fold_params&, \
                                                                   cudaStream_t);
