// SPDX-License-Identifier: Apache-2.0
// examples/custom_block_allocator.cpp — a block allocator written outside the
// library, plugged into inplace_kv_cache as its last template parameter.
//
// top_down_allocator hands out the highest free block ids of its region
// first (block_pool, the default, hands out the lowest), each allocate() call's
// ids in ascending order, so that an eviction batch still lands in one run of
// consecutive blocks and the stream plan still copies it in one piece. It
// counts what it hands out and takes back. A region filled from the top
// leaves its low ids free: the shape an allocator that shares an arena
// with something growing from the bottom starts from.
//
// What an allocator must provide (the writescope::block_allocator concept,
// writescope/block_allocator.hpp):
//   using allocator_concept = writescope::block_allocator_tag;   opt-in
//   A(capacity, max_capacity, region_name, capacity_field), default-constructible, movable
//   capacity() max_capacity() free_blocks() used_blocks() name() is_used(id)
//   grow_to(n) allocate(n, out) release(ids, count) allocation_bound(n)
// with allocate() and release() changing nothing when they throw. The cache
// owns one per host region (unpinned compute, pinned load) and shows them
// through region_allocator(placement).
//
// The program runs a short decode over three sequences (one ends half way and
// a new one takes its slot and, reused, its blocks) with half the placed KV in
// each host region, and checks: every output against fp64 attention; that the
// first block each region handed out was its highest id; that the allocators'
// counters agree with the cache's usage() and with the block tables.
//
// Usage: custom_block_allocator [--steps N] [--layers N] [--cpu-share R] [--seed N]
// Exit status: 0 agreement and the allocators used as counted, 1 otherwise,
// 2 bad command line, 3 a writescope error.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <writescope/reference.hpp>
#include <writescope/writescope.hpp>

namespace ws = writescope;

/// Block ids of one region, highest free first (see the file comment).
/// allocate() is O(capacity) in the worst case (a scan down from the highest
/// free id); block_pool's word scan is the one to use at scale.
class top_down_allocator {
 public:
  using allocator_concept = ws::block_allocator_tag;

  top_down_allocator() = default;
  top_down_allocator(ws::index_t capacity, ws::index_t max_capacity, const char* region_name,
                     const char* capacity_field)
      : max_capacity_(max_capacity), name_(region_name), field_(capacity_field) {
    if (capacity < 0 || max_capacity < capacity || max_capacity > INT32_MAX)
      throw ws::config_error(std::string(region_name) + ": block capacity " + std::to_string(capacity) + " / max " +
                             std::to_string(max_capacity) + " is invalid");
    grow_to(capacity);
  }

  [[nodiscard]] ws::index_t capacity() const noexcept { return ws::index_t(used_.size()); }
  [[nodiscard]] ws::index_t max_capacity() const noexcept { return max_capacity_; }
  [[nodiscard]] ws::index_t free_blocks() const noexcept { return capacity() - used_count_; }
  [[nodiscard]] ws::index_t used_blocks() const noexcept { return used_count_; }
  [[nodiscard]] const char* name() const noexcept { return name_; }
  [[nodiscard]] bool is_used(ws::block_id id) const noexcept { return used_[std::size_t(id)] != 0; }

  void grow_to(ws::index_t n) {
    if (n > max_capacity_)
      throw ws::capacity_error(std::string(name_) + ": cannot grow to " + std::to_string(n) + " blocks, the maximum is " +
                               std::to_string(max_capacity_));
    if (n > capacity()) used_.resize(std::size_t(n), 0);
  }

  /// The `n` highest free ids, appended in ascending order.
  void allocate(ws::index_t n, std::vector<ws::block_id>& out) {
    if (n > free_blocks())
      throw ws::capacity_error(std::string(name_) + ": " + std::to_string(n) + " blocks requested, " +
                               std::to_string(free_blocks()) + " free of " + std::to_string(capacity()) +
                               " (capacity exceeded" + (field_ ? std::string("; raise ") + field_ : std::string()) + ")");
    out.reserve(out.size() + std::size_t(n));  // the only step that may throw: before any change
    const std::size_t first = out.size();
    for (ws::index_t id = capacity() - 1; ws::index_t(out.size() - first) < n; --id)
      if (!used_[std::size_t(id)]) {
        used_[std::size_t(id)] = 1;
        out.push_back(ws::block_id(id));
        if (first_handed_out_ < 0) first_handed_out_ = id;
      }
    std::reverse(out.begin() + std::ptrdiff_t(first), out.end());
    used_count_ += n;
    allocated_ += std::uint64_t(n);
  }

  void release(const ws::block_id* ids, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i)
      if (ids[i] < 0 || ids[i] >= capacity() || !used_[std::size_t(ids[i])])
        throw ws::state_error(std::string(name_) + ": release of block " + std::to_string(ids[i]) +
                              " which is not allocated");
    for (std::size_t i = 0; i < count; ++i) {
      if (!used_[std::size_t(ids[i])]) {  // the same id twice in one call: undo and refuse
        for (std::size_t j = 0; j < i; ++j) used_[std::size_t(ids[j])] = 1;
        throw ws::state_error(std::string(name_) + ": block " + std::to_string(ids[i]) + " released twice");
      }
      used_[std::size_t(ids[i])] = 0;
    }
    used_count_ -= ws::index_t(count);
    released_ += count;
  }

  /// The highest free ids go first: only the whole region bounds them.
  [[nodiscard]] ws::index_t allocation_bound(ws::index_t) const noexcept { return capacity(); }

  // Counters of this example.
  [[nodiscard]] std::uint64_t allocated() const noexcept { return allocated_; }
  [[nodiscard]] std::uint64_t released() const noexcept { return released_; }
  [[nodiscard]] ws::index_t first_handed_out() const noexcept { return first_handed_out_; }

 private:
  std::vector<std::uint8_t> used_;  // [capacity] 1 = allocated
  ws::index_t used_count_ = 0;
  ws::index_t max_capacity_ = 0;
  const char* name_ = "top-down allocator";
  const char* field_ = nullptr;
  std::uint64_t allocated_ = 0, released_ = 0;
  ws::index_t first_handed_out_ = -1;
};

static_assert(ws::block_allocator<top_down_allocator>);

namespace {

struct options {
  int steps = 24;
  int layers = 2;
  double cpu_share = 0.5;
  unsigned long long seed = 5;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::puts("usage: custom_block_allocator [--steps N] [--layers N] [--cpu-share R] [--seed N]\n"
                "Runs a short decode loop on a cache whose host regions hand out block ids from the top\n"
                "down (a user-written block allocator) and checks the outputs against fp64 attention\n"
                "and the allocators' counters against the cache.");
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "custom_block_allocator: %s needs a value (try --help)\n", a.c_str());
      std::exit(2);
    }
    const char* v = argv[++i];
    char* end = nullptr;
    const double x = std::strtod(v, &end);
    if (end == v || *end != '\0') {
      std::fprintf(stderr, "custom_block_allocator: %s: '%s' is not a number\n", a.c_str(), v);
      std::exit(2);
    }
    if (a == "--steps") o.steps = int(x);
    else if (a == "--layers") o.layers = int(x);
    else if (a == "--cpu-share") o.cpu_share = x;
    else if (a == "--seed") o.seed = static_cast<unsigned long long>(x);
    else {
      std::fprintf(stderr, "custom_block_allocator: unknown option %s (try --help)\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.steps < 2 || o.layers < 1) {
    std::fprintf(stderr, "custom_block_allocator: --steps must be >= 2 and --layers >= 1\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  using layout = ws::gqa_layout<128>;
  using cache_type =
      ws::inplace_kv_cache<layout, ws::host_backend, ws::pageable_allocator, ws::fixed_ratio, top_down_allocator>;
  const layout lay(8, 2);
  const int hq = lay.num_q_heads(), hkv = lay.kv_heads();
  constexpr int d = layout::head_dim;
  const double scale = 1.0 / std::sqrt(double(d));

  ws::partition_spec spec;
  spec.num_layers = o.layers;
  spec.block_tokens = 16;
  spec.d_window_tokens = 32;
  spec.max_sequences = 3;
  spec.cpu_capacity_tokens = 4096;
  spec.pinned_capacity_tokens = 4096;
  spec.ping_pong_bytes = ws::index_t(1) << 20;

  ws::host_backend backend;
  cache_type cache(backend, lay, spec, ws::fixed_ratio(o.cpu_share));
  ws::hybrid_attention<cache_type> attention(cache, ws::attention_options{2});

  // The fp64 reference's copy of every sequence's KV: [id][layer] token-major.
  std::vector<std::vector<std::vector<ws::bf16>>> hk(3), hv(3);
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal;
  std::vector<ws::bf16> k, v;
  auto make = [&](ws::index_t n) {
    k.resize(std::size_t(n * hkv * d));
    v.resize(k.size());
    for (auto& x : k) x = ws::bf16::from_float(normal(rng));
    for (auto& x : v) x = ws::bf16::from_float(normal(rng));
    return cache_type::kv_input{{k.data(), v.data()}, n};
  };
  auto admit = [&](ws::index_t prompt) {
    const ws::sequence_id id = cache.begin_sequence(prompt);
    hk[std::size_t(id)].assign(std::size_t(o.layers), {});
    hv[std::size_t(id)].assign(std::size_t(o.layers), {});
    for (int l = 0; l < o.layers; ++l) {
      cache.append_prefill(l, id, make(prompt));
      hk[std::size_t(id)][std::size_t(l)] = k;
      hv[std::size_t(id)][std::size_t(l)] = v;
    }
    return id;
  };

  std::vector<ws::sequence_id> batch{admit(700), admit(96), admit(1300)};
  const top_down_allocator& cpu_ids = cache.region_allocator(ws::placement::cpu_compute);
  const top_down_allocator& pin_ids = cache.region_allocator(ws::placement::gpu_load);

  double worst_rel = 0, worst_lse = 0;
  bool ok = true;
  ws::index_t cpu_tokens = 0, streamed_tokens = 0;
  std::vector<float> q, out, lse;
  std::vector<double> ro(static_cast<std::size_t>(hq) * d), rl(static_cast<std::size_t>(hq));
  for (int step = 0; step < o.steps; ++step) {
    if (step == o.steps / 2) {  // the second sequence ends; a new one takes its slot and blocks
      cache.end_sequence(batch[1]);
      batch[1] = admit(450);
    }
    const int nseq = int(batch.size());
    for (int l = 0; l < o.layers; ++l) {
      cache.append(l, batch, make(nseq));
      for (int i = 0; i < nseq; ++i) {
        auto& K = hk[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        auto& V = hv[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        K.insert(K.end(), k.begin() + i * hkv * d, k.begin() + (i + 1) * hkv * d);
        V.insert(V.end(), v.begin() + i * hkv * d, v.begin() + (i + 1) * hkv * d);
      }
      q.resize(std::size_t(nseq * hq * d));
      for (auto& x : q) x = normal(rng);
      out.assign(q.size(), 0.0f);
      lse.assign(std::size_t(nseq * hq), 0.0f);
      const ws::step_report rep =
          attention.step(l, batch, ws::host_span<const float>(q.data(), ws::index_t(q.size())), float(scale),
                         {ws::host_span<float>(out.data(), ws::index_t(out.size())),
                          ws::host_span<float>(lse.data(), ws::index_t(lse.size())), nullptr});
      cpu_tokens += rep.cpu_tokens;
      streamed_tokens += rep.streamed_tokens;
      for (int i = 0; i < nseq; ++i) {
        const auto& K = hk[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        const auto& V = hv[std::size_t(batch[std::size_t(i)])][std::size_t(l)];
        ws::reference::gqa_decode(hq, hkv, d, q.data() + i * hq * d, K.data(), V.data(),
                                  ws::index_t(K.size()) / (hkv * d), scale, ro.data(), rl.data());
        for (int h = 0; h < hq; ++h) {
          double num = 0, den = 0;
          for (int j = 0; j < d; ++j) {
            const double x = out[std::size_t((i * hq + h) * d + j)], r = ro[std::size_t(h * d + j)];
            num += (x - r) * (x - r);
            den += r * r;
          }
          const double rel = std::sqrt(num / std::max(den, 1e-300));
          const double lerr = std::abs(double(lse[std::size_t(i * hq + h)]) - rl[std::size_t(h)]);
          worst_rel = std::max(worst_rel, rel);
          worst_lse = std::max(worst_lse, lerr);
          if (!(rel <= 5e-3) || !(lerr <= 1e-3 + 1e-5 * std::abs(rl[std::size_t(h)]))) ok = false;
        }
      }
    }
    cache.flush();
  }

  // The allocators were the cache's: their counts are the cache's and the
  // block tables', and they handed out from the top.
  const ws::region_usage u = cache.usage();
  ws::index_t table_cpu = 0, table_pin = 0;
  bool tables_used = true;
  for (ws::sequence_id s : batch) {
    const ws::sequence_state& st = cache.sequence(s);
    table_cpu += ws::index_t(st.cpu_blocks.size());
    table_pin += ws::index_t(st.pinned_blocks.size());
    for (ws::block_id b : st.cpu_blocks) tables_used = tables_used && cpu_ids.is_used(b);
    for (ws::block_id b : st.pinned_blocks) tables_used = tables_used && pin_ids.is_used(b);
  }
  const bool counts = cpu_ids.used_blocks() == u.cpu_used_blocks && pin_ids.used_blocks() == u.pinned_used_blocks &&
                      cpu_ids.used_blocks() == table_cpu && pin_ids.used_blocks() == table_pin &&
                      cpu_ids.allocated() - cpu_ids.released() == std::uint64_t(table_cpu) &&
                      pin_ids.allocated() - pin_ids.released() == std::uint64_t(table_pin) &&
                      cpu_ids.released() + pin_ids.released() > 0 && tables_used;
  const bool from_top = cpu_ids.first_handed_out() == cpu_ids.capacity() - 1 &&
                        pin_ids.first_handed_out() == pin_ids.capacity() - 1;
  const bool both_sides = cpu_tokens > 0 && streamed_tokens > 0;
  const bool pass = ok && counts && from_top && both_sides;
  std::printf("top_down_allocator: unpinned region %llu blocks handed out, %llu taken back (first id %lld of %lld); "
              "pinned region %llu / %llu (first id %lld of %lld)\n",
              (unsigned long long)cpu_ids.allocated(), (unsigned long long)cpu_ids.released(),
              (long long)cpu_ids.first_handed_out(), (long long)cpu_ids.capacity(),
              (unsigned long long)pin_ids.allocated(), (unsigned long long)pin_ids.released(),
              (long long)pin_ids.first_handed_out(), (long long)pin_ids.capacity());
  std::printf("%lld KV tokens attended by the CPU engine, %lld streamed; counters match the cache: %s; "
              "from the top: %s\n",
              (long long)cpu_tokens, (long long)streamed_tokens, counts ? "yes" : "no", from_top ? "yes" : "no");
  std::printf("agreement with fp64: max rel L2 %.2e, max |dLSE| %.2e -> %s\n", worst_rel, worst_lse,
              pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
} catch (const ws::error& e) {
  std::fprintf(stderr, "custom_block_allocator: writescope error: %s\n", e.what());
  return 3;
}
