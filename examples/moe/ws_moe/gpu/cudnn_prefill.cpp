// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/cudnn_prefill.cpp — cudnn_prefill (contract and design in
// cudnn_prefill.hpp): the cuDNN loader, the per-shape graph/plan cache and the
// run. The only file of the project that includes cudnn_frontend.
//
// cuDNN is loaded at run time (cudnn-frontend's dynamic-loading shim), so the
// binaries start on a machine without cuDNN and cudnn_prefill::available()
// says so; the JSON serialisation of the frontend is left out (unused, and it
// would bring a second nlohmann-json into the binaries).
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING 1
#define CUDNN_FRONTEND_SKIP_JSON_LIB 1
#include <cudnn_frontend.h>

#include <dlfcn.h>

#include <cuda_runtime_api.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cudnn_prefill.hpp"

// The handle the frontend's shim resolves every cuDNN symbol from (declared
// extern by cudnn_frontend_shim.h; set once by load_cudnn below).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace ws_moe::gpu {
namespace {

namespace fe = cudnn_frontend;

constexpr long min_cudnn_version = 90600;  ///< ragged Q/K/V/O/Stats with padding and causal masks
constexpr std::size_t workspace_alignment_bytes = 256;

[[noreturn]] void fail(const std::string& rule) { throw writescope::config_error("cudnn prefill: " + rule); }

std::size_t align_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

// ---------------------------------------------------------------------------
// Loading cuDNN

struct loader_state {
  bool ok = false;
  long version = 0;
  std::string reason;
};

loader_state load_cudnn() {
  loader_state s;
  // The frontend opens the CUDA runtime by name for a few calls; this process
  // already runs one (the project links it), so name that one unless the user
  // has chosen.
  if (std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME") == nullptr) {
    const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
    (void)setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), 0);
  }
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("WS_CUDNN_LIBRARY"); env != nullptr && *env != '\0') candidates.emplace_back(env);
#if defined(WS_MOE_CUDNN_LIBRARY_PATH)
  candidates.emplace_back(WS_MOE_CUDNN_LIBRARY_PATH);
#endif
  candidates.emplace_back("libcudnn.so.9");
  void* handle = nullptr;
  std::string tried;
  for (const std::string& c : candidates) {
    dlerror();
    handle = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) break;
    const char* e = dlerror();
    tried += (tried.empty() ? "" : "; ") + c + ": " + (e != nullptr ? e : "not loadable");
  }
  if (handle == nullptr) {
    s.reason = "cuDNN could not be loaded (" + tried + "); set WS_CUDNN_LIBRARY to libcudnn.so.9's path";
    return s;
  }
  using version_fn = std::size_t (*)();
  const auto get_version = reinterpret_cast<version_fn>(dlsym(handle, "cudnnGetVersion"));
  if (get_version == nullptr) {
    s.reason = "the loaded cuDNN library has no cudnnGetVersion";
    dlclose(handle);
    return s;
  }
  s.version = long(get_version());
  if (s.version < min_cudnn_version) {
    s.reason = "cuDNN " + std::to_string(s.version) + " is older than the " + std::to_string(min_cudnn_version) +
               " the prefill attention needs (ragged tensors with padding and causal masks)";
    dlclose(handle);
    return s;
  }
  fe::cudnn_dlhandle = handle;
  s.ok = true;
  return s;
}

const loader_state& loader() {
  static const loader_state s = load_cudnn();
  return s;
}

// ---------------------------------------------------------------------------
// Shape keys and plans

enum uid : fe::graph::Tensor_attributes::uid_t {
  uid_q = 1, uid_k, uid_v, uid_o, uid_stats, uid_seq_len_q, uid_seq_len_kv,
  uid_q_off, uid_k_off, uid_v_off, uid_o_off, uid_stats_off
};

/// Rounded up to a power of two, at least `lo`.
idx bucket(idx x, idx lo) {
  idx b = lo;
  while (b < x) b *= 2;
  return b;
}

struct plan_key {
  int batch;    ///< sequences, rounded up to a power of two
  idx s_tokens; ///< max_seq_tokens, rounded up to a power of two (>= 64)
  int hq, hkv, dqk, dv;
  std::array<idx, 8> strides;
  bool lse;
  int offset_bytes;        ///< 4: int32 ragged offsets, 8: int64
  std::uint32_t scale_bits;
  auto operator<=>(const plan_key&) const = default;
};

plan_key key_of(const cudnn_prefill_params& p) {
  plan_key k{};
  k.batch = int(bucket(p.num_seqs, 1));
  k.s_tokens = bucket(p.max_seq_tokens, 64);
  k.hq = p.hq;
  k.hkv = p.hkv;
  k.dqk = p.dqk;
  k.dv = p.dv;
  k.strides = {p.q_token_stride, p.q_head_stride, p.k_token_stride, p.k_head_stride,
               p.v_token_stride, p.v_head_stride, p.o_token_stride, p.o_head_stride};
  k.lse = p.lse != nullptr;
  // The largest element offset a ragged offset can hold: buffer_tokens rows of
  // the widest token stride (lse: hq per row).
  idx widest = p.hq;
  for (int i = 0; i < 8; i += 2) widest = std::max(widest, k.strides[std::size_t(i)]);
  const bool fits32 = widest == 0 || p.buffer_tokens <= idx(std::numeric_limits<std::int32_t>::max()) / widest;
  k.offset_bytes = fits32 ? 4 : 8;
  k.scale_bits = std::bit_cast<std::uint32_t>(p.scale);
  return k;
}

std::string describe(const plan_key& k) {
  return "sequences " + std::to_string(k.batch) + " (rounded), max tokens " + std::to_string(k.s_tokens) +
         " (rounded), hq " + std::to_string(k.hq) + ", hkv " + std::to_string(k.hkv) + ", dqk " + std::to_string(k.dqk) +
         ", dv " + std::to_string(k.dv) + ", token/head strides q " + std::to_string(k.strides[0]) + "/" +
         std::to_string(k.strides[1]) + " k " + std::to_string(k.strides[2]) + "/" + std::to_string(k.strides[3]) +
         " v " + std::to_string(k.strides[4]) + "/" + std::to_string(k.strides[5]) + " o " +
         std::to_string(k.strides[6]) + "/" + std::to_string(k.strides[7]) + (k.lse ? ", lse" : "") + ", int" +
         std::to_string(8 * k.offset_bytes) + " offsets";
}

struct plan {
  std::shared_ptr<fe::graph::Graph> graph;  ///< null when refused
  std::string refusal;                      ///< cuDNN's reason when refused
  std::size_t cudnn_workspace_bytes = 0;
  cudnn_prefill_detail::aux_layout aux{};
};

/// The SDPA graph of a key, built into a plan; a refusal carries the step and cuDNN's message.
plan build_plan(cudnnHandle_t handle, const plan_key& k) {
  plan pl;
  pl.aux = cudnn_prefill_detail::aux_layout_for(k.batch, k.offset_bytes);
  const std::int64_t b = k.batch, s = k.s_tokens, hq = k.hq, hkv = k.hkv, dqk = k.dqk, dv = k.dv;
  const auto& st = k.strides;
  const fe::DataType_t off_type = k.offset_bytes == 4 ? fe::DataType_t::INT32 : fe::DataType_t::INT64;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto index_tensor = [&](const char* name, fe::graph::Tensor_attributes::uid_t id, std::int64_t n,
                                fe::DataType_t type) {
    return g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(id).set_data_type(type)
                         .set_dim({n, 1, 1, 1}).set_stride({1, 1, 1, 1}));
  };
  // [b, h, s, d] over the caller's [tokens][heads][d] rows: batch i starts at
  // its ragged offset; the batch stride is ignored with ragged offsets (a
  // padded layout's value is given).
  const auto data_tensor = [&](const char* name, fe::graph::Tensor_attributes::uid_t id, std::int64_t heads,
                               std::int64_t d, idx token_stride, idx head_stride, const char* off_name,
                               fe::graph::Tensor_attributes::uid_t off_id) {
    return g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(id).set_dim({b, heads, s, d})
                         .set_stride({s * token_stride, head_stride, token_stride, 1})
                         .set_ragged_offset(index_tensor(off_name, off_id, b + 1, off_type)));
  };
  auto q = data_tensor("q", uid_q, hq, dqk, st[0], st[1], "q_ragged_offset", uid_q_off);
  auto kt = data_tensor("k", uid_k, hkv, dqk, st[2], st[3], "k_ragged_offset", uid_k_off);
  auto vt = data_tensor("v", uid_v, hkv, dv, st[4], st[5], "v_ragged_offset", uid_v_off);
  auto seq_q = index_tensor("seq_len_q", uid_seq_len_q, b, fe::DataType_t::INT32);
  auto seq_kv = index_tensor("seq_len_kv", uid_seq_len_kv, b, fe::DataType_t::INT32);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("ws_prefill")
                     .set_generate_stats(k.lse)
                     .set_attn_scale(std::bit_cast<float>(k.scale_bits))
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0)
                     .set_padding_mask(true)
                     .set_seq_len_q(seq_q)
                     .set_seq_len_kv(seq_kv);
  auto [o, stats] = g->sdpa(q, kt, vt, options);
  o->set_output(true).set_uid(uid_o).set_data_type(fe::DataType_t::BFLOAT16).set_dim({b, hq, s, dv})
      .set_stride({s * st[6], st[7], st[6], 1})
      .set_ragged_offset(index_tensor("o_ragged_offset", uid_o_off, b + 1, off_type));
  if (k.lse) {
    stats->set_output(true).set_uid(uid_stats).set_data_type(fe::DataType_t::FLOAT).set_dim({b, hq, s, 1})
        .set_stride({s * hq, 1, hq, 1})
        .set_ragged_offset(index_tensor("stats_ragged_offset", uid_stats_off, b + 1, off_type));
  }
  const auto refused = [&](const char* step, fe::error_t e) {
    pl.refusal = std::string(step) + ": " + e.err_msg + " (frontend error code " +
                 std::to_string(int(e.code)) + ")";
    return pl;
  };
  if (auto e = g->validate(); e.is_bad()) return refused("validate", e);
  if (auto e = g->build_operation_graph(handle); e.is_bad()) return refused("build_operation_graph", e);
  if (auto e = g->create_execution_plans({fe::HeurMode_t::A}); e.is_bad()) return refused("create_execution_plans", e);
  if (auto e = g->check_support(); e.is_bad()) return refused("check_support", e);
  if (auto e = g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE); e.is_bad()) return refused("build_plans", e);
  std::int64_t ws = 0;
  if (auto e = g->get_workspace_size(ws); e.is_bad()) return refused("get_workspace_size", e);
  pl.cudnn_workspace_bytes = std::size_t(std::max<std::int64_t>(ws, 0));
  pl.graph = std::move(g);
  return pl;
}

}  // namespace

// ---------------------------------------------------------------------------
// Checks

void check_cudnn_prefill(const cudnn_prefill_params& p) {
  if (p.num_seqs < 0) fail("num_seqs " + std::to_string(p.num_seqs) + " is negative");
  if (p.max_seq_tokens < 0) fail("max_seq_tokens " + std::to_string(p.max_seq_tokens) + " is negative");
  if (p.buffer_tokens < p.max_seq_tokens)
    fail("buffer_tokens " + std::to_string(p.buffer_tokens) + " is less than max_seq_tokens " +
         std::to_string(p.max_seq_tokens));
  if (p.buffer_tokens > std::numeric_limits<int>::max())
    fail("buffer_tokens " + std::to_string(p.buffer_tokens) + " exceeds 2^31-1 (token offsets are int)");
  if (p.hq <= 0 || p.hkv <= 0)
    fail("hq " + std::to_string(p.hq) + " and hkv " + std::to_string(p.hkv) + " must be positive");
  if (p.hq % p.hkv != 0) fail("hq " + std::to_string(p.hq) + " is not a multiple of hkv " + std::to_string(p.hkv));
  for (const auto& [name, d] : {std::pair{"dqk", p.dqk}, std::pair{"dv", p.dv}})
    if (d <= 0 || d % 8 != 0 || d > 256)
      fail(std::string("head dim ") + name + " " + std::to_string(d) + " must be a positive multiple of 8, at most 256");
  const struct {
    const char* name;
    idx value;
  } strides[] = {{"q_token_stride", p.q_token_stride}, {"q_head_stride", p.q_head_stride},
                 {"k_token_stride", p.k_token_stride}, {"k_head_stride", p.k_head_stride},
                 {"v_token_stride", p.v_token_stride}, {"v_head_stride", p.v_head_stride},
                 {"o_token_stride", p.o_token_stride}, {"o_head_stride", p.o_head_stride}};
  for (const auto& s : strides) {
    if (s.value < 0) fail(std::string(s.name) + " " + std::to_string(s.value) + " is negative");
    if (s.value % 8 != 0)
      fail(std::string(s.name) + " " + std::to_string(s.value) + " is not a multiple of 8 elements (16 bytes)");
  }
  if (!(std::isfinite(p.scale) && p.scale > 0.0f))
    fail("scale " + std::to_string(p.scale) + " must be finite and positive");
  if (p.num_seqs == 0) return;
  if (p.seq_offsets == nullptr) fail("seq_offsets is null with num_seqs " + std::to_string(p.num_seqs));
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr) fail("q, k, v or out is null");
  const auto misaligned = [](const void* ptr, std::uintptr_t bytes) {
    return reinterpret_cast<std::uintptr_t>(ptr) % bytes != 0;
  };
  if (misaligned(p.q, 16) || misaligned(p.k, 16) || misaligned(p.v, 16) || misaligned(p.out, 16))
    fail("q, k, v and out must be 16-byte aligned");
  if (misaligned(p.lse, 4)) fail("lse must be 4-byte aligned");
}

// ---------------------------------------------------------------------------
// cudnn_prefill

struct cudnn_prefill::impl {
  cudnnHandle_t handle = nullptr;
  mutable std::mutex mutex;
  std::map<plan_key, plan> plans;
  std::string last_refusal;

  /// The plan of p's key, built on first use (mutex held by the caller).
  const plan& plan_for(const cudnn_prefill_params& p) {
    const plan_key k = key_of(p);
    auto it = plans.find(k);
    if (it == plans.end()) {
      plan pl;
      try {
        pl = build_plan(handle, k);
      } catch (const std::exception& e) {  // the frontend's shim throws std::runtime_error
        throw cudnn_error("cudnn prefill: building the plan for " + describe(k) + " failed: " + e.what());
      }
      if (!pl.graph) pl.refusal = "cuDNN has no plan for " + describe(k) + ": " + pl.refusal;
      it = plans.emplace(k, std::move(pl)).first;
    }
    return it->second;
  }
};

bool cudnn_prefill::available() noexcept {
  try {
    return loader().ok;
  } catch (...) {
    return false;
  }
}

std::string cudnn_prefill::unavailable_reason() { return loader().reason; }

long cudnn_prefill::loaded_version() noexcept { return available() ? loader().version : 0; }

cudnn_prefill::cudnn_prefill() : impl_(std::make_unique<impl>()) {
  if (!loader().ok) throw cudnn_unavailable_error("cudnn prefill: " + loader().reason);
  cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
  try {
    status = fe::detail::create_handle(&impl_->handle);
  } catch (const std::exception& e) {
    throw cudnn_error(std::string("cudnn prefill: cudnnCreate failed: ") + e.what());
  }
  if (status != CUDNN_STATUS_SUCCESS)
    throw cudnn_error("cudnn prefill: cudnnCreate failed: " + std::string(fe::detail::get_error_string(status)) +
                      " (status " + std::to_string(int(status)) + ")");
}

cudnn_prefill::~cudnn_prefill() {
  if (impl_ && impl_->handle != nullptr) {
    impl_->plans.clear();  // plans before the handle they were built on
    try {
      (void)fe::detail::destroy_handle(impl_->handle);
    } catch (...) {
    }
  }
}

cudnn_prefill::cudnn_prefill(cudnn_prefill&&) noexcept = default;
cudnn_prefill& cudnn_prefill::operator=(cudnn_prefill&& other) noexcept {
  if (this != &other) {
    cudnn_prefill dying(std::move(*this));
    impl_ = std::move(other.impl_);
  }
  return *this;
}

bool cudnn_prefill::supported(const cudnn_prefill_params& p) {
  check_cudnn_prefill(p);
  std::lock_guard lock(impl_->mutex);
  const plan& pl = impl_->plan_for(p);
  if (!pl.graph) impl_->last_refusal = pl.refusal;
  return pl.graph != nullptr;
}

std::string cudnn_prefill::last_refusal() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->last_refusal;
}

std::size_t cudnn_prefill::workspace_bytes(const cudnn_prefill_params& p) {
  check_cudnn_prefill(p);
  std::lock_guard lock(impl_->mutex);
  const plan& pl = impl_->plan_for(p);
  if (!pl.graph) throw cudnn_unsupported_error("cudnn prefill: " + pl.refusal);
  return pl.aux.end + align_up(pl.cudnn_workspace_bytes, workspace_alignment_bytes);
}

std::size_t cudnn_prefill::cached_plans() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->plans.size();
}

void cudnn_prefill::run(const cudnn_prefill_params& p, void* workspace, std::size_t workspace_size_bytes,
                        cudaStream_t stream) {
  check_cudnn_prefill(p);
  if (p.num_seqs == 0 || p.max_seq_tokens == 0) return;
  std::lock_guard lock(impl_->mutex);
  const plan& pl = impl_->plan_for(p);
  if (!pl.graph) throw cudnn_unsupported_error("cudnn prefill: " + pl.refusal);
  const std::size_t need = pl.aux.end + align_up(pl.cudnn_workspace_bytes, workspace_alignment_bytes);
  if (workspace == nullptr || workspace_size_bytes < need)
    fail("workspace of " + std::to_string(workspace_size_bytes) + " bytes" + (workspace == nullptr ? " (null)" : "") +
         " is smaller than the " + std::to_string(need) + " bytes workspace_bytes() asks for this shape");
  if (reinterpret_cast<std::uintptr_t>(workspace) % workspace_alignment_bytes != 0)
    fail("workspace must be " + std::to_string(workspace_alignment_bytes) + "-byte aligned");

  const plan_key k = key_of(p);
  const idx token_strides[5] = {p.q_token_stride, p.k_token_stride, p.v_token_stride, p.o_token_stride, idx(p.hq)};
  cudnn_prefill_detail::launch_ragged_offsets(p.seq_offsets, p.num_seqs, k.batch, int(p.max_seq_tokens), token_strides,
                                              k.lse, k.offset_bytes, workspace, pl.aux, stream);

  auto* aux = static_cast<unsigned char*>(workspace);
  std::unordered_map<fe::graph::Tensor_attributes::uid_t, void*> pack = {
      {uid_q, const_cast<std::uint16_t*>(p.q)},
      {uid_k, const_cast<std::uint16_t*>(p.k)},
      {uid_v, const_cast<std::uint16_t*>(p.v)},
      {uid_o, p.out},
      {uid_q_off, aux + pl.aux.q_off},
      {uid_k_off, aux + pl.aux.k_off},
      {uid_v_off, aux + pl.aux.v_off},
      {uid_o_off, aux + pl.aux.o_off},
      {uid_seq_len_q, aux + pl.aux.seq_len},
      {uid_seq_len_kv, aux + pl.aux.seq_len}};
  if (k.lse) {
    pack[uid_stats] = p.lse;
    pack[uid_stats_off] = aux + pl.aux.lse_off;
  }
  void* cudnn_workspace = pl.cudnn_workspace_bytes > 0 ? aux + pl.aux.end : nullptr;
  try {
    if (const cudnnStatus_t s = fe::detail::set_stream(impl_->handle, stream); s != CUDNN_STATUS_SUCCESS)
      throw cudnn_error("cudnn prefill: cudnnSetStream failed: " + std::string(fe::detail::get_error_string(s)));
    if (auto e = pl.graph->execute(impl_->handle, pack, cudnn_workspace); e.is_bad())
      throw cudnn_error("cudnn prefill: execute failed for " + describe(k) + ": " + e.get_message());
  } catch (const cudnn_error&) {
    throw;
  } catch (const std::exception& e) {
    throw cudnn_error("cudnn prefill: execute failed for " + describe(k) + ": " + e.what());
  }
}

}  // namespace ws_moe::gpu
