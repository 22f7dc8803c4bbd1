// SPDX-License-Identifier: Apache-2.0
// bench/resident_bench.cpp — decode attention over an HBM-resident KV region,
// one layer: the resident kernels (launch_resident_attend over a device item
// table + launch_resident_fold, kernels_resident.cuh) against the path the
// engine uses today (launch_attend + launch_fold, max_attend_items items per
// launch, dense_engine::attend_resident), next to the device's HBM read rate
// measured in the same run (cub reduction, bench/hbm_ceiling.hpp).
//
// Per preset and context: `batch` sequences of `length` tokens each, stored as
// contiguous blocks of the block format in one device allocation and cut into
// items of `item_tokens` tokens, each item in runs of `run_tokens` (the
// engine's resident groups: eviction batches of D tokens; the bases of a
// contiguous sequence here, one table entry per run). Timed per rep,
// after an L2 flush (a 256 MiB device memset outside the timing): the state
// init, every attention launch and every fold. GB/s counts KV bytes only
// (batch × length × token_bytes); `fraction` is that over the HBM read rate.
// The two paths' folded states are compared (max rel-L2 over rows). Table on
// stdout, JSON (--json) rewritten after every row.
#include "bench_util.hpp"

#include <cuda_runtime_api.h>

#include <writescope/cuda/cuda_error.hpp>
#include <writescope/cuda/kernels.hpp>

#include "cuda_timing.hpp"
#include "hbm_ceiling.hpp"

namespace {

using namespace wsb;

constexpr const char* usage_text = R"(resident_bench — resident-region decode attention: new kernels vs launch_attend + launch_fold

  --presets LIST      qwen3,mixtral,dsv2 (default qwen3,dsv2)
  --batch N           sequences (default 16)
  --lengths LIST      tokens per sequence (default 1K,8K,64K)
  --item-tokens LIST  tokens per item, multiples of --block-tokens (default 256)
  --block-tokens N    tokens per block (default 64)
  --run-tokens N      tokens per run of an item (the eviction batch; default 256), a multiple of
                      --block-tokens; items longer than a run must be whole runs
  --reps N            timed repetitions per point (default 10)
  --no-old            time the new kernels only
  --ceiling-mib N     bytes of the HBM read-rate measurement (default 4096)
  --json FILE         results (rewritten after every row)
  --help
)";

struct options {
  std::vector<std::string> presets{"qwen3", "dsv2"};
  int batch = 16;
  std::vector<index_t> lengths{1024, 8192, 65536};
  std::vector<int> item_tokens{256};
  int block_tokens = 64;
  int run_tokens = 256;
  int reps = 10;
  bool old_path = true;
  index_t ceiling_mib = 4096;
  std::string json_path;
};

options parse(int argc, char** argv) {
  options o;
  arg_reader a(argc, argv);
  while (a.next()) {
    const std::string& f = a.flag();
    if (f == "--help" || f == "-h") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    } else if (f == "--presets") {
      o.presets.clear();
      for (const std::string& p : split_list(a.value())) o.presets.push_back(canonical_preset(p));
    } else if (f == "--batch") {
      o.batch = parse_number<int>(f, a.value());
    } else if (f == "--lengths") {
      o.lengths = parse_list<index_t>(f, a.value());
    } else if (f == "--item-tokens") {
      o.item_tokens = parse_list<int>(f, a.value());
    } else if (f == "--run-tokens") {
      o.run_tokens = parse_number<int>(f, a.value());
    } else if (f == "--block-tokens") {
      o.block_tokens = parse_number<int>(f, a.value());
    } else if (f == "--reps") {
      o.reps = parse_number<int>(f, a.value());
    } else if (f == "--no-old") {
      o.old_path = false;
    } else if (f == "--ceiling-mib") {
      o.ceiling_mib = parse_number<index_t>(f, a.value());
    } else if (f == "--json") {
      o.json_path = a.value();
    } else {
      throw usage_error("unknown flag '" + f + "' (--help lists them)");
    }
  }
  if (o.batch < 1 || o.reps < 1 || o.block_tokens < 1 || o.ceiling_mib < 1)
    throw usage_error("--batch, --reps, --block-tokens and --ceiling-mib must be >= 1");
  if (o.run_tokens < 1 || o.run_tokens % o.block_tokens != 0)
    throw usage_error("--run-tokens " + std::to_string(o.run_tokens) + " must be a positive multiple of --block-tokens");
  for (int t : o.item_tokens) {
    if (t < 1 || t % o.block_tokens != 0) throw usage_error("--item-tokens must be positive multiples of --block-tokens");
    if (t > o.run_tokens && t % o.run_tokens != 0)
      throw usage_error("--item-tokens " + std::to_string(t) + ": an item longer than a run must be whole runs of " +
                        std::to_string(o.run_tokens));
  }
  for (index_t l : o.lengths)
    if (l < 1) throw usage_error("--lengths must be >= 1");
  return o;
}



struct run_state {
  const options* o;
  json_file out;
  double hbm_gbps = 0;
  void add(json row) {
    out.doc["rows"].push_back(std::move(row));
    out.write();
  }
};

/// Max over rows of ||a - b|| / ||b||.
double max_rel_l2(const std::vector<float>& a, const std::vector<float>& b, int v_dim) {
  double worst = 0;
  for (std::size_t r = 0; r * std::size_t(v_dim) < a.size(); ++r) {
    double num = 0, den = 0;
    for (int i = 0; i < v_dim; ++i) {
      const double x = a[r * std::size_t(v_dim) + std::size_t(i)], y = b[r * std::size_t(v_dim) + std::size_t(i)];
      num += (x - y) * (x - y);
      den += y * y;
    }
    worst = std::max(worst, den > 0 ? std::sqrt(num / den) : std::sqrt(num));
  }
  return worst;
}

template <class Layout>
void run_preset(run_state& st, const std::string& name, const Layout& L, double scale) {
  const options& o = *st.o;
  constexpr int V = Layout::v_dim;
  const int hq = L.num_q_heads();
  const ws::block_format<Layout> fmt{L, o.block_tokens};
  const index_t be = fmt.block_elems();
  timer_stream ts;
  device_buffer flush(std::size_t(256) << 20);
  auto flush_l2 = [&](cudaStream_t s) { WS_CUDA_TRY(cudaMemsetAsync(flush.as<void>(), 0, std::size_t(256) << 20, s)); };

  for (index_t len : o.lengths) {
    const index_t nb = (len + o.block_tokens - 1) / o.block_tokens;  // blocks per sequence
    const index_t blocks = nb * o.batch;
    const std::size_t region_bytes = std::size_t(blocks * fmt.block_bytes());
    device_buffer region(region_bytes);
    {  // random bf16, a 16 MiB host pattern tiled over the region
      const std::vector<ws::bf16> pat = random_bf16(index_t(8) << 20, 7);
      const std::size_t chunk = pat.size() * sizeof(ws::bf16);
      for (std::size_t off = 0; off < region_bytes; off += chunk)
        WS_CUDA_TRY(cudaMemcpy(region.as<unsigned char>() + off, pat.data(), std::min(chunk, region_bytes - off),
                               cudaMemcpyHostToDevice));
    }
    std::vector<float> qh(std::size_t(o.batch) * hq * Layout::q_dim);
    {
      splitmix64 rng{11};
      for (float& x : qh) x = rng.uniform(-1.0f, 1.0f);
    }
    device_buffer q(qh.size() * 4);
    WS_CUDA_TRY(cudaMemcpy(q.as<float>(), qh.data(), qh.size() * 4, cudaMemcpyHostToDevice));
    const double kv_bytes = double(o.batch) * double(len) * double(L.token_bytes());

    for (int it_tokens : o.item_tokens) {
      // Items: each sequence's tokens in items of it_tokens, in order, each item
      // in runs of run_tokens (one base per run in d_bases).
      const int run_tokens = std::min(it_tokens, o.run_tokens);
      std::vector<ws::gpu::resident_item> items;
      std::vector<const ws::bf16*> item_base;  // the old path's items: one contiguous span each
      std::vector<const ws::bf16*> bases;
      std::vector<ws::gpu::fold_segment> segs;
      for (int s = 0; s < o.batch; ++s)
        for (index_t t0 = 0; t0 < len; t0 += run_tokens)
          bases.push_back(region.as<ws::bf16>() + (index_t(s) * nb + t0 / o.block_tokens) * be);
      device_buffer d_bases(std::max<std::size_t>(bases.size(), 1) * sizeof(const ws::bf16*));
      WS_CUDA_TRY(cudaMemcpy(d_bases.as<void>(), bases.data(), bases.size() * sizeof(const ws::bf16*),
                             cudaMemcpyHostToDevice));
      std::size_t run_at = 0;
      for (int s = 0; s < o.batch; ++s) {
        const int begin = int(items.size());
        for (index_t t0 = 0; t0 < len; t0 += it_tokens) {
          const int tokens = int(std::min<index_t>(it_tokens, len - t0));
          items.push_back({d_bases.as<const ws::bf16*>() + run_at, tokens, s, int(items.size()), 0});
          item_base.push_back(bases[run_at]);
          run_at += std::size_t((tokens + run_tokens - 1) / run_tokens);
        }
        segs.push_back({s, begin, int(items.size())});
      }
      const std::size_t n = items.size();
      device_buffer d_items(n * sizeof(ws::gpu::resident_item)), d_segs(segs.size() * sizeof(ws::gpu::fold_segment));
      WS_CUDA_TRY(cudaMemcpy(d_items.as<void>(), items.data(), n * sizeof(ws::gpu::resident_item), cudaMemcpyHostToDevice));
      WS_CUDA_TRY(cudaMemcpy(d_segs.as<void>(), segs.data(), segs.size() * sizeof(ws::gpu::fold_segment),
                             cudaMemcpyHostToDevice));
      device_buffer part_o(n * hq * V * 4), part_lse(n * hq * 4);
      const std::size_t rows = std::size_t(o.batch) * hq;
      device_buffer new_o(rows * V * 4), new_lse(rows * 4), old_o(rows * V * 4), old_lse(rows * 4);
      const std::size_t old_rows = std::size_t(ws::gpu::max_attend_items) * hq;
      device_buffer split_o(old_rows * V * 4), split_lse(old_rows * 4);

      auto new_path = [&](cudaStream_t s) {
        ws::gpu::launch_init_state<Layout>(new_o.as<float>(), new_lse.as<float>(), index_t(rows), s);
        ws::gpu::resident_attend_params ap{};
        ap.q = q.as<float>();
        ap.items = d_items.as<ws::gpu::resident_item>();
        ap.part_o = part_o.as<float>();
        ap.part_lse = part_lse.as<float>();
        ap.block_elems = be;
        ap.scale = float(scale);
        ap.hq = hq;
        ap.hkv = L.kv_heads();
        ap.group = L.group_size();
        ap.block_tokens = o.block_tokens;
        ap.run_tokens = run_tokens;
        ap.num_items = int(n);
        ws::gpu::launch_resident_attend<Layout>(ap, s);
        ws::gpu::resident_fold_params fp{};
        fp.state_o = new_o.as<float>();
        fp.state_lse = new_lse.as<float>();
        fp.part_o = part_o.as<float>();
        fp.part_lse = part_lse.as<float>();
        fp.segments = d_segs.as<ws::gpu::fold_segment>();
        fp.hq = hq;
        fp.num_segments = int(segs.size());
        ws::gpu::launch_resident_fold<Layout>(fp, s);
      };
      // dense_engine::attend_and_fold's launches, parameter blocks built on the fly.
      ws::gpu::attend_params ap{};
      ws::gpu::fold_params fp{};
      int old_launches = 0;
      auto old_path = [&](cudaStream_t s) {
        ws::gpu::launch_init_state<Layout>(old_o.as<float>(), old_lse.as<float>(), index_t(rows), s);
        ap.q = q.as<float>();
        ap.block_lists = nullptr;
        ap.block_elems = be;
        ap.scale = float(scale);
        ap.hq = hq;
        ap.hkv = L.kv_heads();
        ap.group = L.group_size();
        ap.block_tokens = o.block_tokens;
        ap.out_o = split_o.as<float>();
        ap.out_lse = split_lse.as<float>();
        old_launches = 0;
        for (std::size_t s0 = 0; s0 < n; s0 += ws::gpu::max_attend_items) {
          const std::size_t s1 = std::min(n, s0 + std::size_t(ws::gpu::max_attend_items));
          ap.num_items = int(s1 - s0);
          fp.state_o = old_o.as<float>();
          fp.state_lse = old_lse.as<float>();
          fp.split_o = split_o.as<float>();
          fp.split_lse = split_lse.as<float>();
          fp.hq = hq;
          fp.num_segments = 0;
          for (std::size_t i = s0; i < s1; ++i) {
            const int local = int(i - s0);
            const ws::gpu::resident_item& r = items[i];
            ap.items[local] = {item_base[i], r.tokens, r.q_seq, local, 0};
            if (fp.num_segments > 0 && fp.segments[fp.num_segments - 1].batch_index == r.q_seq)
              fp.segments[fp.num_segments - 1].split_end = local + 1;
            else
              fp.segments[fp.num_segments++] = {r.q_seq, local, local + 1};
          }
          ws::gpu::launch_attend<Layout>(ap, s);
          ws::gpu::launch_fold<Layout>(fp, s);
          ++old_launches;
        }
      };

      auto measure = [&](auto& path) {
        (void)ts.time(flush_l2, path);  // warm-up (function attributes, first launch)
        std::vector<double> t;
        for (int r = 0; r < o.reps; ++r) t.push_back(ts.time(flush_l2, path));
        return std::make_pair(*std::min_element(t.begin(), t.end()), median(t));
      };
      const auto [nb_best, nb_med] = measure(new_path);
      double ob_best = 0, ob_med = 0, diff = -1;
      if (o.old_path) {
        std::tie(ob_best, ob_med) = measure(old_path);
        std::vector<float> a(rows * V), b(rows * V);
        WS_CUDA_TRY(cudaMemcpy(a.data(), new_o.as<float>(), rows * V * 4, cudaMemcpyDeviceToHost));
        WS_CUDA_TRY(cudaMemcpy(b.data(), old_o.as<float>(), rows * V * 4, cudaMemcpyDeviceToHost));
        diff = max_rel_l2(a, b, V);
      }
      const double new_gbps = kv_bytes / nb_best / 1e9;
      const double old_gbps = ob_best > 0 ? kv_bytes / ob_best / 1e9 : 0.0;
      std::printf("%-18s %3d %8lld %6d %7zu | %9.1f %8.0f %6.3f | %9.1f %8.0f %6.3f %5d | %8.1e\n", name.c_str(),
                  o.batch, static_cast<long long>(len), it_tokens, n, nb_best * 1e6, new_gbps,
                  new_gbps / st.hbm_gbps, ob_best * 1e6, old_gbps, old_gbps / st.hbm_gbps, old_launches, diff);
      std::fflush(stdout);
      st.add(json{{"preset", name},
                  {"batch", o.batch},
                  {"length", len},
                  {"item_tokens", it_tokens},
                  {"items", n},
                  {"block_tokens", o.block_tokens},
                  {"run_tokens", run_tokens},
                  {"kv_bytes", kv_bytes},
                  {"hbm_read_gbps", st.hbm_gbps},
                  {"new", {{"best_us", nb_best * 1e6}, {"median_us", nb_med * 1e6}, {"gbps", new_gbps},
                           {"fraction", new_gbps / st.hbm_gbps}, {"launches", 3}}},
                  {"old", o.old_path ? json{{"best_us", ob_best * 1e6}, {"median_us", ob_med * 1e6},
                                            {"gbps", old_gbps}, {"fraction", old_gbps / st.hbm_gbps},
                                            {"launches", 1 + 2 * old_launches}}
                                     : json(nullptr)},
                  {"max_rel_l2_new_vs_old", diff}});
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    run_state st{&o, json_file(o.json_path)};
    st.out.doc["tool"] = "resident_bench";
    st.out.doc["machine"] = machine_info(argc, argv);
    {
      int dev = 0;
      cudaDeviceProp p{};
      WS_CUDA_TRY(cudaGetDevice(&dev));
      WS_CUDA_TRY(cudaGetDeviceProperties(&p, dev));
      st.out.doc["device"] = json{{"gpu", p.name}, {"backend", "cuda"}, {"sms", p.multiProcessorCount}};
      WS_CUDA_TRY(cudaFree(nullptr));
    }
    st.hbm_gbps = hbm_read_gbps(std::size_t(o.ceiling_mib) << 20, 5);
    st.out.doc["hbm_read_gbps"] = st.hbm_gbps;
    st.out.doc["rows"] = json::array();
    st.out.write();
    std::printf("HBM read rate (cub reduction, %lld MiB): %.0f GB/s\n", static_cast<long long>(o.ceiling_mib),
                st.hbm_gbps);
    std::printf("%-18s %3s %8s %6s %7s | %9s %8s %6s | %9s %8s %6s %5s | %8s\n", "preset", "B", "length", "item",
                "items", "new us", "GB/s", "frac", "old us", "GB/s", "frac", "lnch", "rel diff");
    for (const std::string& p : o.presets) {
      if (p == "qwen3")
        run_preset(st, "Qwen3-30B-A3B", ws::gqa_layout<128>(32, 4), ws::presets::qwen3_30b_a3b::softmax_scale());
      else if (p == "mixtral")
        run_preset(st, "Mixtral-8x7B", ws::gqa_layout<128>(32, 8), ws::presets::mixtral_8x7b::softmax_scale());
      else
        run_preset(st, "DeepSeek-V2-Lite", ws::mla_layout<512, 64>(16), ws::presets::deepseek_v2_lite::softmax_scale());
    }
    st.out.write();
    return 0;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "resident_bench: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "resident_bench: error: %s\n", e.what());
    return 3;
  }
}
