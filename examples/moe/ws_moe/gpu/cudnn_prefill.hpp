// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/cudnn_prefill.hpp — the causal prefill attention of
// flash_prefill.hpp run by cuDNN's fused SDPA (cudnn-frontend graph API), with
// bf16 output: the parameter block, its checks and the class that builds,
// caches and runs the cuDNN plans. Defined in cudnn_prefill.cpp (the only file
// that includes cudnn_frontend) and cudnn_prefill_offsets.cu (the offsets
// kernel). Built only where CMake finds cuDNN and cudnn-frontend
// (WS_MOE_HAVE_CUDNN=1, target ws_moe_cudnn_prefill); needs the CUDA runtime
// headers, not cuDNN's.
//
// Contract: that of flash_prefill.hpp (a ragged batch of whole prompts;
// sequence s owns the token rows [seq_offsets[s], seq_offsets[s+1]); query
// token t attends keys 0..t of its own sequence; GQA with query head h reading
// KV head h / (hq / hkv); element (token, head, e) at
// ptr[token*token_stride + head*head_stride + e], strides in elements), except:
//   * out is bf16 (round to nearest even of the fp32 result), for the o_proj
//     GEMM's bf16 input; lse stays optional fp32 [tokens][hq] (natural log).
//   * Rows outside every sequence and the padding between heads or tokens of
//     out are never written (cuDNN's ragged layout writes only the rows of
//     each sequence's length).
//   * A sequence longer than max_seq_tokens is cut to its first
//     max_seq_tokens rows (the rest is not written); one of negative length
//     counts as empty. check_flash_prefill_offsets checks a host copy.
//
// How it maps onto cuDNN: Q, K, V and O are [b, h, s, d] tensors in the
// ragged (THD) layout: for each of b sequences a ragged offset (elements from
// the base pointer) = seq_offsets[i] * token_stride, head stride and token
// stride as given; a padding mask with seq_len_q = seq_len_kv = the sequence's
// length; the causal mask (top-left diagonal, right bound 0); bf16 in and out,
// fp32 scores and accumulation. b and s are the number of sequences and
// max_seq_tokens rounded up to powers of two (s at least 64); the extra
// sequences have length 0. A small kernel (cudnn_prefill_offsets.cu) writes
// the offsets and lengths from the device seq_offsets into the workspace,
// on the caller's stream, before cuDNN's kernel.
//
// Memory: the caller owns every buffer, the workspace included; asks
// workspace_bytes(p) up front and passes at least that much (device memory,
// 256-byte aligned). run() allocates no device memory. The cuDNN handle made
// by the constructor allocates cuDNN's own small per-handle state once; the
// plan cache lives in host memory.
//
// Errors (all derived from writescope::error):
//   * writescope::config_error: parameters that break a rule of ours (the
//     message names the value and the rule); nothing is launched.
//   * cudnn_unsupported_error (a config_error): cuDNN has no plan for the
//     shape (the message names the shape and quotes cuDNN's reason);
//     supported(p) returns false instead, so that the caller can fall back to
//     launch_flash_prefill.
//   * cudnn_unavailable_error: libcudnn.so.9 could not be loaded, or is older
//     than 9.6.0; available() returns false instead.
//   * cudnn_error: a cuDNN call failed at run time (status and message).
//   * writescope::cuda_error: the offsets kernel's launch failed.
#pragma once


#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <writescope/error.hpp>

#include "flash_prefill.hpp"
#include "kernel_math.hpp"

// The CUDA runtime's stream handle type (cudaStream_t is CUstream_st*),
// declared here so that host-only code (the emulated executor, CI without a
// CUDA toolkit) can include this header.
struct CUstream_st;

namespace ws_moe::gpu {

/// cuDNN could not be loaded at run time (no libcudnn.so.9 on the search path,
/// or a version older than the minimum).
class cudnn_unavailable_error : public writescope::error {
 public:
  using writescope::error::error;
};

/// cuDNN refuses the shape (no engine supports it); the caller can use
/// launch_flash_prefill instead.
class cudnn_unsupported_error : public writescope::config_error {
 public:
  using writescope::config_error::config_error;
};

/// A cuDNN call failed while building or running a plan.
class cudnn_error : public writescope::error {
 public:
  using writescope::error::error;
};

/// Causal self-attention of a ragged batch of prompts, bf16 in and out, for
/// cudnn_prefill. The fields mean what those of flash_prefill_params mean;
/// every pointer is device memory.
struct cudnn_prefill_params {
  const std::uint16_t* q = nullptr;  ///< bf16 bits, [tokens][hq][dqk] with the strides below (elements)
  const std::uint16_t* k = nullptr;  ///< bf16 bits, [tokens][hkv][dqk]
  const std::uint16_t* v = nullptr;  ///< bf16 bits, [tokens][hkv][dv]
  std::uint16_t* out = nullptr;      ///< bf16 bits, [tokens][hq][dv]
  float* lse = nullptr;              ///< optional fp32 [tokens][hq], dense: natural-log LSE of the scaled scores; null = not written
  const int* seq_offsets = nullptr;  ///< [num_seqs+1] token offsets of the sequences, device memory
  int num_seqs = 0;
  idx max_seq_tokens = 0;            ///< longest sequence (tokens)
  idx buffer_tokens = 0;             ///< rows of the q, k, v, out (and lse) buffers: every seq_offsets[i] <= buffer_tokens;
                                     ///< bounds the ragged offsets (int32 below 2^31 elements, int64 above)
  int hq = 0, hkv = 0;               ///< query heads; KV heads (hq % hkv == 0)
  int dqk = 0, dv = 0;               ///< head dims of q/k and of v/out
  idx q_token_stride = 0, q_head_stride = 0;  ///< elements
  idx k_token_stride = 0, k_head_stride = 0;
  idx v_token_stride = 0, v_head_stride = 0;
  idx o_token_stride = 0, o_head_stride = 0;
  float scale = 0;                   ///< softmax scale applied to q·k
};

/// The cuDNN parameters of a flash_prefill_params call over the same q, k, v,
/// offsets, shape and strides, writing bf16 `out_bf16` with f's out strides
/// (f.out is not used) and f.lse; `buffer_tokens` as in cudnn_prefill_params.
[[nodiscard]] inline cudnn_prefill_params to_cudnn_prefill_params(const flash_prefill_params& f, std::uint16_t* out_bf16,
                                                                  idx buffer_tokens) {
  cudnn_prefill_params c;
  c.q = f.q;
  c.k = f.k;
  c.v = f.v;
  c.out = out_bf16;
  c.lse = f.lse;
  c.seq_offsets = f.seq_offsets;
  c.num_seqs = f.num_seqs;
  c.max_seq_tokens = f.max_seq_tokens;
  c.buffer_tokens = buffer_tokens;
  c.hq = f.hq;
  c.hkv = f.hkv;
  c.dqk = f.dqk;
  c.dv = f.dv;
  c.q_token_stride = f.q_token_stride;
  c.q_head_stride = f.q_head_stride;
  c.k_token_stride = f.k_token_stride;
  c.k_head_stride = f.k_head_stride;
  c.v_token_stride = f.v_token_stride;
  c.v_head_stride = f.v_head_stride;
  c.o_token_stride = f.o_token_stride;
  c.o_head_stride = f.o_head_stride;
  c.scale = f.scale;
  return c;
}

/// Checks our rules on the host, without touching device memory or cuDNN:
/// num_seqs, max_seq_tokens, buffer_tokens >= 0 and max_seq_tokens <=
/// buffer_tokens <= 2^31-1; hq, hkv > 0 with hq % hkv == 0; positive dims that
/// are multiples of 8 and at most 256; every stride a non-negative multiple of
/// 8 elements (16 bytes: cuDNN's kernels load rows with 16-byte copies and TMA);
/// q, k, v, out 16-byte aligned, lse 4-byte aligned; finite scale > 0;
/// non-null q, k, v, out, seq_offsets when num_seqs > 0. Throws
/// writescope::config_error naming the value and the rule. Whether cuDNN has a
/// plan for the shape is cudnn_prefill::supported.
void check_cudnn_prefill(const cudnn_prefill_params& p);

/// Runs cudnn_prefill_params through cuDNN's fused SDPA. One object per device
/// (the device current at construction); its methods may be called from
/// several host threads (a mutex guards the handle and the plan cache), and
/// each call runs on the stream it is given.
///
/// Plans are built on first use of a shape key and kept: (sequences and
/// max_seq_tokens, both rounded up to powers of two; hq, hkv, dqk, dv; the
/// eight strides; lse or not; int32 or int64 offsets; scale). A build takes
/// cuDNN's heuristics and plan compilation (up to seconds for a new key), so
/// callers that care ask workspace_bytes or supported for their shapes at
/// init; run() on a cached key only fills the variant pack.
class cudnn_prefill {
 public:
  /// Whether libcudnn.so.9 (9.6.0 or newer) loads: tried once per process,
  /// from $WS_CUDNN_LIBRARY when set, then the library CMake found (if any),
  /// then the dynamic loader's search path. Never throws.
  [[nodiscard]] static bool available() noexcept;
  /// Why available() is false (the loader's message or the version found);
  /// empty when it is true.
  [[nodiscard]] static std::string unavailable_reason();
  /// The loaded cuDNN's version (e.g. 91900 for 9.19.0); 0 when not available.
  [[nodiscard]] static long loaded_version() noexcept;

  /// Loads cuDNN (cudnn_unavailable_error when it cannot) and creates a
  /// cuDNN handle on the current device (cudnn_error when that fails).
  cudnn_prefill();
  ~cudnn_prefill();
  cudnn_prefill(const cudnn_prefill&) = delete;
  cudnn_prefill& operator=(const cudnn_prefill&) = delete;
  cudnn_prefill(cudnn_prefill&&) noexcept;
  cudnn_prefill& operator=(cudnn_prefill&&) noexcept;

  /// Whether cuDNN has a plan for p's shape key (builds and caches it on first
  /// use). False when cuDNN refuses it; last_refusal() then says why.
  /// Throws config_error when p breaks check_cudnn_prefill, cudnn_error when
  /// cuDNN fails otherwise.
  [[nodiscard]] bool supported(const cudnn_prefill_params& p);
  /// cuDNN's reason for the last shape supported() refused (empty if none).
  [[nodiscard]] std::string last_refusal() const;

  /// Device workspace bytes run(p, ...) needs: the offsets and lengths (a few
  /// bytes per sequence) plus cuDNN's plan workspace, each 256-byte aligned.
  /// Builds the plan for p's key when it is not cached; throws as supported()
  /// does and cudnn_unsupported_error when cuDNN refuses the shape.
  [[nodiscard]] std::size_t workspace_bytes(const cudnn_prefill_params& p);

  /// Runs p asynchronously on `stream` (cudnnSetStream): the offsets kernel,
  /// then cuDNN's attention; out and lse are complete when the stream reaches
  /// that point. `workspace` is device memory of `workspace_size_bytes` >=
  /// workspace_bytes(p), 256-byte aligned, not used by anything else until the
  /// stream has passed this call. Throws (before launching anything)
  /// config_error for broken rules or a workspace that is too small or
  /// misaligned, cudnn_unsupported_error for a refused shape, cudnn_error when
  /// cuDNN's execute fails. num_seqs == 0 or max_seq_tokens == 0 launches
  /// nothing.
  void run(const cudnn_prefill_params& p, void* workspace, std::size_t workspace_size_bytes, CUstream_st* stream);

  /// Plans built so far (refused keys included).
  [[nodiscard]] std::size_t cached_plans() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

namespace cudnn_prefill_detail {

/// Where run() puts the offsets and lengths in the workspace (bytes from its
/// start), for `batch` (the rounded number of sequences) and `offset_bytes`
/// (4 or 8) per ragged offset.
struct aux_layout {
  std::size_t q_off, k_off, v_off, o_off, lse_off, seq_len, end;
};
[[nodiscard]] aux_layout aux_layout_for(int batch, int offset_bytes);

/// The offsets kernel (cudnn_prefill_offsets.cu): for i in [0, batch]
///   row_i = seq_offsets[min(i, num_seqs)]
///   *_off[i] = row_i * (q, k, v, o token stride; hq for lse)   (elements; as int32 or int64)
/// and for i in [0, batch)
///   seq_len[i] = i < num_seqs ? clamp(seq_offsets[i+1] - seq_offsets[i], 0, max_seq_tokens) : 0
/// written at `aux` + layout (device memory), asynchronously on `stream`.
/// lse_off is written only when with_lse. WS_CUDA_CHECK_LAST on the launch.
void launch_ragged_offsets(const int* seq_offsets, int num_seqs, int batch, int max_seq_tokens, const idx token_strides[5],
                           bool with_lse, int offset_bytes, void* aux, const aux_layout& layout, CUstream_st* stream);

}  // namespace cudnn_prefill_detail

}  // namespace ws_moe::gpu
