// SPDX-License-Identifier: Apache-2.0
// merge_states / merge_state_row: the exact LSE merge of partial attention
// states (paper §4.2, §5.1; FAULT-KINDS K1/C1, K2, K4/C6). Expected values come
// from fp64 attention over the union of the key subsets (reference.hpp).
#include <doctest/doctest.h>

#include "support/harness.hpp"

using namespace wstest;

namespace {

constexpr float ninf = -std::numeric_limits<float>::infinity();

// fp64 attention of one query over `n` random keys/values (dim d), split into
// two disjoint subsets by `in_a`; returns the partial of each subset (fp32) and
// the full reference (fp64).
struct split_case {
  int d;
  std::vector<float> oa, ob;
  float la = 0, lb = 0;
  std::vector<double> oref;
  double lref = 0;
};

split_case make_split(int n, int d, double scale, std::uint64_t seed, const std::function<bool(int)>& in_a,
                      float key_shift_b = 0.0f) {
  bf16_source src(seed);
  std::vector<bf16> k(std::size_t(n) * d), v(std::size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      k[std::size_t(t) * d + i] = bf16::from_float(src.next().to_float() + (in_a(t) ? 0.0f : key_shift_b));
      v[std::size_t(t) * d + i] = src.next();
    }
  reference::vector q(d);
  for (int i = 0; i < d; ++i) q(i) = double(src.next_float());
  auto sub = [&](auto pred, std::vector<double>& o) {
    std::vector<int> ids;
    for (int t = 0; t < n; ++t)
      if (pred(t)) ids.push_back(t);
    reference::matrix K(Eigen::Index(ids.size()), d), Vm(Eigen::Index(ids.size()), d);
    for (std::size_t r = 0; r < ids.size(); ++r)
      for (int i = 0; i < d; ++i) {
        K(Eigen::Index(r), i) = k[std::size_t(ids[r]) * d + i].to_float();
        Vm(Eigen::Index(r), i) = v[std::size_t(ids[r]) * d + i].to_float();
      }
    o.assign(std::size_t(d), 0.0);
    return reference::attend(K, Vm, q, scale, o.data());
  };
  split_case c;
  c.d = d;
  std::vector<double> oa, ob;
  c.la = float(sub([&](int t) { return in_a(t); }, oa));
  c.lb = float(sub([&](int t) { return !in_a(t); }, ob));
  c.oa.assign(oa.begin(), oa.end());
  c.ob.assign(ob.begin(), ob.end());
  c.lref = sub([](int) { return true; }, c.oref);
  return c;
}

double rel_l2(const float* o, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (o[i] - ref[i]) * (o[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("merge of two empty partials is empty, never NaN (K1/C1)") {
  for (int v_dim : {1, 7, 128}) {
    std::vector<float> a(std::size_t(v_dim), 0.0f), b(std::size_t(v_dim), 0.0f), o(std::size_t(v_dim), 1.0f);
    float lse = 123.0f;
    merge_state_row(a.data(), ninf, b.data(), ninf, o.data(), &lse, v_dim);
    CHECK(lse == ninf);
    for (float x : o) CHECK(std::bit_cast<std::uint32_t>(x) == 0u);
  }
}

TEST_CASE("merge with an empty partial returns the other bit for bit, either side, in place too (K1/C1)") {
  bf16_source src(7);
  const int v_dim = 96;
  std::vector<float> x(v_dim), e(v_dim, 0.0f), o(v_dim);
  for (auto& f : x) f = src.next_float();
  for (float lx : {-1e30f, -88.5f, -3.25f, 0.0f, 17.0f, 1e30f}) {
    float lse = 0;
    std::fill(o.begin(), o.end(), std::numeric_limits<float>::quiet_NaN());
    merge_state_row(x.data(), lx, e.data(), ninf, o.data(), &lse, v_dim);
    CHECK(same_bits(o, x));
    CHECK(std::bit_cast<std::uint32_t>(lse) == std::bit_cast<std::uint32_t>(lx));
    std::fill(o.begin(), o.end(), std::numeric_limits<float>::quiet_NaN());
    merge_state_row(e.data(), ninf, x.data(), lx, o.data(), &lse, v_dim);
    CHECK(same_bits(o, x));
    CHECK(std::bit_cast<std::uint32_t>(lse) == std::bit_cast<std::uint32_t>(lx));
    // in place: out aliases the empty input
    std::vector<float> acc(v_dim, 0.0f);
    float lacc = ninf;
    merge_state_row(acc.data(), lacc, x.data(), lx, acc.data(), &lacc, v_dim);
    CHECK(same_bits(acc, x));
    CHECK(lacc == lx);
  }
}

TEST_CASE("merging partials over disjoint key subsets equals fp64 attention over their union") {
  const int d = 128;
  const double scale = 1.0 / std::sqrt(128.0);
  struct split {
    const char* name;
    int n;
    std::function<bool(int)> in_a;
  };
  const split splits[] = {
      {"halves", 200, [](int t) { return t < 100; }},
      {"interleaved", 97, [](int t) { return t % 2 == 0; }},
      {"one key vs many", 54, [](int t) { return t == 17; }},
      {"many vs one key", 54, [](int t) { return t != 0; }},
  };
  for (const split& sp : splits) {
    const std::string name = sp.name;
    CAPTURE(name);
    const split_case c = make_split(sp.n, d, scale, 99, sp.in_a);
    std::vector<float> o(d);
    float lse = 0;
    merge_state_row(c.oa.data(), c.la, c.ob.data(), c.lb, o.data(), &lse, d);
    CHECK(rel_l2(o.data(), c.oref) <= 1e-5);
    CHECK(std::abs(lse - c.lref) <= 1e-5 * (1 + std::abs(c.lref)));
    // commutative up to fp32 rounding (FMA contraction makes it asymmetric in the last bit)
    std::vector<float> o2(d);
    float lse2 = 0;
    merge_state_row(c.ob.data(), c.lb, c.oa.data(), c.la, o2.data(), &lse2, d);
    CHECK(rel_l2(o2.data(), c.oref) <= 1e-5);
    CHECK(lse == lse2);
  }
}

TEST_CASE("merge of very different or very negative LSEs never zeroes a row and never overflows (K2)") {
  const int d = 64;
  // Keys of subset b shifted so that its logits are far below (or above) a's.
  for (float shift : {-40.0f, 40.0f, -400.0f}) {
    CAPTURE(shift);
    const double scale = 1.0;
    const split_case c = make_split(64, d, scale, 5, [](int t) { return t < 32; }, shift);
    std::vector<float> o(d);
    float lse = 0;
    merge_state_row(c.oa.data(), c.la, c.ob.data(), c.lb, o.data(), &lse, d);
    CHECK(std::isfinite(lse));
    CHECK(rel_l2(o.data(), c.oref) <= 1e-4);
    CHECK(std::abs(lse - c.lref) <= 1e-3 + 1e-5 * std::abs(c.lref));
  }
  // Synthetic: two partials whose LSEs are both hugely negative, or hugely
  // positive, or 1e4 apart: the result is the exact weighted mix.
  struct lc {
    float la, lb;
  };
  for (lc l : {lc{-1.0e4f, -1.0e4f - 0.6931472f}, lc{1.0e4f, 1.0e4f}, lc{-5.0e4f, 5.0e4f}, lc{88.0f, 89.0f},
               lc{-1e30f, -1e30f}}) {
    CAPTURE(l.la);
    CAPTURE(l.lb);
    std::vector<float> a(d, 2.0f), b(d, -1.0f), o(d);
    float lse = 0;
    merge_state_row(a.data(), l.la, b.data(), l.lb, o.data(), &lse, d);
    const double m = std::max<double>(l.la, l.lb);
    const double wa = std::exp(double(l.la) - m), wb = std::exp(double(l.lb) - m);
    const double expect_o = (2.0 * wa - 1.0 * wb) / (wa + wb);
    const double expect_l = m + std::log(wa + wb);
    for (float x : o) REQUIRE(std::abs(x - expect_o) <= 1e-6 * (1 + std::abs(expect_o)));
    CHECK(std::abs(lse - expect_l) <= 1e-6 * std::abs(expect_l) + 1e-6);
  }
}

namespace {

// Partial states of `seqs` x `heads` x `v_dim` in a layout given by strides,
// inside a buffer padded with a sentinel so a stray write shows.
struct strided_states {
  std::vector<float> o, lse;
  host_partial_view<float> view;
};

constexpr float sentinel = -777.0f;

strided_states make_states(int seqs, int heads, int v_dim, const char* kind) {
  strided_states s;
  index_t os, oh, ls, lh, o_size, l_size;
  const std::string k(kind);
  if (k == "dense") {
    os = index_t(heads) * v_dim, oh = v_dim, ls = heads, lh = 1;
  } else if (k == "transposed") {  // [head][seq][v]
    os = v_dim, oh = index_t(seqs) * v_dim, ls = 1, lh = seqs;
  } else if (k == "padded") {  // padded rows and padded sequences
    oh = v_dim + 5, os = index_t(heads) * oh + 3, ls = heads + 2, lh = 1;
  } else {  // "padded transposed"
    os = v_dim + 9, oh = index_t(seqs) * os + 1, ls = 3, lh = index_t(seqs) * 3 + 1;
  }
  o_size = (seqs - 1) * os + (heads - 1) * oh + v_dim + 16;
  l_size = (seqs - 1) * ls + (heads - 1) * lh + 1 + 16;
  s.o.assign(std::size_t(o_size), sentinel);
  s.lse.assign(std::size_t(l_size), sentinel);
  s.view = {s.o.data(), s.lse.data(), seqs, heads, v_dim, os, oh, ls, lh};
  return s;
}

}  // namespace

TEST_CASE("merge_states with different strides gives identical results, batch 5 (K4/C6)") {
  const int seqs = 5, heads = 6, v_dim = 32;
  // Reference partials, dense; some rows empty on one side or both.
  bf16_source src(11);
  std::vector<float> ao(seqs * heads * v_dim), bo(seqs * heads * v_dim), al(seqs * heads), bl(seqs * heads);
  for (auto& x : ao) x = src.next_float();
  for (auto& x : bo) x = src.next_float();
  for (int r = 0; r < seqs * heads; ++r) {
    al[std::size_t(r)] = 3.0f * src.next_float();
    bl[std::size_t(r)] = 3.0f * src.next_float();
    if (r % 7 == 3) {
      al[std::size_t(r)] = ninf;
      std::fill_n(ao.begin() + r * v_dim, v_dim, 0.0f);
    }
    if (r % 5 == 1) {
      bl[std::size_t(r)] = ninf;
      std::fill_n(bo.begin() + r * v_dim, v_dim, 0.0f);
    }
    if (r == 8) {
      al[std::size_t(r)] = bl[std::size_t(r)] = ninf;
      std::fill_n(ao.begin() + r * v_dim, v_dim, 0.0f);
      std::fill_n(bo.begin() + r * v_dim, v_dim, 0.0f);
    }
  }
  // Expected: row by row with merge_state_row on dense rows.
  std::vector<float> eo(seqs * heads * v_dim), el(seqs * heads);
  for (int r = 0; r < seqs * heads; ++r)
    merge_state_row(&ao[std::size_t(r) * v_dim], al[std::size_t(r)], &bo[std::size_t(r) * v_dim], bl[std::size_t(r)],
                    &eo[std::size_t(r) * v_dim], &el[std::size_t(r)], v_dim);
  for (int r = 0; r < seqs * heads; ++r) {  // and the expectation itself is sane
    REQUIRE(!std::isnan(el[std::size_t(r)]));
    if (r == 8) REQUIRE(el[std::size_t(r)] == ninf);
  }

  const char* kinds[] = {"dense", "transposed", "padded", "padded transposed"};
  for (const char* ka : kinds)
    for (const char* kb : kinds)
      for (const char* ko : kinds) {
        const std::string layouts = std::string(ka) + " / " + kb + " -> " + ko;
        CAPTURE(layouts);
        strided_states a = make_states(seqs, heads, v_dim, ka), b = make_states(seqs, heads, v_dim, kb),
                       o = make_states(seqs, heads, v_dim, ko);
        for (int s = 0; s < seqs; ++s)
          for (int h = 0; h < heads; ++h) {
            const std::size_t r = std::size_t(s * heads + h);
            std::copy_n(&ao[r * v_dim], v_dim, a.view.o_row(s, h));
            std::copy_n(&bo[r * v_dim], v_dim, b.view.o_row(s, h));
            a.view.lse_at(s, h) = al[r];
            b.view.lse_at(s, h) = bl[r];
          }
        const std::vector<float> a_before = a.o, b_before = b.o;
        try {
          merge_states(a.view, b.view, o.view);
        } catch (const shape_error& e) {
          FAIL("a valid non-overlapping layout was rejected: " << std::string(e.what()));
        }
        std::size_t written = 0;
        for (int s = 0; s < seqs; ++s)
          for (int h = 0; h < heads; ++h) {
            const std::size_t r = std::size_t(s * heads + h);
            REQUIRE(same_bits(o.view.o_row(s, h), &eo[r * v_dim], std::size_t(v_dim)));
            REQUIRE(std::bit_cast<std::uint32_t>(o.view.lse_at(s, h)) == std::bit_cast<std::uint32_t>(el[r]));
            written += std::size_t(v_dim);
          }
        // Nothing outside the rows was touched; the inputs are unchanged.
        CHECK(std::size_t(std::count_if(o.o.begin(), o.o.end(), [](float x) { return x != sentinel; })) <= written);
        CHECK(std::count(o.lse.begin(), o.lse.end(), sentinel) == std::ptrdiff_t(o.lse.size()) - seqs * heads);
        CHECK(same_bits(a.o, a_before));
        CHECK(same_bits(b.o, b_before));
      }

  SUBCASE("out may alias an input exactly (same pointers, same strides)") {
    for (const char* k : kinds) {
      const std::string layout = k;
      CAPTURE(layout);
      strided_states a = make_states(seqs, heads, v_dim, k), b = make_states(seqs, heads, v_dim, "dense");
      for (int s = 0; s < seqs; ++s)
        for (int h = 0; h < heads; ++h) {
          const std::size_t r = std::size_t(s * heads + h);
          std::copy_n(&ao[r * v_dim], v_dim, a.view.o_row(s, h));
          std::copy_n(&bo[r * v_dim], v_dim, b.view.o_row(s, h));
          a.view.lse_at(s, h) = al[r];
          b.view.lse_at(s, h) = bl[r];
        }
      merge_states(a.view, b.view, a.view);
      for (int s = 0; s < seqs; ++s)
        for (int h = 0; h < heads; ++h) {
          const std::size_t r = std::size_t(s * heads + h);
          REQUIRE(same_bits(a.view.o_row(s, h), &eo[r * v_dim], std::size_t(v_dim)));
          REQUIRE(a.view.lse_at(s, h) == el[r]);
        }
    }
  }
}

TEST_CASE("merge_states rejects overlapping layouts and mismatched shapes with shape_error, changing nothing") {
  const int seqs = 5, heads = 4, v_dim = 16;
  strided_states a = make_states(seqs, heads, v_dim, "dense"), b = make_states(seqs, heads, v_dim, "dense"),
                 o = make_states(seqs, heads, v_dim, "dense");
  for (auto& x : a.o) x = 1.0f;
  for (auto& x : b.o) x = 2.0f;
  for (auto& x : a.lse) x = 0.0f;
  for (auto& x : b.lse) x = 0.0f;
  const std::vector<float> o_before = o.o, l_before = o.lse;

  SUBCASE("rows overlap (head stride smaller than v_dim)") {
    host_partial_view<float> bad = o.view;
    bad.o_head_stride = v_dim - 1;
    try {
      merge_states(a.view, b.view, bad);
      FAIL("expected shape_error");
    } catch (const shape_error& e) {
      CHECK(mentions(e.what(), {"overlap", std::to_string(v_dim - 1)}));
    }
  }
  SUBCASE("sequences overlap (sequence stride too small)") {
    host_partial_view<float> bad = o.view;
    bad.o_seq_stride = index_t(heads - 1) * v_dim;
    CHECK_THROWS_AS(merge_states(a.view, b.view, bad), shape_error);
  }
  SUBCASE("transposed sequences overlapping heads") {
    host_partial_view<float> bad = o.view;
    bad.o_seq_stride = v_dim;
    bad.o_head_stride = index_t(seqs - 1) * v_dim;  // (s=4,h=0) and (s=0,h=1) share a row
    CHECK_THROWS_AS(merge_states(a.view, b.view, bad), shape_error);
  }
  SUBCASE("output LSEs overlap") {
    host_partial_view<float> bad = o.view;
    bad.lse_head_stride = 0;
    CHECK_THROWS_AS(merge_states(a.view, b.view, bad), shape_error);
  }
  SUBCASE("output partially aliases an input with other strides") {
    host_partial_view<float> bad = a.view;
    bad.o_seq_stride = v_dim;  // a transposed view of a's own memory
    bad.o_head_stride = index_t(seqs) * v_dim;
    CHECK_THROWS_AS(merge_states(a.view, b.view, bad), shape_error);
    for (float x : a.o) REQUIRE(x == 1.0f);
  }
  SUBCASE("shape mismatch names both shapes") {
    strided_states b4 = make_states(4, heads, v_dim, "dense");
    try {
      merge_states(a.view, b4.view, o.view);
      FAIL("expected shape_error");
    } catch (const shape_error& e) {
      CHECK(mentions(e.what(), {"[4][4][16]", "[5][4][16]"}));
    }
    strided_states o2 = make_states(seqs, heads, v_dim + 32, "dense");
    CHECK_THROWS_AS(merge_states(a.view, b.view, o2.view), shape_error);
  }
  CHECK(same_bits(o.o, o_before));
  CHECK(same_bits(o.lse, l_before));
}
