// SPDX-License-Identifier: Apache-2.0
// python/csrc/engine.hpp — the binding's type-erased view of one writescope
// cache and its hybrid attention (docs/PYTHON.md).
//
// The library fixes the layout, the backend and the policy at compile time;
// Python picks them at run time. `engine` is the runtime interface the torch
// ops call; `engine_impl<Layout, Backend, PinnedAllocator, Traits>` is one
// instantiation of it. The routing policy is one type for every choice
// (`any_policy`, a variant of the library's four), so that a layout and a
// backend cost one instantiation, not four.
//
// Tensors: K/V rows are bf16, token-major ([tokens][kv_heads][row]; MLA: one
// plane, the latent ‖ rope row); q, out and lse are fp32. Tensors must be on
// the backend's device (Traits::check_device); host_backend takes CPU tensors.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include <writescope/writescope.hpp>

namespace writescope_py {

namespace ws = writescope;

static_assert(sizeof(ws::bf16) == sizeof(at::BFloat16), "bf16 and at::BFloat16 must both be 16-bit bf16");

/// One routing policy type for every runtime choice: the library's four
/// policies in a variant, dispatched per call (route once per eviction batch,
/// observe once per step: the visit costs nothing measurable next to either).
struct any_policy {
  using policy_concept = ws::routing_policy_tag;
  std::variant<ws::roofline_policy, ws::fixed_ratio, ws::gpu_only, ws::cpu_only> p;

  [[nodiscard]] ws::route_decision route(const ws::route_query& q) const {
    return std::visit([&](const auto& x) { return x.route(q); }, p);
  }
  void observe(const ws::cost_sample& s) {
    std::visit([&](auto& x) { x.observe(s); }, p);
  }
};
static_assert(ws::routing_policy<any_policy>);

/// What the binding exposes of one cache + attention, independent of its types.
class engine {
 public:
  virtual ~engine() = default;

  virtual int64_t begin_sequence(int64_t prompt_tokens) = 0;
  virtual void end_sequence(int64_t seq) = 0;
  virtual void announce_admission(int64_t prompt_tokens) = 0;
  /// k (and v, GQA) [tokens][kv_heads][row] bf16.
  virtual void append_prefill(int64_t layer, int64_t seq, const at::Tensor& k, const std::optional<at::Tensor>& v) = 0;
  /// Several sequences' prompts of one layer in one backend write: k (and v)
  /// [tokens][kv_heads][row] bf16, seqs[i]'s prompt its tokens [first_tokens[i],
  /// first_tokens[i] + prompt tokens).
  virtual void append_prefill_batch(int64_t layer, const std::vector<int64_t>& seqs,
                                    const std::vector<int64_t>& first_tokens, const at::Tensor& k,
                                    const std::optional<at::Tensor>& v) = 0;
  /// Finishes the deferred pageable prefill writes (cuda backend; a no-op when
  /// none is pending and on the host backend).
  virtual void complete_host_writes() = 0;
  /// k (and v) [batch][kv_heads][row] bf16, row i for seqs[i].
  virtual void append(int64_t layer, const std::vector<int64_t>& seqs, const at::Tensor& k,
                      const std::optional<at::Tensor>& v) = 0;
  /// q [batch][Hq][q_dim] fp32 -> (out [batch][Hq][v_dim], lse [batch][Hq]) fp32.
  virtual std::tuple<at::Tensor, at::Tensor> attention(int64_t layer, const std::vector<int64_t>& seqs,
                                                       const at::Tensor& q, double scale) = 0;
  /// {evicted sequences, CPU batches, GPU batches}.
  virtual std::vector<int64_t> flush() = 0;
  virtual std::vector<std::pair<std::string, int64_t>> usage() const = 0;
  virtual std::vector<std::pair<std::string, int64_t>> sequence(int64_t seq) const = 0;
  virtual std::vector<std::pair<std::string, double>> last_step() const = 0;
  virtual std::vector<std::pair<std::string, double>> policy_state() const = 0;
  /// The K/V of one cached token, [planes][kv_heads][row] bf16 on the host.
  virtual at::Tensor read_token(int64_t layer, int64_t seq, int64_t position) const = 0;
  virtual std::string describe() const = 0;
};

/// Everything the constructor of an engine needs, parsed from Python's dicts.
struct engine_config {
  std::string layout = "gqa";  // "gqa" or "mla"
  int num_q_heads = 1;
  int num_kv_heads = 1;
  int head_dim = 128;       // GQA row
  int kv_lora_rank = 512;   // MLA
  int rope_dim = 64;        // MLA
  ws::partition_spec spec{};
  ws::attention_options options{};
  any_policy policy{ws::gpu_only{}};
  bool poison = false;
  /// cuda backend: the most bytes of deferred pageable prefill writes
  /// (cuda_backend::set_deferred_host_writes; 0 = synchronous writes). The
  /// page-locked buffer is reserved whole at construction when the cache has
  /// an unpinned region (inplace_kv_cache::reserve_deferred_host_writes;
  /// pinned_memory_error naming this option when it cannot be). Ignored by the
  /// host backend.
  int64_t deferred_host_write_bytes = int64_t{512} << 20;
  /// cuda backend: the device staging buffer of prefill writes to host blocks,
  /// at most (cuda_backend::set_max_staging_bytes); 0 = the library's default.
  int64_t staging_bytes = 0;
  /// cuda backend: the HBM-resident region attended by the split-K resident
  /// kernels (cuda_backend::set_resident_kernel, set before the attention
  /// engine reserves their workspace); experimental, off by default. Ignored by
  /// the host backend.
  bool resident_kernel = false;
  /// Tokens per layer of the unpinned CPU region whose pages are made resident
  /// at construction (inplace_kv_cache::prefault_cpu_region, by all cores), so
  /// that the prefill's writes into it do not fault page by page: -1 = the
  /// whole region, 0 = none (pages become resident as they are first written).
  int64_t cpu_prefault_tokens = 0;
};

namespace detail {

inline std::string dtype_name(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

inline std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

inline int to_int(int64_t v, const char* what) {
  if (v < INT32_MIN || v > INT32_MAX) throw ws::shape_error(std::string(what) + " " + std::to_string(v) + " is out of range");
  return int(v);
}

}  // namespace detail

/// Traits of a backend as the binding drives it: which tensors it takes and
/// what it does around each call (cuda: stream ordering). The host traits.
struct host_traits {
  static constexpr const char* device_name = "cpu";
  template <class Backend>
  static void check_device(Backend&, const at::Tensor& t, const char* call, const char* what) {
    if (!t.device().is_cpu())
      throw ws::shape_error(std::string(call) + ": " + what + " is on " + t.device().str() +
                            "; this cache uses the host backend, which takes CPU tensors");
  }
  template <class Backend>
  struct scope {
    explicit scope(Backend&) {}
  };
};

template <ws::kv_layout Layout, class Backend, class PinnedAllocator, class Traits>
class engine_impl final : public engine {
 public:
  using cache_type = ws::inplace_kv_cache<Layout, Backend, PinnedAllocator, any_policy>;
  using attention_type = ws::hybrid_attention<cache_type>;

  // The backend's switches that must precede the cache and the attention engine.
  static Backend& configured(Backend& b, const engine_config& c) {
    if constexpr (requires { b.set_resident_kernel(true); }) b.set_resident_kernel(c.resident_kernel);
    return b;
  }

  template <class... BackendArgs>
  engine_impl(const Layout& layout, const engine_config& c, BackendArgs&&... backend_args)
      : backend_(std::forward<BackendArgs>(backend_args)...),
        layout_(layout),
        cache_(configured(backend_, c), layout, c.spec, c.policy, PinnedAllocator{}, ws::cache_options{c.poison}),
        attention_(cache_, c.options) {
    if constexpr (has_deferred_writes) {
      if (c.deferred_host_write_bytes < 0)
        throw ws::config_error("Cache: deferred_host_write_bytes = " + std::to_string(c.deferred_host_write_bytes) +
                               " must be >= 0 (0: synchronous prefill writes)");
      if (c.staging_bytes < 0)
        throw ws::config_error("Cache: staging_bytes = " + std::to_string(c.staging_bytes) +
                               " must be >= 0 (0: the library's default)");
      typename Traits::template scope<Backend> s(backend_);
      if (c.staging_bytes > 0) backend_.set_max_staging_bytes(c.staging_bytes);
      backend_.set_deferred_host_writes(c.deferred_host_write_bytes);
      // The whole buffer page-locked now (the cache skips it without an unpinned region), so that
      // no prefill page-locks memory inside its first layers.
      try {
        cache_.reserve_deferred_host_writes(c.deferred_host_write_bytes);
      } catch (const ws::pinned_memory_error& e) {
        throw ws::pinned_memory_error("Cache: deferred_host_write_bytes = " + std::to_string(c.deferred_host_write_bytes) +
                                      " cannot be page-locked at creation (" + e.what() +
                                      "); lower it, or 0 for synchronous prefill writes");
      }
    }
    if (c.cpu_prefault_tokens < -1)
      throw ws::config_error("Cache: cpu_prefault_tokens = " + std::to_string(c.cpu_prefault_tokens) +
                             " must be >= -1 (-1: the whole unpinned region, 0: none)");
    if (c.cpu_prefault_tokens != 0) {
      const int64_t bt = cache_.spec().block_tokens;
      const int64_t blocks =
          c.cpu_prefault_tokens < 0 ? int64_t(cache_.usage().cpu_capacity_blocks) : (c.cpu_prefault_tokens + bt - 1) / bt;
      typename Traits::template scope<Backend> s(backend_);
      cpu_prefaulted_bytes_ = cache_.prefault_cpu_region(ws::index_t(blocks));
    }
  }

  // Deferred writes may still be pending (the last prefill layer's when no
  // decode step followed): they land, and every stream is idle, before the
  // cache frees its regions.
  ~engine_impl() override {
    try {
      typename Traits::template scope<Backend> s(backend_);
      backend_.synchronize_host_writes();
    } catch (...) {
    }
  }

  int64_t begin_sequence(int64_t prompt_tokens) override {
    typename Traits::template scope<Backend> s(backend_);
    return cache_.begin_sequence(prompt_tokens);
  }
  void end_sequence(int64_t seq) override {
    const ws::sequence_id id = detail::to_int(seq, "end_sequence: sequence");
    typename Traits::template scope<Backend> s(backend_);
    backend_.complete_host_writes();  // no deferred write lands in a block after it was freed
    cache_.end_sequence(id);
  }
  void announce_admission(int64_t prompt_tokens) override { cache_.announce_admission(prompt_tokens); }

  void append_prefill(int64_t layer, int64_t seq, const at::Tensor& k, const std::optional<at::Tensor>& v) override {
    const int64_t tokens = k.dim() > 0 ? k.size(0) : 0;
    auto [kk, vv] = checked_kv(k, v, tokens, "append_prefill");
    typename Traits::template scope<Backend> s(backend_);
    cache_.append_prefill(detail::to_int(layer, "append_prefill: layer"), detail::to_int(seq, "append_prefill: sequence"),
                          make_kv(kk, vv, tokens));
  }

  void append_prefill_batch(int64_t layer, const std::vector<int64_t>& seqs, const std::vector<int64_t>& first_tokens,
                            const at::Tensor& k, const std::optional<at::Tensor>& v) override {
    const int64_t tokens = k.dim() > 0 ? k.size(0) : 0;
    auto [kk, vv] = checked_kv(k, v, tokens, "append_prefill_batch");
    ids_.resize(seqs.size());
    for (std::size_t i = 0; i < seqs.size(); ++i) ids_[i] = detail::to_int(seqs[i], "append_prefill_batch: sequence");
    firsts_.assign(first_tokens.begin(), first_tokens.end());
    typename Traits::template scope<Backend> s(backend_);
    cache_.append_prefill(detail::to_int(layer, "append_prefill_batch: layer"), ids_, firsts_, make_kv(kk, vv, tokens));
  }

  void complete_host_writes() override {
    typename Traits::template scope<Backend> s(backend_);
    backend_.complete_host_writes();
  }

  void append(int64_t layer, const std::vector<int64_t>& seqs, const at::Tensor& k,
              const std::optional<at::Tensor>& v) override {
    auto [kk, vv] = checked_kv(k, v, int64_t(seqs.size()), "append");
    ids_.assign(seqs.begin(), seqs.end());
    for (std::size_t i = 0; i < seqs.size(); ++i) ids_[i] = detail::to_int(seqs[i], "append: sequence");
    typename Traits::template scope<Backend> s(backend_);
    cache_.append(detail::to_int(layer, "append: layer"), ids_, make_kv(kk, vv, int64_t(seqs.size())));
  }

  std::tuple<at::Tensor, at::Tensor> attention(int64_t layer, const std::vector<int64_t>& seqs, const at::Tensor& q,
                                               double scale) override {
    const int64_t batch = int64_t(seqs.size());
    const int hq = layout_.num_q_heads();
    check_tensor(q, at::kFloat, {batch, hq, Layout::q_dim}, "attention", "q");
    const at::Tensor qc = q.contiguous();
    ids_.resize(seqs.size());
    for (std::size_t i = 0; i < seqs.size(); ++i) ids_[i] = detail::to_int(seqs[i], "attention: sequence");
    at::Tensor out = at::empty({batch, hq, Layout::v_dim}, q.options());
    at::Tensor lse = at::empty({batch, hq}, q.options());
    using space = typename cache_type::activation_space;
    typename Traits::template scope<Backend> s(backend_);
    last_ = attention_.step(detail::to_int(layer, "attention: layer"), ids_,
                            ws::mem_span<const float, space>(qc.const_data_ptr<float>(), qc.numel()), float(scale),
                            {ws::mem_span<float, space>(out.mutable_data_ptr<float>(), out.numel()),
                             ws::mem_span<float, space>(lse.mutable_data_ptr<float>(), lse.numel()), nullptr});
    return {out, lse};
  }

  std::vector<int64_t> flush() override {
    typename Traits::template scope<Backend> s(backend_);
    const ws::flush_report r = cache_.flush();
    return {r.evicted_sequences, r.cpu_batches, r.gpu_batches};
  }

  std::vector<std::pair<std::string, int64_t>> usage() const override {
    const ws::region_usage u = cache_.usage();
    const ws::partition_spec& sp = cache_.spec();
    return {{"cpu_prefaulted_bytes", cpu_prefaulted_bytes_},
            {"cpu_used_blocks", u.cpu_used_blocks},
            {"cpu_capacity_blocks", u.cpu_capacity_blocks},
            {"pinned_used_blocks", u.pinned_used_blocks},
            {"pinned_capacity_blocks", u.pinned_capacity_blocks},
            {"pinned_max_blocks", u.pinned_max_blocks},
            {"hbm_used_blocks", u.hbm_used_blocks},
            {"hbm_capacity_blocks", u.hbm_capacity_blocks},
            {"live_sequences", u.live_sequences},
            {"max_sequences", u.max_sequences},
            {"cpu_region_bytes", u.cpu_region_bytes},
            {"pinned_region_bytes", u.pinned_region_bytes},
            {"hbm_region_bytes", u.hbm_region_bytes},
            {"d_window_bytes", u.d_window_bytes},
            {"ping_pong_bytes", u.ping_pong_bytes},
            {"block_tokens", sp.block_tokens},
            {"d_window_tokens", sp.d_window_tokens},
            {"num_layers", sp.num_layers},
            {"total_placed_tokens", cache_.total_placed_tokens()},
            {"total_hbm_placed_tokens", cache_.total_hbm_placed_tokens()},
            {"deferred_host_write_bytes", deferred_bytes()},
            {"host_copy_submissions", int64_t(host_copies()[0])},
            {"host_copy_pieces", int64_t(host_copies()[1])},
            {"host_copy_api_calls", int64_t(host_copies()[2])}};
  }

  std::vector<std::pair<std::string, int64_t>> sequence(int64_t seq) const override {
    const ws::sequence_state& st = cache_.sequence(detail::to_int(seq, "sequence: sequence"));
    std::vector<std::pair<std::string, int64_t>> r{{"prompt_tokens", st.prompt_tokens},
                                                   {"placed_tokens", st.placed_tokens},
                                                   {"cpu_placed_tokens", st.cpu_placed_tokens},
                                                   {"hbm_placed_tokens", st.hbm_placed_tokens},
                                                   {"pinned_placed_tokens",
                                                    st.placed_tokens - st.cpu_placed_tokens - st.hbm_placed_tokens},
                                                   {"window_slot", st.window_slot},
                                                   {"generation", int64_t(st.generation)}};
    for (std::size_t l = 0; l < st.window_tokens.size(); ++l) {
      r.emplace_back("window_tokens." + std::to_string(l), st.window_tokens[l]);
      r.emplace_back("ready." + std::to_string(l), st.layer_ready[l]);
    }
    return r;
  }

  std::vector<std::pair<std::string, double>> last_step() const override {
    return {{"cpu_seconds", last_.cpu_seconds},         {"gpu_seconds", last_.gpu_seconds},
            {"total_seconds", last_.total_seconds},     {"launch_seconds", last_.launch_seconds},
            {"query_wait_seconds", last_.query_wait_seconds}, {"finish_seconds", last_.finish_seconds},
            {"cpu_tokens", double(last_.cpu_tokens)},   {"streamed_tokens", double(last_.streamed_tokens)},
            {"window_tokens", double(last_.window_tokens)}, {"assist_tokens", double(last_.assist_tokens)},
            {"copies", double(last_.copies)},           {"chunks", double(last_.chunks)},
            {"cpu_tasks", double(last_.cpu_tasks)},     {"resident_tokens", double(last_.resident_tokens)},
            {"cpu_side", last_.cpu_side ? 1.0 : 0.0}};
  }

  std::vector<std::pair<std::string, double>> policy_state() const override {
    return std::visit(
        [&](const auto& p) -> std::vector<std::pair<std::string, double>> {
          using P = std::decay_t<decltype(p)>;
          if constexpr (std::is_same_v<P, ws::roofline_policy>) {
            const ws::index_t hbm = cache_.total_hbm_placed_tokens();  // in Δ', not in L
            const ws::index_t host = cache_.total_placed_tokens() - hbm;
            return {{"cpu_cost_per_token_seconds", p.cpu_cost_per_token_seconds()},
                    {"gpu_cost_per_token_seconds", p.gpu_cost_per_token_seconds()},
                    {"launch_cost_per_token_seconds", p.launch_cost_per_token_seconds()},
                    {"hbm_cost_per_token_seconds", p.hbm_cost_per_token_seconds()},
                    {"converged_share", p.converged_share()},
                    {"target_share", p.target_share(host, hbm)}};
          } else if constexpr (std::is_same_v<P, ws::fixed_ratio>) {
            return {{"target_share", p.cpu_share()}};
          } else if constexpr (std::is_same_v<P, ws::cpu_only>) {
            return {{"target_share", 1.0}};
          } else {
            return {{"target_share", 0.0}};
          }
        },
        cache_.policy().p);
  }

  at::Tensor read_token(int64_t layer, int64_t seq, int64_t position) const override {
    at::Tensor out = at::empty({Layout::planes, layout_.kv_heads(), Layout::row_elems}, at::TensorOptions().dtype(at::kBFloat16));
    cache_.read_token(detail::to_int(layer, "read_token: layer"), detail::to_int(seq, "read_token: sequence"), position,
                      std::span<ws::bf16>(reinterpret_cast<ws::bf16*>(out.mutable_data_ptr<at::BFloat16>()),
                                          std::size_t(out.numel())));
    return out;
  }

  std::string describe() const override {
    std::string l = Layout::is_mla ? "mla(" + std::to_string(Layout::q_dim - Layout::v_dim) + "+" +
                                         std::to_string(Layout::v_dim) + ")"
                                   : "gqa(head_dim=" + std::to_string(Layout::q_dim) + ")";
    return l + ", Hq=" + std::to_string(layout_.num_q_heads()) + ", Hkv=" + std::to_string(layout_.kv_heads()) +
           ", backend " + std::string(backend_.name());
  }

 private:
  using kv_input = typename cache_type::kv_input;

  int64_t cpu_prefaulted_bytes_ = 0;  ///< bytes of the unpinned region made resident at construction

  static constexpr bool has_deferred_writes = ws::deferred_host_write_backend<Backend>;

  // cuda backend: {submissions, copies, CUDA copy calls} of the D2H batches into
  // page-locked host memory (basic_cuda_backend::host_copy_counters); zeros elsewhere.
  std::array<std::uint64_t, 3> host_copies() const {
    if constexpr (requires { backend_.host_copy_counters(); })
      return backend_.host_copy_counters();
    else
      return {0, 0, 0};
  }

  int64_t deferred_bytes() const {
    if constexpr (has_deferred_writes)
      return backend_.deferred_host_writes();
    else
      return 0;
  }

  void check_tensor(const at::Tensor& t, at::ScalarType dtype, std::initializer_list<int64_t> shape, const char* call,
                    const char* what) {
    if (t.scalar_type() != dtype)
      throw ws::shape_error(std::string(call) + ": " + what + " has dtype " + detail::dtype_name(t) + ", expected " +
                            std::string(c10::toString(dtype)));
    Traits::check_device(backend_, t, call, what);
    const std::vector<int64_t> want(shape);
    bool ok = t.dim() == int64_t(want.size());
    for (std::size_t i = 0; ok && i < want.size(); ++i) ok = t.size(int64_t(i)) == want[i];
    if (!ok) {
      std::string w = "[";
      for (std::size_t i = 0; i < want.size(); ++i) w += (i ? ", " : "") + std::to_string(want[i]);
      throw ws::shape_error(std::string(call) + ": " + what + " has shape " + detail::shape_of(t) + ", expected " + w + "]");
    }
  }

  // K (and V) as the library reads them: rows contiguous, one token stride
  // for both planes. Copies only when the strides do not allow that.
  std::pair<at::Tensor, at::Tensor> checked_kv(const at::Tensor& k, const std::optional<at::Tensor>& v, int64_t tokens,
                                               const char* call) {
    const int64_t hkv = layout_.kv_heads();
    check_tensor(k, at::kBFloat16, {tokens, hkv, Layout::row_elems}, call, "k");
    at::Tensor kk = k, vv;
    if constexpr (Layout::planes == 2) {
      if (!v.has_value()) throw ws::shape_error(std::string(call) + ": a GQA cache needs v");
      check_tensor(*v, at::kBFloat16, {tokens, hkv, Layout::row_elems}, call, "v");
      vv = *v;
    } else if (v.has_value()) {
      throw ws::shape_error(std::string(call) + ": an MLA cache takes one plane (the latent row) in k; v must be None");
    }
    auto rows_ok = [&](const at::Tensor& t) {
      return (t.size(2) <= 1 || t.stride(2) == 1) && (t.size(1) <= 1 || t.stride(1) == Layout::row_elems) &&
             (t.size(0) <= 1 || t.stride(0) >= hkv * Layout::row_elems);
    };
    const bool same_stride = !vv.defined() || tokens <= 1 || vv.stride(0) == kk.stride(0);
    if (!rows_ok(kk) || (vv.defined() && !rows_ok(vv)) || !same_stride) {
      kk = kk.contiguous();
      if (vv.defined()) vv = vv.contiguous();
    }
    return {kk, vv};
  }

  kv_input make_kv(const at::Tensor& k, const at::Tensor& v, int64_t tokens) const {
    kv_input kv;
    kv.planes[0] = reinterpret_cast<const ws::bf16*>(k.const_data_ptr<at::BFloat16>());
    if constexpr (Layout::planes == 2) kv.planes[1] = reinterpret_cast<const ws::bf16*>(v.const_data_ptr<at::BFloat16>());
    kv.num_tokens = tokens;
    kv.token_stride = tokens > 1 ? k.stride(0) : 0;
    return kv;
  }

  Backend backend_;
  Layout layout_;
  cache_type cache_;
  attention_type attention_;
  std::vector<ws::sequence_id> ids_;
  std::vector<ws::index_t> firsts_;
  ws::step_report last_{};
};

/// MLA layouts the extension instantiates (kv_lora_rank, rope dim): DeepSeek-V2 / V2-Lite / V3.
inline constexpr int mla_rank = 512;
inline constexpr int mla_rope = 64;

/// Throws what the library throws for the layout of `c` (unsupported head dim,
/// Hq not a multiple of Hkv, ...) without building anything.
inline void validate_layout(const engine_config& c) {
  if (c.layout == "gqa") {
    ws::dispatch_head_dim(c.head_dim, [&](auto d) { (void)ws::gqa_layout<decltype(d)::value>(c.num_q_heads, c.num_kv_heads); });
    return;
  }
  if (c.layout == "mla") {
    if (c.kv_lora_rank != mla_rank || c.rope_dim != mla_rope)
      throw ws::config_error("MLA kv_lora_rank " + std::to_string(c.kv_lora_rank) + " with rope dim " +
                             std::to_string(c.rope_dim) + " is not supported; supported: " + std::to_string(mla_rank) +
                             " with " + std::to_string(mla_rope));
    (void)ws::mla_layout<mla_rank, mla_rope>(c.num_q_heads);
    return;
  }
  throw ws::config_error("layout '" + c.layout + "' is not supported; supported: gqa, mla");
}

/// The engine of `c` on Backend: dispatches the runtime layout to a compile-time one
/// (GQA head dims: ws::supported_gqa_head_dims; MLA: 512 + 64). Throws
/// config_error naming an unsupported value.
template <class Backend, class PinnedAllocator, class Traits, class... BackendArgs>
std::unique_ptr<engine> build_engine(const engine_config& c, BackendArgs&&... args) {
  if (c.layout == "gqa") {
    return ws::dispatch_head_dim(c.head_dim, [&](auto d) -> std::unique_ptr<engine> {
      using L = ws::gqa_layout<decltype(d)::value>;
      return std::make_unique<engine_impl<L, Backend, PinnedAllocator, Traits>>(L(c.num_q_heads, c.num_kv_heads), c,
                                                                                std::forward<BackendArgs>(args)...);
    });
  }
  if (c.layout == "mla") {
    validate_layout(c);
    using L = ws::mla_layout<mla_rank, mla_rope>;
    return std::make_unique<engine_impl<L, Backend, PinnedAllocator, Traits>>(L(c.num_q_heads), c,
                                                                              std::forward<BackendArgs>(args)...);
  }
  throw ws::config_error("layout '" + c.layout + "' is not supported; supported: gqa, mla");
}

/// Builds the engine of `c` on the host backend (engine_host.cpp).
std::unique_ptr<engine> make_host_engine(const engine_config& c);
/// Builds the engine of `c` on the CUDA backend (engine_cuda.cpp), on the
/// current device and torch's current stream. Throws config_error when the
/// extension was built without CUDA.
std::unique_ptr<engine> make_cuda_engine(const engine_config& c);
/// Whether make_cuda_engine can work (the extension was built with CUDA).
bool cuda_built();

}  // namespace writescope_py
