// ws_moe/gpu/device_decoder.hpp — the CUDA path of the MoE decoders: the same
// models as the host path (decoder.hpp), with weights and activations in
// device memory, cuBLAS GEMMs and the small kernels of kernel_math.hpp, and the
// KV cache on writescope's cuda_backend (docs/DECODERS.md, "CUDA path").
//
//   Layout  gqa_layout<64|128> | mla_layout<512,64> | mla_layout<128,32>
//   Exec    cuda_exec (the GPU) | emulated_exec (the same code on the host, CI)
//   cache   inplace_kv_cache<Layout, Exec::backend_type, Exec::pinned_allocator,
//           runtime_policy>: unpinned CPU region, pinned load region
//           (cudaHostRegister), D-window and ping-pong on the device
//
// Prefill: sequences are admitted (begin_sequence routes their eviction
// batches at write time), then prefilled in waves of whole sequences (at most
// --prefill-chunk-tokens tokens per wave unless one sequence is longer). Per
// wave and layer: projections for all the wave's tokens; per sequence, its
// K/V (bf16) goes to its final regions with append_prefill from device memory
// as soon as it is produced (paper §4.2 footnote) and the prompt attends itself
// causally on the GPU (blocks of query rows: one strided-batched GEMM over the
// KV heads for the scores, a causal softmax kernel, one for P·V); then the
// output projection, the FFN, and after the last layer the first token.
//
// Decode: per step and layer: projections (MLA: W_UK folded into q on the GPU),
// append (device KV into the D-window), hybrid_attention::step (the CPU engine
// attends the unpinned region with OpenMP threads while the GPU streams the
// pinned region through ping-pong and attends it and the D-window; LSE merge on
// the GPU), output projection (MLA: expansion by W_UV), FFN; then flush() and
// the LM head; greedy decoding without recorded logits picks its tokens on
// the device (head_greedy), other sampling on the host from the copied
// logits. On cuda_exec the layer's parts before the append and after the
// attention step (split at the host's one wait where a layer has host
// experts) and the LM head are replayed from CUDA graphs (run_segment;
// device_options::decode_graphs).
//
// MoE: the router (fp32) and top-k run on the device. A decode step groups
// the (token, expert) pairs by expert on the device (decode_routing); where
// the layer has host experts the host downloads the experts chosen and the
// normed rows once, runs its experts on the CPU while the GPU runs the
// device ones, and uploads its rows (split_decode_ffn). Elsewhere (prefill,
// --decode-routing host) the pairs are copied to the host, grouped by expert
// there, and the tokens gathered on the device in expert order. GPU experts: with few rows per
// expert (decode) all of a layer's run in two launches (launch_expert_gemv:
// gate‖up with SiLU, then down — the per-expert launches cost DeepSeek-V2-Lite
// ~1,100 launches a step); otherwise each active expert runs as three GEMMs
// on its rows. Host experts run on the CPU (OpenMP, bf16 weights widened per
// row, overlapped with the GPU experts). One combine kernel
// sums each token's k expert outputs in ascending expert order, as the host
// path does; shared experts are added after.
//
// Precision (--precision): "bf16" — GEMM inputs in bf16 (weights as stored,
// activations rounded to bf16 per GEMM), fp32 accumulation and fp32 outputs;
// "fp32" — bf16 weights widened exactly to fp32 per GEMM, fp32 activations
// (the host path's arithmetic, for the transformers fixtures). Everything else
// is fp32 in both: residual stream, norms, RoPE, softmax, router, attention
// accumulators; the cache holds bf16 K/V.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <compare>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <tuple>
#include <vector>

#include <writescope/writescope.hpp>

#include "../decoder.hpp"
#include "../model_config.hpp"
#include "../ops.hpp"
#include "../runtime_policy.hpp"
#include "../sampling.hpp"
#include "../weights.hpp"
#include "../cpu_experts.hpp"
#include "../dram_ceiling.hpp"
#include "../vram_split.hpp"
#include "device_weights.hpp"
#include "cudnn_prefill.hpp"
#include "flash_prefill.hpp"
#include "gemm.hpp"
#include "kernel_math.hpp"

namespace ws_moe {

/// Where a decode MoE layer groups its routed rows (device_options::decode_routing).
enum class decode_routing_mode { host, device, automatic };

/// Options of the CUDA path (ws_decode --device cuda|emulated).
struct device_options {
  gpu::wtype precision = gpu::wtype::bf16;  ///< GEMM input type
  index_t vram_budget_bytes = 0;            ///< device memory for everything; 0 = free at start - 1 GiB
  long long max_gpu_experts = -1;           ///< at most this many routed experts on the device (-1: no cap)
  index_t prefill_chunk_tokens = 32768;     ///< tokens per prefill wave (whole sequences)
  /// A prefill wave's MoE layers run over chunks of at most this many of its
  /// tokens, one after the other, so that the routed experts' workspaces (packed
  /// rows, their bf16 copies, gate/up/SiLU products, outputs, the routing and its
  /// sort) hold one chunk instead of the wave; each chunk streams the layer's
  /// host experts again. 0 = the whole wave at once. Results are those of the
  /// whole wave (each token's experts see the same rows).
  index_t prefill_moe_chunk_tokens = 0;
  index_t prefill_attention_bytes = index_t{2} << 30;  ///< scores + probabilities of one prefill block
  double max_host_expert_gib = 0.0;         ///< refuse more host-resident expert bytes (0 = 80% of RAM)
  double physical_memory_gib = 0.0;         ///< host RAM (for the default above)
  bool warmup = true;                       ///< one untimed decode step on throw-away sequences before prefill
  /// cuda_backend: page-locked bounce buffer for evictions into the unpinned
  /// region (cuda_backend::set_eviction_bounce_bytes; 0 = direct pageable copies).
  index_t eviction_bounce_bytes = index_t{32} << 20;
  /// cuda_backend: the engine's launcher thread enqueues each layer's streamed
  /// chunks while this thread runs the CPU engine (cuda_backend::set_launch_thread).
  /// Off by default: on the 16-core GPU machine the CPU engine lost what the
  /// launch gained (docs/DECISIONS.md, the launcher-thread entry).
  bool launch_thread = false;
  /// cuda_backend: the HBM-resident region attended by the split-K resident
  /// kernels (cuda_backend::set_resident_kernel; experimental, off by default).
  bool resident_kernel = false;
  /// cuda_backend: all-GPU attention steps that stream nothing run on the
  /// caller stream (cuda_backend::set_caller_stream_steps; on by default).
  bool caller_stream_steps = true;
  /// CUDA graphs of the decode step (cuda_exec only; the emulated executor
  /// has none): per layer, the work before the cache append (RMSNorm and the
  /// projections) and, where it runs on the device alone, the work after the
  /// attention step (output projection, residual, FFN) are captured once per
  /// (layer, segment, batch rows) and replayed in later steps
  /// (docs/DECODER-INTERNALS.md, "CUDA graphs of the decode step"). The same
  /// kernels with the same parameters: the same results as off.
  bool decode_graphs = true;
  /// Decode MoE layers run their device experts in two launches (gate‖up with
  /// SiLU, then down: launch_expert_gemv) instead of one cuBLAS product per
  /// expert and matrix, when the experts are bf16, no expert has more than
  /// grouped_expert_max_rows rows and at least grouped_expert_min_active
  /// device experts have rows (few experts: few launches to save, and cuBLAS
  /// reads Mixtral's 14336-wide experts faster; docs/DECISIONS-DECODERS.md).
  bool grouped_experts = true;
  int grouped_expert_max_rows = 32;
  int grouped_expert_min_active = 16;
  /// Decode MoE layers with bf16 host experts: false = the host enqueues the
  /// device (and shared) experts, then waits for the CPU experts' inputs and
  /// runs them; true = it waits for the inputs first, then the CPU experts'
  /// team starts on them while its thread 0 (this thread) enqueues the device
  /// experts and then joins the team (cpu::side_work), so that the host time
  /// of that enqueue (one cuBLAS product per expert and matrix below
  /// grouped_expert_min_active) overlaps the CPU experts. The same results
  /// either way; refused at setup where no routed expert is on the host
  /// unless device_experts_during_cpu_default (then it is dropped there).
  bool device_experts_during_cpu = false;
  /// device_experts_during_cpu came from the default (ws_decode
  /// --device-experts-issue auto), not from the user: where no routed expert is
  /// on the host it turns off instead of being refused.
  bool device_experts_during_cpu_default = false;
  /// Decode MoE layers without host experts group their routed rows on the
  /// device (group_pairs, or the prefill's sort, bounds and scatter kernels)
  /// and run the grouped kernels from those device-side offsets: no routing
  /// download, no host grouping, no wait for the router before the layer's
  /// expert work is enqueued. Layers with host experts, all bf16, group on
  /// the device too (split routing, split_decode_ffn): the host waits once,
  /// for the experts chosen and the normed rows, runs its experts and
  /// uploads their rows, while the GPU runs the device experts (not with
  /// --device-experts-issue during given by the user, which needs the host
  /// grouping). Applies to a step of at most grouped_expert_max_rows sequences
  /// with bf16 grouped tables and the device grouping's buffers (a batched
  /// prefill); elsewhere the host groups as before. With hot placement the
  /// routed rows a migration counts are those of layers with host experts,
  /// which split routing downloads (a layer without any never migrates). `automatic` (the
  /// default) does this wherever it applies and the experts are narrow (one
  /// matrix at most auto_routing_max_matrix_bytes: Qwen3, DeepSeek-V2-Lite,
  /// not Mixtral) and groups on the host elsewhere;
  /// `device` also refuses at setup (config_error) where it cannot act;
  /// `host` never routes on the device.
  decode_routing_mode decode_routing = decode_routing_mode::automatic;
  /// Prefill waves whose routed rows per host expert average at least
  /// stream_min_rows run the host experts on the device: their bf16 weights
  /// (page-locked host arena) stream H2D through a ring of staging slots on a
  /// copy stream while earlier layers compute; smaller waves (and decode) run
  /// them on the CPU (cpu_experts.hpp).
  bool stream_experts = true;
  double stream_min_rows = 32.0;
  /// Device bytes of the staging ring (inside vram_budget_bytes); 0: two
  /// layers' host experts where they take at most an eighth of the budget
  /// (then a layer's streamed experts join its batched GEMMs while the next
  /// layer's copies land), else one layer's, at most an eighth of the budget,
  /// at least 2 experts.
  index_t expert_staging_bytes = 0;
  /// bf16 precision: the flash prefill attention (flash_prefill.hpp) instead of
  /// materialised score blocks (the fp32 precision always materialises).
  bool flash_prefill = true;
  /// With flash_prefill: cuDNN's fused SDPA (cudnn_prefill.hpp, bf16 output)
  /// when the build has it and it accepts the waves' shapes; else the flash kernel.
  bool cudnn_prefill = true;
  /// bf16 precision, bf16 experts: a prefill MoE layer's device-resident
  /// experts run as pointer-array batched GEMMs (cuBLASLt), one per group of
  /// experts with equal row counts padded to a multiple of 64, instead of
  /// three cuBLAS products per expert.
  bool batched_prefill_experts = true;
  /// How the batched prefill experts' GEMMs are issued: false = one
  /// pointer-array batched GEMM per group of equal padded rows and matrix (gate, up,
  /// down); true = one cublasGemmGroupedBatchedEx per matrix over every
  /// device expert with rows, each at its exact row count (no padding).
  bool grouped_prefill_gemm = false;
  /// The batched GEMMs' groups (not grouped_prefill_gemm): false = experts of
  /// equal ladder size (gemm.hpp ladder_rows) form a group; true = groups
  /// fitted to the layer's loads (gemm.hpp fitted_group_rows), trading padded
  /// rows (their FLOPs at fitted_groups_flops_per_second) against the host
  /// issue of one more group's three calls (3 x fitted_groups_call_seconds).
  bool fitted_expert_groups = true;
  double fitted_groups_flops_per_second = 6e14;
  double fitted_groups_call_seconds = 25e-6;
  /// cuda_backend: prefill KV bound for the unpinned region leaves through a
  /// page-locked bounce buffer of at most this many bytes without the host
  /// waiting; host threads copy it to its blocks during the next layer
  /// (cuda_backend::set_deferred_host_writes; 0 = synchronous writes).
  index_t deferred_kv_write_bytes = index_t{512} << 20;
  /// Device bytes kept free inside the budget for what is allocated after
  /// placement (cuBLAS workspaces, the attention engine's lazy buffers).
  index_t budget_reserve_bytes = index_t{256} << 20;
  /// Random weights only: a per-layer additive bias on the router logits so
  /// that expert popularity within a layer follows a Zipf law with this
  /// exponent over a per-layer random permutation of the experts (0: none;
  /// zipf_router_bias). router_zipf_seed picks the permutations.
  double router_zipf = 0.0;
  std::uint64_t router_zipf_seed = 0;
  /// Hot placement: after the prefill, per MoE layer, the hottest host
  /// experts (routed rows counted during the prefill) swap places with the
  /// coldest device experts, at most migrate_max_experts pairs per layer and
  /// only where the host expert got more rows (migrate_hot_experts).
  bool hot_placement = false;
  /// Layer-major placement (--expert-placement layers): the device takes whole
  /// MoE layers' routed experts, first layers first, while the budget lasts
  /// (at most one layer is split), so the layers after it have every routed
  /// expert in host memory, as llama.cpp's per-tensor `-ot` overrides place
  /// them. Default (false): expert-major, every layer's lowest ids first.
  bool layer_major_placement = false;
  int migrate_max_experts = 8;
  /// Migration by re-reading the two experts from the weight source into
  /// their new places instead of swapping the loaded bytes: the same final
  /// placement by another route (the bit-identity test of the swap).
  bool migrate_reload = false;
  /// Hot placement during the decode: 0 = after the prefill only; N > 0 =
  /// also after every N-th decode step, with the routed rows counted from the
  /// prefill on (the decode steps' rows added), the same rule and per-layer
  /// bound (migrate_max_experts pairs each time). The swaps' copies run
  /// between the steps, synchronously, and their time is the step's.
  int migrate_every_steps = 0;
  /// Measure the host's DRAM read ceiling at setup (dram_ceiling.hpp; with the
  /// CPU experts' threads, after the weights are loaded) when the run has host
  /// experts: the denominator of the decode step's CPU expert bound. false
  /// (--no-dram-ceiling) skips it; refused (config_error) where no expert is
  /// on the host, since there is then nothing to skip.
  bool dram_ceiling = true;
  /// The HBM-resident KV region (partition_spec::hbm_capacity_tokens):
  /// `off` none; `automatic` the split of vram_split.hpp between it and the
  /// routed experts (at most hbm_kv_bytes when > 0; none on the emulated
  /// device without a budget, which has no size to split); `fixed` exactly
  /// hbm_kv_bytes in whole eviction batches (config_error when it does not fit).
  hbm_kv_mode hbm_kv = hbm_kv_mode::off;
  index_t hbm_kv_bytes = 0;
  /// The split's costs per KV token and layer: the roofline's A, B, K
  /// (roofline_init.hpp) and H, the GPU's time for a token attended in HBM;
  /// and the CPU's read rate of expert weights (bytes per second).
  double kv_cpu_seconds_per_token = 0.0;
  double kv_gpu_seconds_per_token = 0.0;
  double kv_launch_seconds_per_token = 0.0;
  double kv_hbm_seconds_per_token = 0.0;
  double cpu_expert_bytes_per_second = 80e9;
};

/// The Zipf router bias of one layer (--router-zipf): expert perm[r] (perm a
/// random permutation seeded by `seed` and the layer) gets
///   bias = beta * ln(w_r),  w_r = (r + 1)^-S,  beta = sigma * sqrt(6) / pi,
/// where sigma is the standard deviation of a random router's logits
/// (weights of standard deviation `weight_stddev`, RMS-normalised inputs:
/// weight_stddev * sqrt(hidden)). For logits of i.i.d. Gumbel noise of scale
/// beta a bias of beta * ln(w) makes top-1 frequencies proportional to w; the
/// logits here are near-Gaussian and top-k picks k, so the frequencies follow
/// the law only approximately (steeper at the head for top-k with k > 1).
inline std::vector<float> zipf_router_bias(int experts, double S, int hidden, double weight_stddev, std::uint64_t seed,
                                           int layer) {
  std::vector<int> perm(static_cast<std::size_t>(experts));
  for (int e = 0; e < experts; ++e) perm[std::size_t(e)] = e;
  std::uint64_t state = gpu::mix64(seed ^ (0x9e3779b97f4a7c15ull * std::uint64_t(layer + 1)));
  for (int i = experts - 1; i > 0; --i) {  // Fisher-Yates
    state = gpu::mix64(state + 0x632be59bd9b4e019ull);
    const int j = int(state % std::uint64_t(i + 1));
    std::swap(perm[std::size_t(i)], perm[std::size_t(j)]);
  }
  const double beta = weight_stddev * std::sqrt(double(hidden)) * std::sqrt(6.0) / 3.14159265358979323846;
  std::vector<float> bias(static_cast<std::size_t>(experts));
  for (int r = 0; r < experts; ++r) bias[std::size_t(perm[std::size_t(r)])] = float(-beta * S * std::log(double(r + 1)));
  return bias;
}

/// The executor's instantiated CUDA graph (cuda_exec::graph), or
/// std::nullptr_t for an executor without graphs (emulated_exec).
template <class Exec>
struct executor_graph {
  using type = std::nullptr_t;
};
template <class Exec>
  requires requires { typename Exec::graph; }
struct executor_graph<Exec> {
  using type = typename Exec::graph;
};

template <class Layout, class Exec>
class device_decoder {
 public:
  using backend_type = typename Exec::backend_type;
  using cache_type = writescope::inplace_kv_cache<Layout, backend_type, typename Exec::pinned_allocator, runtime_policy>;
  using space = typename backend_type::activation_space;
  static constexpr bool mla = Layout::is_mla;
  static constexpr int QD = Layout::q_dim;     ///< query width per head (MLA: absorbed rank + rope)
  static constexpr int VD = Layout::v_dim;     ///< attention output width per head (MLA: rank)
  static constexpr int ROW = Layout::row_elems;

  device_decoder(const model_config& c, const weight_source& src, const device_options& d)
      : c_(c), src_(&src), d_(d), prec_(d.precision) {
    if constexpr (mla) {
      if (c.kv_lora_rank != Layout::kv_lora_rank || c.qk_rope_head_dim != Layout::rope_dim)
        throw writescope::config_error("device_decoder: layout does not match the config's MLA shape");
      rope_ = rotary(c.rope, Layout::rope_dim, rotary::style::interleaved);
    } else {
      if (c.head_dim != Layout::head_dim) throw writescope::config_error("device_decoder: layout head_dim mismatch");
      rope_ = rotary(c.rope, Layout::head_dim, rotary::style::half);
    }
    if (c.num_experts > gpu::route_op::max_experts)
      throw writescope::config_error("the CUDA path routes at most " + std::to_string(gpu::route_op::max_experts) +
                                     " experts; the config has " + std::to_string(c.num_experts));
    if (c.experts_per_tok > 64)
      throw writescope::config_error("the CUDA path routes at most 64 experts per token; the config has " +
                                     std::to_string(c.experts_per_tok));
    if (c.kind == arch::deepseek_v2 && c.topk_method == "group_limited_greedy" && c.n_group > gpu::route_op::max_groups)
      throw writescope::config_error("the CUDA path's router supports at most 64 expert groups");
    if (!(d.router_zipf >= 0.0) || !std::isfinite(d.router_zipf))
      throw writescope::config_error("router Zipf exponent " + std::to_string(d.router_zipf) + ": must be finite and >= 0");
    if (d.router_zipf > 0.0 && !src.is_random())
      throw writescope::config_error("router Zipf exponent " + std::to_string(d.router_zipf) +
                                     ": a bias for random weights only (the checkpoint's routers are kept)");
    if (d.migrate_max_experts < 0)
      throw writescope::config_error("migrate_max_experts " + std::to_string(d.migrate_max_experts) + ": must be >= 0");
    if (d.migrate_every_steps < 0)
      throw writescope::config_error("migrate_every_steps " + std::to_string(d.migrate_every_steps) + ": must be >= 0");
    if (d.migrate_every_steps > 0 && !d.hot_placement)
      throw writescope::config_error("migrate_every_steps " + std::to_string(d.migrate_every_steps) +
                                     ": acts with hot placement only");
  }
  device_decoder(const device_decoder&) = delete;
  device_decoder& operator=(const device_decoder&) = delete;

  [[nodiscard]] Layout layout() const {
    if constexpr (mla)
      return Layout(c_.num_heads);
    else
      return Layout(c_.num_heads, c_.num_kv_heads);
  }

  /// Loads the weights, builds the cache and generates max_new_tokens tokens
  /// for every prompt (ragged batch; with o.eos_token_ids a sequence stops
  /// after its first stop token and leaves the decode batch, live_batch).
  /// on_layer(l) after each layer's non-expert weights; on_loaded() once
  /// every weight is in place.
  generation_result generate(const std::vector<std::vector<int>>& prompts, runtime_policy policy, const run_options& o,
                             const std::function<void(int)>& on_layer = {}, const std::function<void()>& on_loaded = {}) {
    using namespace writescope;
    validate_prompts(c_, prompts, o);
    const int B = int(prompts.size());
    const int V = c_.vocab_size;
    generation_result res;
    res.backend = Exec::is_emulated ? "host_backend (the CUDA path's code emulated on the host)"
                                    : "cuda_backend on " + x_.device_name();
    res.device.used = true;
    res.device.device = x_.device_name();
    res.device.precision = prec_ == gpu::wtype::bf16
                               ? "bf16 GEMM inputs, fp32 accumulation; fp32 activations, norms, softmax, router"
                               : "fp32 (bf16 weights widened exactly; fp32 activations and GEMMs)";
    res.spec = make_partition_spec(layout(), c_.num_layers, prompts, o);
    res.policy = policy.describe();

    // ---- weights (all but the routed experts) ----------------------------------
    load_dense_weights(on_layer);

    // ---- cache, attention engine, workspaces -----------------------------------------
    if constexpr (requires(backend_type& b) { b.set_eviction_bounce_bytes(index_t{0}); })
      x_.backend().set_eviction_bounce_bytes(d_.eviction_bounce_bytes);
    if constexpr (requires(backend_type& b) { b.set_launch_thread(true); })
      x_.backend().set_launch_thread(d_.launch_thread);
    if constexpr (requires(backend_type& b) { b.set_deferred_host_writes(index_t{0}); })
      x_.backend().set_deferred_host_writes(d_.deferred_kv_write_bytes);
    if constexpr (requires(backend_type& b) { b.set_resident_kernel(true); })
      x_.backend().set_resident_kernel(d_.resident_kernel);  // before hybrid_attention: it reserves the workspace
    if constexpr (requires(backend_type& b) { b.set_caller_stream_steps(true); })
      x_.backend().set_caller_stream_steps(d_.caller_stream_steps);
    attention_options ao;
    ao.cpu_threads = o.threads;
    ao.assist = o.assist;
    ao.all_gpu_steps = o.all_gpu_steps;
    ao.task_workspace_reserve_bytes = index_t{256} << 20;  // no page faults in the decode steps (hybrid_attention)
    auto build_cache = [&](runtime_policy p) {
      hybrid_.reset();  // the engine refers to the cache: it goes first
      cache_.reset();
      cache_ = std::make_unique<cache_type>(x_.backend(), layout(), res.spec, std::move(p),
                                            typename Exec::pinned_allocator{}, cache_options{o.kv.poison});
      hybrid_ = std::make_unique<hybrid_attention<cache_type>>(*cache_, ao);
    };
    build_cache(policy);
    plan_waves(prompts);
    use_flash_ = flash_applies();
    cpu_threads_ = o.threads;
    allocate_workspaces(prompts);

    // ---- the VRAM split: routed experts against the HBM-resident KV region ----------
    // Weighed with the device memory in use now (weights, D-window, ping-pong,
    // workspaces); the cache is built again with the region when it gets one,
    // before any sequence exists, and the experts take what is left.
    choose_vram_split(prompts, o, res.device);
    if (res.device.hbm_capacity_tokens > 0) {
      res.spec.hbm_capacity_tokens = res.device.hbm_capacity_tokens;
      build_cache(std::move(policy));
      res.device.hbm_region_bytes = cache_->usage().hbm_region_bytes;
    }

    // ---- routed experts: device while the budget lasts, then host memory ----------
    place_and_load_experts(res.device);
    check_decode_routing(B, res.device.expert_kernels);
    x_.sync();
    if (on_loaded) on_loaded();
    measure_dram_ceiling(res.device);
    res.block_bytes = cache_->format().block_bytes();
    res.token_bytes = layout().token_bytes();
    const region_usage u0 = cache_->usage();
    res.device.kv_bytes = u0.d_window_bytes + u0.ping_pong_bytes;  // the HBM region: hbm_region_bytes
    res.device.weights_bytes = weights_bytes_;
    res.device.workspace_bytes = workspace_bytes_;
    res.device.moe_workspace_bytes = moe_workspace_bytes_;
    res.device.moe_pass_tokens = moe_tokens_cap_;
    res.device.total_bytes = x_.device_total_bytes();
    res.device.used_bytes = device_used();
    res.device.prefill_waves = int(waves_.size());
    res.device.prefill_moe_chunk_tokens = moe_tokens_cap_ < T_ ? static_cast<long long>(moe_tokens_cap_) : 0;
    res.device.prefill_block_rows = use_flash_ ? 0 : rows_blk_;
    if (use_cudnn_)
      res.device.prefill_attention = std::string(Exec::is_emulated ? "cuDNN SDPA path (emulated: the flash host twin, bf16 output)"
                                                                   : "cuDNN SDPA " + std::to_string(x_.cudnn_version())) +
                                     (mla ? " (MLA non-absorbed: per-head K/V expanded from the latent)" : "");
    else if (use_flash_)
      res.device.prefill_attention =
          std::string("flash") + (mla ? " (MLA non-absorbed: per-head K/V expanded from the latent)" : "") +
          (cudnn_why_.empty() ? "" : "; not cuDNN: " + cudnn_why_);
    else
      res.device.prefill_attention = "materialised score blocks (cuBLAS QK, softmax kernel, cuBLAS PV)";
    sample_used();

    if (d_.warmup) {
      const auto t_warm = std::chrono::steady_clock::now();
      warm_up(B);
      res.warmup_sequences = B;
      res.warmup_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_warm).count();
    }

    res.tokens.assign(std::size_t(B), {});
    if (o.record_logits) res.logits.assign(std::size_t(B), {});
    sampler pick(o.sampling, B);
    const float* logits = nullptr;  // the page-locked copy of the last head() (logits_host_)
    std::vector<int> cur(static_cast<std::size_t>(B));

    // The unpinned region's pages for the prompts' blocks (an upper bound: every
    // prompt block may be routed to it) are made resident now, by all cores,
    // as an engine would at start-up, so that the prefill's KV write-out does
    // not fault page by page on the thread that drives the GPU.
    {
      const auto t_pf = std::chrono::steady_clock::now();
      index_t blocks = 0;
      for (const auto& p : prompts) blocks += (index_t(p.size()) + res.spec.block_tokens - 1) / res.spec.block_tokens;
      res.device.kv_prefault_bytes = cache_->prefault_cpu_region(blocks);
      res.device.kv_prefault_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_pf).count();
      // The pinned region is page-locked ahead for the same blocks (bounded by
      // its capacity; paper §7.7's pinning ahead), so that no admission pins
      // on the critical path (cudaHostRegister runs at a few GB/s).
      const auto t_pin = std::chrono::steady_clock::now();
      const index_t pinned_before = cache_->usage().pinned_region_bytes;
      cache_->reserve_pinned_blocks(blocks);
      res.device.kv_pinned_ahead_bytes = cache_->usage().pinned_region_bytes - pinned_before;
      res.device.kv_pinned_ahead_seconds = seconds_since(t_pin);
    }

    // ---- admission + prefill ---------------------------------------------------------
    counting_ = counting::prefill;  // routed rows per expert (placement); the warm-up is not counted
    const auto t_prefill = std::chrono::steady_clock::now();
    const auto [lt_queries0, lt_seconds0, lt_issue0, lt_calls0] = lt_heuristics();
    std::vector<sequence_id> seqs(static_cast<std::size_t>(B));
    index_t announced = 0;  // eq. 2's L is the whole admitted batch, not the prompts placed so far
    for (int i = 0; i < B; ++i) announced += index_t(prompts[std::size_t(i)].size());
    cache_->announce_admission(announced);
    const auto t_admit = std::chrono::steady_clock::now();
    for (int i = 0; i < B; ++i) {
      seqs[std::size_t(i)] = cache_->begin_sequence(index_t(prompts[std::size_t(i)].size()));
      if (o.progress && ((i + 1) % 1024 == 0 || i + 1 == B)) o.progress(phase::admission, i + 1, B);
    }
    res.device.prefill_host.admission_seconds = seconds_since(t_admit);
    for (std::size_t w = 0; w < waves_.size(); ++w) {
      const wave& wv = waves_[w];
      prefill_wave(
          wv, prompts, seqs,
          [&](int l) {
            if (o.progress) o.progress(phase::prefill, int(w) * c_.num_layers + l + 1, int(waves_.size()) * c_.num_layers);
          },
          res.device);
      // first token of each sequence of the wave
      const int ns = wv.end - wv.begin;
      std::vector<int> last(static_cast<std::size_t>(ns));
      for (int i = 0; i < ns; ++i) last[std::size_t(i)] = int(wv.offset[std::size_t(i) + 1] - 1);
      const auto t_end = std::chrono::steady_clock::now();
      x_.h2d(last_rows_, last.data(), index_t(ns) * 4);
      x_.run(gpu::gather_rows_op{x_buf_, c_.hidden_size, last_rows_, c_.hidden_size, y2_}, index_t(ns) * c_.hidden_size);
      logits = head(y2_, ns);
      take_tokens(res, pick, wv.begin, ns, logits, V, cur, o);
      res.device.prefill_host.head_sampling_seconds += seconds_since(t_end);
    }
    const auto t_final = std::chrono::steady_clock::now();
    complete_kv_writes();  // the last layer's deferred KV bytes are in their blocks before prefill ends
    counting_ = counting::off;
    res.prefill_tokens = 0;
    for (const auto& p : prompts) res.prefill_tokens += index_t(p.size());
    res.cpu_prefault_bytes = prefault_for_decode(*cache_, B, o.max_new_tokens);
    res.device.prefill_host.final_seconds = seconds_since(t_final);
    {
      const auto [q, sec, issue, calls] = lt_heuristics();
      res.device.prefill_host.gemm_lt_calls = calls - lt_calls0;
      res.device.prefill_host.gemm_heuristic_queries = q - lt_queries0;
      res.device.prefill_host.gemm_heuristic_seconds = sec - lt_seconds0;
      res.device.prefill_host.gemm_lt_issue_seconds = issue - lt_issue0;
    }
    res.prefill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_prefill).count();
    res.trajectory.push_back(share_of(*cache_, seqs, 0));
    if (d_.hot_placement) migrate_hot_experts(res.device);
    counting_ = counting::decode;

    // ---- decode ------------------------------------------------------------------------
    const int steps = o.max_new_tokens - 1;
    std::vector<index_t> pos(static_cast<std::size_t>(B));
    std::vector<int> ids(static_cast<std::size_t>(B));
    live_batch live(seqs);
    live.finish_stopped(*cache_, res, o);  // a first token can be a stop token
    struct clear_on_exit {  // moe() sums its router waits into res only while decoding
      double*& p;
      ~clear_on_exit() { p = nullptr; }
    } router_wait_guard{router_wait_ = &res.router_wait_seconds};
    // CUDA graphs of the decode segments (run_segment): made again in each run,
    // since they hold its buffer addresses; armed for the decode loop only (not the warm-up)
    graphs_.clear();
    graph_launches_ = graph_captures_ = graph_fallbacks_ = 0;
    graph_fallback_why_.clear();
    struct disarm_on_exit {
      bool& armed;
      ~disarm_on_exit() { armed = false; }
    } graphs_guard{graphs_armed_ = has_graphs && d_.decode_graphs};
    // With host experts, each step's CPU expert bytes and seconds and its GPU
    // timeline marks (step start, routing round trips, overlap windows, LM
    // head done): the CPU experts against their bound (report.hpp expert_bound).
    const bool bound_marks = any_host_experts_;
    // Greedy decoding whose logits are not recorded picks its tokens on the
    // device (head_greedy: the same first maximum as the host's argmax).
    const bool device_greedy = pick.greedy() && !o.record_logits;
    res.device.greedy_on_device = device_greedy && steps > 0;
    for (int s = 1; s <= steps && !live.empty(); ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const int n = live.size();  // row r = sequence live.rows()[r]
      const index_t host_bytes0 = decode_host_expert_bytes_;
      const double cpu_seconds0 = decode_cpu_expert_seconds_;
      int span0 = -1, span1 = -1;
      if (bound_marks) {
        x_.reset_marks();
        trip_marks_.clear();
        window_marks_.clear();
        step_phases_ = {};
        span0 = x_.mark();
        step_marking_ = true;
      }
      for (int r = 0; r < n; ++r) {
        const int i = live.rows()[std::size_t(r)];
        ids[std::size_t(r)] = cur[std::size_t(i)];
        pos[std::size_t(r)] = index_t(prompts[std::size_t(i)].size()) + s - 1;
      }
      x_.h2d(ids_, ids.data(), index_t(n) * 4);
      x_.h2d(pos_, pos.data(), index_t(n) * 8);
      embed(n);
      const step_totals before(res);
      for (int l = 0; l < c_.num_layers; ++l) layer_decode(l, live.seqs(), res);
      const auto t_flush = std::chrono::steady_clock::now();
      const flush_report fr = cache_->flush();
      before.push_step(res, std::chrono::duration<double>(std::chrono::steady_clock::now() - t_flush).count());
      res.cpu_batches += fr.cpu_batches;
      res.gpu_batches += fr.gpu_batches;
      res.hbm_batches += fr.hbm_batches;
      if (fr.evicted_sequences > 0) res.trajectory.push_back(share_of(*cache_, live.seqs(), s));
      const auto t_head = std::chrono::steady_clock::now();
      if (device_greedy) {  // greedy without recorded logits: the choice is made on the device
        head_greedy(n, greedy_ids_);
        if (bound_marks) span1 = x_.mark();  // the tokens are on the host: the step's GPU work is done
        for (int r = 0; r < n; ++r) take_token_id(res, live.rows()[std::size_t(r)], greedy_ids_[std::size_t(r)], cur, o);
      } else {
        logits = head(x_buf_, n);
        if (bound_marks) span1 = x_.mark();  // the logits are on the host: the step's GPU work is done
        take_tokens_rows(res, pick, live.rows(), logits, V, cur, o);
      }
      res.step_head_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t_head).count());
      res.step_sequences.push_back(n);
      live.finish_stopped(*cache_, res, o);
      // hot placement during the decode: a migration round after every N-th step (its time is this step's)
      if (d_.migrate_every_steps > 0 && s % d_.migrate_every_steps == 0 && s < steps && !live.empty())
        migrate_hot_experts(res.device, true);
      res.step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (bound_marks) {  // outside the step's time: the marks are read after a sync
        step_marking_ = false;
        x_.sync();
        double trips = 0.0, windows = 0.0;
        for (const auto& m : trip_marks_) trips += x_.seconds_between(m[0], m[1]);
        for (const auto& m : window_marks_) {
          windows += x_.seconds_between(m[0], m[2]);
          step_phases_.gpu_device_experts += x_.seconds_between(m[0], m[1]);
          step_phases_.gpu_output += x_.seconds_between(m[2], m[3]);
        }
        step_phases_.gpu_window = windows;
        res.step_window_phases.push_back(step_phases_);
        res.step_gpu_span_seconds.push_back(x_.seconds_between(span0, span1));
        res.step_routing_trip_seconds.push_back(trips);
        res.step_overlap_window_seconds.push_back(windows);
        res.step_host_expert_bytes.push_back(decode_host_expert_bytes_ - host_bytes0);
        res.step_cpu_expert_seconds.push_back(decode_cpu_expert_seconds_ - cpu_seconds0);
      }
      sample_used();
      if (o.progress) o.progress(phase::decode, s, steps);
    }
    if (o.progress && !res.step_seconds.empty() && int(res.step_seconds.size()) < steps)
      o.progress(phase::decode, steps, steps);  // every sequence stopped early: close the bar
    x_.sync();
    if constexpr (requires { hybrid_->engine().caller_stream_launches(); })
      res.device.caller_stream_steps = hybrid_->engine().caller_stream_launches();
    res.device.decode_graph_launches = graph_launches_;
    res.device.decode_graph_captures = graph_captures_;
    res.device.decode_graph_fallbacks = graph_fallbacks_;
    res.device.decode_graph_fallback_reason = graph_fallback_why_;
    counting_ = counting::off;

    res.usage = cache_->usage();  // with the stopped sequences' blocks returned
    res.policy_final = cache_->policy().describe();
    sample_used();
    res.device.peak_used_bytes = peak_used_;
    res.device.peak_process_bytes = process_readable_ ? peak_process_ : -1;
    res.device.process_memory_source = x_.process_memory_source();
    res.device.cpu_expert_seconds = cpu_expert_seconds_;
    res.device.cpu_expert_rows = cpu_expert_rows_;
    res.device.grouped_moe_passes = grouped_passes_;
    res.device.device_routed_moe_passes = device_routed_passes_;
    res.device.split_routed_moe_passes = split_passes_;
    res.device.prefill_expert_gemm = d_.grouped_prefill_gemm ? "grouped" : "batched";
    res.device.prefill_expert_groups = d_.fitted_expert_groups ? "fitted" : "ladder";
    res.device.per_expert_moe_passes = per_expert_passes_;
    res.device.device_experts_issue = d_.device_experts_during_cpu ? "during" : "before";
    res.device.batched_moe_passes = batched_passes_;
    res.device.batched_groups = batched_groups_;
    res.device.streamed_batched_passes = stream_batched_passes_;
    res.device.placement = d_.hot_placement ? "hot" : d_.layer_major_placement ? "layers" : "id";
    res.device.router_zipf = d_.router_zipf;
    res.device.prefill_routed_rows = prefill_rows_total_;
    res.device.prefill_device_rows = prefill_rows_device_;
    res.device.decode_routed_rows = decode_rows_total_;
    res.device.decode_device_rows_initial = decode_rows_device_initial_;
    res.device.decode_device_rows = decode_rows_device_;
    live.finish_all(*cache_, res);
    return res;
  }

 private:
  using wtype = gpu::wtype;

  struct wave {
    int begin = 0, end = 0;          ///< sequences [begin, end)
    std::vector<index_t> offset;     ///< token offsets of the sequences inside the wave, [end-begin+1]
  };

  // ---------------------------------------------------------------------------
  // Setup
  // ---------------------------------------------------------------------------

  void load_dense_weights(const std::function<void(int)>& on_layer) {
    gpu::device_loader<Exec> ld(x_, *src_);
    const index_t H = c_.hidden_size;
    m_.embed = ld.matrix("model.embed_tokens.weight", c_.vocab_size, H);
    m_.layers.resize(std::size_t(c_.num_layers));
    for (int l = 0; l < c_.num_layers; ++l) {
      gpu::dlayer& L = m_.layers[std::size_t(l)];
      const std::string p = "model.layers." + std::to_string(l);
      L.input_norm = ld.vector(p + ".input_layernorm.weight", H, 1.0f);
      L.post_norm = ld.vector(p + ".post_attention_layernorm.weight", H, 1.0f);
      const std::string a = p + ".self_attn";
      const bool bias = c_.attention_bias;
      if constexpr (mla) {
        const index_t qk = c_.qk_nope_head_dim + c_.qk_rope_head_dim;
        if (c_.q_lora_rank > 0) {
          L.q_a = ld.linear(a + ".q_a_proj", c_.q_lora_rank, H, bias);
          L.q_a_norm = ld.vector(a + ".q_a_layernorm.weight", c_.q_lora_rank, 1.0f);
          L.q_b = ld.linear(a + ".q_b_proj", index_t(c_.num_heads) * qk, c_.q_lora_rank);
        } else {
          L.q = ld.linear(a + ".q_proj", index_t(c_.num_heads) * qk, H);
        }
        L.kv_a = ld.linear(a + ".kv_a_proj_with_mqa", c_.kv_lora_rank + c_.qk_rope_head_dim, H, bias);
        L.kv_a_norm = ld.vector(a + ".kv_a_layernorm.weight", c_.kv_lora_rank, 1.0f);
        L.kv_b = ld.matrix(a + ".kv_b_proj.weight", index_t(c_.num_heads) * (c_.qk_nope_head_dim + c_.v_head_dim),
                           c_.kv_lora_rank);
        L.o = ld.linear(a + ".o_proj", H, index_t(c_.num_heads) * c_.v_head_dim, bias);
        if (prec_ == wtype::f32 && L.kv_b.type == wtype::bf16) {  // widened once: the absorb/expand GEMMs read it per head
          float* w = static_cast<float*>(x_.alloc(L.kv_b.rows * L.kv_b.cols * 4, "kv_b_proj (fp32 copy)"));
          weights_bytes_ += L.kv_b.rows * L.kv_b.cols * 4;
          x_.run(gpu::widen_op{L.kv_b.p, wtype::bf16, w}, L.kv_b.rows * L.kv_b.cols);
          L.kv_b_f32 = w;
        }
      } else {
        const index_t d = c_.head_dim;
        L.q = ld.linear(a + ".q_proj", index_t(c_.num_heads) * d, H, bias);
        L.k = ld.linear(a + ".k_proj", index_t(c_.num_kv_heads) * d, H, bias);
        L.v = ld.linear(a + ".v_proj", index_t(c_.num_kv_heads) * d, H, bias);
        L.o = ld.linear(a + ".o_proj", H, index_t(c_.num_heads) * d, bias);
        if (c_.kind == arch::qwen3_moe) {
          L.q_norm = ld.vector(a + ".q_norm.weight", d, 1.0f);
          L.k_norm = ld.vector(a + ".k_norm.weight", d, 1.0f);
        }
      }
      L.is_moe = c_.is_moe_layer(l);
      if (!L.is_moe) {
        L.dense = ld.mlp({p + ".mlp.gate_proj", p + ".mlp.up_proj", p + ".mlp.down_proj"}, H, c_.intermediate_size);
      } else {
        const std::string m = p + (c_.kind == arch::mixtral ? ".block_sparse_moe" : ".mlp");
        L.router = ld.linear(m + ".gate", c_.num_experts, H, false, /*force_f32=*/true);
        if (d_.router_zipf > 0.0) {  // random weights: std = random_scale * 65536 / sqrt(3) (random_weight)
          const double stddev = double(src_->random_scale()) * 65536.0 / std::sqrt(3.0);
          const std::vector<float> b =
              zipf_router_bias(c_.num_experts, d_.router_zipf, c_.hidden_size, stddev, d_.router_zipf_seed, l);
          auto* bd = static_cast<float*>(x_.alloc(index_t(b.size()) * 4, "router Zipf bias"));
          x_.h2d(bd, b.data(), index_t(b.size()) * 4);
          weights_bytes_ += index_t(b.size()) * 4;
          L.router.bias = bd;
        }
        if (c_.kind == arch::deepseek_v2 && c_.n_shared_experts > 0) {
          L.has_shared = true;
          L.shared = ld.mlp({m + ".shared_experts.gate_proj", m + ".shared_experts.up_proj", m + ".shared_experts.down_proj"},
                            H, index_t(c_.moe_intermediate_size) * c_.n_shared_experts);
        }
        L.experts.resize(std::size_t(c_.num_experts));
        L.on_host.assign(std::size_t(c_.num_experts), 0);
        L.host_experts.resize(std::size_t(c_.num_experts));
      }
      if (on_layer) on_layer(l);
    }
    m_.final_norm = ld.vector("model.norm.weight", H, 1.0f);
    if (c_.tie_word_embeddings)
      m_.lm_head.w = m_.embed;
    else
      m_.lm_head = ld.linear("lm_head", c_.vocab_size, H);
    weights_bytes_ += ld.bytes();
    const std::vector<float>& f = rope_.inv_freq();
    inv_freq_ = static_cast<float*>(x_.alloc(index_t(f.size()) * 4, "RoPE frequencies"));
    x_.h2d(inv_freq_, f.data(), index_t(f.size()) * 4);
  }

  void plan_waves(const std::vector<std::vector<int>>& prompts) {
    waves_.clear();
    const int B = int(prompts.size());
    const index_t limit = std::max<index_t>(1, d_.prefill_chunk_tokens);
    for (int i = 0; i < B;) {
      wave w;
      w.begin = i;
      w.offset.push_back(0);
      index_t n = 0;
      while (i < B && (n == 0 || n + index_t(prompts[std::size_t(i)].size()) <= limit)) {
        n += index_t(prompts[std::size_t(i)].size());
        w.offset.push_back(n);
        ++i;
      }
      w.end = i;
      waves_.push_back(std::move(w));
    }
  }

  template <class T>
  T* buffer(index_t count, const char* what) {
    const index_t bytes = std::max<index_t>(count, 1) * index_t(sizeof(T));
    workspace_bytes_ += bytes;
    return static_cast<T*>(x_.alloc(bytes, what));
  }
  void* buffer_typed(index_t count, wtype t, const char* what) {
    const index_t bytes = std::max<index_t>(count, 1) * gpu::type_bytes(t);
    workspace_bytes_ += bytes;
    return x_.alloc(bytes, what);
  }

  void allocate_workspaces(const std::vector<std::vector<int>>& prompts) {
    const int B = int(prompts.size());
    index_t T = B, longest = 1;
    for (const wave& w : waves_) T = std::max(T, w.offset.back());
    for (const auto& p : prompts) longest = std::max(longest, index_t(p.size()));
    T_ = T;
    // the MoE passes' tokens at most: a prefill wave's chunk (prefill_moe_chunk_tokens), at least a decode batch
    const index_t Tm = d_.prefill_moe_chunk_tokens > 0 ? std::min(T, std::max<index_t>(d_.prefill_moe_chunk_tokens, B)) : T;
    moe_tokens_cap_ = Tm;
    const index_t H = c_.hidden_size;
    const int hq = c_.num_heads;
    const int hkv = layout().kv_heads();
    // cuBLAS's workspace, a buffer of ours (no allocation inside a decode graph's capture; graphs on or off alike)
    if constexpr (requires(Exec& e) { e.set_blas_workspace(nullptr, index_t{0}); })
      x_.set_blas_workspace(buffer<std::byte>(Exec::blas_workspace_bytes, "cuBLAS workspace"), Exec::blas_workspace_bytes);
    ids_ = buffer<int>(T, "token ids");
    pos_ = buffer<index_t>(T, "positions");
    x_buf_ = buffer<float>(T * H, "hidden states");
    h_ = buffer<float>(T * H, "normalised hidden states");
    y_ = buffer<float>(T * H, "layer outputs");
    y2_ = buffer<float>(Tm * H, "shared-expert outputs");  // also the last prompt rows at the head (B <= Tm)
    q_ = buffer<float>(T * hq * QD, "queries");
    att_ = buffer<float>(T * hq * VD, "attention outputs");
    index_t max_in = std::max<index_t>(H, index_t(hq) * VD);
    index_t inter = 0;
    if constexpr (mla) {
      const index_t qk = c_.qk_nope_head_dim + c_.qk_rope_head_dim;
      qf_ = buffer<float>(T * hq * qk, "MLA full queries");
      if (c_.q_lora_rank > 0) qa_ = buffer<float>(T * c_.q_lora_rank, "MLA q LoRA");
      kvf_[0] = buffer<float>(T * ROW, "MLA latent rows (fp32)");
      kvb_[0] = buffer<writescope::bf16>(T * ROW, "MLA latent rows (bf16)");
      vexp_ = buffer<float>(T * hq * c_.v_head_dim, "MLA expanded values");
      max_in = std::max({max_in, index_t(c_.q_lora_rank), index_t(hq) * qk, index_t(hq) * c_.v_head_dim});
    } else {
      for (int p = 0; p < 2; ++p) {
        kvf_[std::size_t(p)] = buffer<float>(T * hkv * ROW, "K/V (fp32)");
        kvb_[std::size_t(p)] = buffer<writescope::bf16>(T * hkv * ROW, "K/V (bf16)");
      }
    }
    const index_t before_moe = workspace_bytes_;
    bool any_moe = false;
    for (int l = 0; l < c_.num_layers; ++l) {
      if (c_.is_moe_layer(l)) {
        any_moe = true;
        inter = std::max<index_t>(inter, c_.moe_intermediate_size);
        if (c_.kind == arch::deepseek_v2) inter = std::max<index_t>(inter, index_t(c_.moe_intermediate_size) * c_.n_shared_experts);
      } else {
        inter = std::max<index_t>(inter, c_.intermediate_size);
      }
    }
    max_in = std::max(max_in, inter);
    g_ = buffer<float>(T * inter, "MLP gate");
    u_ = buffer<float>(T * inter, "MLP up");
    if (any_moe) {
      const index_t E = c_.num_experts, k = c_.experts_per_tok;
      router_logits_ = buffer<float>(Tm * E, "router logits");
      sel_e_ = buffer<int>(Tm * k, "routing: experts");
      sel_w_ = buffer<float>(Tm * k, "routing: weights");
      // one upload per MoE layer: gather rows, combine rows, combine weights, expert row offsets
      // batched prefill experts (bf16, bf16 experts): padded packed rows and the operand tables
      batched_prefill_ = d_.batched_prefill_experts && prec_ == wtype::bf16 && T > B &&
                         gpu::expert_bytes(c_, *src_, first_moe_layer()) == 6 * H * c_.moe_intermediate_size;
      // packed rows: a batched prefill adds at most batch_pad - 1 per expert and 1/8 of the rest (padded_rows)
      const index_t np_cap = Tm * k + (batched_prefill_ ? E * batch_pad + Tm * k / 8 : 0);
      padded_rows_cap_ = np_cap;
      route_cap_ints_ = np_cap + 2 * Tm * k + E + 1 + 2 + (batched_prefill_ ? 2 * 9 * E : 0);
      route_dev_ = buffer<int>(route_cap_ints_, "routing: rows, weights, expert offsets, batched GEMM tables");
      if (batched_prefill_ && d_.grouped_prefill_gemm) x_.check_grouped_gemm();  // refused at init, not mid-prefill
      if (d_.grouped_experts) {
        grouped_rows_cap_ = index_t(B) * k;  // decode steps only
        eg_ = buffer<float>(grouped_rows_cap_ * c_.moe_intermediate_size, "grouped experts: gate-up outputs");
      }
      // fp32 expert inputs (xg_): allocated by place_and_load_experts, which
      // knows whether host experts exist. A batched prefill that gathers its
      // rows to bf16 needs fp32 rows only for the decode steps and for a
      // prefill wave whose host experts run on the CPU.
      xg_full_rows_ = np_cap;
      xg_small_rows_ = np_cap;
      xg_cpu_wave_rows_ = np_cap;
      if (batched_prefill_ && gpu::fits_x4(H, h_)) {
        xg_small_rows_ = std::min(np_cap, index_t(B) * k);
        // a wave runs its host experts on the CPU when it routes fewer than
        // stream_min_rows rows per expert on average (begin_streaming_wave)
        const index_t cpu_pairs = index_t(std::ceil(d_.stream_min_rows * double(E)));
        xg_cpu_wave_rows_ = std::clamp<index_t>(cpu_pairs + E * batch_pad + cpu_pairs / 8 + 1, xg_small_rows_, np_cap);
      }
      yg_ = buffer<float>(np_cap * H, "expert outputs");
      if (batched_prefill_) {
        const index_t I = c_.moe_intermediate_size;
        x16_ = buffer<std::uint16_t>(np_cap * H, "batched prefill experts: bf16 inputs");
        g_batch_ = buffer<float>(np_cap * I, "batched prefill experts: gate outputs");
        u_batch_ = buffer<float>(np_cap * I, "batched prefill experts: up outputs");
        a16_ = buffer<std::uint16_t>(np_cap * I, "batched prefill experts: bf16 SiLU products");
        // the grouping on the device: sorted experts and pairs, pair indices, expert bounds, sort scratch
        sort_keys_ = buffer<unsigned>(Tm * k, "prefill routing: sorted experts");
        sort_pairs_ = buffer<int>(Tm * k, "prefill routing: sorted pairs");
        pair_ids_ = buffer<int>(Tm * k, "prefill routing: pair indices");
        expert_first_ = buffer<int>(E + 1, "prefill routing: expert bounds");
        sort_temp_bytes_ = index_t(Exec::sort_pairs_temp_bytes(Tm * k));
        sort_temp_ = buffer<std::byte>(sort_temp_bytes_, "prefill routing: sort scratch");
        x_.run(gpu::iota_op{pair_ids_}, Tm * k);
      }
    }
    moe_workspace_bytes_ = workspace_bytes_ - before_moe + (any_moe ? Tm * H * index_t(sizeof(float)) : 0);  // + y2_
    if (prec_ == wtype::bf16) {
      act16_cap_ = T * max_in;
      act16_ = buffer<std::uint16_t>(act16_cap_, "bf16 GEMM inputs");
    } else {
      wide_cap_ = std::max<index_t>(index_t{16} << 20, max_in);
      wide_ = buffer<float>(wide_cap_, "fp32-widened weight rows");
    }
    if (use_flash_) {  // flash prefill: bf16 queries (and MLA's expanded per-head K/V); no score blocks
      wave_offsets_ = buffer<int>(B + 1, "prefill wave offsets");
      if constexpr (mla) {
        const index_t qk = c_.qk_nope_head_dim + c_.qk_rope_head_dim, vh = c_.v_head_dim;
        qb_ = buffer<std::uint16_t>(T * hq * qk, "flash prefill queries (bf16)");
        cbuf_ = buffer<float>(T * c_.kv_lora_rank, "MLA prefill latent (compact)");
        kvx_ = buffer<float>(T * hq * (c_.qk_nope_head_dim + vh), "MLA prefill expanded K/V (fp32)");
        kx_ = buffer<std::uint16_t>(T * hq * qk, "MLA prefill keys (bf16)");
        vx_ = buffer<std::uint16_t>(T * hq * vh, "MLA prefill values (bf16)");
      } else {
        qb_ = buffer<std::uint16_t>(T * hq * QD, "flash prefill queries (bf16)");
      }
    } else {
      // prefill attention blocks: scores [hq][rows][keys] fp32 + probabilities in the GEMM type
      const int ps = gpu::type_bytes(prec_);
      const index_t per_row = index_t(hq) * longest * (4 + ps);
      rows_blk_ = std::clamp<index_t>(d_.prefill_attention_bytes / std::max<index_t>(per_row, 1), 1, longest);
      qp_ = buffer_typed(index_t(hq) * rows_blk_ * QD, prec_, "prefill packed queries");
      s_ = buffer<float>(index_t(hq) * rows_blk_ * longest, "prefill scores");
      p_ = buffer_typed(index_t(hq) * rows_blk_ * longest, prec_, "prefill probabilities");
      op_ = buffer<float>(index_t(hq) * rows_blk_ * VD, "prefill block outputs");
    }
    last_rows_ = buffer<int>(B, "last prompt rows");
    head_n_ = buffer<float>(index_t(B) * H, "final norm");
    logits_ = buffer<float>(index_t(B) * c_.vocab_size, "logits");
    argmax_keys_ = buffer<std::uint64_t>(B, "greedy selection keys");
    argmax_keys_host_mem_ = x_.host_staging(index_t(B) * 8);
    argmax_keys_host_ = reinterpret_cast<std::uint64_t*>(argmax_keys_host_mem_.data());
    // Page-locked: the per-step copy of B x vocab fp32 logits (13 MiB for
    // DeepSeek-V2-Lite at batch 32) runs at the link's rate, not a pageable one.
    logits_host_mem_ = x_.host_staging(index_t(B) * c_.vocab_size * 4);
    logits_host_ = reinterpret_cast<float*>(logits_host_mem_.data());
    (void)hkv;
    choose_prefill_attention();
  }

  index_t device_used() const {
    if constexpr (Exec::is_emulated) {
      const writescope::region_usage u = cache_->usage();
      return x_.allocated_bytes() + u.d_window_bytes + u.ping_pong_bytes + u.hbm_region_bytes;
    } else {
      return x_.device_used_bytes();
    }
  }

  int first_moe_layer() const {
    for (int l = 0; l < c_.num_layers; ++l)
      if (c_.is_moe_layer(l)) return l;
    return -1;
  }

  /// Whether the prefill uses the flash kernel: bf16 precision, not switched
  /// off, and head dims the kernel is built for.
  bool flash_applies() const {
    if (!d_.flash_prefill || prec_ != wtype::bf16) return false;
    auto built = [](int dqk, int dv) {  // the (qk, v) head dims the kernel is instantiated for
      for (const gpu::flash_prefill_dims& d : gpu::flash_prefill_supported_dims)
        if (d.dqk == dqk && d.dv == dv) return true;
      return false;
    };
    if constexpr (mla)
      return built(c_.qk_nope_head_dim + c_.qk_rope_head_dim, c_.v_head_dim);
    else
      return built(Layout::head_dim, Layout::head_dim);
  }

  /// The device memory everything must fit: --vram-budget, else the device's
  /// total less 1 GiB (in the units of device_used(): total - free); the
  /// emulated device without a budget has no bound.
  index_t budget_bytes() const {
    if (d_.vram_budget_bytes > 0) return d_.vram_budget_bytes;
    if constexpr (Exec::is_emulated)
      return std::numeric_limits<index_t>::max() / 4;
    else
      return x_.device_total_bytes() - (index_t{1} << 30);
  }

  /// One routed expert's footprint in the device slab (three matrices,
  /// 256-byte aligned) and its weights' bytes.
  std::pair<index_t, index_t> expert_slab_and_bytes(int layer) const {
    const index_t H = c_.hidden_size, I = c_.moe_intermediate_size;
    const index_t ebytes = gpu::expert_bytes(c_, *src_, layer);
    const index_t esz = ebytes / (3 * H * I);  // bytes per element on the device
    using loader = gpu::device_loader<Exec>;
    return {2 * loader::slab_bytes(I * H * esz) + loader::slab_bytes(H * I * esz), ebytes};
  }

  /// The split of the device memory left after the weights, the cache's
  /// D-window and ping-pong and the workspaces between the routed experts and
  /// the HBM-resident KV region (vram_split.hpp), into rep: the region's
  /// tokens per layer (hbm_capacity_tokens; 0: none), the densities and the
  /// reason. Throws config_error when a fixed region does not fit.
  void choose_vram_split(const std::vector<std::vector<int>>& prompts, const run_options& o, device_report& rep) {
    rep.hbm_kv = d_.hbm_kv == hbm_kv_mode::off ? "off" : d_.hbm_kv == hbm_kv_mode::fixed ? "fixed" : "auto";
    vram_split_inputs in;
    in.mode = d_.hbm_kv;
    in.cap_bytes = d_.hbm_kv_bytes;
    if (o.kv.kv_vram_budget_bytes > 0) {  // the D-window and ping-pong count first
      const writescope::region_usage u = cache_->usage();
      in.kv_budget_left_bytes = std::max<index_t>(0, o.kv.kv_vram_budget_bytes - u.d_window_bytes - u.ping_pong_bytes);
    }
    in.sized = !(Exec::is_emulated && d_.vram_budget_bytes <= 0);
    const index_t H4 = index_t(c_.hidden_size) * index_t(sizeof(float));
    const index_t reserve = Exec::is_emulated ? 0 : d_.budget_reserve_bytes;
    const index_t budget = budget_bytes();
    in.avail_bytes = std::max<index_t>(0, budget - device_used() - xg_small_rows_ * H4 - reserve);
    const int first_moe = first_moe_layer();
    if (first_moe >= 0) {
      const auto [slab, bytes] = expert_slab_and_bytes(first_moe);
      index_t moe_layers = 0;
      for (int l = 0; l < c_.num_layers; ++l) moe_layers += c_.is_moe_layer(l) ? 1 : 0;
      in.experts_total = moe_layers * c_.num_experts;
      if (d_.max_gpu_experts >= 0) in.experts_total = std::min<index_t>(in.experts_total, d_.max_gpu_experts);
      in.expert_slab_bytes = slab;
      in.expert_host_bytes = bytes;
      // once an expert is on the host: its fp32 input rows and the staging
      // ring (as large as it gets: every expert of a layer on the host)
      if (xg_small_rows_ < xg_full_rows_)
        in.host_expert_floor_bytes = ((d_.stream_experts ? xg_cpu_wave_rows_ : xg_full_rows_) - xg_small_rows_) * H4;
      if (d_.stream_experts)
        in.host_expert_floor_bytes += index_t(staging_slots_for(c_.num_experts, budget, slab)) * slab;
      in.num_experts = c_.num_experts;
      in.experts_per_token = c_.experts_per_tok;
    }
    in.batch = int(prompts.size());
    in.cpu_expert_bytes_per_second = d_.cpu_expert_bytes_per_second;
    const writescope::partition_spec& sp = cache_->spec();
    in.batch_tokens = sp.d_window_tokens;
    for (const auto& p : prompts)  // the whole eviction batches each sequence can place
      in.kv_demand_tokens += (index_t(p.size()) + o.max_new_tokens) / sp.d_window_tokens * sp.d_window_tokens;
    in.kv_token_bytes = cache_->format().block_bytes() / sp.block_tokens * sp.num_layers;
    in.num_layers = sp.num_layers;
    in.cpu_seconds_per_token = d_.kv_cpu_seconds_per_token;
    in.gpu_seconds_per_token = d_.kv_gpu_seconds_per_token;
    in.launch_seconds_per_token = d_.kv_launch_seconds_per_token;
    in.hbm_seconds_per_token = d_.kv_hbm_seconds_per_token;
    const vram_split s = ws_moe::split_vram(in);
    rep.split_avail_bytes = in.avail_bytes;
    rep.hbm_capacity_tokens = s.hbm_tokens;
    rep.kv_demand_tokens = s.kv_demand_tokens;
    rep.expert_use_probability = s.expert_use_probability;
    rep.expert_seconds_per_gib = s.expert_seconds_per_gib;
    rep.kv_seconds_per_gib = s.kv_seconds_per_gib;
    rep.split_first = s.first;
    rep.split_reason = s.reason;
  }

  /// The staging ring's slots for `host_per_layer` host experts in the
  /// layer with the most (d_.expert_staging_bytes, else two layers' where
  /// that takes at most an eighth of the budget, else one layer's within that
  /// eighth; at least 2). Never fewer for more host experts.
  int staging_slots_for(index_t host_per_layer, index_t budget, index_t eslab) const {
    index_t want = d_.expert_staging_bytes > 0 ? d_.expert_staging_bytes / eslab
                   : 2 * host_per_layer * eslab <= budget / 8
                       ? 2 * host_per_layer
                       : std::min(host_per_layer, std::max<index_t>(2, budget / 8 / eslab));
    return int(std::clamp<index_t>(want, 2, std::max<index_t>(2, 2 * host_per_layer)));
  }

  void place_and_load_experts(device_report& rep) {
    int first_moe = -1;
    std::vector<int> moe_layers;
    for (int l = 0; l < c_.num_layers; ++l)
      if (m_.layers[std::size_t(l)].is_moe) {
        if (first_moe < 0) first_moe = l;
        moe_layers.push_back(l);
      }
    rep.host_experts.assign(std::size_t(c_.num_layers), {});
    if (moe_layers.empty()) return;
    const index_t H = c_.hidden_size, I = c_.moe_intermediate_size;
    const index_t eslab = expert_slab_and_bytes(first_moe).first;
    const index_t nl = index_t(moe_layers.size());
    const index_t E = c_.num_experts;
    const index_t total = nl * E;
    const index_t budget = budget_bytes();
    rep.budget_bytes = Exec::is_emulated && d_.vram_budget_bytes <= 0 ? 0 : budget;  // 0: no budget (emulated)
    // the fp32 expert inputs (xg_, allocated below) are a workspace: their
    // size depends on whether host experts exist (allocate_workspaces' sizes)
    const index_t H4 = H * index_t(sizeof(float));
    const index_t used = device_used() + xg_small_rows_ * H4;
    const index_t reserve = Exec::is_emulated ? 0 : d_.budget_reserve_bytes;
    if (d_.vram_budget_bytes > 0 && used + reserve > budget)
      throw writescope::config_error("--vram-budget " + writescope::format_bytes(budget) +
                                     " cannot hold the non-expert weights, the KV cache's device regions and the "
                                     "workspaces: they take " + writescope::format_bytes(used) + " (+ " +
                                     writescope::format_bytes(reserve) + " kept free for cuBLAS and the engine)");
    index_t avail = std::max<index_t>(0, budget - used - reserve);
    index_t fit = std::min(total, avail / eslab);
    if (d_.max_gpu_experts >= 0) fit = std::min<index_t>(fit, d_.max_gpu_experts);
    xg_rows_ = xg_small_rows_;
    if (fit < total && xg_small_rows_ < xg_full_rows_) {  // host experts: CPU prefill waves read fp32 rows
      xg_rows_ = d_.stream_experts ? xg_cpu_wave_rows_ : xg_full_rows_;
      avail = std::max<index_t>(0, avail - (xg_rows_ - xg_small_rows_) * H4);
      fit = std::min(fit, avail / eslab);
    }
    // The staging ring for streamed host experts, inside the budget: the
    // experts then placed on the device shrink until both fit.
    int slots = 0;
    if (d_.stream_experts && fit < total) {
      for (int pass = 0; pass < 4; ++pass) {
        // the most host experts one layer has under the placement order
        const index_t host_per_layer =
            d_.layer_major_placement ? std::min(E, total - fit) : (total - fit + nl - 1) / nl;
        slots = staging_slots_for(host_per_layer, budget, eslab);
        if (index_t(slots) * eslab > avail)
          throw writescope::config_error(
              "--vram-budget " + writescope::format_bytes(budget) + ": the expert staging ring (" + std::to_string(slots) +
              " slots of " + writescope::format_bytes(eslab) + ") does not fit the " + writescope::format_bytes(avail) +
              " left after the non-expert weights, the KV regions and the workspaces (use --stream-experts off, a "
              "smaller --expert-staging-mib or a larger --vram-budget)");
        const index_t fit2 = std::min(fit, (avail - index_t(slots) * eslab) / eslab);
        if (fit2 == fit) break;
        fit = fit2;
      }
    }
    const index_t host_count = total - fit;
    // host arena: one block per host expert (gate, up, down contiguous), page-locked when streaming
    gpu::device_loader<Exec> ld(x_, *src_);
    index_t host_bytes = 0;
    std::vector<index_t> host_off(std::size_t(total), -1);  // [layer idx][expert]
    // placement order: (MoE layer index, expert) pairs, the first `fit` on the
    // device. Expert-major (default): expert 0 of every layer, then expert 1, ...
    // Layer-major (--expert-placement layers): layer 0's experts, then layer 1's.
    std::vector<std::pair<index_t, int>> order;
    order.reserve(std::size_t(total));
    if (d_.layer_major_placement)
      for (index_t li = 0; li < nl; ++li)
        for (index_t e = 0; e < E; ++e) order.emplace_back(li, int(e));
    else
      for (index_t e = 0; e < E; ++e)
        for (index_t li = 0; li < nl; ++li) order.emplace_back(li, int(e));
    {
      index_t placed = 0;
      for (const auto& [li, e] : order) {
        if (placed < fit) {
          ++placed;
          continue;
        }
        host_off[std::size_t(li * E + e)] = host_bytes;
        const index_t b = ld.host_expert_bytes(gpu::names_of_expert(c_, moe_layers[std::size_t(li)], int(e)), H, I);
        if (slots > 0 && b > eslab)  // a staging slot holds one expert of the first expert's dtype
          throw writescope::config_error("expert " + std::to_string(e) + " of layer " +
                                         std::to_string(moe_layers[std::size_t(li)]) + " takes " +
                                         writescope::format_bytes(b) + " in host memory, more than a staging slot (" +
                                         writescope::format_bytes(eslab) +
                                         "): the experts mix dtypes; use --stream-experts off");
        host_bytes += b;
      }
    }
    const double limit_gib = d_.max_host_expert_gib > 0 ? d_.max_host_expert_gib : 0.8 * d_.physical_memory_gib;
    if (limit_gib > 0 && double(host_bytes) > limit_gib * double(index_t{1} << 30))
      throw writescope::config_error("the experts that do not fit the VRAM budget (" + writescope::format_bytes(budget) +
                                     ") need " + writescope::format_bytes(host_bytes) + " of host memory, more than " +
                                     std::to_string(limit_gib) + " GiB allowed (use --layers N or a larger --vram-budget)");
    if (fit > 0) ld.use_slab(x_.alloc(fit * eslab, "routed experts (device slab)"), fit * eslab);
    if (xg_full_rows_ > 0) xg_ = buffer<float>(xg_rows_ * H, "expert inputs (fp32)");
    if (host_bytes > 0) {
      host_arena_ = slots > 0 ? x_.host_staging(host_bytes) : x_.host_pageable(host_bytes);
      host_arena_pinned_ = slots > 0;
    }
    index_t placed = 0;
    for (const auto& [li, e] : order) {
      const int l = moe_layers[std::size_t(li)];
      gpu::dlayer& L = m_.layers[std::size_t(l)];
      const gpu::expert_names n = gpu::names_of_expert(c_, l, e);
      if (placed < fit) {
        L.experts[std::size_t(e)] = ld.mlp(n, H, I);
        ++placed;
      } else {
        L.on_host[std::size_t(e)] = 1;
        L.host_experts[std::size_t(e)] = ld.host_mlp(n, H, I, host_arena_.data() + host_off[std::size_t(li * E + e)]);
        rep.experts_host_bytes += L.host_experts[std::size_t(e)].bytes();
        rep.host_experts[std::size_t(l)].push_back(e);
      }
    }
    rep.experts_total = int(total);
    rep.experts_gpu = int(placed);
    rep.experts_host = int(host_count);
    rep.experts_gpu_bytes = fit * eslab;
    any_host_experts_ = placed < total;
    if (slots > 0) {
      staging_slots_ = slots;
      staging_slot_bytes_ = eslab;
      staging_ = static_cast<std::byte*>(x_.alloc(index_t(slots) * eslab, "expert staging ring"));
      workspace_bytes_ += index_t(slots) * eslab;
      x_.ring_setup(slots);
      rep.staging_slots = slots;
      rep.staging_bytes = index_t(slots) * eslab;
      rep.stream_min_rows = d_.stream_min_rows;
    }
    rep.expert_kernels = build_expert_tables(moe_layers);
    initial_on_host_.assign(std::size_t(c_.num_layers), {});
    expert_rows_.assign(std::size_t(c_.num_layers), {});
    for (int l : moe_layers) {
      initial_on_host_[std::size_t(l)] = m_.layers[std::size_t(l)].on_host;
      expert_rows_[std::size_t(l)].assign(std::size_t(E), 0);
    }
    // the batched prefill GEMMs read bf16 weights: every device expert must be bf16
    for (int l : moe_layers)
      for (int e = 0; e < c_.num_experts && batched_prefill_; ++e) {
        const gpu::dlayer& L = m_.layers[std::size_t(l)];
        if (L.on_host[std::size_t(e)]) continue;
        const gpu::dmlp& m = L.experts[std::size_t(e)];
        if (m.gate.w.type != wtype::bf16 || m.up.w.type != wtype::bf16 || m.down.w.type != wtype::bf16)
          batched_prefill_ = false;
      }
  }

  /// The device pointer tables of the grouped expert kernels (one per MoE
  /// layer and matrix; null for a host expert), or why the experts run per
  /// expert: grouping off, no device expert, or a device expert the kernel
  /// cannot read (not bf16, a bias, a row not 16-byte aligned).
  std::string build_expert_tables(const std::vector<int>& moe_layers) {
    if (!d_.grouped_experts) return "one cuBLAS product per expert (--grouped-experts off)";
    const index_t H = c_.hidden_size, I = c_.moe_intermediate_size;
    if (H % 8 != 0 || I % 8 != 0) return "one cuBLAS product per expert (hidden or expert width not a multiple of 8)";
    auto unreadable = [](const gpu::dlinear& w) -> const char* {  // why the kernel cannot read it, or null
      if (w.w.type != wtype::bf16) return "an expert's weights are not bf16";
      if (w.bias != nullptr) return "an expert has a bias";
      if (reinterpret_cast<std::uintptr_t>(w.w.p) % 16 != 0) return "an expert's weights are not 16-byte aligned";
      return nullptr;
    };
    bool any = false;
    for (int l : moe_layers) {
      const gpu::dlayer& L = m_.layers[std::size_t(l)];
      for (int e = 0; e < c_.num_experts; ++e) {
        if (L.on_host[std::size_t(e)]) continue;
        const gpu::dmlp& m = L.experts[std::size_t(e)];
        for (const gpu::dlinear* w : {&m.gate, &m.up, &m.down})
          if (const char* why = unreadable(*w)) return std::string("one cuBLAS product per expert (") + why + ")";
        any = true;
      }
    }
    if (!any) return "none on the device";
    const index_t E = c_.num_experts;
    for (int l : moe_layers) {
      gpu::dlayer& L = m_.layers[std::size_t(l)];
      auto* t = static_cast<const void**>(x_.alloc(3 * E * index_t(sizeof(void*)), "grouped experts: weight tables"));
      workspace_bytes_ += 3 * E * index_t(sizeof(void*));
      L.expert_tables = t;
      upload_expert_table(L);
    }
    grouped_ok_ = true;
    return "grouped (gate-up and down: one launch each per MoE layer) when at most " +
           std::to_string(d_.grouped_expert_max_rows) + " rows per expert and at least " +
           std::to_string(d_.grouped_expert_min_active) + " device experts with rows; else one cuBLAS product per expert";
  }

  /// Layer L's grouped-kernel table [3][E] (gate, up, down pointers; null for
  /// a host expert) written into its device array from L.experts / L.on_host.
  void upload_expert_table(gpu::dlayer& L) {
    if (L.expert_tables == nullptr) return;
    const index_t E = c_.num_experts;
    std::vector<const void*> tab(std::size_t(3 * E));
    for (int e = 0; e < c_.num_experts; ++e) {
      const bool dev = !L.on_host[std::size_t(e)];
      const gpu::dmlp& m = L.experts[std::size_t(e)];
      tab[std::size_t(e)] = dev ? m.gate.w.p : nullptr;
      tab[std::size_t(E + e)] = dev ? m.up.w.p : nullptr;
      tab[std::size_t(2 * E + e)] = dev ? m.down.w.p : nullptr;
    }
    x_.h2d(const_cast<const void**>(L.expert_tables), tab.data(), 3 * E * index_t(sizeof(void*)));
  }

  /// Hot placement (--expert-placement hot), once between the prefill and the
  /// first decode step. Per MoE layer: host experts by prefill rows
  /// descending, device experts by prefill rows ascending (ties: lower id
  /// first); pair i swaps while the host expert got more rows than the device
  /// one, at most migrate_max_experts pairs. A swap (same dtype and bytes on
  /// both sides, else the pair is skipped): the device expert's matrices to a
  /// page-locked host buffer of one expert (D2H), the host expert's bytes into
  /// the device expert's slab matrices (H2D), the buffer into the host expert's
  /// arena block; then L.experts, L.host_experts, L.on_host and the layer's
  /// grouped-kernel table follow. One copy of each expert remains, no device
  /// memory is added. With migrate_reload a layer with swaps is instead
  /// rebuilt from the weight source (reload_layer_experts): the same final state.
  void migrate_hot_experts(device_report& rep, bool decode = false) {
    const auto t0 = std::chrono::steady_clock::now();
    const index_t migrations0 = rep.migrations;
    const int E = c_.num_experts;
    rep.migrate_max_experts = d_.migrate_max_experts;
    rep.migrate_every_steps = d_.migrate_every_steps;
    writescope::host_allocation tmp;
    x_.sync();
    for (int l = 0; l < c_.num_layers; ++l) {
      gpu::dlayer& L = m_.layers[std::size_t(l)];
      if (!L.is_moe) continue;
      const std::vector<std::pair<int, int>> pairs = migration_pairs(L, l, rep);
      if (pairs.empty()) continue;
      if (d_.migrate_reload) {
        reload_layer_experts(L, l, pairs);
      } else {
        for (const auto& [h, d] : pairs) {
          gpu::hmlp& hm = L.host_experts[std::size_t(h)];
          gpu::dmlp& dm = L.experts[std::size_t(d)];
          const index_t bytes = hm.bytes();
          auto* arena = static_cast<std::byte*>(const_cast<void*>(hm.data()));
          if (tmp.size_bytes() < bytes) tmp = x_.host_staging(bytes);
          std::byte* t = tmp.data();
          const gpu::dlinear* parts[3] = {&dm.gate, &dm.up, &dm.down};
          index_t off = 0;
          for (const gpu::dlinear* w : parts) {  // the device expert out ...
            x_.d2h(t + off, w->w.p, w->w.bytes());
            off += w->w.bytes();
          }
          off = 0;
          for (const gpu::dlinear* w : parts) {  // ... the host expert in ...
            x_.h2d(const_cast<void*>(w->w.p), arena + off, w->w.bytes());
            off += w->w.bytes();
          }
          std::memcpy(arena, t, std::size_t(bytes));  // ... and the device expert into the freed host block
          L.experts[std::size_t(h)] = dm;
          L.host_experts[std::size_t(d)] = hm;
          L.experts[std::size_t(d)] = gpu::dmlp{};
          L.host_experts[std::size_t(h)] = gpu::hmlp{};
          L.on_host[std::size_t(h)] = 0;
          L.on_host[std::size_t(d)] = 1;
        }
        upload_expert_table(L);
      }
      for (const auto& [h, d] : pairs) {
        (void)d;
        ++rep.migrations;
        rep.migrate_h2d_bytes += L.experts[std::size_t(h)].gate.w.bytes() + L.experts[std::size_t(h)].up.w.bytes() +
                                 L.experts[std::size_t(h)].down.w.bytes();
      }
      rep.migrate_d2h_bytes = rep.migrate_h2d_bytes;  // every swap moves as much each way
      std::vector<int>& list = rep.host_experts[std::size_t(l)];
      list.clear();
      for (int e = 0; e < E; ++e)
        if (L.on_host[std::size_t(e)]) list.push_back(e);
    }
    x_.sync();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (decode) {  // the rounds after decode steps, apart from the one after the prefill
      ++rep.decode_migration_rounds;
      rep.decode_migrations += rep.migrations - migrations0;
      rep.decode_migrate_seconds += dt;
    } else {
      rep.migrate_seconds += dt;
    }
  }

  /// Layer l's (host expert, device expert) swaps: host experts by prefill
  /// rows descending, device experts ascending (stable: lower id first), pair i
  /// while the host one got more rows, at most migrate_max_experts; a pair
  /// whose two experts differ in a matrix's dtype or bytes is skipped (counted).
  std::vector<std::pair<int, int>> migration_pairs(const gpu::dlayer& L, int l, device_report& rep) const {
    const int E = c_.num_experts;
    const std::vector<index_t>& rows = expert_rows_[std::size_t(l)];
    std::vector<int> host, dev;
    for (int e = 0; e < E; ++e) (L.on_host[std::size_t(e)] ? host : dev).push_back(e);
    std::stable_sort(host.begin(), host.end(), [&](int a, int b) { return rows[std::size_t(a)] > rows[std::size_t(b)]; });
    std::stable_sort(dev.begin(), dev.end(), [&](int a, int b) { return rows[std::size_t(a)] < rows[std::size_t(b)]; });
    std::vector<std::pair<int, int>> pairs;
    for (std::size_t i = 0; i < std::min(host.size(), dev.size()) && int(pairs.size()) < d_.migrate_max_experts; ++i) {
      const int h = host[i], d = dev[i];
      if (rows[std::size_t(h)] <= rows[std::size_t(d)]) break;
      const gpu::hmlp& hm = L.host_experts[std::size_t(h)];
      const gpu::dmlp& dm = L.experts[std::size_t(d)];
      const wtype ht = hm.is_bf16() ? wtype::bf16 : wtype::f32;
      const gpu::dlinear* parts[3] = {&dm.gate, &dm.up, &dm.down};
      const gpu::hmat* hparts[3] = {&hm.gate, &hm.up, &hm.down};
      bool same = true;
      for (int q = 0; q < 3; ++q)
        same = same && parts[q]->w.type == ht && parts[q]->bias == nullptr && parts[q]->w.bytes() == hparts[q]->bytes();
      if (same)
        pairs.emplace_back(h, d);
      else
        ++rep.migrations_skipped;
    }
    return pairs;
  }

  /// --migration reload: layer l rebuilt from the weight source: every
  /// expert re-read into its place after the swaps (a device expert into its
  /// slab block, a host expert into its arena block), L.on_host, L.experts,
  /// L.host_experts and the grouped-kernel table assigned anew.
  void reload_layer_experts(gpu::dlayer& L, int l, const std::vector<std::pair<int, int>>& pairs) {
    const index_t H = c_.hidden_size, I = c_.moe_intermediate_size;
    const int E = c_.num_experts;
    using loader = gpu::device_loader<Exec>;
    std::vector<void*> slot(std::size_t(E), nullptr), block(std::size_t(E), nullptr);
    std::vector<index_t> slot_bytes(std::size_t(E), 0);
    for (int e = 0; e < E; ++e) {
      const gpu::dmlp& m = L.experts[std::size_t(e)];
      if (L.on_host[std::size_t(e)]) {
        block[std::size_t(e)] = const_cast<void*>(L.host_experts[std::size_t(e)].data());
      } else {
        slot[std::size_t(e)] = const_cast<void*>(m.gate.w.p);
        slot_bytes[std::size_t(e)] =
            loader::slab_bytes(m.gate.w.bytes()) + loader::slab_bytes(m.up.w.bytes()) + loader::slab_bytes(m.down.w.bytes());
      }
    }
    for (const auto& [h, d] : pairs) {
      slot[std::size_t(h)] = std::exchange(slot[std::size_t(d)], nullptr);
      slot_bytes[std::size_t(h)] = slot_bytes[std::size_t(d)];
      block[std::size_t(d)] = std::exchange(block[std::size_t(h)], nullptr);
    }
    for (int e = 0; e < E; ++e) {
      loader ld(x_, *src_);
      const gpu::expert_names n = gpu::names_of_expert(c_, l, e);
      if (slot[std::size_t(e)] != nullptr) {
        ld.use_slab(slot[std::size_t(e)], slot_bytes[std::size_t(e)]);
        L.experts[std::size_t(e)] = ld.mlp(n, H, I);
        L.host_experts[std::size_t(e)] = gpu::hmlp{};
        L.on_host[std::size_t(e)] = 0;
      } else {
        L.host_experts[std::size_t(e)] = ld.host_mlp(n, H, I, block[std::size_t(e)]);
        L.experts[std::size_t(e)] = gpu::dmlp{};
        L.on_host[std::size_t(e)] = 1;
      }
    }
    upload_expert_table(L);
  }

  /// Routed rows of this MoE pass (rows_, before padding) into the placement's
  /// counters: per expert in the prefill; in decode the share on the device
  /// now and under the placement at load.
  void count_rows(const gpu::dlayer& L, int l) {
    if (counting_ == counting::off) return;
    const int E = c_.num_experts;
    const std::vector<char>& init = initial_on_host_[std::size_t(l)];
    for (int e = 0; e < E; ++e) {
      const index_t m = rows_[std::size_t(e)];
      if (m == 0) continue;
      if (counting_ == counting::prefill) {
        expert_rows_[std::size_t(l)][std::size_t(e)] += m;
        prefill_rows_total_ += m;
        if (!L.on_host[std::size_t(e)]) prefill_rows_device_ += m;
      } else {
        if (d_.migrate_every_steps > 0) expert_rows_[std::size_t(l)][std::size_t(e)] += m;  // hot placement during the decode
        decode_rows_total_ += m;
        if (!L.on_host[std::size_t(e)]) decode_rows_device_ += m;
        if (!init[std::size_t(e)]) decode_rows_device_initial_ += m;
      }
    }
  }

  /// One decode step of the whole model (embedding, every layer with its
  /// cache append and hybrid attention step, MoE, LM head) on `n` throw-away
  /// sequences, before the real ones are admitted: the first launch of every
  /// decode kernel (CUDA loads modules lazily), the first cuBLAS call of every
  /// decode GEMM shape (n rows; the experts see the row counts their routing
  /// gives), the GPU engine's first launch and the CPU engine's first OpenMP
  /// team of its thread count happen here instead of in the first timed step.
  /// Nothing of it reaches the run: the sequences have no prompt, so nothing is
  /// placed and the policy routes nothing; their step has no CPU or streamed
  /// tokens, so the policy's online A (and B) see no sample; they are ended
  /// without flush, which returns their D-window slots and sequence ids, and the
  /// real sequences then get the same ids and slots as without the warm-up
  /// (their prefill and decode appends overwrite the slot rows before any read;
  /// attention reads only the rows written since). The logits are discarded;
  /// the sampler does not exist yet. CPU-expert statistics are reset.
  void warm_up(int n) {
    using namespace writescope;
    std::vector<sequence_id> seqs(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) seqs[std::size_t(i)] = cache_->begin_sequence(0);
    std::vector<int> ids(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i)  // distinct tokens, so the routers spread the rows over several experts
      ids[std::size_t(i)] = int((std::uint64_t(i) * 7919u + 1u) % std::uint64_t(c_.vocab_size));
    const std::vector<index_t> pos(static_cast<std::size_t>(n), 0);
    x_.h2d(ids_, ids.data(), index_t(n) * 4);
    x_.h2d(pos_, pos.data(), index_t(n) * 8);
    embed(n);
    generation_result scratch;
    for (int l = 0; l < c_.num_layers; ++l) layer_decode(l, seqs, scratch);
    (void)head(x_buf_, n);
    x_.sync();
    for (sequence_id id : seqs) cache_->end_sequence(id);
    warm_up_prefill();
    cpu_expert_seconds_ = 0.0;
    cpu_expert_rows_ = 0;
    grouped_passes_ = per_expert_passes_ = batched_passes_ = batched_groups_ = stream_batched_passes_ = 0;
    device_routed_passes_ = 0;
    split_passes_ = 0;
  }

  /// One untimed layer of the first prefill wave's shape on pseudo-random
  /// tokens, outside the cache: its projections, its attention (the cuDNN
  /// plan of that shape), and the MoE of the first MoE layer with the
  /// device-resident experts, plus, where host experts would be streamed, their
  /// products on a device expert's weights at the rows they get. The first
  /// call of each GEMM shape class (cuBLAS / cuBLASLt heuristics) and each
  /// kernel's lazy module load happen here instead of in the timed prefill
  /// (an engine's start-up profile run). Host experts are not run and nothing
  /// is appended to the cache: the outputs are scratch.
  void warm_up_prefill() {
    if (waves_.empty()) return;
    int lm = -1;
    for (int l = 0; l < c_.num_layers && lm < 0; ++l)
      if (m_.layers[std::size_t(l)].is_moe) lm = l;
    const wave& w = waves_.front();
    const index_t N = w.offset.back(), H = c_.hidden_size;
    ids_host_.resize(std::size_t(N));
    pos_host_.resize(std::size_t(N));
    for (std::size_t s = 0; s + 1 < w.offset.size(); ++s)
      for (index_t t = w.offset[s]; t < w.offset[s + 1]; ++t) {
        ids_host_[std::size_t(t)] = int((std::uint64_t(t) * 2654435761u + 7u) % std::uint64_t(c_.vocab_size));
        pos_host_[std::size_t(t)] = t - w.offset[s];
      }
    x_.h2d(ids_, ids_host_.data(), N * 4);
    x_.h2d(pos_, pos_host_.data(), N * 8);
    if (use_flash_) {
      wave_offsets_host_.assign(w.offset.begin(), w.offset.end());
      x_.h2d(wave_offsets_, wave_offsets_host_.data(), index_t(wave_offsets_host_.size()) * 4);
    }
    x_.reset_marks();
    moe_marks_.clear();
    embed(N);
    const gpu::dlayer& L0 = m_.layers.front();
    rms_norm(x_buf_, H, L0.input_norm, N, int(H), h_, H);
    project(L0, N);
    if (use_flash_) {
      flash_prefill_attention(L0, w);
      if (!mla) attention_output(L0, N);
      x_.run(gpu::add_op{x_buf_, y_}, N * H);
    }
    if (lm >= 0) {
      warming_ = true;
      try {
        ffn_residual(lm, N, false);
      } catch (...) {
        warming_ = false;
        throw;
      }
      warming_ = false;
    }
    x_.sync();
    x_.reset_marks();
    moe_marks_.clear();
  }

  // ---------------------------------------------------------------------------
  // Building blocks
  // ---------------------------------------------------------------------------

  /// The bf16 copy of `count` activations at `a` (bf16 precision) in the GEMM scratch.
  const void* act_bf16(const float* a, index_t count) {
    if (count > act16_cap_)
      throw std::logic_error("device_decoder: bf16 GEMM scratch of " + std::to_string(act16_cap_) + " elements, " +
                             std::to_string(count) + " needed");
    x_.run(gpu::convert_op{a, act16_, wtype::bf16}, count);
    return act16_;
  }

  /// The bf16 copy of `in` for several bf16 linear layers reading it (bf16
  /// precision; null otherwise: each layer then converts or reads fp32 itself).
  const void* shared_bf16_input(const float* in, index_t count, std::initializer_list<const gpu::dlinear*> layers) {
    if (prec_ != wtype::bf16) return nullptr;
    for (const gpu::dlinear* l : layers)
      if (l->w.type != wtype::bf16) return nullptr;
    return act_bf16(in, count);
  }

  /// out[n][W.rows] = in[n][W.cols] · Wᵀ (+ bias), in the configured precision.
  /// `in_bf16`: the bf16 copy of `in` when the caller made one (shared_bf16_input).
  /// `rows_vary`: n changes from call to call (a routed expert's rows): the
  /// product goes through cuda_exec::gemm_varying (one heuristic per class of n).
  void linear(const gpu::dlinear& L, const float* in, index_t n, float* out, const void* in_bf16 = nullptr,
              bool rows_vary = false) {
    const gpu::dmat& W = L.w;
    if (n == 0) return;
    if (W.type == wtype::f32) {
      x_.gemm(gpu::linear_desc(W.p, wtype::f32, W.rows, W.cols, in, n, out, W.rows), "linear (fp32)");
    } else if (prec_ == wtype::bf16) {
      const void* xb = in_bf16 ? in_bf16 : act_bf16(in, n * W.cols);
      const gpu::gemm_desc d = gpu::linear_desc(W.p, wtype::bf16, W.rows, W.cols, xb, n, out, W.rows);
      if (rows_vary)
        x_.gemm_varying(d, "linear (bf16, varying rows)");
      else
        x_.gemm(d, "linear (bf16)");
    } else {  // fp32 precision, bf16 weights: widen a block of rows at a time
      const index_t chunk = std::max<index_t>(1, wide_cap_ / W.cols);
      for (index_t o0 = 0; o0 < W.rows; o0 += chunk) {
        const index_t rows = std::min(chunk, W.rows - o0);
        x_.run(gpu::widen_op{static_cast<const std::uint16_t*>(W.p) + o0 * W.cols, wtype::bf16, wide_}, rows * W.cols);
        x_.gemm(gpu::linear_desc(wide_, wtype::f32, rows, W.cols, in, n, out + o0, W.rows), "linear (widened)");
      }
    }
    if (L.bias) x_.run(gpu::bias_op{out, L.bias, int(W.rows)}, n * W.rows);
  }

  void rms_norm(const float* in, index_t in_stride, const float* w, index_t rows, int dim, float* out, index_t out_stride) {
    x_.rms_norm(gpu::rms_norm_params{in, in_stride, w, rows, dim, c_.rms_norm_eps, out, out_stride});
  }

  /// `in_bf16`: the bf16 copy of `in` when the caller has one (then `in` is not read by bf16 layers).
  /// `rows_vary`: a routed expert (n changes from call to call; see linear).
  void mlp(const gpu::dmlp& m, const float* in, index_t n, float* out, const void* in_bf16 = nullptr,
           bool rows_vary = false) {
    if (n == 0) return;
    const index_t I = m.gate.w.rows;
    const void* xb = in_bf16 ? in_bf16 : shared_bf16_input(in, n * m.gate.w.cols, {&m.gate, &m.up});
    linear(m.gate, in, n, g_, xb, rows_vary);
    linear(m.up, in, n, u_, xb, rows_vary);
    x_.run(gpu::silu_mul_op{g_, u_}, n * I);
    linear(m.down, g_, n, out, nullptr, rows_vary);
  }

  void embed(index_t n) {
    x_.run(gpu::embed_op{m_.embed.p, m_.embed.type, ids_, c_.hidden_size, x_buf_}, n * c_.hidden_size);
  }

  /// A decode step's final norm + LM head of its n rows (x_buf_) with greedy
  /// selection on the device: ids[r] = the first maximum of logits row r
  /// (argmax_rows; only n keys of 8 bytes come back, not n x vocab logits).
  /// Replayed from a CUDA graph while decode graphs are armed (run_segment,
  /// key: layer num_layers, segment A, n rows); returns when ids is written.
  void head_greedy(index_t n, std::vector<int>& ids) {
    run_segment(c_.num_layers, 0, n, true, [&] {
      rms_norm(x_buf_, c_.hidden_size, m_.final_norm, n, c_.hidden_size, head_n_, c_.hidden_size);
      linear(m_.lm_head, head_n_, n, logits_);
      x_.argmax_rows(logits_, n, c_.vocab_size, argmax_keys_);
      x_.d2h_async(argmax_keys_host_, argmax_keys_, n * 8);
    });
    x_.sync();
    ids.resize(std::size_t(n));
    for (index_t r = 0; r < n; ++r) ids[std::size_t(r)] = gpu::argmax_key_column(argmax_keys_host_[r]);
  }

  /// Final norm + LM head of n rows at `in` [n][hidden]; returns the logits
  /// [n][vocab] copied to page-locked host memory (valid until the next call).
  const float* head(const float* in, index_t n) {
    rms_norm(in, c_.hidden_size, m_.final_norm, n, c_.hidden_size, head_n_, c_.hidden_size);
    linear(m_.lm_head, head_n_, n, logits_);
    x_.d2h_async(logits_host_, logits_, n * c_.vocab_size * 4);
    x_.sync();
    return logits_host_;
  }

  // ---------------------------------------------------------------------------
  // Attention: projections, prefill attention, output
  // ---------------------------------------------------------------------------

  /// h_[n] -> q_ [n][hq][QD] (MLA: absorbed), K/V planes fp32 (kvf_) and bf16 (kvb_).
  void project(const gpu::dlayer& L, index_t n) {
    const int hq = c_.num_heads;
    const int half = rope_.dim() / 2;
    const float af = rope_.attention_factor();
    if constexpr (mla) {
      const int nope = c_.qk_nope_head_dim, rope = c_.qk_rope_head_dim, vh = c_.v_head_dim, rank = c_.kv_lora_rank;
      const index_t qk = nope + rope;
      if (c_.q_lora_rank > 0) {
        linear(L.q_a, h_, n, qa_);
        rms_norm(qa_, c_.q_lora_rank, L.q_a_norm, n, c_.q_lora_rank, qa_, c_.q_lora_rank);
        linear(L.q_b, qa_, n, qf_);
      } else {
        linear(L.q, h_, n, qf_);
      }
      // q'[:, h, :rank] = q_nope_h · W_UK_h (before RoPE, like the host path)
      const auto [wp, wt] = kv_b_operand(L);
      const void* b = wt == wtype::bf16 ? act_bf16(qf_, n * hq * qk) : static_cast<const void*>(qf_);
      x_.gemm(gpu::mla_absorb_desc(wp, b, wt, n, hq, nope, rope, vh, rank, q_, QD), "MLA absorb (q_nope W_UK)");
      // q'[:, h, rank:] = q_pe_h
      x_.copy_2d(q_ + rank, index_t(QD) * 4, qf_ + nope, qk * 4, index_t(rope) * 4, n * hq);
      // cache rows c ‖ k_pe
      float* rows = kvf_[0];
      linear(L.kv_a, h_, n, rows);
      rms_norm(rows, ROW, L.kv_a_norm, n, rank, rows, ROW);
      x_.run(gpu::rope_op{q_ + rank, hq, index_t(hq) * QD, QD, pos_, inv_freq_, rope_.dim(), af, 1}, n * hq * half);
      x_.run(gpu::rope_op{rows + rank, 1, ROW, ROW, pos_, inv_freq_, rope_.dim(), af, 1}, n * half);
      x_.run(gpu::convert_op{rows, kvb_[0], wtype::bf16}, n * ROW);
    } else {
      const int hkv = c_.num_kv_heads;
      const int d = Layout::head_dim;
      const void* hb = shared_bf16_input(h_, n * c_.hidden_size, {&L.q, &L.k, &L.v});
      linear(L.q, h_, n, q_, hb);
      linear(L.k, h_, n, kvf_[0], hb);
      linear(L.v, h_, n, kvf_[1], hb);
      if (L.q_norm) {
        rms_norm(q_, d, L.q_norm, n * hq, d, q_, d);
        rms_norm(kvf_[0], d, L.k_norm, n * hkv, d, kvf_[0], d);
      }
      x_.run(gpu::rope_op{q_, hq, index_t(hq) * d, d, pos_, inv_freq_, d, af, 0}, n * hq * half);
      x_.run(gpu::rope_op{kvf_[0], hkv, index_t(hkv) * d, d, pos_, inv_freq_, d, af, 0}, n * hkv * half);
      for (int p = 0; p < 2; ++p) x_.run(gpu::convert_op{kvf_[std::size_t(p)], kvb_[std::size_t(p)], wtype::bf16}, n * hkv * d);
    }
  }

  /// kv_b as a GEMM operand: bf16 in bf16 precision, else its fp32 form.
  std::pair<const void*, wtype> kv_b_operand(const gpu::dlayer& L) const {
    if (L.kv_b.type == wtype::f32) return {L.kv_b.p, wtype::f32};
    if (prec_ == wtype::bf16) return {L.kv_b.p, wtype::bf16};
    return {L.kv_b_f32, wtype::f32};
  }

  /// att_ [n][hq][VD] -> y_ [n][hidden].
  void attention_output(const gpu::dlayer& L, index_t n) {
    if constexpr (mla) {
      const int hq = c_.num_heads, nope = c_.qk_nope_head_dim, vh = c_.v_head_dim, rank = c_.kv_lora_rank;
      const auto [wp, wt] = kv_b_operand(L);
      const void* b = wt == wtype::bf16 ? act_bf16(att_, n * hq * rank) : static_cast<const void*>(att_);
      x_.gemm(gpu::mla_expand_desc(wp, b, wt, n, hq, nope, vh, rank, vexp_), "MLA expand (W_UV a)");
      linear(L.o, vexp_, n, y_);
    } else {
      linear(L.o, att_, n, y_, take_att16());
    }
  }

  /// Causal attention of one sequence's prompt (T tokens at wave offset o0)
  /// over its own K/V: att_[o0 ..] (fp32 mode: fp32 K/V like transformers in
  /// float32; bf16 mode: the bf16 K/V, like a bf16 model).
  void prefill_attention(index_t o0, index_t T) {
    const int hq = c_.num_heads;
    const int hkv = layout().kv_heads();
    const int group = hq / hkv;
    const index_t ts = index_t(hkv) * ROW;  // token stride of the K/V planes
    const float scale = float(c_.softmax_scale());
    const wtype t = prec_;
    const void* kbase;
    const void* vbase;
    if (t == wtype::bf16) {
      kbase = kvb_[0] + o0 * ts;
      vbase = kvb_[mla ? 0 : 1] + o0 * ts;
    } else {
      kbase = kvf_[0] + o0 * ts;
      vbase = kvf_[mla ? 0 : 1] + o0 * ts;
    }
    const float* qs = q_ + o0 * hq * QD;
    float* out = att_ + o0 * hq * VD;
    for (index_t t0 = 0; t0 < T; t0 += rows_blk_) {
      const index_t rows = std::min(rows_blk_, T - t0);
      const index_t keys = t0 + rows;
      const index_t R = rows * group;
      x_.run(gpu::pack_q_op{qs, t0, rows, hq, group, QD, qp_, t}, index_t(hq) * rows * QD);
      x_.gemm(gpu::prefill_qk_desc(kbase, t, ts, ROW, qp_, R, QD, keys, hkv, s_), "prefill scores");
      x_.causal_softmax(gpu::softmax_params{s_, p_, t, index_t(hkv) * R, R, group, keys, t0, scale});
      x_.gemm(gpu::prefill_pv_desc(vbase, t, ts, ROW, p_, R, keys, VD, hkv, op_), "prefill P*V");
      x_.run(gpu::unpack_o_op{op_, t0, rows, hq, group, VD, out}, index_t(hq) * rows * VD);
    }
  }

  // ---------------------------------------------------------------------------
  // FFN
  // ---------------------------------------------------------------------------

  /// x_ += FFN(RMSNorm(x_)) for n tokens.
  /// `decode`: a decode step (the grouped expert kernels may run), else a prefill wave.
  void ffn_residual(int l, index_t n, bool decode) {
    const gpu::dlayer& L = m_.layers[std::size_t(l)];
    const index_t H = c_.hidden_size;
    rms_norm(x_buf_, H, L.post_norm, n, int(H), h_, H);
    if (!L.is_moe) {
      mlp(L.dense, h_, n, y_);
    } else if (decode || n <= moe_tokens_cap_) {
      moe(L, l, n, decode);
    } else {  // prefill_moe_chunk_tokens: the pass over chunks of the wave's rows, h_ / y_ viewed at each
      float* const h0 = h_;
      float* const y0 = y_;
      const index_t C = moe_tokens_cap_;
      try {
        moe_chunk_ = 0;
        for (index_t c0 = 0; c0 < n; c0 += C, ++moe_chunk_) {
          h_ = h0 + c0 * H;
          y_ = y0 + c0 * H;
          moe(L, l, std::min(C, n - c0), decode);
        }
      } catch (...) {
        h_ = h0;
        y_ = y0;
        moe_chunk_ = 0;
        throw;
      }
      h_ = h0;
      y_ = y0;
      moe_chunk_ = 0;
    }
    x_.run(gpu::add_op{x_buf_, y_}, n * H);
  }

  /// The router of layer L over n rows of h_: logits, softmax and top-k into
  /// sel_e_ / sel_w_ [n][k] (route_op's semantics).
  void route_rows(const gpu::dlayer& L, index_t n) {
    const int E = c_.num_experts, k = c_.experts_per_tok;
    linear(L.router, h_, n, router_logits_);
    gpu::route_op r{};
    r.logits = router_logits_;
    r.E = E;
    r.k = k;
    r.group_limited = c_.kind == arch::deepseek_v2 && c_.topk_method == "group_limited_greedy" ? 1 : 0;
    r.n_group = c_.n_group;
    r.topk_group = c_.topk_group;
    r.renorm = c_.kind == arch::mixtral || (c_.kind == arch::qwen3_moe && c_.norm_topk_prob) ? 1 : 0;
    r.apply_scale = c_.kind == arch::deepseek_v2 ? 1 : 0;
    r.scale = float(c_.routed_scaling_factor);
    r.experts = sel_e_;
    r.weights = sel_w_;
    x_.route(r, n);
  }

  /// y_ = routed experts (+ shared experts) of h_, n tokens.
  void moe(const gpu::dlayer& L, int l, index_t n, bool decode) {
    const int E = c_.num_experts;
    const bool timed = !decode;  // prefill: the MoE layer's phases (moe_marks_, read after the wave's sync)
    if (timed) moe_marks_.push_back({x_.mark(), 0, 0, 0, 0});
    route_rows(L, n);
    // Group the (token, slot) pairs by expert: on the device for a batched
    // prefill, else on the host.
    stream_batched_ = !decode && batched_prefill_ && streams_batched(L);
    if (stream_batched_) {  // each streamed expert's slot: its place in the wave's copy order
      streamed_slot_.assign(std::size_t(E), -1);
      const auto [i0, i1] = stream_range(l);
      for (index_t i = i0; i < i1; ++i)
        streamed_slot_[std::size_t(stream_items_[std::size_t(i)].expert)] = int(i % staging_slots_);
    }
    device_routed_ = decode && device_routes_decode(l, n);
    // a decode step's routing round trip: the router's choices to the host, its grouping, the tables back
    const int trip0 = step_marking_ && decode && !device_routed_ ? x_.mark() : -1;
    if (device_routed_) {
      group_decode_on_device(n);  // counted by layer_decode (count_device_routed_pass), replayed or not
    } else {
      if (!decode && batched_prefill_)
        group_on_device(L, n);
      else
        group_on_host(L, n, decode);
      count_rows(L, l);
    }
    if (trip0 >= 0) trip_marks_.push_back({trip0, x_.mark()});
    if (timed) moe_marks_.back()[1] = x_.mark();  // routed: the rows grouped by expert, the tables on the device
    moe_experts(L, l, n, decode, timed);
    if (ph_ != nullptr && !decode && batched_prefill_) ph_->moe_issue_seconds += seconds_since(moe_issue_from_);
  }

  /// Start of the pointer tables in route_dev_ (8-byte aligned, after
  /// [gather rows np][combine rows nk][combine weights nk][expert offsets E+1]).
  static index_t table_at(index_t np, index_t nk, int E) { return (np + 2 * nk + E + 1 + 1) / 2 * 2; }

  /// rows_/count_ from the per-expert row counts; a batched prefill issued
  /// through pointer-array batched GEMMs pads every device-resident expert's rows up
  /// to padded_rows (padding rows gather token 0 and are never combined) so
  /// that experts of equal padded rows run as one batched GEMM; the grouped
  /// issue (grouped_prefill_gemm) keeps the exact rows.
  void lay_out_rows(const gpu::dlayer& L, bool batched) {
    const int E = c_.num_experts;
    const bool pad = batched && !d_.grouped_prefill_gemm;
    padded_of_.assign(std::size_t(E), 0);
    for (int e = 0; e < E; ++e) {
      const index_t m = rows_[std::size_t(e)];
      padded_of_[std::size_t(e)] = pad && m > 0 && in_batch(L, e) ? padded_rows(m) : m;
    }
    if (pad && d_.fitted_expert_groups) fit_groups(L);
    for (int e = 0; e < E; ++e) count_[std::size_t(e) + 1] = count_[std::size_t(e)] + int(padded_of_[std::size_t(e)]);
  }

  /// Whether layer L's streamed host experts run inside its batched GEMMs
  /// (their weights read from their staging slots) rather than one expert at a
  /// time: a streaming prefill wave, pointer-array batched GEMMs on bf16 rows,
  /// bf16 host experts, and a ring that holds two such layers (this layer's
  /// slots are all taken at once; the next layer's copies land meanwhile).
  bool streams_batched(const gpu::dlayer& L) const {
    if (!streaming_ || warming_ || d_.grouped_prefill_gemm || !gpu::fits_x4(c_.hidden_size, h_)) return false;
    index_t host = 0;
    for (int e = 0; e < c_.num_experts; ++e)
      if (L.on_host[std::size_t(e)]) {
        if (!L.host_experts[std::size_t(e)].is_bf16()) return false;
        ++host;
      }
    return host > 0 && 2 * host <= index_t(staging_slots_);
  }

  /// Whether expert e runs in this MoE pass's batched GEMMs (device experts;
  /// streamed host experts too when stream_batched_).
  bool in_batch(const gpu::dlayer& L, int e) const { return !L.on_host[std::size_t(e)] || stream_batched_; }

  /// Whether a MoE pass needs its packed rows in fp32 (xg_) too: a pass not
  /// gathered to bf16, one whose host experts run on the CPU (the warm-up's
  /// pass neither runs nor streams them), or a streamed one with fp32 host experts.
  bool pass_needs_f32(const gpu::dlayer& L, bool batched, bool decode) const {
    const bool stream = streaming_ && !decode;
    if (!(batched && gpu::fits_x4(c_.hidden_size, h_))) return true;
    if (any_host_experts_ && !stream && !warming_) return true;
    if (stream && any_host_experts_)
      for (int e = 0; e < c_.num_experts; ++e)
        if (L.on_host[std::size_t(e)] && !L.host_experts[std::size_t(e)].is_bf16()) return true;
    return false;
  }

  /// padded_of_ of the batched experts from gemm.hpp fitted_group_rows (their
  /// loads in ascending order), inside the packed rows' room.
  void fit_groups(const gpu::dlayer& L) {
    const int E = c_.num_experts;
    fit_order_.clear();
    for (int e = 0; e < E; ++e)
      if (rows_[std::size_t(e)] > 0 && in_batch(L, e)) fit_order_.push_back(e);
    std::stable_sort(fit_order_.begin(), fit_order_.end(),
                     [&](int a, int b) { return rows_[std::size_t(a)] < rows_[std::size_t(b)]; });
    fit_rows_.resize(fit_order_.size());
    for (std::size_t i = 0; i < fit_order_.size(); ++i) fit_rows_[i] = rows_[std::size_t(fit_order_[i])];
    const double row_flops = 6.0 * double(c_.hidden_size) * double(c_.moe_intermediate_size);
    index_t room = padded_rows_cap_, unpadded = 0;
    if (pass_needs_f32(L, true, false)) room = std::min(room, xg_rows_);
    for (int e = 0; e < E; ++e) unpadded += rows_[std::size_t(e)];
    // Past the room, a group's calls are made cheaper (halved) until the
    // partition fits; with no group cost it is the ladder's, which always fits.
    double group_cost = 3.0 * d_.fitted_groups_call_seconds;
    for (int tries = 0; tries < 40; ++tries, group_cost *= 0.5) {
      const std::vector<index_t> sized =
          gpu::fitted_group_rows(fit_rows_, batch_pad, row_flops / d_.fitted_groups_flops_per_second, tries < 39 ? group_cost : 0.0);
      index_t total = unpadded;
      for (std::size_t i = 0; i < sized.size(); ++i) total += sized[i] - fit_rows_[i];
      if (total > room) continue;
      for (std::size_t i = 0; i < sized.size(); ++i) padded_of_[std::size_t(fit_order_[i])] = sized[i];
      return;
    }
  }

  /// A batched prefill expert's rows padded for the batched GEMMs (gemm.hpp ladder_rows).
  static index_t padded_rows(index_t m) { return gpu::ladder_rows(m, batch_pad); }

  /// The prefill grouping of a batched MoE pass on the device (kernel_math.hpp
  /// iota_op .. scatter_rows_op): a stable sort of the pairs by expert, the
  /// experts' bounds, one small download (E+1 ints: the host lays out the
  /// padded rows and the GEMM tables) and one small upload, then the gather
  /// and combine tables scattered on the device.
  void group_on_device(const gpu::dlayer& L, index_t n) {
    const int E = c_.num_experts, k = c_.experts_per_tok;
    const index_t nk = n * k;
    x_.sort_pairs(reinterpret_cast<const unsigned*>(sel_e_), sort_keys_, pair_ids_, sort_pairs_, nk, sort_temp_,
                  std::size_t(sort_temp_bytes_));
    x_.run(gpu::expert_bounds_op{sort_keys_, nk, E, expert_first_}, nk + 1);
    first_host_.resize(std::size_t(E) + 1);
    const auto t_route = std::chrono::steady_clock::now();
    x_.d2h(first_host_.data(), expert_first_, (index_t(E) + 1) * 4);  // waits for the GPU up to the bounds
    if (router_wait_) *router_wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_route).count();
    if (ph_ != nullptr) ph_->router_wait_seconds += seconds_since(t_route);
    moe_issue_from_ = std::chrono::steady_clock::now();
    if (first_host_[std::size_t(E)] != nk || first_host_[0] != 0)
      throw std::logic_error("router returned an expert outside [0, " + std::to_string(E) + ") (" +
                             std::to_string(nk - first_host_[std::size_t(E)]) + " pairs)");
    rows_.assign(std::size_t(E), 0);
    for (int e = 0; e < E; ++e) rows_[std::size_t(e)] = first_host_[std::size_t(e) + 1] - first_host_[std::size_t(e)];
    count_.assign(std::size_t(E) + 1, 0);
    lay_out_rows(L, true);
    const index_t np = count_[std::size_t(E)];
    build_batch_tables(L, E);
    // upload [expert offsets E+1][pad][pointer tables] into their places of route_dev_
    const index_t off_at = np + 2 * nk, tab_at = table_at(np, nk, E);
    route_host_.assign(std::size_t(tab_at - off_at + 2 * index_t(batch_ptrs_.size())), 0);
    std::copy(count_.begin(), count_.end(), route_host_.begin());
    if (!batch_ptrs_.empty())
      std::memcpy(route_host_.data() + (tab_at - off_at), batch_ptrs_.data(), batch_ptrs_.size() * sizeof(const void*));
    if (off_at + index_t(route_host_.size()) > route_cap_ints_)
      throw std::logic_error("device_decoder: routing tables of " + std::to_string(off_at + index_t(route_host_.size())) +
                             " ints, room for " + std::to_string(route_cap_ints_));
    x_.h2d(route_dev_ + off_at, route_host_.data(), index_t(route_host_.size()) * 4);
    x_.zero(route_dev_, np * 4);  // padding rows gather token 0
    x_.run(gpu::scatter_rows_op{sort_keys_, sort_pairs_, expert_first_, route_dev_ + off_at, sel_e_, sel_w_, k,
                                route_dev_, route_dev_ + np, reinterpret_cast<float*>(route_dev_ + np + nk)},
           nk);
    if (ph_ != nullptr) ph_->moe_tables_seconds += seconds_since(moe_issue_from_);
  }

  /// device_options::decode_routing at setup, after the placement: with
  /// `device` it must be able to act, else config_error naming the reason (no hot
  /// placement, at most grouped_expert_max_rows sequences, the grouped
  /// kernels' tables built, the device grouping's buffers of a batched
  /// prefill, and at least one MoE layer with every routed expert on the
  /// device). Marks the layers it applies to (device_only_layer_).
  void check_decode_routing(int batch, const std::string& expert_kernels) {
    device_only_layer_.assign(std::size_t(c_.num_layers), 0);
    split_layer_.assign(std::size_t(c_.num_layers), 0);
    split_rows_cap_ = 0;
    if (d_.decode_routing == decode_routing_mode::host) return;
    const bool strict = d_.decode_routing == decode_routing_mode::device;
    bool refused = false;
    auto refuse = [&](const std::string& why) {
      if (strict) throw writescope::config_error("decode routing on the device: " + why);
      refused = true;  // automatic: the host groups every layer
    };
    // automatic: wide experts (Mixtral's 14336 x 4096) run faster as one cuBLAS product each than in the
    // grouped kernels that device routing needs, so only narrow ones route on the device by default
    if (!strict && index_t(c_.moe_intermediate_size) * c_.hidden_size * 2 > auto_routing_max_matrix_bytes)
      refuse("wide experts");
    if (batch > d_.grouped_expert_max_rows)
      refuse("a batch of " + std::to_string(batch) + " sequences, more than the grouped kernels' " +
             std::to_string(d_.grouped_expert_max_rows) + " rows per expert");
    // A layer with host experts routes on the device too (split routing) when
    // every host expert is bf16 (the CPU experts' kernels) and the host does
    // not order the device experts' enqueue against the CPU experts itself
    // (--device-experts-issue during, given by the user, needs the host grouping).
    const bool split_ok = !(d_.device_experts_during_cpu && !d_.device_experts_during_cpu_default);
    const index_t batch_pairs = index_t(batch) * c_.experts_per_tok;  // split_routes_decode's room at the full batch
    const bool split_fits = batch_pairs <= grouped_rows_cap_ && batch_pairs <= xg_rows_;
    bool any = false;
    for (int l = 0; l < c_.num_layers; ++l) {
      const gpu::dlayer& L = m_.layers[std::size_t(l)];
      if (!L.is_moe) continue;
      const bool all_on_device = std::none_of(L.on_host.begin(), L.on_host.end(), [](char h) { return h != 0; });
      bool host_bf16 = true;
      for (int e = 0; e < c_.num_experts; ++e)
        if (L.on_host[std::size_t(e)] && !L.host_experts[std::size_t(e)].is_bf16()) host_bf16 = false;
      const bool all_on_host = std::all_of(L.on_host.begin(), L.on_host.end(), [](char h) { return h != 0; });
      // the device experts run through the grouped kernels (a layer with none needs no tables)
      const bool kernels = grouped_ok_ && L.expert_tables != nullptr;
      device_only_layer_[std::size_t(l)] = all_on_device && kernels ? 1 : 0;
      split_layer_[std::size_t(l)] =
          !all_on_device && host_bf16 && split_ok && split_fits && (kernels || all_on_host) ? 1 : 0;
      any = any || device_only_layer_[std::size_t(l)] != 0 || split_layer_[std::size_t(l)] != 0;
    }
    if (sort_temp_ == nullptr) refuse("no batched prefill grouping (bf16 precision and bf16 experts needed)");
    if (!any) {
      if (!split_ok)
        refuse("every MoE layer has routed experts in host memory, and --device-experts-issue during needs their "
               "rows grouped on the host");
      else if (!grouped_ok_ && expert_kernels != "none on the device")
        refuse("the grouped expert kernels do not apply: " + expert_kernels);
      else
        refuse("every MoE layer has routed experts in host memory that are not bf16");
    }
    if (refused) {
      device_only_layer_.assign(std::size_t(c_.num_layers), 0);
      split_layer_.assign(std::size_t(c_.num_layers), 0);
    }
    // The split layers' host side: page-locked copies of the routing and the
    // normed rows (down) and the CPU experts' packed rows (up), at fixed
    // addresses for the decode graphs, sized for the batch.
    if (std::any_of(split_layer_.begin(), split_layer_.end(), [](char v) { return v != 0; })) {
      const index_t H = c_.hidden_size, nk = index_t(batch) * c_.experts_per_tok;
      split_down_mem_ = x_.host_staging(nk * 4 + index_t(batch) * H * 4);
      split_up_mem_ = x_.host_staging(nk * H * 4);
      split_sel_host_ = reinterpret_cast<int*>(split_down_mem_.data());
      split_h_host_ = reinterpret_cast<float*>(split_down_mem_.data()) + nk;
      split_y_host_ = reinterpret_cast<float*>(split_up_mem_.data());
      split_x_.assign(std::size_t(nk * H), 0.0f);
      split_rows_cap_ = nk;
      // where every layer with host experts is split, the device experts are enqueued before the CPU's
      if (d_.device_experts_during_cpu_default) {
        bool host_grouped = false;
        for (int l = 0; l < c_.num_layers; ++l)
          host_grouped = host_grouped || (m_.layers[std::size_t(l)].is_moe && !device_only_layer_[std::size_t(l)] &&
                                          !split_layer_[std::size_t(l)]);
        if (!host_grouped) d_.device_experts_during_cpu = false;
      }
    }
  }

  /// Whether decode layer l groups its n sequences' routed rows on the device:
  /// check_decode_routing let decode_routing act, every routed expert
  /// of l is on the device, and n sequences fit the grouped kernels (a step
  /// never has more than the batch that check_decode_routing accepted).
  [[nodiscard]] bool device_routes_decode(int l, index_t n) const {
    return device_only_layer_[std::size_t(l)] != 0 && n * c_.experts_per_tok <= grouped_rows_cap_;
  }

  /// A decode step's grouping on the device: the (token, slot) pairs sorted by
  /// expert (stable: tokens ascending inside an expert), the experts' row
  /// bounds, and the gather and combine tables, with no padding (packed row p
  /// is sorted pair p), so the bounds are the grouped kernels' row offsets.
  /// Nothing is read back. Up to gpu::group_pairs_max pairs on an executor
  /// that has it, one launch (group_pairs) writes the same tables as the
  /// sort, bounds and scatter launches.
  void group_decode_on_device(index_t n) {
    const int E = c_.num_experts, k = c_.experts_per_tok;
    const index_t nk = n * k;
    if constexpr (requires(Exec& e) { e.group_pairs(sel_e_, sel_w_, nk, k, E, sort_keys_, sort_pairs_, expert_first_, route_dev_, route_dev_, sel_w_); }) {
      if (nk <= Exec::group_pairs_max) {
        x_.group_pairs(sel_e_, sel_w_, nk, k, E, sort_keys_, sort_pairs_, expert_first_, route_dev_, route_dev_ + nk,
                       reinterpret_cast<float*>(route_dev_ + 2 * nk));
        return;
      }
    }
    x_.sort_pairs(reinterpret_cast<const unsigned*>(sel_e_), sort_keys_, pair_ids_, sort_pairs_, nk, sort_temp_,
                  std::size_t(sort_temp_bytes_));
    x_.run(gpu::expert_bounds_op{sort_keys_, nk, E, expert_first_}, nk + 1);
    x_.run(gpu::scatter_rows_op{sort_keys_, sort_pairs_, expert_first_, expert_first_, sel_e_, sel_w_, k, route_dev_,
                                route_dev_ + nk, reinterpret_cast<float*>(route_dev_ + 2 * nk)},
           nk);
  }

  /// The grouping on the host (decode steps, and prefills that are not batched).
  void group_on_host(const gpu::dlayer& L, index_t n, bool decode) {
    const int E = c_.num_experts, k = c_.experts_per_tok;
    const index_t nk = n * k;
    he_.resize(std::size_t(nk));
    hw_.resize(std::size_t(nk));
    const auto t_route = std::chrono::steady_clock::now();
    x_.d2h(he_.data(), sel_e_, nk * 4);  // waits for the GPU up to the router
    x_.d2h(hw_.data(), sel_w_, nk * 4);
    if (router_wait_) *router_wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_route).count();

    // Group the (token, slot) pairs by expert: packed rows in expert order,
    // tokens ascending inside an expert; each token's slots in expert order.
    // In parallel over chunks of tokens (the order is the sequential one):
    // per chunk and expert the pairs it holds, so that every chunk knows the
    // first row of its tokens inside each expert.
    const int chunks = int(std::clamp<index_t>(n / 2048, 1, 64));
    chunk_counts_.assign(std::size_t(chunks) * std::size_t(E + 1), 0);
    bad_expert_ = -1;
#pragma omp parallel for schedule(static) if (chunks > 1)
    for (int ch = 0; ch < chunks; ++ch) {
      int* cc = chunk_counts_.data() + std::size_t(ch) * std::size_t(E + 1);
      const index_t t0 = n * ch / chunks, t1 = n * (ch + 1) / chunks;
      for (index_t i = t0 * k; i < t1 * k; ++i) {
        const int e = he_[std::size_t(i)];
        if (e < 0 || e >= E) {
#pragma omp atomic write
          bad_expert_ = e;
          continue;
        }
        ++cc[e];
      }
    }
    if (bad_expert_ != -1) throw std::logic_error("router returned expert " + std::to_string(bad_expert_));
    count_.assign(std::size_t(E) + 1, 0);
    for (int ch = 0; ch < chunks; ++ch)
      for (int e = 0; e < E; ++e) count_[std::size_t(e) + 1] += chunk_counts_[std::size_t(ch) * std::size_t(E + 1) + std::size_t(e)];
    // rows_[e]: expert e's rows; count_[e]: its first packed row (lay_out_rows).
    const bool batched = !decode && batched_prefill_;
    rows_.assign(std::size_t(E), 0);
    for (int e = 0; e < E; ++e) rows_[std::size_t(e)] = count_[std::size_t(e) + 1];
    lay_out_rows(L, batched);
    const index_t np = count_[std::size_t(E)];  // packed rows, padding included (= nk unless batched)
    // chunk_counts_ -> each chunk's first row per expert (exclusive scan over the chunks)
    for (int e = 0; e < E; ++e) {
      int row = count_[std::size_t(e)];
      for (int ch = 0; ch < chunks; ++ch) {
        int& c = chunk_counts_[std::size_t(ch) * std::size_t(E + 1) + std::size_t(e)];
        const int m = c;
        c = row;
        row += m;
      }
    }
    srow_.assign(std::size_t(np), 0);
    crow_.resize(std::size_t(nk));
    cw_.resize(std::size_t(nk));
#pragma omp parallel for schedule(static) if (chunks > 1)
    for (int ch = 0; ch < chunks; ++ch) {
      int* cursor = chunk_counts_.data() + std::size_t(ch) * std::size_t(E + 1);
      const index_t t0 = n * ch / chunks, t1 = n * (ch + 1) / chunks;
      int slot[64];
      for (index_t t = t0; t < t1; ++t) {
        const int* et = he_.data() + t * k;
        for (int s = 0; s < k; ++s) slot[s] = s;
        for (int a = 1; a < k; ++a)  // insertion sort of the token's slots by expert (k is small)
          for (int b = a; b > 0 && et[slot[b]] < et[slot[b - 1]]; --b) std::swap(slot[b], slot[b - 1]);
        for (int j = 0; j < k; ++j) {
          const index_t i = t * k + slot[j];
          const int e = he_[std::size_t(i)];
          const int row = cursor[e]++;
          srow_[std::size_t(row)] = int(t);
          crow_[std::size_t(t * k + j)] = row;
          cw_[std::size_t(t * k + j)] = hw_[std::size_t(i)];
        }
      }
    }
    // The batched GEMMs' operand tables (device pointers; gate, up, down), one
    // group of experts per padded row count, in the same upload.
    if (batched)
      build_batch_tables(L, E);
    else
      batch_ptrs_.clear();
    // One upload: [gather rows np][combine rows nk][combine weights nk][expert offsets E+1][pad][pointer tables].
    const index_t tab_at = table_at(np, nk, E);
    route_host_.assign(std::size_t(tab_at + 2 * index_t(batch_ptrs_.size())), 0);
    std::copy(srow_.begin(), srow_.end(), route_host_.begin());
    std::copy(crow_.begin(), crow_.end(), route_host_.begin() + np);
    std::memcpy(route_host_.data() + np + nk, cw_.data(), std::size_t(nk) * 4);
    std::copy(count_.begin(), count_.end(), route_host_.begin() + np + 2 * nk);
    if (!batch_ptrs_.empty())
      std::memcpy(route_host_.data() + tab_at, batch_ptrs_.data(), batch_ptrs_.size() * sizeof(const void*));
    if (index_t(route_host_.size()) > route_cap_ints_)
      throw std::logic_error("device_decoder: routing upload of " + std::to_string(route_host_.size()) + " ints, room for " +
                             std::to_string(route_cap_ints_));
    x_.h2d(route_dev_, route_host_.data(), index_t(route_host_.size()) * 4);
  }

  /// The rest of a MoE pass after the grouping: gather, experts, combine.
  void moe_experts(const gpu::dlayer& L, int l, index_t n, bool decode, bool timed) {
    const int E = c_.num_experts, k = c_.experts_per_tok;
    const index_t H = c_.hidden_size;
    const index_t nk = n * k;
    const bool batched = !decode && batched_prefill_;
    const index_t np = device_routed_ ? nk : count_[std::size_t(E)];  // device-routed: unpadded
    const int* src_rows = route_dev_;
    const int* comb_rows = route_dev_ + np;
    const float* comb_w = reinterpret_cast<const float*>(route_dev_ + np + nk);
    const int* offsets = device_routed_ ? expert_first_ : route_dev_ + np + 2 * nk;
    void* const* tables = reinterpret_cast<void* const*>(route_dev_ + table_at(np, nk, E));
    // A batched prefill gathers the packed rows straight to bf16 (x16_), the
    // GEMMs' input; the fp32 rows (xg_) only where a reader needs them: the
    // CPU experts' staging, fp32 streamed experts, the other paths.
    const bool stream = streaming_ && !decode;
    const bool x4 = gpu::fits_x4(H, h_);
    const bool gathered16 = batched && x4;
    const bool need_f32 = pass_needs_f32(L, batched, decode);
    if (gathered16) x_.run(gpu::gather_rows_bf16x4_op{h_, H, src_rows, int(H / 4), x16_}, np * H / 4);
    if (need_f32 && np > xg_rows_)
      throw std::logic_error("device_decoder: " + std::to_string(np) + " fp32 expert input rows, room for " +
                             std::to_string(xg_rows_));
    if (need_f32) x_.run(gpu::gather_rows_op{h_, H, src_rows, int(H), xg_}, np * H);
    gathered16_ = gathered16;

    // Host experts: streamed to the device in a streaming prefill wave, else
    // on the CPU: their input rows go to page-locked staging first ...
    index_t host_rows = 0;
    host_runs_.clear();
    if (any_host_experts_ && !stream && !warming_ && !device_routed_)
      for (int e = 0; e < E; ++e) {
        const index_t m = rows_[std::size_t(e)];
        if (m > 0 && L.on_host[std::size_t(e)]) {
          host_runs_.push_back({e, count_[std::size_t(e)], m, host_rows});
          host_rows += m;
        }
      }
    // A decode step's window phases (window_phases; host clock, and marks on the GPU timeline).
    const bool phases = step_marking_ && decode && host_rows > 0;
    using clk = std::chrono::steady_clock;
    const clk::time_point t_stage = phases ? clk::now() : clk::time_point{};
    if (host_rows > 0) {
      ensure_staging(host_rows * H);
      for (const host_run& hr : host_runs_)
        x_.d2h_async(stage_x_ + hr.stage_row * H, xg_ + hr.row * H, hr.rows * H * 4);
      x_.record();
    }
    // a decode step's overlap window: from the CPU experts' inputs on the host
    // to their end, the GPU running the device and shared experts meanwhile
    const int window0 = phases ? x_.mark() : -1;
    int window_dev = -1;  // the device (and shared) experts done on the GPU
    const clk::time_point t_window = phases ? clk::now() : clk::time_point{};
    // ... while the GPU runs its experts (enqueued by issue_device) ...
    auto issue_device = [&] {
      index_t most = 0;
      int active = 0;  // device experts with rows (host-grouped passes)
      if (!device_routed_)
        for (int e = 0; e < E; ++e) {
          const index_t m = rows_[std::size_t(e)];
          most = std::max(most, m);
          active += m > 0 && !L.on_host[std::size_t(e)] ? 1 : 0;
        }
      if (device_routed_ || (decode && grouped_ok_ && nk <= grouped_rows_cap_ && most <= d_.grouped_expert_max_rows &&
                             active >= d_.grouped_expert_min_active)) {
        grouped_experts_on_device(L, offsets, device_routed_ ? nk : 0);
        if (!device_routed_) ++grouped_passes_;  // device-routed: count_device_routed_pass
      } else if (batched) {
        const auto t_gemms = std::chrono::steady_clock::now();
        const index_t s0 = stream_batched_ ? stream_range(l).first : 0;
        const index_t s1 = stream_batched_ ? stream_range(l).second : 0;
        for (index_t i = s0; i < s1; ++i) x_.ring_acquire(int(i % staging_slots_));  // the layer's copies landed
        run_batched_experts(tables, np);
        for (index_t i = s0; i < s1; ++i) {  // its slots free: the next copies go into them
          x_.ring_release(int(i % staging_slots_));
          if (next_copy_ < index_t(stream_items_.size())) enqueue_stream_copy();
        }
        batched_groups_ += index_t(batch_groups_.size());
        if (stream_batched_) ++stream_batched_passes_;
        if (ph_ != nullptr) ph_->moe_gemm_issue_seconds += seconds_since(t_gemms);
        ++batched_passes_;
      } else {
        for (int e = 0; e < E; ++e) {
          const index_t m = rows_[std::size_t(e)];
          if (m == 0 || L.on_host[std::size_t(e)]) continue;
          const index_t row = count_[std::size_t(e)];
          mlp(L.experts[std::size_t(e)], xg_ + row * H, m, yg_ + row * H, nullptr, true);
        }
        ++per_expert_passes_;
      }
      if (timed) moe_marks_.back()[2] = x_.mark();  // device-resident experts done
      if (stream && !stream_batched_) run_streamed_experts(l);
      if (warming_ && staging_slots_ > 0) warm_streamed_shapes(L, np);
      if (timed) moe_marks_.back()[3] = x_.mark();  // streamed experts done
      // shared experts next on the GPU, so that they too overlap the CPU experts
      if (L.has_shared) mlp(L.shared, h_, n, y2_);
      if (phases) window_dev = x_.mark();
    };
    // ... and the CPU runs the host experts, whose outputs go back to their rows:
    // after the device experts' enqueue, or (device_experts_during_cpu, decode,
    // bf16 host experts) with it on thread 0 of the CPU experts' team.
    bool all_bf16 = true;
    for (const host_run& hr : host_runs_) all_bf16 = all_bf16 && L.host_experts[std::size_t(hr.expert)].is_bf16();
    const bool during = host_rows > 0 && decode && d_.device_experts_during_cpu && all_bf16;
    clk::time_point t_issued{}, t_inputs{};
    cpu::run_stats cpu_stats;
    if (!during) {
      issue_device();
      if (phases) t_issued = clk::now();
    }
    if (host_rows > 0) {
      x_.wait_recorded();
      const auto t0 = clk::now();
      t_inputs = t0;
      if (during) {
        struct side_ctx {
          decltype(issue_device)* f;
          static void call(void* p) { (*static_cast<side_ctx*>(p)->f)(); }
        } ctx{&issue_device};
        const cpu::side_work side{&side_ctx::call, &ctx};
        run_cpu_experts(L, &side, phases ? &cpu_stats : nullptr);
      } else {
        run_cpu_experts(L, nullptr, phases ? &cpu_stats : nullptr);
      }
      const auto t1 = clk::now();
      const double dt = std::chrono::duration<double>(t1 - t0).count();
      cpu_expert_seconds_ += dt;
      cpu_expert_rows_ += host_rows;
      if (phases) {
        const int window1 = x_.mark();
        window_marks_.push_back({window0, window_dev, window1, -1});
        auto sec = [](clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); };
        window_phases& w = step_phases_;
        ++w.layers;
        w.stage_issue += sec(t_stage, t_window);
        w.device_issue += during ? cpu_stats.side_seconds : sec(t_window, t_issued);
        w.input_wait += sec(during ? t_window : t_issued, t_inputs);
        w.cpu_setup += cpu_stats.setup_seconds;
        w.cpu_wake += cpu_stats.wake_seconds;
        w.cpu_experts += dt;
        w.host_window += sec(t_window, t1);
      }
      if (counting_ == counting::decode) {  // each host expert with rows reads its weights once
        decode_cpu_expert_seconds_ += dt;
        for (const host_run& hr : host_runs_) decode_host_expert_bytes_ += L.host_experts[std::size_t(hr.expert)].bytes();
      }
      for (const host_run& hr : host_runs_)
        x_.h2d_async(yg_ + hr.row * H, stage_y_ + hr.stage_row * H, hr.rows * H * 4);
    }
    const clk::time_point t_out = phases ? clk::now() : clk::time_point{};
    if (x4 && gpu::fits_x4(H, yg_) && gpu::fits_x4(H, y_))
      x_.run(gpu::combine_x4_op{yg_, comb_rows, comb_w, k, int(H / 4), y_}, n * H / 4);
    else
      x_.run(gpu::combine_op{yg_, comb_rows, comb_w, k, int(H), y_}, n * H);
    if (L.has_shared) x_.run(gpu::add_op{y_, y2_}, n * H);
    if (phases) {
      window_marks_.back()[3] = x_.mark();  // the outputs' H2D and the combine done
      step_phases_.output_issue += std::chrono::duration<double>(clk::now() - t_out).count();
    }
    if (timed) moe_marks_.back()[4] = x_.mark();
  }

  /// Layer L's device experts over the packed rows xg_ -> yg_ through the
  /// grouped kernels (launch_expert_gemv, gate‖up with SiLU into eg_, then
  /// down): y [rows][out] = x [rows][in] · W_eᵀ per expert, rows of expert e
  /// at offsets[e] .. offsets[e + 1]. pairs > 0: a block row per routed pair
  /// over sort_keys_ (device routing: at batch 1, 8 block rows of 128);
  /// 0: a block row per expert. Host experts' rows (null table entries) are
  /// not written.
  void grouped_experts_on_device(const gpu::dlayer& L, const int* offsets, index_t pairs) {
    const int E = c_.num_experts;
    const index_t H = c_.hidden_size, I = c_.moe_intermediate_size;
    auto products = [&](const void* const* w, const void* const* up, index_t out, index_t in, const float* x, float* y) {
      gpu::expert_gemv_params gp;
      gp.w = w;
      gp.up = up;
      gp.offsets = offsets;
      gp.experts = E;
      gp.out = int(out);
      gp.in = int(in);
      gp.x = x;
      gp.x_stride = in;
      gp.y = y;
      gp.y_stride = out;
      gp.round_x = prec_ == wtype::bf16 ? 1 : 0;
      if (pairs > 0) {
        gp.block_experts = sort_keys_;
        gp.blocks = int(pairs);
      }
      x_.expert_gemv(gp);
    };
    products(L.expert_tables, L.expert_tables + E, I, H, xg_, eg_);  // gate‖up with SiLU
    products(L.expert_tables + 2 * E, nullptr, H, I, eg_, yg_);      // down
  }

  /// Rows of a prefill expert in the batched GEMMs are padded to a multiple of this (padded_rows).
  static constexpr index_t batch_pad = 64;

  /// The batched prefill GEMMs' operand tables of layer L (batch_ptrs_, uploaded
  /// with the routing) and their groups (batch_groups_): device-resident
  /// experts with rows, grouped by padded row count; per group 9 tables of
  /// `count` pointers: gate (W, X, G), up (W, X, U), down (W, A, Y), where X is
  /// the bf16 copy of the packed inputs, G/U the fp32 gate/up outputs, A the
  /// bf16 SiLU products and Y the packed outputs (yg_), all at the expert's
  /// first packed row.
  /// With grouped_prefill_gemm the tables are laid out per matrix instead:
  /// 9 tables of `active` pointers (every device expert with rows, ordered by
  /// rows), and batch_groups_ lists the runs of equal rows within them.
  void build_batch_tables(const gpu::dlayer& L, int E) {
    const index_t H = c_.hidden_size, I = c_.moe_intermediate_size;
    batch_ptrs_.clear();
    batch_groups_.clear();
    order_.clear();
    for (int e = 0; e < E; ++e)
      if (rows_[std::size_t(e)] > 0 && in_batch(L, e)) order_.push_back(e);
    auto padded = [&](int e) { return index_t(count_[std::size_t(e) + 1] - count_[std::size_t(e)]); };
    std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) { return padded(a) < padded(b); });
    // a streamed expert's weights: its staging slot (gate, up, down contiguous, bf16)
    auto slot_weight = [&](int e, int which) -> const void* {
      const std::byte* base = staging_ + index_t(streamed_slot_[std::size_t(e)]) * staging_slot_bytes_;
      return base + index_t(which) * c_.moe_intermediate_size * H * 2;
    };
    auto operand = [&](int t, int e) -> const void* {
      const gpu::dmlp& m = L.experts[std::size_t(e)];
      const index_t r0 = count_[std::size_t(e)];
      const bool slot = L.on_host[std::size_t(e)];
      switch (t) {
        case 0: return slot ? slot_weight(e, 0) : m.gate.w.p;
        case 1: return x16_ + r0 * H;
        case 2: return g_batch_ + r0 * I;
        case 3: return slot ? slot_weight(e, 1) : m.up.w.p;
        case 4: return x16_ + r0 * H;
        case 5: return u_batch_ + r0 * I;
        case 6: return slot ? slot_weight(e, 2) : m.down.w.p;
        case 7: return a16_ + r0 * I;
        default: return yg_ + r0 * H;
      }
    };
    if (d_.grouped_prefill_gemm) {
      for (std::size_t i = 0; i < order_.size();) {
        std::size_t j = i;
        while (j < order_.size() && padded(order_[j]) == padded(order_[i])) ++j;
        batch_groups_.push_back({padded(order_[i]), int(j - i), index_t(i)});
        i = j;
      }
      for (int t = 0; t < 9; ++t)
        for (const int e : order_) batch_ptrs_.push_back(operand(t, e));
      return;
    }
    for (std::size_t i = 0; i < order_.size();) {
      std::size_t j = i;
      while (j < order_.size() && padded(order_[j]) == padded(order_[i])) ++j;
      batch_group g;
      g.rows = padded(order_[i]);
      g.count = int(j - i);
      g.first = index_t(batch_ptrs_.size());
      batch_groups_.push_back(g);
      for (int t = 0; t < 9; ++t)
        for (std::size_t q = i; q < j; ++q) batch_ptrs_.push_back(operand(t, order_[q]));
      i = j;
    }
  }

  /// The device-resident experts of a batched prefill layer: the packed inputs
  /// to bf16 once, the gate and up products, SiLU · up over every packed row,
  /// to bf16, the down products into yg_. Issued per group of equal padded
  /// rows and matrix (cuda_exec::gemm_batched; the padding rows compute garbage
  /// that no token combines), or with grouped_prefill_gemm one grouped call
  /// per matrix over every expert at its exact rows.
  void run_batched_experts(void* const* tables, index_t np) {
    const index_t H = c_.hidden_size, I = c_.moe_intermediate_size;
    if (!gathered16_) x_.run(gpu::convert_op{xg_, x16_, wtype::bf16}, np * H);
    // matrix t's products (t: the W table of gate 0, up 3, down 6; X and Y follow)
    std::function<void(int, index_t, index_t)> products;
    gpu::gemm_grouped_desc grouped;
    if (d_.grouped_prefill_gemm) {  // one grouped call per matrix; tables [9][active]
      const index_t active = index_t(order_.size());
      for (const batch_group& g : batch_groups_) {
        grouped.n.push_back(int(g.rows));
        grouped.count.push_back(g.count);
      }
      products = [&, active](int t, index_t out, index_t in) {
        grouped.base = gpu::linear_desc(nullptr, wtype::bf16, out, in, nullptr, 0, nullptr, out);
        grouped.a = tables + index_t(t) * active;
        grouped.b = tables + index_t(t + 1) * active;
        grouped.c = reinterpret_cast<float* const*>(tables + index_t(t + 2) * active);  // the C table holds float*
        x_.gemm_grouped(grouped, "grouped prefill experts");
      };
    } else {  // one batched call per group and matrix; tables per group [9][count]
      products = [&](int t, index_t out, index_t in) {
        for (const batch_group& g : batch_groups_) {
          gpu::gemm_batched_desc d;
          d.base = gpu::linear_desc(nullptr, wtype::bf16, out, in, nullptr, g.rows, nullptr, out);
          d.a = tables + g.first + index_t(t) * g.count;
          d.b = tables + g.first + index_t(t + 1) * g.count;
          d.c = reinterpret_cast<float* const*>(tables + g.first + index_t(t + 2) * g.count);
          d.count = g.count;
          x_.gemm_batched(d, "batched prefill experts");
        }
      };
    }
    products(0, I, H);  // gate
    products(3, I, H);  // up
    if (gpu::fits_x4(np * I, g_batch_) && gpu::fits_x4(np * I, u_batch_)) {
      x_.run(gpu::silu_mul_bf16x4_op{g_batch_, u_batch_, a16_}, np * I / 4);
    } else {
      x_.run(gpu::silu_mul_op{g_batch_, u_batch_}, np * I);
      x_.run(gpu::convert_op{g_batch_, a16_, wtype::bf16}, np * I);
    }
    products(6, H, I);  // down
  }

  /// At setup, when the run has host experts: the DRAM read ceiling with the
  /// CPU experts' thread count (dram_ceiling.hpp), unless d_.dram_ceiling is
  /// off; that option, and d_.device_experts_during_cpu, are refused where
  /// every routed expert is on the device.
  void measure_dram_ceiling(device_report& rep) {
    if (!any_host_experts_) {
      if (d_.device_experts_during_cpu && d_.device_experts_during_cpu_default) d_.device_experts_during_cpu = false;
      if (d_.device_experts_during_cpu)
        throw writescope::config_error(
            "--device-experts-issue during: acts only where routed experts are in host memory (it orders the "
            "device experts' enqueue against the CPU experts), not with all " + std::to_string(rep.experts_total) +
            " routed experts on the device");
      if (!d_.dram_ceiling)
        throw writescope::config_error(
            "--no-dram-ceiling: acts only where routed experts are in host memory (the ceiling is measured only "
            "then), not with all " + std::to_string(rep.experts_total) + " routed experts on the device");
      rep.dram_ceiling = "not measured (no host experts)";
      return;
    }
    if (!d_.dram_ceiling) {
      rep.dram_ceiling = "skipped (--no-dram-ceiling)";
      return;
    }
    // The emulated executor (CI) reads 64 MiB: its bound describes no machine, and
    // a buffer of max(1 GiB, 8 x L3) per test run would cost seconds and memory.
    const std::size_t bytes = Exec::is_emulated ? std::size_t{64} << 20 : 0;  // 0: dram_ceiling_buffer_bytes()
    const cpu::dram_ceiling m = cpu::measure_dram_ceiling(cpu::detail::team_size(cpu_threads_), bytes);
    rep.dram_ceiling = "measured";
    rep.dram_read_gbps = m.gbps;
    rep.dram_buffer_bytes = index_t(m.buffer_bytes);
    rep.dram_threads = m.threads;
    rep.dram_passes = m.passes;
    rep.dram_seconds = m.seconds;
  }

  /// The layer's CPU host runs (host_runs_, inputs in stage_x_, outputs to
  /// stage_y_, or in x_rows / y_rows where given): bf16 experts through cpu::run_experts on the engine's thread
  /// count (one call for the whole layer: every weight read once, all cores);
  /// fp32 experts (F16/F32 checkpoints) through the widening loop. `side`:
  /// work for this thread inside run_experts' team (cpu::side_work; the
  /// caller passes one only when every run is bf16); `stats`: its host seconds.
  void run_cpu_experts(const gpu::dlayer& L, const cpu::side_work* side = nullptr, cpu::run_stats* stats = nullptr,
                       const float* x_rows = nullptr, float* y_rows = nullptr) {
    const index_t H = c_.hidden_size;
    const float* const xb = x_rows != nullptr ? x_rows : stage_x_;  // split routing: its own rows
    float* const yb = y_rows != nullptr ? y_rows : stage_y_;
    cpu_tasks_.clear();
    for (const host_run& hr : host_runs_) {
      const gpu::hmlp& w = L.host_experts[std::size_t(hr.expert)];
      if (!w.is_bf16()) {
        cpu_expert(w, xb + hr.stage_row * H, hr.rows, yb + hr.stage_row * H);
        continue;
      }
      cpu::expert_task t;
      t.w = cpu::expert_view{w.gate.bf16, w.up.bf16, w.down.bf16};
      t.x = xb + hr.stage_row * H;
      t.y = yb + hr.stage_row * H;
      t.rows = hr.rows;
      cpu_tasks_.push_back(t);
    }
    if (!cpu_tasks_.empty() || side != nullptr)
      cpu::run_experts(cpu_tasks_, cpu::expert_shape{H, c_.moe_intermediate_size},
                       prec_ == wtype::bf16 ? cpu::expert_precision::bf16_inputs : cpu::expert_precision::fp32,
                       cpu_threads_, side, stats);
  }

  struct host_run {
    int expert;
    index_t row;        ///< first packed row (device)
    index_t rows;
    index_t stage_row;  ///< first row in the staging buffers
  };

  void ensure_staging(index_t floats) {
    if (stage_cap_ >= floats) return;
    x_.sync();  // no copy may still use the old buffers
    stage_x_mem_ = x_.host_staging(floats * 4);
    stage_y_mem_ = x_.host_staging(floats * 4);
    stage_x_ = reinterpret_cast<float*>(stage_x_mem_.data());
    stage_y_ = reinterpret_cast<float*>(stage_y_mem_.data());
    stage_cap_ = floats;
  }

  /// One expert on the CPU: Y[m][H] = down(silu(gate X) · up X), weights widened
  /// per row; in bf16 precision the GEMM inputs are rounded to bf16 as on the GPU.
  void cpu_expert(const gpu::hmlp& w, const float* X, index_t m, float* Y) {
    const index_t H = c_.hidden_size, I = w.gate.rows;
    xin_.assign(X, X + m * H);
    if (prec_ == wtype::bf16)
      for (float& v : xin_) v = gpu::bf16_to_float(gpu::float_to_bf16(v));
    gcpu_.resize(std::size_t(m * I));
    ucpu_.resize(std::size_t(m * I));
    cpu_matmul(w.gate, xin_.data(), m, gcpu_.data());
    cpu_matmul(w.up, xin_.data(), m, ucpu_.data());
    for (std::size_t i = 0; i < gcpu_.size(); ++i) {
      const float a = gpu::silu(gcpu_[i]) * ucpu_[i];
      gcpu_[i] = prec_ == wtype::bf16 ? gpu::bf16_to_float(gpu::float_to_bf16(a)) : a;
    }
    cpu_matmul(w.down, gcpu_.data(), m, Y);
  }

  /// Y[m][W.rows] = X[m][W.cols] · Wᵀ, parallel over W's rows (each widened once).
  static void cpu_matmul(const gpu::hmat& W, const float* X, index_t m, float* Y) {
    const index_t O = W.rows, I = W.cols;
#pragma omp parallel
    {
      std::vector<float> row(static_cast<std::size_t>(I));
#pragma omp for schedule(static)
      for (index_t o = 0; o < O; ++o) {
        W.widen_row(o, row.data());
        for (index_t r = 0; r < m; ++r) {
          const float* xr = X + r * I;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (index_t i = 0; i < I; ++i) acc += xr[i] * row[std::size_t(i)];
          Y[r * O + o] = acc;
        }
      }
    }
  }

  // ---------------------------------------------------------------------------
  // Layers
  // ---------------------------------------------------------------------------

  template <class Progress>
  void prefill_wave(const wave& w, const std::vector<std::vector<int>>& prompts,
                    const std::vector<writescope::sequence_id>& seqs, Progress&& progress, device_report& rep) {
    using namespace writescope;
    const auto t_setup = std::chrono::steady_clock::now();
    const index_t N = w.offset.back();
    ids_host_.resize(std::size_t(N));
    pos_host_.resize(std::size_t(N));
    for (int i = w.begin; i < w.end; ++i) {
      const auto& p = prompts[std::size_t(i)];
      const index_t o0 = w.offset[std::size_t(i - w.begin)];
      for (index_t t = 0; t < index_t(p.size()); ++t) {
        ids_host_[std::size_t(o0 + t)] = p[std::size_t(t)];
        pos_host_[std::size_t(o0 + t)] = t;
      }
    }
    x_.h2d(ids_, ids_host_.data(), N * 4);
    x_.h2d(pos_, pos_host_.data(), N * 8);
    const bool flash = use_flash_;
    if (flash) {
      wave_offsets_host_.assign(w.offset.begin(), w.offset.end());
      x_.h2d(wave_offsets_, wave_offsets_host_.data(), index_t(wave_offsets_host_.size()) * 4);
    }
    begin_streaming_wave(N);
    x_.reset_marks();
    moe_marks_.clear();
    std::vector<std::array<int, 3>> marks(std::size_t(c_.num_layers));
    embed(N);
    const index_t H = c_.hidden_size;
    const index_t per = index_t(layout().kv_heads()) * ROW;
    ph_ = &rep.prefill_host;
    const auto t_layers = std::chrono::steady_clock::now();
    rep.prefill_host.wave_setup_seconds += std::chrono::duration<double>(t_layers - t_setup).count();
    for (int l = 0; l < c_.num_layers; ++l) {
      const gpu::dlayer& L = m_.layers[std::size_t(l)];
      marks[std::size_t(l)][0] = x_.mark();
      rms_norm(x_buf_, H, L.input_norm, N, int(H), h_, H);
      project(L, N);
      // The wave's KV goes to its final regions as it is produced: with the
      // flash attention in one append over the wave's sequences, after the
      // attention is enqueued (the append waits for the previous layer's
      // deferred copies, or for its own D2H when writes are synchronous, while
      // the GPU computes); otherwise per sequence, beside its attention.
      if (flash) {
        const auto t_att = std::chrono::steady_clock::now();
        flash_prefill_attention(L, w);
        rep.prefill_host.attention_issue_seconds += seconds_since(t_att);
      }
      const auto t_kv = std::chrono::steady_clock::now();
      if (flash) {
        kv_tokens<Layout, space> kv;
        for (int p = 0; p < Layout::planes; ++p) kv.planes[std::size_t(p)] = kvb_[std::size_t(p)];
        kv.num_tokens = N;
        wave_seqs_.assign(seqs.begin() + w.begin, seqs.begin() + w.end);
        wave_first_.assign(w.offset.begin(), w.offset.end() - 1);
        cache_->append_prefill(l, std::span<const sequence_id>(wave_seqs_), std::span<const index_t>(wave_first_), kv);
      } else {
        for (int i = w.begin; i < w.end; ++i) {
          const index_t o0 = w.offset[std::size_t(i - w.begin)];
          const index_t T = w.offset[std::size_t(i - w.begin) + 1] - o0;
          kv_tokens<Layout, space> kv;
          for (int p = 0; p < Layout::planes; ++p) kv.planes[std::size_t(p)] = kvb_[std::size_t(p)] + o0 * per;
          kv.num_tokens = T;
          cache_->append_prefill(l, seqs[std::size_t(i)], kv);
          prefill_attention(o0, T);
        }
      }
      rep.prefill_kv_write_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_kv).count();
      if (!(flash && mla)) attention_output(L, N);  // the MLA flash path applied o_proj itself
      x_.run(gpu::add_op{x_buf_, y_}, N * H);
      marks[std::size_t(l)][1] = x_.mark();
      const double cpu_before = cpu_expert_seconds_;
      ffn_residual(l, N, false);
      rep.prefill_cpu_expert_seconds += cpu_expert_seconds_ - cpu_before;
      marks[std::size_t(l)][2] = x_.mark();
      progress(l);
    }
    rep.prefill_host.layers_seconds += seconds_since(t_layers);
    ph_ = nullptr;
    const auto t_drain = std::chrono::steady_clock::now();
    x_.sync();
    rep.prefill_host.drain_seconds += seconds_since(t_drain);
    for (int l = 0; l < c_.num_layers; ++l) {
      rep.prefill_attention_seconds += x_.seconds_between(marks[std::size_t(l)][0], marks[std::size_t(l)][1]);
      rep.prefill_moe_seconds += x_.seconds_between(marks[std::size_t(l)][1], marks[std::size_t(l)][2]);
    }
    for (const auto& m : moe_marks_) {
      rep.prefill_moe_route_seconds += x_.seconds_between(m[0], m[1]);
      rep.prefill_moe_device_expert_seconds += x_.seconds_between(m[1], m[2]);
      rep.prefill_moe_streamed_expert_seconds += x_.seconds_between(m[2], m[3]);
      rep.prefill_moe_combine_seconds += x_.seconds_between(m[3], m[4]);
    }
    if (streaming_) {
      rep.streamed_experts += index_t(stream_items_.size());
      for (const stream_item& it : stream_items_) rep.streamed_bytes += it.bytes;
    }
    streaming_ = false;
    const auto t_sample = std::chrono::steady_clock::now();
    sample_used();
    rep.prefill_host.memory_sample_seconds += seconds_since(t_sample);
  }

  // ---------------------------------------------------------------------------
  // Prefill attention (flash) and the streamed host experts
  // ---------------------------------------------------------------------------

  /// Causal self-attention of every sequence of the wave in one launch
  /// (flash_prefill.hpp; bf16 q/k/v, fp32 out). GQA: q_ (fp32, RoPE applied)
  /// to bf16, K/V straight from the bf16 planes that went to the cache; out
  /// att_ [N][hq][d]. MLA (non-absorbed, qk = nope + rope, v = v_head_dim): q
  /// from qf_ with RoPE on its rope part, per-head K/V expanded from the
  /// latent by kv_b, out [N][hq][v] -> o_proj -> y_.
  /// The flash prefill parameters of wave w over the decoder's buffers
  /// (queries qb_, keys/values kvb_ or MLA's expanded kx_/vx_, output att_ or
  /// MLA's vexp_ in fp32; the same strides serve the bf16 output).
  gpu::flash_prefill_params flash_params(const wave& w) const {
    const int hq = c_.num_heads;
    gpu::flash_prefill_params fp;
    fp.seq_offsets = wave_offsets_;
    fp.num_seqs = w.end - w.begin;
    fp.max_seq_tokens = 0;
    for (std::size_t i = 0; i + 1 < w.offset.size(); ++i)
      fp.max_seq_tokens = std::max(fp.max_seq_tokens, w.offset[i + 1] - w.offset[i]);
    fp.hq = hq;
    fp.scale = float(c_.softmax_scale());
    if constexpr (mla) {
      const int vh = c_.v_head_dim;
      fp.q = qb_;
      fp.k = kx_;
      fp.v = vx_;
      fp.out = vexp_;
      dense_heads(fp, hq, c_.qk_nope_head_dim + c_.qk_rope_head_dim, vh, vh);
    } else {
      const int d = Layout::head_dim;
      fp.q = qb_;
      fp.k = reinterpret_cast<const std::uint16_t*>(kvb_[0]);
      fp.v = reinterpret_cast<const std::uint16_t*>(kvb_[1]);
      fp.out = att_;
      dense_heads(fp, c_.num_kv_heads, d, d, VD);
    }
    return fp;
  }

  /// Causal attention of wave w's prompts: bf16 inputs, then the flash kernel
  /// (fp32 output in att_ / vexp_) or cuDNN's SDPA (bf16 output in act16_,
  /// read by o_proj as its bf16 input: att16_ready_).
  void run_prefill_attention(const wave& w) {
    const gpu::flash_prefill_params fp = flash_params(w);
    if (use_cudnn_) {
      x_.bf16_prefill_attention(gpu::to_cudnn_prefill_params(fp, act16_, w.offset.back()), cudnn_ws_,
                                std::size_t(cudnn_ws_bytes_));
      att16_ready_ = true;
    } else {
      x_.flash_prefill(fp);
    }
  }

  void flash_prefill_attention(const gpu::dlayer& L, const wave& w) {
    const index_t N = w.offset.back();
    const int hq = c_.num_heads;
    if constexpr (mla) {
      const int nope = c_.qk_nope_head_dim, rope = c_.qk_rope_head_dim, vh = c_.v_head_dim, rank = c_.kv_lora_rank;
      const index_t qk = nope + rope;
      const int half = rope_.dim() / 2;
      // RoPE on q_pe inside the full queries (project() roped only the absorbed copy)
      x_.run(gpu::rope_op{qf_ + nope, hq, index_t(hq) * qk, qk, pos_, inv_freq_, rope_.dim(), rope_.attention_factor(), 1},
             N * hq * half);
      x_.run(gpu::convert_op{qf_, qb_, wtype::bf16}, N * hq * qk);
      // kvx [N][hq][nope + v] = c · kv_bᵀ (c: the normalised latent, first `rank` of each cache row)
      x_.copy_2d(cbuf_, index_t(rank) * 4, kvf_[0], index_t(ROW) * 4, index_t(rank) * 4, N);
      gpu::dlinear kvb;
      kvb.w = L.kv_b;
      linear(kvb, cbuf_, N, kvx_);
      x_.run(gpu::mla_prefill_kv_op{kvx_, kvf_[0] + rank, ROW, hq, nope, rope, vh, kx_, vx_}, N * hq * (qk + vh));
      run_prefill_attention(w);
      linear(L.o, vexp_, N, y_, take_att16());
    } else {
      const int d = Layout::head_dim;
      x_.run(gpu::convert_op{q_, qb_, wtype::bf16}, N * hq * d);
      run_prefill_attention(w);
    }
  }

  /// act16_ when it holds the bf16 attention output of the last prefill
  /// attention (cuDNN), once; else null (o_proj converts att_ itself).
  const void* take_att16() {
    const bool r = att16_ready_;
    att16_ready_ = false;
    return r ? static_cast<const void*>(act16_) : nullptr;
  }

  /// Chooses cuDNN's SDPA for the prefill attention when the executor has it
  /// and it accepts every wave's shape (d_.cudnn_prefill), and allocates its
  /// workspace (inside the budget); otherwise the flash kernel, with the
  /// reason in cudnn_why_.
  void choose_prefill_attention() {
    use_cudnn_ = false;
    cudnn_why_.clear();
    if (!use_flash_) return;
    if (!d_.cudnn_prefill) {
      cudnn_why_ = "--cudnn-prefill off";
      return;
    }
    if constexpr (!Exec::has_bf16_prefill_attention) {
      cudnn_why_ = "not built with cuDNN";
      return;
    } else {
      const index_t out_elems = index_t(c_.num_heads) * (mla ? index_t(c_.v_head_dim) : index_t(VD)) * T_;
      if (out_elems > act16_cap_) {
        cudnn_why_ = "the bf16 output does not fit the GEMM input scratch";
        return;
      }
      std::size_t ws = 0;
      for (const wave& w : waves_) {
        const auto need =
            x_.prepare_bf16_prefill_attention(gpu::to_cudnn_prefill_params(flash_params(w), act16_, w.offset.back()),
                                              cudnn_why_);
        if (!need) return;
        ws = std::max(ws, *need);
      }
      cudnn_ws_bytes_ = index_t(ws);
      cudnn_ws_ = ws > 0 ? buffer<std::byte>(index_t(ws), "cuDNN prefill attention workspace") : nullptr;
      use_cudnn_ = true;
    }
  }

  /// Strides of dense operands: q [N][hq][dqk], k [N][hkv][dqk], v [N][hkv][dv],
  /// out [N][hq][o_head] (elements).
  static void dense_heads(gpu::flash_prefill_params& fp, int hkv, int dqk, int dv, int o_head) {
    const index_t hq = fp.hq;
    fp.hkv = hkv;
    fp.dqk = dqk;
    fp.dv = dv;
    fp.q_token_stride = hq * dqk;
    fp.q_head_stride = dqk;
    fp.k_token_stride = index_t(hkv) * dqk;
    fp.k_head_stride = dqk;
    fp.v_token_stride = index_t(hkv) * dv;
    fp.v_head_stride = dv;
    fp.o_token_stride = hq * o_head;
    fp.o_head_stride = o_head;
  }

  struct stream_item {
    int layer;
    int expert;
    index_t bytes;
  };

  /// Decides whether this wave streams its host experts (mean routed rows per
  /// expert at least stream_min_rows) and, if so, lists them in the order the
  /// MoE layers will read them and enqueues the first `slots` copies.
  void begin_streaming_wave(index_t tokens) {
    streaming_ = false;
    if (staging_slots_ == 0 || !any_host_experts_) return;
    const double mean_rows = double(tokens) * c_.experts_per_tok / double(c_.num_experts);
    if (mean_rows < d_.stream_min_rows) return;
    streaming_ = true;
    stream_items_.clear();
    // per MoE layer, its host experts once per chunk of the wave's MoE pass (ffn_residual)
    stream_chunks_ = tokens > moe_tokens_cap_ ? (tokens + moe_tokens_cap_ - 1) / moe_tokens_cap_ : 1;
    const std::size_t ranges = std::size_t(c_.num_layers) * std::size_t(stream_chunks_);
    layer_first_item_.assign(ranges + 1, 0);
    for (int l = 0; l < c_.num_layers; ++l) {
      const gpu::dlayer& L = m_.layers[std::size_t(l)];
      for (index_t c = 0; c < stream_chunks_; ++c) {
        layer_first_item_[std::size_t(l) * std::size_t(stream_chunks_) + std::size_t(c)] = index_t(stream_items_.size());
        if (!L.is_moe) continue;
        for (int e = 0; e < c_.num_experts; ++e)
          if (L.on_host[std::size_t(e)]) stream_items_.push_back({l, e, L.host_experts[std::size_t(e)].bytes()});
      }
    }
    layer_first_item_[ranges] = index_t(stream_items_.size());
    next_copy_ = 0;
    while (next_copy_ < index_t(stream_items_.size()) && next_copy_ < staging_slots_) enqueue_stream_copy();
  }

  /// The stream items [first, last) of layer l's MoE pass over the current
  /// chunk (moe_chunk_) of a streaming wave.
  std::pair<index_t, index_t> stream_range(int l) const {
    const std::size_t r = std::size_t(l) * std::size_t(stream_chunks_) + std::size_t(moe_chunk_);
    return {layer_first_item_[r], layer_first_item_[r + 1]};
  }

  void enqueue_stream_copy() {
    const stream_item& it = stream_items_[std::size_t(next_copy_)];
    const int slot = int(next_copy_ % staging_slots_);
    const gpu::hmlp& h = m_.layers[std::size_t(it.layer)].host_experts[std::size_t(it.expert)];
    x_.ring_copy(slot, staging_ + index_t(slot) * staging_slot_bytes_, h.data(), it.bytes);
    ++next_copy_;
  }

  /// Layer l's host experts on the device, each from its staging slot (after
  /// its copy landed); the slot is released after the expert's last GEMM and
  /// the next copy is enqueued into it.
  void run_streamed_experts(int l) {
    const index_t H = c_.hidden_size, I = c_.moe_intermediate_size;
    const auto [i0, i1] = stream_range(l);
    for (index_t i = i0; i < i1; ++i) {
      const stream_item& it = stream_items_[std::size_t(i)];
      const int slot = int(i % staging_slots_);
      const gpu::hmlp& h = m_.layers[std::size_t(l)].host_experts[std::size_t(it.expert)];
      const index_t m = rows_[std::size_t(it.expert)];
      x_.ring_acquire(slot);
      if (m > 0) {
        const std::byte* base = staging_ + index_t(slot) * staging_slot_bytes_;
        const wtype t = h.is_bf16() ? wtype::bf16 : wtype::f32;
        const index_t es = gpu::type_bytes(t);
        gpu::dmlp dm;
        dm.gate.w = gpu::dmat{base, t, I, H};
        dm.up.w = gpu::dmat{base + I * H * es, t, I, H};
        dm.down.w = gpu::dmat{base + 2 * I * H * es, t, H, I};
        const index_t row = count_[std::size_t(it.expert)];
        // bf16 experts read the bf16 packed rows of a batched prefill (x16_), as the device experts do
        const void* in16 = gathered16_ && t == wtype::bf16 ? static_cast<const void*>(x16_ + row * H) : nullptr;
        mlp(dm, in16 != nullptr ? nullptr : xg_ + row * H, m, yg_ + row * H, in16, true);
      }
      x_.ring_release(slot);
      if (next_copy_ < index_t(stream_items_.size())) enqueue_stream_copy();
    }
  }

  /// Warm-up only: the products a streamed host expert would run (cuda_exec::
  /// gemm_varying at its rows), on the first device-resident expert's weights
  /// of the layer, into the packed outputs (scratch during the warm-up).
  void warm_streamed_shapes(const gpu::dlayer& L, index_t np) {
    const index_t H = c_.hidden_size;
    int dev = -1;
    for (int e = 0; e < c_.num_experts && dev < 0; ++e)
      if (!L.on_host[std::size_t(e)]) dev = e;
    if (dev < 0 || !gathered16_) return;
    for (int e = 0; e < c_.num_experts; ++e) {
      const index_t m = rows_[std::size_t(e)];
      if (m == 0 || !L.on_host[std::size_t(e)]) continue;
      const index_t row = std::min(index_t(count_[std::size_t(e)]), std::max<index_t>(0, np - m));
      mlp(L.experts[std::size_t(dev)], nullptr, m, yg_ + row * H, x16_ + row * H, true);
    }
  }

  void complete_kv_writes() {
    if constexpr (requires(backend_type& b) { b.complete_host_writes(); }) x_.backend().complete_host_writes();
  }

  /// Device memory in use now; keeps the highest value seen.
  /// The device memory in use (total - free) and NVML's figure for this
  /// process, each kept at its highest; one NVML sample it cannot give makes
  /// the process peak unknown (-1) for the run.
  void sample_used() {
    peak_used_ = std::max(peak_used_, device_used());
    const long long p = x_.process_device_bytes();
    if (p < 0 || !process_readable_)
      process_readable_ = false;
    else
      peak_process_ = std::max(peak_process_, index_t(p));
  }

  /// One decode layer over the B sequences of `seqs` (rows 0..B-1 of x_buf_):
  /// segment A (RMSNorm, projections), the cache append and the hybrid
  /// attention step (host planning, eager), segment B (output projection,
  /// residual, FFN). With decode graphs armed, segment A always and segment B
  /// where it runs on the device alone (decode_segment_b_graphable) run from
  /// CUDA graphs (run_segment); the counters of a MoE pass grouped on the
  /// device are added here, whichever way its segment ran.
  void layer_decode(int l, const std::vector<writescope::sequence_id>& seqs, generation_result& res) {
    using namespace writescope;
    const gpu::dlayer& L = m_.layers[std::size_t(l)];
    const index_t B = index_t(seqs.size());
    const index_t H = c_.hidden_size;
    const int hq = c_.num_heads;
    run_segment(l, 0, B, true, [&] {
      rms_norm(x_buf_, H, L.input_norm, B, int(H), h_, H);
      project(L, B);
    });
    kv_tokens<Layout, space> kv;
    for (int p = 0; p < Layout::planes; ++p) kv.planes[std::size_t(p)] = kvb_[std::size_t(p)];
    kv.num_tokens = B;
    cache_->append(l, seqs, kv);
    const step_outputs<space> so{mem_span<float, space>(att_, B * hq * VD), mem_span<float, space>(), nullptr};
    const step_report r = hybrid_->step(l, seqs, mem_span<const float, space>(q_, B * hq * QD),
                                        float(c_.softmax_scale()), so);
    res.attention_seconds += r.total_seconds;
    res.launch_seconds += r.launch_seconds;
    res.query_wait_seconds += r.query_wait_seconds;
    res.finish_seconds += r.finish_seconds;
    res.cpu_engine_seconds += r.cpu_seconds;
    res.gpu_engine_seconds += r.gpu_seconds;
    res.cpu_tokens += r.cpu_tokens;
    res.assist_tokens += r.assist_tokens;
    res.streamed_tokens += r.streamed_tokens;
    res.window_tokens += r.window_tokens;
    res.resident_tokens += r.resident_tokens;
    if (L.is_moe && split_routes_decode(l, B)) {
      split_decode_ffn(l, B);
      return;
    }
    run_segment(l, 1, B, decode_segment_b_graphable(l, B), [&] {
      attention_output(L, B);
      x_.run(gpu::add_op{x_buf_, y_}, B * H);
      ffn_residual(l, B, true);
    });
    if (L.is_moe && device_routes_decode(l, B)) count_device_routed_pass(B);
  }

  /// Whether decode MoE layer l at n rows takes split_decode_ffn: check_decode_routing
  /// marked it (host experts, all bf16, grouped tables), the pairs fit the
  /// split buffers and the grouped kernels, and this is not a prefill warm-up
  /// pass (the decode warm-up step takes it, counting nothing).
  [[nodiscard]] bool split_routes_decode(int l, index_t n) const {
    const index_t nk = n * c_.experts_per_tok;
    return split_layer_[std::size_t(l)] != 0 && !warming_ && nk <= split_rows_cap_ && nk <= grouped_rows_cap_ &&
           nk <= xg_rows_;
  }

  /// Decode segment B of a layer whose routed experts are on both sides,
  /// grouped on the device (split routing): one wait of the host per layer.
  ///   graph B  attention output, residual, RMSNorm, router, top-k, the pairs
  ///            grouped by expert (group_decode_on_device); the experts chosen
  ///            and the normed rows downloaded to page-locked memory
  ///   graph C  the device experts (grouped kernels, a block row per pair;
  ///            host experts' rows skipped) and the shared experts
  ///   host     waits for graph B's downloads only, groups the pairs as the
  ///            device did (stable by expert), runs the host experts on the
  ///            CPU into their packed rows while graph C runs
  ///   graph D  those rows uploaded (into xg_, free once C is done), copied
  ///            into the packed outputs (host_rows_op; a layer with every
  ///            routed expert on the host uploads straight into them),
  ///            combine, shared experts, residual
  /// The same arithmetic in the same order as the host grouping's pass (the
  /// CPU reads the rows it would have gathered; the combine sums each token's
  /// slots in expert order): the same bits. Graphs B, C and D are run_segment
  /// keys (l, 1), (l, 2), (l, 3): replayed while decode graphs are armed.
  void split_decode_ffn(int l, index_t n) {
    const gpu::dlayer& L = m_.layers[std::size_t(l)];
    const int E = c_.num_experts, k = c_.experts_per_tok;
    const index_t H = c_.hidden_size, nk = n * k;
    using clk = std::chrono::steady_clock;
    const bool phases = step_marking_;
    const clk::time_point t_stage = phases ? clk::now() : clk::time_point{};
    run_segment(l, 1, n, true, [&] {
      attention_output(L, n);
      x_.run(gpu::add_op{x_buf_, y_}, n * H);
      rms_norm(x_buf_, H, L.post_norm, n, int(H), h_, H);
      route_rows(L, n);
      group_decode_on_device(n);
      x_.d2h_async(split_sel_host_, sel_e_, nk * 4);
      x_.d2h_async(split_h_host_, h_, n * H * 4);
    });
    x_.record();  // the host's inputs
    const int window0 = phases ? x_.mark() : -1;
    const clk::time_point t_window = phases ? clk::now() : clk::time_point{};
    // a layer with every routed expert on the host skips the device experts (its table, if any, is all null)
    const bool device_experts =
        L.expert_tables != nullptr && std::any_of(L.on_host.begin(), L.on_host.end(), [](char h) { return h == 0; });
    if (device_experts || L.has_shared)
      run_segment(l, 2, n, true, [&] {
        if (device_experts) {
          x_.run(gpu::gather_rows_op{h_, H, route_dev_, int(H), xg_}, nk * H);
          grouped_experts_on_device(L, expert_first_, nk);
        }
        if (L.has_shared) mlp(L.shared, h_, n, y2_);
      });
    const int window_dev = phases ? x_.mark() : -1;
    const clk::time_point t_issued = phases ? clk::now() : clk::time_point{};
    x_.wait_recorded();
    const clk::time_point t_inputs = clk::now();
    // The device's grouping on the host: packed row of pair i (token i / k) in
    // the order of a stable sort by expert; the host experts' runs of rows.
    split_first_.assign(std::size_t(E) + 1, 0);
    for (index_t i = 0; i < nk; ++i) {
      const int e = split_sel_host_[i];
      if (e < 0 || e >= E) throw std::logic_error("router returned expert " + std::to_string(e));
      ++split_first_[std::size_t(e) + 1];
    }
    for (int e = 0; e < E; ++e) split_first_[std::size_t(e) + 1] += split_first_[std::size_t(e)];
    cursor_.assign(split_first_.begin(), split_first_.end() - 1);
    host_runs_.clear();
    index_t host_rows = 0, device_rows = 0, device_rows_initial = 0;
    const std::vector<char>& init = initial_on_host_[std::size_t(l)];
    for (index_t i = 0; i < nk; ++i) {
      const int e = split_sel_host_[i];
      const index_t row = cursor_[std::size_t(e)]++;
      if (L.on_host[std::size_t(e)]) {
        std::memcpy(split_x_.data() + row * H, split_h_host_ + (i / k) * H, std::size_t(H) * 4);
        ++host_rows;
      } else {
        ++device_rows;
      }
      if (!init[std::size_t(e)]) ++device_rows_initial;
      if (counting_ == counting::decode && d_.migrate_every_steps > 0)
        ++expert_rows_[std::size_t(l)][std::size_t(e)];  // hot placement during the decode
    }
    for (int e = 0; e < E; ++e) {
      const index_t m = split_first_[std::size_t(e) + 1] - split_first_[std::size_t(e)];
      if (m > 0 && L.on_host[std::size_t(e)])
        host_runs_.push_back({e, split_first_[std::size_t(e)], m, split_first_[std::size_t(e)]});
    }
    cpu::run_stats cpu_stats;
    const clk::time_point t0 = t_inputs;  // the CPU experts' time includes gathering their rows
    if (host_rows > 0) run_cpu_experts(L, nullptr, phases ? &cpu_stats : nullptr, split_x_.data(), split_y_host_);
    const clk::time_point t1 = clk::now();
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    cpu_expert_seconds_ += dt;
    cpu_expert_rows_ += host_rows;
    if (counting_ == counting::decode) {
      decode_rows_total_ += nk;
      decode_rows_device_ += device_rows;
      decode_rows_device_initial_ += device_rows_initial;
      decode_cpu_expert_seconds_ += dt;
      for (const host_run& hr : host_runs_) decode_host_expert_bytes_ += L.host_experts[std::size_t(hr.expert)].bytes();
    }
    const int window1 = phases ? x_.mark() : -1;
    const clk::time_point t_out = phases ? clk::now() : clk::time_point{};
    run_segment(l, 3, n, true, [&] {
      if (device_experts) {  // into xg_ (free once graph C is done), then the host experts' rows of yg_
        x_.h2d_async(xg_, split_y_host_, nk * H * 4);
        x_.run(gpu::host_rows_op{sort_keys_, L.expert_tables, xg_, H, yg_}, nk * H);
      } else {
        x_.h2d_async(yg_, split_y_host_, nk * H * 4);  // every row is a host expert's
      }
      const int* comb_rows = route_dev_ + nk;
      const float* comb_w = reinterpret_cast<const float*>(route_dev_ + 2 * nk);
      if (gpu::fits_x4(H, yg_) && gpu::fits_x4(H, y_))
        x_.run(gpu::combine_x4_op{yg_, comb_rows, comb_w, k, int(H / 4), y_}, n * H / 4);
      else
        x_.run(gpu::combine_op{yg_, comb_rows, comb_w, k, int(H), y_}, n * H);
      if (L.has_shared) x_.run(gpu::add_op{y_, y2_}, n * H);
      x_.run(gpu::add_op{x_buf_, y_}, n * H);
    });
    if (device_experts) ++grouped_passes_;
    ++device_routed_passes_;
    ++split_passes_;
    if (phases) {
      window_marks_.push_back({window0, window_dev, window1, x_.mark()});
      auto sec = [](clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); };
      window_phases& w = step_phases_;
      ++w.layers;
      w.stage_issue += sec(t_stage, t_window);
      w.device_issue += sec(t_window, t_issued);
      w.input_wait += sec(t_issued, t_inputs);
      w.cpu_setup += cpu_stats.setup_seconds;
      w.cpu_wake += cpu_stats.wake_seconds;
      w.cpu_experts += dt;
      w.host_window += sec(t_window, t1);
      w.output_issue += sec(t_out, clk::now());
    }
  }

  /// Whether decode segment B of layer l at n rows (attention output, residual,
  /// FFN) runs on the device alone, so that a graph can hold it: a dense
  /// layer, or a MoE layer grouped on the device (device_routes_decode: no
  /// routing download, no host experts, no event or mark). A MoE layer grouped
  /// on the host waits for the router on the host and may run CPU experts:
  /// eager.
  [[nodiscard]] bool decode_segment_b_graphable(int l, index_t n) const {
    const gpu::dlayer& L = m_.layers[std::size_t(l)];
    return !L.is_moe || device_routes_decode(l, n);
  }

  /// The host-side counters of a decode MoE pass grouped on the device, for
  /// every such pass whether its work ran eagerly, was captured or replayed
  /// from a graph: every routed row is a device row (under the placement at
  /// load too), one device-routed pass through the grouped kernels.
  void count_device_routed_pass(index_t n) {
    const index_t rows = n * c_.experts_per_tok;
    if (counting_ == counting::decode) {
      decode_rows_total_ += rows;
      decode_rows_device_ += rows;
      decode_rows_device_initial_ += rows;
    }
    ++device_routed_passes_;
    ++grouped_passes_;
  }

  /// Runs `body` (stream work of decode layer l, segment seg, n rows) eagerly,
  /// or, with decode graphs armed and `graphable`, from the graph of that key:
  /// eager at the key's first call (the first launch of each kernel and the
  /// first cuBLAS call of each shape happen outside a capture), captured at
  /// its second and launched then (a capture runs nothing), launched alone
  /// after. `body`'s host-side effects must be none but idempotent state: a
  /// replay skips it. A capture that fails (a call that cannot be captured:
  /// end_capture returns no graph, or a cuda_error inside it) leaves the key
  /// eager for the rest of the run, counted in graph_fallbacks_ with the first
  /// reason; any other exception ends the capture and propagates.
  template <class F>
  void run_segment(int l, int seg, index_t n, bool graphable, F&& body) {
    if constexpr (has_graphs) {
      if (graphs_armed_ && graphable && !att16_ready_) {
        graph_slot& g = graphs_[graph_key{l, seg, n}];
        if (!g.exec && !g.failed && g.eager_runs++ >= 1) {
          std::string why;
          try {
            x_.begin_capture();
            body();
          } catch (const writescope::cuda_error& e) {
            (void)x_.end_capture(why);
            why = e.what();
          } catch (...) {
            (void)x_.end_capture(why);
            throw;
          }
          if (why.empty()) g.exec = x_.end_capture(why);
          if (g.exec) {
            ++graph_captures_;
          } else {
            g.failed = true;
            ++graph_fallbacks_;
            if (graph_fallback_why_.empty())
              graph_fallback_why_ = (l == c_.num_layers ? std::string("LM head") : "layer " + std::to_string(l) +
                                                                                  " segment " + "ABCD"[seg & 3]) + ", " +
                                    std::to_string(n) + " rows: " + why;
          }
        }
        if (g.exec) {
          x_.launch_graph(g.exec);
          ++graph_launches_;
          return;
        }
      }
    }
    body();
  }

  // Declaration order = destruction order reversed: the executor (and its
  // backend, stream, device memory) outlives the cache and the engine.
  Exec x_;
  model_config c_;
  const weight_source* src_;
  device_options d_;
  wtype prec_;
  rotary rope_;
  gpu::dmodel m_;
  index_t weights_bytes_ = 0, workspace_bytes_ = 0;
  bool any_host_experts_ = false;
  std::vector<wave> waves_;
  index_t T_ = 0, rows_blk_ = 1;

  // device buffers (owned by x_)
  int* ids_ = nullptr;
  index_t* pos_ = nullptr;
  float* inv_freq_ = nullptr;
  float *x_buf_ = nullptr, *h_ = nullptr, *y_ = nullptr, *y2_ = nullptr, *q_ = nullptr, *att_ = nullptr;
  float *qf_ = nullptr, *qa_ = nullptr, *vexp_ = nullptr;
  std::array<float*, 2> kvf_{};
  std::array<writescope::bf16*, 2> kvb_{};
  float *g_ = nullptr, *u_ = nullptr;
  float *router_logits_ = nullptr, *sel_w_ = nullptr, *xg_ = nullptr, *yg_ = nullptr, *eg_ = nullptr;
  /// xg_'s rows: allocated (xg_rows_); with every expert on the device, with
  /// host experts that stream (CPU waves only), and the full packed rows.
  index_t xg_rows_ = 0, xg_small_rows_ = 0, xg_cpu_wave_rows_ = 0, xg_full_rows_ = 0;
  int *sel_e_ = nullptr, *route_dev_ = nullptr, *last_rows_ = nullptr;
  index_t grouped_rows_cap_ = 0;  ///< rows eg_ holds (decode batch × experts per token)
  bool grouped_ok_ = false;       ///< build_expert_tables() made the tables
  std::uint16_t* act16_ = nullptr;
  index_t act16_cap_ = 0;
  float* wide_ = nullptr;
  index_t wide_cap_ = 0;
  void* qp_ = nullptr;
  float* s_ = nullptr;
  void* p_ = nullptr;
  float *op_ = nullptr, *head_n_ = nullptr, *logits_ = nullptr;
  writescope::host_allocation logits_host_mem_;  ///< page-locked [batch][vocab] (host_staging)
  float* logits_host_ = nullptr;
  std::uint64_t* argmax_keys_ = nullptr;              ///< [batch] device: head_greedy's keys (argmax_key)
  writescope::host_allocation argmax_keys_host_mem_;  ///< page-locked [batch]: their copy
  std::uint64_t* argmax_keys_host_ = nullptr;
  std::vector<int> greedy_ids_;                       ///< [live rows] head_greedy's tokens

  // host-side state
  std::vector<int> ids_host_;
  std::vector<index_t> pos_host_;
  std::vector<int> he_, count_, cursor_, srow_, crow_, slot_;
  std::vector<float> hw_, cw_;
  std::vector<int> route_host_;
  index_t grouped_passes_ = 0, per_expert_passes_ = 0;
  /// decode_routing_mode::automatic routes on the device only when one expert
  /// matrix (intermediate x hidden, bf16) is at most this many bytes.
  static constexpr index_t auto_routing_max_matrix_bytes = index_t(32) << 20;
  index_t device_routed_passes_ = 0;  ///< decode MoE passes grouped on the device (decode_routing)
  bool device_routed_ = false;        ///< the current MoE pass was grouped on the device
  std::vector<char> device_only_layer_;  ///< [layer] decode routing on the device applies (check_decode_routing)
  std::vector<char> split_layer_;        ///< [layer] split routing applies: host experts, grouped on the device too
  index_t split_passes_ = 0;             ///< decode MoE passes through split_decode_ffn
  index_t split_rows_cap_ = 0;           ///< routed pairs the split buffers hold (batch x k)
  writescope::host_allocation split_down_mem_, split_up_mem_;  ///< page-locked (host_staging)
  int* split_sel_host_ = nullptr;        ///< [batch x k] the router's experts, downloaded
  float* split_h_host_ = nullptr;        ///< [batch][hidden] the normed rows, downloaded
  float* split_y_host_ = nullptr;        ///< [batch x k][hidden] the CPU experts' packed rows, uploaded
  std::vector<float> split_x_;           ///< [batch x k][hidden] the CPU experts' packed inputs
  std::vector<int> split_first_;         ///< [experts + 1] packed row bounds (host copy of the device grouping)
  std::vector<host_run> host_runs_;
  double* router_wait_ = nullptr;  ///< decode: the result's router wait, summed while a step runs
  /// prefill: the host-side times of the wave being issued (null outside prefill_wave's layer loop)
  prefill_host_seconds* ph_ = nullptr;
  bool warming_ = false;  ///< warm_up_prefill's MoE pass: host experts neither run nor streamed
  std::chrono::steady_clock::time_point moe_issue_from_{};  ///< when the routing counts of the MoE pass arrived

  /// cuBLASLt heuristic queries of the routed-expert GEMMs so far, their host
  /// seconds and the host seconds of all their cuBLASLt calls (0 when emulated).
  std::tuple<long, double, double, long> lt_heuristics() const {
    if constexpr (requires(const Exec& e) { e.gemm_batched_heuristic_queries(); })
      return {x_.gemm_batched_heuristic_queries(), x_.gemm_batched_heuristic_seconds(), x_.gemm_batched_issue_seconds(),
              x_.gemm_batched_calls()};
    else
      return {0L, 0.0, 0.0, 0L};
  }

  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  writescope::host_allocation stage_x_mem_, stage_y_mem_;
  float *stage_x_ = nullptr, *stage_y_ = nullptr;
  index_t stage_cap_ = 0;
  std::vector<float> xin_, gcpu_, ucpu_;
  std::vector<cpu::expert_task> cpu_tasks_;
  int cpu_threads_ = 0;
  // host experts: the arena (page-locked when they stream) and the staging ring
  writescope::host_allocation host_arena_;
  bool host_arena_pinned_ = false;
  std::byte* staging_ = nullptr;
  int staging_slots_ = 0;
  index_t staging_slot_bytes_ = 0;
  bool streaming_ = false;
  std::vector<stream_item> stream_items_;
  std::vector<index_t> layer_first_item_;  ///< per (layer, chunk): its first stream item; the end last
  index_t stream_chunks_ = 1;              ///< chunks of each MoE pass in the streaming wave
  index_t moe_chunk_ = 0;                  ///< the chunk the current prefill MoE pass runs (ffn_residual)
  index_t moe_tokens_cap_ = 0;             ///< tokens of one MoE pass at most (a wave, or its chunk)
  index_t moe_workspace_bytes_ = 0;        ///< the workspaces that scale with moe_tokens_cap_
  index_t next_copy_ = 0;
  // flash prefill
  bool use_flash_ = false;
  bool use_cudnn_ = false;        ///< prefill attention through cuDNN's SDPA (choose_prefill_attention)
  std::string cudnn_why_;         ///< why not, when use_flash_ && !use_cudnn_
  std::byte* cudnn_ws_ = nullptr;  ///< its workspace
  index_t cudnn_ws_bytes_ = 0;
  bool att16_ready_ = false;      ///< act16_ holds the last prefill attention's bf16 output
  int* wave_offsets_ = nullptr;
  std::vector<int> wave_offsets_host_;
  std::uint16_t* qb_ = nullptr;
  float *cbuf_ = nullptr, *kvx_ = nullptr;
  std::uint16_t *kx_ = nullptr, *vx_ = nullptr;
  index_t peak_used_ = 0;
  index_t peak_process_ = 0;  ///< NVML's figure for this process (sample_used)
  bool process_readable_ = true;
  std::vector<std::array<int, 5>> moe_marks_;
  std::vector<writescope::sequence_id> wave_seqs_;  ///< prefill_wave: the wave's sequences (one KV append per layer)
  std::vector<index_t> wave_first_;                   ///< ... and each one's first token in the wave
  // batched prefill experts
  struct batch_group {
    index_t rows = 0;   ///< padded rows of every expert of the group (grouped issue: exact rows)
    int count = 0;      ///< experts
    index_t first = 0;  ///< the group's first entry in the operand tables (grouped issue: its first expert in order_)
  };
  bool batched_prefill_ = false;
  bool gathered16_ = false;  ///< this MoE pass gathered its packed rows to bf16 (x16_) directly
  index_t route_cap_ints_ = 0;
  std::vector<int> rows_, order_, chunk_counts_;
  int bad_expert_ = -1;
  std::vector<const void*> batch_ptrs_;
  std::vector<batch_group> batch_groups_;
  std::vector<index_t> padded_of_;  ///< lay_out_rows: each expert's packed rows (padding included)
  std::vector<int> fit_order_;      ///< fit_groups: the batched experts by load
  std::vector<index_t> fit_rows_;   ///< fit_groups: their loads, ascending
  index_t padded_rows_cap_ = 0;     ///< room for packed rows (padding included) in one MoE pass
  index_t batched_groups_ = 0;      ///< batch_groups_ summed over the timed batched passes
  bool stream_batched_ = false;     ///< this MoE pass's streamed experts run in its batched GEMMs (streams_batched)
  std::vector<int> streamed_slot_;  ///< with stream_batched_: each host expert's staging slot
  index_t stream_batched_passes_ = 0;  ///< prefill MoE passes with stream_batched_
  std::uint16_t *x16_ = nullptr, *a16_ = nullptr;
  unsigned* sort_keys_ = nullptr;  ///< prefill grouping on the device (group_on_device)
  int* sort_pairs_ = nullptr;
  int* pair_ids_ = nullptr;
  int* expert_first_ = nullptr;
  std::byte* sort_temp_ = nullptr;
  index_t sort_temp_bytes_ = 0;
  std::vector<int> first_host_;
  float *g_batch_ = nullptr, *u_batch_ = nullptr;
  index_t batched_passes_ = 0;  ///< prefill MoE layers: start, routed, device experts, streamed, end
  double cpu_expert_seconds_ = 0.0;
  index_t cpu_expert_rows_ = 0;
  // decode steps with host experts: the CPU experts' bytes and seconds, and
  // the marks of the step being run (routing round trips, overlap windows)
  index_t decode_host_expert_bytes_ = 0;
  double decode_cpu_expert_seconds_ = 0.0;
  bool step_marking_ = false;
  std::vector<std::array<int, 2>> trip_marks_;
  /// per layer with host rows: window start, device experts done, window end, combine done
  std::vector<std::array<int, 4>> window_marks_;
  window_phases step_phases_;  ///< the step's window phases so far (host clock; GPU parts at the step's end)
  // placement: routed rows per MoE layer and expert in the prefill, the
  // placement at load, the prefill / decode row counters (count_rows)
  enum class counting { off, prefill, decode };
  counting counting_ = counting::off;
  std::vector<std::vector<index_t>> expert_rows_;
  std::vector<std::vector<char>> initial_on_host_;
  index_t prefill_rows_total_ = 0, prefill_rows_device_ = 0;
  index_t decode_rows_total_ = 0, decode_rows_device_ = 0, decode_rows_device_initial_ = 0;

  // CUDA graphs of the decode segments (run_segment; cuda_exec only)
  static constexpr bool has_graphs = requires(Exec& e, std::string& why) {
    e.begin_capture();
    e.end_capture(why);
  };
  struct graph_key {
    int layer = 0, segment = 0;  ///< segment 0: before the cache append; 1: after the attention step
    index_t rows = 0;
    auto operator<=>(const graph_key&) const = default;
  };
  struct graph_slot {
    typename executor_graph<Exec>::type exec{};  ///< the instantiated graph, once captured
    int eager_runs = 0;                          ///< runs before the capture (the first one is eager)
    bool failed = false;                         ///< its capture failed: eager for the rest of the run
  };
  bool graphs_armed_ = false;  ///< the decode loop of generate(), with device_options::decode_graphs
  std::map<graph_key, graph_slot> graphs_;
  index_t graph_launches_ = 0, graph_captures_ = 0, graph_fallbacks_ = 0;
  std::string graph_fallback_why_;  ///< the first failed capture: where and why

  std::unique_ptr<cache_type> cache_;
  std::unique_ptr<writescope::hybrid_attention<cache_type>> hybrid_;
};

}  // namespace ws_moe
