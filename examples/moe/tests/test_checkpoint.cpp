// SPDX-License-Identifier: Apache-2.0
// Checkpoint loading: the safetensors rules H1–D3 of ws_moe/checkpoint.hpp, the
// sharded index, config.json parsing (both spellings; the public configs), and
// ws_decode's one-line error + non-zero exit on malformed checkpoints and
// calibration files; ws_decode --calibration's entry choice; the CUDA path's
// warm-up step changing no token (emulated).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ws_moe/checkpoint.hpp"
#include "ws_moe/model_config.hpp"
#include <writescope/presets.hpp>

namespace fs = std::filesystem;
using namespace ws_moe;
using nlohmann::json;

namespace {

const fs::path fixtures = WS_MOE_FIXTURES;
const fs::path configs = fs::path(WS_MOE_FIXTURES).parent_path() / "configs";

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b(s.size());
  if (!s.empty()) std::memcpy(b.data(), s.data(), s.size());
  return b;
}

/// A safetensors file image: length prefix (or `forced_len`), header text, data.
std::vector<std::byte> st_image(const std::string& header, const std::vector<std::byte>& data,
                                std::optional<std::uint64_t> forced_len = std::nullopt) {
  std::vector<std::byte> f(8);
  const std::uint64_t n = forced_len.value_or(header.size());
  for (int i = 0; i < 8; ++i) f[std::size_t(i)] = std::byte((n >> (8 * i)) & 0xff);
  const auto h = bytes_of(header);
  f.insert(f.end(), h.begin(), h.end());
  f.insert(f.end(), data.begin(), data.end());
  return f;
}

std::string error_of(const std::vector<std::byte>& image) {
  try {
    parse_safetensors(image, "t.safetensors");
  } catch (const checkpoint_error& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<std::byte> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> b(c.size());
  if (!c.empty()) std::memcpy(b.data(), c.data(), c.size());
  return b;
}

void write_file(const fs::path& p, std::span<const std::byte> b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::trunc);
  out << s;
}

/// A scratch directory removed at scope exit.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::string tmpl = (fs::temp_directory_path() / "ws_moe_test_XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// Splits a safetensors file into (header JSON, data) and reassembles it.
std::pair<json, std::vector<std::byte>> split_st(const std::vector<std::byte>& f) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(f[std::size_t(i)]);
  const std::string h(reinterpret_cast<const char*>(f.data() + 8), std::size_t(n));
  return {json::parse(h), std::vector<std::byte>(f.begin() + 8 + std::ptrdiff_t(n), f.end())};
}

/// Copies the qwen3_moe fixture into `dir` and applies `edit` to the header of model.safetensors.
void copy_fixture_with_header_edit(const fs::path& dir, const std::function<void(json&)>& edit) {
  fs::copy(fixtures / "qwen3_moe", dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  auto [header, data] = split_st(read_file(dir / "model.safetensors"));
  edit(header);
  write_file(dir / "model.safetensors", st_image(header.dump(), data));
}

struct run_result {
  int status = -1;
  std::string output;
};

/// ws_decode with exactly `args` (stdout and stderr together).
run_result run_ws_decode_args(const std::string& args) {
  const std::string cmd = std::string(WS_DECODE_PATH) + " " + args + " 2>&1";
  run_result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) r.output += buf;
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

run_result run_ws_decode(const std::string& args) { return run_ws_decode_args(args + " --max-new-tokens 2 --no-progress"); }

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

void check_public_configs(const fs::path& dir) {
  namespace P = writescope::presets;
  const model_config q = load_model_config(dir / "qwen3_30b_a3b.json");
  CHECK(q.kind == arch::qwen3_moe);
  CHECK(q.num_layers == P::qwen3_30b_a3b::num_layers);
  CHECK(q.num_heads == P::qwen3_30b_a3b::num_q_heads);
  CHECK(q.num_kv_heads == P::qwen3_30b_a3b::num_kv_heads);
  CHECK(q.head_dim == P::qwen3_30b_a3b::layout_type::head_dim);
  CHECK(q.num_experts == 128);
  CHECK(q.experts_per_tok == 8);
  CHECK(q.norm_topk_prob);
  CHECK(q.rope.type == "default");
  CHECK(q.rope.theta == 1e6);
  CHECK(q.softmax_scale() == doctest::Approx(P::qwen3_30b_a3b::softmax_scale()));
  for (int l = 0; l < q.num_layers; ++l) CHECK(q.is_moe_layer(l));

  const model_config m = load_model_config(dir / "mixtral_8x7b.json");
  CHECK(m.kind == arch::mixtral);
  CHECK(m.num_layers == P::mixtral_8x7b::num_layers);
  CHECK(m.num_heads == P::mixtral_8x7b::num_q_heads);
  CHECK(m.num_kv_heads == P::mixtral_8x7b::num_kv_heads);
  CHECK(m.head_dim == 128);  // hidden_size / heads: the Hub file has no head_dim
  CHECK(m.num_experts == 8);
  CHECK(m.experts_per_tok == 2);
  CHECK(m.moe_intermediate_size == 14336);
  CHECK(m.softmax_scale() == doctest::Approx(P::mixtral_8x7b::softmax_scale()));

  const model_config d = load_model_config(dir / "deepseek_v2_lite.json");
  CHECK(d.kind == arch::deepseek_v2);
  CHECK(d.num_layers == P::deepseek_v2_lite::num_layers);
  CHECK(d.num_heads == P::deepseek_v2_lite::num_q_heads);
  CHECK(d.kv_lora_rank == P::deepseek_v2_lite::layout_type::kv_lora_rank);
  CHECK(d.qk_rope_head_dim == P::deepseek_v2_lite::qk_rope_head_dim);
  CHECK(d.qk_nope_head_dim == P::deepseek_v2_lite::qk_nope_head_dim);
  CHECK(d.v_head_dim == P::deepseek_v2_lite::v_head_dim);
  CHECK(d.q_lora_rank == 0);
  CHECK(d.rope.type == "yarn");
  CHECK(d.rope.factor == P::deepseek_v2_lite::yarn_factor);
  CHECK(d.rope.mscale_all_dim == P::deepseek_v2_lite::yarn_mscale_all_dim);
  CHECK(d.softmax_scale() == doctest::Approx(P::deepseek_v2_lite::softmax_scale()).epsilon(1e-12));
  CHECK(d.num_experts == 64);
  CHECK(d.experts_per_tok == 6);
  CHECK(d.n_shared_experts == 2);
  CHECK_FALSE(d.is_moe_layer(0));
  CHECK(d.is_moe_layer(1));
  CHECK(d.topk_method == "greedy");
}

}  // namespace

// -----------------------------------------------------------------------------

TEST_CASE("fp16 widening is exact (normals, subnormals, signed zero, inf, NaN)") {
  CHECK(half_to_float(0x3c00) == 1.0f);
  CHECK(half_to_float(0xc000) == -2.0f);
  CHECK(half_to_float(0x7bff) == 65504.0f);
  CHECK(half_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(half_to_float(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(half_to_float(0x0400) == std::ldexp(1.0f, -14));
  CHECK(std::signbit(half_to_float(0x8000)));
  CHECK(std::isinf(half_to_float(0x7c00)));
  CHECK(std::isnan(half_to_float(0x7e00)));
  for (std::uint32_t h = 0; h < 0x10000; ++h) {  // every finite half round-trips through float
    const float f = half_to_float(std::uint16_t(h));
    if (!std::isfinite(f)) continue;
    const double back = double(f);
    CHECK_MESSAGE(double(half_to_float(std::uint16_t(h))) == back, h);
  }
}

TEST_CASE("a well-formed file parses; BF16, F16 and F32 widen to the stored values") {
  // t1: BF16 [2] = {1, -2}; t2: F16 [1] = {0.5}; t3: F32 [1] = {3.25}
  std::vector<std::byte> data;
  auto put16 = [&](std::uint16_t u) {
    data.push_back(std::byte(u & 0xff));
    data.push_back(std::byte(u >> 8));
  };
  put16(0x3f80);
  put16(0xc000);
  put16(0x3800);
  const float f = 3.25f;
  const auto* fb = reinterpret_cast<const std::byte*>(&f);
  data.insert(data.end(), fb, fb + 4);
  const std::string h = R"({"__metadata__":{"format":"pt"},"t1":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                        R"("t2":{"dtype":"F16","shape":[1],"data_offsets":[4,6]},"t3":{"dtype":"F32","shape":[1],"data_offsets":[6,10]}})";
  const auto image = st_image(h + "   ", data);  // trailing header padding is allowed
  const auto t = parse_safetensors(image, "ok");
  REQUIRE(t.size() == 3);
  float out[2];
  widen_to_f32(t.at("t1").type, t.at("t1").data, 2, out);
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -2.0f);
  widen_to_f32(t.at("t2").type, t.at("t2").data, 1, out);
  CHECK(out[0] == 0.5f);
  widen_to_f32(t.at("t3").type, t.at("t3").data, 1, out);  // unaligned source
  CHECK(out[0] == 3.25f);
  // zero-element tensors and an empty header object are valid
  CHECK(parse_safetensors(st_image(R"({"e":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]}})", {}), "e").size() == 1);
  CHECK(parse_safetensors(st_image("{}", {}), "empty").empty());
}

TEST_CASE("every header rule fails with a checkpoint_error naming the file, the tensor and the rule") {
  const std::vector<std::byte> d4(4);
  auto one = [](const std::string& entry) { return R"({"w":)" + entry + "}"; };
  const std::string ok_entry = R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  struct error_case {
    const char* what;
    std::vector<std::byte> image;
    const char* expect;
  };
  const std::vector<error_case> cases{
      {"short file", bytes_of("abc"), "shorter than the 8-byte header length prefix (H1)"},
      {"length beyond file", st_image(one(ok_entry), d4, 4096), "truncated file?"},
      {"huge length", st_image(one(ok_entry), d4, std::uint64_t{1} << 40), "100 MiB limit (H2"},
      {"array header", st_image("[1,2]", {}), "not a JSON object (H3)"},
      {"empty header", st_image("", {}), "not a JSON object (H3)"},
      {"invalid JSON", st_image(R"({"w":{"dtype":)", {}), "not valid JSON (H3)"},
      {"deep nesting", st_image("{\"a\":" + std::string(5000, '[') + std::string(5000, ']') + "}", {}), "nests deeper"},
      {"entry not object", st_image(one("7"), d4), "tensor \"w\": entry is not an object (H4)"},
      {"no dtype", st_image(one(R"({"shape":[1],"data_offsets":[0,4]})"), d4), "\"dtype\" missing"},
      {"unknown dtype", st_image(one(R"({"dtype":"F33","shape":[1],"data_offsets":[0,4]})"), d4), "unknown dtype \"F33\""},
      {"negative dim", st_image(one(R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})"), d4), "negative dimension"},
      {"float dim", st_image(one(R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})"), d4), "non-integer"},
      {"no shape", st_image(one(R"({"dtype":"F32","data_offsets":[0,4]})"), d4), "\"shape\" missing"},
      {"offsets arity", st_image(one(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})"), d4), "[begin, end]"},
      {"begin > end", st_image(one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,0]})"), d4), "begin > end"},
      {"size mismatch", st_image(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})"), d4), "needs 8 (D1)"},
      {"shape overflow", st_image(one(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})"), d4),
       "overflows (D1)"},
      {"beyond data", st_image(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), d4), "beyond the 4-byte data section"},
      {"trailing bytes", st_image(one(ok_entry), std::vector<std::byte>(12)), "data section has 12 bytes (D3"},
      {"gap at start", st_image(one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})"), std::vector<std::byte>(8)),
       "a gap in the data section (D2)"},
      {"overlap",
       st_image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                std::vector<std::byte>(8)),
       "overlaps tensor"},
      {"metadata not object", st_image(R"({"__metadata__":[1]})", {}), "\"__metadata__\" is not an object (H5)"},
      {"metadata value", st_image(R"({"__metadata__":{"k":1}})", {}), "\"k\" is not a string (H5)"},
  };
  for (const auto& c : cases) {
    const std::string e = error_of(c.image);
    INFO(c.what << ": " << e);
    CHECK(e.find("t.safetensors: ") == 0);
    CHECK(e.find(c.expect) != std::string::npos);
  }
}

TEST_CASE("truncating or corrupting a real checkpoint never crashes: it parses or throws checkpoint_error") {
  const auto file = read_file(fixtures / "qwen3_moe" / "model.safetensors");
  REQUIRE(file.size() > 1000);
  CHECK(parse_safetensors(file, "fixture").size() > 10);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(file[std::size_t(i)]);
  int errors = 0;
  for (std::size_t cut = 0; cut < file.size(); cut += (cut < n + 16 ? 1 : 997)) {
    const std::vector<std::byte> t(file.begin(), file.begin() + std::ptrdiff_t(cut));
    CHECK_THROWS_AS(parse_safetensors(t, "cut"), checkpoint_error);
    ++errors;
  }
  CHECK(errors > int(n));
  std::mt19937_64 rng(5);
  int parsed = 0, rejected = 0;
  for (int i = 0; i < 3000; ++i) {  // flip 1-4 random header bytes
    std::vector<std::byte> t = file;
    const int flips = 1 + int(rng() % 4);
    for (int k = 0; k < flips; ++k) t[8 + rng() % n] = std::byte(rng() & 0xff);
    try {
      parse_safetensors(t, "mutated");
      ++parsed;
    } catch (const checkpoint_error&) {
      ++rejected;
    }
  }
  CHECK(rejected > 0);
  CHECK(parsed + rejected == 3000);
}

TEST_CASE("checkpoint: single file, sharded index, and their error cases") {
  SUBCASE("the fixtures open; the sharded one maps every tensor to its shard") {
    const checkpoint q(fixtures / "qwen3_moe");
    CHECK(q.num_files() == 1);
    CHECK(q.contains("model.embed_tokens.weight"));
    const checkpoint m(fixtures / "mixtral");
    CHECK(m.num_files() > 1);
    CHECK(m.num_tensors() > 20);
    CHECK(m.load_f32("model.norm.weight", {64}).size() == 64);  // stored as F16
  }
  temp_dir tmp;
  auto expect_error = [](const fs::path& dir, const std::string& what) {
    try {
      checkpoint c(dir);
      FAIL("no error for " << dir);
    } catch (const checkpoint_error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  SUBCASE("missing directory / no weights") {
    expect_error(tmp.path / "nope", "checkpoint directory does not exist");
    expect_error(tmp.path, "no model.safetensors or model.safetensors.index.json");
  }
  SUBCASE("bad index.json") {
    const fs::path d = tmp.path / "m";
    fs::copy(fixtures / "mixtral", d, fs::copy_options::recursive);
    const fs::path idx = d / "model.safetensors.index.json";
    const json good = json::parse(std::ifstream(idx));
    write_text(idx, "{\"weight_map\": ");
    expect_error(d, "invalid JSON");
    write_text(idx, "[]");
    expect_error(d, "not a JSON object");
    write_text(idx, R"({"metadata": {}})");
    expect_error(d, "\"weight_map\" missing");
    json j = good;
    j["weight_map"]["model.norm.weight"] = 3;
    write_text(idx, j.dump());
    expect_error(d, "is not a file name string");
    j = good;
    j["weight_map"]["model.norm.weight"] = "../../etc/passwd";
    write_text(idx, j.dump());
    expect_error(d, "not a plain file name");
    j = good;
    j["weight_map"]["model.norm.weight"] = "missing-shard.safetensors";
    write_text(idx, j.dump());
    expect_error(d, "missing-shard.safetensors: cannot open");
    j = good;
    j["weight_map"]["no.such.tensor"] = good["weight_map"]["model.norm.weight"];
    write_text(idx, j.dump());
    expect_error(d, "maps \"no.such.tensor\" to");
  }
  SUBCASE("load_f32: missing tensor, wrong shape, unsupported dtype") {
    const fs::path d = tmp.path / "q";
    copy_fixture_with_header_edit(d, [](json& h) { h["model.norm.weight"]["dtype"] = "I16"; });
    const checkpoint c(d);
    try {
      (void)c.load_f32("model.norm.weight", {64});
      FAIL("no error");
    } catch (const checkpoint_error& e) {
      CHECK(std::string(e.what()).find("model.safetensors: tensor \"model.norm.weight\": dtype I16 is not supported") !=
            std::string::npos);
    }
    CHECK_THROWS_WITH_AS((void)c.load_f32("model.embed_tokens.weight", {256, 32}),
                         doctest::Contains("shape [256, 64], the config implies [256, 32]"), checkpoint_error);
    CHECK_THROWS_WITH_AS((void)c.tensor("lm_head.weightX"), doctest::Contains("missing tensor \"lm_head.weightX\""),
                         checkpoint_error);
  }
}

TEST_CASE("config.json: both spellings, the public configs, and errors") {
  SUBCASE("the public configs parse to the presets' geometry") { check_public_configs(configs); }
  SUBCASE("Hub spelling (rope_theta + rope_scaling) == transformers 5 spelling (rope_parameters)") {
    const model_config hub = load_model_config(configs / "deepseek_v2_lite.json");
    json v5 = json::parse(std::ifstream(configs / "deepseek_v2_lite.json"));
    json rp = v5["rope_scaling"];
    rp.erase("type");
    rp["rope_type"] = "yarn";
    rp["rope_theta"] = 10000.0;
    v5.erase("rope_scaling");
    v5.erase("rope_theta");
    v5["rope_parameters"] = rp;
    const model_config c5 = parse_model_config(v5, "v5");
    CHECK(c5.rope.type == hub.rope.type);
    CHECK(c5.rope.factor == hub.rope.factor);
    CHECK(c5.rope.mscale_all_dim == hub.rope.mscale_all_dim);
    CHECK(c5.softmax_scale() == doctest::Approx(hub.softmax_scale()).epsilon(1e-12));
  }
  SUBCASE("errors name the field") {
    json j = json::parse(std::ifstream(configs / "qwen3_30b_a3b.json"));
    json k = j;
    k.erase("hidden_size");
    CHECK_THROWS_WITH_AS(parse_model_config(k, "c.json"), doctest::Contains("c.json: missing field \"hidden_size\""),
                         checkpoint_error);
    k = j;
    k["num_attention_heads"] = "32";
    CHECK_THROWS_WITH_AS(parse_model_config(k, "c.json"), doctest::Contains("\"num_attention_heads\" must be an integer"),
                         checkpoint_error);
    k = j;
    k["model_type"] = "llama";
    CHECK_THROWS_WITH_AS(parse_model_config(k, "c.json"), doctest::Contains("\"llama\" is not supported"),
                         writescope::config_error);
    k = j;
    k["hidden_act"] = "gelu";
    CHECK_THROWS_AS(parse_model_config(k, "c.json"), writescope::config_error);
    k = j;
    k["num_key_value_heads"] = 5;
    CHECK_THROWS_AS(parse_model_config(k, "c.json"), writescope::config_error);
    temp_dir tmp;
    write_text(tmp.path / "config.json", "{\"model_type\": ");
    CHECK_THROWS_WITH_AS(load_model_config(tmp.path / "config.json"), doctest::Contains("invalid JSON"), checkpoint_error);
    CHECK_THROWS_WITH_AS(load_model_config(tmp.path / "none.json"), doctest::Contains("none.json: no such file"),
                         checkpoint_error);
  }
}

TEST_CASE("ws_decode: a malformed checkpoint gives a one-line error and exit status 1") {
  temp_dir tmp;
  struct cli_case {
    const char* name;
    std::function<void(const fs::path&)> make;
    const char* expect;
  };
  const std::vector<cli_case> cases{
      {"truncated file",
       [](const fs::path& d) {
         fs::copy(fixtures / "qwen3_moe", d, fs::copy_options::recursive);
         fs::resize_file(d / "model.safetensors", fs::file_size(d / "model.safetensors") / 2);
       },
       "truncated file?"},
      {"truncated header",
       [](const fs::path& d) {
         fs::copy(fixtures / "qwen3_moe", d, fs::copy_options::recursive);
         fs::resize_file(d / "model.safetensors", 100);
       },
       "(H2; truncated file?)"},
      {"wrong dtype", [](const fs::path& d) { copy_fixture_with_header_edit(d, [](json& h) { h["model.norm.weight"]["dtype"] = "I16"; }); },
       "dtype I16 is not supported"},
      {"wrong shape",
       [](const fs::path& d) { copy_fixture_with_header_edit(d, [](json& h) { h["model.norm.weight"]["shape"] = {2, 32}; }); },
       "shape [2, 32], the config implies [64]"},
      {"missing tensor",
       [](const fs::path& d) {
         copy_fixture_with_header_edit(d, [](json& h) {
           h["model.norm.weightX"] = h["model.norm.weight"];
           h.erase("model.norm.weight");
         });
       },
       "missing tensor \"model.norm.weight\""},
      {"bad config JSON",
       [](const fs::path& d) {
         fs::copy(fixtures / "qwen3_moe", d, fs::copy_options::recursive);
         write_text(d / "config.json", "{\"model_type\": \"qwen3_moe\",");
       },
       "config.json: invalid JSON"},
      {"missing config field",
       [](const fs::path& d) {
         fs::copy(fixtures / "qwen3_moe", d, fs::copy_options::recursive);
         json c = json::parse(std::ifstream(d / "config.json"));
         c.erase("num_hidden_layers");
         write_text(d / "config.json", c.dump());
       },
       "missing field \"num_hidden_layers\""},
      {"bad index",
       [](const fs::path& d) {
         fs::copy(fixtures / "mixtral", d, fs::copy_options::recursive);
         write_text(d / "model.safetensors.index.json", R"({"weight_map": {"model.norm.weight": 1}})");
       },
       "is not a file name string"},
      {"no weights", [](const fs::path& d) { fs::create_directories(d); fs::copy(fixtures / "qwen3_moe" / "config.json", d); },
       "no model.safetensors"},
  };
  int i = 0;
  for (const auto& c : cases) {
    const fs::path d = tmp.path / std::to_string(i++);  // GCC 12 -Wrestrict false positive on "c" + to_string
    c.make(d);
    const run_result r = run_ws_decode(d.string());
    INFO(c.name << ": status " << r.status << ", output: " << r.output);
    CHECK(r.status == 1);
    CHECK(count_lines(r.output) == 1);
    CHECK(r.output.rfind("ws_decode: error: ", 0) == 0);
    CHECK(r.output.find(c.expect) != std::string::npos);
  }
  const run_result ok = run_ws_decode((fixtures / "qwen3_moe").string() + " --prompt 1,2,3 -q");
  CHECK(ok.status == 0);
}

TEST_CASE("ws_decode --calibration: the entry of the model's attention geometry, or a one-line error and exit status 1") {
  temp_dir tmp;
  constexpr auto npos = std::string::npos;
  // A calibration file as bench/calibrate --out writes it.
  auto entry = [](const char* preset, int batch, double a, double b) {
    return json{{"preset", preset},
                {"batch", batch},
                {"cpu_threads", 15},
                {"cpu_cost_per_token_seconds", a},
                {"gpu_cost_per_token_seconds", b},
                {"cpu_fixed_seconds", 5e-5},
                {"gpu_fixed_seconds", 2e-4}};
  };
  auto file = [&](const json& entries) {
    return json{{"format", "writescope-calibration"}, {"version", 1}, {"device", "NVIDIA H200"},
                {"cpu", "Xeon"}, {"date_utc", "2026-11-29T10:47:59Z"}, {"command", "calibrate"},
                {"entries", entries}};
  };
  const fs::path good = tmp.path / "cal.json";
  write_text(good, file(json::array({entry("Qwen3-30B-A3B", 4, 3.2e-8, 5.0e-8), entry("Qwen3-30B-A3B", 16, 3.1e-8, 4.2e-8),
                                     entry("Mixtral-8x7B", 4, 5.1e-8, 8.5e-8)}))
                       .dump());
  // A tiny model with Qwen3-30B-A3B's attention geometry (32 q / 4 kv heads of 128).
  json cfg = json::parse(std::ifstream(fixtures / "qwen3_moe" / "config.json"));
  cfg["num_attention_heads"] = 32;
  cfg["num_key_value_heads"] = 4;
  cfg["head_dim"] = 128;
  cfg["num_hidden_layers"] = 1;
  const fs::path qcfg = tmp.path / "qwen3_geometry.json";
  write_text(qcfg, cfg.dump());
  auto model_of_batch = [&](int batch) {
    return "--random-weights --config " + qcfg.string() + " --device host --batch " + std::to_string(batch) +
           " --prompt-len 4 --threads 2";
  };
  const std::string model = model_of_batch(3);

  SUBCASE("geometry match at the nearest calibrated batch; the summary and --json say where A and B came from") {
    const fs::path out = tmp.path / "run.json";
    const run_result r = run_ws_decode(model + " --calibration " + good.string() + " --json " + out.string());
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("costs      roofline at init from calibration " + good.string() +
                        ": entry Qwen3-30B-A3B batch 4 (nearest to batch 3), matched by attention geometry, 15 CPU "
                        "engine threads (this run: 1), measured on NVIDIA H200") != npos);
    const json j = json::parse(std::ifstream(out));
    const json& ri = j.at("roofline_init");
    CHECK(ri.at("source") == "calibration");
    CHECK(ri.at("file") == good.string());
    CHECK(ri.at("preset") == "Qwen3-30B-A3B");
    CHECK(ri.at("matched_by") == "attention geometry");
    CHECK(ri.at("entry_batch") == 4);
    CHECK(ri.at("run_batch") == 3);
    CHECK(ri.at("kv_bytes_scale").get<double>() == 1.0);
    CHECK(ri.at("cpu_cost_per_token_seconds").get<double>() == doctest::Approx(3.2e-8));
    CHECK(ri.at("gpu_cost_per_token_seconds").get<double>() == doctest::Approx(5.0e-8));
    CHECK(ri.at("cpu_fixed_seconds").get<double>() == doctest::Approx(5e-5));
    CHECK(ri.at("gpu_fixed_seconds").get<double>() == doctest::Approx(2e-4));
    CHECK(ri.at("converged_share").get<double>() == doctest::Approx(5.0 / 8.2));
    CHECK(j.at("policy").get<std::string>().find("A=3.2e-08 s/token, B=5e-08 s/token") != npos);
    // batch 12 is nearer to 16 than to 4 in log scale
    const run_result r16 = run_ws_decode(model_of_batch(12) + " --calibration " + good.string() + " -q --json " + out.string());
    REQUIRE(r16.status == 0);
    CHECK(json::parse(std::ifstream(out)).at("roofline_init").at("entry_batch") == 16);
  }
  SUBCASE("the entry's KV plan and K: a plan that differs from the run's is named; K enters the share") {
    json e = entry("Qwen3-30B-A3B", 4, 3.2e-8, 5.0e-8);
    e["block_tokens"] = 32;
    e["gpu_split_blocks"] = 4;
    e["launch_cost_per_token_seconds"] = 1e-8;
    const fs::path planned = tmp.path / "planned.json", out = tmp.path / "run.json";
    write_text(planned, file(json::array({e})).dump());
    const run_result r = run_ws_decode(model + " --calibration " + planned.string() + " --json " + out.string());
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("15 CPU engine threads (this run: 1), block 32 tokens (this run: 64), 4-block GPU splits, "
                        "measured on NVIDIA H200") != npos);
    CHECK(r.output.find("K 10 ns/token") != npos);
    const json ri = json::parse(std::ifstream(out)).at("roofline_init");
    CHECK(ri.at("entry_block_tokens") == 32);
    CHECK(ri.at("run_block_tokens") == 64);
    CHECK(ri.at("entry_split_blocks") == 4);
    CHECK(ri.at("run_split_blocks") == 4);
    CHECK(ri.at("launch_cost_per_token_seconds").get<double>() == doctest::Approx(1e-8));
    CHECK(ri.at("converged_share").get<double>() == doctest::Approx(4.0 / 7.2));  // (B-K)/(A+B-K)
    const run_result same = run_ws_decode(model + " --block-tokens 32 --calibration " + planned.string());
    INFO(same.output);
    REQUIRE(same.status == 0);
    CHECK(same.output.find("block 32 tokens, 4-block GPU splits, measured on") != npos);
  }
  SUBCASE("without a file: the bandwidth priors, named as defaults") {
    const fs::path out = tmp.path / "run.json";
    const run_result r = run_ws_decode(model + " --cpu-bw-gbps 100 --json " + out.string());
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("costs      roofline at init from defaults (--cpu-bw-gbps 100, --h2d-bw-gbps 54)") != npos);
    const json ri = json::parse(std::ifstream(out)).at("roofline_init");
    CHECK(ri.at("source") == "defaults");
    CHECK(ri.at("cpu_cost_per_token_seconds").get<double>() == doctest::Approx(2048.0 / 100e9));
    CHECK(ri.at("gpu_cost_per_token_seconds").get<double>() == doctest::Approx(2048.0 / 54e9));
  }
  SUBCASE("--calibration-preset on another geometry: A and B scaled by KV bytes per token") {
    const fs::path out = tmp.path / "run.json";
    const run_result r = run_ws_decode((fixtures / "qwen3_moe").string() + " --prompt 1,2,3 --calibration " +
                                       good.string() + " --calibration-preset qwen3 -q --json " + out.string());
    INFO(r.output);
    REQUIRE(r.status == 0);
    const json ri = json::parse(std::ifstream(out)).at("roofline_init");
    CHECK(ri.at("matched_by") == "--calibration-preset");
    CHECK(ri.at("kv_bytes_scale").get<double>() == doctest::Approx(256.0 / 2048.0));  // 1 kv head of 64 vs 4 of 128
    CHECK(ri.at("cpu_cost_per_token_seconds").get<double>() == doctest::Approx(3.2e-8 / 8));
    CHECK(ri.at("gpu_cost_per_token_seconds").get<double>() == doctest::Approx(5.0e-8 / 8));
  }
  SUBCASE("errors: one line on stderr, exit status 1") {
    const fs::path bad_json = tmp.path / "bad.json", not_cal = tmp.path / "other.json", bad_entry = tmp.path / "entry.json",
                   mixtral_only = tmp.path / "mixtral.json";
    write_text(bad_json, "{\"format\": \"writescope-calibration\",");
    write_text(not_cal, R"({"format": "something-else", "version": 1, "entries": []})");
    write_text(bad_entry, file(json::array({entry("Qwen3-30B-A3B", 4, -1.0, 5.0e-8)})).dump());
    write_text(mixtral_only, file(json::array({entry("Mixtral-8x7B", 4, 5.1e-8, 8.5e-8)})).dump());
    struct cal_case {
      std::string args;
      const char* expect;
    };
    const std::string fixture = (fixtures / "qwen3_moe").string() + " --prompt 1,2,3";
    const std::vector<cal_case> cases{
        {model + " --calibration " + (tmp.path / "none.json").string(), "none.json': cannot open it"},
        {model + " --calibration " + bad_json.string(), "bad.json': not valid JSON"},
        {model + " --calibration " + not_cal.string(), "(not a writescope calibration file)"},
        {model + " --calibration " + bad_entry.string(), "entry 0 (Qwen3-30B-A3B): per-token costs must be positive"},
        {model + " --calibration " + mixtral_only.string(),
         "no entry for preset 'Qwen3-30B-A3B' (calibrated: Mixtral-8x7B batch 4)"},
        {fixture + " --calibration " + good.string(),
         "the model's attention (GQA 4 q / 1 kv heads, head_dim 64) matches none of the calibrated presets"},
        {fixture + " --calibration " + good.string() + " --calibration-preset llama", "--calibration-preset llama is not one of"},
    };
    for (const auto& c : cases) {
      const run_result r = run_ws_decode(c.args);
      INFO(c.args << ": status " << r.status << ", output: " << r.output);
      CHECK(r.status == 1);
      CHECK(count_lines(r.output) == 1);
      CHECK(r.output.rfind("ws_decode: error: ", 0) == 0);
      CHECK(r.output.find(c.expect) != npos);
    }
  }
  SUBCASE("--calibration excludes the bandwidth priors; --calibration-preset needs --calibration (CLI errors)") {
    const run_result r = run_ws_decode(model + " --calibration " + good.string() + " --h2d-bw-gbps 20");
    CHECK(r.status != 0);
    CHECK(r.output.find("--calibration excludes --h2d-bw-gbps") != npos);
    const run_result p = run_ws_decode(model + " --calibration-preset qwen3");
    CHECK(p.status != 0);
    CHECK(p.output.find("--calibration-preset requires --calibration") != npos);
  }
}

/// The --json summaries of one ws_decode run with and one without the warm-up (both must succeed).
static std::pair<json, json> with_and_without_warmup(const std::string& args) {
  temp_dir tmp;
  const fs::path with = tmp.path / "with.json", without = tmp.path / "without.json";
  const run_result a = run_ws_decode_args(args + " --json " + with.string());
  const run_result b = run_ws_decode_args(args + " --no-warmup --json " + without.string());
  INFO(a.output << b.output);
  REQUIRE(a.status == 0);
  REQUIRE(b.status == 0);
  return {json::parse(std::ifstream(with)), json::parse(std::ifstream(without))};
}

TEST_CASE("ws_decode --device emulated: the warm-up step before prefill changes no token and no eviction") {
  // Sampled decoding over a mixed CPU/GPU cache (fixed:0.5: placement is
  // deterministic) with experts on both sides: any state the warm-up left
  // behind (a slot row, a placed block, the policy, the sampler) would show in
  // the tokens, the evictions or the share trajectory.
  const auto [ja, jb] = with_and_without_warmup(
      (fixtures / "deepseek_v2_qlora").string() +
      " --device emulated --precision fp32 --batch 3 --prompt-len 5:20 --max-new-tokens 16 "
      "--temperature 0.8 --top-p 0.9 --seed 7 --policy fixed:0.5 --max-gpu-experts 3 "
      "--block-tokens 4 --d-window 8 --ping-pong-blocks 4 --gpu-split-blocks 2 --cpu-task-blocks 2 "
      "--threads 2 --poison --no-progress -q");
  CHECK(ja.at("warmup").at("sequences") == 3);
  CHECK(jb.at("warmup").at("sequences") == 0);
  CHECK(ja.at("tokens") == jb.at("tokens"));
  CHECK(ja.at("decode_evictions") == jb.at("decode_evictions"));
  CHECK(ja.at("sequences") == jb.at("sequences"));
  CHECK(ja.at("share_trajectory") == jb.at("share_trajectory"));
  CHECK(ja.at("tpot_steady_steps") == 14);
}

TEST_CASE("ws_decode --device emulated: the prefill warm-up (bf16, batched experts, streamed host experts) changes no "
          "token") {
  // bf16 GEMMs with the batched prefill experts and host experts streamed to
  // the device in the prefill: the warm-up's layer of the first wave's shape
  // runs the device experts and, on a device expert's weights, the products
  // the streamed ones will run; it writes scratch only. The wave routes more
  // rows than the fp32 expert inputs hold (sized for a CPU-expert wave): the
  // warm-up must not gather them as if its host experts ran on the CPU.
  const auto [ja, jb] = with_and_without_warmup(
      (fixtures / "qwen3_moe").string() +
      " --device emulated --precision bf16 --batch 3 --prompt-len 120:180 --max-new-tokens 6 "
      "--seed 11 --policy fixed:0.5 --max-gpu-experts 3 --stream-min-rows 0 "
      "--expert-staging-mib 0.01 --block-tokens 4 --d-window 8 --threads 2 --poison --no-progress -q");
  CHECK(ja.at("warmup").at("sequences") == 3);
  CHECK(ja.at("tokens") == jb.at("tokens"));
  CHECK(ja.at("sequences") == jb.at("sequences"));
  CHECK(ja.at("expert_streaming").at("copies").get<long long>() > 0);
}
