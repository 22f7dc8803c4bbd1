// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/flash_prefill.cu — the causal prefill attention kernel (nvcc,
// sm_80 and later; built for sm_90). Design, contract and limits are in
// flash_prefill.hpp; this file has the tile arithmetic.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"; lane = 4 *
// group + quad, group 0..7, quad 0..3):
//   A 16x16 (row): a0 (row group, cols 2quad..+1), a1 (row group+8, same
//                  cols), a2 (row group, cols 8+2quad..+1), a3 (row group+8, those)
//   B 16x8 (col):  b0 (k rows 2quad..+1, col group), b1 (k rows 8+2quad..+1)
//   C 16x8 fp32:   c0 c1 (row group, cols 2quad, 2quad+1), c2 c3 (row group+8)
// so the C fragments of two neighbouring 8-key score tiles are, packed to
// bf16 pairs, the A fragment of P for those 16 keys, and P never leaves the
// registers. ldmatrix x4 loads four 8x8 bf16 matrices whose row addresses come
// from lanes 8i..8i+7; each lane gets (row group, cols 2quad..+1) of each, or
// with .trans (rows 2quad..+1, col group), which is the B layout of a
// row-major [key][dim] V tile.
#include <cuda_runtime.h>

#include <cstdint>

#include <writescope/cuda/cuda_error.hpp>

#include "flash_prefill_launch.hpp"

namespace ws_moe::gpu {
namespace {

constexpr int warps = 8;
constexpr int threads = 32 * warps;
constexpr int key_tile = 64;  ///< keys per shared-memory tile
constexpr int rows_per_cta = 16 * warps;
constexpr int stages = 3;     ///< K/V tiles in shared memory: tile j computed while j+1 and j+2 arrive
constexpr int pad = 8;        ///< bf16 elements of padding per shared-memory row (16 bytes: ldmatrix without bank conflicts)

/// Tile geometry of one instantiation. HEADS query heads of one KV group per
/// CTA, each with `positions` query positions; warp w owns head w / row_warps
/// and positions 16 * (w % row_warps) .. +15 of the tile.
template <int DQK, int DV, int HEADS>
struct geometry {
  static_assert(DQK % 16 == 0 && DV % 16 == 0, "head dims must be multiples of 16 (mma k and ldmatrix x4 pairs)");
  static_assert(warps % HEADS == 0, "HEADS must divide the warps of a CTA");
  static constexpr int row_warps = warps / HEADS;
  static constexpr int positions = 16 * row_warps;  ///< query positions per CTA
  static constexpr int ldk = DQK + pad;             ///< row stride of the Q and K tiles (elements)
  static constexpr int ldv = DV + pad;              ///< row stride of the V tiles
  static constexpr int q_elems = rows_per_cta * ldk;
  static constexpr int k_elems = key_tile * ldk;
  static constexpr int v_elems = key_tile * ldv;
  static constexpr int smem_bytes = 2 * (q_elems + stages * (k_elems + v_elems));
  static_assert(smem_bytes <= 227 * 1024, "shared memory of one CTA above the sm_90 limit");
};

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// 16-byte global -> shared copy; `valid` false fills the 16 bytes with zeros
/// and reads nothing (src must still be a mapped address).
__device__ __forceinline__ void copy_16(std::uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/// Waits until at most N of this thread's newest copy groups are in flight.
template <int N>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t addr, std::uint32_t& r0, std::uint32_t& r1,
                                            std::uint32_t& r2, std::uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t addr, std::uint32_t& r0, std::uint32_t& r1,
                                                  std::uint32_t& r2, std::uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

/// c += a * b for one m16n8k16 tile (bf16 inputs, fp32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));  // ex2(-inf) = +0
  return y;
}

/// Two floats as a bf16 pair, `lo` in the low half (the lower column index).
__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  std::uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));  // first source -> high half
  return r;
}

/// Starts the copy of 64 token rows (`first`.. of the sequence whose row 0 is
/// `g`) of D elements into a shared tile of row stride D + pad; rows at or past
/// the sequence's `tokens` are zero-filled. With D a multiple of 64 a thread
/// copies chunk t % 8 of every 8-chunk column block of rows t / 8 + 32 r (a few
/// live pointers, constant offsets); otherwise chunks are dealt out in order.
template <int D>
__device__ __forceinline__ void copy_rows(std::uint16_t* tile, const std::uint16_t* g, idx token_stride, int first,
                                          int tokens) {
  if constexpr (D % 64 == 0) {
    constexpr int row_step = threads / 8;
    const int row0 = int(threadIdx.x) / 8, col0 = (int(threadIdx.x) % 8) * 8;
    const std::uint32_t dst = shared_address(tile + row0 * (D + pad) + col0);
    const std::uint16_t* const src = g + idx(first + row0) * token_stride + col0;
    const std::uint16_t* const first_row = g + col0;  // a mapped address for the zero-filled rows
#pragma unroll
    for (int r = 0; r < key_tile / row_step; ++r) {
      const bool valid = first + row0 + row_step * r < tokens;
      const std::uint16_t* const row_src = valid ? src + idx(row_step * r) * token_stride : first_row;
#pragma unroll
      for (int cb = 0; cb < D / 64; ++cb)
        copy_16(dst + std::uint32_t((row_step * r * (D + pad) + cb * 64) * 2), row_src + cb * 64, valid);
    }
  } else {
    constexpr int chunks_per_row = D / 8, chunks = key_tile * chunks_per_row;
#pragma unroll
    for (int i = 0; i < (chunks + threads - 1) / threads; ++i) {
      const int c = int(threadIdx.x) + i * threads;
      if (chunks % threads != 0 && c >= chunks) break;
      const int row = c / chunks_per_row, col = (c % chunks_per_row) * 8;
      const int pos = first + row;
      const bool valid = pos < tokens;
      copy_16(shared_address(tile + row * (D + pad) + col), g + idx(valid ? pos : 0) * token_stride + col, valid);
    }
  }
}

template <int DQK, int DV, int HEADS>
__global__ void __launch_bounds__(threads, 1)
    flash_prefill_kernel(const flash_prefill_params p, int q_tiles, int head_groups) {
  using G = geometry<DQK, DV, HEADS>;
  extern __shared__ __align__(16) std::uint16_t smem[];
  std::uint16_t* const sq = smem;
  std::uint16_t* const sk = sq + G::q_elems;           // `stages` K tiles
  std::uint16_t* const sv = sk + stages * G::k_elems;  // `stages` V tiles

  // Work item: block b -> query tile q_tiles-1 - b/W of item b%W (longest first).
  const unsigned items = unsigned(p.num_seqs) * unsigned(p.hkv) * unsigned(head_groups);
  const unsigned item = blockIdx.x % items;
  const int q_tile = q_tiles - 1 - int(blockIdx.x / items);
  const int head_group = int(item % unsigned(head_groups));
  const int kv_head = int((item / unsigned(head_groups)) % unsigned(p.hkv));
  const int seq = int(item / (unsigned(head_groups) * unsigned(p.hkv)));
  const int start = p.seq_offsets[seq];
  const int tokens = p.seq_offsets[seq + 1] - start;
  const int q0 = q_tile * G::positions;
  if (q0 >= tokens) return;  // whole CTA: before any barrier

  const int group = p.hq / p.hkv;
  const int head0 = kv_head * group + head_group * HEADS;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int warp_head = warp / G::row_warps;
  const int warp_pos = (warp % G::row_warps) * 16;
  // Key tiles: the CTA loads 0 .. the one holding its last real query row; a
  // warp computes 0 .. the one holding its own rows (16 rows, 16-aligned: one
  // tile), the last of them masked; a warp past the sequence end computes none.
  const int n_tiles = ((q0 + G::positions < tokens ? q0 + G::positions : tokens) - 1) / key_tile + 1;
  const int warp_first = q0 + warp_pos;
  const int warp_tiles = warp_first < tokens ? warp_first / key_tile + 1 : 0;

  const std::uint16_t* const kg = p.k + idx(start) * p.k_token_stride + idx(kv_head) * p.k_head_stride;
  const std::uint16_t* const vg = p.v + idx(start) * p.v_token_stride + idx(kv_head) * p.v_head_stride;

  // Q rows (head, position) -> shared row head * positions + position, with K/V
  // tile 0 (group 0); tile 1 (group 1).
  {
    const std::uint16_t* const qg = p.q + idx(start) * p.q_token_stride + idx(head0) * p.q_head_stride;
    constexpr int chunks_per_row = DQK / 8, chunks = rows_per_cta * chunks_per_row;
#pragma unroll
    for (int i = 0; i < (chunks + threads - 1) / threads; ++i) {
      const int c = int(threadIdx.x) + i * threads;
      if (chunks % threads != 0 && c >= chunks) break;
      const int row = c / chunks_per_row, col = (c % chunks_per_row) * 8;
      const int head = row / G::positions, pos = q0 + row % G::positions;
      const bool valid = pos < tokens;
      copy_16(shared_address(sq + row * G::ldk + col),
              qg + idx(valid ? pos : 0) * p.q_token_stride + idx(head) * p.q_head_stride + col, valid);
    }
  }
#pragma unroll
  for (int t = 0; t < stages - 1; ++t) {
    if (t < n_tiles) {
      copy_rows<DQK>(sk + t * G::k_elems, kg, p.k_token_stride, t * key_tile, tokens);
      copy_rows<DV>(sv + t * G::v_elems, vg, p.v_token_stride, t * key_tile, tokens);
    }
    copy_commit();  // possibly empty: one group per tile keeps the wait counts fixed
  }
  copy_wait<stages - 2>();  // Q and tile 0
  __syncthreads();

  // This warp's 16 query rows as A fragments, for the whole pass.
  std::uint32_t qf[DQK / 16][4];
  {
    const std::uint32_t base =
        shared_address(sq + (warp_head * G::positions + warp_pos + (lane % 16)) * G::ldk + (lane / 16) * 8);
#pragma unroll
    for (int kc = 0; kc < DQK / 16; ++kc) ldmatrix_x4(base + kc * 32, qf[kc][0], qf[kc][1], qf[kc][2], qf[kc][3]);
  }
  // Per-lane ldmatrix offsets (bytes) inside a K tile (keys (lane/16)*8 + lane%8,
  // dims ((lane/8)%2)*8: b0 b1 of key tile 2i, then of 2i+1) and a V tile (keys
  // ((lane/8)%2)*8 + lane%8, dims (lane/16)*8, transposed: b0 b1 of dim tile 2i, then 2i+1).
  const std::uint32_t k_lane = std::uint32_t((((lane / 16) * 8 + lane % 8) * G::ldk + ((lane / 8) % 2) * 8) * 2);
  const std::uint32_t v_lane = std::uint32_t(((((lane / 8) % 2) * 8 + lane % 8) * G::ldv + (lane / 16) * 8) * 2);
  const std::uint32_t sk0 = shared_address(sk), sv0 = shared_address(sv);

  float o[DV / 8][4];
#pragma unroll
  for (int d = 0; d < DV / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  const float neg_inf = __uint_as_float(0xff800000u);
  float m_lo = neg_inf, m_hi = neg_inf;  // running max of the raw scores, rows group and group+8
  float l_lo = 0.0f, l_hi = 0.0f;        // running sums of this lane's columns (quad-reduced at the end)
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const int row_lo = warp_first + lane / 4;  // query position of c0, c1 (c2, c3: row_lo + 8)

  int stage = 0;
  for (int j = 0; j < n_tiles; ++j) {
    {  // tile j + stages - 1 into the stage tile j - 1 used (every warp left it at the last barrier)
      const int t = j + stages - 1;
      const int st = stage == 0 ? stages - 1 : stage - 1;
      if (t < n_tiles) {
        copy_rows<DQK>(sk + st * G::k_elems, kg, p.k_token_stride, t * key_tile, tokens);
        copy_rows<DV>(sv + st * G::v_elems, vg, p.v_token_stride, t * key_tile, tokens);
      }
      copy_commit();
    }
    if (j < warp_tiles) {
      const std::uint32_t kt = sk0 + std::uint32_t(stage * G::k_elems * 2) + k_lane;
      const std::uint32_t vt = sv0 + std::uint32_t(stage * G::v_elems * 2) + v_lane;

      // S = Q K^T: 16 rows x 64 keys, eight 8-key accumulator tiles.
      float s[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < DQK / 16; ++kc) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          std::uint32_t b0, b1, b2, b3;
          ldmatrix_x4(kt + std::uint32_t((i * 16 * G::ldk + kc * 16) * 2), b0, b1, b2, b3);
          mma_bf16(s[2 * i], qf[kc], b0, b1);
          mma_bf16(s[2 * i + 1], qf[kc], b2, b3);
        }
      }
      if (j == warp_tiles - 1) {  // this warp's diagonal tile: key > query -> -inf
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int key = j * key_tile + n * 8 + (lane % 4) * 2;
          if (key > row_lo) s[n][0] = neg_inf;
          if (key + 1 > row_lo) s[n][1] = neg_inf;
          if (key > row_lo + 8) s[n][2] = neg_inf;
          if (key + 1 > row_lo + 8) s[n][3] = neg_inf;
        }
      }

      // Online softmax. Key 0 is in tile 0 and never masked, so the running max
      // is finite from the first tile on and no row computes inf - inf.
      float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[n][0], s[n][1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[n][2], s[n][3]));
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      const float corr_lo = fast_exp2((m_lo - mx_lo) * scale_log2);  // 0 on the first tile (m = -inf)
      const float corr_hi = fast_exp2((m_hi - mx_hi) * scale_log2);
      m_lo = mx_lo;
      m_hi = mx_hi;
      const float off_lo = mx_lo * scale_log2, off_hi = mx_hi * scale_log2;
      float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        s[n][0] = fast_exp2(fmaf(s[n][0], scale_log2, -off_lo));
        s[n][1] = fast_exp2(fmaf(s[n][1], scale_log2, -off_lo));
        s[n][2] = fast_exp2(fmaf(s[n][2], scale_log2, -off_hi));
        s[n][3] = fast_exp2(fmaf(s[n][3], scale_log2, -off_hi));
        sum_lo += s[n][0] + s[n][1];
        sum_hi += s[n][2] + s[n][3];
      }
      l_lo = l_lo * corr_lo + sum_lo;
      l_hi = l_hi * corr_hi + sum_hi;
#pragma unroll
      for (int d = 0; d < DV / 8; ++d) {
        o[d][0] *= corr_lo;
        o[d][1] *= corr_lo;
        o[d][2] *= corr_hi;
        o[d][3] *= corr_hi;
      }

      // O += P V: four 16-key chunks; P's A fragment from the score registers.
#pragma unroll
      for (int kk = 0; kk < key_tile / 16; ++kk) {
        const std::uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int i = 0; i < DV / 16; ++i) {
          std::uint32_t b0, b1, b2, b3;
          ldmatrix_x4_trans(vt + std::uint32_t((kk * 16 * G::ldv + i * 16) * 2), b0, b1, b2, b3);
          mma_bf16(o[2 * i], a, b0, b1);
          mma_bf16(o[2 * i + 1], a, b2, b3);
        }
      }
    }
    // Tile j+1 has landed (at most the stages-2 newest groups still in flight)
    // and every warp is done with this stage, which the next iteration refills.
    copy_wait<stages - 2>();
    __syncthreads();
    stage = stage == stages - 1 ? 0 : stage + 1;
  }
  if (warp_tiles == 0) return;  // no real row (after the last barrier)

  // Row sums over the quad, normalise, store (rows past the sequence end are dropped).
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  const int head = head0 + warp_head;
  const float inv_lo = 1.0f / l_lo, inv_hi = 1.0f / l_hi;
  const int col = (lane % 4) * 2;
  if (row_lo < tokens) {
    float* const out = p.out + idx(start + row_lo) * p.o_token_stride + idx(head) * p.o_head_stride + col;
#pragma unroll
    for (int d = 0; d < DV / 8; ++d)
      *reinterpret_cast<float2*>(out + d * 8) = make_float2(o[d][0] * inv_lo, o[d][1] * inv_lo);
    if (p.lse != nullptr && lane % 4 == 0) p.lse[idx(start + row_lo) * p.hq + head] = m_lo * p.scale + logf(l_lo);
  }
  if (row_lo + 8 < tokens) {
    float* const out = p.out + idx(start + row_lo + 8) * p.o_token_stride + idx(head) * p.o_head_stride + col;
#pragma unroll
    for (int d = 0; d < DV / 8; ++d)
      *reinterpret_cast<float2*>(out + d * 8) = make_float2(o[d][2] * inv_hi, o[d][3] * inv_hi);
    if (p.lse != nullptr && lane % 4 == 0) p.lse[idx(start + row_lo + 8) * p.hq + head] = m_hi * p.scale + logf(l_hi);
  }
}

template <int DQK, int DV, int HEADS>
void launch_with(const flash_prefill_params& p, cudaStream_t stream) {
  using G = geometry<DQK, DV, HEADS>;
  const int group = p.hq / p.hkv;
  const int head_groups = group / HEADS;
  const idx q_tiles = (p.max_seq_tokens + G::positions - 1) / G::positions;
  const idx blocks = q_tiles * p.num_seqs * p.hkv * head_groups;  // <= 2^31-1: check_flash_prefill
  if (blocks == 0) return;
  WS_CUDA_TRY(cudaFuncSetAttribute(flash_prefill_kernel<DQK, DV, HEADS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   G::smem_bytes));
  WS_CUDA_TRY(cudaFuncSetAttribute(flash_prefill_kernel<DQK, DV, HEADS>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   int(cudaSharedmemCarveoutMaxShared)));
  flash_prefill_kernel<DQK, DV, HEADS><<<unsigned(blocks), threads, G::smem_bytes, stream>>>(p, int(q_tiles), head_groups);
  WS_CUDA_CHECK_LAST();
}

/// GQA dims: 8, 4, 2 or 1 query heads per CTA by the group size; MLA dims
/// (hq == hkv in the decoders) only the one-head tiling, which serves any group.
template <int DQK, int DV, bool Grouped>
void dispatch_heads(const flash_prefill_params& p, cudaStream_t stream) {
  const int heads = flash_prefill_heads_per_cta(p.hq / p.hkv);
  if constexpr (Grouped) {
    if (heads == 8) return launch_with<DQK, DV, 8>(p, stream);
    if (heads == 4) return launch_with<DQK, DV, 4>(p, stream);
    if (heads == 2) return launch_with<DQK, DV, 2>(p, stream);
  }
  launch_with<DQK, DV, 1>(p, stream);
}

}  // namespace

void launch_flash_prefill(const flash_prefill_params& p, cudaStream_t stream) {
  check_flash_prefill(p);
  if (p.num_seqs == 0 || p.max_seq_tokens == 0) return;
  if (p.dqk == 64 && p.dv == 64) return dispatch_heads<64, 64, true>(p, stream);
  if (p.dqk == 128 && p.dv == 128) return dispatch_heads<128, 128, true>(p, stream);
  if (p.dqk == 192 && p.dv == 128) return dispatch_heads<192, 128, false>(p, stream);
  if (p.dqk == 48 && p.dv == 16) return dispatch_heads<48, 16, false>(p, stream);
  flash_detail::fail("head dims (dqk " + std::to_string(p.dqk) + ", dv " + std::to_string(p.dv) + ") are not built");
}

}  // namespace ws_moe::gpu
