// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/cuda_exec.hpp — the executor of the CUDA path's decoder
// (device_decoder.hpp) on a real GPU: one non-blocking stream on which every
// model kernel, every cuBLAS call and writescope's cuda_backend (its "caller"
// stream) run in order; device memory from cuda_backend::allocate_device;
// cuBLAS with CUBLAS_COMPUTE_32F (bf16 or fp32 inputs, fp32 output; default
// math mode, so no TF32).
//
// Host code (g++): the kernels are reached through ops.hpp (ops.cu) and
// writescope's kernels.hpp (ws_kernels_*.cu). Every CUDA call is checked with
// WS_CUDA_TRY, every cuBLAS call with WS_CUBLAS_TRY; both throw
// writescope::cuda_error naming the call, the status and the source line.
//
// Copies: h2d() and d2h() (pageable host memory) return once the copy is
// complete; the *_async variants need page-locked host memory (host_staging())
// and are ordered on the stream.
//
// CUDA graphs: begin_capture() .. end_capture() records the work enqueued on
// the stream in between (by this thread; cudaStreamCaptureModeThreadLocal)
// into an executable graph instead of running it; launch_graph() enqueues it
// on the stream. cuBLAS runs inside a capture only with a workspace of its own
// (set_blas_workspace: no allocation during the capture). Between the two,
// mark() and record() throw std::logic_error (an event recorded inside a
// capture would not time or signal the work it seems to); a call that cannot
// be captured (h2d, d2h, sync, ...) fails with writescope::cuda_error and
// invalidates the capture, which end_capture() then reports.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <writescope/cuda/cuda_backend.hpp>
#include <writescope/cuda/cuda_error.hpp>
#include <writescope/cuda/pinned_allocators.hpp>

#include "cublas_check.hpp"
#include "cudnn_prefill.hpp"
#include "flash_prefill.hpp"
#include "flash_prefill_launch.hpp"
#include "gemm.hpp"
#include "kernel_math.hpp"
#include "lt_batched_gemm.hpp"
#include "nvml_memory.hpp"
#include "ops.hpp"

namespace ws_moe::gpu {

/// Number of usable CUDA devices; 0 when there is no driver or no device (never throws).
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

class cuda_exec {
 public:
  using backend_type = writescope::cuda_backend;
  using pinned_allocator = writescope::cuda_host_register;
  static constexpr bool is_emulated = false;

  cuda_exec() : stream_(writescope::cuda_detail::unique_stream::create()) {
    WS_CUDA_TRY(cudaFree(nullptr));  // the context exists before the first memory reading
    std::size_t free = 0, total = 0;
    WS_CUDA_TRY(cudaMemGetInfo(&free, &total));
    free_at_start_ = idx(free);
    total_ = idx(total);
    {
      int dev = 0;
      char bus[32] = {};
      WS_CUDA_TRY(cudaGetDevice(&dev));
      WS_CUDA_TRY(cudaDeviceGetPCIBusId(bus, int(sizeof bus), dev));
      nvml_ = std::make_unique<nvml_process_memory>(bus);
    }
    backend_.emplace(stream_.get());
    done_ = writescope::cuda_detail::unique_event::create();
    WS_CUBLAS_TRY(cublasCreate(&blas_));
    WS_CUBLAS_TRY(cublasSetStream(blas_, stream_.get()));
    WS_CUBLAS_TRY(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));
  }
  cuda_exec(const cuda_exec&) = delete;
  cuda_exec& operator=(const cuda_exec&) = delete;
  ~cuda_exec() {
    writescope::cuda_detail::ignore(cudaStreamSynchronize(stream_.get()));
    if (copy_stream_.get() != nullptr) writescope::cuda_detail::ignore(cudaStreamSynchronize(copy_stream_.get()));
    lt_.reset();
    if (blas_ != nullptr) (void)cublasDestroy(blas_);
    bufs_.clear();
    backend_.reset();
  }

  /// Bytes of the cuBLAS workspace the decoder allocates and hands to
  /// set_blas_workspace: 32 MiB, the size cuBLAS recommends on Hopper (4 MiB
  /// on earlier GPUs), on every GPU.
  static constexpr idx blas_workspace_bytes = idx{32} << 20;
  /// cuBLAS's workspace: `bytes` of device memory at `p` (from alloc()), used by
  /// every later cuBLAS call on the stream instead of cuBLAS's own pool, so
  /// that a GEMM allocates nothing inside a graph capture.
  void set_blas_workspace(void* p, idx bytes) { WS_CUBLAS_TRY(cublasSetWorkspace(blas_, p, std::size_t(bytes))); }

  [[nodiscard]] backend_type& backend() noexcept { return *backend_; }
  [[nodiscard]] std::string device_name() const { return std::string(backend_->name()); }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }

  /// Device memory (cudaMalloc through cuda_backend: resource_error naming `what`
  /// and the size when refused), owned by the executor. Not initialised.
  void* alloc(idx bytes, const char* what) {
    if (bytes <= 0) return nullptr;
    bufs_.push_back(backend_->allocate_device(bytes, what));
    allocated_ += bytes;
    return bufs_.back().data();
  }
  [[nodiscard]] idx allocated_bytes() const noexcept { return allocated_; }

  template <class Op>
  void run(const Op& op, idx n) {
    launch_elementwise(op, n, stream_.get());
  }
  void rms_norm(const rms_norm_params& p) { launch_rms_norm(p, stream_.get()); }
  void route(const route_op& p, idx n) { launch_route(p, n, stream_.get()); }
  void causal_softmax(const softmax_params& p) { launch_causal_softmax(p, stream_.get()); }
  void expert_gemv(const expert_gemv_params& p) { launch_expert_gemv(p, stream_.get()); }
  /// Whether this build has the bf16-output prefill attention (cuDNN's fused
  /// SDPA through cudnn_prefill.hpp; WS_MOE_HAVE_CUDNN).
#ifdef WS_MOE_HAVE_CUDNN
  static constexpr bool has_bf16_prefill_attention = true;
#else
  static constexpr bool has_bf16_prefill_attention = false;
#endif

  /// Prepares the bf16-output prefill attention for p's shape (builds and
  /// caches cuDNN's plan): its device workspace bytes, or nullopt with the
  /// reason in `why` when it cannot run here (cuDNN not built or not loadable,
  /// or refusing the shape). Throws config_error for broken parameters.
  std::optional<std::size_t> prepare_bf16_prefill_attention(const cudnn_prefill_params& p, std::string& why) {
#ifdef WS_MOE_HAVE_CUDNN
    if (!cudnn_prefill::available()) {
      why = "cuDNN does not load: " + cudnn_prefill::unavailable_reason();
      return std::nullopt;
    }
    if (!cudnn_) cudnn_ = std::make_unique<cudnn_prefill>();
    if (!cudnn_->supported(p)) {
      why = "cuDNN refused the shape: " + cudnn_->last_refusal();
      return std::nullopt;
    }
    return cudnn_->workspace_bytes(p);
#else
    (void)p;
    why = "not built with cuDNN (WRITESCOPE_CUDNN found no cudnn.h / cudnn_frontend.h)";
    return std::nullopt;
#endif
  }
  /// Runs the prepared bf16-output prefill attention on the stream.
  void bf16_prefill_attention(const cudnn_prefill_params& p, void* workspace, std::size_t workspace_bytes) {
#ifdef WS_MOE_HAVE_CUDNN
    if (!cudnn_) throw std::logic_error("cuda_exec: bf16_prefill_attention before prepare_bf16_prefill_attention");
    cudnn_->run(p, workspace, workspace_bytes, stream_.get());
#else
    (void)p;
    (void)workspace;
    (void)workspace_bytes;
    throw std::logic_error("cuda_exec: bf16_prefill_attention without cuDNN");
#endif
  }
  /// The loaded cuDNN version (e.g. 91900), 0 when none.
  [[nodiscard]] static long cudnn_version() noexcept {
#ifdef WS_MOE_HAVE_CUDNN
    return cudnn_prefill::loaded_version();
#else
    return 0;
#endif
  }

  [[nodiscard]] static std::size_t sort_pairs_temp_bytes(idx n) { return gpu::sort_pairs_temp_bytes(n); }
  /// Stable sort of n (key, value) pairs by key (ops.hpp launch_sort_pairs).
  void sort_pairs(const unsigned* keys_in, unsigned* keys_out, const int* values_in, int* values_out, idx n, void* temp,
                  std::size_t temp_bytes) {
    launch_sort_pairs(keys_in, keys_out, values_in, values_out, n, temp, temp_bytes, stream_.get());
  }
  /// A decode step's routed pairs grouped by expert in one launch (ops.hpp
  /// launch_group_pairs: the tables of sort_pairs + expert_bounds_op +
  /// scatter_rows_op), for n <= group_pairs_max pairs.
  static constexpr idx group_pairs_max = gpu::group_pairs_max;
  void group_pairs(const int* experts, const float* weights, idx n, int k, int E, unsigned* sorted_keys,
                   int* sorted_pairs, int* first, int* src_rows, int* comb_rows, float* comb_w) {
    launch_group_pairs(experts, weights, n, k, E, sorted_keys, sorted_pairs, first, src_rows, comb_rows, comb_w,
                       stream_.get());
  }
  /// Greedy sampling: keys[r] = the largest argmax_key of row r of x
  /// [rows][cols] (ops.hpp launch_argmax_rows; keys zeroed by the call).
  void argmax_rows(const float* x, idx rows, idx cols, std::uint64_t* keys) {
    launch_argmax_rows(x, rows, cols, keys, stream_.get());
  }
  void flash_prefill(const flash_prefill_params& p) {
    check_flash_prefill(p);
    launch_flash_prefill(p, stream_.get());
  }

  void gemm(const gemm_desc& d, const char* what) {
    check_gemm(d, what);
    if (d.m == 0 || d.n == 0) return;
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType t = d.a_type == wtype::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasOperation_t ta = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (d.k == 0) {  // an empty sum: C = 0 (cuBLAS would scale C by beta, which is what we want, but be explicit)
      for (idx b = 0; b < d.batch; ++b)
        WS_CUDA_TRY(cudaMemset2DAsync(d.c + b * d.stride_c, std::size_t(d.ldc) * 4, 0, std::size_t(d.m) * 4,
                                      std::size_t(d.n), stream_.get()));
      return;
    }
    if (d.batch == 1) {
      WS_CUBLAS_TRY(cublasGemmEx(blas_, ta, tb, int(d.m), int(d.n), int(d.k), &one, d.a, t, int(d.lda), d.b, t,
                                 int(d.ldb), &zero, d.c, CUDA_R_32F, int(d.ldc), CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
    } else {
      WS_CUBLAS_TRY(cublasGemmStridedBatchedEx(blas_, ta, tb, int(d.m), int(d.n), int(d.k), &one, d.a, t, int(d.lda),
                                               static_cast<long long>(d.stride_a), d.b, t, int(d.ldb),
                                               static_cast<long long>(d.stride_b), &zero, d.c, CUDA_R_32F, int(d.ldc),
                                               static_cast<long long>(d.stride_c), int(d.batch), CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
    }
  }

  /// One pointer-array batched GEMM over device pointer tables (fp32 output,
  /// fp32 accumulation) through cuBLASLt, the algorithm chosen once per shape
  /// class (lt_batched_gemm.hpp: cublasGemmBatchedEx would run its heuristic
  /// for every new row count). The first call allocates cuBLASLt's 32 MiB
  /// workspace (inside the budget's reserve for what is allocated after placement).
  void gemm_batched(const gemm_batched_desc& d, const char* what) {
    check_gemm_batched(d, what);
    const gemm_desc& b = d.base;
    if (d.count == 0 || b.m == 0 || b.n == 0) return;
    if (!lt_) lt_ = std::make_unique<lt_batched_gemm>();
    lt_->run(b.trans_a, b.trans_b, int(b.m), int(b.n), int(b.k), b.a_type == wtype::bf16 ? CUDA_R_16BF : CUDA_R_32F, d.a,
             int(b.lda), d.b, int(b.ldb), d.c, int(b.ldc), int(d.count), stream_.get());
  }
  /// gemm for products whose n (rows) changes from call to call (a routed
  /// expert's rows: per-expert and streamed experts): one plain product through
  /// cuBLASLt with the algorithm chosen once per class of n (cublasGemmEx
  /// would run its heuristic for every new n); other descriptors go to gemm.
  void gemm_varying(const gemm_desc& d, const char* what) {
    check_gemm(d, what);
    if (d.batch != 1 || d.k == 0 || d.m == 0 || d.n == 0) {
      gemm(d, what);
      return;
    }
    if (!lt_) lt_ = std::make_unique<lt_batched_gemm>();
    lt_->run_single(d.trans_a, d.trans_b, int(d.m), int(d.n), int(d.k), d.a_type == wtype::bf16 ? CUDA_R_16BF : CUDA_R_32F,
                    d.a, int(d.lda), d.b, int(d.ldb), d.c, int(d.ldc), stream_.get());
  }
  /// cuBLASLt heuristic queries of gemm_batched and gemm_varying so far, and their host seconds.
  [[nodiscard]] long gemm_batched_heuristic_queries() const noexcept { return lt_ ? lt_->heuristic_queries() : 0; }
  [[nodiscard]] double gemm_batched_heuristic_seconds() const noexcept { return lt_ ? lt_->heuristic_seconds() : 0.0; }
  /// Host seconds inside gemm_batched and gemm_varying's cuBLASLt calls (queries included).
  [[nodiscard]] double gemm_batched_issue_seconds() const noexcept { return lt_ ? lt_->issue_seconds() : 0.0; }
  [[nodiscard]] long gemm_batched_calls() const noexcept { return lt_ ? lt_->calls() : 0; }

  /// Throws config_error when this cuBLAS has no grouped GEMM with bf16
  /// inputs and fp32 outputs (cuBLAS 13.0 answers CUBLAS_STATUS_NOT_SUPPORTED):
  /// one 1 x 1 x 1 product on scratch memory, at init.
  void check_grouped_gemm() {
    void* mem = nullptr;
    WS_CUDA_TRY(cudaMalloc(&mem, 256));
    auto* base = static_cast<char*>(mem);
    WS_CUDA_TRY(cudaMemsetAsync(base, 0, 256, stream_.get()));
    const void* host_tab[3] = {base + 128, base + 144, base + 160};
    WS_CUDA_TRY(cudaMemcpyAsync(base, host_tab, sizeof host_tab, cudaMemcpyHostToDevice, stream_.get()));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int one_i = 1;
    const float one = 1.0f, zero = 0.0f;
    const auto* tab = reinterpret_cast<const void* const*>(base);
    const cublasStatus_t s = cublasGemmGroupedBatchedEx(
        blas_, &ta, &tb, &one_i, &one_i, &one_i, &one, tab, CUDA_R_16BF, &one_i, tab + 1, CUDA_R_16BF, &one_i, &zero,
        const_cast<void* const*>(tab + 2), CUDA_R_32F, &one_i, 1, &one_i, CUBLAS_COMPUTE_32F);
    const cudaError_t e = cudaStreamSynchronize(stream_.get());
    (void)cudaFree(mem);
    WS_CUDA_TRY(e);
    if (s != CUBLAS_STATUS_SUCCESS)
      throw writescope::config_error("--prefill-expert-gemm grouped: cuBLAS refuses a grouped GEMM with bf16 inputs and "
                                     "fp32 outputs (cuBLAS status " + std::to_string(int(s)) +
                                     "); use --prefill-expert-gemm batched");
  }

  /// One cublasGemmGroupedBatchedEx call (cuBLAS reads the per-group host
  /// arrays during the call; the pointer tables are device memory).
  void gemm_grouped(const gemm_grouped_desc& d, const char* what) {
    check_gemm_grouped(d, what);
    const gemm_desc& b = d.base;
    if (d.n.empty() || b.m == 0) return;
    const std::size_t g = d.n.size();
    grouped_int_.assign(6 * g, 0);
    int* m = grouped_int_.data();
    int* k = m + g;
    int* lda = k + g;
    int* ldb = lda + g;
    int* ldc = ldb + g;
    for (std::size_t i = 0; i < g; ++i) {
      m[i] = int(b.m);
      k[i] = int(b.k);
      lda[i] = int(b.lda);
      ldb[i] = int(b.ldb);
      ldc[i] = int(b.ldc);
    }
    grouped_ta_.assign(g, b.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    grouped_tb_.assign(g, b.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
    grouped_alpha_.assign(g, 1.0f);
    grouped_beta_.assign(g, 0.0f);
    const cudaDataType t = b.a_type == wtype::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    WS_CUBLAS_TRY(cublasGemmGroupedBatchedEx(blas_, grouped_ta_.data(), grouped_tb_.data(), m, d.n.data(), k,
                                             grouped_alpha_.data(), d.a, t, lda, d.b, t, ldb, grouped_beta_.data(),
                                             reinterpret_cast<void* const*>(d.c), CUDA_R_32F, ldc, int(g),
                                             d.count.data(), CUBLAS_COMPUTE_32F));
  }

  void h2d(void* dst, const void* src, idx bytes) {
    if (bytes <= 0) return;
    WS_CUDA_TRY(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyHostToDevice, stream_.get()));
    // The source is pageable and may be reused or freed at once: wait (every
    // caller uploads between synchronising points, so the stream is idle anyway).
    WS_CUDA_TRY(cudaStreamSynchronize(stream_.get()));
  }
  void d2h(void* dst, const void* src, idx bytes) {
    if (bytes <= 0) return;
    WS_CUDA_TRY(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyDeviceToHost, stream_.get()));
    WS_CUDA_TRY(cudaStreamSynchronize(stream_.get()));
  }
  void d2d(void* dst, const void* src, idx bytes) {
    if (bytes > 0)
      WS_CUDA_TRY(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyDeviceToDevice, stream_.get()));
  }
  void copy_2d(void* dst, idx dpitch, const void* src, idx spitch, idx width, idx height) {
    if (width > 0 && height > 0)
      WS_CUDA_TRY(cudaMemcpy2DAsync(dst, std::size_t(dpitch), src, std::size_t(spitch), std::size_t(width),
                                    std::size_t(height), cudaMemcpyDeviceToDevice, stream_.get()));
  }
  void zero(void* p, idx bytes) {
    if (bytes > 0) WS_CUDA_TRY(cudaMemsetAsync(p, 0, std::size_t(bytes), stream_.get()));
  }
  void sync() { WS_CUDA_TRY(cudaStreamSynchronize(stream_.get())); }

  /// Page-locked host memory (cudaHostAlloc via cuda_backend) for the async copies.
  writescope::host_allocation host_staging(idx bytes) { return backend_->allocate_staging(bytes); }
  /// Pageable host memory (zero-filled, resident on first touch), e.g. host experts that never stream.
  writescope::host_allocation host_pageable(idx bytes) { return writescope::detail::map_pageable(bytes, "host expert arena"); }
  void d2h_async(void* dst, const void* src, idx bytes) {
    if (bytes > 0)
      WS_CUDA_TRY(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyDeviceToHost, stream_.get()));
  }
  void h2d_async(void* dst, const void* src, idx bytes) {
    if (bytes > 0)
      WS_CUDA_TRY(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyHostToDevice, stream_.get()));
  }
  void record() {
    if (capturing_) throw std::logic_error("cuda_exec: record() inside a CUDA graph capture");
    writescope::cuda_detail::record(done_, stream_.get());
  }
  void wait_recorded() { WS_CUDA_TRY(cudaEventSynchronize(done_.get())); }

  // ---- expert streaming ring (prefill: host experts run on the device) --------
  // `slots` staging slots in device memory, each guarded by two events:
  // ready[s] (recorded on the copy stream after a copy into s) and free[s]
  // (recorded on the compute stream after the last kernel that reads s). A
  // copy into s waits for free[s]; a kernel reading s waits for ready[s]. The
  // caller enqueues the copy of item i + slots only after the release of item
  // i (cudaStreamWaitEvent on an event not yet recorded does not wait).
  void ring_setup(int slots) {
    if (!copy_stream_.get()) copy_stream_ = writescope::cuda_detail::unique_stream::create();
    while (int(ring_ready_.size()) < slots) {
      ring_ready_.push_back(writescope::cuda_detail::unique_event::create());
      ring_free_.push_back(writescope::cuda_detail::unique_event::create());
    }
  }
  /// H2D of `bytes` from page-locked `src` into slot `slot` at `dst`, on the copy stream.
  void ring_copy(int slot, void* dst, const void* src, idx bytes) {
    writescope::cuda_detail::wait(copy_stream_.get(), ring_free_[std::size_t(slot)]);
    if (bytes > 0)
      WS_CUDA_TRY(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyHostToDevice, copy_stream_.get()));
    writescope::cuda_detail::record(ring_ready_[std::size_t(slot)], copy_stream_.get());
  }
  /// The compute stream waits until slot `slot` holds its item.
  void ring_acquire(int slot) { writescope::cuda_detail::wait(stream_.get(), ring_ready_[std::size_t(slot)]); }
  /// The kernels enqueued so far are the last readers of slot `slot`.
  void ring_release(int slot) { writescope::cuda_detail::record(ring_free_[std::size_t(slot)], stream_.get()); }

  // ---- CUDA graphs of stream work --------------------------------------------------
  struct graph_exec_deleter {
    void operator()(cudaGraphExec_t g) const noexcept { (void)cudaGraphExecDestroy(g); }
  };
  /// An instantiated graph (cudaGraphExecDestroy on destruction; one still
  /// running is freed when it completes).
  using graph = std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, graph_exec_deleter>;

  /// Starts recording the stream's work into a graph (nothing runs until
  /// launch_graph). Throws writescope::cuda_error when the stream cannot capture.
  void begin_capture() {
    if (capturing_) throw std::logic_error("cuda_exec: begin_capture inside a capture");
    WS_CUDA_TRY(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
  }
  /// Ends the capture and instantiates the graph. Returns null, with the reason
  /// in `why`, when the capture was invalidated (a call inside it that cannot
  /// be captured) or the graph does not instantiate; the error is cleared and
  /// the stream is no longer capturing either way. Never throws.
  graph end_capture(std::string& why) noexcept {
    capturing_ = false;
    cudaGraph_t g = nullptr;
    cudaError_t e = cudaStreamEndCapture(stream_.get(), &g);
    if (e != cudaSuccess || g == nullptr) {
      why = std::string("cudaStreamEndCapture: ") + (e != cudaSuccess ? cudaGetErrorString(e) : "no graph");
      if (g != nullptr) (void)cudaGraphDestroy(g);
      (void)cudaGetLastError();
      return graph{};
    }
    cudaGraphExec_t x = nullptr;
    e = cudaGraphInstantiate(&x, g, 0);
    (void)cudaGraphDestroy(g);
    if (e != cudaSuccess || x == nullptr) {
      why = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(e);
      if (x != nullptr) (void)cudaGraphExecDestroy(x);
      (void)cudaGetLastError();
      return graph{};
    }
    return graph(x);
  }
  [[nodiscard]] bool capturing() const noexcept { return capturing_; }
  /// Enqueues an instantiated graph on the stream (after everything enqueued before it).
  void launch_graph(const graph& g) { WS_CUDA_TRY(cudaGraphLaunch(g.get(), stream_.get())); }

  // ---- phase timing: events on the compute stream, read after a sync -------------
  /// Records a timing event on the compute stream; returns its index (reset_marks() starts over).
  int mark() {
    if (capturing_) throw std::logic_error("cuda_exec: mark() inside a CUDA graph capture");
    if (marks_used_ == int(marks_.size())) marks_.push_back(writescope::cuda_detail::unique_event::create(true));
    writescope::cuda_detail::record(marks_[std::size_t(marks_used_)], stream_.get());
    return marks_used_++;
  }
  /// Seconds between two marks (both complete: call after sync()).
  double seconds_between(int a, int b) const {
    float ms = 0.0f;
    WS_CUDA_TRY(cudaEventElapsedTime(&ms, marks_[std::size_t(a)].get(), marks_[std::size_t(b)].get()));
    return double(ms) * 1e-3;
  }
  void reset_marks() noexcept { marks_used_ = 0; }

  [[nodiscard]] idx device_total_bytes() const noexcept { return total_; }
  [[nodiscard]] idx device_free_bytes() const {
    std::size_t free = 0, total = 0;
    WS_CUDA_TRY(cudaMemGetInfo(&free, &total));
    return idx(free);
  }
  /// Device memory in use: the device's total minus its free memory, i.e. this
  /// process's allocations (ours, the cache's regions, the engine's
  /// workspaces, cuBLAS), its CUDA context and the driver's reservation (an
  /// upper bound of what NVML reports for the process on a GPU it has alone).
  [[nodiscard]] idx device_used_bytes() const { return total_ - device_free_bytes(); }
  [[nodiscard]] idx device_free_at_start() const noexcept { return free_at_start_; }
  /// Device memory NVML attributes to this process now (context included), or
  /// -1 where NVML cannot say; process_memory_source() then says why.
  [[nodiscard]] long long process_device_bytes() { return nvml_->available() ? nvml_->used_bytes() : -1; }
  [[nodiscard]] std::string process_memory_source() const {
    return nvml_->available() && nvml_->why().empty() ? "NVML (" + nvml_->source() + ")" : "NVML unavailable: " + nvml_->why();
  }

 private:
  writescope::cuda_detail::unique_stream stream_;
  idx free_at_start_ = 0, total_ = 0;
  std::unique_ptr<nvml_process_memory> nvml_;
  std::optional<backend_type> backend_;
  writescope::cuda_detail::unique_event done_;
  cublasHandle_t blas_ = nullptr;
  std::unique_ptr<lt_batched_gemm> lt_;  ///< gemm_batched, gemm_varying (created at the first call)
#ifdef WS_MOE_HAVE_CUDNN
  std::unique_ptr<cudnn_prefill> cudnn_;  ///< created at the first prepare_bf16_prefill_attention
#endif
  std::vector<backend_type::device_buffer> bufs_;
  idx allocated_ = 0;
  writescope::cuda_detail::unique_stream copy_stream_;
  std::vector<writescope::cuda_detail::unique_event> ring_ready_, ring_free_, marks_;
  int marks_used_ = 0;
  bool capturing_ = false;  ///< between begin_capture and end_capture
  std::vector<int> grouped_int_;  ///< gemm_grouped's per-group host arrays
  std::vector<cublasOperation_t> grouped_ta_, grouped_tb_;
  std::vector<float> grouped_alpha_, grouped_beta_;
};

}  // namespace ws_moe::gpu
