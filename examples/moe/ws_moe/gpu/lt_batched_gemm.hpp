// SPDX-License-Identifier: Apache-2.0
// examples/moe/ws_moe/gpu/lt_batched_gemm.hpp — pointer-array batched GEMMs
// through cuBLASLt with the algorithm chosen once per shape class.
//
// Why: cublasGemmBatchedEx runs cuBLAS's heuristic for every (m, n, k, count)
// it has not seen. A prefill MoE layer's expert groups have new row counts in
// every layer and wave, so the first layers spend about 2.5 ms of host time per
// new shape (measured on an H200 with cuBLAS 13.1) while the GPU waits.
// Here the heuristic runs once per class of calls (transposes, types, m, k,
// leading dimensions, n and count rounded up to powers of two), at the shape
// of the class's first call; every later call of the class reuses that
// algorithm with its own exact n and count in the layouts. An algorithm that
// cuBLASLt rejects for a call's exact shape is replaced by one chosen for that
// exact shape (cached under it). run_single does the same for plain products
// (one matrix each) whose n changes from call to call.
//
// The product: for each i < count, C_i [m x n] = op(A_i) op(B_i), column-major
// as in cuBLAS; A, B bf16 (or fp32), C fp32, fp32 accumulation; A, B, C are
// device arrays of count device pointers (run) or device matrices (run_single). Stream: the one passed to run(); the
// calls are asynchronous. Not thread-safe (one instance per issuing thread).
// Errors: cuBLAS failures throw writescope::cuda_error (WS_CUBLAS_TRY).
#pragma once

#include <cublasLt.h>

#include <chrono>
#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>

#include <writescope/cuda/cuda_error.hpp>

#include "cublas_check.hpp"

namespace ws_moe::gpu {

class lt_batched_gemm {
 public:
  /// workspace_bytes: device scratch the algorithms may use (allocated here, once).
  explicit lt_batched_gemm(std::size_t workspace_bytes = std::size_t{32} << 20) : ws_bytes_(workspace_bytes) {
    WS_CUBLAS_TRY(cublasLtCreate(&lt_));
    if (ws_bytes_ > 0) WS_CUDA_TRY(cudaMalloc(&ws_, ws_bytes_));
  }
  lt_batched_gemm(const lt_batched_gemm&) = delete;
  lt_batched_gemm& operator=(const lt_batched_gemm&) = delete;
  ~lt_batched_gemm() {
    for (auto& [k, d] : descs_) (void)cublasLtMatmulDescDestroy(d);
    if (ws_ != nullptr) (void)cudaFree(ws_);
    if (lt_ != nullptr) (void)cublasLtDestroy(lt_);
  }

  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return ws_bytes_; }
  /// Heuristic queries so far (one per shape class, plus exact-shape fallbacks).
  [[nodiscard]] long heuristic_queries() const noexcept { return queries_; }
  /// Host seconds spent in those queries.
  [[nodiscard]] double heuristic_seconds() const noexcept { return query_seconds_; }
  /// Host seconds spent in run and run_single altogether (queries included).
  [[nodiscard]] double issue_seconds() const noexcept { return issue_seconds_; }
  /// Calls of run and run_single so far.
  [[nodiscard]] long calls() const noexcept { return calls_; }

  /// C_i = op(A_i) op(B_i) for i < count (see the file comment). ab_type:
  /// CUDA_R_16BF or CUDA_R_32F; lda/ldb/ldc in elements.
  void run(bool trans_a, bool trans_b, int m, int n, int k, cudaDataType ab_type, const void* const* a, int lda,
           const void* const* b, int ldb, float* const* c, int ldc, int count, cudaStream_t stream) {
    if (count <= 0 || m <= 0 || n <= 0) return;
    const auto t0 = std::chrono::steady_clock::now();
    layouts L(trans_a, trans_b, m, n, k, ab_type, lda, ldb, ldc, count);
    issue(trans_a, trans_b, m, n, k, ab_type, lda, ldb, ldc, count, L, a, b, const_cast<float**>(c), stream);
    issue_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++calls_;
  }

  /// One product C = op(A) op(B) (plain device pointers, no batch): for
  /// products whose n changes from call to call (a routed expert's rows).
  void run_single(bool trans_a, bool trans_b, int m, int n, int k, cudaDataType ab_type, const void* a, int lda,
                  const void* b, int ldb, float* c, int ldc, cudaStream_t stream) {
    if (m <= 0 || n <= 0) return;
    const auto t0 = std::chrono::steady_clock::now();
    layouts L(trans_a, trans_b, m, n, k, ab_type, lda, ldb, ldc, 0);
    issue(trans_a, trans_b, m, n, k, ab_type, lda, ldb, ldc, 0, L, a, b, c, stream);
    issue_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++calls_;
  }

 private:
  /// The three layouts of one call (pointer arrays of `count` matrices; count
  /// 0: plain matrices), destroyed with it.
  struct layouts {
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    layouts(bool ta, bool tb, int m, int n, int k, cudaDataType t, int lda, int ldb, int ldc, int count) {
      WS_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&a, t, ta ? k : m, ta ? m : k, lda));
      WS_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&b, t, tb ? n : k, tb ? k : n, ldb));
      WS_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, m, n, ldc));
      if (count == 0) return;  // a plain product
      const std::uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
      for (cublasLtMatrixLayout_t l : {a, b, c}) {
        WS_CUBLAS_TRY(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof mode));
        WS_CUBLAS_TRY(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      }
    }
    layouts(const layouts&) = delete;
    layouts& operator=(const layouts&) = delete;
    ~layouts() {
      for (cublasLtMatrixLayout_t l : {a, b, c})
        if (l != nullptr) (void)cublasLtMatrixLayoutDestroy(l);
    }
  };

  struct key {
    bool exact, ta, tb;  ///< exact: a call's own shape (a fallback), else a class
    int type, m, k, n, lda, ldb, ldc, count;
    bool operator<(const key& o) const {
      return std::tie(exact, ta, tb, type, m, k, n, lda, ldb, ldc, count) <
             std::tie(o.exact, o.ta, o.tb, o.type, o.m, o.k, o.n, o.lda, o.ldb, o.ldc, o.count);
    }
  };

  /// The class of a call: its transposes, types, m, k and leading dimensions,
  /// n and count rounded up to powers of two (count 0: a plain product). The
  /// class's algorithm is the heuristic's first choice for the first call of
  /// the class, at that call's exact shape; a later call of the class that the
  /// algorithm does not support gets the heuristic's choice for its own exact
  /// shape (cached under that exact shape).
  void issue(bool ta, bool tb, int m, int n, int k, cudaDataType t, int lda, int ldb, int ldc, int count,
             const layouts& L, const void* a, const void* b, void* c, cudaStream_t stream) {
    const cublasLtMatmulDesc_t op = desc(ta, tb);
    const key klass{false, ta, tb, int(t), m, k, round_up_pow2(n), lda, ldb, ldc, count > 0 ? round_up_pow2(count) : 0};
    const float one = 1.0f, zero = 0.0f;
    auto matmul = [&](const cublasLtMatmulAlgo_t& algo) {
      return cublasLtMatmul(lt_, op, &one, a, L.a, b, L.b, &zero, c, L.c, c, L.c, &algo, ws_, ws_bytes_, stream);
    };
    auto it = algos_.find(klass);
    if (it == algos_.end()) it = algos_.emplace(klass, query(op, L)).first;
    if (matmul(it->second) == CUBLAS_STATUS_SUCCESS) return;
    const key exact{true, ta, tb, int(t), m, k, n, lda, ldb, ldc, count};
    auto ex = algos_.find(exact);
    if (ex == algos_.end()) ex = algos_.emplace(exact, query(op, L)).first;
    WS_CUBLAS_TRY(matmul(ex->second));
  }

  static int round_up_pow2(int n) {
    int p = 1;
    while (p < n) p *= 2;
    return p;
  }

  cublasLtMatmulDesc_t desc(bool ta, bool tb) {
    const int k = (ta ? 2 : 0) | (tb ? 1 : 0);
    auto it = descs_.find(k);
    if (it != descs_.end()) return it->second;
    cublasLtMatmulDesc_t d = nullptr;
    WS_CUBLAS_TRY(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    WS_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof oa));
    WS_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof ob));
    descs_.emplace(k, d);
    return d;
  }

  cublasLtMatmulAlgo_t query(cublasLtMatmulDesc_t op, const layouts& L) {
    const auto t0 = std::chrono::steady_clock::now();
    cublasLtMatmulPreference_t pref = nullptr;
    WS_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref));
    WS_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes_,
                                                       sizeof ws_bytes_));
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt_, op, L.a, L.b, L.c, L.c, pref, 1, &r, &found);
    (void)cublasLtMatmulPreferenceDestroy(pref);
    WS_CUBLAS_TRY(s);
    if (found == 0) WS_CUBLAS_TRY(CUBLAS_STATUS_NOT_SUPPORTED);
    ++queries_;
    query_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r.algo;
  }

  cublasLtHandle_t lt_ = nullptr;
  void* ws_ = nullptr;
  std::size_t ws_bytes_ = 0;
  std::map<int, cublasLtMatmulDesc_t> descs_;
  std::map<key, cublasLtMatmulAlgo_t> algos_;
  long queries_ = 0;
  double query_seconds_ = 0.0;
  double issue_seconds_ = 0.0;
  long calls_ = 0;
};

}  // namespace ws_moe::gpu
