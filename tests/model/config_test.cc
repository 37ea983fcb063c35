#include "model/config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace moe::model {
namespace {

using nlohmann::json;

json read_json(const std::string& relative) {
  std::ifstream in(std::string(MOE_SOURCE_DIR) + "/" + relative);
  EXPECT_TRUE(in.good()) << relative;
  return json::parse(in);
}

// The public Qwen3-235B-A22B config, in transformers 4.x spelling.
json qwen3_235b() { return read_json("tests/data/configs/qwen3-235b-a22b.config.json"); }

// The same config re-spelled the way transformers 5.x saves it.
json respell_as_v5(json j) {
  j["num_local_experts"] = j["num_experts"];
  j.erase("num_experts");
  j["rope_parameters"] = {{"rope_theta", j["rope_theta"]}, {"rope_type", "default"}};
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["dtype"] = j["torch_dtype"];
  j.erase("torch_dtype");
  return j;
}

Status parse_error(const json& j) {
  auto config = parse_model_config(j);
  EXPECT_FALSE(config.has_value());
  return config.status();
}

TEST(ModelConfig, ReadsQwen3_235B) {
  auto config = parse_model_config(qwen3_235b());
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  const ModelConfig& c = *config;
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_layers, 94);
  EXPECT_EQ(c.num_q_heads, 64);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 1536);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_EQ(c.dtype, DType::kBF16);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{151645});
  for (int l = 0; l < c.num_layers; ++l) EXPECT_TRUE(c.layer_is_moe(l));
  EXPECT_TRUE(c.quantization.method.empty());
}

TEST(ModelConfig, ReadsFp8QuantizationConfig) {
  auto config = parse_model_config(read_json("tests/data/configs/qwen3-235b-a22b-fp8.config.json"));
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  EXPECT_EQ(config->quantization.method, "fp8");
  EXPECT_EQ(config->quantization.weight_block_size, (std::vector<int>{128, 128}));
  EXPECT_EQ(config->quantization.activation_scheme, "dynamic");
}

TEST(ModelConfig, BothSpellingsGiveTheSameConfig) {
  auto v4 = parse_model_config(qwen3_235b());
  auto v5 = parse_model_config(respell_as_v5(qwen3_235b()));
  ASSERT_TRUE(v4.has_value() && v5.has_value()) << v5.status().to_string();
  EXPECT_EQ(v4->num_experts, v5->num_experts);
  EXPECT_EQ(v4->rope.theta, v5->rope.theta);
  EXPECT_EQ(v4->dtype, v5->dtype);
}

TEST(ModelConfig, ReadsEveryGoldenConfig) {
  // Saved by transformers 5.17 (num_local_experts, rope_parameters, dtype).
  auto basic = parse_model_config(read_json("tests/data/golden/moe_basic/config.json"));
  ASSERT_TRUE(basic.has_value()) << basic.status().to_string();
  EXPECT_EQ(basic->num_experts, 8);
  EXPECT_EQ(basic->head_dim, 32);  // != hidden_size / num_attention_heads = 16
  auto dense_layer = parse_model_config(read_json("tests/data/golden/moe_dense_layer/config.json"));
  ASSERT_TRUE(dense_layer.has_value());
  EXPECT_TRUE(dense_layer->layer_is_moe(0));
  EXPECT_FALSE(dense_layer->layer_is_moe(1));  // mlp_only_layers = [1]
  EXPECT_TRUE(dense_layer->tie_word_embeddings);
  EXPECT_FALSE(dense_layer->norm_topk_prob);
  auto sparse = parse_model_config(read_json("tests/data/golden/moe_sparse_step/config.json"));
  ASSERT_TRUE(sparse.has_value());
  EXPECT_EQ(sparse->decoder_sparse_step, 2);
  EXPECT_FALSE(sparse->layer_is_moe(0));
  EXPECT_TRUE(sparse->layer_is_moe(1));
  EXPECT_FALSE(sparse->layer_is_moe(2));
  EXPECT_TRUE(sparse->layer_is_moe(3));
  auto yarn = parse_model_config(read_json("tests/data/golden/moe_yarn/config.json"));
  ASSERT_TRUE(yarn.has_value());
  EXPECT_EQ(yarn->rope.type, "yarn");
  EXPECT_DOUBLE_EQ(yarn->rope.factor, 4.0);  // explicit factor wins over 512 / 64 (transformers 5.x)
  EXPECT_EQ(yarn->rope.original_max_position_embeddings, 64);
  auto dense = parse_model_config(read_json("tests/data/golden/dense_qwen3/config.json"));
  ASSERT_TRUE(dense.has_value()) << dense.status().to_string();
  EXPECT_EQ(dense->model_type, "qwen3");
  EXPECT_FALSE(dense->layer_is_moe(0));
}

TEST(ModelConfig, YarnFromV4RopeScaling) {
  json j = qwen3_235b();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  auto c = parse_model_config(j);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->rope.type, "yarn");
  EXPECT_DOUBLE_EQ(c->rope.factor, 4.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 32768);
}

TEST(ModelConfig, ErrorsNameTheField) {
  json j = qwen3_235b();
  j["model_type"] = "llama";
  EXPECT_NE(parse_error(j).message().find("model_type 'llama'"), std::string::npos);

  j = qwen3_235b();
  j.erase("hidden_size");
  EXPECT_NE(parse_error(j).message().find("'hidden_size' is missing"), std::string::npos);

  j = qwen3_235b();
  j["num_local_experts"] = 64;
  Status s = parse_error(j);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("contradictory fields 'num_experts' = 128 and 'num_local_experts' = 64"), std::string::npos);

  j = qwen3_235b();
  j["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "default"}};
  EXPECT_NE(parse_error(j).message().find("contradictory 'rope_theta'"), std::string::npos);

  j = qwen3_235b();
  j["dtype"] = "float32";
  EXPECT_NE(parse_error(j).message().find("'torch_dtype'"), std::string::npos);

  j = qwen3_235b();
  j["num_experts_per_tok"] = 200;
  EXPECT_NE(parse_error(j).message().find("'num_experts_per_tok' = 200 exceeds"), std::string::npos);

  j = qwen3_235b();
  j["num_key_value_heads"] = 5;
  EXPECT_NE(parse_error(j).message().find("'num_key_value_heads' = 5"), std::string::npos);

  j = qwen3_235b();
  j["hidden_size"] = "4096";
  EXPECT_NE(parse_error(j).message().find("'hidden_size' must be an integer"), std::string::npos);

  j = qwen3_235b();
  j.erase("head_dim");
  j["hidden_size"] = 4000;
  EXPECT_NE(parse_error(j).message().find("'head_dim' is missing"), std::string::npos);

  j = qwen3_235b();
  j["mlp_only_layers"] = {3, 200};
  EXPECT_NE(parse_error(j).message().find("'mlp_only_layers' names layer 200"), std::string::npos);

  j = qwen3_235b();
  j["mlp_only_layers"] = {0};
  j.erase("intermediate_size");
  EXPECT_NE(parse_error(j).message().find("'intermediate_size' is missing"), std::string::npos);

  j = qwen3_235b();
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 2.0}};
  EXPECT_EQ(parse_error(j).code(), StatusCode::kUnimplemented);

  EXPECT_EQ(parse_model_config(std::string("{not json")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_model_config(std::string("[1, 2]")).status().code(), StatusCode::kInvalidArgument);
}

TEST(ModelConfig, LoadFromMissingDirectory) {
  auto c = load_model_config("/nonexistent/model");
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace moe::model
