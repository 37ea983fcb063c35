// The weight loader's checks: a checkpoint that disagrees with its config
// fails with an error naming the tensor, never a crash. Each case starts from
// the golden moe_basic checkpoint, changes one thing, and writes it anew.
#include "model/weights.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "model/safetensors.h"

namespace moe::model {
namespace {

namespace fs = std::filesystem;

const std::string kSource = std::string(MOE_SOURCE_DIR) + "/tests/data/golden/moe_basic";

class WeightsTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_weights_test_" + std::to_string(::getpid()) + "_" +
                                        testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(kSource + "/config.json", dir_ / "config.json");
    auto file = SafetensorsFile::open(kSource + "/model.safetensors");
    ASSERT_TRUE(file.has_value()) << file.status().to_string();
    source_ = std::make_unique<SafetensorsFile>(std::move(file).value());
    for (const auto& info : source_->tensors()) tensors_.emplace_back(info.name, source_->view(info));
  }
  void TearDown() override { fs::remove_all(dir_); }

  Status load_modified() {
    EXPECT_TRUE(write_safetensors((dir_ / "model.safetensors").string(), tensors_).is_ok());
    auto config = load_model_config(dir_.string());
    EXPECT_TRUE(config.has_value());
    ThreadPool pool(1);
    return ModelWeights::load(dir_.string(), *config, pool).status();
  }

  void erase(const std::string& name) {
    std::erase_if(tensors_, [&](const auto& t) { return t.first == name; });
  }

  fs::path dir_;
  std::unique_ptr<SafetensorsFile> source_;
  std::vector<std::pair<std::string, TensorView>> tensors_;
  std::vector<Tensor> storage_;
};

TEST_F(WeightsTest, UnmodifiedCheckpointLoads) { EXPECT_TRUE(load_modified().is_ok()); }

TEST_F(WeightsTest, MissingTensorIsNamed) {
  erase("model.layers.1.mlp.experts.3.up_proj.weight");
  Status s = load_modified();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("model.layers.1.mlp.experts.3.up_proj.weight"), std::string::npos) << s.message();
}

TEST_F(WeightsTest, ShapeMismatchAgainstConfigIsNamed) {
  for (auto& [name, view] : tensors_)
    if (name == "model.layers.0.self_attn.q_proj.weight") view = view.reshaped({view.dim(1), view.dim(0)});
  Status s = load_modified();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'model.layers.0.self_attn.q_proj.weight' has shape [64, 128], the config implies [128, 64]"), std::string::npos)
      << s.message();
}

TEST_F(WeightsTest, UnusedTensorIsAnError) {
  Tensor extra(DType::kBF16, {4});
  tensors_.emplace_back("model.layers.0.mlp.shared_expert.weight", extra.view());
  Status s = load_modified();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not used"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("model.layers.0.mlp.shared_expert.weight"), std::string::npos) << s.message();
}

TEST_F(WeightsTest, IntegerWeightsAreRefused) {
  Tensor ints(DType::kI32, {64});
  for (auto& [name, view] : tensors_)
    if (name == "model.norm.weight") view = ints.view();
  Status s = load_modified();
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("'model.norm.weight' has dtype i32"), std::string::npos) << s.message();
}

TEST_F(WeightsTest, QuantizedConfigWithBf16WeightsIsRefusedClearly) {
  std::ifstream in(dir_ / "config.json");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  in.close();
  text.insert(text.rfind('}'), R"(, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]})");
  std::ofstream(dir_ / "config.json") << text;
  // The config says fp8, so every MLP projection must be F8_E4M3 with its scales.
  Status s = load_modified();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'model.layers.0.mlp.experts.0.gate_proj.weight' has dtype BF16, expected F8_E4M3"),
            std::string::npos)
      << s.message();
}

TEST(Weights, DummyHasTheConfigShapes) {
  auto config = load_model_config(kSource);
  ASSERT_TRUE(config.has_value());
  ThreadPool pool(2);
  ModelWeights a = ModelWeights::dummy(*config, 7, pool), b = ModelWeights::dummy(*config, 7, pool);
  EXPECT_EQ(a.layer(1).w13.shape(), (Shape{8, 64, 64}));  // [experts, 2 * moe_inter, hidden]
  EXPECT_EQ(a.layer(1).w2.shape(), (Shape{8, 64, 32}));
  EXPECT_EQ(a.lm_head().shape(), (Shape{512, 64}));
  EXPECT_EQ(a.layer(0).q_proj.dtype(), DType::kBF16);
  // Deterministic in the seed, whatever the thread count.
  ThreadPool one(1);
  ModelWeights c = ModelWeights::dummy(*config, 7, one);
  EXPECT_EQ(std::memcmp(a.layer(1).w13.data(), c.layer(1).w13.data(), a.layer(1).w13.num_bytes()), 0);
  EXPECT_EQ(a.num_bytes(), b.num_bytes());
}

}  // namespace
}  // namespace moe::model
