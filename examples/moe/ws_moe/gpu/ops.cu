// ws_moe/gpu/ops.cu — the CUDA path's model kernels (nvcc only): a grid-stride
// launcher for the element-wise functors of kernel_math.hpp and the two row
// reductions (RMSNorm, causal softmax of prefill scores). The math of every
// element is in kernel_math.hpp, shared with the host emulation.
#include <cuda_runtime.h>

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

// Block reductions over `threads` threads; every thread gets the result.
__device__ double block_sum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = threads / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double r = shared[0];
  __syncthreads();
  return r;
}

__device__ float block_max(float v, float* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = threads / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const float r = shared[0];
  __syncthreads();
  return r;
}

__global__ void __launch_bounds__(threads) rms_norm_kernel(const rms_norm_params p) {
  __shared__ double red[threads];
  const idx row = blockIdx.x;
  const float* x = p.x + row * p.x_stride;
  float* y = p.y + row * p.y_stride;
  double ss = 0.0;
  for (int e = int(threadIdx.x); e < p.dim; e += threads) ss += double(x[e]) * double(x[e]);
  const float inv = rms_inverse(block_sum(ss, red), p.dim, p.eps);
  // Each element is read and then written by the same thread (y may alias x).
  for (int e = int(threadIdx.x); e < p.dim; e += threads) y[e] = p.w[e] * __fmul_rn(x[e], inv);
}

__global__ void __launch_bounds__(threads) causal_softmax_kernel(const softmax_params p) {
  __shared__ double red_d[threads];
  __shared__ float red_f[threads];
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
  rms_norm_kernel<<<unsigned(p.rows), threads, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
}

void launch_causal_softmax(const softmax_params& p, cudaStream_t stream) {
  if (p.rows_total <= 0 || p.keys <= 0) return;
  if (p.rows_total > idx(0x7fffffff)) throw writescope::config_error("causal_softmax: more than 2^31-1 rows in one launch");
  causal_softmax_kernel<<<unsigned(p.rows_total), threads, 0, stream>>>(p);
  WS_CUDA_CHECK_LAST();
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
template void launch_elementwise<fill_op>(const fill_op&, idx, cudaStream_t);
template void launch_elementwise<random_op>(const random_op&, idx, cudaStream_t);
template void launch_elementwise<route_op>(const route_op&, idx, cudaStream_t);
template void launch_elementwise<pack_q_op>(const pack_q_op&, idx, cudaStream_t);
template void launch_elementwise<unpack_o_op>(const unpack_o_op&, idx, cudaStream_t);

}  // namespace ws_moe::gpu
