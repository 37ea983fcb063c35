// The MTP module (model/mtp.h) against golden draft logits from the PyTorch
// reference (tools/make_mtp_golden.py -> tests/data/mtp_golden), the checks
// of its loader (missing, misshapen and unknown tensors), and an MTP layer
// inside the target's own checkpoint (Qwen3.5 style) against the same layer
// as a side checkpoint.
#include "model/mtp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

// The golden prompt through the target: the logits of its last position and
// the hidden state of every position (what the MTP layer reads).
struct TargetRun {
  Tensor logits;  // [1, vocab]
  Tensor hidden;  // [prompt, hidden]
};

constexpr int kPageSize = 4, kNumPages = 8;

std::vector<int32_t> all_positions(int32_t n) {
  std::vector<int32_t> positions(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) positions[static_cast<size_t>(i)] = i;
  return positions;
}

TargetRun run_target(ThreadPool& pool, const ModelWeights& weights, const std::vector<int32_t>& prompt) {
  const ModelConfig& config = weights.config();
  const auto n = static_cast<int32_t>(prompt.size());
  kv::KvCache target_kv(
      {config.num_layers, config.num_kv_heads, config.head_dim, kPageSize, kNumPages, DType::kF32});
  std::vector<ops::PagedKv> layers;
  for (int l = 0; l < config.num_layers; ++l) layers.push_back(target_kv.layer(l));
  ForwardBatch batch;
  batch.token_ids = prompt;
  batch.positions = all_positions(n);
  batch.query_start = {0, n};
  batch.page_table = {0, 1, 2, 3, 4, 5, 6, 7};
  batch.max_pages_per_seq = kNumPages;
  batch.logits_rows = {n - 1};
  TargetRun run;
  run.logits = Qwen3MoeModel(weights).forward(pool, batch, layers, {}, batch.positions, &run.hidden);
  return run;
}

// The MTP pass over the prompt (row t combines h_t with token t + 1, the last
// row with `next_token`) and one chained step at position n from its own
// output at n - 1 and `draft`.
struct MtpRun {
  MtpOutput prompt;   // every row of the prompt
  MtpOutput chained;  // the chained step
};

MtpRun run_mtp(ThreadPool& pool, const MtpModel& mtp, const std::vector<int32_t>& prompt,
               const Tensor& hidden, int32_t next_token, int32_t draft) {
  const ModelConfig& config = mtp.config();
  const auto n = static_cast<int32_t>(prompt.size());
  kv::KvCache mtp_kv({1, config.num_kv_heads, config.head_dim, kPageSize, kNumPages, DType::kF32});
  MtpBatch mb;
  mb.token_ids.assign(prompt.begin() + 1, prompt.end());
  mb.token_ids.push_back(next_token);
  mb.positions = all_positions(n);
  mb.query_start = {0, n};
  mb.page_table = {0, 1, 2, 3, 4, 5, 6, 7};
  mb.max_pages_per_seq = kNumPages;
  mb.output_rows = mb.positions;
  MtpRun run;
  run.prompt = mtp.forward(pool, mb, hidden, mtp_kv.layer(0));
  MtpBatch chained;
  chained.token_ids = {draft};
  chained.positions = {n};
  chained.query_start = {0, 1};
  chained.page_table = mb.page_table;
  chained.max_pages_per_seq = kNumPages;
  chained.output_rows = {0};
  Tensor last(DType::kF32, {1, config.hidden_size});
  std::copy_n(run.prompt.hidden.data_as<float>() + (n - 1) * config.hidden_size, config.hidden_size,
              last.data_as<float>());
  run.chained = mtp.forward(pool, chained, last, mtp_kv.layer(0));
  return run;
}

nlohmann::json read_golden() {
  std::ifstream in(source("tests/data/mtp_golden/golden.json"));
  EXPECT_TRUE(in.good());
  return nlohmann::json::parse(in);
}

TEST(Mtp, MatchesTorchGoldenDraftLogits) {
  const auto golden = read_golden();
  ThreadPool pool(2);
  const std::string target_dir = source(golden["target"].get<std::string>());
  auto config = load_model_config(target_dir);
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  auto weights = ModelWeights::load(target_dir, *config, pool);
  ASSERT_TRUE(weights.has_value()) << weights.status().to_string();
  auto mtp_weights = MtpWeights::load(source("tests/data/mtp_golden"), *config);
  ASSERT_TRUE(mtp_weights.has_value()) << mtp_weights.status().to_string();
  ASSERT_TRUE(mtp_weights->layer().is_moe);
  MtpModel mtp(*mtp_weights, *weights);

  const auto prompt = golden["prompt"].get<std::vector<int32_t>>();
  const auto n = static_cast<int32_t>(prompt.size());
  const TargetRun target = run_target(pool, *weights, prompt);
  const int32_t next_token = golden["next_token"].get<int32_t>();
  int32_t argmax = 0;
  const float* logits = target.logits.data_as<float>();
  for (int64_t v = 1; v < config->vocab_size; ++v)
    if (logits[v] > logits[argmax]) argmax = static_cast<int32_t>(v);
  EXPECT_EQ(argmax, next_token);

  const MtpRun out = run_mtp(pool, mtp, prompt, target.hidden, next_token, golden["draft"].get<int32_t>());
  const auto& rows = golden["logits"];
  ASSERT_EQ(static_cast<int32_t>(rows.size()), n);
  for (int32_t t = 0; t < n; ++t)
    expect_close(out.prompt.logits.data_as<float>() + t * config->vocab_size,
                 rows[t].get<std::vector<float>>(), "MTP logits at position " + std::to_string(t));
  expect_close(out.chained.logits.data_as<float>(), golden["chained_logits"].get<std::vector<float>>(),
               "chained step");
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

// The golden target with the golden MTP layer inside its own checkpoint, as
// Qwen3.5 and Qwen3-Next ship it: the target's tensors in one shard, the
// mtp.* tensors (and a test's extra tensors) in a second, behind
// model.safetensors.index.json.
class MtpInModelCheckpoint : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("moe_mtp_in_model_" + std::to_string(::getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    for (const char* file : {"config.json", "generation_config.json"})
      std::filesystem::copy_file(std::filesystem::path(kTargetDir) / file, dir_ / file);
    auto target = SafetensorsFile::open(kTargetDir + "/model.safetensors");
    ASSERT_TRUE(target.has_value()) << target.status().to_string();
    target_ = std::make_unique<SafetensorsFile>(std::move(target).value());
    auto mtp = SafetensorsFile::open(kMtpDir + "/model.safetensors");
    ASSERT_TRUE(mtp.has_value()) << mtp.status().to_string();
    mtp_ = std::make_unique<SafetensorsFile>(std::move(mtp).value());
    auto config = load_model_config(kTargetDir);
    ASSERT_TRUE(config.has_value()) << config.status().to_string();
    config_ = *config;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes the two shards, `extra` after the MTP layer's tensors; returns the directory.
  std::string write(const std::vector<std::pair<std::string, TensorView>>& extra = {}) {
    std::vector<std::pair<std::string, TensorView>> tensors;
    for (const auto& info : target_->tensors()) tensors.emplace_back(info.name, target_->view(info));
    for (const auto& info : mtp_->tensors()) tensors.emplace_back(info.name, mtp_->view(info));
    tensors.insert(tensors.end(), extra.begin(), extra.end());
    // A shard as large as the target's data: the first MTP tensor opens the second.
    EXPECT_TRUE(write_sharded_safetensors(dir_.string(), tensors, target_->data_size()).is_ok());
    return dir_.string();
  }

  const std::string kTargetDir = source("tests/data/golden/moe_basic");
  const std::string kMtpDir = source("tests/data/mtp_golden");
  std::filesystem::path dir_;
  std::unique_ptr<SafetensorsFile> target_, mtp_;
  ModelConfig config_;
};

void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.num_bytes()), 0) << what << " differs";
}

TEST_F(MtpInModelCheckpoint, TargetLeavesTheMtpTensorsAndComputesTheSame) {
  const std::string dir = write();
  auto checkpoint = SafetensorsCheckpoint::open(dir);
  ASSERT_TRUE(checkpoint.has_value()) << checkpoint.status().to_string();
  ASSERT_EQ(checkpoint->shards().size(), 2u);
  for (const auto& name : checkpoint->shards()[1].tensor_names()) EXPECT_TRUE(is_mtp_tensor(name)) << name;
  const auto in_dir = has_mtp_tensors(dir), in_target = has_mtp_tensors(kTargetDir);
  ASSERT_TRUE(in_dir.has_value() && in_target.has_value());
  EXPECT_TRUE(*in_dir);
  EXPECT_FALSE(*in_target);
  EXPECT_FALSE(has_mtp_tensors("/nonexistent/model").has_value());

  ThreadPool pool(2);
  auto in_model = ModelWeights::load(dir, config_, pool);
  ASSERT_TRUE(in_model.has_value()) << in_model.status().to_string();
  auto plain = ModelWeights::load(kTargetDir, config_, pool);
  ASSERT_TRUE(plain.has_value()) << plain.status().to_string();
  const auto prompt = read_golden()["prompt"].get<std::vector<int32_t>>();
  const TargetRun got = run_target(pool, *in_model, prompt), want = run_target(pool, *plain, prompt);
  expect_same(got.logits, want.logits, "target logits");
  expect_same(got.hidden, want.hidden, "target hidden states");
}

TEST_F(MtpInModelCheckpoint, MtpLayerDraftsAsTheSideCheckpoint) {
  const std::string dir = write();
  ThreadPool pool(2);
  auto target = ModelWeights::load(dir, config_, pool);
  ASSERT_TRUE(target.has_value()) << target.status().to_string();
  auto in_model = MtpWeights::load(dir, config_, MtpCheckpoint::kModel);
  ASSERT_TRUE(in_model.has_value()) << in_model.status().to_string();
  EXPECT_TRUE(in_model->layer().is_moe);
  auto side = MtpWeights::load(kMtpDir, config_);
  ASSERT_TRUE(side.has_value()) << side.status().to_string();

  const auto golden = read_golden();
  const auto prompt = golden["prompt"].get<std::vector<int32_t>>();
  const TargetRun run = run_target(pool, *target, prompt);
  const int32_t next_token = golden["next_token"].get<int32_t>(), draft = golden["draft"].get<int32_t>();
  const MtpRun got = run_mtp(pool, MtpModel(*in_model, *target), prompt, run.hidden, next_token, draft);
  const MtpRun want = run_mtp(pool, MtpModel(*side, *target), prompt, run.hidden, next_token, draft);
  expect_same(got.prompt.logits, want.prompt.logits, "draft logits over the prompt");
  expect_same(got.chained.logits, want.chained.logits, "chained draft logits");

  // Read as a side checkpoint, the same directory is refused: the target's tensors are not the MTP layer's.
  auto as_side = MtpWeights::load(dir, config_);
  ASSERT_FALSE(as_side.has_value());
  EXPECT_NE(as_side.status().to_string().find("model.embed_tokens.weight"), std::string::npos)
      << as_side.status().to_string();
}

// Each loader refuses the unknown tensors of its own prefix, and only those.
TEST_F(MtpInModelCheckpoint, UnknownTensorsAreRefusedByTheirLoader) {
  Tensor extra(DType::kBF16, {config_.hidden_size});
  const std::string dir = write({{"model.layers.0.mlp.shared_expert.weight", extra.view()},
                                 {"mtp.layers.1.input_layernorm.weight", extra.view()}});
  ThreadPool pool(1);
  auto target = ModelWeights::load(dir, config_, pool);
  ASSERT_FALSE(target.has_value());
  const std::string target_error = target.status().to_string();
  EXPECT_NE(target_error.find("not used"), std::string::npos) << target_error;
  EXPECT_NE(target_error.find("model.layers.0.mlp.shared_expert.weight"), std::string::npos) << target_error;
  EXPECT_EQ(target_error.find("mtp."), std::string::npos) << target_error;

  auto mtp = MtpWeights::load(dir, config_, MtpCheckpoint::kModel);
  ASSERT_FALSE(mtp.has_value());
  const std::string mtp_error = mtp.status().to_string();
  EXPECT_NE(mtp_error.find("not used"), std::string::npos) << mtp_error;
  EXPECT_NE(mtp_error.find("mtp.layers.1.input_layernorm.weight"), std::string::npos) << mtp_error;
  EXPECT_EQ(mtp_error.find("shared_expert"), std::string::npos) << mtp_error;
}

// A misshapen mtp.* tensor in the model's checkpoint (here one merged file)
// is refused as in a side checkpoint.
TEST_F(MtpInModelCheckpoint, MisshapenMtpTensorIsRefused) {
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const auto& info : target_->tensors()) tensors.emplace_back(info.name, target_->view(info));
  for (const auto& info : mtp_->tensors())
    tensors.emplace_back(info.name, info.name == "mtp.fc.weight" ? mtp_->view("mtp.norm.weight").value()
                                                                 : mtp_->view(info));
  ASSERT_TRUE(write_safetensors((dir_ / "model.safetensors").string(), tensors).is_ok());
  ThreadPool pool(1);
  EXPECT_TRUE(ModelWeights::load(dir_.string(), config_, pool).has_value());
  auto mtp = MtpWeights::load(dir_.string(), config_, MtpCheckpoint::kModel);
  ASSERT_FALSE(mtp.has_value());
  EXPECT_NE(mtp.status().to_string().find("'mtp.fc.weight' has shape"), std::string::npos)
      << mtp.status().to_string();
}

}  // namespace
}  // namespace moe::model
