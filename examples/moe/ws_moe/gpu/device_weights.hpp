// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/device_weights.hpp — the model's weights for the CUDA path:
// matrices on the device in the checkpoint's precision (BF16 stays bf16; F16
// and F32 are widened exactly to fp32), routers always fp32, norms and biases
// fp32; routed experts either on the device or — when they do not fit the
// --vram-budget — in host memory (bf16, or fp32 for F16/F32 checkpoints), run
// by the CPU.
//
// Checkpoint tensors are copied from the memory-mapped file to the device one
// at a time (nothing but the current tensor passes through host memory, and a
// BF16 tensor not even that: it is copied straight from the mapping).
// --random-weights tensors are generated on the device by a counter-based
// kernel (gpu::random_op), element i of tensor `name` being the same value the
// host path generates (weights.hpp), rounded to bf16; host-resident random
// experts are generated on the host with the same function.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../checkpoint.hpp"
#include "../model_config.hpp"
#include "../weights.hpp"
#include "kernel_math.hpp"

namespace ws_moe::gpu {

/// A row-major [rows][cols] matrix in device memory, bf16 or fp32.
struct dmat {
  const void* p = nullptr;
  wtype type = wtype::bf16;
  idx rows = 0, cols = 0;
  [[nodiscard]] idx bytes() const noexcept { return rows * cols * type_bytes(type); }
};

/// y = x·Wᵀ (+ bias): W [out][in] on the device, bias fp32 [out] or null.
struct dlinear {
  dmat w;
  const float* bias = nullptr;
};

/// down(silu(gate x) · up x) on the device.
struct dmlp {
  dlinear gate, up, down;
};

/// A row-major [rows][cols] matrix in host memory: bf16 bits, or fp32 (F16/F32
/// checkpoints). A view: the bytes live in the decoder's host expert arena
/// (page-locked under CUDA, so the prefill can stream them to the device).
struct hmat {
  const std::uint16_t* bf16 = nullptr;
  const float* f32 = nullptr;
  idx rows = 0, cols = 0;
  [[nodiscard]] idx bytes() const noexcept { return rows * cols * (f32 != nullptr ? 4 : 2); }
  [[nodiscard]] bool is_bf16() const noexcept { return f32 == nullptr; }
  [[nodiscard]] const void* data() const noexcept {
    return f32 != nullptr ? static_cast<const void*>(f32) : static_cast<const void*>(bf16);
  }
  /// Row r widened to fp32 into `out` [cols].
  void widen_row(idx r, float* out) const {
    if (f32 != nullptr) {
      std::memcpy(out, f32 + r * cols, std::size_t(cols) * 4);
      return;
    }
    const std::uint16_t* b = bf16 + r * cols;
    for (idx i = 0; i < cols; ++i) out[i] = bf16_to_float(b[i]);
  }
};

/// A SiLU-gated expert in host memory: gate [inter][hidden], up [inter][hidden],
/// down [hidden][inter], contiguous in that order (one block of the arena, so one
/// copy moves the whole expert to the device).
struct hmlp {
  hmat gate, up, down;
  [[nodiscard]] const void* data() const noexcept { return gate.data(); }
  [[nodiscard]] idx bytes() const noexcept { return gate.bytes() + up.bytes() + down.bytes(); }
  [[nodiscard]] bool is_bf16() const noexcept { return gate.f32 == nullptr; }
};

/// One decoder layer. GQA uses q, k, v, o (+ q_norm, k_norm for Qwen3); MLA
/// uses q (or q_a, q_a_norm, q_b), kv_a, kv_a_norm, kv_b, o.
struct dlayer {
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;
  dlinear q, k, v, o;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  dlinear q_a, q_b, kv_a;
  const float* q_a_norm = nullptr;
  const float* kv_a_norm = nullptr;
  dmat kv_b;                         ///< [H*(nope+v)][rank]: W_UK ‖ W_UV per head
  const float* kv_b_f32 = nullptr;   ///< fp32 copy of a bf16 kv_b (fp32 GEMM precision only)
  bool is_moe = false;
  dmlp dense;                        ///< dense MLP (non-MoE layers)
  dlinear router;                    ///< [E][hidden], fp32
  std::vector<dmlp> experts;         ///< [E]; empty matrices for host experts
  std::vector<char> on_host;         ///< [E]: expert kept in host memory
  std::vector<hmlp> host_experts;    ///< [E]; filled for host experts only
  /// Device array [3][E] of the experts' gate, up and down weight pointers
  /// (null for host experts) for the grouped kernels; null when not built.
  const void* const* expert_tables = nullptr;
  bool has_shared = false;
  dmlp shared;                       ///< DeepSeek shared experts
};

struct dmodel {
  dmat embed;  ///< [vocab][hidden]
  std::vector<dlayer> layers;
  const float* final_norm = nullptr;
  dlinear lm_head;  ///< [vocab][hidden] (the embedding when tied)
};

/// Bytes and element type a routed expert takes on the device, from the
/// checkpoint's first expert (bf16 for random weights).
inline idx expert_bytes(const model_config& c, const weight_source& src, int first_moe_layer) {
  const idx elems = 3 * idx(c.hidden_size) * c.moe_intermediate_size;
  if (src.is_random() || first_moe_layer < 0) return elems * 2;
  const std::string p = "model.layers." + std::to_string(first_moe_layer) +
                        (c.kind == arch::mixtral ? ".block_sparse_moe.experts.0.w1.weight" : ".mlp.experts.0.gate_proj.weight");
  const checkpoint* ck = src.ckpt();
  return ck->contains(p) && ck->tensor(p).type == dtype::bf16 ? elems * 2 : elems * 4;
}

/// The checkpoint names of expert `e` of layer `l`: {gate, up, down} prefixes.
struct expert_names {
  std::string gate, up, down;
};
inline expert_names names_of_expert(const model_config& c, int l, int e) {
  const std::string p = "model.layers." + std::to_string(l);
  if (c.kind == arch::mixtral) {
    const std::string m = p + ".block_sparse_moe.experts." + std::to_string(e);
    return {m + ".w1", m + ".w3", m + ".w2"};
  }
  const std::string m = p + ".mlp.experts." + std::to_string(e);
  return {m + ".gate_proj", m + ".up_proj", m + ".down_proj"};
}

/// Loads tensors onto the device through an executor (cuda_exec or
/// emulated_exec), counting the bytes it allocates.
template <class Exec>
class device_loader {
 public:
  device_loader(Exec& x, const weight_source& src) : x_(&x), src_(&src) {}

  /// A matrix "<name>" [rows][cols] in its checkpoint precision (random: bf16);
  /// force_f32: fp32 whatever the checkpoint holds (routers).
  dmat matrix(const std::string& name, idx rows, idx cols, bool force_f32 = false) {
    dmat m;
    m.rows = rows;
    m.cols = cols;
    const std::int64_t shape[2] = {rows, cols};
    if (src_->is_random()) {
      m.type = force_f32 ? wtype::f32 : wtype::bf16;
      void* p = alloc(m.bytes(), name);
      x_->run(random_op{p, m.type, src_->name_hash(name), src_->random_scale()}, rows * cols);
      m.p = p;
      return m;
    }
    const tensor_view& v = src_->ckpt()->checked(name, std::span<const std::int64_t>(shape, 2));
    if (v.type == dtype::bf16 && !force_f32) {
      m.type = wtype::bf16;
      void* p = alloc(m.bytes(), name);
      x_->h2d(p, v.data, idx(v.bytes));
      m.p = p;
    } else {
      const std::vector<float> f = src_->ckpt()->load_f32(name, std::span<const std::int64_t>(shape, 2));
      m.type = wtype::f32;
      void* p = alloc(m.bytes(), name);
      x_->h2d(p, f.data(), m.bytes());
      m.p = p;
    }
    return m;
  }

  /// "<prefix>.weight" [out][in] (+ "<prefix>.bias" [out] when `bias`).
  dlinear linear(const std::string& prefix, idx out, idx in, bool bias = false, bool force_f32 = false) {
    dlinear l;
    l.w = matrix(prefix + ".weight", out, in, force_f32);
    if (bias) l.bias = vector(prefix + ".bias", out, 0.0f);
    return l;
  }

  dmlp mlp(const expert_names& n, idx hidden, idx inter) {
    return {linear(n.gate, inter, hidden), linear(n.up, inter, hidden), linear(n.down, hidden, inter)};
  }

  /// An fp32 vector [n] (norm weights, biases); random mode: `random_value` everywhere.
  const float* vector(const std::string& name, idx n, float random_value) {
    float* p = static_cast<float*>(alloc(n * 4, name));
    if (src_->is_random()) {
      x_->run(fill_op{p, random_value}, n);
    } else {
      const std::vector<float> f = src_->ckpt()->load_f32(name, {std::int64_t(n)});
      x_->h2d(p, f.data(), n * 4);
    }
    return p;
  }

  /// Host bytes an expert takes in the host arena (bf16 for BF16 and random
  /// tensors, fp32 for F16/F32 ones; the three matrices contiguous).
  [[nodiscard]] idx host_expert_bytes(const expert_names& n, idx hidden, idx inter) const {
    return 3 * hidden * inter * (host_is_bf16(n) ? 2 : 4);
  }

  /// Whether the expert is kept as bf16 in host memory: random weights, or all
  /// three matrices BF16 in the checkpoint (otherwise all three are fp32).
  [[nodiscard]] bool host_is_bf16(const expert_names& n) const {
    if (src_->is_random()) return true;
    for (const std::string* t : {&n.gate, &n.up, &n.down}) {
      const std::string name = *t + ".weight";
      if (!src_->ckpt()->contains(name) || src_->ckpt()->tensor(name).type != dtype::bf16) return false;
    }
    return true;
  }

  /// A matrix kept in host memory (CPU or streamed experts), written to `dst`
  /// (host memory of at least rows*cols elements of the returned type): bf16
  /// bits for BF16 and random tensors, fp32 for F16/F32 ones.
  hmat host_matrix(const std::string& name, idx rows, idx cols, void* dst, bool as_bf16) {
    hmat m;
    m.rows = rows;
    m.cols = cols;
    const idx n = rows * cols;
    if (src_->is_random()) {
      const std::uint64_t h = src_->name_hash(name);
      const float scale = src_->random_scale();
      std::uint16_t* out = static_cast<std::uint16_t*>(dst);
#pragma omp parallel for schedule(static)
      for (idx i = 0; i < n; ++i) out[i] = float_to_bf16(random_weight(h, i, scale));
      m.bf16 = out;
      return m;
    }
    const std::int64_t shape[2] = {rows, cols};
    const tensor_view& v = src_->ckpt()->checked(name, std::span<const std::int64_t>(shape, 2));
    if (v.type == dtype::bf16 && as_bf16) {
      std::memcpy(dst, v.data, std::size_t(n) * 2);
      m.bf16 = static_cast<const std::uint16_t*>(dst);
    } else {
      const std::vector<float> f = src_->ckpt()->load_f32(name, std::span<const std::int64_t>(shape, 2));
      std::memcpy(dst, f.data(), std::size_t(n) * 4);
      m.f32 = static_cast<const float*>(dst);
    }
    return m;
  }

  /// An expert into `dst` (host_expert_bytes(n, hidden, inter) bytes): gate, up, down.
  hmlp host_mlp(const expert_names& n, idx hidden, idx inter, void* dst) {
    auto* b = static_cast<std::byte*>(dst);
    const bool bf = host_is_bf16(n);
    const idx es = bf ? 2 : 4;
    hmlp m;
    m.gate = host_matrix(n.gate + ".weight", inter, hidden, b, bf);
    m.up = host_matrix(n.up + ".weight", inter, hidden, b + inter * hidden * es, bf);
    m.down = host_matrix(n.down + ".weight", hidden, inter, b + 2 * inter * hidden * es, bf);
    return m;
  }

  /// Bytes allocated so far by this loader.
  [[nodiscard]] idx bytes() const noexcept { return bytes_; }

  /// Sub-allocate the following device tensors from [base, base + bytes)
  /// (256-byte aligned) instead of one cudaMalloc each: the routed experts
  /// live in one slab, so the allocator's 2 MiB granularity costs nothing per
  /// matrix. Throws std::logic_error when the slab is exhausted. A null base
  /// returns to one allocation per tensor.
  void use_slab(void* base, idx bytes) {
    slab_ = static_cast<std::byte*>(base);
    slab_left_ = base != nullptr ? bytes : 0;
  }
  /// Bytes a tensor of `bytes` takes in a slab.
  static constexpr idx slab_bytes(idx bytes) noexcept { return (bytes + 255) / 256 * 256; }

 private:
  void* alloc(idx bytes, const std::string& what) {
    bytes_ += bytes;
    if (slab_ == nullptr) return x_->alloc(bytes, what.c_str());
    const idx take = slab_bytes(bytes);
    if (take > slab_left_) throw std::logic_error("device_loader: expert slab exhausted at " + what);
    void* p = slab_;
    slab_ += take;
    slab_left_ -= take;
    return p;
  }

  Exec* x_;
  const weight_source* src_;
  idx bytes_ = 0;
  std::byte* slab_ = nullptr;
  idx slab_left_ = 0;
};

}  // namespace ws_moe::gpu
