// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/emulated_exec.hpp — the executor of the CUDA path's decoder
// (device_decoder.hpp) on the host, for machines without a GPU (CI):
// `ws_decode --device emulated`.
//
// It runs the CUDA path's own code — the same decoder, the same buffers and
// offsets, the same GEMM descriptors (checked by check_gemm, computed by
// reference_gemm) and the same element functors of kernel_math.hpp (run in an
// OpenMP loop instead of a grid) — with writescope's host_backend as the cache
// backend, whose "device" memory is host memory. What it cannot show is
// whether the CUDA kernels, cuBLAS and cuda_backend themselves behave; that is
// what the gpu-labelled tests on the GPU machine are for.
//
// Same interface as cuda_exec (cuda_exec.hpp); see there for the semantics.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <writescope/host_backend.hpp>
#include <writescope/host_memory.hpp>

#include "cudnn_prefill.hpp"
#include "flash_prefill.hpp"
#include "gemm.hpp"
#include "kernel_math.hpp"

namespace ws_moe::gpu {

class emulated_exec {
 public:
  using backend_type = writescope::host_backend;
  using pinned_allocator = writescope::pageable_allocator;
  static constexpr bool is_emulated = true;

  emulated_exec() = default;
  emulated_exec(const emulated_exec&) = delete;
  emulated_exec& operator=(const emulated_exec&) = delete;

  [[nodiscard]] backend_type& backend() noexcept { return backend_; }
  [[nodiscard]] std::string device_name() const { return "emulated on the host (no GPU; --device emulated)"; }

  /// Zero-filled "device" memory owned by the executor; `what` names it in errors.
  void* alloc(idx bytes, const char* what) {
    if (bytes <= 0) return nullptr;
    bufs_.push_back(backend_.allocate_device(bytes, what));
    allocated_ += bytes;
    return bufs_.back().data();
  }
  [[nodiscard]] idx allocated_bytes() const noexcept { return allocated_; }
  /// No device process to measure: -1 (the budget is checked on allocated_bytes()).
  [[nodiscard]] long long process_device_bytes() const noexcept { return -1; }
  [[nodiscard]] std::string process_memory_source() const { return "emulated: no device process"; }

  template <class Op>
  void run(const Op& op, idx n) {
#pragma omp parallel for schedule(static)
    for (idx i = 0; i < n; ++i) op(i);
  }

  void route(const route_op& p, idx n) { run(p, n); }

  void rms_norm(const rms_norm_params& p) {
#pragma omp parallel for schedule(static)
    for (idx r = 0; r < p.rows; ++r) {
      const float* x = p.x + r * p.x_stride;
      float* y = p.y + r * p.y_stride;
      double ss = 0.0;
      for (int e = 0; e < p.dim; ++e) ss += double(x[e]) * double(x[e]);
      const float inv = rms_inverse(ss, p.dim, p.eps);
      for (int e = 0; e < p.dim; ++e) y[e] = p.w[e] * (x[e] * inv);
    }
  }

  void causal_softmax(const softmax_params& p) {
#pragma omp parallel for schedule(static)
    for (idx row = 0; row < p.rows_total; ++row) {
      const idx valid = softmax_valid(p, row);
      const float* s = p.s + row * p.keys;
      float m = -INFINITY;
      for (idx j = 0; j < valid; ++j) m = std::max(m, s[j] * p.scale);
      double sum = 0.0;
      for (idx j = 0; j < valid; ++j) sum += double(expf(s[j] * p.scale - m));
      const float inv = float(1.0 / sum);
      for (idx j = 0; j < p.keys; ++j)
        store_from_float(p.p, p.p_type, row * p.keys + j, j < valid ? expf(s[j] * p.scale - m) * inv : 0.0f);
    }
  }

  void expert_gemv(const expert_gemv_params& p) { expert_gemv_reference(p); }
  /// The bf16-output prefill attention on the host: the flash prefill's host
  /// twin (fp32) rounded to bf16, with the flash twin's parameter checks (the
  /// CUDA executor runs cuDNN's SDPA; this is the CI check of the decoder's
  /// bf16-output path, not of cuDNN).
  static constexpr bool has_bf16_prefill_attention = true;
  std::optional<std::size_t> prepare_bf16_prefill_attention(const cudnn_prefill_params&, std::string&) {
    return std::size_t{0};
  }
  void bf16_prefill_attention(const cudnn_prefill_params& p, void*, std::size_t) {
    if (p.num_seqs == 0) return;
    flash_prefill_params f;
    f.q = p.q;
    f.k = p.k;
    f.v = p.v;
    f.lse = p.lse;
    f.seq_offsets = p.seq_offsets;
    f.num_seqs = p.num_seqs;
    f.max_seq_tokens = p.max_seq_tokens;
    f.hq = p.hq;
    f.hkv = p.hkv;
    f.dqk = p.dqk;
    f.dv = p.dv;
    f.q_token_stride = p.q_token_stride;
    f.q_head_stride = p.q_head_stride;
    f.k_token_stride = p.k_token_stride;
    f.k_head_stride = p.k_head_stride;
    f.v_token_stride = p.v_token_stride;
    f.v_head_stride = p.v_head_stride;
    f.scale = p.scale;
    // fp32 result in a dense [rows][hq][dv] scratch, then rounded into out's strides
    const idx rows = p.seq_offsets[p.num_seqs];
    scratch_.assign(std::size_t(rows * p.hq * p.dv), 0.0f);
    f.out = scratch_.data();
    f.o_head_stride = p.dv;
    f.o_token_stride = idx(p.hq) * p.dv;
    flash_prefill_host(f);
    for (int s = 0; s < p.num_seqs; ++s)
#pragma omp parallel for schedule(static)
      for (idx t = p.seq_offsets[s]; t < p.seq_offsets[s + 1]; ++t)
        for (int h = 0; h < p.hq; ++h)
          for (int e = 0; e < p.dv; ++e)
            p.out[t * p.o_token_stride + h * p.o_head_stride + e] =
                float_to_bf16(scratch_[std::size_t((t * p.hq + h) * p.dv + e)]);
  }
  [[nodiscard]] static long cudnn_version() noexcept { return 0; }

  [[nodiscard]] static std::size_t sort_pairs_temp_bytes(idx) { return 0; }
  /// Stable sort of n (key, value) pairs by key (the CUDA executor's CUB sort, on the host).
  void sort_pairs(const unsigned* keys_in, unsigned* keys_out, const int* values_in, int* values_out, idx n, void*,
                  std::size_t) {
    std::vector<idx> order(std::size_t(std::max<idx>(n, 0)));
    for (idx i = 0; i < n; ++i) order[std::size_t(i)] = i;
    std::stable_sort(order.begin(), order.end(), [&](idx a, idx b) { return keys_in[a] < keys_in[b]; });
    for (idx i = 0; i < n; ++i) {
      keys_out[i] = keys_in[order[std::size_t(i)]];
      values_out[i] = values_in[order[std::size_t(i)]];
    }
  }
  /// Greedy sampling (the CUDA executor's launch_argmax_rows, on the host):
  /// keys[r] = the largest argmax_key of row r of x [rows][cols].
  void argmax_rows(const float* x, idx rows, idx cols, std::uint64_t* keys) {
#pragma omp parallel for schedule(static)
    for (idx r = 0; r < rows; ++r) {
      std::uint64_t best = 0;
      for (idx c = 0; c < cols; ++c) best = std::max(best, argmax_key(x[r * cols + c], c));
      keys[r] = best;
    }
  }
  /// The flash prefill's host twin (fp32 arithmetic on the same bf16 inputs).
  void flash_prefill(const flash_prefill_params& p) {
    check_flash_prefill(p);
    flash_prefill_host(p);
  }

  void gemm(const gemm_desc& d, const char* what) {
    check_gemm(d, what);
    reference_gemm(d);
  }
  void gemm_varying(const gemm_desc& d, const char* what) { gemm(d, what); }  ///< cuda_exec's twin: the same product
  void gemm_batched(const gemm_batched_desc& d, const char* what) {
    check_gemm_batched(d, what);
    reference_gemm_batched(d);
  }

  void check_grouped_gemm() {}  ///< the reference executor computes every type
  void gemm_grouped(const gemm_grouped_desc& d, const char* what) {
    check_gemm_grouped(d, what);
    reference_gemm_grouped(d);
  }

  void h2d(void* dst, const void* src, idx bytes) { copy(dst, src, bytes); }
  void d2h(void* dst, const void* src, idx bytes) { copy(dst, src, bytes); }
  void d2d(void* dst, const void* src, idx bytes) { copy(dst, src, bytes); }
  void copy_2d(void* dst, idx dpitch, const void* src, idx spitch, idx width, idx height) {
    for (idx r = 0; r < height; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, std::size_t(width));
  }
  void zero(void* p, idx bytes) {
    if (bytes > 0) std::memset(p, 0, std::size_t(bytes));
  }
  void sync() {}

  /// Host staging for the CPU experts' copies (page-locked under CUDA).
  writescope::host_allocation host_staging(idx bytes) { return backend_.allocate_staging(bytes); }
  /// Pageable host memory (zero-filled, resident on first touch), e.g. host experts that never stream.
  writescope::host_allocation host_pageable(idx bytes) { return writescope::detail::map_pageable(bytes, "host expert arena"); }
  void d2h_async(void* dst, const void* src, idx bytes) { copy(dst, src, bytes); }
  void h2d_async(void* dst, const void* src, idx bytes) { copy(dst, src, bytes); }
  /// record(): marks the work enqueued so far; wait_recorded(): the host waits for it.
  void record() {}
  void wait_recorded() {}

  /// Expert streaming ring (cuda_exec.hpp): every call completes at once, in call order.
  void ring_setup(int) {}
  void ring_copy(int, void* dst, const void* src, idx bytes) { copy(dst, src, bytes); }
  void ring_acquire(int) {}
  void ring_release(int) {}

  /// Phase timing: host wall-clock at each mark (the work before it is done).
  int mark() {
    marks_.push_back(std::chrono::steady_clock::now());
    return int(marks_.size()) - 1;
  }
  double seconds_between(int a, int b) const {
    return std::chrono::duration<double>(marks_[std::size_t(b)] - marks_[std::size_t(a)]).count();
  }
  void reset_marks() noexcept { marks_.clear(); }

  /// Device memory: none to report under emulation (total = free = 0).
  [[nodiscard]] idx device_total_bytes() const noexcept { return 0; }
  [[nodiscard]] idx device_free_bytes() const noexcept { return 0; }
  /// Bytes in use by this process on the device (emulation: what alloc() handed out).
  [[nodiscard]] idx device_used_bytes() const noexcept { return allocated_; }

 private:
  static void copy(void* dst, const void* src, idx bytes) {
    if (bytes > 0) std::memcpy(dst, src, std::size_t(bytes));
  }

  backend_type backend_;
  std::vector<backend_type::device_buffer> bufs_;
  idx allocated_ = 0;
  std::vector<std::chrono::steady_clock::time_point> marks_;
  std::vector<float> scratch_;  ///< bf16_prefill_attention's fp32 result
};

}  // namespace ws_moe::gpu
