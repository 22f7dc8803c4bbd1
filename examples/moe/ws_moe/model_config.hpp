// SPDX-License-Identifier: Apache-2.0
// ws_moe/model_config.hpp — the parts of a Hugging Face config.json that the
// three decoders need (Qwen3-MoE, Mixtral, DeepSeek-V2), read from either
// spelling in circulation: the Hub files (rope_theta + rope_scaling,
// num_experts) and transformers >= 5 (rope_parameters, num_local_experts).
//
// Errors: a missing file, invalid JSON, a missing required field or a field of
// the wrong JSON type is a checkpoint_error naming the file and the field; a
// well-formed value the decoders do not implement (hidden_act "gelu", a head
// dim without kernels, sliding-window attention) is a config_error naming the
// value and what is supported.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <writescope/error.hpp>

#include "checkpoint.hpp"

namespace ws_moe {

using writescope::config_error;

enum class arch { qwen3_moe, mixtral, deepseek_v2 };

[[nodiscard]] inline const char* to_string(arch a) noexcept {
  switch (a) {
    case arch::qwen3_moe: return "qwen3_moe";
    case arch::mixtral: return "mixtral";
    case arch::deepseek_v2: return "deepseek_v2";
  }
  return "?";
}

/// "qwen3_moe" | "mixtral" | "deepseek_v2" -> arch; config_error otherwise.
[[nodiscard]] inline arch parse_arch(const std::string& s) {
  if (s == "qwen3_moe") return arch::qwen3_moe;
  if (s == "mixtral") return arch::mixtral;
  if (s == "deepseek_v2") return arch::deepseek_v2;
  throw config_error("model_type \"" + s + "\" is not supported; supported: qwen3_moe, deepseek_v2, mixtral");
}

/// Rotary position embedding parameters (HF modeling_rope_utils semantics).
struct rope_config {
  std::string type = "default";  ///< "default", "linear" or "yarn"
  double theta = 10000.0;
  double factor = 1.0;
  double original_max_position_embeddings = 0.0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 0.0, mscale_all_dim = 0.0;  ///< 0 = absent
  std::optional<double> attention_factor;
  bool truncate = true;
};

struct model_config {
  arch kind = arch::qwen3_moe;
  std::string model_type;
  int vocab_size = 0;
  int hidden_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;              ///< GQA head dim (DeepSeek: unused)
  int intermediate_size = 0;     ///< dense MLP
  int moe_intermediate_size = 0; ///< routed experts (Mixtral: intermediate_size)
  int num_experts = 0;
  int experts_per_tok = 0;
  bool norm_topk_prob = false;
  double rms_norm_eps = 1e-6;
  rope_config rope;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  double initializer_range = 0.02;
  std::vector<int> eos_token_ids;
  int max_position_embeddings = 0;  ///< longest sequence the model was made for (0 = not in config.json)
  // Qwen3-MoE
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  // Mixtral / Qwen3 sliding window (unsupported beyond its length)
  std::optional<int> sliding_window;
  // DeepSeek-V2
  int kv_lora_rank = 0;
  int q_lora_rank = 0;  ///< 0 = none (V2-Lite: q_proj)
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  int n_shared_experts = 0;
  int first_k_dense_replace = 0;
  std::string topk_method = "greedy";
  int n_group = 1;
  int topk_group = 1;
  double routed_scaling_factor = 1.0;

  /// Whether layer `l` has a routed-expert FFN (else a dense MLP), per HF.
  [[nodiscard]] bool is_moe_layer(int l) const {
    switch (kind) {
      case arch::qwen3_moe:
        for (int x : mlp_only_layers)
          if (x == l) return false;
        return num_experts > 0 && (l + 1) % decoder_sparse_step == 0;
      case arch::mixtral: return true;
      case arch::deepseek_v2: return l >= first_k_dense_replace;
    }
    return true;
  }

  /// Softmax scale applied to q·k (DeepSeek: incl. YaRN mscale², as HF's yarn_apply_mscale).
  [[nodiscard]] double softmax_scale() const {
    if (kind != arch::deepseek_v2) return 1.0 / std::sqrt(double(head_dim));
    double s = 1.0 / std::sqrt(double(qk_nope_head_dim + qk_rope_head_dim));
    if (rope.type != "default" && rope.mscale_all_dim != 0.0) {
      const double m = rope.factor <= 1.0 ? 1.0 : 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
      s *= m * m;
    }
    return s;
  }

  /// Width of the rotated part of a head (GQA: head_dim; MLA: qk_rope_head_dim).
  [[nodiscard]] int rope_dim() const { return kind == arch::deepseek_v2 ? qk_rope_head_dim : head_dim; }

  /// Parameters of the model in elements (for the host memory estimate).
  /// Summed in double: sizes up to 2^30 each overflowed std::int64_t (UB,
  /// found by fuzz_json_loaders); saturates at INT64_MAX.
  [[nodiscard]] std::int64_t parameter_count() const {
    const double h = hidden_size;
    double n = double(vocab_size) * h * (tie_word_embeddings ? 1 : 2) + h;
    for (int l = 0; l < num_layers; ++l) {
      n += 2 * h;
      if (kind == arch::deepseek_v2) {
        const double qk = double(qk_nope_head_dim) + qk_rope_head_dim;
        n += q_lora_rank ? h * q_lora_rank + q_lora_rank + double(q_lora_rank) * num_heads * qk : h * num_heads * qk;
        n += h * (double(kv_lora_rank) + qk_rope_head_dim) + kv_lora_rank +
             double(kv_lora_rank) * num_heads * (double(qk_nope_head_dim) + v_head_dim) + double(num_heads) * v_head_dim * h;
      } else {
        n += h * head_dim * (2.0 * num_heads + 2.0 * num_kv_heads);
      }
      if (is_moe_layer(l)) {
        n += double(num_experts) * (h + 3 * h * moe_intermediate_size);
        n += 3 * h * double(moe_intermediate_size) * n_shared_experts;
      } else {
        n += 3 * h * double(intermediate_size);
      }
    }
    return n >= 9.2e18 ? INT64_MAX : std::int64_t(n);
  }
};

namespace detail {

struct config_reader {
  const nlohmann::json& j;
  std::string label;

  [[noreturn]] void bad(const std::string& key, const char* want) const {
    throw checkpoint_error(label + ": field \"" + key + "\" must be " + want);
  }
  [[nodiscard]] bool has(const std::string& key) const {
    const auto it = j.find(key);
    return it != j.end() && !it->is_null();
  }
  [[nodiscard]] const nlohmann::json& at(const std::string& key) const {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
      // Not j.value(): a non-string model_type (with --arch) made it throw nlohmann's type_error (fuzz_json_loaders).
      const auto mt = j.find("model_type");
      throw checkpoint_error(label + ": missing field \"" + key + "\" (required for " +
                             (mt != j.end() && mt->is_string() ? mt->get<std::string>() : std::string("this model")) +
                             ")");
    }
    return *it;
  }
  [[nodiscard]] int integer(const std::string& key) const {
    const auto& v = at(key);
    if (!v.is_number_integer()) bad(key, "an integer");
    const auto x = v.get<std::int64_t>();
    if (x < 0 || x > (std::int64_t{1} << 30)) bad(key, "an integer in [0, 2^30]");
    return int(x);
  }
  [[nodiscard]] int integer(const std::string& key, int fallback) const { return has(key) ? integer(key) : fallback; }
  [[nodiscard]] double number(const std::string& key) const {
    const auto& v = at(key);
    if (!v.is_number()) bad(key, "a number");
    const double x = v.get<double>();
    if (!std::isfinite(x)) bad(key, "finite");
    return x;
  }
  [[nodiscard]] double number(const std::string& key, double fallback) const { return has(key) ? number(key) : fallback; }
  [[nodiscard]] bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const auto& v = at(key);
    if (!v.is_boolean()) bad(key, "true or false");
    return v.get<bool>();
  }
  [[nodiscard]] std::string string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const auto& v = at(key);
    if (!v.is_string()) bad(key, "a string");
    return v.get<std::string>();
  }
  [[nodiscard]] std::vector<int> int_list(const std::string& key) const {
    std::vector<int> out;
    if (!has(key)) return out;
    const auto& v = at(key);
    if (v.is_number_integer()) {
      out.push_back(integer(key));
      return out;
    }
    if (!v.is_array()) bad(key, "an integer or a list of integers");
    for (const auto& x : v) {
      if (!x.is_number_integer()) bad(key, "an integer or a list of integers");
      out.push_back(int(x.get<std::int64_t>()));
    }
    return out;
  }
};

inline rope_config parse_rope(const config_reader& r) {
  rope_config rc;
  // transformers >= 5: "rope_parameters": {"rope_type", "rope_theta", ...}; Hub: rope_theta + rope_scaling.
  const nlohmann::json* scaling = nullptr;
  if (r.has("rope_parameters")) {
    scaling = &r.at("rope_parameters");
    if (!scaling->is_object()) r.bad("rope_parameters", "an object");
  } else if (r.has("rope_scaling")) {
    scaling = &r.at("rope_scaling");
    if (!scaling->is_object()) r.bad("rope_scaling", "an object or null");
  }
  rc.theta = r.number("rope_theta", 10000.0);
  if (!scaling) return rc;
  const config_reader s{*scaling, r.label + ": " + (r.has("rope_parameters") ? "rope_parameters" : "rope_scaling")};
  rc.theta = s.number("rope_theta", rc.theta);
  rc.type = s.string("rope_type", s.string("type", "default"));
  if (rc.type == "default") return rc;
  if (rc.type != "linear" && rc.type != "yarn")
    throw config_error("rope type \"" + rc.type + "\" is not supported; supported: default, linear, yarn");
  rc.factor = s.number("factor");
  if (!(rc.factor > 0.0)) throw config_error("rope scaling factor " + std::to_string(rc.factor) + " must be > 0");
  if (rc.type == "yarn") {
    rc.original_max_position_embeddings = s.number("original_max_position_embeddings");
    rc.beta_fast = s.number("beta_fast", 32.0);
    rc.beta_slow = s.number("beta_slow", 1.0);
    if (rc.beta_fast == 0.0) rc.beta_fast = 32.0;  // HF: `or 32`
    if (rc.beta_slow == 0.0) rc.beta_slow = 1.0;
    rc.mscale = s.number("mscale", 0.0);
    rc.mscale_all_dim = s.number("mscale_all_dim", 0.0);
    if (s.has("attention_factor")) rc.attention_factor = s.number("attention_factor");
    rc.truncate = s.boolean("truncate", true);
  }
  return rc;
}

}  // namespace detail

/// Parses config.json content. `forced` overrides "model_type" (--arch).
inline model_config parse_model_config(const nlohmann::json& j, const std::string& label,
                                       std::optional<arch> forced = std::nullopt) {
  if (!j.is_object()) throw checkpoint_error(label + ": not a JSON object");
  const detail::config_reader r{j, label};
  model_config c;
  if (forced) {
    c.kind = *forced;
    c.model_type = to_string(*forced);
  } else {
    if (!r.has("model_type"))
      throw checkpoint_error(label + ": missing field \"model_type\" (pass --arch qwen3_moe|deepseek_v2|mixtral)");
    c.model_type = r.string("model_type", "");
    c.kind = parse_arch(c.model_type);
  }
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("hidden_size");
  c.num_layers = r.integer("num_hidden_layers");
  c.num_heads = r.integer("num_attention_heads");
  c.num_kv_heads = r.integer("num_key_value_heads", c.num_heads);
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  c.initializer_range = r.number("initializer_range", 0.02);
  c.eos_token_ids = r.int_list("eos_token_id");
  c.max_position_embeddings = r.integer("max_position_embeddings", 0);
  c.rope = detail::parse_rope(r);
  const std::string act = r.string("hidden_act", "silu");
  if (act != "silu") throw config_error("hidden_act \"" + act + "\" is not supported; supported: silu");
  if (c.vocab_size < 1 || c.hidden_size < 1 || c.num_layers < 1 || c.num_heads < 1 || c.num_kv_heads < 1)
    throw config_error(label + ": vocab_size, hidden_size, num_hidden_layers and head counts must be >= 1");

  switch (c.kind) {
    case arch::qwen3_moe:
      c.head_dim = r.integer("head_dim", c.hidden_size / c.num_heads);
      c.intermediate_size = r.integer("intermediate_size");
      c.moe_intermediate_size = r.integer("moe_intermediate_size");
      c.num_experts = r.has("num_experts") ? r.integer("num_experts") : r.integer("num_local_experts");
      c.experts_per_tok = r.integer("num_experts_per_tok");
      c.norm_topk_prob = r.boolean("norm_topk_prob", false);
      c.decoder_sparse_step = r.integer("decoder_sparse_step", 1);
      c.mlp_only_layers = r.int_list("mlp_only_layers");
      c.attention_bias = r.boolean("attention_bias", false);
      if (r.boolean("use_sliding_window", false) && r.has("sliding_window")) c.sliding_window = r.integer("sliding_window");
      if (c.decoder_sparse_step < 1) throw config_error("decoder_sparse_step must be >= 1");
      break;
    case arch::mixtral:
      c.head_dim = r.integer("head_dim", c.hidden_size / c.num_heads);
      c.intermediate_size = r.integer("intermediate_size");
      c.moe_intermediate_size = c.intermediate_size;
      c.num_experts = r.integer("num_local_experts");
      c.experts_per_tok = r.integer("num_experts_per_tok");
      c.norm_topk_prob = true;
      if (r.has("sliding_window")) c.sliding_window = r.integer("sliding_window");
      break;
    case arch::deepseek_v2:
      c.intermediate_size = r.integer("intermediate_size");
      c.moe_intermediate_size = r.integer("moe_intermediate_size");
      c.num_experts = r.integer("n_routed_experts");
      c.experts_per_tok = r.integer("num_experts_per_tok");
      c.norm_topk_prob = r.boolean("norm_topk_prob", false);
      c.kv_lora_rank = r.integer("kv_lora_rank");
      c.q_lora_rank = r.integer("q_lora_rank", 0);
      c.qk_nope_head_dim = r.integer("qk_nope_head_dim");
      c.qk_rope_head_dim = r.integer("qk_rope_head_dim");
      c.v_head_dim = r.integer("v_head_dim");
      c.n_shared_experts = r.integer("n_shared_experts", 0);
      c.first_k_dense_replace = r.integer("first_k_dense_replace", 0);
      c.topk_method = r.string("topk_method", "greedy");
      c.n_group = r.integer("n_group", 1);
      c.topk_group = r.integer("topk_group", 1);
      c.routed_scaling_factor = r.number("routed_scaling_factor", 1.0);
      c.attention_bias = r.boolean("attention_bias", false);
      c.head_dim = c.qk_rope_head_dim;
      if (r.boolean("mlp_bias", false)) throw config_error("mlp_bias = true is not supported");
      if (c.topk_method != "greedy" && c.topk_method != "group_limited_greedy")
        throw config_error("topk_method \"" + c.topk_method + "\" is not supported; supported: greedy, group_limited_greedy");
      if (c.topk_method == "group_limited_greedy" &&
          (c.n_group < 1 || c.num_experts % c.n_group != 0 || c.topk_group < 1 || c.topk_group > c.n_group ||
           c.experts_per_tok > c.topk_group * (c.num_experts / c.n_group)))
        throw config_error("group_limited_greedy: n_group " + std::to_string(c.n_group) + " must divide n_routed_experts " +
                           std::to_string(c.num_experts) + ", 1 <= topk_group <= n_group, and the kept groups must hold " +
                           "num_experts_per_tok experts");
      if (c.qk_rope_head_dim % 2 != 0) throw config_error("qk_rope_head_dim must be even");
      break;
  }
  if (c.kind != arch::deepseek_v2) {
    if (c.num_heads % c.num_kv_heads != 0)
      throw config_error("num_attention_heads " + std::to_string(c.num_heads) + " is not a multiple of num_key_value_heads " +
                         std::to_string(c.num_kv_heads));
    if (c.head_dim % 2 != 0) throw config_error("head_dim must be even");
  }
  bool any_moe = false;
  for (int l = 0; l < c.num_layers; ++l) any_moe = any_moe || c.is_moe_layer(l);
  if (any_moe && (c.num_experts < 1 || c.experts_per_tok < 1 || c.experts_per_tok > c.num_experts))
    throw config_error("num_experts_per_tok " + std::to_string(c.experts_per_tok) + " must be in [1, num_experts=" +
                       std::to_string(c.num_experts) + "]");
  return c;
}

/// Reads and parses `path` (config.json).
inline model_config load_model_config(const std::filesystem::path& path, std::optional<arch> forced = std::nullopt) {
  return parse_model_config(read_json_file(path), path.string(), forced);
}

}  // namespace ws_moe
