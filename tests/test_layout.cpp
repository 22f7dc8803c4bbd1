// SPDX-License-Identifier: Apache-2.0
// Layout arithmetic at run time (the constexpr part is static_asserted in
// layout.hpp), the block format's offsets, the model presets, bf16 rounding,
// and the runtime -> compile-time head-dim dispatch.
#include <doctest/doctest.h>

#include <set>

#include "support/harness.hpp"

using namespace wstest;

namespace {

struct no_tag_layout {  // every member of a layout, but no opt-in tag
  [[maybe_unused]] static constexpr int planes = 1, key_plane = 0, value_plane = 0, row_elems = 64, q_dim = 64, v_dim = 64;
  [[maybe_unused]] static constexpr bool is_mla = false;
  int num_q_heads() const { return 1; }
  int kv_heads() const { return 1; }
  int group_size() const { return 1; }
  index_t token_bytes() const { return 128; }
};
static_assert(!kv_layout<no_tag_layout>, "layouts are opt-in by tag");
static_assert(!kv_layout<int>);

// Every (plane, kv_head, token, elem) maps to a distinct offset in
// [0, block_elems); each (plane, kv_head) slice is contiguous, token-major.
template <class Layout>
void check_block_format(const Layout& L, int block_tokens) {
  const block_format<Layout> f{L, block_tokens};
  CAPTURE(block_tokens);
  CHECK(f.slice_elems() == index_t(block_tokens) * Layout::row_elems);
  CHECK(f.block_elems() == index_t(Layout::planes) * L.kv_heads() * block_tokens * Layout::row_elems);
  CHECK(f.block_bytes() == f.block_elems() * 2);
  CHECK(f.block_bytes() == L.token_bytes() * block_tokens);
  std::vector<std::uint8_t> seen(std::size_t(f.block_elems()), 0);
  index_t expect = 0;
  for (int p = 0; p < Layout::planes; ++p)
    for (int h = 0; h < L.kv_heads(); ++h) {
      REQUIRE(f.slice_offset(p, h) == expect);
      for (int t = 0; t < block_tokens; ++t)
        for (int e = 0; e < Layout::row_elems; ++e) {
          const index_t off = f.offset(p, h, t, e);
          REQUIRE(off == expect);  // row-major [plane][kv_head][token][elem]
          REQUIRE(off >= 0);
          REQUIRE(off < f.block_elems());
          REQUIRE(seen[std::size_t(off)] == 0);
          seen[std::size_t(off)] = 1;
          ++expect;
        }
    }
  CHECK(expect == f.block_elems());
}

}  // namespace

TEST_CASE("block_format offsets are a bijection onto the block, per-head slices contiguous") {
  SUBCASE("GQA 32/4 d128") {
    for (int bt : {1, 16, 17, 64}) check_block_format(gqa_layout<128>(32, 4), bt);
  }
  SUBCASE("GQA 8/8 d64 and 2/1 d256") {
    check_block_format(gqa_layout<64>(8, 8), 5);
    check_block_format(gqa_layout<256>(2, 1), 3);
  }
  SUBCASE("MLA 512+64") {
    for (int bt : {1, 16, 64}) check_block_format(mla_layout<512, 64>(16), bt);
  }
  // A few hand-computed offsets.
  const block_format<gqa_layout<128>> g{gqa_layout<128>(32, 4), 16};
  CHECK(g.offset(0, 0, 0, 0) == 0);
  CHECK(g.offset(0, 1, 0, 0) == 16 * 128);
  CHECK(g.offset(1, 0, 0, 0) == 4 * 16 * 128);
  CHECK(g.offset(1, 2, 3, 4) == ((1 * 4 + 2) * 16 + 3) * 128 + 4);
  const block_format<mla_layout<512, 64>> m{mla_layout<512, 64>(16), 64};
  CHECK(m.offset(0, 0, 63, 575) == 64 * 576 - 1);
  CHECK(m.slice_offset(mla_layout<512, 64>::value_plane, 0) == 0);  // values = first 512 elements of each row
}

TEST_CASE("block_format offsets stay 64-bit for blocks far into a region") {
  const block_format<gqa_layout<256>> f{gqa_layout<256>(64, 64), 256};
  // one block: 2 planes * 64 heads * 256 tokens * 256 elems = 8 Mi elements = 16 MiB
  CHECK(f.block_bytes() == index_t{16} << 20);
  CHECK(f.offset(1, 63, 255, 255) == f.block_elems() - 1);
  // Block id 300 of an arena: 300 * 8 Mi elements > 2^31.
  const index_t far = index_t{300} * f.block_elems() + f.offset(1, 63, 255, 255);
  CHECK(far > (index_t{1} << 31));
  CHECK(far * index_t(sizeof(bf16)) > (index_t{1} << 32));
}

TEST_CASE("layouts: head counts, groups and token bytes") {
  const gqa_layout<128> g(28, 4);
  CHECK(g.num_q_heads() == 28);
  CHECK(g.kv_heads() == 4);
  CHECK(g.group_size() == 7);
  CHECK(g.token_bytes() == 2 * 4 * 128 * 2);
  const mla_layout<512, 64> m(16);
  CHECK(m.kv_heads() == 1);
  CHECK(m.group_size() == 16);
  CHECK(mla_layout<512, 64>::q_dim == 576);
  CHECK(mla_layout<512, 64>::v_dim == 512);
  CHECK(gqa_layout<64>().num_q_heads() == 1);
  CHECK(gqa_layout<128>(8, 2) == gqa_layout<128>(8, 2));
  CHECK_FALSE(gqa_layout<128>(8, 2) == gqa_layout<128>(8, 4));
}

TEST_CASE("presets: token bytes and softmax scales of the three models") {
  CHECK(presets::qwen3_30b_a3b::layout().token_bytes() == 2048);
  CHECK(presets::mixtral_8x7b::layout().token_bytes() == 4096);
  CHECK(presets::deepseek_v2_lite::layout().token_bytes() == 1152);
  CHECK(presets::qwen3_30b_a3b::layout().group_size() == 8);
  CHECK(presets::mixtral_8x7b::layout().group_size() == 4);
  CHECK(presets::deepseek_v2_lite::layout().num_q_heads() == 16);
  CHECK(presets::qwen3_30b_a3b::num_layers == 48);
  CHECK(presets::mixtral_8x7b::num_layers == 32);
  CHECK(presets::deepseek_v2_lite::num_layers == 27);
  // 1/sqrt(128), computed independently.
  CHECK(presets::qwen3_30b_a3b::softmax_scale() == doctest::Approx(0.08838834764831843).epsilon(1e-15));
  CHECK(presets::mixtral_8x7b::softmax_scale() == doctest::Approx(0.08838834764831843).epsilon(1e-15));
  // DeepSeek-V2-Lite: mscale = 0.1 * 0.707 * ln(40) + 1; scale = mscale^2 / sqrt(128 + 64).
  CHECK(presets::deepseek_v2_lite::yarn_mscale() == doctest::Approx(1.2608037774058554).epsilon(1e-15));
  CHECK(presets::deepseek_v2_lite::softmax_scale() == doctest::Approx(0.11472138679292612).epsilon(1e-15));
  // The scale is neither the bare 1/sqrt(192) nor mscale/sqrt(192) (K6: a missing factor).
  CHECK(presets::deepseek_v2_lite::softmax_scale() > 1.5 / std::sqrt(192.0));
}

TEST_CASE("bf16: round to nearest even, exact widening, NaN stays NaN") {
  CHECK(bf16::from_float(1.0f).bits == 0x3f80);
  CHECK(bf16::from_float(1.0f).to_float() == 1.0f);
  // 1 + 2^-8 is exactly half way between 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(bf16::from_float(1.0f + 0x1p-8f).bits == 0x3f80);
  // 1 + 3*2^-8 is half way between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  CHECK(bf16::from_float(1.0f + 3 * 0x1p-8f).bits == 0x3f82);
  CHECK(bf16::from_float(1.0f + 0x1p-8f + 0x1p-20f).bits == 0x3f81);  // above half: up
  CHECK(bf16::from_float(-2.5f).to_float() == -2.5f);
  CHECK(std::isnan(bf16::from_float(std::numeric_limits<float>::quiet_NaN()).to_float()));
  CHECK(std::isinf(bf16::from_float(std::numeric_limits<float>::infinity()).to_float()));
  CHECK(round_to_bf16(3.0e4f) == bf16{poison_bf16_bits}.to_float());
  CHECK(std::abs(bf16{poison_bf16_bits}.to_float() - 3.0e4f) <= 64.0f);
  // Every bf16 value widens exactly and narrows back to itself.
  for (std::uint32_t b = 0; b < 0x10000; b += 7) {
    const bf16 x{std::uint16_t(b)};
    const float f = x.to_float();
    if (std::isnan(f)) continue;
    REQUIRE(bf16::from_float(f).bits == x.bits);
  }
}

TEST_CASE("dispatch_head_dim selects the compile-time head dim or names the value and the supported set") {
  std::set<int> hit;
  for (int d : {64, 128, 256}) {
    const int got = dispatch_head_dim(d, [](auto c) { return decltype(c)::value; });
    CHECK(got == d);
    dispatch_head_dim(d, [&](auto c) { hit.insert(c.value); });  // void-returning functor
  }
  CHECK(hit == std::set<int>{64, 128, 256});
  for (int bad : {80, 0, -128, 512}) {
    try {
      dispatch_head_dim(bad, [](auto) {});
      FAIL("expected config_error for head dim " << bad);
    } catch (const config_error& e) {
      CHECK(mentions(e.what(), {"head dim", std::to_string(bad), "64, 128, 256"}));
    }
  }
  // dispatch_value on an arbitrary list, with a move-only result.
  auto p = dispatch_value<3, 5, 7>(5, "widget", [](auto c) { return std::make_unique<int>(c.value * 2); });
  CHECK(*p == 10);
  auto bad_widget = [] { return dispatch_value<3, 5, 7>(4, "widget", [](auto) { return 0; }); };
  CHECK_THROWS_AS(bad_widget(), config_error);
}

TEST_CASE("partition_spec derived sizes round up to whole blocks") {
  partition_spec s;
  s.block_tokens = 16;
  s.d_window_tokens = 64;
  s.cpu_capacity_tokens = 100;
  s.pinned_capacity_tokens = 32;
  CHECK(s.window_blocks() == 4);
  CHECK(s.cpu_capacity_blocks() == 7);
  CHECK(s.pinned_capacity_blocks() == 2);
  const gqa_layout<128> L(8, 2);
  s.ping_pong_bytes = 3 * block_format<gqa_layout<128>>{L, 16}.block_bytes() + 100;  // rounded down
  CHECK(s.ping_pong_blocks(L) == 3);
}
