// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the JSON inputs of the examples/moe loader.
//   first byte even: config.json -> ws_moe::parse_model_config (as
//                    load_model_config reads it), with and without --arch
//   first byte odd:  model.safetensors.index.json -> ws_moe::checkpoint, in a
//                    scratch directory that also holds two valid shards
// The rest of the input is the file's text.
//
// Checked on every input: only writescope::checkpoint_error or
// writescope::config_error escapes (anything else reaches libFuzzer as an
// uncaught exception); an accepted config has the invariants the decoders
// rely on (positive sizes, Hq a multiple of Hkv, experts_per_tok in range,
// even rope dims) and its derived values are computable without UB; an
// accepted index maps every tensor to a shard that has it.
// Seeds: tests/fuzz/corpus/fuzz_json_loaders.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <ws_moe/checkpoint.hpp>
#include <ws_moe/model_config.hpp>

namespace {

[[noreturn]] void fuzz_fail(const char* what) {
  std::fprintf(stderr, "fuzz_json_loaders: invariant broken: %s\n", what);
  std::abort();
}

std::filesystem::path scratch;

// A valid safetensors file with one F32 tensor `name` of 2 elements.
void write_shard(const std::filesystem::path& p, const std::string& name) {
  std::string header = "{\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  std::ofstream f(p, std::ios::binary);
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(char((n >> (8 * i)) & 0xff));
  f << header;
  const float v[2] = {1.0f, -2.0f};
  f.write(reinterpret_cast<const char*>(v), sizeof v);
}

void check_config(const ws_moe::model_config& c) {
  if (c.vocab_size < 1 || c.hidden_size < 1 || c.num_layers < 1 || c.num_heads < 1 || c.num_kv_heads < 1)
    fuzz_fail("accepted config with a non-positive size");
  if (c.kind != ws_moe::arch::deepseek_v2 && (c.num_heads % c.num_kv_heads != 0 || c.head_dim % 2 != 0))
    fuzz_fail("accepted GQA config with Hq % Hkv != 0 or an odd head dim");
  if (c.kind == ws_moe::arch::deepseek_v2 && c.qk_rope_head_dim % 2 != 0) fuzz_fail("accepted an odd rope dim");
  (void)c.softmax_scale();
  (void)c.rope_dim();
  (void)c.parameter_count();  // ws_decode sizes its memory estimate with it
  for (int l = 0; l < std::min(c.num_layers, 64); ++l) (void)c.is_moe_layer(l);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  scratch = std::filesystem::temp_directory_path() / ("ws_fuzz_json_" + std::to_string(::getpid()));
  std::filesystem::create_directories(scratch);
  write_shard(scratch / "a.safetensors", "x");
  write_shard(scratch / "b.safetensors", "y");
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(scratch, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) == 0) {
    // config.json, parsed the way read_json_file does (depth bound, then nlohmann).
    if (ws_moe::detail::json_depth(text) > 32) return 0;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception&) {
      return 0;
    }
    const std::optional<ws_moe::arch> forced[] = {std::nullopt, ws_moe::arch::qwen3_moe, ws_moe::arch::mixtral,
                                                  ws_moe::arch::deepseek_v2};
    for (const auto& f : forced) {
      try {
        check_config(ws_moe::parse_model_config(j, "config.json", f));
      } catch (const writescope::checkpoint_error&) {
      } catch (const writescope::config_error&) {
      }
    }
  } else {
    {
      std::ofstream f(scratch / "model.safetensors.index.json", std::ios::binary | std::ios::trunc);
      f << text;
    }
    try {
      const ws_moe::checkpoint ck(scratch);
      if (ck.num_tensors() == 0) fuzz_fail("accepted an index with no tensors");
      for (const char* name : {"x", "y"})
        if (ck.contains(name) && ck.tensor(name).bytes != 8) fuzz_fail("a mapped tensor has the wrong size");
    } catch (const writescope::checkpoint_error&) {
    }
  }
  return 0;
}
