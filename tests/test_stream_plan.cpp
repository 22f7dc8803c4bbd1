// SPDX-License-Identifier: Apache-2.0
// stream_plan: how pinned blocks travel through the ping-pong buffers
// (paper §4.2, §6). Checked against the plain list of each sequence's blocks:
// every block streamed exactly once, in order; splits never straddle chunks;
// split boundaries independent of batchmates; physically adjacent blocks
// coalesced into one copy; buffers used round-robin.
#include <doctest/doctest.h>

#include <map>
#include <random>

#include "support/harness.hpp"
#include <writescope/detail/bounce_copy.hpp>
#include <writescope/detail/stream_copy.hpp>

using namespace wstest;

namespace {

constexpr index_t block_elems = 8;  // small fake blocks in a fake pinned arena

struct arena {
  std::vector<bf16> mem;
  explicit arena(int blocks) : mem(std::size_t(blocks) * block_elems) {}
  pinned_span<const bf16> ptr(block_id id) const { return pinned_span<const bf16>(mem.data() + index_t(id) * block_elems, block_elems); }
  block_id id_of(pinned_span<const bf16> p) const { return block_id((p.data() - mem.data()) / block_elems); }
};

stream_plan build(const arena& a, const std::vector<std::vector<block_id>>& seqs, index_t chunk_blocks, int split_blocks,
                  int buffers) {
  stream_plan p;
  p.build(
      int(seqs.size()), [&](int i) { return std::span<const block_id>(seqs[std::size_t(i)]); },
      [&](block_id id) { return a.ptr(id); }, block_elems, chunk_blocks, split_blocks, buffers);
  return p;
}

// Checks every structural invariant of a plan; returns, per sequence, the
// sizes of its splits in order.
std::vector<std::vector<int>> check_plan(const arena& a, const stream_plan& p,
                                         const std::vector<std::vector<block_id>>& seqs, index_t chunk_blocks,
                                         int split_blocks, int buffers) {
  std::vector<std::vector<block_id>> streamed(seqs.size());
  std::vector<std::vector<int>> split_sizes(seqs.size());
  index_t total = 0, max_run = 0;
  index_t expect_run = 0, expect_split = 0;
  for (std::size_t c = 0; c < p.chunks.size(); ++c) {
    const stream_chunk& ch = p.chunks[c];
    CAPTURE(c);
    REQUIRE(ch.buffer == int(c % std::size_t(buffers)));  // round-robin
    REQUIRE(ch.num_blocks >= 1);
    REQUIRE(ch.num_blocks <= chunk_blocks);
    REQUIRE(ch.run_begin == expect_run);  // chunks partition runs and splits, in order
    REQUIRE(ch.split_begin == expect_split);
    expect_run = ch.run_end;
    expect_split = ch.split_end;
    // What the chunk's buffer holds after its copies.
    std::vector<block_id> buf(std::size_t(ch.num_blocks), -1);
    for (index_t r = ch.run_begin; r < ch.run_end; ++r) {
      const stream_run& run = p.runs[std::size_t(r)];
      REQUIRE(run.num_blocks >= 1);
      REQUIRE(run.dst_block >= 0);
      REQUIRE(run.dst_block + run.num_blocks <= ch.num_blocks);
      max_run = std::max(max_run, run.num_blocks);
      for (index_t k = 0; k < run.num_blocks; ++k) {
        REQUIRE(buf[std::size_t(run.dst_block + k)] == -1);  // each buffer block written once
        buf[std::size_t(run.dst_block + k)] = a.id_of(run.src) + block_id(k);
      }
      // Maximal coalescing: two consecutive runs in a chunk are not mergeable.
      if (r > ch.run_begin) {
        const stream_run& prev = p.runs[std::size_t(r - 1)];
        REQUIRE(run.src.size() == run.num_blocks * block_elems);
        REQUIRE_FALSE((prev.src.data() + prev.num_blocks * block_elems == run.src.data() &&
                       prev.dst_block + prev.num_blocks == run.dst_block));
      }
    }
    index_t covered = 0;
    for (index_t s = ch.split_begin; s < ch.split_end; ++s) {
      const stream_split& sp = p.splits[std::size_t(s)];
      REQUIRE(sp.first_block == covered);  // splits tile the chunk, never straddle it
      REQUIRE(sp.num_blocks >= 1);
      REQUIRE(sp.num_blocks <= split_blocks);
      REQUIRE(sp.first_block + sp.num_blocks <= ch.num_blocks);
      covered += sp.num_blocks;
      for (int k = 0; k < sp.num_blocks; ++k) streamed[std::size_t(sp.batch_index)].push_back(buf[std::size_t(sp.first_block + k)]);
      split_sizes[std::size_t(sp.batch_index)].push_back(sp.num_blocks);
    }
    REQUIRE(covered == ch.num_blocks);
    total += ch.num_blocks;
  }
  REQUIRE(expect_run == index_t(p.runs.size()));
  REQUIRE(expect_split == index_t(p.splits.size()));
  for (std::size_t i = 0; i < seqs.size(); ++i) REQUIRE(streamed[i] == seqs[i]);  // all blocks, once, in order
  CHECK(total == p.streamed_blocks);
  CHECK(max_run == p.max_run_blocks);
  return split_sizes;
}

}  // namespace

TEST_CASE("a fresh, orderly pool streams as one copy per chunk") {
  arena a(256);
  std::vector<std::vector<block_id>> seqs{{}, {}};
  for (block_id b = 0; b < 20; ++b) seqs[0].push_back(b);
  for (block_id b = 20; b < 31; ++b) seqs[1].push_back(b);
  const stream_plan p = build(a, seqs, 8, 4, 2);
  const auto sizes = check_plan(a, p, seqs, 8, 4, 2);
  // Splits of 4, 4, 4, 4, 4 | 4, 4, 3 packed into chunks of <= 8 blocks.
  CHECK(sizes[0] == std::vector<int>{4, 4, 4, 4, 4});
  CHECK(sizes[1] == std::vector<int>{4, 4, 3});
  CHECK(p.chunks.size() == 4);
  CHECK(p.runs.size() == p.chunks.size());  // the two sequences are adjacent too: coalesced across them
  CHECK(p.max_run_blocks == 8);
  CHECK(p.streamed_blocks == 31);
}

TEST_CASE("runs break where blocks are not physically adjacent, and at every chunk") {
  arena a(64);
  const std::vector<std::vector<block_id>> seqs{{0, 1, 2, 7, 8, 3, 40, 41, 42, 43}};
  const stream_plan p = build(a, seqs, 100, 16, 2);
  check_plan(a, p, seqs, 100, 16, 2);
  REQUIRE(p.chunks.size() == 1);
  REQUIRE(p.runs.size() == 4);
  CHECK(p.runs[0].num_blocks == 3);
  CHECK(p.runs[1].num_blocks == 2);
  CHECK(p.runs[2].num_blocks == 1);
  CHECK(p.runs[3].num_blocks == 4);
  // Same blocks with chunks of 4: a run never crosses into the next chunk.
  const stream_plan q = build(a, seqs, 4, 2, 3);
  check_plan(a, q, seqs, 4, 2, 3);
  CHECK(q.chunks.size() == 3);
  CHECK(q.max_run_blocks <= 4);
}

TEST_CASE("a sequence's split boundaries do not depend on its batchmates (K10)") {
  arena a(4096);
  std::mt19937_64 rng(3);
  auto random_blocks = [&](int n) {
    std::vector<block_id> v;
    for (int k = 0; k < n; ++k) v.push_back(block_id(rng() % 4096));
    return v;
  };
  const std::vector<block_id> me = random_blocks(23);
  for (int split : {1, 3, 5, 16}) {
    for (index_t chunk : {index_t(split), index_t(split) * 2 + 1, index_t(64)}) {
      CAPTURE(split);
      CAPTURE(chunk);
      const std::vector<std::vector<block_id>> solo{me};
      const auto solo_sizes = check_plan(a, build(a, solo, chunk, split, 2), solo, chunk, split, 2)[0];
      for (int mates : {1, 4}) {
        std::vector<std::vector<block_id>> batch;
        for (int m = 0; m < mates; ++m) batch.push_back(random_blocks(int(rng() % 40)));
        batch.insert(batch.begin() + std::ptrdiff_t(mates / 2), me);
        const auto sizes = check_plan(a, build(a, batch, chunk, split, 2), batch, chunk, split, 2);
        CHECK(sizes[std::size_t(mates / 2)] == solo_sizes);
      }
      // The sizes are the sequence's own cut: split, split, ..., remainder.
      std::vector<int> expect;
      for (int b = 0; b < 23; b += split) expect.push_back(std::min(split, 23 - b));
      CHECK(solo_sizes == expect);
    }
  }
}

TEST_CASE("the ramp: chunk k holds at most first * 2^k blocks, up to a buffer; splits and batch invariance unchanged") {
  arena a(4096);
  std::vector<std::vector<block_id>> seqs{{}};
  for (block_id b = 0; b < 300; ++b) seqs[0].push_back(b);
  const auto ramped = [&](index_t chunk, int split, index_t first) {
    stream_plan p;
    p.build(
        int(seqs.size()), [&](int i) { return std::span<const block_id>(seqs[std::size_t(i)]); },
        [&](block_id id) { return a.ptr(id); }, block_elems, chunk, split, 2, first);
    return p;
  };
  // Chunks of 64 blocks, splits of 4, ramp from 8: 8, 16, 32, 64, 64, 64, 52.
  const stream_plan p = ramped(64, 4, 8);
  const auto sizes = check_plan(a, p, seqs, 64, 4, 2);
  std::vector<index_t> got;
  for (const stream_chunk& c : p.chunks) got.push_back(c.num_blocks);
  CHECK(got == std::vector<index_t>{8, 16, 32, 64, 64, 64, 52});
  for (std::size_t k = 0; k < p.chunks.size(); ++k)
    CHECK(p.chunks[k].num_blocks <= stream_plan::chunk_capacity(k, 64, 4, 8));
  // The split cut is the sequence's own, whatever the ramp.
  const stream_plan flat = ramped(64, 4, 0);
  CHECK(check_plan(a, flat, seqs, 64, 4, 2) == sizes);
  CHECK(flat.chunks.size() == 5);  // 64 x 4 + 44
  // A ramp start below the split size starts at one split; above the buffer, no ramp.
  CHECK(stream_plan::chunk_capacity(0, 64, 4, 1) == 4);
  CHECK(stream_plan::chunk_capacity(1, 64, 4, 1) == 8);
  CHECK(stream_plan::chunk_capacity(0, 64, 4, 100) == 64);
  CHECK(stream_plan::chunk_capacity(40, 64, 4, 8) == 64);  // no overflow for late chunks
  const stream_plan odd = ramped(60, 3, 5);  // capacities 5, 10, 20, 40, 60: splits of 3 fill 3, 9, 18, 39, 60
  check_plan(a, odd, seqs, 60, 3, 2);
  CHECK(odd.chunks[0].num_blocks == 3);
  CHECK(odd.chunks[1].num_blocks == 9);
  CHECK(odd.chunks[2].num_blocks == 18);
  CHECK(odd.chunks[3].num_blocks == 39);
  CHECK(odd.chunks[4].num_blocks == 60);
}

TEST_CASE("ping-pong buffers are used round-robin, for any buffer count") {
  arena a(512);
  std::vector<std::vector<block_id>> seqs(5);
  for (int i = 0; i < 5; ++i)
    for (int b = 0; b < 17 + i; ++b) seqs[std::size_t(i)].push_back(block_id(i * 100 + b));
  for (int buffers : {2, 3, 4}) {
    CAPTURE(buffers);
    const stream_plan p = build(a, seqs, 6, 3, buffers);
    check_plan(a, p, seqs, 6, 3, buffers);
    CHECK(p.chunks.size() >= std::size_t(buffers));
  }
}

TEST_CASE("empty sequences and empty batches stream nothing; the plan is reusable") {
  arena a(64);
  stream_plan p;
  const std::vector<std::vector<block_id>> none{{}, {}, {}};
  p.build(
      3, [&](int i) { return std::span<const block_id>(none[std::size_t(i)]); }, [&](block_id id) { return a.ptr(id); },
      block_elems, 4, 2, 2);
  CHECK(p.chunks.empty());
  CHECK(p.runs.empty());
  CHECK(p.splits.empty());
  CHECK(p.streamed_blocks == 0);
  // Reuse after a non-empty build: nothing stale survives.
  const std::vector<std::vector<block_id>> some{{}, {5, 6, 7}, {}};
  p.build(
      3, [&](int i) { return std::span<const block_id>(some[std::size_t(i)]); }, [&](block_id id) { return a.ptr(id); },
      block_elems, 4, 2, 2);
  check_plan(a, p, some, 4, 2, 2);
  p.build(
      0, [&](int) { return std::span<const block_id>(); }, [&](block_id id) { return a.ptr(id); }, block_elems, 4, 2, 2);
  CHECK(p.chunks.empty());
  CHECK(p.streamed_blocks == 0);
  CHECK(p.max_run_blocks == 0);
}

TEST_CASE("random batches satisfy every plan invariant") {
  std::mt19937_64 rng(17);
  arena a(1024);
  for (int it = 0; it < 200; ++it) {
    const int split = 1 + int(rng() % 6);
    const index_t chunk = split + index_t(rng() % 10);
    const int buffers = 2 + int(rng() % 3);
    std::vector<std::vector<block_id>> seqs(std::size_t(1 + rng() % 6));
    block_id next = block_id(rng() % 100);
    for (auto& s : seqs) {
      const int n = int(rng() % 30);
      for (int k = 0; k < n; ++k) {
        if (rng() % 4 == 0) next = block_id(rng() % 1000);  // a jump: not adjacent
        s.push_back(next++ % 1024);
      }
    }
    CAPTURE(it);
    check_plan(a, build(a, seqs, chunk, split, buffers), seqs, chunk, split, buffers);
  }
}

TEST_CASE("the step's plan over a real cache coalesces the pinned blocks of an orderly pool") {
  using L = gqa_layout<64>;
  host_backend be;
  const L lay(2, 1);
  partition_spec spec = small_spec(1, 2);
  spec.pinned_initial_tokens = -1;  // one slab up front: ids map to one contiguous arena
  spec.pinned_growth_tokens = spec.pinned_capacity_tokens;
  spec.gpu_split_blocks = 2;
  set_ping_pong_blocks(spec, lay, 6);
  // ramp 0: chunks of 6 + 2 blocks; the harness's ramp from one split (2): chunks of 2 + 4 + 2.
  struct ramp_case {
    index_t first_chunk_bytes;
    std::size_t chunks;
    index_t longest;
  };
  for (const ramp_case rc : {ramp_case{0, 2, 6}, ramp_case{1, 3, 4}}) {
    const index_t first_chunk_bytes = rc.first_chunk_bytes;
    const std::size_t chunks = rc.chunks;
    const index_t longest = rc.longest;
    CAPTURE(first_chunk_bytes);
    spec.first_chunk_bytes = first_chunk_bytes;
    host_cache<L, gpu_only> cache(be, lay, spec, gpu_only{}, {}, cache_options{true});
    decode_driver<decltype(cache)> d(cache, {1, true}, 5, 0.125);
    const sequence_id s = d.add(4 * 32 + 3);  // 4 eviction batches = 8 blocks, ids 0..7
    const std::vector<sequence_id> batch{s};
    REQUIRE(d.step(batch).ok());
    const stream_plan& p = d.attention().last_plan();
    CHECK(p.streamed_blocks == 8);
    CHECK(p.chunks.size() == chunks);
    CHECK(p.runs.size() == chunks);  // one copy per chunk
    CHECK(p.max_run_blocks == longest);
    CHECK(d.last_report.copies == index_t(chunks));
    CHECK(d.last_report.chunks == index_t(chunks));
    CHECK(d.last_report.streamed_tokens == 128);
  }
}

TEST_CASE("stream_copy (the sparse gather's non-temporal copy) copies exactly the bytes asked, any alignment") {
  std::vector<unsigned char> src(1 << 16), dst(1 << 16);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131u + 7u);
  for (const std::size_t off : {std::size_t(0), std::size_t(16), std::size_t(3)})
    for (const std::size_t len : {std::size_t(0), std::size_t(17), std::size_t(255), std::size_t(256),
                                  std::size_t(4096 + 48), std::size_t(32768 + 5)}) {
      CAPTURE(off);
      CAPTURE(len);
      std::fill(dst.begin(), dst.end(), static_cast<unsigned char>(0xA5));  // poison
      writescope::detail::stream_copy(dst.data() + off, src.data() + off, len);
      writescope::detail::stream_copy_fence();
      std::size_t bad = 0;
      for (std::size_t i = 0; i < dst.size(); ++i) {
        const bool inside = i >= off && i < off + len;
        bad += dst[i] != (inside ? src[i] : 0xA5);
      }
      CHECK(bad == 0);
    }
}

TEST_CASE("copy_out_of_bounce (bounced D2H writes, host side): every piece's bytes land at its destination, nothing else") {
  // pieces with gaps between them, from a few bytes to 5.5 MiB (several 1 MiB slices, slice
  // boundaries inside pieces), sent to shuffled places of one destination arena; 1 and 4 threads
  const index_t sizes[] = {7, 4096, 1 << 20, (index_t{11} << 19) + 3, 65536 + 1, 300, (index_t{2} << 20) - 1, 1};
  std::vector<writescope::detail::bounce_piece> pieces;
  index_t at = 5, total = 0;
  for (const index_t n : sizes) {
    pieces.push_back({nullptr, at, n});
    at += n + (n % 3 == 0 ? 0 : 64);  // some pieces back to back, some with a gap
    total += n;
  }
  std::vector<std::byte> buf(static_cast<std::size_t>(at));
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = std::byte(i * 2654435761u >> 24);
  std::vector<std::size_t> order(pieces.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937 rng(5);
  std::shuffle(order.begin(), order.end(), rng);
  for (const int threads : {1, 4}) {
    CAPTURE(threads);
    std::vector<std::byte> dst(std::size_t(total + 64 * index_t(pieces.size())), std::byte{0xA5});  // poison
    std::vector<std::byte> want = dst;
    index_t d = 0;
    for (const std::size_t i : order) {  // destinations in another order than the buffer's, 64-byte gaps
      pieces[i].dst = dst.data() + d;
      std::memcpy(want.data() + d, buf.data() + pieces[i].offset, std::size_t(pieces[i].bytes));
      d += pieces[i].bytes + 64;
    }
    writescope::detail::copy_out_of_bounce(buf.data(), pieces, threads);
    CHECK(dst == want);
  }
  writescope::detail::copy_out_of_bounce(buf.data(), {}, 4);  // nothing to copy: no access
}
