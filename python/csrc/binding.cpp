// SPDX-License-Identifier: Apache-2.0
// python/csrc/binding.cpp — the torch library `writescope` (docs/PYTHON.md):
// the custom class torch.classes.writescope.Cache (one inplace_kv_cache with
// its hybrid_attention) and the tensor ops on it, registered with
// TORCH_LIBRARY so that they go through torch's dispatcher:
//
//   writescope::append_prefill(Cache cache, int layer, int seq, Tensor k, Tensor? v) -> ()
//   writescope::append_prefill_batch(Cache cache, int layer, int[] seqs, int[] first_tokens, Tensor k, Tensor? v) -> ()
//   writescope::append(Cache cache, int layer, int[] seqs, Tensor k, Tensor? v) -> ()
//   writescope::decode_attention(Cache cache, int layer, int[] seqs, Tensor q, float scale) -> (Tensor, Tensor)
//   writescope::mla_decode_attention(Cache cache, int layer, int[] seqs, Tensor query, Tensor w_uk, Tensor w_uv_t,
//                                    float scale) -> Tensor
//   writescope::flush(Cache cache) -> int[]
//
// Errors: the library's typed exceptions leave here as c10 errors whose
// message starts with "[writescope.<Name>] " (ValueError for config and shape
// errors, RuntimeError otherwise); the Python package turns them into
// writescope.<Name> exceptions carrying the library's message.
#include <Python.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <mutex>
#include <string>

#include "engine.hpp"

#ifndef WRITESCOPE_PY_BUILD_INFO
#  define WRITESCOPE_PY_BUILD_INFO "unknown"
#endif

namespace writescope_py {
namespace {

[[noreturn]] void raise_tagged(const char* name, const std::string& what, bool value_error) {
  const std::string msg = std::string("[writescope.") + name + "] " + what;
  const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  if (value_error) throw c10::ValueError(loc, msg);
  throw c10::Error(loc, msg);
}

/// Runs f, turning writescope's exceptions into tagged c10 errors (most
/// derived first).
template <class F>
decltype(auto) guarded(F&& f) {
  try {
    return f();
  } catch (const ws::config_error& e) {
    raise_tagged("ConfigError", e.what(), true);
  } catch (const ws::shape_error& e) {
    raise_tagged("ShapeError", e.what(), true);
  } catch (const ws::state_error& e) {
    raise_tagged("StateError", e.what(), false);
  } catch (const ws::capacity_error& e) {
    raise_tagged("CapacityError", e.what(), false);
  } catch (const ws::pinned_memory_error& e) {
    raise_tagged("PinnedMemoryError", e.what(), false);
  } catch (const ws::resource_error& e) {
    raise_tagged("ResourceError", e.what(), false);
  } catch (const ws::cuda_error& e) {
    raise_tagged("CudaError", e.what(), false);
  } catch (const ws::checkpoint_error& e) {
    raise_tagged("CheckpointError", e.what(), false);
  } catch (const ws::error& e) {
    raise_tagged("Error", e.what(), false);
  } catch (const std::bad_alloc&) {
    raise_tagged("ResourceError", "out of host memory (std::bad_alloc)", false);
  }
}

/// Reads the constructor's dictionaries into an engine_config; every key must
/// be known (a misspelt option is a ConfigError, not a silent default).
engine_config parse_config(const std::string& layout, const std::string& policy, const std::string& backend,
                           const c10::Dict<std::string, int64_t>& ints, const c10::Dict<std::string, double>& reals) {
  engine_config c;
  c.layout = layout;
  ws::partition_spec& s = c.spec;
  ws::roofline_params rp;
  double cpu_share = -1.0;
  for (const auto& kv : ints) {
    const std::string& k = kv.key();
    const int64_t v = kv.value();
    auto as_int = [&] { return detail::to_int(v, k.c_str()); };
    if (k == "num_q_heads") c.num_q_heads = as_int();
    else if (k == "num_kv_heads") c.num_kv_heads = as_int();
    else if (k == "head_dim") c.head_dim = as_int();
    else if (k == "kv_lora_rank") c.kv_lora_rank = as_int();
    else if (k == "rope_dim") c.rope_dim = as_int();
    else if (k == "num_layers") s.num_layers = as_int();
    else if (k == "block_tokens") s.block_tokens = as_int();
    else if (k == "d_window_tokens") s.d_window_tokens = as_int();
    else if (k == "max_sequences") s.max_sequences = as_int();
    else if (k == "cpu_capacity_tokens") s.cpu_capacity_tokens = v;
    else if (k == "pinned_capacity_tokens") s.pinned_capacity_tokens = v;
    else if (k == "hbm_capacity_tokens") s.hbm_capacity_tokens = v;
    else if (k == "pinned_initial_tokens") s.pinned_initial_tokens = v;
    else if (k == "pinned_growth_tokens") s.pinned_growth_tokens = v;
    else if (k == "ping_pong_bytes") s.ping_pong_bytes = v;
    else if (k == "ping_pong_buffers") s.ping_pong_buffers = as_int();
    else if (k == "first_chunk_bytes") s.first_chunk_bytes = v;
    else if (k == "gpu_split_blocks") s.gpu_split_blocks = as_int();
    else if (k == "cpu_task_blocks") s.cpu_task_blocks = as_int();
    else if (k == "cpu_threads") c.options.cpu_threads = as_int();
    else if (k == "task_workspace_reserve_bytes") c.options.task_workspace_reserve_bytes = v;
    else if (k == "poison") c.poison = v != 0;
    else if (k == "all_gpu_steps") c.options.all_gpu_steps = v != 0;
    else if (k == "cost_window_samples") rp.cost_window_samples = as_int();
    else if (k == "track_gpu_cost") rp.track_gpu_cost = v != 0;
    else if (k == "track_launch_cost") rp.track_launch_cost = v != 0;
    else if (k == "track_hbm_cost") rp.track_hbm_cost = v != 0;
    else if (k == "deferred_host_write_bytes") c.deferred_host_write_bytes = v;
    else if (k == "staging_bytes") c.staging_bytes = v;
    else if (k == "resident_kernel") c.resident_kernel = v != 0;
    else if (k == "cpu_prefault_tokens") c.cpu_prefault_tokens = v;
    else throw ws::config_error("Cache: unknown integer option '" + k + "'");
  }
  for (const auto& kv : reals) {
    const std::string& k = kv.key();
    const double v = kv.value();
    if (k == "cpu_share") cpu_share = v;
    else if (k == "cpu_cost_per_token_seconds") rp.cpu_cost_per_token_seconds = v;
    else if (k == "gpu_cost_per_token_seconds") rp.gpu_cost_per_token_seconds = v;
    else if (k == "cpu_fixed_seconds") rp.cpu_fixed_seconds = v;
    else if (k == "gpu_fixed_seconds") rp.gpu_fixed_seconds = v;
    else if (k == "placement_headroom") rp.placement_headroom = v;
    else if (k == "placement_headroom_z") rp.placement_headroom_z = v;
    else if (k == "launch_cost_per_token_seconds") rp.launch_cost_per_token_seconds = v;
    else if (k == "hbm_cost_per_token_seconds") rp.hbm_cost_per_token_seconds = v;
    else throw ws::config_error("Cache: unknown float option '" + k + "'");
  }
  // The library rounds the HBM region down to whole eviction batches; here a capacity that is
  // not one is refused, so that the region is the size asked for.
  if (s.hbm_capacity_tokens < 0 || (s.d_window_tokens > 0 && s.hbm_capacity_tokens % s.d_window_tokens != 0))
    throw ws::config_error("Cache: hbm_capacity_tokens = " + std::to_string(s.hbm_capacity_tokens) +
                           " must be >= 0 and a whole number of eviction batches (a multiple of d_window_tokens = " +
                           std::to_string(s.d_window_tokens) + "); 0: no HBM-resident region");
  if (policy == "roofline") c.policy.p = ws::roofline_policy(rp);
  else if (policy == "fixed_ratio") c.policy.p = ws::fixed_ratio(cpu_share);
  else if (policy == "gpu_only") c.policy.p = ws::gpu_only{};
  else if (policy == "cpu_only") c.policy.p = ws::cpu_only{};
  else throw ws::config_error("Cache: policy '" + policy + "' is not supported; supported: roofline, fixed_ratio, gpu_only, cpu_only");
  if (backend != "host" && backend != "cuda")
    throw ws::config_error("Cache: backend '" + backend + "' is not supported; supported: host, cuda");
  return c;
}

template <class V>
c10::Dict<std::string, V> to_dict(const std::vector<std::pair<std::string, V>>& v) {
  c10::Dict<std::string, V> d;
  for (const auto& [k, x] : v) d.insert(k, x);
  return d;
}

}  // namespace

/// torch.classes.writescope.Cache: owns one engine. Calls are serialized by a
/// mutex (the library drives a cache from one thread at a time).
struct Cache : torch::CustomClassHolder {
  Cache(const std::string& layout, const std::string& policy, const std::string& backend,
        const c10::Dict<std::string, int64_t>& ints, const c10::Dict<std::string, double>& reals)
      : backend_name(backend) {
    guarded([&] {
      const engine_config c = parse_config(layout, policy, backend, ints, reals);
      impl = backend == "cuda" ? make_cuda_engine(c) : make_host_engine(c);
    });
  }
  template <class F>
  decltype(auto) locked(F&& f) {
    std::lock_guard lk(mu);
    return guarded(std::forward<F>(f));
  }
  std::mutex mu;
  std::string backend_name;
  std::unique_ptr<engine> impl;
};

namespace {

void op_validate_layout(const std::string& kind, int64_t hq, int64_t hkv, int64_t a, int64_t b) {
  guarded([&] {
    engine_config c;
    c.layout = kind;
    c.num_q_heads = detail::to_int(hq, "num_q_heads");
    c.num_kv_heads = detail::to_int(hkv, "num_kv_heads");
    c.head_dim = c.kv_lora_rank = detail::to_int(a, kind == "mla" ? "kv_lora_rank" : "head_dim");
    c.rope_dim = detail::to_int(b, "rope_dim");
    validate_layout(c);
  });
}

void op_append_prefill(const c10::intrusive_ptr<Cache>& c, int64_t layer, int64_t seq, const at::Tensor& k,
                       const std::optional<at::Tensor>& v) {
  c->locked([&] { c->impl->append_prefill(layer, seq, k, v); });
}
void op_append_prefill_batch(const c10::intrusive_ptr<Cache>& c, int64_t layer, std::vector<int64_t> seqs,
                             std::vector<int64_t> first_tokens, const at::Tensor& k, const std::optional<at::Tensor>& v) {
  c->locked([&] { c->impl->append_prefill_batch(layer, seqs, first_tokens, k, v); });
}
void op_append(const c10::intrusive_ptr<Cache>& c, int64_t layer, std::vector<int64_t> seqs, const at::Tensor& k,
               const std::optional<at::Tensor>& v) {
  c->locked([&] { c->impl->append(layer, seqs, k, v); });
}
std::tuple<at::Tensor, at::Tensor> op_decode_attention(const c10::intrusive_ptr<Cache>& c, int64_t layer,
                                                       std::vector<int64_t> seqs, const at::Tensor& q, double scale) {
  return c->locked([&] { return c->impl->attention(layer, seqs, q, scale); });
}
/// Absorbed MLA decode attention from the model's query (docs/PYTHON.md): q' =
/// q_nope·W_UK ‖ q_pe per head, the cache's attention over the latent rows, the
/// output W_UV per head. query [batch, heads, 1, nope + rope] (any float dtype,
/// the cache's device), w_uk [heads, nope, rank] and w_uv_t [heads, rank, v]
/// float32 on the same device; returns [batch, 1, heads, v] in query's dtype.
/// One call from Python instead of the eight tensor ops around decode_attention.
at::Tensor op_mla_decode_attention(const c10::intrusive_ptr<Cache>& c, int64_t layer, std::vector<int64_t> seqs,
                                   const at::Tensor& query, const at::Tensor& w_uk, const at::Tensor& w_uv_t,
                                   double scale) {
  const auto shape = [](const at::Tensor& t) {
    std::string s = "[";
    for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + "]";
  };
  guarded([&] {
    if (query.dim() != 4 || query.size(2) != 1)
      throw ws::shape_error("mla_decode_attention: query " + shape(query) + " is not [batch, heads, 1, nope + rope]");
    const int64_t h = query.size(1);
    if (w_uk.dim() != 3 || w_uk.size(0) != h || w_uk.size(1) >= query.size(3) || w_uk.scalar_type() != at::kFloat)
      throw ws::shape_error("mla_decode_attention: w_uk " + shape(w_uk) + " (" + std::string(c10::toString(w_uk.scalar_type())) +
                            ") is not float32 [" + std::to_string(h) + ", nope < " + std::to_string(query.size(3)) +
                            ", rank]");
    if (w_uv_t.dim() != 3 || w_uv_t.size(0) != h || w_uv_t.size(1) != w_uk.size(2) ||
        w_uv_t.scalar_type() != at::kFloat)
      throw ws::shape_error("mla_decode_attention: w_uv_t " + shape(w_uv_t) + " (" +
                            std::string(c10::toString(w_uv_t.scalar_type())) + ") is not float32 [" +
                            std::to_string(h) + ", " + std::to_string(w_uk.size(2)) + ", v]");
    if (w_uk.device() != query.device() || w_uv_t.device() != query.device())
      throw ws::shape_error("mla_decode_attention: query on " + query.device().str() + ", w_uk on " +
                            w_uk.device().str() + ", w_uv_t on " + w_uv_t.device().str() + ": one device");
  });
  const int64_t nope = w_uk.size(1);
  const at::Tensor q = query.select(2, 0).to(at::kFloat);                    // [batch, heads, nope + rope]
  const at::Tensor q_lat = at::bmm(q.narrow(2, 0, nope).transpose(0, 1), w_uk);  // [heads, batch, rank]
  const at::Tensor qp = at::cat({q_lat.transpose(0, 1), q.narrow(2, nope, q.size(2) - nope)}, 2);
  const at::Tensor out = std::get<0>(c->locked([&] { return c->impl->attention(layer, seqs, qp, scale); }));
  return at::bmm(out.transpose(0, 1), w_uv_t).transpose(0, 1).to(query.scalar_type()).unsqueeze(1);
}
std::vector<int64_t> op_flush(const c10::intrusive_ptr<Cache>& c) {
  return c->locked([&] { return c->impl->flush(); });
}

}  // namespace
}  // namespace writescope_py

TORCH_LIBRARY(writescope, m) {
  using writescope_py::Cache;
  m.class_<Cache>("Cache")
      .def(torch::init<std::string, std::string, std::string, c10::Dict<std::string, int64_t>,
                       c10::Dict<std::string, double>>())
      .def("begin_sequence",
           [](const c10::intrusive_ptr<Cache>& c, int64_t prompt_tokens) {
             return c->locked([&] { return c->impl->begin_sequence(prompt_tokens); });
           })
      .def("end_sequence",
           [](const c10::intrusive_ptr<Cache>& c, int64_t seq) { c->locked([&] { c->impl->end_sequence(seq); }); })
      .def("announce_admission",
           [](const c10::intrusive_ptr<Cache>& c, int64_t tokens) {
             c->locked([&] { c->impl->announce_admission(tokens); });
           })
      .def("usage",
           [](const c10::intrusive_ptr<Cache>& c) {
             return c->locked([&] { return writescope_py::to_dict(c->impl->usage()); });
           })
      .def("sequence",
           [](const c10::intrusive_ptr<Cache>& c, int64_t seq) {
             return c->locked([&] { return writescope_py::to_dict(c->impl->sequence(seq)); });
           })
      .def("last_step",
           [](const c10::intrusive_ptr<Cache>& c) {
             return c->locked([&] { return writescope_py::to_dict(c->impl->last_step()); });
           })
      .def("policy_state",
           [](const c10::intrusive_ptr<Cache>& c) {
             return c->locked([&] { return writescope_py::to_dict(c->impl->policy_state()); });
           })
      .def("read_token",
           [](const c10::intrusive_ptr<Cache>& c, int64_t layer, int64_t seq, int64_t position) {
             return c->locked([&] { return c->impl->read_token(layer, seq, position); });
           })
      .def("complete_host_writes",
           [](const c10::intrusive_ptr<Cache>& c) { c->locked([&] { c->impl->complete_host_writes(); }); })
      .def("describe",
           [](const c10::intrusive_ptr<Cache>& c) { return c->locked([&] { return c->impl->describe(); }); })
      .def("backend", [](const c10::intrusive_ptr<Cache>& c) { return c->backend_name; });

  m.def("append_prefill(__torch__.torch.classes.writescope.Cache cache, int layer, int seq, Tensor k, Tensor? v) -> ()",
        &writescope_py::op_append_prefill);
  m.def(
      "append_prefill_batch(__torch__.torch.classes.writescope.Cache cache, int layer, int[] seqs, int[] first_tokens, "
      "Tensor k, Tensor? v) -> ()",
      &writescope_py::op_append_prefill_batch);
  m.def("append(__torch__.torch.classes.writescope.Cache cache, int layer, int[] seqs, Tensor k, Tensor? v) -> ()",
        &writescope_py::op_append);
  m.def(
      "decode_attention(__torch__.torch.classes.writescope.Cache cache, int layer, int[] seqs, Tensor q, float scale) "
      "-> (Tensor, Tensor)",
      &writescope_py::op_decode_attention);
  m.def(
      "mla_decode_attention(__torch__.torch.classes.writescope.Cache cache, int layer, int[] seqs, Tensor query, "
      "Tensor w_uk, Tensor w_uv_t, float scale) -> Tensor",
      &writescope_py::op_mla_decode_attention);
  m.def("flush(__torch__.torch.classes.writescope.Cache cache) -> int[]", &writescope_py::op_flush);
  m.def("validate_layout(str kind, int num_q_heads, int num_kv_heads, int row, int rope_dim=0) -> ()",
        &writescope_py::op_validate_layout);
  m.def("cuda_built() -> bool", [] { return writescope_py::cuda_built(); });
  m.def("build_info() -> str", [] { return std::string(WRITESCOPE_PY_BUILD_INFO); });
}

// `import writescope._C` loads this library (and so runs the registrations
// above); the module itself is empty: everything is reached through torch.ops
// and torch.classes.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
