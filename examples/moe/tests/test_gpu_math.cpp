// SPDX-License-Identifier: Apache-2.0
// The CUDA path's math on the host: the GEMM descriptors (cuBLAS column-major
// semantics, checked against plain row-major loops and the host path's ops),
// the element functors of kernel_math.hpp that the CUDA kernels run (router,
// RoPE, prefill pack/softmax/unpack) against the host path (moe.hpp, ops.hpp),
// and the random-weight generator shared by host and device. The whole decoder
// is exercised against transformers by the ws_decode_emulated.* tests; these
// pin the pieces one by one, with odd sizes.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <writescope/bf16.hpp>

#include "ws_moe/gpu/emulated_exec.hpp"
#include "ws_moe/gpu/gemm.hpp"
#include "ws_moe/gpu/kernel_math.hpp"
#include "ws_moe/moe.hpp"
#include "ws_moe/ops.hpp"
#include "ws_moe/weights.hpp"

using namespace ws_moe;
using gpu::idx;
using gpu::wtype;

namespace {

std::vector<float> randn(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m;
}

}  // namespace

TEST_CASE("reference_gemm follows cuBLAS's column-major semantics") {
  // A = [[1,2,3],[4,5,6]] (2x3) stored column-major with lda 3 (one padding row).
  const std::vector<float> A = {1, 4, -1, 2, 5, -1, 3, 6, -1};
  // B = [[1,0],[0,1],[1,1]] (3x2) stored column-major, ldb 3.
  const std::vector<float> B = {1, 0, 1, 0, 1, 1};
  std::vector<float> C(4, -7.0f);
  gpu::gemm_desc d;
  d.m = 2;
  d.n = 2;
  d.k = 3;
  d.a = A.data();
  d.lda = 3;
  d.b = B.data();
  d.ldb = 3;
  d.c = C.data();
  d.ldc = 2;
  gpu::reference_gemm(d);
  // A·B = [[4,5],[10,11]], column-major
  CHECK(C == std::vector<float>{4, 10, 5, 11});
  // transposed A: A stored as its transpose (3x2, lda 3) gives the same product
  const std::vector<float> At = {1, 2, 3, 4, 5, 6};
  d.trans_a = true;
  d.a = At.data();
  d.lda = 3;
  std::fill(C.begin(), C.end(), -7.0f);
  gpu::reference_gemm(d);
  CHECK(C == std::vector<float>{4, 10, 5, 11});
  // cuBLAS's argument rules
  d.lda = 2;  // < k for a transposed A
  CHECK_THROWS_AS(gpu::check_gemm(d, "t"), writescope::config_error);
  d.lda = 3;
  d.b_type = wtype::bf16;
  CHECK_THROWS_AS(gpu::check_gemm(d, "t"), writescope::config_error);
}

TEST_CASE("linear_desc equals the host path's linear layer, strided output, bf16 operands") {
  const int out = 37, in = 29, n = 5;
  linear L;
  L.out = out;
  L.in = in;
  L.weight = randn(std::size_t(out) * in, 1);
  const auto x = randn(std::size_t(n) * in, 2);
  std::vector<float> ref(std::size_t(n) * out);
  L.forward(x.data(), n, ref.data());
  // into columns [3, 3+out) of a wider output (ldy = out + 5)
  const idx ldy = out + 5;
  std::vector<float> y(std::size_t(n) * ldy, 0.0f);
  gpu::reference_gemm(gpu::linear_desc(L.weight.data(), wtype::f32, out, in, x.data(), n, y.data() + 3, ldy));
  std::vector<float> got(std::size_t(n) * out);
  for (int t = 0; t < n; ++t)
    for (int o = 0; o < out; ++o) got[std::size_t(t * out + o)] = y[std::size_t(t * ldy + 3 + o)];
  CHECK(max_diff(got, ref) < 1e-4);
  // bf16 operands: the product of the rounded values
  std::vector<std::uint16_t> wb(L.weight.size()), xb(x.size());
  std::vector<float> wr(L.weight.size()), xr(x.size());
  for (std::size_t i = 0; i < wb.size(); ++i) wr[i] = gpu::bf16_to_float(wb[i] = gpu::float_to_bf16(L.weight[i]));
  for (std::size_t i = 0; i < xb.size(); ++i) xr[i] = gpu::bf16_to_float(xb[i] = gpu::float_to_bf16(x[i]));
  L.weight = wr;
  L.forward(xr.data(), n, ref.data());
  std::vector<float> y16(std::size_t(n) * out);
  gpu::reference_gemm(gpu::linear_desc(wb.data(), wtype::bf16, out, in, xb.data(), n, y16.data(), out));
  CHECK(max_diff(y16, ref) < 1e-4);
}

TEST_CASE("MLA absorb and expand descriptors equal the per-head products") {
  const int H = 3, nope = 5, rope = 4, vh = 6, rank = 8, n = 4;
  const int qk = nope + rope, q_dim = rank + rope;
  const auto kv_b = randn(std::size_t(H) * (nope + vh) * rank, 3);  // [H*(nope+vh)][rank]
  const auto qf = randn(std::size_t(n) * H * qk, 4);               // [n][H][qk]
  std::vector<float> q(std::size_t(n) * H * q_dim, 99.0f);
  gpu::reference_gemm(gpu::mla_absorb_desc(kv_b.data(), qf.data(), wtype::f32, n, H, nope, rope, vh, rank, q.data(), q_dim));
  double worst = 0.0;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h) {
      for (int r = 0; r < rank; ++r) {
        double acc = 0.0;
        for (int l = 0; l < nope; ++l)
          acc += double(qf[std::size_t((t * H + h) * qk + l)]) * kv_b[std::size_t((h * (nope + vh) + l) * rank + r)];
        worst = std::max(worst, std::fabs(acc - q[std::size_t((t * H + h) * q_dim + r)]));
      }
      for (int r = rank; r < q_dim; ++r) CHECK(q[std::size_t((t * H + h) * q_dim + r)] == 99.0f);  // rope part untouched
    }
  CHECK(worst < 1e-5);

  const auto a = randn(std::size_t(n) * H * rank, 5);  // [n][H][rank]
  std::vector<float> v(std::size_t(n) * H * vh);
  gpu::reference_gemm(gpu::mla_expand_desc(kv_b.data(), a.data(), wtype::f32, n, H, nope, vh, rank, v.data()));
  worst = 0.0;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < vh; ++c) {
        double acc = 0.0;
        for (int r = 0; r < rank; ++r)
          acc += double(a[std::size_t((t * H + h) * rank + r)]) * kv_b[std::size_t((h * (nope + vh) + nope + c) * rank + r)];
        worst = std::max(worst, std::fabs(acc - v[std::size_t((t * H + h) * vh + c)]));
      }
  CHECK(worst < 1e-5);
}

TEST_CASE("prefill blocks (pack, scores, causal softmax, P·V, unpack) equal causal_attention") {
  struct shape {
    int hq, hkv, d, dv, T, rows;
    bool shared_kv;  // MLA: V = the first dv elements of the K row
  };
  for (const shape s : {shape{6, 2, 8, 8, 13, 4, false}, shape{4, 1, 12, 8, 9, 9, true}, shape{3, 3, 8, 8, 7, 1, false},
                      shape{4, 1, 12, 8, 11, 3, true}}) {
    CAPTURE(s.hq);
    CAPTURE(s.hkv);
    CAPTURE(s.rows);
    const int group = s.hq / s.hkv;
    const idx ts = idx(s.hkv) * s.d;
    const auto q = randn(std::size_t(s.T) * s.hq * s.d, 6);
    const auto k = randn(std::size_t(s.T) * ts, 7);
    const auto vv = s.shared_kv ? k : randn(std::size_t(s.T) * ts, 8);
    const float scale = 0.37f;
    std::vector<float> ref(std::size_t(s.T) * s.hq * s.dv);
    causal_attention(q.data(), s.hq, s.d, k.data(), vv.data(), s.hkv, ts, s.d, s.dv, s.T, scale, ref.data());

    gpu::emulated_exec x;
    std::vector<float> qp(std::size_t(s.hq) * s.rows * s.d), S(std::size_t(s.hq) * s.rows * s.T),
        P(S.size()), O(std::size_t(s.hq) * s.rows * s.dv), out(ref.size(), -5.0f);
    for (idx t0 = 0; t0 < s.T; t0 += s.rows) {
      const idx rows = std::min<idx>(s.rows, s.T - t0), keys = t0 + rows, R = rows * group;
      x.run(gpu::pack_q_op{q.data(), t0, rows, s.hq, group, s.d, qp.data(), wtype::f32}, idx(s.hq) * rows * s.d);
      x.gemm(gpu::prefill_qk_desc(k.data(), wtype::f32, ts, s.d, qp.data(), R, s.d, keys, s.hkv, S.data()), "qk");
      x.causal_softmax(gpu::softmax_params{S.data(), P.data(), wtype::f32, idx(s.hkv) * R, R, group, keys, t0, scale});
      x.gemm(gpu::prefill_pv_desc(vv.data(), wtype::f32, ts, s.d, P.data(), R, keys, s.dv, s.hkv, O.data()), "pv");
      x.run(gpu::unpack_o_op{O.data(), t0, rows, s.hq, group, s.dv, out.data()}, idx(s.hq) * rows * s.dv);
    }
    CHECK(max_diff(out, ref) < 1e-5);
  }
}

TEST_CASE("route_op equals route_tokens for the three routers, ties included") {
  const int n = 23;
  auto check = [&](model_config c) {
    CAPTURE(to_string(c.kind));
    const int E = c.num_experts, k = c.experts_per_tok;
    linear router;  // identity: the router logits are the input
    router.out = router.in = E;
    router.weight.assign(std::size_t(E) * E, 0.0f);
    for (int e = 0; e < E; ++e) router.weight[std::size_t(e) * E + e] = 1.0f;
    auto h = randn(std::size_t(n) * E, 9);
    for (int e = 0; e < E; e += 3) h[std::size_t(e)] = h[1];  // ties in token 0
    for (float& v : h) v = std::round(v * 4.0f) / 4.0f;        // and many more (quantised logits)
    const routing ref = route_tokens(c, router, h.data(), n);
    std::vector<int> ex(std::size_t(n) * k);
    std::vector<float> w(std::size_t(n) * k);
    gpu::route_op r{};
    r.logits = h.data();
    r.E = E;
    r.k = k;
    r.group_limited = c.topk_method == "group_limited_greedy" ? 1 : 0;
    r.n_group = c.n_group;
    r.topk_group = c.topk_group;
    r.renorm = c.kind == arch::mixtral || (c.kind == arch::qwen3_moe && c.norm_topk_prob) ? 1 : 0;
    r.apply_scale = c.kind == arch::deepseek_v2 ? 1 : 0;
    r.scale = float(c.routed_scaling_factor);
    r.experts = ex.data();
    r.weights = w.data();
    for (idx t = 0; t < n; ++t) r(t);
    CHECK(ex == ref.experts);
    CHECK(max_diff(w, ref.weights) <= 1e-7);
  };
  model_config q;
  q.kind = arch::qwen3_moe;
  q.num_experts = 12;
  q.experts_per_tok = 4;
  q.norm_topk_prob = true;
  check(q);
  q.norm_topk_prob = false;
  check(q);
  model_config m;
  m.kind = arch::mixtral;
  m.num_experts = 8;
  m.experts_per_tok = 2;
  check(m);
  model_config d;
  d.kind = arch::deepseek_v2;
  d.num_experts = 16;
  d.experts_per_tok = 3;
  d.routed_scaling_factor = 2.5;
  check(d);
  d.topk_method = "group_limited_greedy";
  d.n_group = 4;
  d.topk_group = 2;
  check(d);
}

TEST_CASE("rope_op equals rotary::apply (rotate-half, interleaved, YaRN)") {
  rope_config plain;
  plain.theta = 10000.0;
  rope_config yarn;
  yarn.type = "yarn";
  yarn.theta = 10000.0;
  yarn.factor = 40.0;
  yarn.original_max_position_embeddings = 4096;
  yarn.mscale = 0.707;
  yarn.mscale_all_dim = 0.707;
  yarn.attention_factor = 1.3;
  for (const auto& [rc, style] : {std::pair{plain, rotary::style::half}, std::pair{yarn, rotary::style::interleaved}}) {
    const int dim = 32, heads = 3, n = 5;
    const idx stride = dim + 8;  // heads padded, like MLA's q' rope part
    const rotary rot(rc, dim, style);
    auto x = randn(std::size_t(n) * heads * stride, 10);
    auto y = x;
    const std::vector<idx> pos = {0, 1, 17, 1000, 70000};
    for (int t = 0; t < n; ++t) rot.apply(x.data() + t * heads * stride, heads, stride, pos[std::size_t(t)]);
    gpu::rope_op op{y.data(), heads, idx(heads) * stride, stride, pos.data(), rot.inv_freq().data(), dim,
                    rot.attention_factor(), rot.interleaved() ? 1 : 0};
    for (idx i = 0; i < idx(n) * heads * (dim / 2); ++i) op(i);
    CHECK(max_diff(x, y) < 1e-6);
  }
}

TEST_CASE("random weights: the device generator is the host path's") {
  const weight_source src(42, 0.1);
  const linear l = src.make_linear("model.layers.0.mlp.gate", 7, 9);
  const std::uint64_t h = src.name_hash("model.layers.0.mlp.gate.weight");
  for (idx i = 0; i < 63; ++i) CHECK(gpu::random_weight(h, i, src.random_scale()) == l.weight[std::size_t(i)]);
  // bf16 round trip of the shared conversion helpers
  for (float v : {0.0f, -1.0f, 3.14159f, 1e-30f, 65504.0f})
    CHECK(gpu::float_to_bf16(v) == writescope::bf16::from_float(v).bits);
}

namespace {

/// A grouped-expert problem: E experts with bf16 weights [out][in] (gate and
/// up), packed row offsets with an empty expert, one expert of more than 8
/// rows (two passes of the CUDA kernel) and one expert in host memory (null).
struct expert_problem {
  int E = 5, out = 16, in = 24;
  std::vector<int> offsets = {0, 3, 3, 12, 13, 20};
  int host_expert = 3;
  std::vector<std::vector<std::uint16_t>> gate, up;
  std::vector<float> x;
  explicit expert_problem(std::uint64_t seed) {
    for (int e = 0; e < E; ++e) {
      std::vector<std::uint16_t> g(std::size_t(out) * in), u(g.size());
      const auto gf = randn(g.size(), seed + 2 * std::uint64_t(e), 0.3f), uf = randn(g.size(), seed + 2 * std::uint64_t(e) + 1, 0.3f);
      for (std::size_t i = 0; i < g.size(); ++i) {
        g[i] = gpu::float_to_bf16(gf[i]);
        u[i] = gpu::float_to_bf16(uf[i]);
      }
      gate.push_back(std::move(g));
      up.push_back(std::move(u));
    }
    x = randn(std::size_t(offsets.back()) * in, seed + 100);
  }
};

}  // namespace

TEST_CASE("expert_gemv_reference equals one GEMM per expert, skips host experts") {
  const expert_problem P(7);
  const int rows = P.offsets.back();
  std::vector<const void*> wg(std::size_t(P.E)), wu(std::size_t(P.E));
  for (int e = 0; e < P.E; ++e) {
    wg[std::size_t(e)] = e == P.host_expert ? nullptr : P.gate[std::size_t(e)].data();
    wu[std::size_t(e)] = e == P.host_expert ? nullptr : P.up[std::size_t(e)].data();
  }
  for (const int round_x : {0, 1}) {
    for (const bool gate_up : {true, false}) {
      CAPTURE(round_x);
      CAPTURE(gate_up);
      const float poison = -1.25e30f;
      std::vector<float> y(std::size_t(rows) * P.out, poison);
      gpu::expert_gemv_params p;
      p.w = wg.data();
      p.up = gate_up ? wu.data() : nullptr;
      p.offsets = P.offsets.data();
      p.experts = P.E;
      p.out = P.out;
      p.in = P.in;
      p.x = P.x.data();
      p.x_stride = P.in;
      p.y = y.data();
      p.y_stride = P.out;
      p.round_x = round_x;
      gpu::expert_gemv_reference(p);
      // the per-expert path: bf16 GEMM operands (round_x) or fp32 with the weights widened
      for (int e = 0; e < P.E; ++e) {
        const int r0 = P.offsets[std::size_t(e)], m = P.offsets[std::size_t(e) + 1] - r0;
        if (e == P.host_expert) {  // not written
          for (std::size_t i = std::size_t(r0) * P.out; i < std::size_t(r0 + m) * P.out; ++i) REQUIRE(y[i] == poison);
          continue;
        }
        if (m == 0) continue;
        std::vector<float> g(std::size_t(m) * P.out), u(g.size());
        std::vector<std::uint16_t> xb(std::size_t(m) * P.in);
        std::vector<float> wgf(P.gate[std::size_t(e)].size()), wuf(wgf.size());
        for (std::size_t i = 0; i < wgf.size(); ++i) {
          wgf[i] = gpu::bf16_to_float(P.gate[std::size_t(e)][i]);
          wuf[i] = gpu::bf16_to_float(P.up[std::size_t(e)][i]);
        }
        const float* xe = P.x.data() + std::size_t(r0) * P.in;
        for (std::size_t i = 0; i < xb.size(); ++i) xb[i] = gpu::float_to_bf16(xe[i]);
        auto product = [&](const std::vector<std::uint16_t>& w16, const std::vector<float>& w32, float* out) {
          if (round_x)
            gpu::reference_gemm(gpu::linear_desc(w16.data(), wtype::bf16, P.out, P.in, xb.data(), m, out, P.out));
          else
            gpu::reference_gemm(gpu::linear_desc(w32.data(), wtype::f32, P.out, P.in, xe, m, out, P.out));
        };
        product(P.gate[std::size_t(e)], wgf, g.data());
        product(P.up[std::size_t(e)], wuf, u.data());
        if (gate_up)
          for (std::size_t i = 0; i < g.size(); ++i) gpu::silu_mul_op{g.data(), u.data()}(idx(i));
        for (int r = 0; r < m; ++r)
          for (int o = 0; o < P.out; ++o)
            REQUIRE(y[std::size_t(r0 + r) * P.out + o] == g[std::size_t(r) * P.out + o]);
      }
    }
  }
}

TEST_CASE("four-wide MoE passes (gather to bf16, SiLU product to bf16, combine) equal plain loops bit for bit") {
  const int H = 12, I = 8, k = 3, n_tokens = 5;
  const auto src = randn(std::size_t(n_tokens) * H, 31);
  const std::vector<int> rows = {4, 0, 0, 3, 2, 1, 4, 2};  // packed rows -> token (repeats, any order)
  const idx np = idx(rows.size());
  // gather: dst[j][e] = bf16(src[rows[j]][e])
  std::vector<std::uint16_t> g16(std::size_t(np * H) + 4, 0xdead);  // poisoned tail must survive
  gpu::gather_rows_bf16x4_op gop{src.data(), H, rows.data(), H / 4, g16.data()};
  REQUIRE(gpu::fits_x4(H, src.data()));
  for (idx i = 0; i < np * H / 4; ++i) gop(i);
  for (idx j = 0; j < np; ++j)
    for (int e = 0; e < H; ++e)
      CHECK(g16[std::size_t(j * H + e)] == writescope::bf16::from_float(src[std::size_t(rows[std::size_t(j)] * H + e)]).bits);
  for (std::size_t t = std::size_t(np * H); t < g16.size(); ++t) CHECK(g16[t] == 0xdead);
  // SiLU product: a = bf16(g / (1 + exp(-g)) * u)
  const auto g = randn(std::size_t(np * I), 32, 3.0f), u = randn(std::size_t(np * I), 33);
  std::vector<std::uint16_t> a16(std::size_t(np * I), 0xdead);
  gpu::silu_mul_bf16x4_op sop{g.data(), u.data(), a16.data()};
  for (idx i = 0; i < np * I / 4; ++i) sop(i);
  for (std::size_t i = 0; i < a16.size(); ++i)
    CHECK(a16[i] == writescope::bf16::from_float(g[i] / (1.0f + std::exp(-g[i])) * u[i]).bits);
  // combine: out[t][e] = sum_s w[t][s] * y[crow[t][s]][e], s ascending, from 0
  const auto y = randn(std::size_t(np * H), 34);
  std::vector<int> crow(std::size_t(n_tokens * k));
  for (std::size_t i = 0; i < crow.size(); ++i) crow[i] = int((i * 5 + 3) % std::size_t(np));
  const auto w = randn(crow.size(), 35);
  std::vector<float> out(std::size_t(n_tokens * H), -7.0f);
  gpu::combine_x4_op cop{y.data(), crow.data(), w.data(), k, H / 4, out.data()};
  for (idx i = 0; i < idx(n_tokens) * H / 4; ++i) cop(i);
  for (int t = 0; t < n_tokens; ++t)
    for (int e = 0; e < H; ++e) {
      float acc = 0.0f;
      for (int s = 0; s < k; ++s) acc += y[std::size_t(crow[std::size_t(t * k + s)] * H + e)] * w[std::size_t(t * k + s)];
      CHECK(out[std::size_t(t * H + e)] == acc);
    }
  CHECK_FALSE(gpu::fits_x4(10, src.data()));
  CHECK_FALSE(gpu::fits_x4(H, src.data() + 1));
}

TEST_CASE("fitted_group_rows: the least-cost partition of sorted loads, against every partition") {
  using writescope::index_t;
  std::mt19937 rng(5);
  const index_t pad = 64;
  // the cost of a partition given as the first expert of each group after the first
  auto cost = [&](const std::vector<index_t>& rows, unsigned cuts, double row_cost, double group_cost) {
    double c = 0;
    std::size_t start = 0;
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (i + 1 == rows.size() || (cuts >> i & 1u)) {  // a group ends at i
        c += group_cost + double(i + 1 - start) * double(gpu::ladder_rows(rows[i], pad)) * row_cost;
        start = i + 1;
      }
    return c;
  };
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t n = 1 + rng() % 10;
    std::vector<index_t> rows(n);
    const index_t spread = trial % 3 == 0 ? 100 : trial % 3 == 1 ? 3000 : 40000;
    for (auto& r : rows) r = 1 + index_t(rng() % std::uint32_t(spread));
    std::sort(rows.begin(), rows.end());
    const double row_cost = 1.0, group_cost = double(rng() % 20000);
    const std::vector<index_t> got = gpu::fitted_group_rows(rows, pad, row_cost, group_cost);
    REQUIRE(got.size() == n);
    // the result is a partition into runs of equal padded size, each the ladder size of its largest load
    double got_cost = 0;
    for (std::size_t i = 0; i < n;) {
      std::size_t j = i;
      while (j < n && got[j] == got[i]) ++j;
      CHECK(got[i] == gpu::ladder_rows(rows[j - 1], pad));
      if (j < n) CHECK(got[j] > got[i]);
      got_cost += group_cost + double(j - i) * double(got[i]) * row_cost;
      i = j;
    }
    double best = -1;
    for (unsigned cuts = 0; cuts < (1u << (n - 1)); ++cuts) {
      const double c = cost(rows, cuts, row_cost, group_cost);
      if (best < 0 || c < best) best = c;
    }
    INFO("trial " << trial << " n " << n << " group cost " << group_cost);
    CHECK(got_cost == doctest::Approx(best).epsilon(1e-12));
  }
  // no group cost: every expert at its own ladder size; a huge one: a single group
  const std::vector<index_t> loads = {1, 70, 130, 700, 2100, 2200, 9000};
  const auto alone = gpu::fitted_group_rows(loads, pad, 1.0, 0.0);
  for (std::size_t i = 0; i < loads.size(); ++i) CHECK(alone[i] == gpu::ladder_rows(loads[i], pad));
  for (const index_t r : gpu::fitted_group_rows(loads, pad, 1.0, 1e12)) CHECK(r == gpu::ladder_rows(9000, pad));
  CHECK(gpu::fitted_group_rows({}, pad, 1.0, 1.0).empty());
  CHECK_THROWS_AS(gpu::fitted_group_rows({5, 3}, pad, 1.0, 1.0), std::invalid_argument);
  CHECK_THROWS_AS(gpu::fitted_group_rows({0, 3}, pad, 1.0, 1.0), std::invalid_argument);
  CHECK_THROWS_AS(gpu::fitted_group_rows({3}, 0, 1.0, 1.0), std::invalid_argument);
  CHECK_THROWS_AS(gpu::fitted_group_rows({3}, pad, -1.0, 1.0), std::invalid_argument);
}

namespace {
/// The first maximum of a row (std::max_element with -0 equal to +0), NaN
/// skipped; 0 for a row with no number.
int first_max(const float* x, idx cols) {
  int best = -1;
  for (idx c = 0; c < cols; ++c) {
    if (std::isnan(x[c])) continue;
    if (best < 0 || x[c] > x[best]) best = int(c);
  }
  return best < 0 ? 0 : best;
}
}  // namespace

// Greedy selection on the device (emulated executor's argmax_rows and the keys'
// encoding the CUDA kernel shares): the first maximum, ties to the lower column,
// -0 equal to +0, NaN never chosen, rows of -inf or of NaN give column 0.
TEST_CASE("argmax_rows: the first maximum of each row (ties, signed zeros, NaN, infinities)") {
  gpu::emulated_exec x;
  for (const idx cols : {idx(1), idx(5), idx(4099), idx(151936)}) {
    CAPTURE(cols);
    const idx rows = 7;
    std::vector<float> v(std::size_t(rows * cols));
    std::mt19937_64 rng{std::uint64_t(cols)};
    std::normal_distribution<float> d(0.0f, 3.0f);
    for (float& f : v) f = d(rng);
    auto row = [&](idx r) { return v.data() + r * cols; };
    if (cols > 4) {
      const float m = *std::max_element(row(1), row(1) + cols) + 1.0f;  // row 1: a tie, the lower column wins
      row(1)[cols - 2] = m;
      row(1)[3] = m;
      for (idx c = 0; c < cols; ++c) row(2)[c] = -1.0f - float(c % 7);  // row 2: -0 then +0 are the maximum
      row(2)[2] = -0.0f;
      row(2)[4] = 0.0f;
      row(3)[0] = NAN;  // row 3: NaN first and in the middle, never chosen
      row(3)[cols / 2] = NAN;
    }
    std::fill(row(4), row(4) + cols, -INFINITY);  // row 4: all -inf
    std::fill(row(5), row(5) + cols, NAN);        // row 5: all NaN
    row(6)[cols - 1] = INFINITY;                  // row 6: +inf last
    std::vector<std::uint64_t> keys(std::size_t(rows), 0xababababababababull);
    x.argmax_rows(v.data(), rows, cols, keys.data());
    for (idx r = 0; r < rows; ++r) {
      CAPTURE(r);
      CHECK(gpu::argmax_key_column(keys[std::size_t(r)]) == first_max(row(r), cols));
    }
    if (cols > 4) {
      CHECK(gpu::argmax_key_column(keys[1]) == 3);
      CHECK(gpu::argmax_key_column(keys[2]) == 2);
    }
    CHECK(gpu::argmax_key_column(keys[6]) == int(cols - 1));
  }
}

// Split routing's upload: the host experts' packed rows (null table entries)
// come from the CPU's rows, the device experts' rows stay as they are.
TEST_CASE("host_rows_op copies exactly the host experts' packed rows") {
  const int E = 5;
  const idx H = 6, pairs = 9;
  std::vector<const void*> table(std::size_t(E), nullptr);
  static const int weights = 0;
  table[1] = table[3] = &weights;  // experts 1 and 3 on the device
  const std::vector<unsigned> keys = {0, 1, 1, 2, 3, 3, 3, 4, 4};
  std::vector<float> src(std::size_t(pairs * H)), dst(std::size_t(pairs * H), -7.0f);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = float(i);
  const gpu::host_rows_op op{keys.data(), table.data(), src.data(), H, dst.data()};
  for (idx i = 0; i < pairs * H; ++i) op(i);
  for (idx p = 0; p < pairs; ++p)
    for (idx e = 0; e < H; ++e) {
      const bool host = table[keys[std::size_t(p)]] == nullptr;
      CHECK(dst[std::size_t(p * H + e)] == (host ? float(p * H + e) : -7.0f));
    }
}
