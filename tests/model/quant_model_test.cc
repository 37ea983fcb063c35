// Quantized checkpoints: the converter (model/quantize_checkpoint.h), the
// loader's checks (model/weights.h, model/quant_weights.h) and dummy
// quantized weights. Oracles: the input bf16 checkpoint (copied tensors must be
// bitwise equal; quantized ones must equal quantize_tensor of the input,
// which tests/ops/quant_test.cc checks against the format definitions) and
// the documented names, dtypes and shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "kv/kv_cache.h"
#include "model/qwen3_moe.h"
#include "model/quantize_checkpoint.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "ops/linear.h"

namespace moe::model {
namespace {

namespace fs = std::filesystem;
using ops::QuantFormat;

const std::string kGolden = std::string(MOE_SOURCE_DIR) + "/tests/data/golden/";
constexpr QuantFormat kAllFormats[] = {QuantFormat::kFp8Block, QuantFormat::kMxfp8, QuantFormat::kNvfp4,
                                       QuantFormat::kMxfp4};

class QuantModelTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_quant_model_test_" + std::to_string(::getpid()) + "_" +
                                        testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  Expected<QuantizeSummary> convert(const std::string& model, QuantFormat format, const std::string& out,
                                    bool attention = true, bool force = false) {
    QuantizeOptions options;
    options.model_dir = model;
    options.out_dir = out;
    options.format = format;
    options.quantize_attention = attention;
    options.force = force;
    options.max_shard_bytes = 100'000;  // several shards even for the tiny models
    return quantize_checkpoint(options, {});
  }

  Expected<ModelWeights> load(const std::string& dir) {
    MOE_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(dir));
    return ModelWeights::load(dir, config, pool_);
  }

  // Rewrites checkpoint `from` into dir_/name as one file, after `edit`.
  std::string rewrite(const std::string& from, const std::string& name,
                      const std::function<void(std::vector<std::pair<std::string, TensorView>>&)>& edit) {
    auto checkpoint = SafetensorsCheckpoint::open(from);
    EXPECT_TRUE(checkpoint.has_value()) << checkpoint.status().to_string();
    std::vector<std::pair<std::string, TensorView>> tensors;
    for (const auto& n : checkpoint->tensor_names()) tensors.emplace_back(n, *checkpoint->view(n));
    edit(tensors);
    const fs::path out = dir_ / name;
    fs::create_directories(out);
    fs::copy_file(fs::path(from) / "config.json", out / "config.json");
    EXPECT_TRUE(write_safetensors((out / "model.safetensors").string(), tensors).is_ok());
    return out.string();
  }

  fs::path dir_;
  ThreadPool pool_{2};
};

std::vector<float> dequantized(const ops::QuantizedTensor& q, int64_t row_begin, int64_t num_rows) {
  std::vector<float> out(static_cast<size_t>(num_rows * q.cols()));
  ops::dequantize_rows(q, row_begin, num_rows, out.data());
  return out;
}

TEST_F(QuantModelTest, ConverterWritesALoadableCheckpoint) {
  const std::string source = kGolden + "moe_basic";
  auto input = SafetensorsCheckpoint::open(source);
  ASSERT_TRUE(input.has_value());
  auto config = load_model_config(source);
  ASSERT_TRUE(config.has_value());
  for (QuantFormat format : kAllFormats) {
    SCOPED_TRACE(std::string(ops::quant_format_name(format)));
    const std::string out = (dir_ / std::string(ops::quant_format_name(format))).string();
    auto summary = convert(source, format, out);
    ASSERT_TRUE(summary.has_value()) << summary.status().to_string();
    const int64_t per_layer = 4 + 3 * config->num_experts;
    EXPECT_EQ(summary->num_quantized, config->num_layers * per_layer);
    EXPECT_GT(summary->num_shards, 1);
    EXPECT_TRUE(fs::exists(fs::path(out) / "generation_config.json"));
    std::ifstream config_in(fs::path(out) / "config.json");
    const auto written = nlohmann::json::parse(config_in);
    EXPECT_EQ(written["quantization_config"]["quant_method"],
              format == QuantFormat::kFp8Block ? "fp8" : std::string(ops::quant_format_name(format)));

    auto output = SafetensorsCheckpoint::open(out);
    ASSERT_TRUE(output.has_value()) << output.status().to_string();
    for (const auto& name : input->tensor_names()) {
      const TensorView in = *input->view(name);
      if (!is_quantized_projection(name, true)) {  // copied bit for bit
        const TensorView copy = *output->view(name);
        ASSERT_EQ(copy.num_bytes(), in.num_bytes()) << name;
        EXPECT_EQ(std::memcmp(copy.data(), in.data(), in.num_bytes()), 0) << name;
        continue;
      }
      const QuantTensorNames names = quant_tensor_names(format, name);
      const StoredTensorSpec values = stored_values_spec(format, in.dim(0), in.dim(1));
      const StoredTensorSpec scales = stored_scales_spec(format, in.dim(0), in.dim(1));
      EXPECT_EQ(output->find(names.values)->dtype, values.dtype) << name;
      EXPECT_EQ(output->find(names.values)->shape, values.shape) << name;
      EXPECT_EQ(output->find(names.scales)->dtype, scales.dtype) << name;
      EXPECT_EQ(output->find(names.scales)->shape, scales.shape) << name;
      if (!names.global_scale.empty()) {
        EXPECT_EQ(output->find(names.global_scale)->shape, Shape{}) << name;
      }
    }

    auto weights = load(out);
    ASSERT_TRUE(weights.has_value()) << weights.status().to_string();
    EXPECT_EQ(weights->quant_format(), format);
    // Packing: expert 1 of layer 1, gate rows then up rows, as quantize_tensor makes them.
    const LayerWeights& layer = weights->layer(1);
    EXPECT_TRUE(layer.q_proj.empty());
    EXPECT_FALSE(layer.router.empty());
    const int64_t inter = config->moe_intermediate_size;
    const ops::QuantizedTensor w13 = layer.w13_quant.slice0(1);
    const TensorView gate = *input->view("model.layers.1.mlp.experts.1.gate_proj.weight");
    const TensorView up = *input->view("model.layers.1.mlp.experts.1.up_proj.weight");
    const float shared_amax = std::max(tensor_max_abs(pool_, gate), tensor_max_abs(pool_, up));
    auto gate_q = quantize_tensor(pool_, format, gate, shared_amax);
    auto up_q = quantize_tensor(pool_, format, up, shared_amax);
    ASSERT_TRUE(gate_q.has_value() && up_q.has_value());
    EXPECT_EQ(dequantized(w13, 0, inter), dequantized(gate_q->view(), 0, inter));
    EXPECT_EQ(dequantized(w13, inter, inter), dequantized(up_q->view(), 0, inter));
  }
}

// quantize_tensor splits a matrix into 128-row tasks: its bytes are those of
// quantize_matrix on the whole f32 matrix, whatever the pool's size.
TEST_F(QuantModelTest, QuantizeTensorBytesDoNotDependOnThreads) {
  const int64_t rows = 300, cols = 200;
  Tensor bf16(DType::kBF16, {rows, cols});
  Tensor f32(DType::kF32, {rows, cols});
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = std::sin(0.37f * static_cast<float>(i)) * (1.0f + static_cast<float>(i % 97));
    bf16.data_as<uint16_t>()[i] = float_to_bf16(v);
    f32.data_as<float>()[i] = bf16_to_float(float_to_bf16(v));
  }
  ThreadPool one(1), three(3);
  for (QuantFormat format : {QuantFormat::kFp8Block, QuantFormat::kMxfp8, QuantFormat::kNvfp4, QuantFormat::kMxfp4}) {
    SCOPED_TRACE(std::string(ops::quant_format_name(format)));
    OwnedQuantized want = allocate_quantized(format, 0, rows, cols);
    if (!want.global_scale.empty())
      want.global_scale.data_as<float>()[0] = ops::nvfp4_global_scale(ops::max_abs(f32.data_as<float>(), rows * cols));
    ops::quantize_matrix(f32.data_as<float>(), want.view());
    for (ThreadPool* pool : {&one, &three}) {
      auto got = quantize_tensor(*pool, format, bf16.view());
      ASSERT_TRUE(got.has_value()) << got.status().to_string();
      EXPECT_EQ(std::memcmp(got->values.data(), want.values.data(), want.values.num_bytes()), 0);
      EXPECT_EQ(std::memcmp(got->scales.data(), want.scales.data(), want.scales.num_bytes()), 0);
      if (!want.global_scale.empty()) {
        EXPECT_EQ(got->global_scale.data_as<float>()[0], want.global_scale.data_as<float>()[0]);
      }
    }
  }
}

// The weight-only formats (no activation quantization) must give exactly the
// logits of the plain model whose f32 weights are the dequantized ones: the
// same f32 products summed in the same order. Checks the loader's packing
// (fused halves, expert order, scale rows) and the forward's dispatch end to end.
TEST_F(QuantModelTest, WeightOnlyModelEqualsItsDequantizedCheckpoint) {
  const std::string source = kGolden + "moe_dense_layer";
  auto input = SafetensorsCheckpoint::open(source);
  ASSERT_TRUE(input.has_value());
  for (QuantFormat format : {QuantFormat::kNvfp4, QuantFormat::kMxfp4}) {
    SCOPED_TRACE(std::string(ops::quant_format_name(format)));
    const std::string out = (dir_ / std::string(ops::quant_format_name(format))).string();
    ASSERT_TRUE(convert(source, format, out).has_value());
    std::vector<Tensor> owned;
    const std::string plain = rewrite(source, std::string(ops::quant_format_name(format)) + "_deq", [&](auto& tensors) {
      for (auto& [name, view] : tensors) {
        if (name.ends_with("mlp.gate.weight")) {  // the plain loader wants the router in the experts' dtype
          Tensor f32(DType::kF32, view.shape());
          ops::cpu::to_f32(view.dtype(), view.data(), f32.data_as<float>(), view.num_elements());
          view = f32.view();
          owned.push_back(std::move(f32));
        }
        if (!is_quantized_projection(name, true)) continue;
        float amax = tensor_max_abs(pool_, view);
        for (auto [mine, other] : {std::pair{"gate_proj", "up_proj"}, {"up_proj", "gate_proj"}}) {
          const size_t at = name.find(mine);
          if (at == std::string::npos) continue;
          std::string sibling = name;
          sibling.replace(at, std::string(mine).size(), other);
          amax = std::max(amax, tensor_max_abs(pool_, *input->view(sibling)));
        }
        auto q = quantize_tensor(pool_, format, view, amax);
        ASSERT_TRUE(q.has_value());
        Tensor f32(DType::kF32, view.shape());
        ops::dequantize_rows(q->view(), 0, view.dim(0), f32.data_as<float>());
        view = f32.view();
        owned.push_back(std::move(f32));
      }
    });
    auto quantized = load(out);
    auto dequantized = load(plain);
    ASSERT_TRUE(quantized.has_value() && dequantized.has_value()) << dequantized.status().to_string();
    const std::vector<int32_t> ids = {7, 300, 12, 9, 401, 3, 3, 88};
    auto run = [&](const ModelWeights& w) {
      Qwen3MoeModel model(w);
      const ModelConfig& c = w.config();
      kv::KvCache cache({c.num_layers, c.num_kv_heads, c.head_dim, 16, 1, DType::kF32});
      std::vector<ops::PagedKv> layers;
      for (int l = 0; l < c.num_layers; ++l) layers.push_back(cache.layer(l));
      ForwardBatch batch{ids, {0, 1, 2, 3, 4, 5, 6, 7}, {0, 8}, {0}, 1, {0, 7}};
      return model.forward(pool_, batch, layers);
    };
    Tensor a = run(*quantized), b = run(*dequantized);
    ASSERT_EQ(a.num_bytes(), b.num_bytes());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.num_bytes()), 0);
  }
}

TEST_F(QuantModelTest, ExpertsOnlyKeepsAttentionInBf16) {
  const std::string out = (dir_ / "experts_only").string();
  ASSERT_TRUE(convert(kGolden + "moe_dense_layer", QuantFormat::kMxfp8, out, /*attention=*/false).has_value());
  auto weights = load(out);
  ASSERT_TRUE(weights.has_value()) << weights.status().to_string();
  for (int l = 0; l < weights->num_layers(); ++l) {
    EXPECT_FALSE(weights->layer(l).q_proj.empty());
    EXPECT_TRUE(weights->layer(l).q_proj_quant.empty());
    EXPECT_FALSE(weights->layer(l).w13_quant.empty()) << "layer " << l;  // MoE and dense MLPs alike
  }
}

TEST_F(QuantModelTest, ConverterRefusesBadInput) {
  const std::string source = kGolden + "moe_basic";
  const std::string out = (dir_ / "out").string();
  fs::create_directories(out);
  std::ofstream(fs::path(out) / "keep.txt") << "x";
  auto not_empty = convert(source, QuantFormat::kFp8Block, out);
  EXPECT_EQ(not_empty.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(not_empty.status().message().find("not empty"), std::string::npos) << not_empty.status().message();
  ASSERT_TRUE(convert(source, QuantFormat::kFp8Block, out, true, /*force=*/true).has_value());
  // A second --force run over our own output works too (old shards are replaced).
  ASSERT_TRUE(convert(source, QuantFormat::kMxfp4, out, true, true).has_value());
  EXPECT_EQ(load(out)->quant_format(), QuantFormat::kMxfp4);

  EXPECT_EQ(convert(source, QuantFormat::kFp8Block, source, true, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(convert((dir_ / "missing").string(), QuantFormat::kFp8Block, (dir_ / "o2").string()).status().code(),
            StatusCode::kNotFound);
  auto again = convert(out, QuantFormat::kFp8Block, (dir_ / "o3").string());
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("already quantized"), std::string::npos) << again.status().message();

  // E2M1 needs an even K: refused before anything is written.
  Tensor odd(DType::kF32, {4, 33});
  const std::string odd_dir = rewrite(source, "odd", [&](auto& tensors) {
    tensors = {{"model.layers.0.mlp.experts.0.gate_proj.weight", odd.view()}};
  });
  auto refused = convert(odd_dir, QuantFormat::kNvfp4, (dir_ / "o4").string());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("K = 33 must be even"), std::string::npos) << refused.status().message();
  EXPECT_FALSE(fs::exists(dir_ / "o4"));
  EXPECT_TRUE(convert(odd_dir, QuantFormat::kMxfp8, (dir_ / "o5").string()).has_value());  // partial block: fine
}

TEST_F(QuantModelTest, LoaderChecksEveryQuantizedTensor) {
  const std::string fp8 = (dir_ / "fp8").string();
  ASSERT_TRUE(convert(kGolden + "moe_basic", QuantFormat::kFp8Block, fp8).has_value());
  const std::string scale = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv";
  Tensor wrong_shape(DType::kF32, {2, 1});
  Tensor wrong_dtype(DType::kBF16, {1, 1});
  Tensor extra(DType::kF32, {1, 1});
  struct Case {
    std::string name;
    std::function<void(std::vector<std::pair<std::string, TensorView>>&)> edit;
    StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"missing", [&](auto& t) { std::erase_if(t, [&](auto& p) { return p.first == scale; }); }, StatusCode::kNotFound,
       scale},
      {"shape", [&](auto& t) { for (auto& p : t) if (p.first == scale) p.second = wrong_shape.view(); },
       StatusCode::kInvalidArgument, "'" + scale + "' has shape [2, 1], expected [1, 1]"},
      {"dtype", [&](auto& t) { for (auto& p : t) if (p.first == scale) p.second = wrong_dtype.view(); },
       StatusCode::kInvalidArgument, "'" + scale + "' has dtype BF16, expected F32"},
      {"router_scale", [&](auto& t) { t.emplace_back("model.layers.0.mlp.gate.weight_scale_inv", extra.view()); },
       StatusCode::kInvalidArgument, "not used"},
      {"attention_scale",
       [&](auto& t) {
         std::erase_if(t, [&](auto& p) { return p.first == "model.layers.0.self_attn.q_proj.weight_scale_inv"; });
       },
       StatusCode::kNotFound, "its scale tensor 'model.layers.0.self_attn.q_proj.weight_scale_inv' is missing"},
  };
  for (const Case& c : cases) {
    auto loaded = load(rewrite(fp8, c.name, c.edit));
    EXPECT_EQ(loaded.status().code(), c.code) << c.name << ": " << loaded.status().to_string();
    EXPECT_NE(loaded.status().message().find(c.message), std::string::npos) << c.name << ": " << loaded.status().message();
  }
  // nvfp4: gate and up of one expert must share their global scale to be fused.
  const std::string nvfp4 = (dir_ / "nvfp4").string();
  ASSERT_TRUE(convert(kGolden + "moe_basic", QuantFormat::kNvfp4, nvfp4).has_value());
  float other = 0.5f;
  auto loaded = load(rewrite(nvfp4, "global", [&](auto& t) {
    for (auto& p : t)
      if (p.first == "model.layers.0.mlp.experts.2.up_proj.weight_scale_2") p.second = TensorView(&other, DType::kF32, {});
  }));
  EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find("different global scales"), std::string::npos) << loaded.status().message();
}

TEST_F(QuantModelTest, OfficialFp8NamesAndShapesAtQwen3_235BScale) {
  // The directory holds several configs; parse the FP8 one directly.
  std::ifstream in(std::string(MOE_SOURCE_DIR) + "/tests/data/configs/qwen3-235b-a22b-fp8.config.json");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  auto fp8 = parse_model_config(text);
  ASSERT_TRUE(fp8.has_value()) << fp8.status().to_string();
  EXPECT_EQ(fp8->quantization.format, QuantFormat::kFp8Block);
  const auto names = quant_tensor_names(QuantFormat::kFp8Block, "model.layers.0.mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(names.scales, "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv");
  EXPECT_TRUE(names.global_scale.empty());
  EXPECT_EQ(stored_scales_spec(QuantFormat::kFp8Block, 1536, 4096).shape, (Shape{12, 32}));
  EXPECT_EQ(stored_scales_spec(QuantFormat::kFp8Block, 4096, 1536).shape, (Shape{32, 12}));
  EXPECT_EQ(stored_values_spec(QuantFormat::kNvfp4, 1536, 4096).shape, (Shape{1536, 2048}));
  EXPECT_EQ(stored_scales_spec(QuantFormat::kMxfp8, 1536, 4096).shape, (Shape{1536, 128}));
  // Fused w13 of 128 experts: the plain DeepGEMM layout since 1536 % 128 == 0.
  EXPECT_EQ(ops::quant_scale_shape(QuantFormat::kFp8Block, 2 * 1536, 4096, 1536), (Shape{24, 32}));
}

TEST_F(QuantModelTest, ConfigNamesTheFormatOrSaysWhyNot) {
  std::ifstream in(kGolden + "moe_basic/config.json");
  const auto base = nlohmann::json::parse(in);
  auto parse = [&](const nlohmann::json& quantization) {
    auto j = base;
    j["quantization_config"] = quantization;
    return parse_model_config(j);
  };
  EXPECT_EQ(parse({{"quant_method", "mxfp8"}, {"weight_block_size", {1, 32}}})->quantization.format, QuantFormat::kMxfp8);
  EXPECT_EQ(parse({{"quant_method", "nvfp4"}})->quantization.format, QuantFormat::kNvfp4);
  EXPECT_EQ(parse({{"quant_method", "mxfp4"}})->quantization.format, QuantFormat::kMxfp4);
  EXPECT_EQ(parse({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}})->quantization.format,
            QuantFormat::kFp8Block);
  auto per_tensor = parse({{"quant_method", "fp8"}});
  EXPECT_EQ(per_tensor.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(per_tensor.status().message().find("[128, 128]"), std::string::npos) << per_tensor.status().message();
  EXPECT_EQ(parse({{"quant_method", "nvfp4"}, {"weight_block_size", {1, 32}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(parse({{"quant_method", "gptq"}}).status().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(parse({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"activation_scheme", "static"}})
                .status()
                .code(),
            StatusCode::kUnimplemented);
}

TEST_F(QuantModelTest, DummyQuantizedWeightsRun) {
  auto config = load_model_config(kGolden + "moe_dense_layer");
  ASSERT_TRUE(config.has_value());
  const ModelWeights plain = ModelWeights::dummy(*config, 3, pool_);
  for (QuantFormat format : kAllFormats) {
    const ModelWeights a = ModelWeights::dummy(*config, 3, pool_, format);
    const ModelWeights b = ModelWeights::dummy(*config, 3, pool_, format);
    EXPECT_EQ(a.quant_format(), format);
    EXPECT_LT(a.num_bytes(), plain.num_bytes());
    const std::vector<int32_t> ids = {1, 2, 3, 4, 5};
    auto run = [&](const ModelWeights& w) {
      Qwen3MoeModel model(w);
      kv::KvCache cache({config->num_layers, config->num_kv_heads, config->head_dim, 16, 1, DType::kF32});
      std::vector<ops::PagedKv> layers;
      for (int l = 0; l < config->num_layers; ++l) layers.push_back(cache.layer(l));
      ForwardBatch batch{ids, {0, 1, 2, 3, 4}, {0, 5}, {0}, 1, {4}};
      return model.forward(pool_, batch, layers);
    };
    Tensor la = run(a), lb = run(b);
    for (int64_t i = 0; i < la.num_elements(); ++i) ASSERT_TRUE(std::isfinite(la.data_as<float>()[i]));
    EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.num_bytes()), 0) << ops::quant_format_name(format);
  }
}

}  // namespace
}  // namespace moe::model
