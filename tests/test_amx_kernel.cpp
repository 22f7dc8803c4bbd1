// SPDX-License-Identifier: Apache-2.0
// The AMX-BF16 decode kernel (cpu/amx_attention.hpp) against the fp64
// reference: its algorithm on the portable tile emulation (every machine),
// and the hardware tiles where the CPU has AMX (the GPU machine's Xeon; other
// machines report the hardware cases as skipped). MLA and GQA layouts, head
// blocks of 16 with padded short blocks, chunk remainders around 16/32/64,
// partial and empty segments with poisoned rows past their end, extreme
// logits (K2), empty inputs (K1), determinism (K10), long-sequence accuracy
// (K3) and the hardware against the emulation.
#include <doctest/doctest.h>

#include <thread>

#include "support/harness.hpp"
#include "support/kernel_segments.hpp"
#include "writescope/cpu/amx_attention.hpp"

using namespace wstest;

namespace {

template <class Layout>
using emu_kernel = cpu::amx_decode_kernel<Layout, cpu::amx_detail::emulated_tiles>;
template <class Layout>
using hw_kernel = cpu::amx_decode_kernel<Layout, cpu::amx_detail::hw_tiles>;

bool hardware_or_skip() {
  if (cpu::amx_available()) return true;
  MESSAGE("this CPU (or kernel) offers no AMX-BF16 tiles: hardware case skipped, emulation only");
  return false;
}

template <class L>
L make_layout(int group, int kv_heads) {
  if constexpr (L::is_mla) {
    (void)kv_heads;
    return L(group);
  } else {
    return L(group * kv_heads, kv_heads);
  }
}

template <class L, class Kernel>
void sweep(const std::vector<int>& groups, const std::vector<index_t>& lengths, const std::vector<int>& block_tokens,
           std::uint64_t seed) {
  bf16_source src(seed);
  double worst = 0;
  for (int g : groups) {
    const int hkv = L::is_mla ? 1 : 2;
    const L lay = make_layout<L>(g, hkv);
    for (index_t n : lengths)
      for (int bt : block_tokens) {
        CAPTURE(g);
        CAPTURE(n);
        CAPTURE(bt);
        const auto h = random_history(lay, n, src);
        const segment_list<L> sl(lay, bt, h, cut(n, bt, 3, bt == 64 ? 2 : 0));
        const auto q = random_queries(std::size_t(lay.num_q_heads()) * L::q_dim, src);
        const compare_result r = run_kernel_and_compare<L, Kernel>(lay, h, sl, q, 1.0 / std::sqrt(double(L::q_dim)));
        INFO("rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
        REQUIRE(r.ok());
        CHECK(r.max_rel_l2 <= 2e-5);  // fp32-class: q and p in two bf16 parts each
        worst = std::max(worst, r.max_rel_l2);
      }
  }
  MESSAGE(std::string(Kernel::emulated_tiles_name()) << " R=" << L::row_elems << ": worst relative L2 against fp64 " << worst);
}

}  // namespace

TEST_CASE("AMX kernel, emulated tiles, matches fp64: MLA and GQA, head blocks, chunk remainders, partial and empty segments") {
  const std::vector<index_t> lengths{1, 15, 16, 17, 33, 64, 65, 130};
  sweep<mla_layout<512, 64>, emu_kernel<mla_layout<512, 64>>>({1, 16, 17}, lengths, {7, 64}, 11);
  sweep<gqa_layout<128>, emu_kernel<gqa_layout<128>>>({1, 4, 8, 20}, lengths, {16, 64}, 12);
  sweep<gqa_layout<64>, emu_kernel<gqa_layout<64>>>({3}, {100}, {64}, 13);
}

TEST_CASE("AMX kernel, hardware tiles, matches fp64 and the emulation") {
  if (!hardware_or_skip()) return;
  const std::vector<index_t> lengths{1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 300};
  sweep<mla_layout<512, 64>, hw_kernel<mla_layout<512, 64>>>({1, 3, 16, 17, 32, 33}, lengths, {1, 7, 16, 64}, 21);
  sweep<gqa_layout<128>, hw_kernel<gqa_layout<128>>>({1, 2, 4, 8, 16, 17}, lengths, {7, 16, 64}, 22);
  sweep<gqa_layout<256>, hw_kernel<gqa_layout<256>>>({4}, {70, 300}, {64}, 23);

  // The inline assembly against the instruction semantics written in C++.
  using L = mla_layout<512, 64>;
  const L lay(16);
  bf16_source src(24);
  const auto h = random_history(lay, 700, src);
  const segment_list<L> sl(lay, 64, h, cut(700, 64, 4, 3));
  const auto q = random_queries(16 * L::q_dim, src);
  std::vector<float> oh, lh, oe, le;
  REQUIRE(run_kernel_and_compare<L, hw_kernel<L>>(lay, h, sl, q, 0.1147, &oh, &lh).ok());
  REQUIRE(run_kernel_and_compare<L, emu_kernel<L>>(lay, h, sl, q, 0.1147, &oe, &le).ok());
  // Not bit-identical: inside one TDPBF16PS the hardware's order and
  // rounding of the 32 products is its own (and it flushes denormals). Both
  // are held to the fp64 bar above; here, how far apart they are.
  double worst_l2 = 0, worst_lse = 0;
  for (int hh = 0; hh < 16; ++hh) {
    double num = 0, den = 0;
    for (int e = 0; e < L::v_dim; ++e) {
      const double a = oh[std::size_t(hh * L::v_dim + e)], b = oe[std::size_t(hh * L::v_dim + e)];
      num += (a - b) * (a - b);
      den += b * b;
    }
    worst_l2 = std::max(worst_l2, std::sqrt(num / den));
    worst_lse = std::max(worst_lse, std::abs(double(lh[std::size_t(hh)]) - le[std::size_t(hh)]));
  }
  MESSAGE("hardware vs emulated tiles: worst relative L2 " << worst_l2 << ", worst |LSE difference| " << worst_lse);
  CHECK(worst_l2 <= 4e-5);  // each is within 2e-5 of fp64 (the sweeps above)
  CHECK(worst_lse <= 1e-4);
}

TEST_CASE("AMX kernel: empty inputs give exactly (0, -inf); poisoned blocks behind zero-token segments are not read (K1)") {
  using L = mla_layout<512, 64>;
  const L lay(16);
  const block_format<L> fmt{lay, 64};
  std::vector<bf16> poisoned(std::size_t(fmt.block_elems()), bf16{poison_bf16_bits});
  bf16_source src(5);
  const auto q = random_queries(16 * L::q_dim, src);
  auto check_empty = [&](auto kernel_tag) {
    using K = decltype(kernel_tag);
    std::vector<float> o(16 * L::v_dim, std::numeric_limits<float>::quiet_NaN()), lse(16, 0.0f);
    const cpu::kv_segment segs[] = {{poisoned.data(), 0}, {poisoned.data(), 0}};
    K::run(fmt, 0, q.data(), L::q_dim, 16, 0.1f, segs, o.data(), L::v_dim, lse.data());
    for (float x : o) CHECK(std::bit_cast<std::uint32_t>(x) == 0u);
    for (float x : lse) CHECK(x == -std::numeric_limits<float>::infinity());
    K::run(fmt, 0, q.data(), L::q_dim, 16, 0.1f, {}, o.data(), L::v_dim, lse.data());
    for (float x : lse) CHECK(x == -std::numeric_limits<float>::infinity());
  };
  check_empty(emu_kernel<L>{});
  if (hardware_or_skip()) check_empty(hw_kernel<L>{});
}

TEST_CASE("AMX kernel: very negative, very positive and very different logits never zero a row (K2)") {
  using L = mla_layout<512, 64>;
  const L lay(16);
  for (float kmean : {-100.0f, 100.0f, 0.0f})
    for (float qmag : {1.0f, 30.0f}) {
      CAPTURE(kmean);
      CAPTURE(qmag);
      bf16_source src(9);
      kv_generator<L> gen;
      gen.value = [kmean](int, int, int, bf16_source& s) { return bf16::from_float(kmean + s.next().to_float()); };
      const auto h = random_history(lay, 90, src, gen);
      const segment_list<L> sl(lay, 64, h, cut(90, 64, 2, 2));
      std::vector<float> q(16 * L::q_dim);
      for (auto& x : q) x = qmag * (kmean == 0.0f ? src.next_float() : 1.0f + 0.01f * src.next_float());
      auto check = [&](auto kernel_tag) {
        std::vector<float> o, lse;
        const compare_result r =
            run_kernel_and_compare<L, decltype(kernel_tag)>(lay, h, sl, q, 1.0 / std::sqrt(576.0), &o, &lse);
        INFO("rel_l2 " << r.max_rel_l2 << " lse " << r.max_lse_err);
        CHECK(r.ok());
        for (float x : lse) CHECK(std::isfinite(x));
      };
      check(emu_kernel<L>{});
      if (hardware_or_skip()) check(hw_kernel<L>{});
    }
}

TEST_CASE("AMX kernel: bit-identical across reruns and threads (K10); 32K tokens in one call stay fp32-class (K3)") {
  if (!hardware_or_skip()) return;
  using L = mla_layout<512, 64>;
  const L lay(16);
  bf16_source src(8);
  const auto h = random_history(lay, 333, src);
  const segment_list<L> sl(lay, 64, h, cut(333, 64, 4, 3));
  const auto q = random_queries(16 * L::q_dim, src);
  std::vector<float> o1, l1, o2, l2, o3, l3;
  REQUIRE(run_kernel_and_compare<L, hw_kernel<L>>(lay, h, sl, q, 0.09, &o1, &l1).ok());
  REQUIRE(run_kernel_and_compare<L, hw_kernel<L>>(lay, h, sl, q, 0.09, &o2, &l2).ok());
  std::thread t([&] { (void)run_kernel_and_compare<L, hw_kernel<L>>(lay, h, sl, q, 0.09, &o3, &l3); });
  t.join();
  CHECK(same_bits(o1, o2));
  CHECK(same_bits(l1, l2));
  CHECK(same_bits(o1, o3));
  CHECK(same_bits(l1, l3));

  bf16_source big(32768);
  const index_t n = 32768;
  const auto hb = random_history(lay, n, big);
  const segment_list<L> slb(lay, 64, hb, cut(n, 64, 0, 0));
  const auto qb = random_queries(16 * L::q_dim, big);
  const compare_result r = run_kernel_and_compare<L, hw_kernel<L>>(lay, hb, slb, qb, 0.1147);
  INFO("rel_l2 " << r.max_rel_l2);
  CHECK(r.ok());
  CHECK(r.max_rel_l2 <= 2e-5);
}

TEST_CASE("auto_decode_kernel: AMX for MLA when available (WRITESCOPE_CPU_AMX), the FMA kernel otherwise") {
  const bool amx = cpu::amx_available();
  const cpu::amx_use u = cpu::amx_setting();
  CHECK(cpu::auto_decode_kernel<mla_layout<512, 64>>::uses_amx() == (amx && u != cpu::amx_use::off));
  CHECK(cpu::auto_decode_kernel<gqa_layout<128>>::uses_amx() == (amx && u == cpu::amx_use::all));
  MESSAGE("AMX available: " << amx << ", WRITESCOPE_CPU_AMX setting " << int(u));
  using L = mla_layout<512, 64>;
  const L lay(16);
  bf16_source src(3);
  const auto h = random_history(lay, 200, src);
  const segment_list<L> sl(lay, 64, h, cut(200, 64, 0, 0));
  const auto q = random_queries(16 * L::q_dim, src);
  CHECK(run_kernel_and_compare<L, cpu::auto_decode_kernel<L>>(lay, h, sl, q, 0.1).ok());
}
