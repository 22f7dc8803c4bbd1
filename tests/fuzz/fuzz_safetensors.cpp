// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the safetensors parser of examples/moe
// (ws_moe::parse_safetensors, rules H1-D3 of ws_moe/checkpoint.hpp), on whole
// files as bytes: malformed length prefixes, headers, dtypes, shapes, offsets.
//
// Checked on every input: the parser either returns or throws
// writescope::checkpoint_error (any other exception escapes and libFuzzer
// reports it); every returned view lies inside the input and holds exactly
// numel x dtype size bytes; widening every loadable tensor to fp32 reads only
// those bytes (ASan checks the reads). Seeds: tests/fuzz/corpus/fuzz_safetensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include <ws_moe/checkpoint.hpp>

namespace {
[[noreturn]] void fuzz_fail(const char* what) {
  std::fprintf(stderr, "fuzz_safetensors: invariant broken: %s\n", what);
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  try {
    const auto tensors = ws_moe::parse_safetensors(file, "fuzz.safetensors");
    std::size_t total = 0;
    for (const auto& [name, v] : tensors) {
      const auto* begin = file.data();
      if (v.data < begin || v.data > begin + size || v.bytes > std::size_t(begin + size - v.data))
        fuzz_fail("a view points outside the file");
      if (std::uint64_t(v.numel()) * std::uint64_t(ws_moe::info(v.type).bytes) != v.bytes)
        fuzz_fail("view bytes != numel * dtype size");
      total += v.bytes;
      if (v.type == ws_moe::dtype::bf16 || v.type == ws_moe::dtype::f16 || v.type == ws_moe::dtype::f32) {
        std::vector<float> out(std::size_t(v.numel()));
        ws_moe::widen_to_f32(v.type, v.data, out.size(), out.data());
      }
    }
    if (total > size) fuzz_fail("tensors hold more bytes than the file");
  } catch (const writescope::checkpoint_error&) {
  }
  return 0;
}
