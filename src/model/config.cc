#include "model/config.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace moe::model {
namespace {

using nlohmann::json;

// Field readers: absent -> nullopt; present with the wrong type -> error.
Expected<std::optional<int64_t>> opt_int(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<int64_t>();
  if (!it->is_number_integer()) return invalid_argument("config.json: field '{}' must be an integer, got {}", key, it->dump());
  return std::optional<int64_t>(it->get<int64_t>());
}

Expected<std::optional<double>> opt_number(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<double>();
  if (!it->is_number()) return invalid_argument("config.json: field '{}' must be a number, got {}", key, it->dump());
  return std::optional<double>(it->get<double>());
}

Expected<std::optional<bool>> opt_bool(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<bool>();
  if (!it->is_boolean()) return invalid_argument("config.json: field '{}' must be true or false, got {}", key, it->dump());
  return std::optional<bool>(it->get<bool>());
}

Expected<int64_t> required_int(const json& j, const char* key, int64_t min_value = 1) {
  MOE_ASSIGN_OR_RETURN(auto value, opt_int(j, key));
  if (!value) return invalid_argument("config.json: required field '{}' is missing", key);
  if (*value < min_value) return invalid_argument("config.json: field '{}' = {} must be >= {}", key, *value, min_value);
  return *value;
}

// The same fact under two names (4.x and 5.x): either may be present; both must agree.
Expected<std::optional<int64_t>> int_either(const json& j, const char* a, const char* b) {
  MOE_ASSIGN_OR_RETURN(auto va, opt_int(j, a));
  MOE_ASSIGN_OR_RETURN(auto vb, opt_int(j, b));
  if (va && vb && *va != *vb)
    return invalid_argument("config.json: contradictory fields '{}' = {} and '{}' = {}", a, *va, b, *vb);
  return va ? va : vb;
}

Expected<std::vector<int>> int_list(const json& j, const char* key) {
  std::vector<int> out;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  if (it->is_number_integer()) return std::vector<int>{it->get<int>()};
  if (!it->is_array()) return invalid_argument("config.json: field '{}' must be a list of integers", key);
  for (const auto& v : *it) {
    if (!v.is_number_integer()) return invalid_argument("config.json: field '{}' must be a list of integers", key);
    out.push_back(v.get<int>());
  }
  return out;
}

Status parse_rope(const json& j, ModelConfig& config) {
  // 4.x: top-level rope_theta + rope_scaling (may be null). 5.x: rope_parameters.
  const json* params = nullptr;
  if (auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalid_argument("config.json: field 'rope_parameters' must be an object");
    params = &*it;
  }
  const json* scaling = nullptr;
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalid_argument("config.json: field 'rope_scaling' must be an object or null");
    scaling = &*it;
  }
  MOE_ASSIGN_OR_RETURN(auto top_theta, opt_number(j, "rope_theta"));
  std::optional<double> param_theta;
  if (params) {
    MOE_ASSIGN_OR_RETURN(param_theta, opt_number(*params, "rope_theta"));
  }
  if (top_theta && param_theta && *top_theta != *param_theta)
    return invalid_argument("config.json: contradictory 'rope_theta' = {} and 'rope_parameters.rope_theta' = {}",
                            *top_theta, *param_theta);
  config.rope.theta = param_theta ? *param_theta : top_theta ? *top_theta : 10000.0;
  config.rope.head_dim = config.head_dim;

  const json* spec = params ? params : scaling;
  if (params && scaling && (*params).value("rope_type", std::string("default")) != "default") {
    const std::string a = params->value("rope_type", ""), b = scaling->value("rope_type", scaling->value("type", ""));
    if (!b.empty() && a != b)
      return invalid_argument("config.json: contradictory 'rope_parameters.rope_type' = '{}' and 'rope_scaling' type '{}'", a, b);
  }
  if (spec == nullptr) return Status::ok();
  std::string type = spec->value("rope_type", spec->value("type", std::string("default")));
  if (type == "default") return Status::ok();
  if (type != "yarn")
    return unimplemented("config.json: rope type '{}' is not supported (default and yarn are)", type);
  config.rope.type = "yarn";
  MOE_ASSIGN_OR_RETURN(auto factor, opt_number(*spec, "factor"));
  MOE_ASSIGN_OR_RETURN(auto original, opt_int(*spec, "original_max_position_embeddings"));
  if (!original) original = config.max_position_embeddings;
  if (!factor) {
    if (*original <= 0) return invalid_argument("config.json: yarn rope needs 'factor'");
    factor = static_cast<double>(config.max_position_embeddings) / static_cast<double>(*original);
  }
  if (*factor <= 0) return invalid_argument("config.json: yarn 'factor' must be positive");
  if (*original <= 0) return invalid_argument("config.json: yarn needs 'original_max_position_embeddings' or 'max_position_embeddings'");
  config.rope.factor = *factor;
  config.rope.original_max_position_embeddings = static_cast<int>(*original);
  MOE_ASSIGN_OR_RETURN(auto beta_fast, opt_number(*spec, "beta_fast"));
  MOE_ASSIGN_OR_RETURN(auto beta_slow, opt_number(*spec, "beta_slow"));
  MOE_ASSIGN_OR_RETURN(auto attention_factor, opt_number(*spec, "attention_factor"));
  MOE_ASSIGN_OR_RETURN(auto mscale, opt_number(*spec, "mscale"));
  MOE_ASSIGN_OR_RETURN(auto mscale_all_dim, opt_number(*spec, "mscale_all_dim"));
  MOE_ASSIGN_OR_RETURN(auto truncate, opt_bool(*spec, "truncate"));
  if (beta_fast && *beta_fast != 0) config.rope.beta_fast = *beta_fast;
  if (beta_slow && *beta_slow != 0) config.rope.beta_slow = *beta_slow;
  if (attention_factor) config.rope.attention_factor = *attention_factor;
  if (mscale) config.rope.mscale = *mscale;
  if (mscale_all_dim) config.rope.mscale_all_dim = *mscale_all_dim;
  if (truncate) config.rope.truncate = *truncate;
  return Status::ok();
}

Status parse_quantization(const json& j, ModelConfig& config) {
  auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return Status::ok();
  if (!it->is_object()) return invalid_argument("config.json: field 'quantization_config' must be an object");
  config.quantization.method = it->value("quant_method", std::string());
  config.quantization.activation_scheme = it->value("activation_scheme", std::string());
  MOE_ASSIGN_OR_RETURN(config.quantization.weight_block_size, int_list(*it, "weight_block_size"));
  QuantizationConfig& q = config.quantization;
  const std::vector<int>& block = q.weight_block_size;
  if (q.method == "fp8") {
    if (block != std::vector<int>{128, 128})
      return unimplemented("config.json: quant_method 'fp8' is supported with weight_block_size [128, 128] only, got [{}]",
                           fmt::join(block.begin(), block.end(), ", "));
    q.format = ops::QuantFormat::kFp8Block;
  } else if (q.method == "mxfp8" || q.method == "nvfp4" || q.method == "mxfp4") {
    q.format = *ops::quant_format_from_name(q.method);
    const std::vector<int> expected = {1, ops::quant_format_spec(q.format).block_cols};
    if (!block.empty() && block != expected)
      return invalid_argument("config.json: quant_method '{}' has weight_block_size [{}]; it must be [{}]", q.method,
                              fmt::join(block.begin(), block.end(), ", "), fmt::join(expected.begin(), expected.end(), ", "));
  } else {
    return unimplemented("config.json: quant_method '{}' is not supported (fp8 with 128x128 blocks, mxfp8, nvfp4, mxfp4)",
                         q.method);
  }
  if (!q.activation_scheme.empty() && q.activation_scheme != "dynamic" && q.activation_scheme != "none")
    return unimplemented("config.json: activation_scheme '{}' is not supported (dynamic)", q.activation_scheme);
  return Status::ok();
}

}  // namespace

bool ModelConfig::layer_is_moe(int layer) const {
  if (num_experts == 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

Expected<ModelConfig> parse_model_config(const json& j) {
  if (!j.is_object()) return invalid_argument("config.json: expected a JSON object");
  ModelConfig c;
  auto type_it = j.find("model_type");
  if (type_it == j.end() || !type_it->is_string()) return invalid_argument("config.json: required field 'model_type' is missing");
  c.model_type = type_it->get<std::string>();
  if (c.model_type != "qwen3_moe" && c.model_type != "qwen3")
    return unimplemented("config.json: model_type '{}' is not supported (qwen3_moe and qwen3 are)", c.model_type);
  const bool is_moe = c.model_type == "qwen3_moe";

  MOE_ASSIGN_OR_RETURN(c.vocab_size, required_int(j, "vocab_size"));
  MOE_ASSIGN_OR_RETURN(c.hidden_size, required_int(j, "hidden_size"));
  MOE_ASSIGN_OR_RETURN(auto layers, required_int(j, "num_hidden_layers"));
  MOE_ASSIGN_OR_RETURN(auto q_heads, required_int(j, "num_attention_heads"));
  c.num_layers = static_cast<int>(layers);
  c.num_q_heads = static_cast<int>(q_heads);
  MOE_ASSIGN_OR_RETURN(auto kv_heads, opt_int(j, "num_key_value_heads"));
  c.num_kv_heads = kv_heads ? static_cast<int>(*kv_heads) : c.num_q_heads;
  if (c.num_kv_heads < 1 || c.num_q_heads % c.num_kv_heads != 0)
    return invalid_argument("config.json: 'num_attention_heads' = {} is not a multiple of 'num_key_value_heads' = {}",
                            c.num_q_heads, c.num_kv_heads);
  MOE_ASSIGN_OR_RETURN(auto head_dim, opt_int(j, "head_dim"));
  if (head_dim) {
    if (*head_dim < 2 || *head_dim % 2 != 0) return invalid_argument("config.json: 'head_dim' = {} must be even and >= 2", *head_dim);
    c.head_dim = static_cast<int>(*head_dim);
  } else {
    if (c.hidden_size % c.num_q_heads != 0)
      return invalid_argument("config.json: 'head_dim' is missing and 'hidden_size' = {} is not divisible by 'num_attention_heads' = {}",
                              c.hidden_size, c.num_q_heads);
    c.head_dim = static_cast<int>(c.hidden_size / c.num_q_heads);
  }
  MOE_ASSIGN_OR_RETURN(auto eps, opt_number(j, "rms_norm_eps"));
  if (eps) c.rms_norm_eps = static_cast<float>(*eps);
  MOE_ASSIGN_OR_RETURN(auto max_pos, opt_int(j, "max_position_embeddings"));
  c.max_position_embeddings = max_pos.value_or(0);
  MOE_ASSIGN_OR_RETURN(auto tie, opt_bool(j, "tie_word_embeddings"));
  c.tie_word_embeddings = tie.value_or(false);

  if (auto act = j.value("hidden_act", std::string("silu")); act != "silu")
    return unimplemented("config.json: 'hidden_act' = '{}' is not supported (silu is)", act);
  MOE_ASSIGN_OR_RETURN(auto bias, opt_bool(j, "attention_bias"));
  if (bias.value_or(false)) return unimplemented("config.json: 'attention_bias' = true is not supported");
  MOE_ASSIGN_OR_RETURN(auto sliding, opt_bool(j, "use_sliding_window"));
  if (sliding.value_or(false)) return unimplemented("config.json: 'use_sliding_window' = true is not supported");

  // The dense MLP size: required for qwen3, and for qwen3_moe when any layer is dense.
  MOE_ASSIGN_OR_RETURN(auto inter, opt_int(j, "intermediate_size"));
  c.intermediate_size = inter.value_or(0);
  if (is_moe) {
    MOE_ASSIGN_OR_RETURN(auto experts, int_either(j, "num_experts", "num_local_experts"));
    if (!experts || *experts < 1) return invalid_argument("config.json: required field 'num_experts' (or 'num_local_experts') is missing");
    c.num_experts = static_cast<int>(*experts);
    MOE_ASSIGN_OR_RETURN(auto top_k, required_int(j, "num_experts_per_tok"));
    if (top_k > c.num_experts)
      return invalid_argument("config.json: 'num_experts_per_tok' = {} exceeds 'num_experts' = {}", top_k, c.num_experts);
    c.num_experts_per_tok = static_cast<int>(top_k);
    MOE_ASSIGN_OR_RETURN(c.moe_intermediate_size, required_int(j, "moe_intermediate_size"));
    MOE_ASSIGN_OR_RETURN(auto norm_topk, opt_bool(j, "norm_topk_prob"));
    c.norm_topk_prob = norm_topk.value_or(false);
    MOE_ASSIGN_OR_RETURN(auto step, opt_int(j, "decoder_sparse_step"));
    c.decoder_sparse_step = static_cast<int>(step.value_or(1));
    if (c.decoder_sparse_step < 1) return invalid_argument("config.json: 'decoder_sparse_step' must be >= 1");
    MOE_ASSIGN_OR_RETURN(c.mlp_only_layers, int_list(j, "mlp_only_layers"));
    for (int layer : c.mlp_only_layers)
      if (layer < 0 || layer >= c.num_layers)
        return invalid_argument("config.json: 'mlp_only_layers' names layer {} of {}", layer, c.num_layers);
  }
  bool any_dense = false;
  for (int l = 0; l < c.num_layers; ++l) any_dense |= !c.layer_is_moe(l);
  if (any_dense && c.intermediate_size < 1)
    return invalid_argument("config.json: required field 'intermediate_size' is missing (needed by dense layers)");

  MOE_RETURN_IF_ERROR(parse_rope(j, c));

  MOE_ASSIGN_OR_RETURN(auto bos, opt_int(j, "bos_token_id"));
  if (bos) c.bos_token_id = static_cast<int>(*bos);
  MOE_ASSIGN_OR_RETURN(c.eos_token_ids, int_list(j, "eos_token_id"));

  std::string dtype_a = j.value("torch_dtype", std::string()), dtype_b = j.value("dtype", std::string());
  if (!dtype_a.empty() && !dtype_b.empty() && dtype_a != dtype_b)
    return invalid_argument("config.json: contradictory 'torch_dtype' = '{}' and 'dtype' = '{}'", dtype_a, dtype_b);
  const std::string dtype = dtype_a.empty() ? dtype_b : dtype_a;
  if (dtype.empty() || dtype == "bfloat16") c.dtype = DType::kBF16;
  else if (dtype == "float32") c.dtype = DType::kF32;
  else if (dtype == "float16") c.dtype = DType::kF16;
  else return unimplemented("config.json: dtype '{}' is not supported", dtype);
  MOE_RETURN_IF_ERROR(parse_quantization(j, c));
  return c;
}

Expected<ModelConfig> parse_model_config(const std::string& json_text) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("config.json: not valid JSON");
  return parse_model_config(j);
}

Expected<ModelConfig> load_model_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  if (!in) return not_found("cannot open {}", path);
  std::stringstream text;
  text << in.rdbuf();
  auto config = parse_model_config(text.str());
  if (!config) return config.status().with_context(model_dir);
  return config;
}

}  // namespace moe::model

namespace moe::model {
Expected<std::vector<int>> load_generation_eos_ids(const std::string& model_dir) {
  const std::string path = model_dir + "/generation_config.json";
  std::ifstream in(path);
  if (!in) return std::vector<int>{};
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument("{}: not a JSON object", path);
  auto ids = int_list(j, "eos_token_id");
  if (!ids) return invalid_argument("{}: 'eos_token_id' must be an integer or a list of integers", path);
  return ids;
}
}  // namespace moe::model
