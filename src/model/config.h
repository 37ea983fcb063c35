// The model configuration: what the forward pass needs from a Hugging Face
// config.json, for model_type "qwen3_moe" and "qwen3" (dense).
//
// Both spellings are read: transformers 4.x (num_experts, top-level rope_theta
// and rope_scaling, torch_dtype) and 5.x (num_local_experts, rope_parameters,
// dtype). A field given in both spellings with different values is an error.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"
#include "core/status.h"
#include "ops/quant.h"
#include "ops/rope.h"

namespace moe::model {

// config.json's "quantization_config" (docs/quantization.md). quant_method
// "fp8" with weight_block_size [128, 128] is the official Qwen3 FP8 format
// (fp8-block); "mxfp8", "nvfp4" and "mxfp4" are ours, written by
// `moeserve quantize`.
struct QuantizationConfig {
  std::string method;                // "fp8", "mxfp8", "nvfp4", "mxfp4" (empty: none)
  std::vector<int> weight_block_size;  // e.g. {128, 128}; {1, 32} for mx, {1, 16} for nvfp4
  std::string activation_scheme;     // "dynamic" (fp8-block, mxfp8) or "none" (weight-only fp4)
  ops::QuantFormat format = ops::QuantFormat::kNone;  // derived from the above
};

struct ModelConfig {
  std::string model_type;  // "qwen3_moe" or "qwen3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // each expert
  int num_experts = 0;
  int num_experts_per_tok = 0;
  bool norm_topk_prob = false;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  float rms_norm_eps = 1e-6f;
  ops::RopeSpec rope;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  std::optional<int> bos_token_id;
  std::vector<int> eos_token_ids;
  DType dtype = DType::kBF16;  // the checkpoint's dtype
  QuantizationConfig quantization;

  // Whether layer `layer` has a sparse MoE block (else a dense MLP); the rule
  // of transformers' Qwen3MoeDecoderLayer.
  bool layer_is_moe(int layer) const;
  int q_size() const { return num_q_heads * head_dim; }
  int kv_size() const { return num_kv_heads * head_dim; }
};

// Parses config.json text. Errors name the field.
Expected<ModelConfig> parse_model_config(const std::string& json_text);
Expected<ModelConfig> parse_model_config(const nlohmann::json& json);
// Reads DIR/config.json.
Expected<ModelConfig> load_model_config(const std::string& model_dir);

}  // namespace moe::model

namespace moe::model {
// eos ids from DIR/generation_config.json ("eos_token_id": int or list); empty
// when the file is absent.
Expected<std::vector<int>> load_generation_eos_ids(const std::string& model_dir);
}  // namespace moe::model
