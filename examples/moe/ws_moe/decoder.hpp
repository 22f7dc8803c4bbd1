// SPDX-License-Identifier: Apache-2.0
// ws_moe/decoder.hpp — a MoE transformer decoder over one writescope KV cache:
// prefill and token-by-token decode on the host (fp32 compute, bf16 KV), the
// cache split between its unpinned CPU region and the (emulated) GPU side.
//
//   Attn   gqa_attention<HeadDim> | mla_attention<KvLoraRank, RopeDim>
//   cache  inplace_kv_cache<Attn::layout_type, host_backend, pageable_allocator, runtime_policy>,
//          one cache for all layers (one block table per sequence; one routing
//          decision per eviction batch covers every layer)
//
// Prefill (ragged batch, packed): every sequence is admitted with
// begin_sequence(P) — its floor(P/D) eviction batches are routed by the policy
// at write time — then, layer by layer, the prompt's K/V (MLA: latent rows) is
// computed for all tokens, written to its final regions with append_prefill
// as it is produced, and the prompt attends itself causally on the host in
// fp32 (ops.hpp). Decode: per step and layer, the new token's KV goes to the
// D-window (append), hybrid_attention::step attends CPU region ‖ streamed
// pinned blocks ‖ D-window and merges by LSE; after the last layer flush()
// evicts every full D-window to the region the policy picks.
//
// Numerics: weights and activations fp32; the cache holds bf16 KV, so decode
// attention sees bf16-rounded K/V (prefill attention uses the fp32 values, as
// HF does). See docs/DECODERS.md for the comparison with transformers.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#if defined(_OPENMP)
#  include <omp.h>
#endif

#include <writescope/writescope.hpp>

#include "attention.hpp"
#include "model_config.hpp"
#include "moe.hpp"
#include "runtime_policy.hpp"
#include "sampling.hpp"
#include "weights.hpp"

namespace ws_moe {

using writescope::index_t;

/// Physical plan of the KV cache (paper §4.3 PartitionSpec) as the CLI sets it.
struct kv_options {
  int block_tokens = 64;
  int d_window_tokens = 256;
  index_t ping_pong_bytes = index_t{64} << 20;
  index_t ping_pong_blocks = 0;  ///< > 0: overrides ping_pong_bytes
  index_t first_chunk_bytes = 0;  ///< ramp start of a step's chunks (0: none; partition_spec)
  int ping_pong_buffers = 2;
  int gpu_split_blocks = 4;
  int cpu_task_blocks = 16;
  index_t kv_vram_budget_bytes = 0;  ///< D-window + ping-pong must fit; 0 = no limit
  bool poison = false;               ///< poison every region at init (debug)
};

/// What run_options::progress reports: admission (done of total sequences
/// admitted to the cache), prefill (layers), decode (steps).
enum class phase { admission, prefill, decode };

struct run_options {
  int max_new_tokens = 32;
  sampling_options sampling;
  kv_options kv;
  int threads = 0;  ///< CPU attention engine threads (0 = library default: hardware threads - 1)
  /// CPU assist over the pinned region (hybrid_attention; off: the paper's split).
  writescope::assist_options assist{};
  /// writescope::attention_options::all_gpu_steps (--all-gpu-steps).
  bool all_gpu_steps = true;
  bool record_logits = false;
  /// Teacher forcing (--expect --teacher-force): the token fed back for
  /// sequence i after its s-th generated token is (*forced_tokens)[i][s], not the
  /// sampled one (which is still recorded), so the logits of every step stay
  /// comparable with the reference even where a greedy choice flips.
  const std::vector<std::vector<int>>* forced_tokens = nullptr;
  /// Stop tokens (ws_decode --stop-at-eos: the config's eos_token_id, or
  /// --eos-token-id). A sequence that samples one of them has generated its
  /// last token: it leaves the decode batch and its KV blocks and D-window
  /// slot go back to the cache (live_batch). Empty: every sequence generates
  /// max_new_tokens tokens (the speed runs' setting).
  std::vector<int> eos_token_ids;
  std::function<void(phase, int done, int total)> progress;
};

/// The CPU share after a flush: placed tokens of all live sequences, the share
/// of them in the unpinned region, and the policy's target.
struct share_point {
  int step = 0;
  index_t placed_tokens = 0;
  double cpu_share = 0.0;
  double target = 0.0;
};

struct sequence_summary {
  index_t prompt_tokens = 0, placed_tokens = 0, cpu_placed_tokens = 0, window_tokens = 0;
  index_t hbm_placed_tokens = 0;  ///< of placed_tokens, in the HBM-resident region (CUDA path, --hbm-kv)
};

/// Where the thread that drives the GPU spends a prefill (CUDA path; wall
/// seconds summed over the waves): admitting the prompts, setting each wave
/// up, issuing the layers (every wait inside included), of which waiting for
/// each MoE layer's routing counts, issuing the attention, and issuing a MoE
/// layer's work after its counts arrived; at each wave's end waiting for the
/// GPU to finish it, the LM head and sampling of its first tokens, and the
/// device-memory sample; after the last wave the last deferred KV bytes and
/// the decode's page prefault; the expert GEMMs' cuBLASLt calls and heuristic
/// queries (inside the MoE issue). A layer time close to the device phases
/// means the GPU waited for the host. Zero on the host path.
struct prefill_host_seconds {
  double admission_seconds = 0.0;   ///< begin_sequence of every prompt (block tables, routing)
  double wave_setup_seconds = 0.0;  ///< token ids and positions uploaded, streaming set up, embedding
  double memory_sample_seconds = 0.0;  ///< the device-memory samples after each wave (NVML)
  double layers_seconds = 0.0;
  double router_wait_seconds = 0.0;
  double attention_issue_seconds = 0.0;
  double moe_issue_seconds = 0.0;
  double moe_tables_seconds = 0.0;      ///< of which: the routing tables laid out and uploaded
  double moe_gemm_issue_seconds = 0.0;  ///< of which: the batched expert GEMMs issued
  double drain_seconds = 0.0;
  double head_sampling_seconds = 0.0;
  double final_seconds = 0.0;
  /// cuBLASLt heuristic queries of the routed-expert GEMMs during the prefill, and their host seconds.
  long gemm_heuristic_queries = 0;
  double gemm_heuristic_seconds = 0.0;
  double gemm_lt_issue_seconds = 0.0;  ///< host seconds inside those GEMMs' cuBLASLt calls, queries included
  long gemm_lt_calls = 0;              ///< and the number of those calls
};

/// What the CUDA path (ws_moe/gpu/device_decoder.hpp) adds to a run's result:
/// device memory by use, where the experts live, the CPU experts' time.
struct device_report {
  bool used = false;                 ///< false: host path
  std::string device;                ///< the executor's device name
  std::string precision;             ///< GEMM precision (docs/DECODER-INTERNALS.md)
  index_t total_bytes = 0;           ///< device memory of the GPU (0 when emulated)
  index_t budget_bytes = 0;          ///< --vram-budget (or the default)
  index_t used_bytes = 0;            ///< device memory in use after setup (everything)
  index_t weights_bytes = 0;         ///< non-expert weights on the device
  index_t experts_gpu_bytes = 0;     ///< routed experts on the device
  index_t experts_host_bytes = 0;    ///< routed experts in host memory
  index_t kv_bytes = 0;              ///< the cache's device regions (D-window + ping-pong)
  /// Decode attention steps that ran on the caller stream (cuda_backend's
  /// caller-stream steps: all-GPU, nothing streamed; --caller-stream-steps).
  index_t caller_stream_steps = 0;
  /// CUDA graphs of the decode step (--decode-graphs; cuda_exec only): decode
  /// segments launched from a graph (replays, and the launch right after each
  /// capture), graphs captured (one per layer, segment and batch rows), and
  /// captures that failed (that key then ran eagerly), with the first
  /// failure's place and reason.
  index_t decode_graph_launches = 0;
  index_t decode_graph_captures = 0;
  index_t decode_graph_fallbacks = 0;
  std::string decode_graph_fallback_reason;
  index_t workspace_bytes = 0;       ///< activations and scratch of the decoder
  /// Of workspace_bytes, the routed experts' buffers that scale with the tokens
  /// of one MoE pass (routing, its sort, packed rows and their products), and
  /// those tokens: the largest prefill wave, or --prefill-moe-chunk-tokens.
  index_t moe_workspace_bytes = 0;
  index_t moe_pass_tokens = 0;
  /// The split of the VRAM budget between routed experts and the
  /// HBM-resident KV region (--hbm-kv; ws_moe/vram_split.hpp): the mode
  /// ("off", "auto", "fixed"), the bytes the split divided, the region (bytes,
  /// all layers; tokens per layer), the planned KV it weighed (tokens per
  /// layer), P, the step seconds one GiB of each use saves, which went first
  /// ("KV", "experts", "" when no split was made) and the one-line reason.
  std::string hbm_kv = "off";
  index_t split_avail_bytes = 0;
  index_t hbm_region_bytes = 0, hbm_capacity_tokens = 0, kv_demand_tokens = 0;
  double expert_use_probability = 0.0, expert_seconds_per_gib = 0.0, kv_seconds_per_gib = 0.0;
  std::string split_first, split_reason;
  int experts_total = 0, experts_gpu = 0, experts_host = 0;
  std::vector<std::vector<int>> host_experts;  ///< per layer, the experts kept in host memory
  double cpu_expert_seconds = 0.0;   ///< host time in CPU experts
  index_t cpu_expert_rows = 0;       ///< token rows computed by CPU experts
  /// The host's DRAM read ceiling measured at setup for the CPU experts'
  /// bound (ws_moe/dram_ceiling.hpp): "measured", "skipped (--no-dram-ceiling)"
  /// or "not measured (no host experts)"; GB/s, buffer, threads, passes and
  /// the measurement's seconds (setup, in no other figure).
  std::string dram_ceiling = "not measured (no host experts)";
  double dram_read_gbps = 0.0;
  index_t dram_buffer_bytes = 0;
  int dram_threads = 0, dram_passes = 0;
  double dram_seconds = 0.0;
  /// The device experts' kernels: "grouped" (one launch for gate‖up, one for
  /// down per MoE layer when few rows per expert) or why they run per expert.
  std::string expert_kernels;
  index_t grouped_moe_passes = 0;    ///< MoE layer passes through the grouped kernels
  index_t device_routed_moe_passes = 0;  ///< decode MoE passes grouped on the device (--decode-routing device)
  /// Of those, passes of layers with routed experts in host memory (split
  /// routing: one download of the routing and inputs, the CPU's rows back).
  index_t split_routed_moe_passes = 0;
  /// Decode steps chose their tokens on the device (greedy, no recorded logits).
  bool greedy_on_device = false;
  index_t per_expert_moe_passes = 0; ///< MoE layer passes with one cuBLAS product per expert
  /// Decode MoE layers with host experts: the device experts enqueued "before"
  /// the CPU experts or "during" them (--device-experts-issue).
  std::string device_experts_issue = "before";
  index_t batched_moe_passes = 0;    ///< prefill MoE layer passes through the batched GEMMs
  std::string prefill_expert_gemm;   ///< how those GEMMs were issued: "batched" or "grouped"
  std::string prefill_expert_groups; ///< "batched": the groups by "ladder" size or "fitted" to the loads
  index_t batched_groups = 0;        ///< groups of experts over those passes (three GEMMs each when batched)
  int prefill_waves = 0;             ///< groups of sequences prefilled together
  long long prefill_moe_chunk_tokens = 0;  ///< tokens of one prefill MoE pass at most, where a wave is cut (0: whole waves)
  index_t prefill_block_rows = 0;    ///< query rows per prefill attention block (materialised-score path)
  std::string prefill_attention;     ///< which prefill attention ran: "flash" or "materialised scores"
  /// Host experts streamed to the device in prefill (--stream-experts): the
  /// device staging ring's slots and bytes (inside the budget), the mean rows
  /// per expert above which a wave streams, the expert copies made and their bytes.
  int staging_slots = 0;
  index_t staging_bytes = 0;
  double stream_min_rows = 0.0;
  index_t streamed_experts = 0;
  index_t streamed_bytes = 0;
  index_t streamed_batched_passes = 0;  ///< prefill MoE passes whose streamed experts ran in the batched GEMMs
  /// Expert placement (--expert-placement): "id" (by expert id) or "hot"
  /// (migrated after the prefill by its routed rows); the experts swapped
  /// (pairs), pairs skipped (dtypes or sizes differ), the bytes each way, the
  /// time, the per-layer bound; the Zipf router exponent (0: none).
  std::string placement = "id";
  index_t migrations = 0, migrations_skipped = 0;
  index_t migrate_h2d_bytes = 0, migrate_d2h_bytes = 0;
  double migrate_seconds = 0.0;
  int migrate_max_experts = 0;
  /// Hot placement during the decode (--migrate-every-steps N): the rounds
  /// run after decode steps, the swaps they made and their time (in the
  /// steps' time); included in migrations and the bytes above.
  int migrate_every_steps = 0;
  index_t decode_migration_rounds = 0, decode_migrations = 0;
  double decode_migrate_seconds = 0.0;
  double router_zipf = 0.0;
  /// Routed (token, expert) rows of the MoE passes and those of device
  /// experts: prefill (placement at load); decode under the placement at
  /// load and under the one the decode ran with (after a migration).
  index_t prefill_routed_rows = 0, prefill_device_rows = 0;
  index_t decode_routed_rows = 0, decode_device_rows_initial = 0, decode_device_rows = 0;
  /// The unpinned region's pages for the prompts' blocks, made resident
  /// before the prefill (setup, not prefill time): bytes and seconds.
  index_t kv_prefault_bytes = 0;
  double kv_prefault_seconds = 0.0;
  /// The pinned region page-locked at setup for the prompts' blocks (reserve_pinned_blocks).
  index_t kv_pinned_ahead_bytes = 0;
  double kv_pinned_ahead_seconds = 0.0;
  index_t peak_used_bytes = 0;       ///< highest device memory in use sampled at phase boundaries and decode steps
  /// The highest device memory NVML attributed to this process at the same
  /// samples (-1: NVML could not say at some sample; process_memory_source says why).
  index_t peak_process_bytes = -1;
  std::string process_memory_source;
  /// Prefill phases (device time between events on the compute stream; host
  /// time for the CPU parts): attention incl. projections and the KV
  /// write-out, the MoE layers (router, experts, combine), the host-expert
  /// part of them on the CPU, and the host thread's time in append_prefill.
  double prefill_attention_seconds = 0.0;
  double prefill_moe_seconds = 0.0;
  double prefill_cpu_expert_seconds = 0.0;
  double prefill_kv_write_seconds = 0.0;
  /// The MoE part split (device time): router and the host's grouping of the
  /// rows up to their upload, gather + device-resident experts, streamed
  /// experts (waiting for their copies included), CPU experts' return + shared
  /// experts + combine.
  double prefill_moe_route_seconds = 0.0;
  double prefill_moe_device_expert_seconds = 0.0;
  double prefill_moe_streamed_expert_seconds = 0.0;
  double prefill_moe_combine_seconds = 0.0;
  /// The prefill's host thread (wall time, summed over the waves).
  prefill_host_seconds prefill_host;
};

/// A decode step's CPU-expert overlap windows taken apart (CUDA path with host
/// experts; docs/DECODER-INTERNALS.md, "The overlap window's phases"): seconds
/// summed over the step's MoE layers with host rows. Host parts: steady_clock
/// on the thread that drives the GPU (and cpu::run_stats of the CPU experts'
/// call); GPU parts: events on the compute stream.
struct window_phases {
  int layers = 0;             ///< MoE layers with host rows
  double stage_issue = 0.0;   ///< host: enqueue the inputs' D2H copies (just before the window)
  double device_issue = 0.0;  ///< host: enqueue the device and shared experts (inside the CPU experts with --device-experts-issue during)
  double input_wait = 0.0;    ///< host: wait for the inputs' copies (cuda_exec::wait_recorded)
  double cpu_setup = 0.0;     ///< host, of cpu_experts: cpu::run_experts' work items, up to its parallel region
  double cpu_wake = 0.0;      ///< host, of cpu_experts: the region's start to the last team thread in it
  double cpu_experts = 0.0;   ///< host: the CPU experts' call (= step_cpu_expert_seconds)
  double host_window = 0.0;   ///< host: the inputs' copies enqueued to the CPU experts done
  double output_issue = 0.0;  ///< host: enqueue the outputs' H2D copies and the combine (after the window)
  double gpu_window = 0.0;          ///< GPU: the overlap windows (= step_overlap_window_seconds)
  double gpu_device_experts = 0.0;  ///< GPU: window start to the device and shared experts done
  double gpu_output = 0.0;          ///< GPU: window end to the combine done (outputs' H2D, combine)
};

struct generation_result {
  std::string backend = "host backend (emulated GPU)";
  device_report device;
  std::vector<std::vector<int>> tokens;                ///< generated, per sequence
  std::vector<std::vector<float>> logits;              ///< per sequence: [steps][vocab] when recorded
  index_t prefill_tokens = 0;
  /// Bytes of the unpinned region made resident after prefill for the decode's
  /// evictions (prefault_for_decode; part of prefill_seconds).
  index_t cpu_prefault_bytes = 0;
  double prefill_seconds = 0.0;
  std::vector<double> step_seconds;                    ///< wall time of each decode step (TPOT)
  /// Per decode step, summed over the layers: CPU engine seconds, GPU side
  /// seconds (cuda_backend: of earlier launches, see step_report) and KV
  /// tokens the CPU engine attended in the pinned region (CPU assist).
  std::vector<double> step_cpu_engine_seconds, step_gpu_side_seconds;
  std::vector<index_t> step_assist_tokens;
  /// Per decode step, the host thread's time (seconds) summed over the layers:
  /// inside hybrid_attention::step (attention), and of that its launch, query
  /// wait and finish phases (step_report); the MoE router's wait for its
  /// expert choices on the host (CUDA path; 0 on the host path); the eviction
  /// flush after the layers. What the step spends outside these is the rest
  /// of the model's host work and waits.
  std::vector<double> step_attention_seconds, step_launch_seconds, step_query_wait_seconds, step_finish_seconds,
      step_router_wait_seconds, step_flush_seconds;
  /// Per decode step: the LM head, the logits' way to the host and sampling
  /// (outside the layers; the rest of the step is the layers' model work).
  std::vector<double> step_head_seconds;
  /// Per decode step, CUDA path with host experts (else empty): the host
  /// expert bytes read (per MoE layer, each host expert with >= 1 row reads
  /// its weights once, in their host precision), the CPU experts' wall
  /// seconds, and the GPU timeline (events on the compute stream): the step's
  /// span (first work to the logits on the host), its overlap windows (per
  /// layer with host rows: the CPU experts' inputs on the host to their end)
  /// and routing round trips (router's choices to the host, tables back).
  /// docs/DECODER-INTERNALS.md, "CPU experts against their bound".
  std::vector<index_t> step_host_expert_bytes;
  std::vector<double> step_cpu_expert_seconds, step_gpu_span_seconds, step_overlap_window_seconds,
      step_routing_trip_seconds;
  /// Per decode step, same condition: the overlap windows' phases (window_phases).
  std::vector<window_phases> step_window_phases;
  /// Per decode step, for the whole process (getrusage): minor page faults
  /// and involuntary context switches (a step's outlier on the host shows here).
  std::vector<long> step_minor_faults, step_involuntary_switches;
  int warmup_sequences = 0;                            ///< CUDA path: throw-away sequences of the warm-up step (0: none)
  double warmup_seconds = 0.0;                         ///< its wall time (before prefill; in no other figure)
  double attention_seconds = 0.0, cpu_engine_seconds = 0.0, gpu_engine_seconds = 0.0;
  double launch_seconds = 0.0, query_wait_seconds = 0.0, finish_seconds = 0.0;  ///< step_report phases, summed
  double router_wait_seconds = 0.0;  ///< decode steps only (CUDA path)
  index_t cpu_tokens = 0, streamed_tokens = 0, window_tokens = 0;
  index_t resident_tokens = 0;                         ///< attended in place in the HBM-resident region (CUDA path)
  index_t assist_tokens = 0;                           ///< of cpu_tokens: pinned tokens attended by the CPU
  int cpu_batches = 0, gpu_batches = 0;                ///< eviction batches routed during decode
  int hbm_batches = 0;                                 ///< of them, into the HBM-resident region (not in gpu_batches)
  std::vector<share_point> trajectory;
  std::vector<sequence_summary> sequences;             ///< per sequence, when it ended (end_sequence)
  /// Per decode step, the sequences that generated a token in it (the batch
  /// less those stopped by an EOS token; run_options::eos_token_ids).
  std::vector<int> step_sequences;
  int eos_stopped_sequences = 0;  ///< sequences that sampled a stop token before max_new_tokens
  writescope::region_usage usage;
  writescope::partition_spec spec;
  index_t block_bytes = 0;                             ///< one block of one layer
  index_t token_bytes = 0;                             ///< one token of one layer
  std::string policy;        ///< at admission
  std::string policy_final;  ///< after the run (roofline: with the online A)
  std::string layout;
};

/// The attention totals of a result before one decode step; push_step()
/// appends the step's share of them to the per-step series.
struct step_totals {
  double cpu_seconds, gpu_seconds, attention_seconds, launch_seconds, query_wait_seconds, finish_seconds,
      router_wait_seconds;
  index_t assist_tokens;
  rusage usage{};
  explicit step_totals(const generation_result& r)
      : cpu_seconds(r.cpu_engine_seconds),
        gpu_seconds(r.gpu_engine_seconds),
        attention_seconds(r.attention_seconds),
        launch_seconds(r.launch_seconds),
        query_wait_seconds(r.query_wait_seconds),
        finish_seconds(r.finish_seconds),
        router_wait_seconds(r.router_wait_seconds),
        assist_tokens(r.assist_tokens) {
    getrusage(RUSAGE_SELF, &usage);
  }
  /// Appends the step's share of the totals; `flush_seconds`: the step's eviction flush.
  void push_step(generation_result& r, double flush_seconds) const {
    r.step_cpu_engine_seconds.push_back(r.cpu_engine_seconds - cpu_seconds);
    r.step_gpu_side_seconds.push_back(r.gpu_engine_seconds - gpu_seconds);
    r.step_assist_tokens.push_back(r.assist_tokens - assist_tokens);
    r.step_attention_seconds.push_back(r.attention_seconds - attention_seconds);
    r.step_launch_seconds.push_back(r.launch_seconds - launch_seconds);
    r.step_query_wait_seconds.push_back(r.query_wait_seconds - query_wait_seconds);
    r.step_finish_seconds.push_back(r.finish_seconds - finish_seconds);
    r.step_router_wait_seconds.push_back(r.router_wait_seconds - router_wait_seconds);
    r.step_flush_seconds.push_back(flush_seconds);
    rusage now{};
    getrusage(RUSAGE_SELF, &now);
    r.step_minor_faults.push_back(now.ru_minflt - usage.ru_minflt);
    r.step_involuntary_switches.push_back(now.ru_nivcsw - usage.ru_nivcsw);
  }
};

/// After prefill: makes resident the unpinned-region pages that the decode's
/// evictions can take — per sequence ceil(new tokens / block) + one D-window of
/// blocks per layer (inplace_kv_cache::prefault_cpu_region) — so that no
/// eviction step pays page faults. Returns the bytes touched.
template <class Cache>
index_t prefault_for_decode(Cache& cache, int sequences, int max_new_tokens) {
  const writescope::partition_spec& sp = cache.spec();
  const index_t per_sequence = (index_t(max_new_tokens) + sp.block_tokens - 1) / sp.block_tokens + sp.window_blocks();
  return cache.prefault_cpu_region(index_t(sequences) * per_sequence);
}

/// Rejects empty prompts, token ids outside the vocabulary, runs beyond a
/// configured sliding window and max_new_tokens < 1 (config_error).
inline void validate_prompts(const model_config& c, const std::vector<std::vector<int>>& prompts, const run_options& o) {
  using writescope::config_error;
  if (prompts.empty()) throw config_error("generate: no prompts");
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) throw config_error("prompt " + std::to_string(i) + " is empty");
    for (int t : prompts[i])
      if (t < 0 || t >= c.vocab_size)
        throw config_error("prompt " + std::to_string(i) + " has token id " + std::to_string(t) + " outside [0, " +
                           std::to_string(c.vocab_size) + ")");
    if (c.sliding_window && index_t(prompts[i].size()) + o.max_new_tokens > *c.sliding_window)
      throw config_error("sliding-window attention (window " + std::to_string(*c.sliding_window) +
                         ") is not implemented; prompt + new tokens must stay within the window");
  }
  if (o.max_new_tokens < 1) throw config_error("--max-new-tokens must be >= 1");
}

/// The partition spec for `prompts` + max_new_tokens each: either host region
/// can hold every placed token (any policy fits). Throws config_error when the
/// device-side regions exceed the KV VRAM budget.
template <class Layout>
writescope::partition_spec make_partition_spec(const Layout& layout, int num_layers,
                                               const std::vector<std::vector<int>>& prompts, const run_options& o) {
  const kv_options& k = o.kv;
  writescope::partition_spec s;
  s.num_layers = num_layers;
  s.block_tokens = k.block_tokens;
  s.d_window_tokens = k.d_window_tokens;
  s.max_sequences = std::max<int>(1, int(prompts.size()));
  index_t cap = 0;
  for (const auto& p : prompts) {
    const index_t total = index_t(p.size()) + o.max_new_tokens;
    cap += (total / std::max(1, k.d_window_tokens)) * k.d_window_tokens;
  }
  s.cpu_capacity_tokens = std::max<index_t>(cap, k.block_tokens);
  s.pinned_capacity_tokens = std::max<index_t>(cap, k.block_tokens);
  s.pinned_initial_tokens = 0;
  // Page-locked as prefill places blocks there, in slabs of an eighth of the
  // capacity (at least one D-window per sequence). A slab is one
  // registration and breaks a layer's run of blocks: the default (one D per
  // sequence) gave runs of 8-64 blocks, one H2D copy each, and a host
  // enqueue of ~1 ms per layer (step_host_phases).
  s.pinned_growth_tokens = std::max<index_t>(index_t(s.max_sequences) * k.d_window_tokens, cap / 8);
  s.ping_pong_buffers = k.ping_pong_buffers;
  s.gpu_split_blocks = k.gpu_split_blocks;
  s.cpu_task_blocks = k.cpu_task_blocks;
  const index_t block_bytes = writescope::block_format<Layout>{layout, std::max(1, k.block_tokens)}.block_bytes();
  s.ping_pong_bytes = k.ping_pong_blocks > 0 ? k.ping_pong_blocks * block_bytes : k.ping_pong_bytes;
  s.first_chunk_bytes = k.first_chunk_bytes;
  s.validate(layout);
  if (k.kv_vram_budget_bytes > 0) {
    const index_t window = index_t(s.max_sequences) * s.d_window_tokens * layout.token_bytes() * s.num_layers;
    const index_t pp = s.ping_pong_blocks(layout) * block_bytes * s.ping_pong_buffers;
    if (window + pp > k.kv_vram_budget_bytes)
      throw writescope::config_error("KV VRAM budget " + writescope::format_bytes(k.kv_vram_budget_bytes) +
                                     " is smaller than D-window " + writescope::format_bytes(window) + " + ping-pong " +
                                     writescope::format_bytes(pp) + "; lower --d-window or --ping-pong-mib");
  }
  return s;
}

/// The policy's target CPU share of the host-placed tokens at `host_placed`
/// host tokens and `hbm_placed` HBM-resident ones (roofline: eq. 2 with the HBM
/// tokens in Δ'; fixed: r; gpu_only 0; cpu_only 1).
inline double target_share_of(const runtime_policy& p, index_t host_placed, index_t hbm_placed = 0) {
  const auto& v = p.get();
  if (const auto* r = std::get_if<writescope::roofline_policy>(&v)) return r->target_share(host_placed, hbm_placed);
  if (const auto* f = std::get_if<writescope::fixed_ratio>(&v)) return f->cpu_share();
  return std::holds_alternative<writescope::cpu_only>(v) ? 1.0 : 0.0;
}

/// The deployed CPU share of the live sequences `seqs` of `cache` after
/// `step`: CPU-placed tokens over host-placed ones (HBM-resident tokens are in
/// neither), the share the policies set.
template <class Cache>
share_point share_of(const Cache& cache, const std::vector<writescope::sequence_id>& seqs, int step) {
  share_point p;
  p.step = step;
  index_t cpu = 0, hbm = 0;
  for (auto id : seqs) {
    const auto& st = cache.sequence(id);
    p.placed_tokens += st.placed_tokens;
    cpu += st.cpu_placed_tokens;
    hbm += st.hbm_placed_tokens;
  }
  const index_t host = p.placed_tokens - hbm;
  p.cpu_share = host > 0 ? double(cpu) / double(host) : 0.0;
  p.target = target_share_of(cache.policy(), host, hbm);
  return p;
}

/// Records the logits (if asked), picks sequence i's next token, and sets the
/// token fed back (the pick, or the forced one under teacher forcing).
inline void take_token(generation_result& res, sampler& pick, int i, const float* lg, int vocab, std::vector<int>& cur,
                       const run_options& o);
inline void take_token_id(generation_result& res, int i, int t, std::vector<int>& cur, const run_options& o);

/// take_token for sequences [first, first + n) with logits rows lg[0 .. n):
/// in parallel (OpenMP) when greedy — each sequence's token, logits and
/// forced-token slot are its own — else one after another (the sampler's
/// scratch is shared).
inline void take_tokens(generation_result& res, sampler& pick, int first, int n, const float* lg, int vocab,
                        std::vector<int>& cur, const run_options& o) {
  if (pick.greedy()) {
#pragma omp parallel for schedule(static) num_threads(std::max(1, o.threads))
    for (int i = 0; i < n; ++i) take_token(res, pick, first + i, lg + index_t(i) * vocab, vocab, cur, o);
  } else {
    for (int i = 0; i < n; ++i) take_token(res, pick, first + i, lg + index_t(i) * vocab, vocab, cur, o);
  }
}

inline void take_token(generation_result& res, sampler& pick, int i, const float* lg, int vocab, std::vector<int>& cur,
                       const run_options& o) {
  const std::span<const float> row(lg, std::size_t(vocab));
  if (o.record_logits) res.logits[std::size_t(i)].insert(res.logits[std::size_t(i)].end(), row.begin(), row.end());
  take_token_id(res, i, pick.next(i, row), cur, o);
}

/// Sequence i's next token t, chosen already (greedy selection on the device:
/// no logits to record): appended to its tokens and made the next input
/// (or the forced token of that step, run_options::forced_tokens).
inline void take_token_id(generation_result& res, int i, int t, std::vector<int>& cur, const run_options& o) {
  res.tokens[std::size_t(i)].push_back(t);
  cur[std::size_t(i)] = t;
  if (o.forced_tokens && std::size_t(i) < o.forced_tokens->size()) {
    const std::vector<int>& f = (*o.forced_tokens)[std::size_t(i)];
    const std::size_t s = res.tokens[std::size_t(i)].size() - 1;
    if (s < f.size()) cur[std::size_t(i)] = f[s];
  }
}

/// take_tokens for a decode batch that lost sequences: logits row r (of
/// rows.size()) belongs to sequence rows[r].
inline void take_tokens_rows(generation_result& res, sampler& pick, const std::vector<int>& rows, const float* lg,
                             int vocab, std::vector<int>& cur, const run_options& o) {
  const int n = int(rows.size());
  if (pick.greedy()) {
#pragma omp parallel for schedule(static) num_threads(std::max(1, o.threads))
    for (int r = 0; r < n; ++r) take_token(res, pick, rows[std::size_t(r)], lg + index_t(r) * vocab, vocab, cur, o);
  } else {
    for (int r = 0; r < n; ++r) take_token(res, pick, rows[std::size_t(r)], lg + index_t(r) * vocab, vocab, cur, o);
  }
}

/// The sequences of a batch that still generate, in batch order. Both
/// decoders run each decode step over these rows only: row r of the step's
/// activations is sequence rows()[r]. finish_stopped() retires the sequences
/// whose last sampled token is a stop token (run_options::eos_token_ids):
/// their summary is recorded and end_sequence() returns their blocks and
/// D-window slot to the cache at once, so a ragged finish frees capacity
/// while the others go on. finish_all() retires the rest at the end of the
/// run. Host thread only.
class live_batch {
 public:
  explicit live_batch(std::vector<writescope::sequence_id> seqs) : seqs_(std::move(seqs)) {
    rows_.resize(seqs_.size());
    for (std::size_t i = 0; i < rows_.size(); ++i) rows_[i] = int(i);
    live_seqs_ = seqs_;
  }

  [[nodiscard]] bool empty() const noexcept { return rows_.empty(); }
  [[nodiscard]] int size() const noexcept { return int(rows_.size()); }
  /// [live] batch index of each live sequence, ascending.
  [[nodiscard]] const std::vector<int>& rows() const noexcept { return rows_; }
  /// [live] cache ids of the live sequences, in rows() order.
  [[nodiscard]] const std::vector<writescope::sequence_id>& seqs() const noexcept { return live_seqs_; }

  /// Retires the live sequences whose last generated token is one of
  /// o.eos_token_ids (none when the list is empty); counts those that stopped
  /// before o.max_new_tokens in res.eos_stopped_sequences.
  template <class Cache>
  void finish_stopped(Cache& cache, generation_result& res, const run_options& o) {
    if (o.eos_token_ids.empty()) return;
    std::size_t keep = 0;
    for (std::size_t r = 0; r < rows_.size(); ++r) {
      const int i = rows_[r];
      const std::vector<int>& t = res.tokens[std::size_t(i)];
      const bool stop = !t.empty() && std::find(o.eos_token_ids.begin(), o.eos_token_ids.end(), t.back()) !=
                                          o.eos_token_ids.end();
      if (stop) {
        finish(cache, res, i);
        if (int(t.size()) < o.max_new_tokens) ++res.eos_stopped_sequences;
      } else {
        rows_[keep] = i;
        live_seqs_[keep] = seqs_[std::size_t(i)];
        ++keep;
      }
    }
    rows_.resize(keep);
    live_seqs_.resize(keep);
  }

  /// Retires every live sequence (after the last step).
  template <class Cache>
  void finish_all(Cache& cache, generation_result& res) {
    for (int i : rows_) finish(cache, res, i);
    rows_.clear();
    live_seqs_.clear();
  }

 private:
  template <class Cache>
  void finish(Cache& cache, generation_result& res, int i) {
    const writescope::sequence_id id = seqs_[std::size_t(i)];
    const auto& st = cache.sequence(id);
    if (res.sequences.size() < seqs_.size()) res.sequences.resize(seqs_.size());
    res.sequences[std::size_t(i)] = {st.prompt_tokens, st.placed_tokens, st.cpu_placed_tokens,
                                     index_t(st.window_tokens.empty() ? 0 : st.window_tokens[0]), st.hbm_placed_tokens};
    cache.end_sequence(id);
  }

  std::vector<writescope::sequence_id> seqs_;       ///< [batch] every sequence's cache id
  std::vector<int> rows_;                           ///< [live]
  std::vector<writescope::sequence_id> live_seqs_;  ///< [live]
};

template <class Attn>
class decoder {
 public:
  using layout_type = typename Attn::layout_type;
  using weights_type = model_weights<typename Attn::weights_type>;
  using cache_type = writescope::inplace_kv_cache<layout_type, writescope::host_backend, writescope::pageable_allocator,
                                                  runtime_policy>;
  static constexpr int q_dim = Attn::q_dim;
  static constexpr int v_dim = Attn::v_dim;
  static constexpr int row = layout_type::row_elems;

  decoder(const model_config& c, weights_type w) : c_(c), w_(std::move(w)), attn_(c_) {}
  decoder(const decoder&) = delete;  // attn_ points at c_
  decoder& operator=(const decoder&) = delete;

  [[nodiscard]] layout_type layout() const { return attn_.layout(); }
  [[nodiscard]] const model_config& config() const noexcept { return c_; }

  /// The partition spec for `prompts` + max_new_tokens each: either region can
  /// hold every placed token (any policy fits). Throws config_error when the
  /// device-side regions exceed the KV VRAM budget.
  writescope::partition_spec make_spec(const std::vector<std::vector<int>>& prompts, const run_options& o) const {
    return make_partition_spec(layout(), c_.num_layers, prompts, o);
  }

  /// Generates max_new_tokens tokens for every prompt (ragged batch) with
  /// `policy` routing the KV; with o.eos_token_ids a sequence stops after its
  /// first stop token and the decode goes on over the rest (live_batch).
  /// Prompts must be non-empty token ids < vocab (config_error otherwise).
  /// Host thread; the result's per-sequence lists are indexed like `prompts`.
  generation_result generate(const std::vector<std::vector<int>>& prompts, runtime_policy policy, const run_options& o) {
    using namespace writescope;
    validate_prompts(c_, prompts, o);
    const int B = int(prompts.size());
    const int H = c_.hidden_size;
    const int V = c_.vocab_size;
    const int hq = attn_.q_heads();

    generation_result res;
    res.spec = make_spec(prompts, o);
    res.policy = policy.describe();
    backend_type backend;
    cache_type cache(backend, layout(), res.spec, std::move(policy), {}, cache_options{o.kv.poison});
    attention_options ao;
    ao.cpu_threads = o.threads;
    ao.assist = o.assist;
    ao.all_gpu_steps = o.all_gpu_steps;
    ao.task_workspace_reserve_bytes = index_t{256} << 20;  // no page faults in the decode steps (hybrid_attention)
    hybrid_attention<cache_type> hybrid(cache, ao);
    res.block_bytes = cache.format().block_bytes();
    res.token_bytes = layout().token_bytes();
    res.tokens.assign(std::size_t(B), {});
    if (o.record_logits) res.logits.assign(std::size_t(B), {});
    sampler pick(o.sampling, B);

    // ---- admission + prefill ------------------------------------------------
    const auto t_prefill = std::chrono::steady_clock::now();
    std::vector<sequence_id> seqs(static_cast<std::size_t>(B));
    std::vector<index_t> offset(static_cast<std::size_t>(B) + 1, 0);
    index_t announced = 0;  // eq. 2's L is the whole admitted batch, not the prompts placed so far
    for (int i = 0; i < B; ++i) announced += index_t(prompts[std::size_t(i)].size());
    cache.announce_admission(announced);
    for (int i = 0; i < B; ++i) {
      seqs[std::size_t(i)] = cache.begin_sequence(index_t(prompts[std::size_t(i)].size()));
      offset[std::size_t(i) + 1] = offset[std::size_t(i)] + index_t(prompts[std::size_t(i)].size());
      if (o.progress && ((i + 1) % 1024 == 0 || i + 1 == B)) o.progress(phase::admission, i + 1, B);
    }
    const index_t N = offset.back();
    res.prefill_tokens = N;
    std::vector<float> x(static_cast<std::size_t>(N * H));
    std::vector<index_t> pos(static_cast<std::size_t>(N));
    for (int i = 0; i < B; ++i)
      for (index_t t = 0; t < index_t(prompts[std::size_t(i)].size()); ++t) {
        const int tok = prompts[std::size_t(i)][std::size_t(t)];
        std::copy_n(w_.embed.data() + index_t(tok) * H, H, x.data() + (offset[std::size_t(i)] + t) * H);
        pos[std::size_t(offset[std::size_t(i)] + t)] = t;
      }
    for (int l = 0; l < c_.num_layers; ++l) {
      layer_forward_prefill(l, cache, seqs, offset, x, pos);
      if (o.progress) o.progress(phase::prefill, l + 1, c_.num_layers);
    }
    std::vector<float> last(static_cast<std::size_t>(B) * H), logits(static_cast<std::size_t>(B) * V);
    for (int i = 0; i < B; ++i)
      std::copy_n(x.data() + (offset[std::size_t(i) + 1] - 1) * H, H, last.data() + index_t(i) * H);
    head(last.data(), B, logits.data());
    std::vector<int> cur(static_cast<std::size_t>(B));
    take_tokens(res, pick, 0, B, logits.data(), V, cur, o);
    res.cpu_prefault_bytes = prefault_for_decode(cache, B, o.max_new_tokens);
    res.prefill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_prefill).count();
    res.trajectory.push_back(share_of(cache, seqs, 0));

    // ---- decode -------------------------------------------------------------
    const int steps = o.max_new_tokens - 1;
    live_batch live(seqs);
    live.finish_stopped(cache, res, o);  // a first token can be a stop token
    x.resize(std::size_t(B) * H);
    pos.resize(std::size_t(B));
    q_.resize(std::size_t(B) * hq * q_dim);
    out_.resize(std::size_t(B) * hq * v_dim);
    for (int s = 1; s <= steps && !live.empty(); ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const int n = live.size();  // row r = sequence live.rows()[r]
      for (int r = 0; r < n; ++r) {
        const int i = live.rows()[std::size_t(r)];
        std::copy_n(w_.embed.data() + index_t(cur[std::size_t(i)]) * H, H, x.data() + index_t(r) * H);
        pos[std::size_t(r)] = index_t(prompts[std::size_t(i)].size()) + s - 1;
      }
      x.resize(std::size_t(n) * H);
      pos.resize(std::size_t(n));
      const step_totals before(res);
      for (int l = 0; l < c_.num_layers; ++l) layer_forward_decode(l, cache, hybrid, live.seqs(), x, pos, res);
      const auto t_flush = std::chrono::steady_clock::now();
      const flush_report fr = cache.flush();
      before.push_step(res, std::chrono::duration<double>(std::chrono::steady_clock::now() - t_flush).count());
      res.cpu_batches += fr.cpu_batches;
      res.gpu_batches += fr.gpu_batches;
      if (fr.evicted_sequences > 0) res.trajectory.push_back(share_of(cache, live.seqs(), s));
      const auto t_head = std::chrono::steady_clock::now();
      head(x.data(), n, logits.data());
      take_tokens_rows(res, pick, live.rows(), logits.data(), V, cur, o);
      res.step_head_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t_head).count());
      res.step_sequences.push_back(n);
      live.finish_stopped(cache, res, o);
      res.step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (o.progress) o.progress(phase::decode, s, steps);
    }
    if (o.progress && !res.step_seconds.empty() && int(res.step_seconds.size()) < steps)
      o.progress(phase::decode, steps, steps);  // every sequence stopped early: close the bar

    res.usage = cache.usage();  // with the stopped sequences' blocks returned
    res.policy_final = cache.policy().describe();
    live.finish_all(cache, res);
    return res;
  }

 private:
  using backend_type = writescope::host_backend;

  // final norm + LM head: x[n][hidden] -> logits[n][vocab]
  void head(const float* x, index_t n, float* logits) {
    tmp_.resize(std::size_t(n) * c_.hidden_size);
    rms_norm(x, w_.final_norm.data(), n, c_.hidden_size, c_.rms_norm_eps, tmp_.data());
    w_.lm_head.forward(tmp_.data(), n, logits);
  }

  // KV planes (fp32, token-major) -> bf16 planes for the cache.
  void to_bf16(index_t n) {
    const index_t per = index_t(attn_.kv_heads()) * row;
    for (int p = 0; p < Attn::planes; ++p) {
      kvb_[std::size_t(p)].resize(std::size_t(n * per));
      for (index_t i = 0; i < n * per; ++i)
        kvb_[std::size_t(p)][std::size_t(i)] = writescope::bf16::from_float(kvf_[std::size_t(p)][std::size_t(i)]);
    }
  }

  void alloc_planes(index_t n) {
    const index_t per = index_t(attn_.kv_heads()) * row;
    for (int p = 0; p < Attn::planes; ++p) {
      kvf_[std::size_t(p)].resize(std::size_t(n * per));
      kv_ptr_[std::size_t(p)] = kvf_[std::size_t(p)].data();
    }
  }

  void ffn_residual(int l, std::vector<float>& x, index_t n) {
    const int H = c_.hidden_size;
    const auto& L = w_.layers[std::size_t(l)];
    h_.resize(std::size_t(n) * H);
    y_.resize(std::size_t(n) * H);
    rms_norm(x.data(), L.post_norm.data(), n, H, c_.rms_norm_eps, h_.data());
    ffn_forward(c_, L.ffn, h_.data(), n, y_.data());
    for (index_t i = 0; i < n * H; ++i) x[std::size_t(i)] += y_[std::size_t(i)];
  }

  void layer_forward_prefill(int l, cache_type& cache, const std::vector<writescope::sequence_id>& seqs,
                             const std::vector<index_t>& offset, std::vector<float>& x, const std::vector<index_t>& pos) {
    const int H = c_.hidden_size;
    const int hq = attn_.q_heads();
    const index_t N = offset.back();
    const auto& L = w_.layers[std::size_t(l)];
    h_.resize(std::size_t(N) * H);
    rms_norm(x.data(), L.input_norm.data(), N, H, c_.rms_norm_eps, h_.data());
    q_.resize(std::size_t(N) * hq * q_dim);
    alloc_planes(N);
    attn_.project(L.attn, h_.data(), N, pos.data(), q_.data(), kv_ptr_.data());
    to_bf16(N);
    out_.resize(std::size_t(N) * hq * v_dim);
    const index_t per = index_t(attn_.kv_heads()) * row;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const index_t o0 = offset[i], T = offset[i + 1] - offset[i];
      writescope::kv_tokens<layout_type, writescope::pageable_host_space> kv;
      for (int p = 0; p < Attn::planes; ++p) kv.planes[std::size_t(p)] = kvb_[std::size_t(p)].data() + o0 * per;
      kv.num_tokens = T;
      cache.append_prefill(l, seqs[i], kv);  // routed to its final regions as it is produced
      std::array<const float*, Attn::planes> planes{};
      for (int p = 0; p < Attn::planes; ++p) planes[std::size_t(p)] = kvf_[std::size_t(p)].data() + o0 * per;
      attn_.prefill_attend(q_.data() + o0 * hq * q_dim, planes.data(), T, out_.data() + o0 * hq * v_dim);
    }
    y_.resize(std::size_t(N) * H);
    attn_.output(L.attn, out_.data(), N, y_.data());
    for (index_t i = 0; i < N * H; ++i) x[std::size_t(i)] += y_[std::size_t(i)];
    ffn_residual(l, x, N);
  }

  void layer_forward_decode(int l, cache_type& cache, writescope::hybrid_attention<cache_type>& hybrid,
                            const std::vector<writescope::sequence_id>& seqs, std::vector<float>& x,
                            const std::vector<index_t>& pos, generation_result& res) {
    using namespace writescope;
    const int H = c_.hidden_size;
    const int hq = attn_.q_heads();
    const index_t B = index_t(seqs.size());
    const auto& L = w_.layers[std::size_t(l)];
    h_.resize(std::size_t(B) * H);
    rms_norm(x.data(), L.input_norm.data(), B, H, c_.rms_norm_eps, h_.data());
    q_.resize(std::size_t(B) * hq * q_dim);
    alloc_planes(B);
    attn_.project(L.attn, h_.data(), B, pos.data(), q_.data(), kv_ptr_.data());
    to_bf16(B);
    kv_tokens<layout_type, pageable_host_space> kv;
    for (int p = 0; p < Attn::planes; ++p) kv.planes[std::size_t(p)] = kvb_[std::size_t(p)].data();
    kv.num_tokens = B;
    cache.append(l, seqs, kv);
    out_.resize(std::size_t(B) * hq * v_dim);
    step_outputs<pageable_host_space> so{host_span<float>(out_.data(), index_t(out_.size())), host_span<float>(), nullptr};
    const step_report r = hybrid.step(l, seqs, host_span<const float>(q_.data(), index_t(q_.size())), float(attn_.scale()), so);
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
    y_.resize(std::size_t(B) * H);
    attn_.output(L.attn, out_.data(), B, y_.data());
    for (index_t i = 0; i < B * H; ++i) x[std::size_t(i)] += y_[std::size_t(i)];
    ffn_residual(l, x, B);
  }

  model_config c_;
  weights_type w_;
  Attn attn_;
  std::vector<float> h_, y_, q_, out_, tmp_;
  std::array<std::vector<float>, Attn::planes> kvf_;
  std::array<std::vector<writescope::bf16>, Attn::planes> kvb_;
  std::array<float*, Attn::planes> kv_ptr_{};
};

}  // namespace ws_moe
