// SPDX-License-Identifier: Apache-2.0
// block_pool: lowest-first allocation, contiguity, release and reuse, refused
// double frees, growth (paper §4.1: the block is the unit of reuse). The
// reference is a std::set of free ids.
#include <doctest/doctest.h>

#include <numeric>
#include <random>
#include <set>

#include "support/harness.hpp"

using namespace wstest;

namespace {

std::vector<block_id> iota_ids(block_id first, int n) {
  std::vector<block_id> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

void check_against(const block_pool& p, const std::set<block_id>& free_ids) {
  REQUIRE(p.free_blocks() == index_t(free_ids.size()));
  REQUIRE(p.used_blocks() == p.capacity() - index_t(free_ids.size()));
  for (block_id b = 0; b < p.capacity(); ++b) REQUIRE(p.is_used(b) == (free_ids.count(b) == 0));
}

}  // namespace

TEST_CASE("a fresh pool hands out consecutive ids, lowest first") {
  block_pool p(200, 200, "test pool");
  CHECK(p.capacity() == 200);
  CHECK(p.free_blocks() == 200);
  std::vector<block_id> out;
  p.allocate(70, out);  // crosses a 64-bit word
  CHECK(out == iota_ids(0, 70));
  p.allocate(0, out);
  CHECK(out.size() == 70);
  p.allocate(130, out);  // appends, continuing where it stopped
  CHECK(out == iota_ids(0, 200));
  CHECK(p.free_blocks() == 0);
  CHECK(p.used_blocks() == 200);
}

TEST_CASE("released blocks are reused in place, lowest first") {
  block_pool p(200, 200, "test pool");
  std::vector<block_id> all;
  p.allocate(200, all);
  const std::vector<block_id> rel{150, 63, 64, 127, 5};
  p.release(rel.data(), rel.size());
  CHECK(p.free_blocks() == 5);
  std::vector<block_id> got;
  p.allocate(3, got);
  CHECK(got == std::vector<block_id>{5, 63, 64});
  got.clear();
  p.allocate(2, got);
  CHECK(got == std::vector<block_id>{127, 150});
  CHECK(p.free_blocks() == 0);
  // free everything: the pool is fresh again (contiguous)
  p.release(all.data(), all.size());
  got.clear();
  p.allocate(100, got);
  CHECK(got == iota_ids(0, 100));
}

TEST_CASE("allocation beyond the free count throws capacity_error and changes nothing") {
  block_pool p(10, 10, "unpinned compute region");
  std::vector<block_id> out;
  p.allocate(7, out);
  try {
    p.allocate(4, out);
    FAIL("expected capacity_error");
  } catch (const capacity_error& e) {
    CHECK(mentions(e.what(), {"unpinned compute region", "4 blocks requested", "3 free"}));
  }
  CHECK(out.size() == 7);
  CHECK(p.free_blocks() == 3);
  p.allocate(3, out);
  CHECK(out == iota_ids(0, 10));
}

TEST_CASE("a pool given the setting that sizes it names that setting when full") {
  block_pool p(2, 2, "pinned load region", "partition_spec::pinned_capacity_tokens");
  std::vector<block_id> out;
  try {
    p.allocate(3, out);
    FAIL("expected capacity_error");
  } catch (const capacity_error& e) {
    CHECK(std::string(e.what()) ==
          "pinned load region: 3 blocks requested, 2 free of 2 (capacity exceeded; raise "
          "partition_spec::pinned_capacity_tokens)");
  }
  block_pool q(2, 2, "x");  // no setting: none named
  try {
    q.allocate(3, out);
    FAIL("expected capacity_error");
  } catch (const capacity_error& e) {
    CHECK(std::string(e.what()) == "x: 3 blocks requested, 2 free of 2 (capacity exceeded)");
  }
  CHECK(out.empty());
}

TEST_CASE("double free, unknown ids and repeated ids throw state_error and change nothing") {
  block_pool p(130, 130, "pinned load region");
  std::vector<block_id> out;
  p.allocate(100, out);
  const std::vector<block_id> first{3, 64, 65};
  p.release(first.data(), first.size());
  std::set<block_id> free_ids{3, 64, 65};
  for (block_id b = 100; b < 130; ++b) free_ids.insert(b);
  check_against(p, free_ids);

  SUBCASE("double free of one block") {
    const block_id again[] = {10, 64};  // 10 is used, 64 already free
    try {
      p.release(again, 2);
      FAIL("expected state_error");
    } catch (const state_error& e) {
      CHECK(mentions(e.what(), {"pinned load region", "64"}));
    }
  }
  SUBCASE("the same id twice in one call") {
    const block_id twice[] = {11, 12, 11};
    try {
      p.release(twice, 3);
      FAIL("expected state_error");
    } catch (const state_error& e) {
      CHECK(mentions(e.what(), {"11", "twice"}));
    }
  }
  SUBCASE("ids out of range") {
    const block_id neg[] = {-1};
    const block_id big[] = {130};
    CHECK_THROWS_AS(p.release(neg, 1), state_error);
    CHECK_THROWS_AS(p.release(big, 1), state_error);
  }
  check_against(p, free_ids);  // unchanged, whatever was refused
  std::vector<block_id> got;
  p.allocate(4, got);
  CHECK(got == std::vector<block_id>{3, 64, 65, 100});
}

TEST_CASE("growth adds free blocks after the old ones, up to the maximum") {
  block_pool p(0, 300, "pinned load region");
  CHECK(p.capacity() == 0);
  std::vector<block_id> out;
  CHECK_THROWS_AS(p.allocate(1, out), capacity_error);
  p.grow_to(60);
  p.allocate(60, out);
  CHECK(out == iota_ids(0, 60));
  p.grow_to(130);  // crosses word boundaries
  CHECK(p.capacity() == 130);
  CHECK(p.free_blocks() == 70);
  p.allocate(70, out);
  CHECK(out == iota_ids(0, 130));
  p.grow_to(100);  // shrinking is a no-op
  CHECK(p.capacity() == 130);
  try {
    p.grow_to(301);
    FAIL("expected capacity_error");
  } catch (const capacity_error& e) {
    CHECK(mentions(e.what(), {"301", "300"}));
  }
  CHECK(p.capacity() == 130);
  p.grow_to(300);
  CHECK(p.free_blocks() == 170);
}

TEST_CASE("invalid pool sizes are config errors") {
  CHECK_THROWS_AS(block_pool(-1, 10, "x"), config_error);
  CHECK_THROWS_AS(block_pool(11, 10, "x"), config_error);
  CHECK_THROWS_AS(block_pool(0, index_t{1} << 32, "x"), config_error);
}

TEST_CASE("random allocate/release/grow sequences match a set of free ids (lowest-first)") {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    index_t cap = 70;
    block_pool p(cap, 400, "random pool");
    std::set<block_id> free_ids;
    for (block_id b = 0; b < cap; ++b) free_ids.insert(b);
    std::vector<block_id> used;
    for (int it = 0; it < 3000; ++it) {
      const int op = int(rng() % 10);
      if (op < 5) {
        const index_t n = index_t(rng() % 9);
        std::vector<block_id> got;
        if (n > index_t(free_ids.size())) {
          REQUIRE_THROWS_AS(p.allocate(n, got), capacity_error);
          REQUIRE(got.empty());
        } else {
          p.allocate(n, got);
          auto it2 = free_ids.begin();
          for (index_t k = 0; k < n; ++k, ++it2) REQUIRE(got[std::size_t(k)] == *it2);
          for (block_id b : got) {
            free_ids.erase(b);
            used.push_back(b);
          }
        }
      } else if (op < 9) {
        std::vector<block_id> rel;
        const int n = int(rng() % 7);
        for (int k = 0; k < n && !used.empty(); ++k) {
          const std::size_t i = std::size_t(rng() % used.size());
          rel.push_back(used[i]);
          used.erase(used.begin() + std::ptrdiff_t(i));
        }
        p.release(rel.data(), rel.size());
        for (block_id b : rel) free_ids.insert(b);
      } else if (cap < 400) {
        const index_t ncap = std::min<index_t>(400, cap + index_t(rng() % 40));
        p.grow_to(ncap);
        for (block_id b = block_id(cap); b < ncap; ++b) free_ids.insert(b);
        cap = ncap;
      }
      if (it % 100 == 0) check_against(p, free_ids);
    }
    check_against(p, free_ids);
  }
}
