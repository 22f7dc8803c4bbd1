// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/ops.cu — the CUDA path's model kernels (nvcc only): a grid-stride
// launcher for the element-wise functors of kernel_math.hpp, the two row
// reductions (RMSNorm, causal softmax of prefill scores) and the grouped
// experts of a decode step. The math of every
// element is in kernel_math.hpp, shared with the host emulation.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cuda/atomic>

#include <algorithm>
#include <string>

#include <writescope/cuda/cuda_error.hpp>

#include "ops.hpp"

namespace ws_moe::gpu {
namespace {

constexpr int threads = 256;

template <class Op>
__global__ void __launch_bounds__(threads) elementwise_kernel(const Op op, idx n) {
  const idx stride = idx(gridDim.x) * blockDim.x;
  for (idx i = idx(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) op(i);
}

unsigned grid_for(idx n) {
  const idx blocks = (n + threads - 1) / threads;
  return unsigned(blocks < 1 ? 1 : (blocks > (idx(1) << 20) ? (idx(1) << 20) : blocks));
}

// Block reductions over `threads` threads (CUB's BlockReduce: warp shuffles,
// then one shared-memory stage); every thread gets the result.
using block_sum_reduce = cub::BlockReduce<double, threads>;
using block_max_reduce = cub::BlockReduce<float, threads>;

template <class T>
struct block_reduce_smem {
  typename cub::BlockReduce<T, threads>::TempStorage temp;
  T result;
};

__device__ double block_sum(double v, block_reduce_smem<double>& sm) {
  const double r = block_sum_reduce(sm.temp).Sum(v);
  if (threadIdx.x == 0) sm.result = r;
  __syncthreads();
  const double all = sm.result;
  __syncthreads();  // the storage may be reused
  return all;
}

__device__ float block_max(float v, block_reduce_smem<float>& sm) {
  const float r = block_max_reduce(sm.temp).Reduce(v, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) sm.result = r;
  __syncthreads();
  const float all = sm.result;
  __syncthreads();
  return all;
}

__global__ void __launch_bounds__(threads) rms_norm_kernel(const rms_norm_params p) {
  __shared__ block_reduce_smem<double> red;
  const idx row = blockIdx.x;
  const float* x = p.x + row * p.x_stride;
  float* y = p.y + row * p.y_stride;
  double ss = 0.0;
  for (int e = int(threadIdx.x); e < p.dim; e += threads) ss += double(x[e]) * double(x[e]);
  const float inv = rms_inverse(block_sum(ss, red), p.dim, p.eps);
  // Each element is read and then written by the same thread (y may alias x).
  for (int e = int(threadIdx.x); e < p.dim; e += threads) y[e] = p.w[e] * __fmul_rn(x[e], inv);
}

// Short rows (dim <= rms_warp_max_dim, e.g. Qwen3's per-head q/k norm over
// 128): one warp per row, eight rows per CTA; the same double sum of squares
// and the same per-element formula as rms_norm_kernel.
constexpr int rms_warp_max_dim = 512;

__global__ void __launch_bounds__(threads) rms_norm_warp_kernel(const rms_norm_params p) {
  const idx row = idx(blockIdx.x) * (threads / 32) + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int lane = int(threadIdx.x % 32);
  const float* x = p.x + row * p.x_stride;
  float* y = p.y + row * p.y_stride;
  double ss = 0.0;
  for (int e = lane; e < p.dim; e += 32) ss += double(x[e]) * double(x[e]);
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = rms_inverse(ss, p.dim, p.eps);
  for (int e = lane; e < p.dim; e += 32) y[e] = p.w[e] * __fmul_rn(x[e], inv);
}

__global__ void __launch_bounds__(threads) causal_softmax_kernel(const softmax_params p) {
  __shared__ block_reduce_smem<double> red_d;
  __shared__ block_reduce_smem<float> red_f;
  const idx row = blockIdx.x;
  const idx valid = softmax_valid(p, row);
  const float* s = p.s + row * p.keys;
  float m = -INFINITY;
  for (idx j = threadIdx.x; j < valid; j += threads) m = fmaxf(m, __fmul_rn(s[j], p.scale));
  m = block_max(m, red_f);
  double sum = 0.0;
  for (idx j = threadIdx.x; j < valid; j += threads) sum += double(expf(__fsub_rn(__fmul_rn(s[j], p.scale), m)));
  const float inv = float(1.0 / block_sum(sum, red_d));
  for (idx j = threadIdx.x; j < p.keys; j += threads) {
    const float v = j < valid ? __fmul_rn(expf(__fsub_rn(__fmul_rn(s[j], p.scale), m)), inv) : 0.0f;
    store_from_float(p.p, p.p_type, row * p.keys + j, v);
  }
}

// Grouped experts (kernel_math.hpp expert_gemv_params): one warp per output
// element column o of one expert (blockIdx.y), `rows_per_pass` of the expert's
// rows at a time. Each lane reads 8 consecutive bf16 weights (16 bytes) per
// step, so a warp streams a weight row in 512-byte coalesced pieces; the few x
// rows come through L1 (every warp of the block reads the same ones). fp32
// accumulation; the warp's partial sums meet in a butterfly reduction.
constexpr int gemv_warps = threads / 32;
constexpr int rows_per_pass = 8;

__device__ inline void unpack_bf16x8(const uint4 v, float* f) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ inline float warp_sum(float v) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
  return v;
}

template <bool GateUp>
__global__ void __launch_bounds__(threads) expert_gemv_kernel(const expert_gemv_params p) {
  int e = int(blockIdx.y);
  if (p.block_experts != nullptr) {  // one block row per routed pair: the first of each expert runs it
    e = int(p.block_experts[blockIdx.y]);
    if (blockIdx.y > 0 && int(p.block_experts[blockIdx.y - 1]) == e) return;
  }
  const void* wp = p.w[e];
  if (wp == nullptr) return;
  const int r0 = p.offsets[e], r1 = p.offsets[e + 1];
  const int o = int(blockIdx.x) * gemv_warps + int(threadIdx.x) / 32;
  if (r1 <= r0 || o >= p.out) return;
  const int lane = int(threadIdx.x) % 32;
  const auto* w = static_cast<const std::uint16_t*>(wp) + idx(o) * p.in;
  const std::uint16_t* u = nullptr;
  if constexpr (GateUp) u = static_cast<const std::uint16_t*>(p.up[e]) + idx(o) * p.in;
  for (int rb = r0; rb < r1; rb += rows_per_pass) {
    const int nr = min(rows_per_pass, r1 - rb);
    float ag[rows_per_pass], au[rows_per_pass];
#pragma unroll
    for (int r = 0; r < rows_per_pass; ++r) ag[r] = au[r] = 0.0f;
#pragma unroll 4
    for (int c = lane * 8; c < p.in; c += 32 * 8) {
      float wf[8], uf[8];
      unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(w + c)), wf);
      if constexpr (GateUp) unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(u + c)), uf);
#pragma unroll
      for (int r = 0; r < rows_per_pass; ++r) {
        if (r < nr) {
          const float4* xr = reinterpret_cast<const float4*>(p.x + idx(rb + r) * p.x_stride + c);
          const float4 a = xr[0], b = xr[1];
          const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float xi = expert_input(xv[i], p.round_x);
            ag[r] = fmaf(xi, wf[i], ag[r]);
            if constexpr (GateUp) au[r] = fmaf(xi, uf[i], au[r]);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < rows_per_pass; ++r) {
      if (r < nr) {
        const float g = warp_sum(ag[r]);
        float v = g;
        if constexpr (GateUp) v = silu(g) * warp_sum(au[r]);
        if (lane == 0) p.y[idx(rb + r) * p.y_stride + o] = v;
      }
    }
  }
}


// The router's softmax + top-k (route_op's semantics), one warp per token row:
// lane j holds experts j, j + 32, ... (at most route_op::max_experts / 32 each).
// Max and the double sum of exponentials are warp reductions; every probability
// is route_op::prob's formula; the k rounds each take the warp's largest
// untaken probability, ties to the lower expert index, as route_op does. Only
// the order of the double sum differs from the serial functor.
constexpr int route_per_lane = route_op::max_experts / 32;

__global__ void __launch_bounds__(threads) route_warp_kernel(const route_op p, idx n) {
  __shared__ float gmax_shared[threads / 32][route_op::max_groups];
  const int warp = int(threadIdx.x / 32);
  const idx t = idx(blockIdx.x) * (threads / 32) + warp;
  if (t >= n) return;
  const int lane = int(threadIdx.x % 32);
  const float* lg = p.logits + t * p.E;
  float v[route_per_lane];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < route_per_lane; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < p.E ? lg[e] : -INFINITY;
    m = fmaxf(m, v[j]);
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  double sum = 0.0;
  double ex[route_per_lane];  // each exponential once: the sum's and the probability's are the same value
#pragma unroll
  for (int j = 0; j < route_per_lane; ++j) {
    ex[j] = lane + 32 * j < p.E ? exp(double(v[j]) - double(m)) : 0.0;
    sum += ex[j];
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
  for (int j = 0; j < route_per_lane; ++j)
    if (lane + 32 * j < p.E) v[j] = float(ex[j] / sum);  // route_op::prob
  const int per = p.group_limited ? p.E / p.n_group : p.E;
  unsigned long long kept_groups = ~0ull;
  if (p.group_limited) {
    for (int g = 0; g < p.n_group; ++g) {
      float best = -INFINITY;
#pragma unroll
      for (int j = 0; j < route_per_lane; ++j) {
        const int e = lane + 32 * j;
        if (e < p.E && e / per == g) best = fmaxf(best, v[j]);
      }
      for (int o = 16; o > 0; o >>= 1) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, o));
      if (lane == 0) gmax_shared[warp][g] = best;
    }
    __syncwarp();
    if (lane == 0) {  // route_op's selection: stable descending, ties to the lower group
      const float* gmax = gmax_shared[warp];
      kept_groups = 0;
      for (int r = 0; r < p.topk_group; ++r) {
        int bg = -1;
        for (int g = 0; g < p.n_group; ++g)
          if (!((kept_groups >> g) & 1ull) && (bg < 0 || gmax[g] > gmax[bg])) bg = g;
        kept_groups |= 1ull << bg;
      }
    }
    kept_groups = __shfl_sync(0xffffffffu, kept_groups, 0);
  }
  unsigned taken = 0;  // bit j: expert lane + 32 j taken
  float wsum = 0.0f;
  for (int r = 0; r < p.k; ++r) {
    float bv = -INFINITY;
    int be = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < route_per_lane; ++j) {
      const int e = lane + 32 * j;
      if (e >= p.E || ((taken >> j) & 1u)) continue;
      const float x = ((kept_groups >> (e / per)) & 1ull) ? v[j] : 0.0f;
      if (x > bv) {  // j ascending = e ascending within the lane: ties keep the lower index
        bv = x;
        be = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) {
        bv = ov;
        be = oe;
      }
    }
    if ((be & 31) == lane) taken |= 1u << (be / 32);
    if (lane == 0) {
      p.experts[t * p.k + r] = be;
      p.weights[t * p.k + r] = bv;
    }
    wsum += bv;
  }
  if (lane == 0)
    for (int r = 0; r < p.k; ++r) {
      float w = p.weights[t * p.k + r];
      if (p.renorm) w /= wsum;
      if (p.apply_scale) w *= p.scale;
      p.weights[t * p.k + r] = w;
    }
}
}  // namespace

template <class Op>
void launch_elementwise(const Op& op, idx n, cudaStream_t stream) {
  if (n <= 0) return;
  elementwise_kernel<Op><<<grid_for(n), threads, 0, stream>>>(op, n);
  WS_CUDA_CHECK_LAST();
}

void launch_rms_norm(const rms_norm_params& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.dim <= 0) return;
  if (p.rows > idx(0x7fffffff)) throw writescope::config_error("rms_norm: more than 2^31-1 rows in one launch");
  if (p.dim <= rms_warp_max_dim) {
    const idx rows_per_cta = threads / 32;
    const idx ctas = (p.rows + rows_per_cta - 1) / rows_per_cta;
    rms_norm_warp_kernel<<<unsigned(ctas), threads, 0, stream>>>(p);
  } else {
    rms_norm_kernel<<<unsigned(p.rows), threads, 0, stream>>>(p);
  }
  WS_CUDA_CHECK_LAST();
}

void launch_causal_softmax(const softmax_params& p, cudaStream_t stream) {
  if (p.rows_total <= 0 || p.keys <= 0) return;
  if (p.rows_total > idx(0x7fffffff)) throw writescope::config_error("causal_softmax: more than 2^31-1 rows in one launch");
  causal_softmax_kernel<<<unsigned(p.rows_total), threads, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

void launch_expert_gemv(const expert_gemv_params& p, cudaStream_t stream) {
  if (p.experts <= 0 || p.out <= 0) return;
  if (p.in <= 0 || p.in % 8 != 0 || p.x_stride % 4 != 0)
    throw writescope::config_error("expert_gemv: in (" + std::to_string(p.in) + ") must be a positive multiple of 8 and x_stride (" +
                                   std::to_string(p.x_stride) + ") a multiple of 4");
  if (p.experts > 65535) throw writescope::config_error("expert_gemv: more than 65535 experts in one launch");
  if (p.block_experts != nullptr && (p.blocks < 1 || p.blocks > 65535))
    throw writescope::config_error("expert_gemv: " + std::to_string(p.blocks) +
                                   " block rows over the routed pairs (needs 1 to 65535)");
  const unsigned rows_y = unsigned(p.block_experts != nullptr ? p.blocks : p.experts);
  const dim3 grid(unsigned((p.out + gemv_warps - 1) / gemv_warps), rows_y);
  if (p.up != nullptr)
    expert_gemv_kernel<true><<<grid, threads, 0, stream>>>(p);
  else
    expert_gemv_kernel<false><<<grid, threads, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

void launch_route(const route_op& p, idx n, cudaStream_t stream) {
  if (n <= 0) return;
  if (p.E < 1 || p.E > route_op::max_experts || p.k < 1 || p.k > p.E)
    throw writescope::config_error("route: " + std::to_string(p.E) + " experts, top-" + std::to_string(p.k) +
                                   " (needs 1 <= k <= experts <= " + std::to_string(route_op::max_experts) + ")");
  if (p.group_limited && (p.n_group < 1 || p.n_group > route_op::max_groups || p.E % p.n_group != 0 ||
                          p.topk_group < 1 || p.topk_group > p.n_group))
    throw writescope::config_error("route: group-limited routing over " + std::to_string(p.n_group) + " groups, top-" +
                                   std::to_string(p.topk_group) + " groups, " + std::to_string(p.E) +
                                   " experts (needs groups dividing the experts, at most " +
                                   std::to_string(route_op::max_groups) + ")");
  if (n > idx(0x7fffffff)) throw writescope::config_error("route: more than 2^31-1 rows in one launch");
  const idx rows_per_cta = threads / 32;
  route_warp_kernel<<<unsigned((n + rows_per_cta - 1) / rows_per_cta), threads, 0, stream>>>(p, n);
  WS_CUDA_CHECK_LAST();
}

namespace {
// launch_group_pairs: one CTA, thread p owns pair p. Stable rank of pair p =
// pairs with a smaller key + pairs before p with the same key (cub's stable
// radix sort order); then expert_bounds_op and scatter_rows_op on the sorted
// tables, each thread its own element(s), with the same arithmetic.
__global__ void __launch_bounds__(group_pairs_max) group_pairs_kernel(const int* experts, const float* weights, int n,
                                                                      int k, int E, unsigned* sorted_keys,
                                                                      int* sorted_pairs, int* first, int* src_rows,
                                                                      int* comb_rows, float* comb_w) {
  __shared__ unsigned keys[group_pairs_max];
  __shared__ unsigned skeys[group_pairs_max];
  __shared__ int spairs[group_pairs_max];
  __shared__ int sfirst[route_op::max_experts + 1];
  const int p = int(threadIdx.x);
  if (p < n) keys[p] = unsigned(experts[p]);
  __syncthreads();
  if (p < n) {
    const unsigned key = keys[p];
    int rank = 0;
    for (int q = 0; q < n; ++q) {
      const unsigned kq = keys[q];
      rank += (kq < key || (kq == key && q < p)) ? 1 : 0;
    }
    skeys[rank] = key;
    spairs[rank] = p;
    sorted_keys[rank] = key;
    sorted_pairs[rank] = p;
  }
  __syncthreads();
  for (int i = p; i <= n; i += int(blockDim.x)) {  // expert_bounds_op(i), i = 0..n
    const auto clamp = [&](unsigned key) { return key > unsigned(E) ? E : int(key); };
    const int prev = i == 0 ? -1 : clamp(skeys[i - 1]);
    const int cur = i == n ? E : clamp(skeys[i]);
    for (int e = prev + 1; e <= cur; ++e) {
      sfirst[e] = i;
      first[e] = i;
    }
  }
  __syncthreads();
  if (p < n) {  // scatter_rows_op(p) with row0 = first
    const int pair = spairs[p];
    const int e = int(skeys[p]);
    const int row = sfirst[e] + (p - sfirst[e]);
    const int t = pair / k;
    src_rows[row] = t;
    int j = 0;
    for (int s = 0; s < k; ++s) j += int(keys[t * k + s]) < e ? 1 : 0;
    comb_rows[t * k + j] = row;
    comb_w[t * k + j] = weights[pair];
  }
}
}  // namespace

void launch_group_pairs(const int* experts, const float* weights, idx n, int k, int E, unsigned* sorted_keys,
                        int* sorted_pairs, int* first, int* src_rows, int* comb_rows, float* comb_w,
                        cudaStream_t stream) {
  if (n < 1 || n > group_pairs_max)
    throw writescope::config_error("group_pairs: " + std::to_string(n) + " routed pairs (one launch takes 1 to " +
                                   std::to_string(group_pairs_max) + ")");
  if (E < 1 || E > route_op::max_experts)
    throw writescope::config_error("group_pairs: " + std::to_string(E) + " experts (needs 1 to " +
                                   std::to_string(route_op::max_experts) + ")");
  if (k < 1 || n % k != 0)
    throw writescope::config_error("group_pairs: " + std::to_string(n) + " pairs are not whole tokens of " +
                                   std::to_string(k) + " slots");
  const idx threads = std::min<idx>(group_pairs_max, (n + 1 + 31) / 32 * 32);  // a thread per pair, whole warps
  group_pairs_kernel<<<1, unsigned(threads), 0, stream>>>(experts, weights, int(n), k, E, sorted_keys, sorted_pairs,
                                                          first, src_rows, comb_rows, comb_w);
  WS_CUDA_CHECK_LAST();
}

namespace {
// launch_argmax_rows: grid (chunks, rows); each CTA reduces its chunk of one
// row to the largest argmax_key (CUB block reduction), then one device-scope
// atomic max (libcu++) folds the chunks. Max is associative and commutative
// and the keys are distinct per column, so the result is exact and
// deterministic.
__global__ void __launch_bounds__(threads) argmax_rows_kernel(const float* x, idx cols, idx chunk,
                                                              unsigned long long* keys) {
  using block_key_reduce = cub::BlockReduce<unsigned long long, threads>;
  __shared__ typename block_key_reduce::TempStorage tmp;
  const idx row = idx(blockIdx.y);
  const idx c0 = idx(blockIdx.x) * chunk;
  const idx c1 = c0 + chunk < cols ? c0 + chunk : cols;
  const float* xr = x + row * cols;
  unsigned long long best = 0;
  for (idx c = c0 + threadIdx.x; c < c1; c += threads) {
    const unsigned long long k = argmax_key(xr[c], c);
    best = k > best ? k : best;
  }
  best = block_key_reduce(tmp).Reduce(best, [](unsigned long long a, unsigned long long b) { return a > b ? a : b; });
  if (threadIdx.x == 0) cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>(keys[row]).fetch_max(best);
}
}  // namespace

void launch_argmax_rows(const float* x, idx rows, idx cols, std::uint64_t* keys, cudaStream_t stream) {
  if (rows < 0 || rows > 65535)
    throw writescope::config_error("argmax_rows: " + std::to_string(rows) + " rows (one launch takes 0 to 65535)");
  if (cols < 1 || cols > idx(0x7fffffff))
    throw writescope::config_error("argmax_rows: " + std::to_string(cols) + " columns (needs 1 to 2^31-1)");
  if (rows == 0) return;
  static_assert(sizeof(unsigned long long) == sizeof(std::uint64_t));
  WS_CUDA_TRY(cudaMemsetAsync(keys, 0, std::size_t(rows) * sizeof(std::uint64_t), stream));
  // chunks of at least 16 columns per thread, at most 64 chunks per row
  idx chunks = (cols + idx(threads) * 16 - 1) / (idx(threads) * 16);
  chunks = chunks < 1 ? 1 : (chunks > 64 ? 64 : chunks);
  const idx chunk = (cols + chunks - 1) / chunks;
  argmax_rows_kernel<<<dim3(unsigned(chunks), unsigned(rows)), threads, 0, stream>>>(
      x, cols, chunk, reinterpret_cast<unsigned long long*>(keys));
  WS_CUDA_CHECK_LAST();
}

std::size_t sort_pairs_temp_bytes(idx n) {
  if (n > idx(0x7fffffff)) throw writescope::config_error("sort_pairs: more than 2^31-1 items");
  std::size_t bytes = 0;
  WS_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const unsigned*>(nullptr),
                                              static_cast<unsigned*>(nullptr), static_cast<const int*>(nullptr),
                                              static_cast<int*>(nullptr), int(n)));
  return bytes;
}

void launch_sort_pairs(const unsigned* keys_in, unsigned* keys_out, const int* values_in, int* values_out, idx n,
                       void* temp, std::size_t temp_bytes, cudaStream_t stream) {
  if (n <= 0) return;
  const std::size_t need = sort_pairs_temp_bytes(n);
  if (temp_bytes < need)
    throw writescope::config_error("sort_pairs: " + std::to_string(temp_bytes) + " bytes of scratch, " +
                                   std::to_string(need) + " needed for " + std::to_string(n) + " items");
  WS_CUDA_TRY(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in, values_out, int(n), 0,
                                              32, stream));
}

template void launch_elementwise<embed_op>(const embed_op&, idx, cudaStream_t);
template void launch_elementwise<rope_op>(const rope_op&, idx, cudaStream_t);
template void launch_elementwise<silu_mul_op>(const silu_mul_op&, idx, cudaStream_t);
template void launch_elementwise<add_op>(const add_op&, idx, cudaStream_t);
template void launch_elementwise<bias_op>(const bias_op&, idx, cudaStream_t);
template void launch_elementwise<convert_op>(const convert_op&, idx, cudaStream_t);
template void launch_elementwise<widen_op>(const widen_op&, idx, cudaStream_t);
template void launch_elementwise<gather_rows_op>(const gather_rows_op&, idx, cudaStream_t);
template void launch_elementwise<combine_op>(const combine_op&, idx, cudaStream_t);
template void launch_elementwise<iota_op>(const iota_op&, idx, cudaStream_t);
template void launch_elementwise<expert_bounds_op>(const expert_bounds_op&, idx, cudaStream_t);
template void launch_elementwise<scatter_rows_op>(const scatter_rows_op&, idx, cudaStream_t);
template void launch_elementwise<combine_x4_op>(const combine_x4_op&, idx, cudaStream_t);
template void launch_elementwise<gather_rows_bf16x4_op>(const gather_rows_bf16x4_op&, idx, cudaStream_t);
template void launch_elementwise<silu_mul_bf16x4_op>(const silu_mul_bf16x4_op&, idx, cudaStream_t);
template void launch_elementwise<fill_op>(const fill_op&, idx, cudaStream_t);
template void launch_elementwise<host_rows_op>(const host_rows_op&, idx, cudaStream_t);
template void launch_elementwise<random_op>(const random_op&, idx, cudaStream_t);
template void launch_elementwise<pack_q_op>(const pack_q_op&, idx, cudaStream_t);
template void launch_elementwise<unpack_o_op>(const unpack_o_op&, idx, cudaStream_t);
template void launch_elementwise<mla_prefill_kv_op>(const mla_prefill_kv_op&, idx, cudaStream_t);

}  // namespace ws_moe::gpu
