// SPDX-License-Identifier: Apache-2.0
// MLA (DeepSeek-V2-Lite geometry, absorbed form, paper §6.1) through the
// split cache, against the NON-absorbed fp64 reference: random W_UK
// [h][nope][rank] and W_UV [h][v][rank]; the test folds W_UK into the query
// (q' = q_nope·W_UK ‖ q_pe) and expands the cache's latent output by W_UV in
// double, and compares with per-head attention over k = [W_UK c ‖ k_pe],
// v = W_UV c (reference::mla_decode). Softmax scale: DeepSeek's, with mscale².
#include <doctest/doctest.h>

#include <cstdint>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using M = mla_layout<512, 64>;
using ds = presets::deepseek_v2_lite;
constexpr int H = 16, RANK = 512, ROPE = 64, NOPE = ds::qk_nope_head_dim, VD = ds::v_head_dim, Q = M::q_dim;

struct fixed_5 {
  using type = fixed_ratio;
  static fixed_ratio make() { return fixed_ratio(0.5); }
};
struct gpu_only_mk {
  using type = gpu_only;
  static gpu_only make() { return {}; }
};
struct cpu_only_mk {
  using type = cpu_only;
  static cpu_only make() { return {}; }
};

/// A cache over MLA rows, the attention step, the history of every row, and
/// random projection weights.
template <class Policy>
class mla_rig {
 public:
  using cache_type = host_cache<M, Policy>;
  host_backend be;
  M lay{H};
  cache_type cache;
  hybrid_attention<cache_type> attn;
  bf16_source src;
  double scale;
  std::vector<double> w_uk, w_uv;  // [h][nope][rank], [h][v][rank]
  std::vector<kv_history<M>> hist;
  kv_generator<M> gen;
  // last step
  std::vector<float> q_nope, q_pe, q_abs, out, lse;
  debug_partials dbg;

  mla_rig(Policy p, int max_seqs, std::uint64_t seed, double softmax_scale = ds::softmax_scale(), int threads = 1)
      : cache(be, lay, make_spec(max_seqs), std::move(p), {}, cache_options{true}),
        attn(cache, attention_options{threads, true}),
        src(seed),
        scale(softmax_scale) {
    w_uk.resize(std::size_t(H) * NOPE * RANK);
    w_uv.resize(std::size_t(H) * VD * RANK);
    const double s = 1.0 / std::sqrt(double(RANK));
    for (auto& x : w_uk) x = s * src.next_float();
    for (auto& x : w_uv) x = s * src.next_float();
  }
  static partition_spec make_spec(int max_seqs) {
    partition_spec s = small_spec(1, max_seqs);  // block 16, D 32, split 4, CPU task 3
    set_ping_pong_blocks(s, M(H), 6);
    return s;
  }

  sequence_id add(index_t p) {
    const sequence_id id = cache.begin_sequence(p);
    if (std::size_t(id) >= hist.size()) hist.resize(std::size_t(id) + 1);
    hist[std::size_t(id)] = {};
    if (p > 0) {
      const auto b = gen.make(lay, p, src);
      cache.append_prefill(0, id, b.view());
      record(hist[std::size_t(id)], lay, b, 0, p);
    }
    return id;
  }

  void append(std::span<const sequence_id> batch) {
    const auto b = gen.make(lay, index_t(batch.size()), src);
    cache.append(0, batch, b.view());
    for (std::size_t i = 0; i < batch.size(); ++i) record(hist[std::size_t(batch[i])], lay, b, index_t(i), 1);
  }

  /// Fresh q_nope/q_pe per sequence, absorbed into q' (fp32), one attention step.
  void attend(std::span<const sequence_id> batch) {
    const std::size_t n = batch.size();
    q_nope.resize(n * H * NOPE);
    q_pe.resize(n * H * ROPE);
    q_abs.assign(n * H * Q, 0.0f);
    for (auto& x : q_nope) x = src.next_float();
    for (auto& x : q_pe) x = src.next_float();
    for (std::size_t i = 0; i < n; ++i)
      for (int h = 0; h < H; ++h) {
        float* qa = q_abs.data() + (i * H + std::size_t(h)) * Q;
        const float* qn = q_nope.data() + (i * H + std::size_t(h)) * NOPE;
        std::vector<double> acc(RANK, 0.0);  // q' = q_nope · W_UK[h], in double
        for (int k = 0; k < NOPE; ++k) {
          const double* w = w_uk.data() + (std::size_t(h) * NOPE + std::size_t(k)) * RANK;
          for (int r = 0; r < RANK; ++r) acc[std::size_t(r)] += double(qn[k]) * w[r];
        }
        for (int r = 0; r < RANK; ++r) qa[r] = float(acc[std::size_t(r)]);
        std::copy_n(q_pe.data() + (i * H + std::size_t(h)) * ROPE, ROPE, qa + RANK);
      }
    out.assign(n * H * RANK, std::numeric_limits<float>::quiet_NaN());
    lse.assign(n * H, std::numeric_limits<float>::quiet_NaN());
    step_outputs<pageable_host_space> so{host_span<float>(out.data(), index_t(out.size())),
                                         host_span<float>(lse.data(), index_t(lse.size())), &dbg};
    attn.step(0, batch, host_span<const float>(q_abs.data(), index_t(q_abs.size())), float(scale), so);
  }

  /// Latent output and LSE vs the absorbed fp64 reference; every engine's
  /// partial vs the reference over its own rows.
  compare_result check_latent(std::span<const sequence_id> batch) {
    compare_result r;
    std::vector<double> ro, rl;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const auto& h = hist[std::size_t(batch[i])];
      reference_attention(lay, h, q_abs.data() + i * H * Q, scale, ro, rl);
      compare_rows(H, RANK, out.data() + i * H * RANK, lse.data() + i * H, ro, rl, r);
      const sequence_state& st = cache.sequence(batch[i]);
      const std::vector<float>* po[3] = {&dbg.cpu_o, &dbg.streamed_o, &dbg.window_o};
      const std::vector<float>* pl[3] = {&dbg.cpu_lse, &dbg.streamed_lse, &dbg.window_lse};
      for (int e = 0; e < 3; ++e) {
        const compare_result pr = check_engine_partial(lay, h, st, 16, engine(e), *po[e], *pl[e], i,
                                                       q_abs.data() + i * H * Q, scale);
        r.max_rel_l2 = std::max(r.max_rel_l2, pr.max_rel_l2);
        r.max_lse_err = std::max(r.max_lse_err, pr.max_lse_err);
        r.non_finite = r.non_finite || pr.non_finite;
      }
    }
    return r;
  }

  /// Output expanded by W_UV (double) vs the non-absorbed fp64 reference.
  /// `only`: check just this batch row.
  compare_result check_expanded(std::span<const sequence_id> batch, double ref_scale, std::size_t only = SIZE_MAX,
                                bool with_lse = true) {
    compare_result r;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      if (only != SIZE_MAX && i != only) continue;
      const auto& h = hist[std::size_t(batch[i])];
      std::vector<double> ro(std::size_t(H) * VD), rl(H);
      reference::mla_decode(H, RANK, ROPE, NOPE, VD, q_nope.data() + i * H * NOPE, q_pe.data() + i * H * ROPE,
                            h.planes[0].data(), h.tokens, w_uk.data(), w_uv.data(), ref_scale, ro.data(), rl.data());
      std::vector<float> o(std::size_t(H) * VD);
      for (int hh = 0; hh < H; ++hh)
        for (int v = 0; v < VD; ++v) {
          double acc = 0;
          const float* lat = out.data() + (i * H + std::size_t(hh)) * RANK;
          const double* w = w_uv.data() + (std::size_t(hh) * VD + std::size_t(v)) * RANK;
          for (int k = 0; k < RANK; ++k) acc += w[k] * double(lat[k]);
          o[std::size_t(hh) * VD + std::size_t(v)] = float(acc);
        }
      compare_rows(H, VD, o.data(), with_lse ? lse.data() + i * H : nullptr, ro, rl, r);
    }
    return r;
  }
};

}  // namespace

TEST_CASE_TEMPLATE("MLA decode loop (DeepSeek-V2-Lite: 16 heads, 512 + 64) matches the non-absorbed fp64 reference", Mk,
                   fixed_5, gpu_only_mk, cpu_only_mk) {
  mla_rig<typename Mk::type> rig(Mk::make(), 4, 606);
  // First attended lengths 1, 32 (= D), 34, 101; 45 steps cross an eviction for
  // each. The latent output and every engine's partial are checked against the
  // absorbed reference at every step; the expanded output against the
  // non-absorbed one (about 0.6 GFLOP per sequence in fp64) every 11th step.
  const std::vector<sequence_id> batch{rig.add(0), rig.add(31), rig.add(33), rig.add(100)};
  for (int s = 0; s < 45; ++s) {
    CAPTURE(s);
    rig.append(batch);
    rig.attend(batch);
    const compare_result lat = rig.check_latent(batch);
    INFO("latent rel_l2 " << lat.max_rel_l2 << " lse " << lat.max_lse_err);
    REQUIRE(lat.ok());
    if (s % 11 == 0 || s == 44) {
      const compare_result ex = rig.check_expanded(batch, ds::softmax_scale());
      INFO("expanded rel_l2 " << ex.max_rel_l2 << " lse " << ex.max_lse_err);
      REQUIRE(ex.ok());
    }
    rig.cache.flush();
  }
  CHECK(rig.cache.total_placed_tokens() > 0);
}

TEST_CASE("MLA: the scale includes mscale^2 and is applied once by every engine (K6); L = 1 gives the latent row") {
  mla_rig<fixed_ratio> rig(fixed_ratio(0.5), 2, 17);
  const std::vector<sequence_id> batch{rig.add(0), rig.add(4 * 32 + 7)};
  rig.append(batch);
  rig.attend(batch);
  REQUIRE(rig.check_latent(batch).ok());
  REQUIRE(rig.check_expanded(batch, ds::softmax_scale()).ok());
  // L = 1: LSE = scale * q'.row, and the latent output is the row's c_kv exactly.
  const auto& h = rig.hist[std::size_t(batch[0])];
  for (int hh = 0; hh < H; ++hh) {
    double dot = 0;
    for (int e = 0; e < Q; ++e) dot += double(rig.q_abs[std::size_t(hh) * Q + std::size_t(e)]) * h.planes[0][std::size_t(e)].to_float();
    CHECK(std::abs(rig.lse[std::size_t(hh)] - ds::softmax_scale() * dot) <= 1e-5 * (1 + std::abs(ds::softmax_scale() * dot)));
    for (int e = 0; e < RANK; ++e) REQUIRE(rig.out[std::size_t(hh) * RANK + std::size_t(e)] == h.planes[0][std::size_t(e)].to_float());
  }
  // The sequence with 136 rows over all three engines: a missing mscale^2 (or
  // one applied twice) fails the same comparison, in the output alone and in
  // the LSE alone.
  REQUIRE(rig.cache.sequence(batch[1]).cpu_placed_tokens > 0);
  REQUIRE(rig.cache.sequence(batch[1]).cpu_placed_tokens < rig.cache.sequence(batch[1]).placed_tokens);
  const double m2 = ds::yarn_mscale() * ds::yarn_mscale();
  for (double wrong : {ds::softmax_scale() / m2, ds::softmax_scale() * m2}) {
    CHECK(rig.check_expanded(batch, wrong, 1, false).max_rel_l2 > rel_l2_bar);
    CHECK(rig.check_expanded(batch, wrong, 1, true).max_lse_err > 0.0);
  }
}

TEST_CASE("MLA: a sequence in a batch is bit-identical across reruns and CPU thread counts (K10)") {
  std::vector<float> outs[3];
  for (int k = 0; k < 3; ++k) {
    mla_rig<fixed_ratio> rig(fixed_ratio(0.5), 3, 9, ds::softmax_scale(), k == 2 ? 2 : 1);
    const std::vector<sequence_id> batch{rig.add(3 * 32 + 1), rig.add(5), rig.add(64)};
    for (int s = 0; s < 12; ++s) {
      rig.append(batch);
      rig.attend(batch);
      outs[k].insert(outs[k].end(), rig.out.begin(), rig.out.end());
      outs[k].insert(outs[k].end(), rig.lse.begin(), rig.lse.end());
      rig.cache.flush();
    }
    REQUIRE(rig.check_latent(batch).ok());
  }
  CHECK(same_bits(outs[0], outs[1]));
  CHECK(same_bits(outs[0], outs[2]));
}
