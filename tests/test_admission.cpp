// SPDX-License-Identifier: Apache-2.0
// Admission at scale: begin_sequence / end_sequence take their D-window slot
// and sequence id from free lists, O(1) in the number of sequences. The count
// of free-list entries examined (admission_probes()) must grow by exactly two
// per admission however many sequences are live; a linear scan over the
// slots or the ids would grow by O(live) per admission. A D-window of one
// token of a one-head layout (256 B per sequence) lets 100,000 sequences fit.
// The reference for which slot and id come next is the documented order: a
// fresh cache hands out 0, 1, 2, ...; after end_sequence() the most recently
// ended comes first.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<64>;

partition_spec tiny_spec(int max_sequences) {
  partition_spec s;
  s.num_layers = 1;
  s.block_tokens = 1;
  s.d_window_tokens = 1;
  s.max_sequences = max_sequences;
  s.cpu_capacity_tokens = 4;  // four placed tokens in all (the refusal case below)
  s.pinned_capacity_tokens = 4;
  s.pinned_initial_tokens = 0;
  s.gpu_split_blocks = 1;
  s.cpu_task_blocks = 1;
  s.ping_pong_bytes = 4 * G(1, 1).token_bytes();
  return s;
}

}  // namespace

TEST_CASE("admission is O(1) per sequence: 100,000 sequences, two free-list probes each") {
  constexpr int n = 100'000;
  host_backend be;
  const G lay(1, 1);
  host_cache<G, gpu_only> cache(be, lay, tiny_spec(n), gpu_only{});
  REQUIRE(cache.usage().d_window_bytes == index_t(n) * lay.token_bytes());
  CHECK(cache.admission_probes() == 0);

  // A fresh cache: ids and slots 0, 1, 2, ... in order.
  for (int i = 0; i < n; ++i) {
    const sequence_id id = cache.begin_sequence(0);
    REQUIRE(id == i);
    REQUIRE(cache.sequence(id).window_slot == i);
  }
  CHECK(cache.live_sequences() == n);
  CHECK(cache.admission_probes() == std::uint64_t(2) * n);

  // Full: refused, one probe (the empty slot list), nothing changed.
  CHECK_THROWS_AS(cache.begin_sequence(0), capacity_error);
  CHECK(cache.admission_probes() == std::uint64_t(2) * n + 1);
  CHECK(cache.live_sequences() == n);

  // End every other sequence, then admit as many again: the most recently
  // ended id and slot come first, each admission still two probes.
  std::vector<sequence_id> ended;
  for (int i = 0; i < n; i += 2) {
    const int slot = cache.sequence(i).window_slot;
    REQUIRE(slot == i);
    cache.end_sequence(i);
    ended.push_back(i);
  }
  CHECK(cache.live_sequences() == n / 2);
  const std::uint64_t before = cache.admission_probes();
  std::set<int> slots;
  for (std::size_t k = 0; k < ended.size(); ++k) {
    const sequence_id id = cache.begin_sequence(0);
    REQUIRE(id == ended[ended.size() - 1 - k]);
    REQUIRE(cache.sequence(id).window_slot == id);  // its slot was freed with it
    slots.insert(cache.sequence(id).window_slot);
  }
  CHECK(slots.size() == ended.size());
  CHECK(cache.admission_probes() - before == std::uint64_t(2) * ended.size());
  CHECK(cache.live_sequences() == n);

  // Every live sequence has its own slot (none shared, none out of range).
  std::vector<std::uint8_t> used(std::size_t(n), 0);
  for (sequence_id s = 0; s < n; ++s) {
    const int slot = cache.sequence(s).window_slot;
    REQUIRE(slot >= 0);
    REQUIRE(slot < n);
    REQUIRE(used[std::size_t(slot)] == 0);
    used[std::size_t(slot)] = 1;
  }
}

TEST_CASE("slots and ids ended in any order are reused most recent first, and only once") {
  host_backend be;
  const G lay(1, 1);
  host_cache<G, gpu_only> cache(be, lay, tiny_spec(8), gpu_only{});
  for (int i = 0; i < 8; ++i) REQUIRE(cache.begin_sequence(0) == i);
  // End 5, 1, 6 (their slots equal their ids in a fresh cache).
  for (sequence_id s : {5, 1, 6}) cache.end_sequence(s);
  CHECK(cache.begin_sequence(0) == 6);
  CHECK(cache.sequence(6).window_slot == 6);
  cache.end_sequence(3);
  CHECK(cache.begin_sequence(0) == 3);
  CHECK(cache.begin_sequence(0) == 1);
  CHECK(cache.begin_sequence(0) == 5);
  CHECK_THROWS_AS(cache.begin_sequence(0), capacity_error);  // all 8 live again
  std::set<int> slots;
  for (sequence_id s = 0; s < 8; ++s) slots.insert(cache.sequence(s).window_slot);
  CHECK(slots == std::set<int>{0, 1, 2, 3, 4, 5, 6, 7});
}

TEST_CASE("a refused admission takes neither a slot nor an id (strong guarantee)") {
  host_backend be;
  const G lay(1, 1);
  // cpu_only with a 4-token unpinned region: a 3-token prompt places 3
  // batches, a second one finds 1 block free and is refused at its batch 2.
  host_cache<G, cpu_only> cache(be, lay, tiny_spec(4), cpu_only{});
  const sequence_id a = cache.begin_sequence(3);
  CHECK(a == 0);
  const std::uint64_t probes = cache.admission_probes();
  try {
    (void)cache.begin_sequence(3);
    FAIL("no capacity_error");
  } catch (const capacity_error& e) {
    const std::string what = e.what();
    INFO("message: " << what);
    CHECK(mentions(what, {"begin_sequence: a prompt of 3 tokens (eviction batch 2 of 3", "unpinned compute region",
                          "raise partition_spec::cpu_capacity_tokens", "now 4 tokens per layer"}));
  }
  CHECK(cache.admission_probes() == probes + 2);
  CHECK(cache.live_sequences() == 1);
  CHECK(cache.usage().cpu_used_blocks == 3);
  // The next admission gets what the refused one would have: id 1, slot 1.
  const sequence_id b = cache.begin_sequence(1);
  CHECK(b == 1);
  CHECK(cache.sequence(b).window_slot == 1);
  CHECK(cache.usage().cpu_used_blocks == 4);
  cache.end_sequence(a);
  cache.end_sequence(b);
  CHECK(cache.usage().cpu_used_blocks == 0);
  CHECK(cache.begin_sequence(0) == b);  // most recently ended first
}
