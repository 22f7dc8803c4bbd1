// SPDX-License-Identifier: Apache-2.0
// A one-off probe (session of 2026-12-01, not built by CMake): host issue cost of cublasGemmBatchedEx for new vs repeated shapes;
// cublasLt pointer-array with one cached algo; cublasLt grouped (device shapes).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <vector>

#define CK(x) do { auto e_ = (x); if (e_ != cudaSuccess) { std::printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); std::exit(1); } } while (0)
#define CB(x) do { auto s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { std::printf("cuBLAS status %d at %d\n", int(s_), __LINE__); } } while (0)
using clk = std::chrono::steady_clock;
static double secs(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }
static long ladder(long m, long pad) {
  long step = pad;
  if (m > 8 * pad) { int j = 0; while ((2L << j) < m) ++j; step = std::max(pad, 1L << (j - 3)); }
  return (m + step - 1) / step * step;
}
struct group { long rows; int count; std::vector<int> experts; };

int main() {
  const int E = 128, H = 2048, I = 768, LAYERS = 8;
  const long T = 32768, K = 8;
  std::mt19937 rng(1);
  // per-layer rows (random router-like spread)
  std::vector<std::vector<long>> rows(LAYERS, std::vector<long>(E));
  for (auto& r : rows) {
    std::vector<double> w(E);
    std::gamma_distribution<double> g(4.0, 1.0);
    double s = 0; for (auto& x : w) { x = g(rng); s += x; }
    long tot = 0; for (int e = 0; e < E; ++e) { r[e] = long(T * K * w[e] / s); tot += r[e]; }
    r[0] += T * K - tot;
  }
  long maxp = 0;
  for (auto& r : rows) { long p = 0; for (long m : r) p += ladder(m, 64); maxp = std::max(maxp, p); }
  __nv_bfloat16 *W, *X; float* Y;
  CK(cudaMalloc(&W, size_t(E) * H * I * 2 * 2));
  CK(cudaMalloc(&X, size_t(maxp) * H * 2));
  CK(cudaMalloc(&Y, size_t(maxp) * H * 4));
  CK(cudaMemset(W, 0, size_t(E) * H * I * 2 * 2)); CK(cudaMemset(X, 0, size_t(maxp) * H * 2));
  void** tab; CK(cudaMalloc(&tab, 1 << 20));
  int* dims; CK(cudaMalloc(&dims, 1 << 16));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cublasHandle_t h; CB(cublasCreate(&h)); CB(cublasSetStream(h, st));
  cublasLtHandle_t lt; CB(cublasLtCreate(&lt));
  void* ws; const size_t wsb = 64 << 20; CK(cudaMalloc(&ws, wsb));
  CB(cublasSetWorkspace(h, ws, wsb));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  const float one = 1, zero = 0;
  std::printf("cuBLAS version %d (header %d)\n", [&] { int v; cublasGetVersion(h, &v); return v; }(), CUBLAS_VERSION);

  // the two matrices: gate-like (out I, in H) and down-like (out H, in I)
  struct mat { int out, in; };
  const mat mats[2] = {{I, H}, {H, I}};
  // ---------- 1. cublasGemmBatchedEx over ladder groups, as the decoder issues ----------
  auto groups_of = [&](const std::vector<long>& r, std::vector<long>& first) {
    std::vector<int> order(E); for (int e = 0; e < E; ++e) order[e] = e;
    first.assign(E, 0); long at = 0;
    for (int e = 0; e < E; ++e) { first[e] = at; at += ladder(r[e], 64); }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ladder(r[a], 64) < ladder(r[b], 64); });
    std::vector<group> gs;
    for (size_t i = 0; i < order.size();) {
      size_t j = i; while (j < order.size() && ladder(r[order[j]], 64) == ladder(r[order[i]], 64)) ++j;
      size_t c = 1; while (2 * c <= j - i) c *= 2; j = i + c;
      group g{ladder(r[order[i]], 64), int(c), {}};
      for (size_t q = i; q < j; ++q) g.experts.push_back(order[q]);
      gs.push_back(g); i = j;
    }
    return gs;
  };
  std::set<std::tuple<int, int, long, int>> seen;
  for (int pass = 0; pass < 2; ++pass)
    for (int l = 0; l < LAYERS; ++l) {
      std::vector<long> first; auto gs = groups_of(rows[l], first);
      // tables: per group [A count][B count][C count]
      std::vector<void*> host; std::vector<size_t> at;
      for (int mi = 0; mi < 2; ++mi) for (auto& g : gs) {
        at.push_back(host.size());
        for (int e : g.experts) host.push_back(W + size_t(e) * H * I * 2 + size_t(mi) * H * I);
        for (int e : g.experts) host.push_back(X + size_t(first[e]) * mats[mi].in);
        for (int e : g.experts) host.push_back(Y + size_t(first[e]) * mats[mi].out);
      }
      CK(cudaMemcpy(tab, host.data(), host.size() * 8, cudaMemcpyHostToDevice));
      CK(cudaStreamSynchronize(st));
      int fresh = 0; double host_s = 0;
      CK(cudaEventRecord(e0, st));
      size_t q = 0;
      for (int mi = 0; mi < 2; ++mi) for (auto& g : gs) {
        const mat m = mats[mi]; void** t = tab + at[q++];
        fresh += seen.insert({m.out, m.in, g.rows, g.count}).second;
        auto t0 = clk::now();
        CB(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m.out, int(g.rows), m.in, &one, t, CUDA_R_16BF, m.in,
                               t + g.count, CUDA_R_16BF, m.in, &zero, t + 2 * g.count, CUDA_R_32F, m.out, g.count,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        host_s += secs(t0);
      }
      CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
      std::printf("batchedEx pass %d layer %d: %zu calls, %d new shapes, host issue %.2f ms, GPU span %.2f ms\n", pass, l,
                  2 * gs.size(), fresh, host_s * 1e3, ms);
    }

  // ---------- 2. cublasLt pointer array, one algo per matrix (heuristic at a representative shape) ----------
  for (int mi = 0; mi < 2; ++mi) {
    const mat m = mats[mi];
    cublasLtMatmulDesc_t op; CB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    auto layouts = [&](long n, int count, cublasLtMatrixLayout_t* L) {
      CB(cublasLtMatrixLayoutCreate(&L[0], CUDA_R_16BF, m.in, m.out, m.in));
      CB(cublasLtMatrixLayoutCreate(&L[1], CUDA_R_16BF, m.in, n, m.in));
      CB(cublasLtMatrixLayoutCreate(&L[2], CUDA_R_32F, m.out, n, m.out));
      uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
      for (int i = 0; i < 3; ++i) {
        CB(cublasLtMatrixLayoutSetAttribute(L[i], CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof mode));
        CB(cublasLtMatrixLayoutSetAttribute(L[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      }
    };
    cublasLtMatrixLayout_t L[3]; layouts(2048, 8, L);
    cublasLtMatmulPreference_t pref; CB(cublasLtMatmulPreferenceCreate(&pref));
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t res[8]; int nres = 0;
    auto t0 = clk::now();
    CB(cublasLtMatmulAlgoGetHeuristic(lt, op, L[0], L[1], L[2], L[2], pref, 8, res, &nres));
    std::printf("Lt ptr-array mat %d: heuristic %.2f ms, %d algos\n", mi, secs(t0) * 1e3, nres);
    for (auto& x : L) cublasLtMatrixLayoutDestroy(x);
    if (nres == 0) continue;
    for (int pass = 0; pass < 2; ++pass) {
      double host_s = 0; float gpu_ms = 0; int calls = 0, fails = 0;
      for (int l = 0; l < LAYERS; ++l) {
        std::vector<long> first; auto gs = groups_of(rows[l], first);
        std::vector<void*> host; std::vector<size_t> at;
        for (auto& g : gs) {
          at.push_back(host.size());
          for (int e : g.experts) host.push_back(W + size_t(e) * H * I * 2 + size_t(mi) * H * I);
          for (int e : g.experts) host.push_back(X + size_t(first[e]) * m.in);
          for (int e : g.experts) host.push_back(Y + size_t(first[e]) * m.out);
        }
        CK(cudaMemcpy(tab, host.data(), host.size() * 8, cudaMemcpyHostToDevice));
        CK(cudaEventRecord(e0, st));
        for (size_t gi = 0; gi < gs.size(); ++gi) {
          auto& g = gs[gi]; void** t = tab + at[gi];
          auto t1 = clk::now();
          cublasLtMatrixLayout_t M[3]; layouts(g.rows, g.count, M);
          auto s = cublasLtMatmul(lt, op, &one, t, M[0], t + g.count, M[1], &zero, t + 2 * g.count, M[2], t + 2 * g.count,
                                  M[2], &res[0].algo, ws, wsb, st);
          for (auto& x : M) cublasLtMatrixLayoutDestroy(x);
          host_s += secs(t1); ++calls; fails += s != CUBLAS_STATUS_SUCCESS;
        }
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); gpu_ms += ms;
      }
      std::printf("Lt ptr-array mat %d pass %d: %d calls (%d failed), host %.2f ms, GPU %.2f ms over %d layers\n", mi, pass,
                  calls, fails, host_s * 1e3, gpu_ms, LAYERS);
    }
  }

#if CUBLAS_VERSION >= 130200
  // ---------- 3. cublasLt grouped: one call per matrix, every expert at exact rows, shapes on the device ----------
  for (int mi = 0; mi < 2; ++mi) {
    const mat m = mats[mi];
    cublasLtMatmulDesc_t op; CB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    // dims: [A rows E][A cols E][A ld E][B rows][B cols][B ld][C rows][C cols][C ld]
    int* A_r = dims; int* A_c = dims + E; int* A_l = dims + 2 * E; int* B_r = dims + 3 * E; int* B_c = dims + 4 * E;
    int* B_l = dims + 5 * E; int* C_r = dims + 6 * E; int* C_c = dims + 7 * E; int* C_l = dims + 8 * E;
    cublasLtMatrixLayout_t L[3];
    CB(cublasLtGroupedMatrixLayoutCreate(&L[0], CUDA_R_16BF, E, A_r, A_c, A_l));
    CB(cublasLtGroupedMatrixLayoutCreate(&L[1], CUDA_R_16BF, E, B_r, B_c, B_l));
    CB(cublasLtGroupedMatrixLayoutCreate(&L[2], CUDA_R_32F, E, C_r, C_c, C_l));
    cublasLtMatmulPreference_t pref; CB(cublasLtMatmulPreferenceCreate(&pref));
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    uint32_t avg = uint32_t(T * K / E), red = uint32_t(m.in);
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_COLS, &avg, sizeof avg));
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_AVERAGE_REDUCTION_DIM, &red, sizeof red));
    cublasLtMatmulHeuristicResult_t res[8]; int nres = 0;
    auto t0 = clk::now();
    auto hs = cublasLtMatmulAlgoGetHeuristic(lt, op, L[0], L[1], L[2], L[2], pref, 8, res, &nres);
    std::printf("Lt grouped mat %d: heuristic status %d, %.2f ms, %d algos\n", mi, int(hs), secs(t0) * 1e3, nres);
    if (nres == 0) continue;
    double host_s = 0; float gpu_ms = 0; double useful = 0; int fails = 0;
    for (int pass = 0; pass < 2; ++pass) {
      host_s = 0; gpu_ms = 0; useful = 0;
      for (int l = 0; l < LAYERS; ++l) {
        std::vector<int> hd(9 * E); std::vector<void*> host(3 * E); long at = 0;
        for (int e = 0; e < E; ++e) {
          hd[e] = m.in; hd[E + e] = m.out; hd[2 * E + e] = m.in;
          hd[3 * E + e] = m.in; hd[4 * E + e] = int(rows[l][e]); hd[5 * E + e] = m.in;
          hd[6 * E + e] = m.out; hd[7 * E + e] = int(rows[l][e]); hd[8 * E + e] = m.out;
          host[e] = W + size_t(e) * H * I * 2 + size_t(mi) * H * I;
          host[E + e] = X + size_t(at) * m.in; host[2 * E + e] = Y + size_t(at) * m.out; at += rows[l][e];
          useful += 2.0 * m.in * m.out * rows[l][e];
        }
        CK(cudaMemcpy(dims, hd.data(), hd.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(tab, host.data(), host.size() * 8, cudaMemcpyHostToDevice));
        CK(cudaEventRecord(e0, st));
        auto t1 = clk::now();
        auto s = cublasLtMatmul(lt, op, &one, tab, L[0], tab + E, L[1], &zero, tab + 2 * E, L[2], tab + 2 * E, L[2],
                                &res[0].algo, ws, wsb, st);
        host_s += secs(t1); fails += s != CUBLAS_STATUS_SUCCESS;
        if (s != CUBLAS_STATUS_SUCCESS && l == 0) std::printf("  grouped matmul status %d\n", int(s));
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); gpu_ms += ms;
      }
      std::printf("Lt grouped mat %d pass %d: %d layers (%d failed), host %.2f ms, GPU %.2f ms, %.0f TFLOP/s\n", mi, pass,
                  LAYERS, fails, host_s * 1e3, gpu_ms, useful / (gpu_ms * 1e-3) * 1e-12);
    }
  }
#else
  std::printf("cublasLt grouped: header %d has no grouped mode\n", CUBLAS_VERSION);
#endif
  // dense reference for the same FLOPs (per matrix, one expert's weights, all rows)
  for (int mi = 0; mi < 2; ++mi) {
    const mat m = mats[mi];
    CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m.out, int(T * K), m.in, &one, W, CUDA_R_16BF, m.in, X, CUDA_R_16BF, m.in,
                    &zero, Y, CUDA_R_32F, m.out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cudaEventRecord(e0, st));
    for (int r = 0; r < 5; ++r)
      CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m.out, int(T * K), m.in, &one, W, CUDA_R_16BF, m.in, X, CUDA_R_16BF, m.in,
                      &zero, Y, CUDA_R_32F, m.out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    std::printf("dense mat %d: %.2f ms per layer, %.0f TFLOP/s\n", mi, ms / 5, 2.0 * m.in * m.out * T * K / (ms / 5 * 1e-3) * 1e-12);
  }
  return 0;
}
