// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: inplace_kv_cache + hybrid_attention (host backend) driven
// by random sequences of calls, checked against a simple model of the cache.
//
// The input chooses a small configuration (GQA head dim 64, Hq/Hkv, layers,
// block size, D, max_sequences, region capacities, pinned growth, ping-pong,
// split sizes, threads, the CPU assist: off, fixed or adaptive) and a policy
// (gpu_only, cpu_only, fixed_ratio(r), roofline_policy), then a list of operations: begin_sequence, append_prefill,
// append, step, flush, end_sequence, read_token and "decode rounds" (append +
// step on every layer, then flush), with valid and deliberately invalid
// arguments (dead or repeated sequences, bad layers, wrong token counts, null
// planes, short strides, bad sizes, zero scale, full D-windows).
//
// The model keeps, per live sequence and layer, every token written (the
// reference's own copy), the D-window fill, the placed tokens and which layers
// hold their prompt. Checked after every operation:
//   * a call the model says is invalid throws exactly the documented type
//     (docs/ERRORS.md) and changes nothing (snapshot before == after);
//   * a valid call succeeds, except begin_sequence / flush, which may refuse
//     with capacity_error (regions full) — then nothing changed either;
//   * step output == fp64 attention over exactly the tokens written to that
//     layer (every token attended exactly once: a lost or doubled token, an
//     over-read of a poisoned tail, a stale block would break the bar);
//   * read_token returns the written bytes exactly (random positions, and the
//     first, middle and last token of every sequence and layer after every
//     operation);
//   * accounting: usage() used blocks == the blocks of the live sequences,
//     each block owned by one sequence only, total_placed_tokens == the sum,
//     block tables consistent with placed / cpu_placed tokens, D-window slots
//     distinct; flush evicts exactly the sequences whose windows are full in
//     every layer.
// A violation prints what broke and aborts (libFuzzer saves the input).
// Seeds: tests/fuzz/corpus/fuzz_cache.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <typeinfo>

#include "support/harness.hpp"

using namespace wstest;

namespace {

using G = gqa_layout<64>;
constexpr int Q = G::q_dim;
constexpr int V = G::v_dim;

[[noreturn]] void broken(const std::string& what) {
  std::fprintf(stderr, "fuzz_cache: %s\n", what.c_str());
  std::abort();
}
#define FUZZ_CHECK(cond, msg)                                                   \
  do {                                                                          \
    if (!(cond)) broken(std::string(#cond) + " — " + std::string(msg));         \
  } while (0)

enum class err { none, shape, state, config, capacity };

/// What the run exercised, printed at exit when WS_FUZZ_STATS=1 (scripts/run-fuzz
/// replays the corpus with it, so the report says what the corpus reaches).
struct statistics {
  long inputs = 0, caches = 0, config_refused = 0, ops = 0, steps_checked = 0, sequences_checked = 0,
       tokens_checked = 0, evictions = 0, cpu_batches = 0, gpu_batches = 0, refusals[5] = {}, read_tokens = 0;
  index_t max_tokens = 0;
  ~statistics() {
    const char* v = std::getenv("WS_FUZZ_STATS");
    if (v == nullptr || *v != '1') return;
    std::fprintf(stderr,
                 "fuzz_cache stats: %ld inputs, %ld caches (%ld specs refused), %ld operations, %ld steps checked "
                 "against fp64 (%ld sequence rows, %ld KV tokens, longest %lld), %ld evictions (%ld to CPU, %ld to "
                 "GPU), %ld read_token checks; typed refusals: shape %ld, state %ld, config %ld, capacity %ld\n",
                 inputs, caches, config_refused, ops, steps_checked, sequences_checked, tokens_checked,
                 static_cast<long long>(max_tokens), evictions, cpu_batches, gpu_batches, read_tokens, refusals[1],
                 refusals[2], refusals[3], refusals[4]);
  }
} stats;

const char* name(err e) {
  switch (e) {
    case err::none: return "no error";
    case err::shape: return "shape_error";
    case err::state: return "state_error";
    case err::config: return "config_error";
    case err::capacity: return "capacity_error";
  }
  return "?";
}

/// Runs f and classifies what it threw; anything unexpected aborts.
template <class F>
err classify(F&& f, std::string* message = nullptr) {
  try {
    f();
    return err::none;
  } catch (const shape_error& e) {
    if (message) *message = e.what();
    return err::shape;
  } catch (const state_error& e) {
    if (message) *message = e.what();
    return err::state;
  } catch (const config_error& e) {
    if (message) *message = e.what();
    return err::config;
  } catch (const capacity_error& e) {
    if (message) *message = e.what();
    return err::capacity;
  } catch (const std::exception& e) {
    broken(std::string("unexpected exception ") + typeid(e).name() + ": " + e.what());
  }
}

struct model_seq {
  index_t prompt = 0;
  index_t placed = 0;
  std::vector<std::uint8_t> ready;   // [layer]
  std::vector<int> window;           // [layer]
  std::vector<kv_history<G>> hist;   // [layer] every token written
};

template <class Policy>
class driver {
 public:
  using cache_t = host_cache<G, Policy>;

  driver(FuzzedDataProvider& in, const G& lay, const partition_spec& spec, Policy pol, attention_options opts,
         std::uint64_t seed)
      : in_(in), lay_(lay), cache_(be_, lay, spec, std::move(pol), {}, cache_options{true}), attn_(cache_, opts),
        src_(seed) {
    slots_ = spec.max_sequences;
  }

  void run(int max_ops) {
    for (int op = 0; op < max_ops && in_.remaining_bytes() > 0; ++op) {
      switch (in_.ConsumeIntegralInRange<int>(0, 9)) {
        case 0: op_begin(); break;
        case 1: op_prefill(); break;
        case 2: op_append(); break;
        case 3: op_step(); break;
        case 4: op_flush(); break;
        case 5: op_end(); break;
        case 6: op_read_token(); break;
        default: op_round(); break;
      }
      check_invariants();
      ++stats.ops;
    }
    // Drain: every remaining sequence ends; all blocks come back.
    for (auto it = seqs_.begin(); it != seqs_.end();) {
      cache_.end_sequence(it->first);
      it = seqs_.erase(it);
    }
    check_invariants();
    const region_usage u = cache_.usage();
    FUZZ_CHECK(u.cpu_used_blocks == 0 && u.pinned_used_blocks == 0 && u.live_sequences == 0, "blocks leaked");
  }

 private:
  const partition_spec& spec() const { return cache_.spec(); }
  int layers() const { return spec().num_layers; }
  int D() const { return spec().d_window_tokens; }

  std::vector<sequence_id> live_ids() const {
    std::vector<sequence_id> v;
    for (const auto& [id, s] : seqs_) v.push_back(id);
    return v;
  }

  /// A sequence id: usually a live one, sometimes an ended or never-used one.
  sequence_id pick_id() {
    const auto ids = live_ids();
    if (ids.empty() || in_.ConsumeIntegralInRange<int>(0, 15) == 0)
      return in_.ConsumeIntegralInRange<sequence_id>(-1, spec().max_sequences + 1);
    return ids[in_.ConsumeIntegralInRange<std::size_t>(0, ids.size() - 1)];
  }
  int pick_layer() {
    if (in_.ConsumeIntegralInRange<int>(0, 31) == 0) return in_.ConsumeBool() ? -1 : layers();
    return in_.ConsumeIntegralInRange<int>(0, layers() - 1);
  }
  /// A batch: a random subset of live sequences in random order, sometimes
  /// with a dead id or a repeat.
  std::vector<sequence_id> pick_batch() {
    std::vector<sequence_id> ids = live_ids(), b;
    for (sequence_id id : ids)
      if (in_.ConsumeBool()) b.push_back(id);
    for (std::size_t i = b.size(); i > 1; --i)
      std::swap(b[i - 1], b[in_.ConsumeIntegralInRange<std::size_t>(0, i - 1)]);
    if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) b.push_back(pick_id());
    if (!b.empty() && in_.ConsumeIntegralInRange<int>(0, 15) == 0) b.push_back(b[0]);
    return b;
  }
  bool live(sequence_id id) const { return seqs_.count(id) != 0; }

  kv_batch<G> make_kv(index_t n) { return kv_generator<G>{}.make(lay_, n, src_); }

  /// Damages a KV view the way a caller can: null plane or too short a stride.
  err damage(kv_tokens<G, pageable_host_space>& kv) {
    const int what = in_.ConsumeIntegralInRange<int>(0, 31);
    if (what == 0 && kv.num_tokens > 0) {
      kv.planes[std::size_t(in_.ConsumeIntegralInRange<int>(0, 1))] = nullptr;
      return err::shape;
    }
    if (what == 1 && kv.num_tokens > 0) {
      kv.token_stride = index_t(lay_.kv_heads()) * G::row_elems - 1;
      return err::shape;
    }
    return err::none;
  }

  /// check_batch's precedence: per sequence in order, dead -> shape, repeat -> shape, no prompt -> state.
  err batch_error(const std::vector<sequence_id>& b, int layer) const {
    for (std::size_t i = 0; i < b.size(); ++i) {
      if (!live(b[i])) return err::shape;
      for (std::size_t j = 0; j < i; ++j)
        if (b[j] == b[i]) return err::shape;
      if (!seqs_.at(b[i]).ready[std::size_t(layer)]) return err::state;
    }
    return err::none;
  }

  void expect(err got, err want, const std::string& what, const std::string& msg) {
    ++stats.refusals[int(got)];
    if (got != want) broken(what + ": expected " + name(want) + ", got " + name(got) + (msg.empty() ? "" : ": " + msg));
  }

  /// Runs a call the model predicts to fail with `want` (!= none): the
  /// cache's observable state must not change.
  template <class F>
  void expect_refusal(err want, const std::string& what, F&& f) {
    const auto ids = live_ids();
    const cache_snapshot before = snapshot(cache_, ids);
    std::string msg;
    const err got = classify(f, &msg);
    expect(got, want, what, msg);
    FUZZ_CHECK(snapshot(cache_, ids) == before, what + " changed the cache although it threw " + name(got));
  }

  // --- operations ---------------------------------------------------------------

  void op_begin() {
    index_t p = in_.ConsumeIntegralInRange<index_t>(0, 3 * D() + 2);
    if (in_.ConsumeIntegralInRange<int>(0, 31) == 0) p = -1 - in_.ConsumeIntegralInRange<index_t>(0, 3);
    if (in_.ConsumeIntegralInRange<int>(0, 3) == 0) {  // an engine announcing a batch of admissions
      index_t a = in_.ConsumeIntegralInRange<index_t>(0, 8 * D());
      if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) a = -1 - a;
      const index_t prev = cache_.announced_tokens();
      std::string amsg;
      const err ag = classify([&] { cache_.announce_admission(a); }, &amsg);
      expect(ag, a < 0 ? err::shape : err::none, "announce_admission(" + std::to_string(a) + ")", amsg);
      FUZZ_CHECK(cache_.announced_tokens() == (a < 0 ? prev : a), "announce_admission: wrong announcement after the call");
    }
    const index_t announced = cache_.announced_tokens();
    const auto ids = live_ids();
    const cache_snapshot before = snapshot(cache_, ids);
    sequence_id id = -1;
    std::string msg;
    const err got = classify([&] { id = cache_.begin_sequence(p); }, &msg);
    const err want = p < 0 ? err::shape : int(seqs_.size()) >= slots_ ? err::capacity : err::none;
    if (want != err::none || got == err::capacity) {  // a full region may refuse a valid admission
      if (want == err::none && got == err::capacity) FUZZ_CHECK(p >= D(), "capacity_error for a prompt with no whole batch");
      expect(got, want == err::none ? err::capacity : want, "begin_sequence(" + std::to_string(p) + ")", msg);
      FUZZ_CHECK(snapshot(cache_, ids) == before, "begin_sequence refused but changed the cache");
      FUZZ_CHECK(cache_.announced_tokens() == announced, "begin_sequence refused but changed the announcement");
      return;
    }
    expect(got, err::none, "begin_sequence(" + std::to_string(p) + ")", msg);
    FUZZ_CHECK(!live(id), "begin_sequence returned a live id");
    FUZZ_CHECK(cache_.announced_tokens() == std::max<index_t>(0, announced - p),
               "begin_sequence did not consume its prompt from the announcement");
    model_seq s;
    s.prompt = p;
    s.placed = p / D() * D();
    s.ready.assign(std::size_t(layers()), p == 0 ? 1 : 0);
    s.window.assign(std::size_t(layers()), 0);
    s.hist.resize(std::size_t(layers()));
    seqs_.emplace(id, std::move(s));
  }

  void op_prefill() {
    // Mostly a sequence that still needs this layer's prompt.
    sequence_id id = pick_id();
    int layer = pick_layer();
    for (const auto& [sid, s] : seqs_)
      for (int l = 0; l < layers(); ++l)
        if (!s.ready[std::size_t(l)] && in_.ConsumeIntegralInRange<int>(0, 3) != 0) {
          id = sid;
          layer = l;
          goto chosen;
        }
  chosen:
    const index_t n = live(id) && in_.ConsumeIntegralInRange<int>(0, 15) != 0
                          ? seqs_.at(id).prompt
                          : in_.ConsumeIntegralInRange<index_t>(0, 3 * D());
    kv_batch<G> b = make_kv(n);
    auto kv = b.view();
    const err damaged = damage(kv);
    err want = err::none;
    if (layer < 0 || layer >= layers() || !live(id)) want = err::shape;
    else if (seqs_.at(id).ready[std::size_t(layer)]) want = err::state;
    else if (n != seqs_.at(id).prompt) want = err::shape;
    else want = damaged;
    const std::string what = "append_prefill(layer " + std::to_string(layer) + ", seq " + std::to_string(id) + ")";
    if (want != err::none) return expect_refusal(want, what, [&] { cache_.append_prefill(layer, id, kv); });
    std::string msg;
    expect(classify([&] { cache_.append_prefill(layer, id, kv); }, &msg), err::none, what, msg);
    model_seq& s = seqs_.at(id);
    record(s.hist[std::size_t(layer)], lay_, b, 0, n);
    s.ready[std::size_t(layer)] = 1;
    s.window[std::size_t(layer)] = int(s.prompt - s.placed);
  }

  /// append(layer, batch) with the model's prediction; returns whether it went through.
  bool do_append(int layer, const std::vector<sequence_id>& batch, bool allow_damage) {
    index_t n = index_t(batch.size());
    if (allow_damage && in_.ConsumeIntegralInRange<int>(0, 31) == 0) n += in_.ConsumeBool() ? 1 : -1;
    if (n < 0) n = 0;
    kv_batch<G> b = make_kv(n);
    auto kv = b.view();
    const err damaged = allow_damage ? damage(kv) : err::none;
    err want = err::none;
    if (layer < 0 || layer >= layers() || n != index_t(batch.size())) want = err::shape;
    else if (damaged != err::none) want = damaged;
    else if ((want = batch_error(batch, layer)) == err::none)
      for (sequence_id id : batch)
        if (seqs_.at(id).window[std::size_t(layer)] >= D()) {
          want = err::state;  // the D-window is full: flush first
          break;
        }
    const std::string what = "append(layer " + std::to_string(layer) + ", " + std::to_string(batch.size()) + " seqs)";
    if (want != err::none) {
      expect_refusal(want, what, [&] { cache_.append(layer, batch, kv); });
      return false;
    }
    std::string msg;
    expect(classify([&] { cache_.append(layer, batch, kv); }, &msg), err::none, what, msg);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      model_seq& s = seqs_.at(batch[i]);
      record(s.hist[std::size_t(layer)], lay_, b, index_t(i), 1);
      ++s.window[std::size_t(layer)];
    }
    return true;
  }

  void op_append() { do_append(pick_layer(), pick_batch(), true); }

  /// step(layer, batch) with the model's prediction; a valid step is compared with fp64.
  void do_step(int layer, const std::vector<sequence_id>& batch, bool allow_damage) {
    const int hq = lay_.num_q_heads();
    const std::size_t rows = batch.size() * std::size_t(hq);
    std::vector<float> q(rows * Q), out(rows * V, std::numeric_limits<float>::quiet_NaN()),
        lse(rows, std::numeric_limits<float>::quiet_NaN());
    for (float& x : q) x = src_.next_float();
    index_t q_n = index_t(q.size()), out_n = index_t(out.size()), lse_n = index_t(lse.size());
    float scale = 0.125f;
    int damaged = allow_damage ? in_.ConsumeIntegralInRange<int>(0, 39) : 99;
    if (damaged == 0 && q_n > 0) --q_n;
    if (damaged == 1 && out_n > 0) --out_n;
    if (damaged == 2) lse_n = lse_n > 1 ? 1 : 2;  // non-empty and wrong (1 is right only for rows == 1)
    if (damaged == 3) scale = in_.ConsumeBool() ? 0.0f : std::numeric_limits<float>::infinity();
    if (damaged == 4) lse_n = 0;  // no LSE wanted: valid
    err want = err::none;
    if (layer < 0 || layer >= layers() || int(batch.size()) > spec().max_sequences) want = err::shape;
    else if (q_n != index_t(q.size()) || out_n != index_t(out.size()) || (lse_n != 0 && lse_n != index_t(lse.size())))
      want = err::shape;
    else if (!(scale > 0.0f && std::isfinite(scale))) want = err::config;
    else want = batch_error(batch, layer);
    const step_outputs<pageable_host_space> so{host_span<float>(out.data(), out_n), host_span<float>(lse.data(), lse_n),
                                               nullptr};
    const std::string what = "step(layer " + std::to_string(layer) + ", " + std::to_string(batch.size()) + " seqs)";
    auto call = [&] { attn_.step(layer, batch, host_span<const float>(q.data(), q_n), scale, so); };
    if (want != err::none) {
      const std::vector<float> out0 = out;
      expect_refusal(want, what, call);
      FUZZ_CHECK(out.empty() || same_bits(out, out0), what + " wrote its outputs although it threw");
      return;
    }
    std::string msg;
    expect(classify(call, &msg), err::none, what, msg);
    ++stats.steps_checked;
    std::vector<double> ro, rl;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const model_seq& s = seqs_.at(batch[i]);
      const kv_history<G>& h = s.hist[std::size_t(layer)];
      const sequence_state& st = cache_.sequence(batch[i]);
      FUZZ_CHECK(h.tokens == st.total_tokens(layer), what + ": the cache holds " + std::to_string(st.total_tokens(layer)) +
                                                         " tokens, the model " + std::to_string(h.tokens));
      reference_attention(lay_, h, q.data() + i * std::size_t(hq) * Q, double(scale), ro, rl);
      compare_result r;
      compare_rows(hq, V, out.data() + i * std::size_t(hq) * V, lse_n ? lse.data() + i * std::size_t(hq) : nullptr, ro,
                   rl, r);
      ++stats.sequences_checked;
      stats.tokens_checked += h.tokens;
      stats.max_tokens = std::max(stats.max_tokens, h.tokens);
      if (!r.ok())
        broken(what + ": sequence " + std::to_string(batch[i]) + " (" + std::to_string(h.tokens) +
               " tokens) differs from fp64: rel_l2 " + std::to_string(r.max_rel_l2) + " lse " +
               std::to_string(r.max_lse_err) + (r.non_finite ? " non-finite" : ""));
    }
  }

  void op_step() { do_step(pick_layer(), pick_batch(), true); }

  void op_flush() {
    const auto ids = live_ids();
    const cache_snapshot before = snapshot(cache_, ids);
    flush_report rep;
    std::string msg;
    const err got = classify([&] { rep = cache_.flush(); }, &msg);
    if (got == err::capacity) {
      ++stats.refusals[int(err::capacity)];
      FUZZ_CHECK(snapshot(cache_, ids) == before, "flush refused but changed the cache: " + msg);
      return;
    }
    expect(got, err::none, "flush", msg);
    int evicted = 0;
    for (auto& [id, s] : seqs_) {
      bool full = true;
      for (int w : s.window) full = full && w == D();
      if (!full) continue;
      ++evicted;
      s.placed += D();
      std::fill(s.window.begin(), s.window.end(), 0);
    }
    FUZZ_CHECK(rep.evicted_sequences == evicted, "flush evicted " + std::to_string(rep.evicted_sequences) +
                                                     " sequences, the model expects " + std::to_string(evicted));
    FUZZ_CHECK(rep.cpu_batches + rep.gpu_batches == evicted, "flush report does not add up");
    stats.evictions += evicted;
    stats.cpu_batches += rep.cpu_batches;
    stats.gpu_batches += rep.gpu_batches;
  }

  void op_end() {
    const sequence_id id = pick_id();
    if (!live(id)) return expect_refusal(err::shape, "end_sequence(" + std::to_string(id) + ")", [&] { cache_.end_sequence(id); });
    std::string msg;
    expect(classify([&] { cache_.end_sequence(id); }, &msg), err::none, "end_sequence", msg);
    seqs_.erase(id);
  }

  void op_read_token() {
    const sequence_id id = pick_id();
    const int layer = pick_layer();
    const index_t row = index_t(lay_.kv_heads()) * G::row_elems;
    std::vector<bf16> tok(std::size_t(2 * row));
    index_t pos = in_.ConsumeIntegralInRange<index_t>(-1, 4 * D());
    std::span<bf16> out(tok);
    if (in_.ConsumeIntegralInRange<int>(0, 31) == 0) out = out.first(out.size() - 1);
    const bool ok_layer = layer >= 0 && layer < layers();
    // Positions a layer holds: every token written, or, before its prompt,
    // the placed (allocated, not yet written) prompt batches.
    const index_t held = live(id) && ok_layer ? (seqs_.at(id).ready[std::size_t(layer)]
                                                     ? seqs_.at(id).hist[std::size_t(layer)].tokens
                                                     : seqs_.at(id).placed)
                                              : 0;
    if (held > 0 && pos >= 0) pos %= held;
    const bool valid = ok_layer && live(id) && pos >= 0 && pos < held && out.size() == tok.size();
    const std::string what = "read_token(layer " + std::to_string(layer) + ", seq " + std::to_string(id) + ", " +
                             std::to_string(pos) + ")";
    if (!valid) return expect_refusal(err::shape, what, [&] { cache_.read_token(layer, id, pos, out); });
    std::string msg;
    expect(classify([&] { cache_.read_token(layer, id, pos, out); }, &msg), err::none, what, msg);
    if (!seqs_.at(id).ready[std::size_t(layer)]) return;  // allocated, not yet written: nothing to compare
    ++stats.read_tokens;
    const kv_history<G>& h = seqs_.at(id).hist[std::size_t(layer)];
    for (int p = 0; p < 2; ++p)
      FUZZ_CHECK(std::memcmp(tok.data() + p * row, h.planes[p].data() + pos * row, std::size_t(row) * sizeof(bf16)) == 0,
                 what + ": plane " + std::to_string(p) + " differs from what was written");
  }

  /// A decode round: every layer appends one token to every sequence that can
  /// take one and attends; then flush. Drives sequences through evictions.
  void op_round() {
    const int rounds = in_.ConsumeIntegralInRange<int>(1, D() + 2);
    for (int r = 0; r < rounds; ++r) {
      std::vector<sequence_id> batch;
      for (const auto& [id, s] : seqs_) {
        bool can = true;
        for (int l = 0; l < layers(); ++l) can = can && s.ready[std::size_t(l)] && s.window[std::size_t(l)] < D();
        if (can) batch.push_back(id);
      }
      if (batch.empty()) break;
      for (int l = 0; l < layers(); ++l) {
        if (!do_append(l, batch, false)) broken("a decode round's append was refused");
        if (l == 0 || r + 1 == rounds) do_step(l, batch, false);  // attending every layer every round is slow
      }
      op_flush();
      check_invariants();
    }
  }

  // --- invariants ---------------------------------------------------------------

  void check_invariants() {
    const region_usage u = cache_.usage();
    FUZZ_CHECK(u.live_sequences == int(seqs_.size()) && cache_.live_sequences() == int(seqs_.size()),
               "live sequences: cache " + std::to_string(u.live_sequences) + ", model " + std::to_string(seqs_.size()));
    FUZZ_CHECK(u.pinned_capacity_blocks <= u.pinned_max_blocks, "pinned capacity above its maximum");
    std::vector<std::uint8_t> cpu_owned(std::size_t(u.cpu_capacity_blocks), 0), pin_owned(std::size_t(u.pinned_capacity_blocks), 0);
    std::vector<std::uint8_t> slot_used(std::size_t(spec().max_sequences), 0);
    index_t cpu_blocks = 0, pin_blocks = 0, placed = 0;
    const int bt = spec().block_tokens;
    for (const auto& [id, s] : seqs_) {
      const sequence_state& st = cache_.sequence(id);
      const std::string who = "sequence " + std::to_string(id) + ": ";
      FUZZ_CHECK(st.prompt_tokens == s.prompt, who + "prompt");
      FUZZ_CHECK(st.placed_tokens == s.placed, who + "placed " + std::to_string(st.placed_tokens) + ", model " +
                                                   std::to_string(s.placed));
      FUZZ_CHECK(st.placed_tokens % D() == 0, who + "placed tokens not a multiple of D");
      FUZZ_CHECK(st.window_tokens == s.window, who + "D-window fill differs from the model");
      FUZZ_CHECK(st.layer_ready == s.ready, who + "prompt-written flags differ from the model");
      FUZZ_CHECK(index_t(st.block_table.size()) * bt == st.placed_tokens, who + "block table length");
      FUZZ_CHECK(st.cpu_blocks.size() + st.pinned_blocks.size() == st.block_table.size(), who + "region lists");
      FUZZ_CHECK(index_t(st.cpu_blocks.size()) * bt == st.cpu_placed_tokens, who + "cpu_placed_tokens");
      std::size_t ci = 0, pi = 0;
      for (const block_ref& b : st.block_table) {
        if (b.region == placement::cpu_compute) {
          FUZZ_CHECK(ci < st.cpu_blocks.size() && st.cpu_blocks[ci++] == b.id, who + "cpu block order");
          FUZZ_CHECK(b.id >= 0 && b.id < u.cpu_capacity_blocks, who + "cpu block id out of range");
          FUZZ_CHECK(!cpu_owned[std::size_t(b.id)]++, who + "cpu block " + std::to_string(b.id) + " owned twice");
        } else {
          FUZZ_CHECK(pi < st.pinned_blocks.size() && st.pinned_blocks[pi++] == b.id, who + "pinned block order");
          FUZZ_CHECK(b.id >= 0 && b.id < u.pinned_capacity_blocks, who + "pinned block id out of range");
          FUZZ_CHECK(!pin_owned[std::size_t(b.id)]++, who + "pinned block " + std::to_string(b.id) + " owned twice");
        }
      }
      // A batch is routed whole: each eviction batch's blocks share one region.
      const int wb = spec().window_blocks();
      for (std::size_t k = 0; k < st.block_table.size(); k += std::size_t(wb))
        for (int j = 1; j < wb; ++j)
          FUZZ_CHECK(st.block_table[k + std::size_t(j)].region == st.block_table[k].region, who + "a batch split across regions");
      FUZZ_CHECK(st.window_slot >= 0 && st.window_slot < spec().max_sequences, who + "slot out of range");
      FUZZ_CHECK(!slot_used[std::size_t(st.window_slot)]++, who + "D-window slot shared");
      cpu_blocks += index_t(st.cpu_blocks.size());
      pin_blocks += index_t(st.pinned_blocks.size());
      placed += st.placed_tokens;
      for (int l = 0; l < layers(); ++l) {
        const kv_history<G>& h = s.hist[std::size_t(l)];
        FUZZ_CHECK(h.tokens == (s.ready[std::size_t(l)] ? st.total_tokens(l) : 0),
                   who + "tokens written to layer " + std::to_string(l));
        // Every token stays where it was written: read back the first, the
        // middle and the last token (wherever each lives now) byte for byte.
        const index_t row = index_t(lay_.kv_heads()) * G::row_elems;
        for (const index_t pos : {index_t{0}, h.tokens / 2, h.tokens - 1}) {
          if (h.tokens == 0) break;
          readback_.resize(std::size_t(2 * row));
          cache_.read_token(l, id, pos, readback_);
          ++stats.read_tokens;
          for (int p = 0; p < 2; ++p)
            FUZZ_CHECK(std::memcmp(readback_.data() + p * row, h.planes[p].data() + pos * row,
                                   std::size_t(row) * sizeof(bf16)) == 0,
                       who + "token " + std::to_string(pos) + " of layer " + std::to_string(l) + ", plane " +
                           std::to_string(p) + " differs from what was written");
        }
      }
    }
    FUZZ_CHECK(u.cpu_used_blocks == cpu_blocks, "usage().cpu_used_blocks " + std::to_string(u.cpu_used_blocks) +
                                                    " != blocks of live sequences " + std::to_string(cpu_blocks));
    FUZZ_CHECK(u.pinned_used_blocks == pin_blocks, "usage().pinned_used_blocks " + std::to_string(u.pinned_used_blocks) +
                                                       " != blocks of live sequences " + std::to_string(pin_blocks));
    FUZZ_CHECK(cache_.total_placed_tokens() == placed, "total_placed_tokens differs from the sum over sequences");
  }

  FuzzedDataProvider& in_;
  G lay_;
  host_backend be_;
  cache_t cache_;
  hybrid_attention<cache_t> attn_;
  bf16_source src_;
  int slots_ = 0;
  std::map<sequence_id, model_seq> seqs_;
  std::vector<bf16> readback_;
};

template <class Policy>
void run_with(FuzzedDataProvider& in, const G& lay, const partition_spec& spec, Policy pol, attention_options opts,
              std::uint64_t seed) {
  std::optional<driver<Policy>> d;
  try {
    d.emplace(in, lay, spec, std::move(pol), opts, seed);
  } catch (const config_error&) {
    ++stats.config_refused;
    return;  // an invalid spec is refused at init; test_errors covers the messages
  }
  ++stats.caches;
  d->run(32);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  ++stats.inputs;
  static constexpr int heads[][2] = {{1, 1}, {2, 1}, {4, 2}, {8, 2}, {4, 4}, {6, 3}};
  const auto& h = heads[in.ConsumeIntegralInRange<int>(0, 5)];
  const G lay(h[0], h[1]);
  partition_spec s;
  s.num_layers = in.ConsumeIntegralInRange<int>(1, 3);
  s.block_tokens = 1 << in.ConsumeIntegralInRange<int>(0, 4);         // 1..16
  s.d_window_tokens = s.block_tokens * in.ConsumeIntegralInRange<int>(1, 4);
  s.max_sequences = in.ConsumeIntegralInRange<int>(1, 5);
  const index_t D = s.d_window_tokens;
  s.cpu_capacity_tokens = D * in.ConsumeIntegralInRange<int>(0, 12) + in.ConsumeIntegralInRange<int>(0, 3);
  s.pinned_capacity_tokens = D * in.ConsumeIntegralInRange<int>(0, 12);
  const int init = in.ConsumeIntegralInRange<int>(0, 2);
  s.pinned_initial_tokens = init == 0 ? -1 : init == 1 ? 0 : std::min(s.pinned_capacity_tokens, D);
  s.pinned_growth_tokens = in.ConsumeIntegralInRange<int>(0, 3) * s.block_tokens;
  s.gpu_split_blocks = in.ConsumeIntegralInRange<int>(1, 4);
  s.cpu_task_blocks = in.ConsumeIntegralInRange<int>(1, 4);
  s.ping_pong_buffers = in.ConsumeIntegralInRange<int>(2, 3);
  const index_t pp_blocks = in.ConsumeIntegralInRange<int>(0, 8);  // fewer than gpu_split_blocks: a config_error
  s.ping_pong_bytes = pp_blocks * block_format<G>{lay, s.block_tokens}.block_bytes();
  attention_options opts{in.ConsumeIntegralInRange<int>(1, 2), true};
  const std::uint64_t seed = in.ConsumeIntegral<std::uint32_t>();
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {  // CPU assist over the pinned blocks
    case 1:
      opts.assist.mode = assist_mode::fixed;
      opts.assist.fixed_fraction = in.ConsumeIntegralInRange<int>(0, 4) / 4.0;
      break;
    case 2:
      opts.assist.mode = assist_mode::adaptive;
      opts.assist.max_pinned_fraction = in.ConsumeIntegralInRange<int>(0, 4) / 4.0;
      opts.assist.initial_cpu_seconds_per_token = 1e-9 * in.ConsumeIntegralInRange<int>(0, 50);
      opts.assist.initial_gpu_seconds_per_token = 1e-9 * in.ConsumeIntegralInRange<int>(0, 50);
      break;
    default: break;  // off (half the inputs, as before the assist existed)
  }
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: run_with(in, lay, s, gpu_only{}, opts, seed); break;
    case 1: run_with(in, lay, s, cpu_only{}, opts, seed); break;
    case 2: run_with(in, lay, s, fixed_ratio(in.ConsumeIntegralInRange<int>(0, 10) / 10.0), opts, seed); break;
    default: {
      roofline_params p;
      p.cpu_cost_per_token_seconds = 1e-9 * in.ConsumeIntegralInRange<int>(1, 100);
      p.gpu_cost_per_token_seconds = 1e-9 * in.ConsumeIntegralInRange<int>(1, 100);
      p.gpu_fixed_seconds = 1e-6 * in.ConsumeIntegralInRange<int>(0, 50);
      p.cost_window_samples = in.ConsumeIntegralInRange<int>(1, 8);
      // K, the enqueue cost per streamed token: 0 (the paper's eq. 2) up to past A and B,
      // where the target share jumps to 0 or 1
      p.launch_cost_per_token_seconds = 1e-9 * in.ConsumeIntegralInRange<int>(0, 120);
      run_with(in, lay, s, roofline_policy(p), opts, seed);
    }
  }
  return 0;
}
