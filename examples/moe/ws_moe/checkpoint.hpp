// SPDX-License-Identifier: Apache-2.0
// ws_moe/checkpoint.hpp — Hugging Face checkpoint files: memory-mapped
// *.safetensors (single file or sharded with model.safetensors.index.json).
//
// The safetensors format (https://github.com/huggingface/safetensors):
//
//     [8 bytes: N, little-endian u64][N bytes: JSON header][data section]
//
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the data section) plus an optional "__metadata__" object
// of strings. This parser enforces the same rules as the reference
// implementation, each failure a writescope::checkpoint_error naming the file,
// the tensor and the rule:
//
//   H1  the file holds at least the 8-byte length prefix
//   H2  N <= 100 MiB and N <= file size - 8 (a truncated file fails here or in D3)
//   H3  the header is a JSON object, nesting <= 8 levels, valid JSON
//   H4  every entry is an object with a known "dtype" string, a "shape" array of
//       non-negative integers and "data_offsets" = [begin, end], begin <= end
//   H5  "__metadata__", if present, is an object of strings
//   D1  end - begin == product(shape) * dtype size (no overflow)
//   D2  sorted by begin, the tensors tile the data section exactly: the first
//       starts at 0, each starts where the previous ended (no overlap, no gap)
//   D3  the last tensor ends exactly at the end of the file
//
// The parser (parse_safetensors) works on a byte span so it can be fuzzed
// without files; it never reads outside the span and never throws anything but
// checkpoint_error (std::bad_alloc aside). Tensor data is never copied: views
// point into the mapping. Loading (checkpoint::load_f32) widens BF16/F16/F32 to
// fp32 and checks the expected shape.
//
// Caveat: a file truncated by another process *after* it was mapped raises
// SIGBUS on access, like every mmap reader; checkpoints are read-only inputs.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <writescope/error.hpp>

namespace ws_moe {

using writescope::checkpoint_error;

/// Element types of safetensors. Only bf16, f16 and f32 are loadable; the rest
/// are recognised so that a file using them parses and fails with a clear
/// "unsupported dtype" only when such a tensor is requested.
enum class dtype : std::uint8_t { bf16, f16, f32, f64, i8, u8, i16, u16, i32, u32, i64, u64, boolean, f8_e4m3, f8_e5m2 };

struct dtype_info {
  std::string_view name;
  dtype type;
  int bytes;
};

inline constexpr dtype_info dtype_table[] = {
    {"BF16", dtype::bf16, 2},       {"F16", dtype::f16, 2},         {"F32", dtype::f32, 4},
    {"F64", dtype::f64, 8},         {"I8", dtype::i8, 1},           {"U8", dtype::u8, 1},
    {"I16", dtype::i16, 2},         {"U16", dtype::u16, 2},         {"I32", dtype::i32, 4},
    {"U32", dtype::u32, 4},         {"I64", dtype::i64, 8},         {"U64", dtype::u64, 8},
    {"BOOL", dtype::boolean, 1},    {"F8_E4M3", dtype::f8_e4m3, 1}, {"F8_E5M2", dtype::f8_e5m2, 1},
};

[[nodiscard]] inline const dtype_info& info(dtype t) noexcept {
  for (const auto& d : dtype_table)
    if (d.type == t) return d;
  return dtype_table[0];
}

/// A tensor inside a mapped file. `data` points into the mapping (any alignment).
struct tensor_view {
  dtype type = dtype::f32;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;
  std::size_t bytes = 0;

  [[nodiscard]] std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
};

/// "[2, 64]".
inline std::string shape_string(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// IEEE binary16 -> binary32, exact (subnormals, inf, NaN included).
[[nodiscard]] inline float half_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (std::uint32_t(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

/// Widens `n` elements of a bf16/f16/f32 buffer (any alignment) to fp32.
inline void widen_to_f32(dtype t, const std::byte* src, std::size_t n, float* dst) {
  switch (t) {
    case dtype::f32:
      if (n > 0) std::memcpy(dst, src, n * 4);
      return;
    case dtype::bf16:
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t u;
        std::memcpy(&u, src + 2 * i, 2);
        dst[i] = std::bit_cast<float>(std::uint32_t(u) << 16);
      }
      return;
    case dtype::f16:
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t u;
        std::memcpy(&u, src + 2 * i, 2);
        dst[i] = half_to_float(u);
      }
      return;
    default:
      throw checkpoint_error(std::string("widen_to_f32: dtype ") + std::string(info(t).name) + " is not loadable");
  }
}

// -----------------------------------------------------------------------------
// Parser
// -----------------------------------------------------------------------------

inline constexpr std::uint64_t max_header_bytes = std::uint64_t{100} << 20;
inline constexpr int max_header_depth = 8;

namespace detail {

// Nesting depth of a JSON text, ignoring brackets inside strings. Bounds the
// parser's work on hostile input before it builds anything.
inline int json_depth(std::string_view s) noexcept {
  int depth = 0, worst = 0;
  bool in_string = false, escape = false;
  for (char c : s) {
    if (in_string) {
      if (escape) escape = false;
      else if (c == '\\') escape = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '{' || c == '[') worst = std::max(worst, ++depth);
    else if (c == '}' || c == ']') --depth;
  }
  return worst;
}

inline std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

[[noreturn]] inline void fail_at(const std::string& label, const std::string& what) {
  throw checkpoint_error(label + ": " + one_line(what));
}

}  // namespace detail

/// Parses a whole safetensors file held in `file`; views point into it.
/// `label` names the file in messages. Throws checkpoint_error (rules H1–D3).
inline std::map<std::string, tensor_view, std::less<>> parse_safetensors(std::span<const std::byte> file,
                                                                         const std::string& label) {
  const struct {
    const std::string& label;
    [[noreturn]] void operator()(const std::string& what) const { detail::fail_at(label, what); }
  } fail{label};
  const std::uint64_t size = file.size();
  if (size < 8) fail("file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length prefix (H1)");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::uint64_t(std::to_integer<std::uint8_t>(file[std::size_t(i)]));
  if (n > max_header_bytes)
    fail("header length " + std::to_string(n) + " exceeds the 100 MiB limit (H2; corrupt or not a safetensors file)");
  if (n > size - 8)
    fail("header length " + std::to_string(n) + " exceeds the " + std::to_string(size - 8) +
         " bytes after the length prefix (H2; truncated file?)");
  const std::string_view text(reinterpret_cast<const char*>(file.data() + 8), std::size_t(n));
  const std::size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos || text[first] != '{') fail("header is not a JSON object (H3)");
  if (detail::json_depth(text) > max_header_depth)
    fail("header nests deeper than " + std::to_string(max_header_depth) + " levels (H3)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("header is not valid JSON (H3): ") + e.what());
  }
  if (!header.is_object()) fail("header is not a JSON object (H3)");

  const std::uint64_t data_size = size - 8 - n;
  const std::byte* data = file.data() + 8 + n;
  struct span_entry {
    std::uint64_t begin, end;
    const std::string* name;
  };
  std::vector<span_entry> spans;
  std::map<std::string, tensor_view, std::less<>> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) fail("\"__metadata__\" is not an object (H5)");
      for (auto m = e.begin(); m != e.end(); ++m)
        if (!m.value().is_string()) fail("\"__metadata__\" entry \"" + m.key() + "\" is not a string (H5)");
      continue;
    }
    const std::string where = "tensor \"" + name + "\": ";
    if (!e.is_object()) fail(where + "entry is not an object (H4)");
    const auto dt = e.find("dtype");
    if (dt == e.end() || !dt->is_string()) fail(where + "\"dtype\" missing or not a string (H4)");
    const std::string dts = dt->get<std::string>();
    const dtype_info* di = nullptr;
    for (const auto& d : dtype_table)
      if (d.name == dts) di = &d;
    if (!di) fail(where + "unknown dtype \"" + dts + "\" (H4)");
    const auto sh = e.find("shape");
    if (sh == e.end() || !sh->is_array()) fail(where + "\"shape\" missing or not an array (H4)");
    tensor_view v;
    v.type = di->type;
    std::uint64_t numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) fail(where + "shape " + detail::one_line(sh->dump()) + " has a non-integer or negative dimension (H4)");
      const std::uint64_t x = d.get<std::uint64_t>();
      if (x > (std::uint64_t{1} << 53) || __builtin_mul_overflow(numel, x, &numel) || numel > (std::uint64_t{1} << 62))
        fail(where + "shape " + detail::one_line(sh->dump()) + " overflows (D1)");
      v.shape.push_back(std::int64_t(x));
    }
    const auto off = e.find("data_offsets");
    if (off == e.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      fail(where + "\"data_offsets\" is not [begin, end] of non-negative integers (H4)");
    const std::uint64_t b = (*off)[0].get<std::uint64_t>();
    const std::uint64_t en = (*off)[1].get<std::uint64_t>();
    if (b > en) fail(where + "data_offsets [" + std::to_string(b) + ", " + std::to_string(en) + "] has begin > end (H4)");
    std::uint64_t need = 0;
    if (__builtin_mul_overflow(numel, std::uint64_t(di->bytes), &need))
      fail(where + "shape " + shape_string(v.shape) + " overflows (D1)");
    if (en - b != need)
      fail(where + "data_offsets [" + std::to_string(b) + ", " + std::to_string(en) + "] hold " +
           std::to_string(en - b) + " bytes but shape " + shape_string(v.shape) + " x " + dts + " needs " +
           std::to_string(need) + " (D1)");
    if (en > data_size)
      fail(where + "data_offsets end " + std::to_string(en) + " is beyond the " + std::to_string(data_size) +
           "-byte data section (D3; truncated file?)");
    v.data = data + b;
    v.bytes = std::size_t(en - b);
    auto [pos, inserted] = out.emplace(name, std::move(v));
    (void)inserted;  // nlohmann keeps one value per key, so names are unique here
    spans.push_back({b, en, &pos->first});
  }
  std::sort(spans.begin(), spans.end(), [](const span_entry& x, const span_entry& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  std::uint64_t expect = 0;
  const std::string* prev = nullptr;
  for (const span_entry& s : spans) {
    if (s.begin < expect)
      fail("tensor \"" + *s.name + "\" (data_offsets [" + std::to_string(s.begin) + ", " + std::to_string(s.end) +
           "]) overlaps tensor \"" + *prev + "\" which ends at " + std::to_string(expect) + " (D2)");
    if (s.begin > expect)
      fail("tensor \"" + *s.name + "\" starts at " + std::to_string(s.begin) + " but the previous tensor ends at " +
           std::to_string(expect) + ": a gap in the data section (D2)");
    expect = s.end;
    prev = s.name;
  }
  if (expect != data_size)
    fail("tensors end at " + std::to_string(expect) + " but the data section has " + std::to_string(data_size) +
         " bytes (D3; trailing bytes or a truncated header)");
  return out;
}

// -----------------------------------------------------------------------------
// Files
// -----------------------------------------------------------------------------

/// A read-only private mapping of a whole file. Throws checkpoint_error naming
/// the path for a missing, unreadable, non-regular or empty file.
class mapped_file {
 public:
  mapped_file() = default;
  explicit mapped_file(const std::filesystem::path& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw checkpoint_error(path.string() + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw checkpoint_error(path.string() + ": not a regular file");
    }
    size_ = std::size_t(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw checkpoint_error(path.string() + ": mmap failed: " + std::strerror(err));
      }
      data_ = static_cast<const std::byte*>(p);
    }
    ::close(fd);
  }
  mapped_file(mapped_file&& o) noexcept
      : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  mapped_file& operator=(mapped_file&& o) noexcept {
    if (this != &o) {
      reset();
      path_ = std::move(o.path_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  ~mapped_file() { reset(); }

  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  void reset() noexcept {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
    size_ = 0;
  }
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

/// One mapped and parsed .safetensors file.
class safetensors_file {
 public:
  explicit safetensors_file(const std::filesystem::path& path)
      : map_(path), tensors_(parse_safetensors(map_.bytes(), path.string())) {}

  [[nodiscard]] const tensor_view* find(std::string_view name) const {
    const auto it = tensors_.find(name);
    return it == tensors_.end() ? nullptr : &it->second;
  }
  [[nodiscard]] const std::map<std::string, tensor_view, std::less<>>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return map_.path(); }

 private:
  mapped_file map_;
  std::map<std::string, tensor_view, std::less<>> tensors_;
};

/// Reads a whole text file; throws checkpoint_error naming `path` if missing.
inline std::string read_text_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw checkpoint_error(path.string() + ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw checkpoint_error(path.string() + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Parses a JSON file; throws checkpoint_error naming the file for a missing
/// file, invalid JSON or nesting deeper than `max_depth`.
inline nlohmann::json read_json_file(const std::filesystem::path& path, int max_depth = 32) {
  const std::string text = read_text_file(path);
  if (detail::json_depth(text) > max_depth)
    throw checkpoint_error(path.string() + ": nests deeper than " + std::to_string(max_depth) + " levels");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw checkpoint_error(path.string() + ": invalid JSON: " + detail::one_line(e.what()));
  }
}

/// A Hugging Face checkpoint directory: model.safetensors, or the shards named
/// by model.safetensors.index.json ({"weight_map": {tensor: file}}). Every file
/// is mapped and validated when the checkpoint is opened.
class checkpoint {
 public:
  static constexpr const char* single_file = "model.safetensors";
  static constexpr const char* index_file = "model.safetensors.index.json";

  /// Throws checkpoint_error for a missing directory, no weights file, a bad
  /// index (not an object, weight_map missing, non-string or path-like file
  /// names, a tensor absent from its shard) or any file failing H1–D3.
  explicit checkpoint(const std::filesystem::path& dir) : dir_(dir) {
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec))
      throw checkpoint_error(dir.string() + ": checkpoint directory does not exist");
    const auto index = dir / index_file;
    if (std::filesystem::exists(index, ec)) {
      open_index(index);
    } else if (std::filesystem::exists(dir / single_file, ec)) {
      files_.push_back(std::make_unique<safetensors_file>(dir / single_file));
      for (const auto& [name, v] : files_.back()->tensors()) where_.emplace(name, 0);
    } else {
      throw checkpoint_error(dir.string() + ": no " + single_file + " or " + index_file + " in the checkpoint directory");
    }
  }

  [[nodiscard]] bool contains(std::string_view name) const { return where_.find(name) != where_.end(); }

  /// The tensor `name`; throws checkpoint_error "missing tensor" naming the directory.
  [[nodiscard]] const tensor_view& tensor(std::string_view name) const {
    const auto it = where_.find(name);
    if (it == where_.end())
      throw checkpoint_error(dir_.string() + ": missing tensor \"" + std::string(name) + "\"");
    return *files_[it->second]->find(name);
  }

  /// The file holding `name` (for messages).
  [[nodiscard]] std::string file_of(std::string_view name) const {
    const auto it = where_.find(name);
    return it == where_.end() ? dir_.string() : files_[it->second]->path().string();
  }

  /// The tensor `name` after checking that its shape is `shape` exactly and its
  /// dtype is BF16, F16 or F32. Throws checkpoint_error naming file, tensor and rule.
  [[nodiscard]] const tensor_view& checked(std::string_view name, std::span<const std::int64_t> shape) const {
    const tensor_view& v = tensor(name);
    const std::string where = file_of(name) + ": tensor \"" + std::string(name) + "\": ";
    if (!std::equal(v.shape.begin(), v.shape.end(), shape.begin(), shape.end()))
      throw checkpoint_error(where + "shape " + shape_string(v.shape) + ", the config implies " + shape_string(shape));
    if (v.type != dtype::bf16 && v.type != dtype::f16 && v.type != dtype::f32)
      throw checkpoint_error(where + "dtype " + std::string(info(v.type).name) +
                             " is not supported (the decoders load BF16, F16 or F32)");
    return v;
  }

  /// Loads `name` as fp32, checking that its shape is `shape` exactly and its
  /// dtype is BF16, F16 or F32. Throws checkpoint_error naming file, tensor and rule.
  [[nodiscard]] std::vector<float> load_f32(std::string_view name, std::span<const std::int64_t> shape) const {
    const tensor_view& v = checked(name, shape);
    std::vector<float> out(static_cast<std::size_t>(v.numel()));
    widen_to_f32(v.type, v.data, out.size(), out.data());
    return out;
  }
  std::vector<float> load_f32(std::string_view name, std::initializer_list<std::int64_t> shape) const {
    return load_f32(name, std::span<const std::int64_t>(shape.begin(), shape.size()));
  }

  [[nodiscard]] std::size_t num_tensors() const noexcept { return where_.size(); }
  [[nodiscard]] std::size_t num_files() const noexcept { return files_.size(); }
  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return dir_; }

 private:
  void open_index(const std::filesystem::path& index) {
    const nlohmann::json j = read_json_file(index);
    const std::string label = index.string() + ": ";
    if (!j.is_object()) throw checkpoint_error(label + "not a JSON object");
    const auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object()) throw checkpoint_error(label + "\"weight_map\" missing or not an object");
    if (wm->empty()) throw checkpoint_error(label + "\"weight_map\" is empty");
    std::map<std::string, std::size_t> file_ids;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string())
        throw checkpoint_error(label + "weight_map entry \"" + it.key() + "\" is not a file name string");
      const std::string f = it.value().get<std::string>();
      if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos || f.find('\\') != std::string::npos ||
          f.find('\0') != std::string::npos)
        throw checkpoint_error(label + "weight_map entry \"" + it.key() + "\" names \"" + f +
                               "\", which is not a plain file name inside the checkpoint directory");
      auto [pos, inserted] = file_ids.emplace(f, files_.size());
      if (inserted) files_.push_back(std::make_unique<safetensors_file>(dir_ / f));
      if (!files_[pos->second]->find(it.key()))
        throw checkpoint_error(label + "maps \"" + it.key() + "\" to " + f + ", which has no such tensor");
      where_.emplace(it.key(), pos->second);
    }
  }

  std::filesystem::path dir_;
  std::vector<std::unique_ptr<safetensors_file>> files_;
  std::map<std::string, std::size_t, std::less<>> where_;
};

}  // namespace ws_moe
