// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/kernels.hpp — host-visible declarations of the GPU kernels'
// launchers and of their parameter blocks (docs/CUDA-ENGINE.md). Compiles with the
// host compiler alone (plus <cuda_runtime_api.h>); the definitions live in
// kernels.cuh, which only nvcc compiles.
//
// Linking: every launcher is a function template over the layout (or over a
// dummy `class = void` for the layout-independent ones), declared here and
// explicitly instantiated by ONE .cu file of the program:
//
//     // my_kernels.cu   (compiled by nvcc, -std=c++20, -arch=sm_90)
//     #include <writescope/cuda/kernels.cuh>
//     WS_CUDA_INSTANTIATE_COMMON()
//     WS_CUDA_INSTANTIATE(writescope::gqa_layout<128>)
//     WS_CUDA_INSTANTIATE(writescope::mla_layout<512, 64>)
//
// A layout used with cuda_backend but not instantiated there fails at link time
// with an undefined reference to writescope::gpu::launch_attend<Layout>. A
// program whose backend has the mutation-test hooks
// (basic_cuda_backend<cuda_test_hooks>) also instantiates
// WS_CUDA_INSTANTIATE_TEST_HOOKS(Layout) for each of its layouts.
//
// Parameter blocks travel as kernel parameters (by value, captured at launch),
// so a launch never reads host memory the caller may change afterwards, and
// needs no device-side metadata buffer. Each block stays under 4 KiB (the
// classic kernel-parameter limit); lists longer than the fixed capacities are
// issued as several launches by the caller. Plain aggregates only (no
// [[no_unique_address]], no virtuals): the host compiler and nvcc must agree on
// their layout.
//
// Memory spaces: every pointer in these blocks is device memory unless noted.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../bf16.hpp"
#include "../config.hpp"

namespace writescope::gpu {

// -----------------------------------------------------------------------------
// Attention over lists of tokens (streamed splits and D-windows)
// -----------------------------------------------------------------------------

/// Work items per attend launch.
inline constexpr int max_attend_items = 128;
/// Query heads one CTA attends (a larger group is split over grid.z).
inline constexpr int attend_heads_per_cta = 16;

/// One run of tokens of one sequence in the block format of layout.hpp: token i
/// lives in block `i / block_tokens` after `base` (blocks contiguous, each
/// block_elems elements), row `i % block_tokens`. Only the first `tokens`
/// tokens are read (rows past them may hold poison).
/// launch_attend_listed (sparse splits): `tokens` = nb * block_tokens spans nb
/// whole blocks, and KV head h attends only the blocks listed at
/// block_lists[list_offset + h*(nb + 1)]: [count, i_0, ..., i_{count-1}], each
/// i_j in [0, nb), ascending — as if those blocks alone were contiguous after
/// `base` (count = 0: the empty partial). Out-of-range counts and indices are
/// clamped into the item (never read outside it). launch_attend ignores list_offset.
struct attend_item {
  const bf16* base;   ///< first block (device: a ping-pong buffer or a D-window slot)
  int tokens;         ///< >= 0; 0 gives the empty partial (o = 0, lse = -inf)
  int q_seq;          ///< batch index: query rows q[(q_seq*hq + h)*q_dim ...]
  int out_index;      ///< output rows out_o[(out_index*hq + h)*v_dim ...], out_lse[out_index*hq + h]
  int list_offset;    ///< launch_attend_listed only (see above)
};

/// Decode attention of every item for all heads: grid (items, kv_heads,
/// ceil(group / attend_heads_per_cta)). Writes the partial state of each item
/// and query head: o normalised, lse natural log, fp32. Deterministic.
struct attend_params {
  const float* q;        ///< [batch][hq][q_dim] fp32, unscaled
  float* out_o;          ///< [*][hq][v_dim]
  float* out_lse;        ///< [*][hq]
  const std::int32_t* block_lists;  ///< launch_attend_listed: per-item, per-KV-head block lists (device)
  index_t block_elems;   ///< elements of one block
  float scale;           ///< softmax scale applied to q·k
  int hq;
  int hkv;
  int group;             ///< hq / hkv (MLA: hq)
  int block_tokens;
  int num_items;         ///< <= max_attend_items
  attend_item items[max_attend_items];
};
static_assert(sizeof(attend_params) <= 4096, "attend_params must fit the 4 KiB kernel-parameter limit");

template <class Layout>
void launch_attend(const attend_params& p, cudaStream_t stream);

/// launch_attend for sparse splits: each (item, KV head) attends only the
/// blocks of its list (see attend_item). With every block listed the result is
/// bit-identical to launch_attend's (same loads, same arithmetic, same order).
template <class Layout>
void launch_attend_listed(const attend_params& p, cudaStream_t stream);

/// Mutation tests only (cuda_test_hooks, cuda_debug_options::consumer_delay_cycles):
/// launch_attend (`listed` false) or launch_attend_listed (true) whose every CTA
/// first spins `delay_cycles` SM clock cycles before it reads KV (a slow
/// consumer); the same results. A separate kernel instantiation, so the
/// production kernels carry no such branch; instantiated by
/// WS_CUDA_INSTANTIATE_TEST_HOOKS(Layout) (kernels.cuh).
template <class Layout>
void launch_attend_slow(const attend_params& p, bool listed, long long delay_cycles, cudaStream_t stream);

// -----------------------------------------------------------------------------
// Folding split partials into running per-sequence states
// -----------------------------------------------------------------------------

inline constexpr int max_fold_segments = 128;

/// Splits [split_begin, split_end) (rows of the split workspace) all belong to
/// sequence `batch_index`; they are folded into its running state in order.
struct fold_segment {
  int batch_index;
  int split_begin;
  int split_end;
};

/// state = state ⊕ split[split_begin] ⊕ ... ⊕ split[split_end-1] per segment and
/// head, in split order (merge_state_row semantics, deterministic). Grid
/// (segments, hq).
struct fold_params {
  float* state_o;          ///< [batch][hq][v_dim]
  float* state_lse;        ///< [batch][hq]
  const float* split_o;    ///< [split][hq][v_dim]
  const float* split_lse;  ///< [split][hq]
  int hq;
  int num_segments;        ///< <= max_fold_segments
  fold_segment segments[max_fold_segments];
};
static_assert(sizeof(fold_params) <= 4096, "fold_params must fit the 4 KiB kernel-parameter limit");

template <class Layout>
void launch_fold(const fold_params& p, cudaStream_t stream);

/// Sets `rows` states to the empty partial (o = 0, lse = -inf).
template <class Layout>
void launch_init_state(float* o, float* lse, index_t rows, cudaStream_t stream);

// -----------------------------------------------------------------------------
// HBM-resident region: tensor-core split-K attention over a device item table
// (kernels_resident.cuh; the engine's path only with basic_cuda_backend::set_resident_kernel,
// experimental and off by default: docs/CUDA-ENGINE.md)
// -----------------------------------------------------------------------------

/// One item of tokens of one sequence in the HBM-resident region, in the
/// block format of layout.hpp, stored as runs of contiguous blocks: token i
/// lies in run k = i / run_tokens (resident_attend_params), whose first block
/// is runs[k] (blocks contiguous inside a run, each block_elems elements), at
/// run token j = i % run_tokens: block j / block_tokens of the run, row j %
/// block_tokens. Every run but the item's last holds run_tokens tokens. Only
/// the first `tokens` tokens are read. 24 bytes; lives in a device table.
struct resident_item {
  const bf16* const* runs;  ///< device table of the item's run bases (each 16-byte aligned)
  int tokens;         ///< >= 0; 0 gives the empty partial (o = 0, lse = -inf)
  int q_seq;          ///< batch index: query rows q[(q_seq*hq + h)*q_dim ...]
  int out_index;      ///< partial rows part_o[(out_index*hq + h)*v_dim ...], part_lse[out_index*hq + h]
  int reserved;       ///< 0 (padding)
};
static_assert(sizeof(resident_item) == 24, "resident_item: host and device must agree on its size");

/// Split-K decode attention over `num_items` items of a device table, any
/// count: grid (num_items, kv_heads, ceil(group / 16)), one CTA of
/// resident_attend_threads threads per (item, KV head, 16 query heads). Writes
/// each item's partial state for the KV head's query heads (o normalised, lse
/// natural log, fp32; the merge contract, docs/MERGE-CONTRACT.md). Each partial
/// depends only on its item and its queries (deterministic, batch-invariant).
/// Tokens per CTA: an item's tokens are attended by one CTA, so items of a few
/// hundred tokens keep the GPU busy; a long item is correct but serial.
struct resident_attend_params {
  const float* q;                 ///< [batch][hq][q_dim] fp32, unscaled
  const resident_item* items;     ///< [num_items] device memory, read by the kernel
  float* part_o;                  ///< [*][hq][v_dim] fp32, rows by out_index
  float* part_lse;                ///< [*][hq] fp32
  index_t block_elems;            ///< elements of one block
  float scale;                    ///< softmax scale applied to q·k
  int hq;
  int hkv;
  int group;                      ///< hq / hkv (MLA: hq)
  int block_tokens;
  int run_tokens;                 ///< tokens of an item's run (resident_item), a positive multiple of block_tokens
  int num_items;                  ///< >= 0, any count (grid.x)
};

/// Threads per CTA of the resident attention kernel.
inline constexpr int resident_attend_threads = 128;

/// Enqueues the resident attention kernel on `stream` (asynchronous; the
/// tables and q are read when it runs). num_items <= 0: nothing. Throws
/// cuda_error for a launch error (a grid dimension over the device limit
/// included: hkv or the head groups above 65535).
template <class Layout>
void launch_resident_attend(const resident_attend_params& p, cudaStream_t stream);

/// The resident path's in-order fold: for each segment {batch_index,
/// split_begin, split_end} of the device table `segments`, partial rows
/// [split_begin, split_end) (out_index values of launch_resident_attend) are
/// folded into state row batch_index in row order, per query head, with
/// fold_kernel's arithmetic (merge_state_row; deterministic). Grid
/// (num_segments, hq). Segments name distinct batch indices.
struct resident_fold_params {
  float* state_o;                 ///< [batch][hq][v_dim]
  float* state_lse;               ///< [batch][hq]
  const float* part_o;            ///< [*][hq][v_dim]
  const float* part_lse;          ///< [*][hq]
  const fold_segment* segments;   ///< [num_segments] device memory
  int hq;
  int num_segments;               ///< >= 0, any count
};

template <class Layout>
void launch_resident_fold(const resident_fold_params& p, cudaStream_t stream);

// -----------------------------------------------------------------------------
// Final merge
// -----------------------------------------------------------------------------

/// out = (streamed ⊕ window) ⊕ cpu per row (rows = batch*hq), merge_state_row
/// semantics: exact identities for empty partials, never NaN from empties.
struct merge_params {
  const float* streamed_o;
  const float* streamed_lse;
  const float* window_o;
  const float* window_lse;
  const float* cpu_o;    ///< null (with cpu_lse): no CPU partial, out = streamed ⊕ window
  const float* cpu_lse;
  float* out;      ///< [rows][v_dim]
  float* out_lse;  ///< [rows] or null
  index_t rows;
};

template <class Layout>
void launch_merge(const merge_params& p, cudaStream_t stream);

/// The tail of an all-GPU step on the caller stream (dense_engine's
/// caller-stream path) in one launch, for sequence b and query head h:
///   state = empty ⊕ split[segments[b].split_begin] ⊕ ... ⊕ split[segments[b].split_end - 1]
///   out   = state ⊕ window[b]
/// state written to state_o/state_lse (the streamed partial), out to
/// out/out_lse: the same merge_state_row calls in the same order as
/// launch_init_state + launch_fold + launch_merge (no CPU partial), so the same
/// bits. Grid (batch, hq). launch_fold_merge throws config_error for a batch
/// over max_fold_segments; a batch of 0 launches nothing.
struct fold_merge_params {
  float* state_o;           ///< [batch][hq][v_dim]
  float* state_lse;         ///< [batch][hq]
  const float* split_o;     ///< [split][hq][v_dim]
  const float* split_lse;   ///< [split][hq]
  const float* window_o;    ///< [batch][hq][v_dim]: the D-window partials
  const float* window_lse;  ///< [batch][hq]
  float* out;               ///< [batch][hq][v_dim]
  float* out_lse;           ///< [batch][hq] or null
  int hq;
  int batch;                ///< <= max_fold_segments
  /// segments[b]: sequence b's splits (batch_index b; split_begin == split_end: none).
  fold_segment segments[max_fold_segments];
};
static_assert(sizeof(fold_merge_params) <= 4096, "fold_merge_params must fit the 4 KiB kernel-parameter limit");

template <class Layout>
void launch_fold_merge(const fold_merge_params& p, cudaStream_t stream);

/// Rows of one launch of launch_merge_rows.
inline constexpr int max_merge_rows = 512;

/// The merge of one rank's partials into the running states of a batch
/// (tensor_parallel_mla on device backends, cuda/tensor_parallel.hpp): for
/// k in [0, num_rows) and every query head h,
///   state[rows[k]][h] = state[rows[k]][h] ⊕ part[part_begin + k][h]
/// with merge_state_row's arithmetic and identities (empty partials exact).
/// The rows[k] of one launch are distinct. Grid (num_rows, hq).
struct merge_rows_params {
  float* state_o;         ///< [batch][hq][v_dim]
  float* state_lse;       ///< [batch][hq]
  const float* part_o;    ///< [*][hq][v_dim]
  const float* part_lse;  ///< [*][hq]
  int hq;
  int part_begin;         ///< partial row of k = 0
  int num_rows;           ///< <= max_merge_rows
  int rows[max_merge_rows];  ///< state row (batch index) of partial row part_begin + k
};
static_assert(sizeof(merge_rows_params) <= 4096, "merge_rows_params must fit the 4 KiB kernel-parameter limit");

template <class Layout>
void launch_merge_rows(const merge_rows_params& p, cudaStream_t stream);

// -----------------------------------------------------------------------------
// Scatter of token-major KV into blocks (append, prefill)
// -----------------------------------------------------------------------------

inline constexpr int max_scatter_items = 128;

/// Copy input tokens [src_token, src_token + num_tokens) to rows
/// [dst_token, dst_token + num_tokens) of the block at `dst` (device memory).
struct scatter_item {
  index_t src_token;
  bf16* dst;
  int num_tokens;
  int dst_token;
};

/// Grid (items, planes * kv_heads). Input plane p, token t, head h, element i
/// at planes[p][t*token_stride + h*row_elems + i].
struct scatter_params {
  const bf16* planes[2];
  index_t token_stride;  ///< elements between tokens of the input
  int kv_heads;
  int block_tokens;
  int vectorized;        ///< 1: 16-byte loads/stores (all addresses 16-byte aligned)
  int num_items;         ///< <= max_scatter_items
  scatter_item items[max_scatter_items];
};
static_assert(sizeof(scatter_params) <= 4096, "scatter_params must fit the 4 KiB kernel-parameter limit");

template <class Layout>
void launch_scatter(const scatter_params& p, cudaStream_t stream);

// -----------------------------------------------------------------------------
// Layout-independent kernels (instantiated by WS_CUDA_INSTANTIATE_COMMON())
// -----------------------------------------------------------------------------

/// Fills `count` 16-bit words at `dst` (device) with `value` (poisoning).
template <class = void>
void launch_fill_u16(std::uint16_t* dst, index_t count, std::uint16_t value, cudaStream_t stream);

/// One thread spins for `cycles` SM clock cycles (tests: a long kernel on a stream).
template <class = void>
void launch_spin(long long cycles, cudaStream_t stream);

/// A stream-ordered gate on host progress (the sparse gather pipeline, paper
/// §4.4 and Fig. 6; docs/SPARSE.md §4): one thread waits until each of
/// `counters[0..n)` (page-locked, mapped host memory that host threads write
/// with atomic stores; a device-accessible pointer, 8-byte aligned) is >= `need`,
/// polling with system-scope acquire loads (cuda::atomic_ref) and __nanosleep. Work
/// enqueued after it on `stream` starts only then. Unlike a host function
/// (cudaLaunchHostFunc) no driver callback thread takes part, whose wake-up
/// latency would gate every chunk (docs/DECISIONS.md). The host must eventually raise every counter (on an
/// abort: to the maximum), or the stream never proceeds.
template <class = void>
void launch_wait_host_counters(const unsigned long long* counters, int n, unsigned long long need,
                               cudaStream_t stream);

/// Source blocks one launch of the pull kernel carries by value.
inline constexpr int max_pull_blocks = 480;
/// Threads per CTA of the pull kernel.
inline constexpr int pull_threads_per_cta = 256;

/// One launch of the pull kernel (launch_pull_blocks builds it): block i,
/// block_bytes bytes, is copied from src[i] to dst + i * block_bytes. The
/// pointers travel by value, captured at launch, so no host buffer a later step
/// could overwrite is read by the kernel.
struct pull_params {
  const void* src[max_pull_blocks];  ///< page-locked, device-mapped host memory, read via its host
                                     ///< address (unified addressing); 16-byte aligned
  void* dst;                         ///< device memory (a ping-pong buffer), 16-byte aligned
  index_t block_bytes;               ///< > 0, a multiple of 16
  int count;                         ///< blocks of this launch, <= max_pull_blocks
};
static_assert(sizeof(pull_params) <= 4096, "pull_params must fit the 4 KiB kernel-parameter limit");

/// The device pull of the sparse pipeline (sparse_transfer::device_pull: the
/// alternative to paper §4.4's host gather into staging; docs/SPARSE.md §4.1): copies `count` blocks of `block_bytes` bytes,
/// block i from host address `src[i]` — page-locked and device-mapped memory
/// (cuda_host_alloc / cuda_host_register regions) that the device reads over
/// PCIe — to device memory `dst + i * block_bytes` (contiguous), on `stream`,
/// in stream order. `src` is host memory read during the call only (the
/// pointers are copied into the launches' parameters); launches of at most
/// max_pull_blocks blocks are issued in order. Each launch has min(blocks,
/// max_ctas) CTAs of pull_threads_per_cta threads; a CTA copies whole blocks
/// (grid-stride over the blocks) with 16-byte loads, several in flight per
/// thread before their stores (PCIe read latency). The caller guarantees that
/// the device may access every source (unified addressing and
/// cudaDevAttrCanUseHostPointerForRegisteredMem, mapped memory): an unmapped
/// address is a device fault (a sticky cuda_error at the next check).
/// Throws config_error, before any launch, for block_bytes not a positive
/// multiple of 16, a pointer not 16-byte aligned or max_ctas < 1; cuda_error
/// for a launch error. count <= 0: nothing.
template <class = void>
void launch_pull_blocks(const void* const* src, index_t count, void* dst, index_t block_bytes, int max_ctas,
                        cudaStream_t stream);

}  // namespace writescope::gpu
