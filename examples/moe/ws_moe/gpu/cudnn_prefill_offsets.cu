// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/cudnn_prefill_offsets.cu — the small kernel that turns the
// prefill's token offsets into cuDNN's ragged element offsets and sequence
// lengths (contract in cudnn_prefill.hpp, cudnn_prefill_detail), and the
// workspace layout it writes. No cuDNN headers.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <writescope/cuda/cuda_error.hpp>

#include "cudnn_prefill.hpp"

namespace ws_moe::gpu::cudnn_prefill_detail {
namespace {

constexpr std::size_t align_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

template <class Off>
__global__ void ragged_offsets_kernel(const int* __restrict__ seq_offsets, int num_seqs, int batch, int max_seq_tokens,
                                      idx q_ts, idx k_ts, idx v_ts, idx o_ts, idx lse_ts, bool with_lse,
                                      Off* __restrict__ q_off, Off* __restrict__ k_off, Off* __restrict__ v_off,
                                      Off* __restrict__ o_off, Off* __restrict__ lse_off, int* __restrict__ seq_len) {
  for (int i = int(blockIdx.x * blockDim.x + threadIdx.x); i <= batch; i += int(gridDim.x * blockDim.x)) {
    const idx row = seq_offsets[min(i, num_seqs)];
    q_off[i] = Off(row * q_ts);
    k_off[i] = Off(row * k_ts);
    v_off[i] = Off(row * v_ts);
    o_off[i] = Off(row * o_ts);
    if (with_lse) lse_off[i] = Off(row * lse_ts);
    if (i < batch) {
      int len = 0;
      if (i < num_seqs) len = min(max(seq_offsets[i + 1] - seq_offsets[i], 0), max_seq_tokens);
      seq_len[i] = len;
    }
  }
}

template <class Off>
void launch_typed(const int* seq_offsets, int num_seqs, int batch, int max_seq_tokens, const idx ts[5], bool with_lse,
                  void* aux, const aux_layout& l, cudaStream_t stream) {
  auto* base = static_cast<unsigned char*>(aux);
  const int threads = 256;
  const int blocks = std::min((batch + threads) / threads, 64);
  ragged_offsets_kernel<Off><<<blocks, threads, 0, stream>>>(
      seq_offsets, num_seqs, batch, max_seq_tokens, ts[0], ts[1], ts[2], ts[3], ts[4], with_lse,
      reinterpret_cast<Off*>(base + l.q_off), reinterpret_cast<Off*>(base + l.k_off),
      reinterpret_cast<Off*>(base + l.v_off), reinterpret_cast<Off*>(base + l.o_off),
      reinterpret_cast<Off*>(base + l.lse_off), reinterpret_cast<int*>(base + l.seq_len));
  WS_CUDA_CHECK_LAST();
}

}  // namespace

aux_layout aux_layout_for(int batch, int offset_bytes) {
  const std::size_t offsets = align_up(std::size_t(batch + 1) * std::size_t(offset_bytes), 256);
  aux_layout l{};
  l.q_off = 0;
  l.k_off = l.q_off + offsets;
  l.v_off = l.k_off + offsets;
  l.o_off = l.v_off + offsets;
  l.lse_off = l.o_off + offsets;
  l.seq_len = l.lse_off + offsets;
  l.end = l.seq_len + align_up(std::size_t(batch) * sizeof(int), 256);
  return l;
}

void launch_ragged_offsets(const int* seq_offsets, int num_seqs, int batch, int max_seq_tokens, const idx token_strides[5],
                           bool with_lse, int offset_bytes, void* aux, const aux_layout& layout, cudaStream_t stream) {
  if (offset_bytes == 4)
    launch_typed<std::int32_t>(seq_offsets, num_seqs, batch, max_seq_tokens, token_strides, with_lse, aux, layout, stream);
  else
    launch_typed<std::int64_t>(seq_offsets, num_seqs, batch, max_seq_tokens, token_strides, with_lse, aux, layout, stream);
}

}  // namespace ws_moe::gpu::cudnn_prefill_detail
