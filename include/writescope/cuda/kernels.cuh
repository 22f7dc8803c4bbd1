// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/kernels.cuh — the GPU side of a decode step (paper §4.2,
// §6): split attention over streamed ping-pong chunks and over the
// D-window, the in-order fold of split partials, the final LSE merge, the
// merge of tensor_parallel_mla's rank partials, the scatter of appended KV
// into blocks, the sparse pipeline's wait kernel and device pull, and two
// small helpers (fill, spin).
// nvcc only. Host code includes kernels.hpp (declarations) and links one .cu
// that includes this file and instantiates its layouts:
//
//     #include <writescope/cuda/kernels.cuh>
//     WS_CUDA_INSTANTIATE_COMMON()                        // exactly once per program
//     WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)    // once per layout used
//     WS_CUDA_INSTANTIATE(writescope::mla_layout<512, 64>)
//
// (at global namespace scope; compile with -std=c++20 --expt-relaxed-constexpr
// and the target architecture, e.g. -arch=sm_90 — linking the .cu target to
// writescope::cuda adds the first two). Keep the instantiated set short: each
// layout costs seven kernels of compile time. Programs whose backend has the
// mutation-test hooks (basic_cuda_backend<cuda_test_hooks>, hooks.hpp) also
// write WS_CUDA_INSTANTIATE_TEST_HOOKS(Layout) per layout: the attention
// kernels with a slow consumer, which the production kernels do not contain.
//
// Numerics (docs/MERGE-CONTRACT.md): KV is bf16 in memory and widened exactly; scores,
// running max, running sum and outputs are fp32; exp/log are the natural-base
// expf/logf (no exp2, so no base conversion is needed: fault kind K2); the
// running max starts at -inf (never a finite stand-in); an item with no tokens
// yields the empty partial (o = 0, lse = -inf); merges call merge_state_row
// (partial_state.hpp), the host's merge, including its identities for empty partials.
// Every reduction has a fixed order: results are deterministic and do not depend
// on other items of the launch (batch invariance, K10).
//
// Attention kernel design (a simple one: the streamed side is bound by PCIe
// (Gen5 x16: ≈ 55 GB/s), far below what even a plain kernel reads from HBM). One CTA of 256
// threads attends one item (a streamed split, an HBM-resident split or a
// D-window) for one KV head and up to 16 query heads of its group. Tiles of 32
// tokens stream through shared memory in a cp.async pipeline of
// attend_cfg::stages stages (16-byte asynchronous copies; MLA: one 576-wide row
// serves both products and all heads), so the copies of the next tiles are in
// flight while a tile is computed: the 16×32 scores with one lane per token and
// one warp per two heads, the online softmax per head inside the warp
// (shuffles), and P·V with each thread owning 8 output columns of a few heads.
// Rows past the item's valid tokens are never read. The pipeline changes when
// bytes land, not which bytes or the arithmetic: results do not depend on the
// stage count.
#pragma once

#if !defined(__CUDACC__)
#  error "writescope/cuda/kernels.cuh must be compiled by nvcc; host code includes kernels.hpp"
#endif

#include <cuda/atomic>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "../layout.hpp"
#include "../partial_state.hpp"
#include "cuda_error.hpp"
#include "kernels.hpp"

namespace writescope::gpu::detail {

// -----------------------------------------------------------------------------
// Device helpers
// -----------------------------------------------------------------------------

/// Eight bf16 (one 16-byte vector) widened to fp32, exactly.
__device__ __forceinline__ void unpack8(const uint4 v, float (&f)[8]) {
  f[0] = __uint_as_float(v.x << 16);
  f[1] = __uint_as_float(v.x & 0xffff0000u);
  f[2] = __uint_as_float(v.y << 16);
  f[3] = __uint_as_float(v.y & 0xffff0000u);
  f[4] = __uint_as_float(v.z << 16);
  f[5] = __uint_as_float(v.z & 0xffff0000u);
  f[6] = __uint_as_float(v.w << 16);
  f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// Butterfly reductions: every lane ends with the same value (each step adds a
// pair in both orders, and fp addition is commutative), so the result is
// deterministic and uniform across the warp.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// (oa, la) ⊕= (ob, lb) for one output element: merge_state_row
/// (partial_state.hpp) over a row of one element, so the kernels merge with the
/// host's arithmetic and identities (an empty b leaves a untouched; an empty a
/// takes b as is).
__device__ __forceinline__ void merge_into(float& oa, float& la, float ob, float lb) {
  merge_state_row(&oa, la, &ob, lb, &oa, &la, 1);
}

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

/// 16 bytes global -> shared, asynchronous (sm_80+); `bytes` = 0 zero-fills the
/// 16 shared bytes and reads nothing from `gmem` (which must still be a valid
/// address). Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes = 16) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
/// Closes this thread's group of cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// -----------------------------------------------------------------------------
// Attention over items
// -----------------------------------------------------------------------------

template <class L>
struct attend_cfg {
  static constexpr int threads = 256;
  static constexpr int warps = threads / 32;
  static constexpr int tile = 32;                          ///< tokens per tile: one per lane
  /// cp.async pipeline depth: tiles in shared memory at once. Rows wider than
  /// 128 elements (MLA's 576, GQA head dim 256) take two, so that two CTAs
  /// still fit an SM's 228 KiB; narrower rows three.
  static constexpr int stages = L::row_elems > 128 ? 2 : 3;
  static constexpr int heads = attend_heads_per_cta;       ///< query heads per CTA
  static constexpr int heads_per_warp = heads / warps;     ///< score/softmax phase
  static constexpr int R = L::row_elems;
  static constexpr int V = L::v_dim;
  static constexpr int RP = R + 8;                         ///< padded smem row (bf16): 16-byte rows land on distinct banks
  static constexpr int RC = R / 8;                         ///< 16-byte chunks per row
  static constexpr int VC = V / 8;                         ///< 8-column groups of the output
  static constexpr bool shared_kv = L::is_mla;             ///< V = first v_dim elements of the K row
  static constexpr int NH = threads / VC;                  ///< head lanes of the P·V phase
  static constexpr int HPT = (heads + NH - 1) / NH;        ///< heads per thread in the P·V phase
  static constexpr int PS = tile + 1;                      ///< padded probability row
  static constexpr unsigned q_off = 0;
  static constexpr unsigned k_off = q_off + unsigned(sizeof(float)) * heads * R;
  static constexpr unsigned tile_bytes = unsigned(sizeof(std::uint16_t)) * tile * RP;  ///< one plane, one stage
  static constexpr unsigned v_off = k_off + tile_bytes * stages;
  static constexpr unsigned p_off = v_off + (shared_kv ? 0u : tile_bytes * stages);
  static constexpr unsigned stat_off = p_off + unsigned(sizeof(float)) * heads * PS;
  static constexpr unsigned smem_bytes = stat_off + unsigned(sizeof(float)) * 3 * heads;

  static_assert(heads % warps == 0, "attend: heads per CTA must be a multiple of the warps");
  static_assert(R % 8 == 0 && V % 8 == 0 && V <= R, "attend: rows must be whole 16-byte vectors");
  static_assert(VC <= threads && threads % VC == 0, "attend: v_dim/8 must divide the thread count");
  static_assert(L::q_dim == R, "attend: a query head is as wide as a key row");
  static_assert(k_off % 16 == 0 && v_off % 16 == 0 && p_off % 16 == 0, "attend: smem regions must be 16-byte aligned");
  static_assert(tile_bytes % 16 == 0 && (RP * 2) % 16 == 0, "attend: smem rows must be 16-byte aligned");
  static_assert(stages >= 2, "attend: two pipeline stages at least");
  static_assert(smem_bytes <= 227u * 1024u, "attend: shared memory over the sm_90 per-CTA limit");
};

/// The production attention kernel's spin parameter: none.
struct no_spin {};
/// Mutation tests (launch_attend_slow): every CTA spins `cycles` before reading KV.
struct consumer_spin {
  long long cycles;
};

template <class L, bool Listed, class Spin>
__global__ void __launch_bounds__(256) attend_kernel(const __grid_constant__ attend_params p, const Spin spin) {
  using C = attend_cfg<L>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* qs = reinterpret_cast<float*>(smem + C::q_off);
  std::uint16_t* ks = reinterpret_cast<std::uint16_t*>(smem + C::k_off);
  std::uint16_t* vs = C::shared_kv ? ks : reinterpret_cast<std::uint16_t*>(smem + C::v_off);
  float* ps = reinterpret_cast<float*>(smem + C::p_off);
  float* alpha_s = reinterpret_cast<float*>(smem + C::stat_off);
  float* m_s = alpha_s + C::heads;
  float* l_s = m_s + C::heads;

  const attend_item& it = p.items[blockIdx.x];
  const int kvh = int(blockIdx.y);
  const int g0 = int(blockIdx.z) * C::heads;
  const int gc = imin(C::heads, p.group - g0);  // heads of this CTA
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int bt = p.block_tokens;
  // Listed (sparse splits): this KV head's blocks, [count, i_0, ...]; token t
  // of the listed sequence lives in block lst[1 + t / bt] after it.base. The
  // count and the indices are clamped to the item's nb blocks: a bad list
  // (a race, a bug) reads wrong blocks of the item, never outside it.
  const std::int32_t* lst = nullptr;
  int tokens = it.tokens;
  int nb = 0;
  if constexpr (Listed) {
    nb = it.tokens / bt;
    lst = p.block_lists + it.list_offset + index_t(kvh) * (nb + 1);
    const int count = lst[0];
    tokens = (count < 0 ? 0 : (count > nb ? nb : count)) * bt;
  }

  if constexpr (!std::is_same_v<Spin, no_spin>) {  // mutation tests: a slow consumer
    if (spin.cycles > 0) {
      if (tid == 0) {
        const long long t0 = clock64();
        while (clock64() - t0 < spin.cycles) {
        }
      }
      __syncthreads();
    }
  } else {
    (void)spin;
  }

  const auto* kbase =
      reinterpret_cast<const std::uint16_t*>(it.base) + block_format<L>::offset_in(p.hkv, bt, L::key_plane, kvh, 0, 0);
  const auto* vbase =
      reinterpret_cast<const std::uint16_t*>(it.base) + block_format<L>::offset_in(p.hkv, bt, L::value_plane, kvh, 0, 0);

  // Issues the copies of tile t (rows [t*tile, t*tile + n)) into stage st;
  // rows past n are neither copied nor read.
  auto load_tile = [&](int t, int st) {
    const int t0 = t * C::tile;
    const int n = imin(C::tile, tokens - t0);
    std::uint16_t* kd = ks + st * C::tile * C::RP;
    std::uint16_t* vd = vs + st * C::tile * C::RP;
#pragma unroll 4
    for (int i = tid; i < n * C::RC; i += C::threads) {
      const int r = i / C::RC;
      const int c = i - r * C::RC;
      const int tok = t0 + r;
      const int blk = tok / bt;
      int src_blk = blk;
      if constexpr (Listed) {
        const int x = lst[1 + blk];
        src_blk = x >= 0 && x < nb ? x : 0;
      }
      const index_t off = index_t(src_blk) * p.block_elems + index_t(tok - blk * bt) * C::R + c * 8;
      cp_async16(kd + r * C::RP + c * 8, kbase + off);
      if constexpr (!C::shared_kv) cp_async16(vd + r * C::RP + c * 8, vbase + off);
    }
  };
  const int num_tiles = (tokens + C::tile - 1) / C::tile;
  // Prologue: the first stages - 1 tiles in flight, one commit group each
  // (empty past the last tile, so that every thread's group count is uniform).
#pragma unroll
  for (int st = 0; st < C::stages - 1; ++st) {
    if (st < num_tiles) load_tile(st, st);
    cp_async_commit();
  }

  // Queries of this CTA's heads, pre-scaled, fp32 (while the first tiles land).
  const index_t qrow0 = index_t(it.q_seq) * p.hq + index_t(kvh) * p.group + g0;
  for (int i = tid; i < gc * C::R; i += C::threads) {
    const int g = i / C::R;
    const int e = i - g * C::R;
    qs[g * C::R + e] = p.q[(qrow0 + g) * C::R + e] * p.scale;
  }

  float m[C::heads_per_warp];
  float l[C::heads_per_warp];
#pragma unroll
  for (int j = 0; j < C::heads_per_warp; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
  }
  float acc[C::HPT][8];
#pragma unroll
  for (int jj = 0; jj < C::HPT; ++jj)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[jj][k] = 0.0f;
  const int vc = tid % C::VC;  // this thread's 8 output columns: [8*vc, 8*vc+8)
  const int hl = tid / C::VC;  // and heads hl, hl+NH, ...

  for (int ti = 0; ti < num_tiles; ++ti) {
    const int n = imin(C::tile, tokens - ti * C::tile);
    // 1. This thread's copies of tile t have landed; after the barrier every
    //    thread's have, the queries are written, and tile t-1 is fully consumed,
    //    so its stage takes the copies of tile t + stages - 1.
    cp_async_wait<C::stages - 2>();
    __syncthreads();
    if (ti + C::stages - 1 < num_tiles) load_tile(ti + C::stages - 1, (ti + C::stages - 1) % C::stages);
    cp_async_commit();
    const std::uint16_t* kt = ks + (ti % C::stages) * C::tile * C::RP;
    const std::uint16_t* vt = vs + (ti % C::stages) * C::tile * C::RP;

    // 2. Scores: lane = token, warp = heads warp, warp+8 (same thread keeps them).
    float s[C::heads_per_warp];
#pragma unroll
    for (int j = 0; j < C::heads_per_warp; ++j) s[j] = 0.0f;
    if (lane < n) {
      const std::uint16_t* krow = kt + lane * C::RP;
#pragma unroll 2
      for (int c = 0; c < C::RC; ++c) {
        float kf[8];
        unpack8(*reinterpret_cast<const uint4*>(krow + c * 8), kf);
#pragma unroll
        for (int j = 0; j < C::heads_per_warp; ++j) {
          const int g = warp + C::warps * j;
          if (g < gc) {
            const float4 qa = *reinterpret_cast<const float4*>(qs + g * C::R + c * 8);
            const float4 qb = *reinterpret_cast<const float4*>(qs + g * C::R + c * 8 + 4);
            float t = s[j];
            t = fmaf(qa.x, kf[0], t);
            t = fmaf(qa.y, kf[1], t);
            t = fmaf(qa.z, kf[2], t);
            t = fmaf(qa.w, kf[3], t);
            t = fmaf(qb.x, kf[4], t);
            t = fmaf(qb.y, kf[5], t);
            t = fmaf(qb.z, kf[6], t);
            t = fmaf(qb.w, kf[7], t);
            s[j] = t;
          }
        }
      }
    }

    // 3. Online softmax per head, inside its warp.
#pragma unroll
    for (int j = 0; j < C::heads_per_warp; ++j) {
      const int g = warp + C::warps * j;
      if (g < gc) {  // warp-uniform
        const float sv = lane < n ? s[j] : -INFINITY;
        const float m_new = fmaxf(m[j], warp_max(sv));  // finite: n >= 1
        const float alpha = m[j] == -INFINITY ? 0.0f : expf(m[j] - m_new);
        const float pv = lane < n ? expf(sv - m_new) : 0.0f;
        l[j] = l[j] * alpha + warp_sum(pv);
        m[j] = m_new;
        ps[g * C::PS + lane] = pv;
        if (lane == 0) alpha_s[g] = alpha;
      }
    }
    __syncthreads();

    // 4. Rescale and accumulate P·V.
#pragma unroll
    for (int jj = 0; jj < C::HPT; ++jj) {
      const int g = hl + C::NH * jj;
      if (g < gc) {
        const float a = alpha_s[g];
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[jj][k] *= a;
      }
    }
    for (int r = 0; r < n; ++r) {
      float vf[8];
      unpack8(*reinterpret_cast<const uint4*>(vt + r * C::RP + vc * 8), vf);
#pragma unroll
      for (int jj = 0; jj < C::HPT; ++jj) {
        const int g = hl + C::NH * jj;
        if (g < gc) {
          const float pr = ps[g * C::PS + r];
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[jj][k] = fmaf(pr, vf[k], acc[jj][k]);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can remain

  // 5. Normalise and write the partial state.
#pragma unroll
  for (int j = 0; j < C::heads_per_warp; ++j) {
    const int g = warp + C::warps * j;
    if (g < gc && lane == 0) {
      m_s[g] = m[j];
      l_s[g] = l[j];
    }
  }
  __syncthreads();
#pragma unroll
  for (int jj = 0; jj < C::HPT; ++jj) {
    const int g = hl + C::NH * jj;
    if (g < gc) {
      const index_t row = index_t(it.out_index) * p.hq + index_t(kvh) * p.group + g0 + g;
      const float lsum = l_s[g];
      const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;  // no token: o = 0
      float* o = p.out_o + row * C::V + vc * 8;
      *reinterpret_cast<float4*>(o) = make_float4(acc[jj][0] * inv, acc[jj][1] * inv, acc[jj][2] * inv, acc[jj][3] * inv);
      *reinterpret_cast<float4*>(o + 4) =
          make_float4(acc[jj][4] * inv, acc[jj][5] * inv, acc[jj][6] * inv, acc[jj][7] * inv);
      if (vc == 0) p.out_lse[row] = lsum > 0.0f ? m_s[g] + logf(lsum) : -INFINITY;
    }
  }
}

// -----------------------------------------------------------------------------
// Fold, init, merge
// -----------------------------------------------------------------------------

/// Partials whose loads one fold thread issues ahead of their merges.
inline constexpr int fold_unroll = 8;

/// (o, lse) ⊕= split[begin] ⊕ ... ⊕ split[end-1] for output element i of
/// query head h, in split order (merge_into each). The partials' loads do not
/// depend on the running state: fold_unroll of them are issued together ahead
/// of their merges (a long segment is a chain of merges, latency-bound
/// otherwise); the merges keep the split order, so the bits do not depend on
/// fold_unroll.
template <int V>
__device__ __forceinline__ void fold_chain(float& o, float& lse, const float* split_o, const float* split_lse, int begin,
                                           int end, int hq, int h, int i) {
  constexpr int U = fold_unroll;
  for (int s0 = begin; s0 < end; s0 += U) {
    float po[U], pl[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u < end) {
        const index_t srow = index_t(s0 + u) * hq + h;
        po[u] = split_o[srow * V + i];
        pl[u] = split_lse[srow];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (s0 + u < end) merge_into(o, lse, po[u], pl[u]);
  }
}

/// One CTA folds segment `sg` (its partials split_o/split_lse, rows
/// [split_begin, split_end)) into the running state of its sequence, query
/// head blockIdx.y, in the partials' order: the body of fold_kernel and of
/// resident_fold_kernel, so both give the same bits for the same partials.
/// Every thread of the CTA must call it (a barrier inside).
template <class L>
__device__ __forceinline__ void fold_segment_into_state(const fold_segment& sg, int hq, float* state_o,
                                                        float* state_lse, const float* split_o,
                                                        const float* split_lse) {
  constexpr int V = L::v_dim;
  const int h = int(blockIdx.y);
  const index_t row = index_t(sg.batch_index) * hq + h;
  const float lse0 = state_lse[row];
  float lse_out = lse0;
  for (int i = int(threadIdx.x); i < V; i += int(blockDim.x)) {
    float o = state_o[row * V + i];
    float lse = lse0;
    fold_chain<V>(o, lse, split_o, split_lse, sg.split_begin, sg.split_end, hq, h, i);
    state_o[row * V + i] = o;
    lse_out = lse;
  }
  __syncthreads();  // every thread read lse0 before it is overwritten
  if (threadIdx.x == 0) state_lse[row] = lse_out;
}

template <class L>
__global__ void __launch_bounds__(128) fold_kernel(const __grid_constant__ fold_params p) {
  fold_segment_into_state<L>(p.segments[blockIdx.x], p.hq, p.state_o, p.state_lse, p.split_o, p.split_lse);
}

template <class L>
__global__ void init_state_kernel(float* o, float* lse, index_t rows) {
  constexpr int V = L::v_dim;
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * V; i += stride) {
    o[i] = 0.0f;
    if (i < rows) lse[i] = -INFINITY;
  }
}

template <class L>
__global__ void __launch_bounds__(128) merge_kernel(const merge_params p) {
  constexpr int V = L::v_dim;
  const index_t row = blockIdx.x;
  const float ls = p.streamed_lse[row];
  const float lw = p.window_lse[row];
  const float lc = p.cpu_lse != nullptr ? p.cpu_lse[row] : -INFINITY;  // null: no CPU partial
  float lse_out = ls;
  for (int i = int(threadIdx.x); i < V; i += int(blockDim.x)) {
    const index_t e = row * V + i;
    float o = p.streamed_o[e];
    float lse = ls;
    merge_into(o, lse, p.window_o[e], lw);  // GPU side: streamed ⊕ D-window
    if (p.cpu_o != nullptr) merge_into(o, lse, p.cpu_o[e], lc);  // then ⊕ CPU
    p.out[e] = o;
    lse_out = lse;
  }
  if (p.out_lse != nullptr && threadIdx.x == 0) p.out_lse[row] = lse_out;
}

/// The caller-stream step's tail in one kernel (fold_merge_params): the same
/// merge_into calls in the same order as launch_init_state + launch_fold +
/// launch_merge without a CPU partial, so the same bits. Grid (batch, hq).
template <class L>
__global__ void __launch_bounds__(128) fold_merge_kernel(const __grid_constant__ fold_merge_params p) {
  constexpr int V = L::v_dim;
  const int b = int(blockIdx.x);
  const int h = int(blockIdx.y);
  const fold_segment sg = p.segments[b];
  const index_t row = index_t(b) * p.hq + h;
  const float lw = p.window_lse[row];
  float state_lse = -INFINITY;
  float lse_out = -INFINITY;
  for (int i = int(threadIdx.x); i < V; i += int(blockDim.x)) {
    float o = 0.0f;  // launch_init_state's empty partial
    float lse = -INFINITY;
    fold_chain<V>(o, lse, p.split_o, p.split_lse, sg.split_begin, sg.split_end, p.hq, h, i);
    p.state_o[row * V + i] = o;
    state_lse = lse;
    merge_into(o, lse, p.window_o[row * V + i], lw);  // streamed ⊕ D-window
    p.out[row * V + i] = o;
    lse_out = lse;
  }
  if (threadIdx.x == 0) {
    p.state_lse[row] = state_lse;
    if (p.out_lse != nullptr) p.out_lse[row] = lse_out;
  }
}

/// One CTA merges partial row part_begin + blockIdx.x, query head
/// blockIdx.y, into state row rows[blockIdx.x] (merge_rows_params).
template <class L>
__global__ void __launch_bounds__(128) merge_rows_kernel(const __grid_constant__ merge_rows_params p) {
  constexpr int V = L::v_dim;
  const int h = int(blockIdx.y);
  const index_t srow = index_t(p.rows[blockIdx.x]) * p.hq + h;
  const index_t prow = index_t(p.part_begin + int(blockIdx.x)) * p.hq + h;
  const float lse0 = p.state_lse[srow];
  const float lp = p.part_lse[prow];
  float lse_out = lse0;
  for (int i = int(threadIdx.x); i < V; i += int(blockDim.x)) {
    float o = p.state_o[srow * V + i];
    float lse = lse0;
    merge_into(o, lse, p.part_o[prow * V + i], lp);
    p.state_o[srow * V + i] = o;
    lse_out = lse;
  }
  __syncthreads();  // every thread read lse0 before it is overwritten
  if (threadIdx.x == 0) p.state_lse[srow] = lse_out;
}

// -----------------------------------------------------------------------------
// Scatter, fill, spin
// -----------------------------------------------------------------------------

template <class L>
__global__ void __launch_bounds__(128) scatter_kernel(const __grid_constant__ scatter_params p) {
  constexpr int R = L::row_elems;
  constexpr int RC = R / 8;
  const scatter_item& it = p.items[blockIdx.x];
  const int plane = int(blockIdx.y) / p.kv_heads;
  const int h = int(blockIdx.y) - plane * p.kv_heads;
  const auto* src = reinterpret_cast<const std::uint16_t*>(p.planes[plane]) + it.src_token * p.token_stride +
                    index_t(h) * R;
  auto* dst = reinterpret_cast<std::uint16_t*>(it.dst) +
              block_format<L>::offset_in(p.kv_heads, p.block_tokens, plane, h, it.dst_token, 0);
  const int n = it.num_tokens * RC;
  for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) {
    const int t = i / RC;
    const int c = i - t * RC;
    const std::uint16_t* s = src + index_t(t) * p.token_stride + c * 8;
    std::uint16_t* d = dst + index_t(t) * R + c * 8;
    if (p.vectorized) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) d[k] = s[k];
    }
  }
}

template <class = void>
__global__ void fill_u16_kernel(std::uint16_t* dst, index_t count, std::uint16_t value) {
  const index_t stride = index_t(gridDim.x) * blockDim.x;
  for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) dst[i] = value;
}

template <class = void>
__global__ void spin_kernel(long long cycles) {
  if (threadIdx.x == 0) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
  }
}

// The counters are written by host threads (std::atomic_ref release stores,
// sparse_engine.hpp) and read here through the mapping at system scope with
// acquire loads: what a host thread wrote before publishing is visible to the
// work ordered after this kernel.
template <class = void>
__global__ void wait_host_counters_kernel(const unsigned long long* counters, int n, unsigned long long need) {
  if (threadIdx.x == 0) {
    for (int j = 0; j < n; ++j) {
      const cuda::atomic_ref<const unsigned long long, cuda::thread_scope_system> c(counters[j]);
      while (c.load(cuda::memory_order_acquire) < need) __nanosleep(200);
    }
  }
}

/// Vectors of 16 bytes each pull-kernel thread loads before it stores them:
/// 8 × 256 threads × 16 bytes = 32 KiB of PCIe reads in flight per CTA.
inline constexpr int pull_unroll = 8;

// The device pull (launch_pull_blocks): CTA c copies blocks c, c + grid, ...;
// per block, each pass loads pull_unroll 16-byte vectors per thread (strided
// by the CTA's width, so a warp reads 512 contiguous bytes per load) into
// registers, then stores them. Loads are streaming (evict-first): the host
// bytes are read once; the stores stay in L2 for the attention kernel.
template <class = void>
__global__ void __launch_bounds__(pull_threads_per_cta) pull_blocks_kernel(const __grid_constant__ pull_params p) {
  const index_t vecs = p.block_bytes / 16;
  const index_t width = index_t(blockDim.x);
  for (int blk = int(blockIdx.x); blk < p.count; blk += int(gridDim.x)) {
    const uint4* src = static_cast<const uint4*>(p.src[blk]);
    uint4* dst = reinterpret_cast<uint4*>(static_cast<unsigned char*>(p.dst) + index_t(blk) * p.block_bytes);
    for (index_t base = index_t(threadIdx.x); base < vecs; base += width * pull_unroll) {
      uint4 v[pull_unroll];
#pragma unroll
      for (int k = 0; k < pull_unroll; ++k) {
        const index_t i = base + index_t(k) * width;
        v[k] = i < vecs ? __ldcs(src + i) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int k = 0; k < pull_unroll; ++k) {
        const index_t i = base + index_t(k) * width;
        if (i < vecs) dst[i] = v[k];
      }
    }
  }
}

inline unsigned grid_for(index_t n, int threads) {
  const index_t blocks = (n + threads - 1) / threads;
  return unsigned(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

}  // namespace writescope::gpu::detail

namespace writescope::gpu {

namespace detail {

// One attention kernel variant: shared memory above 48 KiB needs an opt-in,
// once per kernel (cudaFuncAttributeMaxDynamicSharedMemorySize).
template <class Layout, bool Listed, class Spin>
void launch_attend_variant(const attend_params& p, const Spin spin, cudaStream_t stream) {
  using C = attend_cfg<Layout>;
  if (p.num_items <= 0) return;
  static const bool configured = [] {
    WS_CUDA_TRY(cudaFuncSetAttribute(attend_kernel<Layout, Listed, Spin>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(C::smem_bytes)));
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(p.num_items), unsigned(p.hkv), unsigned((p.group + C::heads - 1) / C::heads));
  attend_kernel<Layout, Listed, Spin><<<grid, C::threads, C::smem_bytes, stream>>>(p, spin);
  WS_CUDA_CHECK_LAST();
}

}  // namespace detail

template <class Layout>
void launch_attend(const attend_params& p, cudaStream_t stream) {
  detail::launch_attend_variant<Layout, false>(p, detail::no_spin{}, stream);
}

template <class Layout>
void launch_attend_listed(const attend_params& p, cudaStream_t stream) {
  detail::launch_attend_variant<Layout, true>(p, detail::no_spin{}, stream);
}

template <class Layout>
void launch_attend_slow(const attend_params& p, bool listed, long long delay_cycles, cudaStream_t stream) {
  if (listed)
    detail::launch_attend_variant<Layout, true>(p, detail::consumer_spin{delay_cycles}, stream);
  else
    detail::launch_attend_variant<Layout, false>(p, detail::consumer_spin{delay_cycles}, stream);
}

template <class Layout>
void launch_fold(const fold_params& p, cudaStream_t stream) {
  if (p.num_segments <= 0) return;
  detail::fold_kernel<Layout><<<dim3(unsigned(p.num_segments), unsigned(p.hq)), 128, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

template <class Layout>
void launch_fold_merge(const fold_merge_params& p, cudaStream_t stream) {
  if (p.batch <= 0) return;
  if (p.batch > max_fold_segments)
    throw config_error("launch_fold_merge: batch " + std::to_string(p.batch) + " over " +
                       std::to_string(max_fold_segments) + " sequences per launch");
  detail::fold_merge_kernel<Layout><<<dim3(unsigned(p.batch), unsigned(p.hq)), 128, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

template <class Layout>
void launch_init_state(float* o, float* lse, index_t rows, cudaStream_t stream) {
  if (rows <= 0) return;
  detail::init_state_kernel<Layout><<<detail::grid_for(rows * Layout::v_dim, 256), 256, 0, stream>>>(o, lse, rows);
  WS_CUDA_CHECK_LAST();
}

template <class Layout>
void launch_merge(const merge_params& p, cudaStream_t stream) {
  if (p.rows <= 0) return;
  detail::merge_kernel<Layout><<<unsigned(p.rows), 128, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

template <class Layout>
void launch_merge_rows(const merge_rows_params& p, cudaStream_t stream) {
  if (p.num_rows <= 0) return;
  detail::merge_rows_kernel<Layout><<<dim3(unsigned(p.num_rows), unsigned(p.hq)), 128, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

template <class Layout>
void launch_scatter(const scatter_params& p, cudaStream_t stream) {
  if (p.num_items <= 0) return;
  detail::scatter_kernel<Layout>
      <<<dim3(unsigned(p.num_items), unsigned(Layout::planes * p.kv_heads)), 128, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

template <class>
void launch_fill_u16(std::uint16_t* dst, index_t count, std::uint16_t value, cudaStream_t stream) {
  if (count <= 0) return;
  detail::fill_u16_kernel<><<<detail::grid_for(count, 256), 256, 0, stream>>>(dst, count, value);
  WS_CUDA_CHECK_LAST();
}

template <class>
void launch_spin(long long cycles, cudaStream_t stream) {
  detail::spin_kernel<><<<1, 32, 0, stream>>>(cycles);
  WS_CUDA_CHECK_LAST();
}

template <class>
void launch_wait_host_counters(const unsigned long long* counters, int n, unsigned long long need,
                               cudaStream_t stream) {
  if (n <= 0) return;
  detail::wait_host_counters_kernel<><<<1, 32, 0, stream>>>(counters, n, need);
  WS_CUDA_CHECK_LAST();
}

template <class>
void launch_pull_blocks(const void* const* src, index_t count, void* dst, index_t block_bytes, int max_ctas,
                        cudaStream_t stream) {
  if (count <= 0) return;
  auto address = [](const void* q) {
    char text[32];
    std::snprintf(text, sizeof text, "%p", q);
    return std::string(text);
  };
  if (block_bytes <= 0 || block_bytes % 16 != 0)
    throw config_error("launch_pull_blocks: block_bytes " + std::to_string(block_bytes) +
                       " must be a positive multiple of 16 (the pull kernel moves 16-byte vectors)");
  if (max_ctas < 1)
    throw config_error("launch_pull_blocks: max_ctas " + std::to_string(max_ctas) + " must be >= 1");
  if (reinterpret_cast<std::uintptr_t>(dst) % 16 != 0)
    throw config_error("launch_pull_blocks: destination " + address(dst) + " is not 16-byte aligned");
  for (index_t i = 0; i < count; ++i)
    if (reinterpret_cast<std::uintptr_t>(src[i]) % 16 != 0)
      throw config_error("launch_pull_blocks: source block " + std::to_string(i) + " at " + address(src[i]) +
                         " is not 16-byte aligned");
  pull_params p;
  p.block_bytes = block_bytes;
  for (index_t b0 = 0; b0 < count; b0 += max_pull_blocks) {
    const int n = int(count - b0 < max_pull_blocks ? count - b0 : max_pull_blocks);
    for (int k = 0; k < n; ++k) p.src[k] = src[b0 + k];
    p.dst = static_cast<unsigned char*>(dst) + b0 * block_bytes;
    p.count = n;
    const unsigned grid = unsigned(n < max_ctas ? n : max_ctas);
    detail::pull_blocks_kernel<><<<grid, pull_threads_per_cta, 0, stream>>>(p);
    WS_CUDA_CHECK_LAST();
  }
}

}  // namespace writescope::gpu

/// Explicitly instantiates every layout-dependent launcher for the layout
/// given as the (possibly comma-containing) argument. Global namespace scope.
#define WS_CUDA_INSTANTIATE(...)                                                                                  \
  template void writescope::gpu::launch_attend<__VA_ARGS__>(const writescope::gpu::attend_params&, cudaStream_t); \
  template void writescope::gpu::launch_attend_listed<__VA_ARGS__>(const writescope::gpu::attend_params&,         \
                                                                   cudaStream_t);                                 \
  template void writescope::gpu::launch_fold<__VA_ARGS__>(const writescope::gpu::fold_params&, cudaStream_t);     \
  template void writescope::gpu::launch_init_state<__VA_ARGS__>(float*, float*, writescope::index_t, cudaStream_t); \
  template void writescope::gpu::launch_merge<__VA_ARGS__>(const writescope::gpu::merge_params&, cudaStream_t);   \
  template void writescope::gpu::launch_fold_merge<__VA_ARGS__>(const writescope::gpu::fold_merge_params&,       \
                                                                cudaStream_t);                                    \
  template void writescope::gpu::launch_merge_rows<__VA_ARGS__>(const writescope::gpu::merge_rows_params&,       \
                                                                cudaStream_t);                                    \
  template void writescope::gpu::launch_scatter<__VA_ARGS__>(const writescope::gpu::scatter_params&, cudaStream_t); \
  WS_CUDA_INSTANTIATE_RESIDENT(__VA_ARGS__)

/// Explicitly instantiates the attention kernels with a slow consumer
/// (launch_attend_slow) for the layout given as the argument: only programs
/// whose backend has the mutation-test hooks (cuda_test_hooks) need it.
#define WS_CUDA_INSTANTIATE_TEST_HOOKS(...)                                                                \
  template void writescope::gpu::launch_attend_slow<__VA_ARGS__>(const writescope::gpu::attend_params&, bool, \
                                                                 long long, cudaStream_t);

/// Explicitly instantiates the layout-independent launchers. Exactly once per program.
#define WS_CUDA_INSTANTIATE_COMMON()                                                                      \
  template void writescope::gpu::launch_fill_u16<void>(std::uint16_t*, writescope::index_t, std::uint16_t, \
                                                       cudaStream_t);                                      \
  template void writescope::gpu::launch_spin<void>(long long, cudaStream_t);                              \
  template void writescope::gpu::launch_wait_host_counters<void>(const unsigned long long*, int,           \
                                                                 unsigned long long, cudaStream_t);       \
  template void writescope::gpu::launch_pull_blocks<void>(const void* const*, writescope::index_t, void*,  \
                                                          writescope::index_t, int, cudaStream_t);

// The HBM-resident region's tensor-core kernels (launch_resident_attend,
// launch_resident_fold; WS_CUDA_INSTANTIATE_RESIDENT, part of WS_CUDA_INSTANTIATE).
#include "kernels_resident.cuh"
