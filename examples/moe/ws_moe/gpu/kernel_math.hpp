// SPDX-License-Identifier: Apache-2.0
// ws_moe/gpu/kernel_math.hpp — the element-level math of the CUDA path's model
// kernels, written once as host+device functors so that the very same code runs
// in the CUDA kernels (ops.cu, nvcc) and in the host emulation of the CUDA path
// (emulated_exec.hpp, g++; `ws_decode --device emulated`, tested in CI where no
// GPU exists).
//
// Every functor is a plain aggregate of parameters (pointers are device memory
// under the CUDA executor, host memory under the emulated one) with
//   void operator()(idx i) const     element i of [0, size) — independent of every other i
// A CUDA launch runs i over a grid-stride loop; the emulation runs it in an
// OpenMP loop. Row reductions (RMSNorm, the prefill softmax) have a parameter
// block and a per-row "finish" helper here; their reductions are written twice
// (a block reduction in ops.cu, a sequential loop in the emulation).
//
// Numerics follow the host path (ops.hpp, moe.hpp), which follows transformers
// in float32: RMSNorm's mean square and the router's softmax sums in double,
// RoPE angles in fp32 with cos/sin in double, SiLU x/(1+exp(-x)) in fp32.
//
// nvcc constraints: no std:: containers, no concepts, no device
// lambdas; only <cstdint>, <cmath>, <cstring>.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#  define WS_MOE_HD __host__ __device__
#else
#  define WS_MOE_HD
#endif

namespace ws_moe::gpu {

using idx = std::int64_t;

/// Element type of a weight or GEMM operand. Activations are always fp32 in
/// memory; GEMM inputs are bf16 or fp32 (docs/DECODER-INTERNALS.md, precision).
enum class wtype : int { bf16 = 0, f32 = 1 };

[[nodiscard]] WS_MOE_HD inline int type_bytes(wtype t) { return t == wtype::bf16 ? 2 : 4; }

// -----------------------------------------------------------------------------
// Scalars
// -----------------------------------------------------------------------------

[[nodiscard]] WS_MOE_HD inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

[[nodiscard]] WS_MOE_HD inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// bf16 bits -> float, exact.
[[nodiscard]] WS_MOE_HD inline float bf16_to_float(std::uint16_t b) { return bits_float(std::uint32_t(b) << 16); }

/// float -> bf16 bits, round to nearest even, NaN stays NaN (writescope::bf16::from_float).
[[nodiscard]] WS_MOE_HD inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x0040u);
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// Element i of a weight tensor of type t.
[[nodiscard]] WS_MOE_HD inline float load_as_float(const void* p, wtype t, idx i) {
  return t == wtype::bf16 ? bf16_to_float(static_cast<const std::uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

/// Stores v as element i of a tensor of type t (bf16: rounded to nearest even).
WS_MOE_HD inline void store_from_float(void* p, wtype t, idx i, float v) {
  if (t == wtype::bf16)
    static_cast<std::uint16_t*>(p)[i] = float_to_bf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

[[nodiscard]] WS_MOE_HD inline float silu(float x) { return x / (1.0f + expf(-x)); }

/// splitmix64 finaliser: the counter-based generator of --random-weights
/// (weights.hpp, weight_source), the same on host and device.
[[nodiscard]] WS_MOE_HD inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Element i of a random tensor whose name hashes to `h`: an Irwin-Hall sum of
/// four 16-bit uniforms of one 64-bit hash, centred, times `scale`
/// (= stddev * sqrt(3) / 65536). Bit-identical on host and device (one exact
/// subtraction, one rounding multiply).
[[nodiscard]] WS_MOE_HD inline float random_weight(std::uint64_t h, idx i, float scale) {
  const std::uint64_t r = mix64(h + std::uint64_t(i));
  const std::uint32_t sum = std::uint32_t(r & 0xffffu) + std::uint32_t((r >> 16) & 0xffffu) +
                            std::uint32_t((r >> 32) & 0xffffu) + std::uint32_t(r >> 48);
  return (float(sum) - 2.0f * 65535.0f) * scale;
}

// -----------------------------------------------------------------------------
// Element-wise functors (size given at the launch)
// -----------------------------------------------------------------------------

/// x[t][e] = table[ids[t]][e] (fp32). Size n * hidden.
struct embed_op {
  const void* table;
  wtype type;
  const int* ids;
  int hidden;
  float* x;
  WS_MOE_HD void operator()(idx i) const {
    const idx t = i / hidden;
    const idx e = i - t * hidden;
    x[i] = load_as_float(table, type, idx(ids[t]) * hidden + e);
  }
};

/// Rotary embedding in place at x + t*token_stride + h*head_stride, rotated
/// width `dim` (pairs (j, j+dim/2), or (2j, 2j+1) when interleaved), position
/// pos[t]; cos/sin times attention_factor (YaRN). Size n * heads * dim/2.
struct rope_op {
  float* x;
  int heads;
  idx token_stride;
  idx head_stride;
  const idx* pos;
  const float* inv_freq;  ///< [dim/2]
  int dim;
  float attention_factor;
  int interleaved;
  WS_MOE_HD void operator()(idx i) const {
    const int half = dim / 2;
    const idx th = i / half;
    const int j = int(i - th * half);
    const idx t = th / heads;
    const int h = int(th - t * heads);
    const float angle = float(pos[t]) * inv_freq[j];  // fp32 like torch
    const float c = float(cos(double(angle))) * attention_factor;
    const float s = float(sin(double(angle))) * attention_factor;
    float* v = x + t * token_stride + idx(h) * head_stride;
    const int ia = interleaved ? 2 * j : j;
    const int ib = interleaved ? 2 * j + 1 : j + half;
    const float a = v[ia];
    const float b = v[ib];
    v[ia] = a * c - b * s;
    v[ib] = b * c + a * s;
  }
};

/// g = silu(g) * u. Size n.
struct silu_mul_op {
  float* g;
  const float* u;
  WS_MOE_HD void operator()(idx i) const { g[i] = silu(g[i]) * u[i]; }
};

/// x += y. Size n.
struct add_op {
  float* x;
  const float* y;
  WS_MOE_HD void operator()(idx i) const { x[i] += y[i]; }
};

/// y[r][c] += bias[c]. Size rows * cols.
struct bias_op {
  float* y;
  const float* bias;
  int cols;
  WS_MOE_HD void operator()(idx i) const { y[i] += bias[i % cols]; }
};

/// out[i] = in[i] as type `type` (bf16: rounded to nearest even). Size n.
struct convert_op {
  const float* in;
  void* out;
  wtype type;
  WS_MOE_HD void operator()(idx i) const { store_from_float(out, type, i, in[i]); }
};

/// MLA prefill in the non-absorbed form (paper's MLA model; DeepSeek-V2): the
/// per-head keys and values of n tokens from the expanded latent kvx
/// [n][heads][nope + vd] (c·W_UKᵀ ‖ c·W_UVᵀ) and the shared rotary key k_pe
/// (pe, token stride pe_stride, rope elements): k [n][heads][nope + rope] =
/// k_nope ‖ k_pe, v [n][heads][vd], both bf16. Size n·heads·(nope + rope + vd).
struct mla_prefill_kv_op {
  const float* kvx;
  const float* pe;
  idx pe_stride;
  int heads, nope, rope, vd;
  std::uint16_t* k;
  std::uint16_t* v;
  WS_MOE_HD void operator()(idx i) const {
    const int w = nope + rope + vd;
    const idx th = i / w;
    const int e = int(i - th * w);
    const idx t = th / heads;
    const float* x = kvx + th * (nope + vd);
    if (e < nope)
      k[th * (nope + rope) + e] = float_to_bf16(x[e]);
    else if (e < nope + rope)
      k[th * (nope + rope) + e] = float_to_bf16(pe[t * pe_stride + (e - nope)]);
    else
      v[th * vd + (e - nope - rope)] = float_to_bf16(x[nope + (e - nope - rope)]);
  }
};

/// out[i] = in[i] widened to fp32 (exact). Size n.
struct widen_op {
  const void* in;
  wtype type;
  float* out;
  WS_MOE_HD void operator()(idx i) const { out[i] = load_as_float(in, type, i); }
};

/// dst[j][e] = src[rows[j] * src_stride + e]. Size n * cols.
struct gather_rows_op {
  const float* src;
  idx src_stride;
  const int* rows;
  int cols;
  float* dst;
  WS_MOE_HD void operator()(idx i) const {
    const idx j = i / cols;
    const idx e = i - j * cols;
    dst[i] = src[idx(rows[j]) * src_stride + e];
  }
};

// Four-wide forms of the prefill MoE's memory-bound passes: each index moves
// four consecutive elements with one 16-byte fp32 load (and one 8-byte bf16
// store on the device). They compute exactly what their one-element forms
// compute, element for element (same rounding, same summation order), and
// need widths that are multiples of 4 and 16-byte aligned fp32 rows
// (fits_x4 below); the callers fall back to the one-element forms otherwise.

/// Whether a row width (elements) and base pointer allow the four-wide forms.
[[nodiscard]] inline bool fits_x4(idx width, const void* p) {
  return width % 4 == 0 && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

/// (i / d, i % d) in 32-bit arithmetic when i fits (the common case), 64-bit otherwise.
WS_MOE_HD inline void div_mod(idx i, int d, idx& q, idx& r) {
  if (i >= 0 && i <= idx(0x7fffffff)) {
    const int ii = int(i);
    const int qq = ii / d;
    q = qq;
    r = ii - qq * d;
  } else {
    q = i / d;
    r = i - q * d;
  }
}

/// Four fp32 values from 16-byte aligned memory.
WS_MOE_HD inline void load_f32x4(const float* p, float (&v)[4]) {
#ifdef __CUDA_ARCH__
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x;
  v[1] = q.y;
  v[2] = q.z;
  v[3] = q.w;
#else
  for (int j = 0; j < 4; ++j) v[j] = p[j];
#endif
}

/// Four values rounded to bf16 (float_to_bf16) at 8-byte aligned p.
WS_MOE_HD inline void store_bf16x4(std::uint16_t* p, const float (&v)[4]) {
#ifdef __CUDA_ARCH__
  const unsigned lo = unsigned(float_to_bf16(v[0])) | (unsigned(float_to_bf16(v[1])) << 16);
  const unsigned hi = unsigned(float_to_bf16(v[2])) | (unsigned(float_to_bf16(v[3])) << 16);
  *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
#else
  for (int j = 0; j < 4; ++j) p[j] = float_to_bf16(v[j]);
#endif
}

/// gather_rows_op followed by convert_op to bf16, in one pass:
/// dst[j][e] = bf16(src[rows[j] * src_stride + e]) (dst dense, row width cols).
/// cols and src_stride multiples of 4; src 16-byte, dst 8-byte aligned. Size n * cols / 4.
struct gather_rows_bf16x4_op {
  const float* src;
  idx src_stride;
  const int* rows;
  int cols4;  ///< cols / 4
  std::uint16_t* dst;
  WS_MOE_HD void operator()(idx i) const {
    idx j, e4;
    div_mod(i, cols4, j, e4);
    float v[4];
    load_f32x4(src + idx(rows[j]) * src_stride + 4 * e4, v);
    store_bf16x4(dst + 4 * i, v);
  }
};

/// silu_mul_op followed by convert_op to bf16, in one pass: a[i] = bf16(silu(g[i]) * u[i]).
/// g, u 16-byte aligned, a 8-byte aligned. Size n / 4 (n a multiple of 4).
struct silu_mul_bf16x4_op {
  const float* g;
  const float* u;
  std::uint16_t* a;
  WS_MOE_HD void operator()(idx i) const {
    float gv[4], uv[4];
    load_f32x4(g + 4 * i, gv);
    load_f32x4(u + 4 * i, uv);
    for (int j = 0; j < 4; ++j) gv[j] = silu(gv[j]) * uv[j];
    store_bf16x4(a + 4 * i, gv);
  }
};

/// combine_op four columns at a time (the same sum, in the same order, per
/// element). hidden a multiple of 4; y and out 16-byte aligned. Size n * hidden / 4.
struct combine_x4_op {
  const float* y;
  const int* rows;
  const float* w;
  int k;
  int hidden4;  ///< hidden / 4
  float* out;
  WS_MOE_HD void operator()(idx i) const {
    idx t, e4;
    div_mod(i, hidden4, t, e4);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < k; ++s) {
      float v[4];
      load_f32x4(y + idx(rows[t * k + s]) * hidden4 * 4 + 4 * e4, v);
      const float ws = w[t * k + s];
      for (int j = 0; j < 4; ++j) acc[j] += v[j] * ws;
    }
#ifdef __CUDA_ARCH__
    *reinterpret_cast<float4*>(out + 4 * i) = make_float4(acc[0], acc[1], acc[2], acc[3]);
#else
    for (int j = 0; j < 4; ++j) out[4 * i + j] = acc[j];
#endif
  }
};

// Prefill MoE grouping on the device. The (token, slot) pairs t*k + s of the
// router's output are sorted by expert, stably (ties keep token order): the
// executor's sort_pairs, keys = experts as unsigned, values = pair indices.
// expert_bounds_op then finds each expert's first sorted position and, after
// the host laid out the packed rows (padded per expert), scatter_rows_op
// writes the gather and combine tables. The result is the host grouping's
// (device_decoder::moe): packed rows in expert order, tokens ascending inside
// an expert; each token's slots in ascending expert order.

/// out[i] = i. Size n.
struct iota_op {
  int* out;
  WS_MOE_HD void operator()(idx i) const { out[i] = int(i); }
};

/// first[e] = the first position p of the sorted keys with key >= e, for
/// e in [0, E]; keys at or above E (not an expert) count as E, so first[E] < n
/// tells the caller that the router returned one. Size n + 1.
struct expert_bounds_op {
  const unsigned* sorted_keys;  ///< [n]
  idx n;
  int E;
  int* first;  ///< [E + 1]
  WS_MOE_HD void operator()(idx i) const {
    const auto clamp = [&](unsigned key) { return key > unsigned(E) ? E : int(key); };
    const int prev = i == 0 ? -1 : clamp(sorted_keys[i - 1]);
    const int cur = i == n ? E : clamp(sorted_keys[i]);
    for (int e = prev + 1; e <= cur; ++e) first[e] = int(i);
  }
};

/// The gather and combine tables from the sorted pairs: sorted position p of
/// expert e is packed row row0[e] + (p - first[e]); src_rows[row] = its token;
/// comb_rows/comb_w[t*k + j] = its row and routing weight, j = the rank of e
/// among the token's k (distinct) experts. Rows of src_rows that no pair
/// writes (per-expert padding) are left as they are. Size n = tokens * k.
struct scatter_rows_op {
  const unsigned* sorted_keys;  ///< [n] experts, sorted
  const int* sorted_pairs;      ///< [n] t*k + s, in the sorted order
  const int* first;             ///< [E + 1] expert_bounds_op
  const int* row0;              ///< [E + 1] first packed row per expert
  const int* experts;           ///< [n] the router's experts, token-major
  const float* weights;         ///< [n] the router's weights, token-major
  int k;
  int* src_rows;                ///< [packed rows]
  int* comb_rows;               ///< [n]
  float* comb_w;                ///< [n]
  WS_MOE_HD void operator()(idx p) const {
    const int pair = sorted_pairs[p];
    const int e = int(sorted_keys[p]);
    const int row = row0[e] + int(p - first[e]);
    const idx t = pair / k;
    src_rows[row] = int(t);
    int j = 0;
    for (int s = 0; s < k; ++s) j += experts[t * k + s] < e ? 1 : 0;
    comb_rows[t * k + j] = row;
    comb_w[t * k + j] = weights[pair];
  }
};

/// MoE combine: out[t][e] = sum over s < k, in order, of w[t][s] * y[rows[t][s]][e],
/// starting from 0 — the host path's accumulation order when the k slots of a
/// token are sorted by expert id (moe.hpp: experts in ascending order). Size n * hidden.
struct combine_op {
  const float* y;
  const int* rows;
  const float* w;
  int k;
  int hidden;
  float* out;
  WS_MOE_HD void operator()(idx i) const {
    const idx t = i / hidden;
    const idx e = i - t * hidden;
    float acc = 0.0f;
    for (int s = 0; s < k; ++s) acc += y[idx(rows[t * k + s]) * hidden + e] * w[t * k + s];
    out[i] = acc;
  }
};

/// The host experts' rows of a decode MoE pass grouped on the device with
/// experts on both sides (device_decoder's split routing): for packed row
/// p = i / hidden, dst[i] = src[i] where the grouped-kernel table has no
/// device weights for the row's expert (w[keys[p]] null: an expert in host
/// memory, whose output the CPU computed into src); the device experts' rows
/// of dst are left as they are. keys: [pairs] the sorted expert of each
/// packed row (group_pairs' sorted_keys). Size pairs * hidden.
struct host_rows_op {
  const unsigned* keys;
  const void* const* w;
  const float* src;
  idx hidden;
  float* dst;
  WS_MOE_HD void operator()(idx i) const {
    const idx p = i / hidden;
    if (w[keys[p]] == nullptr) dst[i] = src[i];
  }
};

/// Greedy sampling on the device: the key of logit v at column c, so that the
/// largest key of a row is its first maximum among the numbers (std::max_element's
/// tie rule; unlike torch.argmax, which returns a NaN's index):
/// the high word orders the floats (-0 counted as +0), the low word is
/// 0xffffffff - c (a lower column wins a tie). NaN gets key 0, below every
/// other key: never chosen unless the whole row is NaN.
[[nodiscard]] WS_MOE_HD inline std::uint64_t argmax_key(float v, idx c) {
  if (v != v) return 0;
  if (v == 0.0f) v = 0.0f;
  std::uint32_t u = 0;
  std::memcpy(&u, &v, 4);
  const std::uint32_t ordered = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
  return (std::uint64_t(ordered) << 32) | std::uint64_t(0xffffffffu - std::uint32_t(c));
}
/// The column of a row's largest argmax_key (0 for a row whose key stayed 0).
[[nodiscard]] WS_MOE_HD inline int argmax_key_column(std::uint64_t key) {
  return key == 0 ? 0 : int(0xffffffffu - std::uint32_t(key & 0xffffffffu));
}

/// Fills n floats with `value`. Size n.
struct fill_op {
  float* p;
  float value;
  WS_MOE_HD void operator()(idx i) const { p[i] = value; }
};

/// out[i] = random_weight(hash, i, scale) as type `type`. Size n.
struct random_op {
  void* out;
  wtype type;
  std::uint64_t hash;
  float scale;
  WS_MOE_HD void operator()(idx i) const { store_from_float(out, type, i, random_weight(hash, i, scale)); }
};

/// Router of one token (moe.hpp route_tokens, all three models). Size n.
///   p = softmax(logits) (double sums, fp32 values)
///   group_limited: keep the topk_group groups (of n_group) with the largest
///                  per-group max of p, zero the other experts
///   top-k of the kept scores, ties to the lower expert index; w = score,
///   / sum of the k scores when renorm, * scale (DeepSeek's routed_scaling_factor)
/// experts[t][i], weights[t][i] in rank order.
struct route_op {
  static constexpr int max_experts = 512;
  static constexpr int max_groups = 64;
  const float* logits;  ///< [n][E]
  int E;
  int k;
  int group_limited;
  int n_group;
  int topk_group;
  int renorm;
  int apply_scale;
  float scale;
  int* experts;    ///< [n][k]
  float* weights;  ///< [n][k]

  WS_MOE_HD void operator()(idx t) const {
    const float* lg = logits + t * E;
    float m = lg[0];
    for (int e = 1; e < E; ++e) m = lg[e] > m ? lg[e] : m;
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += exp(double(lg[e]) - double(m));
    const int per = group_limited ? E / n_group : E;
    std::uint64_t kept_groups = ~0ull;  // bit g: group g kept
    if (group_limited) {
      float gmax[max_groups];
      for (int g = 0; g < n_group; ++g) {
        float best = prob(lg, m, sum, g * per);
        for (int e = g * per + 1; e < (g + 1) * per; ++e) {
          const float p = prob(lg, m, sum, e);
          best = p > best ? p : best;
        }
        gmax[g] = best;
      }
      kept_groups = 0;
      for (int r = 0; r < topk_group; ++r) {  // stable descending: ties to the lower group
        int bg = -1;
        for (int g = 0; g < n_group; ++g)
          if (!((kept_groups >> g) & 1ull) && (bg < 0 || gmax[g] > gmax[bg])) bg = g;
        kept_groups |= 1ull << bg;
      }
    }
    std::uint64_t taken[max_experts / 64] = {};
    float wsum = 0.0f;
    for (int r = 0; r < k; ++r) {
      int best = -1;
      float bv = 0.0f;
      for (int e = 0; e < E; ++e) {
        if ((taken[e >> 6] >> (e & 63)) & 1ull) continue;
        const float v = ((kept_groups >> (e / per)) & 1ull) ? prob(lg, m, sum, e) : 0.0f;
        if (best < 0 || v > bv) {  // strictly greater: ties keep the lower index
          best = e;
          bv = v;
        }
      }
      taken[best >> 6] |= 1ull << (best & 63);
      experts[t * k + r] = best;
      weights[t * k + r] = bv;
      wsum += bv;
    }
    for (int r = 0; r < k; ++r) {
      float w = weights[t * k + r];
      if (renorm) w /= wsum;
      if (apply_scale) w *= scale;
      weights[t * k + r] = w;
    }
  }

  [[nodiscard]] WS_MOE_HD static float prob(const float* lg, float m, double sum, int e) {
    return float(exp(double(lg[e]) - double(m)) / sum);
  }
};

// -----------------------------------------------------------------------------
// Prefill attention: packing and unpacking around the batched GEMMs
// -----------------------------------------------------------------------------
//
// For a block of `rows` query tokens [t0, t0 + rows) of one sequence, the
// queries of KV head g's group are packed as one matrix Qp[g] of R = rows*group
// rows (row q = r*group + j: token t0 + r, query head g*group + j), so that
// S[g] = Qp[g]·K[g]ᵀ and O[g] = P[g]·V[g] are one strided-batched GEMM each
// over the KV heads (gemm.hpp, prefill_qk / prefill_pv).

/// Qp[g][r][j][e] = q[(t0 + r)][g*group + j][e], stored as `type`. Size hq * rows * qd.
struct pack_q_op {
  const float* q;  ///< the sequence's queries [T][hq][qd]
  idx t0;
  idx rows;
  int hq;
  int group;
  int qd;
  void* out;
  wtype type;
  WS_MOE_HD void operator()(idx i) const {
    const idx e = i % qd;
    const idx rest = i / qd;
    const idx j = rest % group;
    const idx rest2 = rest / group;
    const idx r = rest2 % rows;
    const idx g = rest2 / rows;
    store_from_float(out, type, i, q[((t0 + r) * hq + g * group + j) * qd + e]);
  }
};

/// out[(t0 + r)][g*group + j][e] = Op[g][r][j][e]. Size hq * rows * dv.
struct unpack_o_op {
  const float* o;  ///< [hkv][rows][group][dv]
  idx t0;
  idx rows;
  int hq;
  int group;
  int dv;
  float* out;  ///< the sequence's outputs [T][hq][dv]
  WS_MOE_HD void operator()(idx i) const {
    const idx e = i % dv;
    const idx rest = i / dv;
    const idx j = rest % group;
    const idx rest2 = rest / group;
    const idx r = rest2 % rows;
    const idx g = rest2 / rows;
    out[((t0 + r) * hq + g * group + j) * dv + e] = o[i];
  }
};

// -----------------------------------------------------------------------------
// Row reductions
// -----------------------------------------------------------------------------

/// y[r][0:dim] = x[r][0:dim] / sqrt(mean(x²) + eps) * w (ops.hpp rms_norm); y may alias x.
struct rms_norm_params {
  const float* x;
  idx x_stride;
  const float* w;
  idx rows;
  int dim;
  double eps;
  float* y;
  idx y_stride;
};

/// The scale of a row from its sum of squares (double), as the host path computes it.
[[nodiscard]] WS_MOE_HD inline float rms_inverse(double sum_squares, int dim, double eps) {
  return float(1.0 / sqrt(sum_squares / dim + eps));
}

/// Causal softmax of a block of prefill scores (ops.hpp causal_attention):
/// row q of head-group g (q = r*group + j, token t0 + r) keeps keys
/// [0, t0 + r + 1): p = exp(s*scale - max) / sum (exp in fp32, sum in double,
/// p = e * float(1/sum)); the other keys get 0.
struct softmax_params {
  const float* s;  ///< [hkv][R][keys] fp32
  void* p;         ///< [hkv][R][keys], type p_type
  wtype p_type;
  idx rows_total;  ///< hkv * R
  idx R;           ///< rows * group
  int group;
  idx keys;        ///< t0 + rows
  idx t0;
  float scale;
};

/// Valid keys of row `row` (of rows_total) of a softmax block.
[[nodiscard]] WS_MOE_HD inline idx softmax_valid(const softmax_params& p, idx row) {
  const idx local = row % p.R;
  return p.t0 + local / p.group + 1;
}

// -----------------------------------------------------------------------------
// Grouped experts (decode)
// -----------------------------------------------------------------------------

/// The routed experts of one MoE layer in one launch (decode: a few rows per
/// expert). Rows are packed in expert order (device_decoder::moe): expert e
/// owns rows [offsets[e], offsets[e+1]). For every expert whose table entry is
/// not null, and every row r of it, o < out:
///   up == nullptr:  y[r][o] = x_r · w[e][o]
///   otherwise:      y[r][o] = silu(x_r · w[e][o]) * (x_r · up[e][o])   (gate ‖ up, SiLU-gated)
/// x fp32 [rows][in] (row stride x_stride), w/up bf16 row-major [out][in]
/// (PyTorch's layout), y fp32 [rows][out] (row stride y_stride). Rows of a
/// null entry (an expert kept in host memory) are not written. round_x: every
/// x element is rounded to bf16 first — what the bf16 GEMM path hands cuBLAS
/// (act_bf16); 0 keeps fp32 inputs (fp32 precision with bf16 weights widened).
/// The CUDA kernel needs in % 8 == 0, x_stride % 4 == 0 and 16-byte-aligned
/// x and weight rows (device_decoder checks them before choosing this path).
struct expert_gemv_params {
  const void* const* w = nullptr;   ///< [experts] device pointers (null: skipped)
  const void* const* up = nullptr;  ///< [experts] or null (plain product)
  const int* offsets = nullptr;     ///< [experts + 1] packed row offsets, ascending
  int experts = 0;
  /// Optional grid over the routed rows instead of every expert: [blocks]
  /// expert ids in ascending order, repeats allowed (the sorted expert of each
  /// routed pair, as device routing makes them); block row y runs expert
  /// block_experts[y] unless it equals block_experts[y - 1]. Null: block row e
  /// runs expert e, for e < experts. The output is the same either way.
  const unsigned* block_experts = nullptr;
  int blocks = 0;
  int out = 0, in = 0;
  const float* x = nullptr;
  idx x_stride = 0;
  float* y = nullptr;
  idx y_stride = 0;
  int round_x = 0;
};

/// x element as the GEMM sees it (rounded to bf16 when round_x).
[[nodiscard]] WS_MOE_HD inline float expert_input(float v, int round_x) {
  return round_x ? bf16_to_float(float_to_bf16(v)) : v;
}

}  // namespace ws_moe::gpu
