// The MTP module (model/mtp.h) against golden draft logits from the PyTorch
// reference (tools/make_mtp_golden.py -> tests/data/mtp_golden), and the
// checks of its loader (missing, misshapen and unknown tensors).
#include "model/mtp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "kv/kv_cache.h"
#include "model/qwen3_moe.h"
#include "model/safetensors.h"

namespace moe::model {
namespace {

std::string source(const std::string& path) { return std::string(MOE_SOURCE_DIR) + "/" + path; }

// Tolerance: both sides compute in f32 from the same bf16 weights; the
// target's 2 layers and the MTP block differ only in summation order, so
// logits agree to ~1e-5 relative. 1e-3 of the largest |logit| leaves room for
// the reduction orders of both libraries and still catches any real error
// (a wrong concat order or norm changes logits by O(1)).
constexpr double kRelTolerance = 1e-3;

void expect_close(const float* got, const std::vector<float>& want, const std::string& what) {
  double max_abs = 0, max_err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(static_cast<double>(want[i])));
    max_err = std::max(max_err, std::abs(static_cast<double>(got[i]) - want[i]));
    ASSERT_TRUE(std::isfinite(got[i])) << what << " " << i;
  }
  EXPECT_LE(max_err, kRelTolerance * std::max(1.0, max_abs)) << what;
}

TEST(Mtp, MatchesTorchGoldenDraftLogits) {
  std::ifstream in(source("tests/data/mtp_golden/golden.json"));
  ASSERT_TRUE(in.good());
  const auto golden = nlohmann::json::parse(in);
  ThreadPool pool(2);
  const std::string target_dir = source(golden["target"].get<std::string>());
  auto config = load_model_config(target_dir);
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  auto weights = ModelWeights::load(target_dir, *config, pool);
  ASSERT_TRUE(weights.has_value()) << weights.status().to_string();
  auto mtp_weights = MtpWeights::load(source("tests/data/mtp_golden"), *config);
  ASSERT_TRUE(mtp_weights.has_value()) << mtp_weights.status().to_string();
  ASSERT_TRUE(mtp_weights->layer().is_moe);
  Qwen3MoeModel target(*weights);
  MtpModel mtp(*mtp_weights, *weights);

  const auto prompt = golden["prompt"].get<std::vector<int32_t>>();
  const auto n = static_cast<int32_t>(prompt.size());
  const int page_size = 4, num_pages = 8;
  kv::KvCache target_kv({config->num_layers, config->num_kv_heads, config->head_dim, page_size, num_pages, DType::kF32});
  kv::KvCache mtp_kv({1, config->num_kv_heads, config->head_dim, page_size, num_pages, DType::kF32});
  std::vector<ops::PagedKv> layers;
  for (int l = 0; l < config->num_layers; ++l) layers.push_back(target_kv.layer(l));
  ForwardBatch batch;
  batch.token_ids = prompt;
  for (int32_t i = 0; i < n; ++i) batch.positions.push_back(i);
  batch.query_start = {0, n};
  batch.page_table = {0, 1, 2, 3, 4, 5, 6, 7};
  batch.max_pages_per_seq = num_pages;
  batch.logits_rows = {n - 1};
  std::vector<int32_t> all_rows(batch.positions.begin(), batch.positions.end());
  Tensor hidden;
  const Tensor logits = target.forward(pool, batch, layers, {}, all_rows, &hidden);
  const int32_t next_token = golden["next_token"].get<int32_t>();
  int32_t argmax = 0;
  for (int64_t v = 1; v < config->vocab_size; ++v)
    if (logits.data_as<float>()[v] > logits.data_as<float>()[argmax]) argmax = static_cast<int32_t>(v);
  EXPECT_EQ(argmax, next_token);

  MtpBatch mb;
  mb.token_ids.assign(prompt.begin() + 1, prompt.end());
  mb.token_ids.push_back(next_token);
  mb.positions = batch.positions;
  mb.query_start = {0, n};
  mb.page_table = batch.page_table;
  mb.max_pages_per_seq = num_pages;
  mb.output_rows = all_rows;
  const MtpOutput out = mtp.forward(pool, mb, hidden, mtp_kv.layer(0));
  const auto& rows = golden["logits"];
  ASSERT_EQ(static_cast<int32_t>(rows.size()), n);
  for (int32_t t = 0; t < n; ++t)
    expect_close(out.logits.data_as<float>() + t * config->vocab_size, rows[t].get<std::vector<float>>(),
                 "MTP logits at position " + std::to_string(t));

  // One chained step at position n: the MTP's own output at n - 1 and its draft.
  const int32_t draft = golden["draft"].get<int32_t>();
  MtpBatch chained;
  chained.token_ids = {draft};
  chained.positions = {n};
  chained.query_start = {0, 1};
  chained.page_table = batch.page_table;
  chained.max_pages_per_seq = num_pages;
  chained.output_rows = {0};
  Tensor last(DType::kF32, {1, config->hidden_size});
  std::copy_n(out.hidden.data_as<float>() + (n - 1) * config->hidden_size, config->hidden_size, last.data_as<float>());
  const MtpOutput step = mtp.forward(pool, chained, last, mtp_kv.layer(0));
  expect_close(step.logits.data_as<float>(), golden["chained_logits"].get<std::vector<float>>(), "chained step");
}

// A checkpoint directory holding `tensors`.
std::string write_checkpoint(const std::string& name, const std::vector<std::pair<std::string, TensorView>>& tensors) {
  const auto dir = std::filesystem::temp_directory_path() / ("moe_mtp_test_" + name + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  EXPECT_TRUE(write_safetensors((dir / "model.safetensors").string(), tensors).is_ok());
  return dir.string();
}

TEST(Mtp, LoaderChecksEveryTensor) {
  auto config = load_model_config(source("tests/data/golden/dense_qwen3"));
  ASSERT_TRUE(config.has_value());
  const MtpWeights w = MtpWeights::dummy(*config, 3, false);
  const LayerWeights& l = w.layer();
  std::vector<std::pair<std::string, TensorView>> tensors = {
      {"mtp.pre_fc_norm_embedding.weight", w.embed_norm()}, {"mtp.pre_fc_norm_hidden.weight", w.hidden_norm()},
      {"mtp.fc.weight", w.fc()}, {"mtp.norm.weight", w.final_norm()},
      {"mtp.layers.0.input_layernorm.weight", l.input_norm},
      {"mtp.layers.0.post_attention_layernorm.weight", l.post_attention_norm},
      {"mtp.layers.0.self_attn.q_proj.weight", l.q_proj}, {"mtp.layers.0.self_attn.k_proj.weight", l.k_proj},
      {"mtp.layers.0.self_attn.v_proj.weight", l.v_proj}, {"mtp.layers.0.self_attn.o_proj.weight", l.o_proj},
      {"mtp.layers.0.self_attn.q_norm.weight", l.q_norm}, {"mtp.layers.0.self_attn.k_norm.weight", l.k_norm},
      {"mtp.layers.0.mlp.down_proj.weight", l.w2}};
  const int64_t inter = config->intermediate_size;
  Tensor gate(l.w13.dtype(), {inter, config->hidden_size}), up(l.w13.dtype(), {inter, config->hidden_size});
  tensors.emplace_back("mtp.layers.0.mlp.gate_proj.weight", gate.view());
  tensors.emplace_back("mtp.layers.0.mlp.up_proj.weight", up.view());
  auto good = MtpWeights::load(write_checkpoint("good", tensors), *config);
  ASSERT_TRUE(good.has_value()) << good.status().to_string();
  EXPECT_FALSE(good->layer().is_moe);

  auto missing = tensors;
  missing.erase(missing.begin() + 2);
  auto r1 = MtpWeights::load(write_checkpoint("missing", missing), *config);
  ASSERT_FALSE(r1.has_value());
  EXPECT_NE(r1.status().to_string().find("mtp.fc.weight"), std::string::npos) << r1.status().to_string();

  auto misshapen = tensors;
  misshapen[2].second = w.embed_norm();  // [hidden] where [hidden, 2 * hidden] belongs
  auto r2 = MtpWeights::load(write_checkpoint("shape", misshapen), *config);
  ASSERT_FALSE(r2.has_value());
  EXPECT_NE(r2.status().to_string().find("shape"), std::string::npos) << r2.status().to_string();

  auto unknown = tensors;
  unknown.emplace_back("mtp.layers.1.input_layernorm.weight", w.final_norm());
  auto r3 = MtpWeights::load(write_checkpoint("unknown", unknown), *config);
  ASSERT_FALSE(r3.has_value());
  EXPECT_NE(r3.status().to_string().find("not used"), std::string::npos) << r3.status().to_string();

  EXPECT_FALSE(MtpWeights::load("/nonexistent/mtp", *config).has_value());
}

}  // namespace
}  // namespace moe::model
