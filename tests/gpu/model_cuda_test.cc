// The whole model on the GPU against transformers' goldens and against the
// CPU reference (tests/data/golden). Skips without a GPU.
//
// The GPU path rounds GEMM inputs (normed activations, q/k/v, attention
// output, expert activations) and the KV cache to bf16, so its logits differ
// from the float32 goldens by ~1e-2 relative, not by float32 noise. Greedy ids
// are compared exactly only where the golden top-1/top-2 margin at every step
// stays above kBf16Margin; prompts with a smaller margin are listed, not
// silently dropped, and their tokens are compared up to the first small-margin
// step.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <nlohmann/json.hpp>

#include "kv/kv_cache.h"
#include "model/cuda/cuda_model.h"
#include "model/qwen3_moe.h"

namespace moe::model {
namespace {

using nlohmann::json;

constexpr double kLogitTolerance = 3e-2;  // relative L2, bf16 activations
constexpr double kBf16Margin = 0.1;       // logit margin above which bf16 rounding cannot flip a greedy choice

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::string golden_dir(const std::string& name) { return std::string(MOE_SOURCE_DIR) + "/tests/data/golden/" + name; }

struct Loaded {
  ModelConfig config;
  std::unique_ptr<ModelWeights> weights;
};

Loaded load(const std::string& name, ThreadPool& pool) {
  Loaded m;
  auto config = load_model_config(golden_dir(name));
  EXPECT_TRUE(config.has_value());
  m.config = *config;
  auto weights = ModelWeights::load(golden_dir(name), m.config, pool);
  EXPECT_TRUE(weights.has_value()) << weights.status().to_string();
  m.weights = std::make_unique<ModelWeights>(std::move(weights).value());
  return m;
}

int32_t engine_argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

double relative_error(const float* ours, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff += (ours[i] - ref[i]) * static_cast<double>(ours[i] - ref[i]);
    norm += ref[i] * static_cast<double>(ref[i]);
  }
  return std::sqrt(diff / norm);
}

// One sequence's whole prompt as a batch over pages 0.., logits of its last token.
ForwardBatch prompt_batch(const std::vector<int32_t>& ids, int page_size) {
  ForwardBatch batch;
  batch.token_ids = ids;
  for (int i = 0; i < static_cast<int>(ids.size()); ++i) batch.positions.push_back(i);
  batch.query_start = {0, static_cast<int32_t>(ids.size())};
  const int pages = (static_cast<int>(ids.size()) + page_size - 1) / page_size;
  for (int p = 0; p < pages; ++p) batch.page_table.push_back(p);
  batch.max_pages_per_seq = pages;
  batch.logits_rows = {static_cast<int32_t>(ids.size()) - 1};
  return batch;
}

// Greedy generation on the GPU through the KV cache: one prefill, then decode steps.
std::vector<int32_t> gpu_greedy(CudaQwen3MoeModel& model, const std::vector<int32_t>& prompt, int steps, int page_size) {
  const int total = static_cast<int>(prompt.size()) + steps;
  const int pages = (total + page_size - 1) / page_size;
  ForwardBatch batch;
  batch.token_ids = prompt;
  for (int i = 0; i < static_cast<int>(prompt.size()); ++i) batch.positions.push_back(i);
  batch.query_start = {0, static_cast<int32_t>(prompt.size())};
  for (int p = 0; p < pages; ++p) batch.page_table.push_back(pages - 1 - p);  // reversed pages
  batch.max_pages_per_seq = pages;
  batch.logits_rows = {static_cast<int32_t>(prompt.size()) - 1};
  std::vector<int32_t> out;
  for (int step = 0; step < steps; ++step) {
    auto ids = model.forward_greedy(batch);
    EXPECT_TRUE(ids.has_value()) << ids.status().to_string();
    if (!ids) return out;
    out.push_back((*ids)[0]);
    const int32_t pos = static_cast<int32_t>(prompt.size()) + step;
    batch.token_ids = {(*ids)[0]};
    batch.positions = {pos};
    batch.query_start = {0, 1};
    batch.logits_rows = {0};
  }
  return out;
}

class CudaGoldenTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
  ThreadPool pool_;
};

TEST_P(CudaGoldenTest, LogitsAndGreedyMatchTransformers) {
  std::ifstream in(golden_dir(GetParam()) + "/golden.json");
  const json golden = json::parse(in);
  Loaded m = load(GetParam(), pool_);
  CudaModelOptions options;
  options.page_size = 4;
  options.num_pages = 64;
  auto model = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_TRUE(model.has_value()) << model.status().to_string();
  double max_err = 0;
  int compared = 0;
  for (const auto& prompt : golden["prompts"]) {
    const auto ids = prompt["ids"].get<std::vector<int32_t>>();
    auto logits = (*model)->forward(prompt_batch(ids, 4));
    ASSERT_TRUE(logits.has_value()) << logits.status().to_string();
    const double err = relative_error(logits->data_as<float>(), prompt["last_logits"].get<std::vector<float>>());
    for (int64_t i = 0; i < logits->num_elements(); ++i) ASSERT_TRUE(std::isfinite(logits->data_as<float>()[i]));
    EXPECT_LT(err, kLogitTolerance) << "prompt of " << ids.size() << " tokens";
    max_err = std::max(max_err, err);

    const auto expected = prompt["greedy"].get<std::vector<int32_t>>();
    const auto margins = prompt["greedy_margins"].get<std::vector<double>>();
    int robust_steps = 0;
    while (robust_steps < static_cast<int>(margins.size()) && margins[robust_steps] >= kBf16Margin) ++robust_steps;
    const auto got = gpu_greedy(**model, ids, static_cast<int>(expected.size()), 4);
    ASSERT_EQ(got.size(), expected.size());
    EXPECT_TRUE(std::equal(got.begin(), got.begin() + robust_steps, expected.begin()))
        << "prompt of " << ids.size() << " tokens, first " << robust_steps << " steps";
    if (robust_steps < static_cast<int>(expected.size()))
      std::printf("%s: prompt of %zu tokens: golden margin %.4f < %.2f at step %d; tokens compared up to there\n",
                  GetParam().c_str(), ids.size(), margins[robust_steps], kBf16Margin, robust_steps);
    compared += robust_steps;
  }
  std::printf("%s: max relative logit error %.3g (bf16 activations), %d greedy steps compared exactly\n",
              GetParam().c_str(), max_err, compared);
}

INSTANTIATE_TEST_SUITE_P(Models, CudaGoldenTest,
                         testing::Values("moe_basic", "moe_dense_layer", "moe_sparse_step", "moe_yarn", "dense_qwen3"));

TEST(CudaModel, BatchedMatchesOneByOne) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool;
  Loaded m = load("moe_basic", pool);
  CudaModelOptions options;
  options.page_size = 4;
  options.num_pages = 64;
  auto model = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_TRUE(model.has_value());
  const std::vector<std::vector<int32_t>> prompts = {{5, 9, 13}, {100, 200, 300, 400, 7, 8, 9}, {42}};
  ForwardBatch batch;
  batch.query_start = {0};
  batch.max_pages_per_seq = 2;
  int page = 0;
  for (const auto& p : prompts) {
    for (int i = 0; i < static_cast<int>(p.size()); ++i) batch.token_ids.push_back(p[i]), batch.positions.push_back(i);
    batch.query_start.push_back(static_cast<int32_t>(batch.token_ids.size()));
    batch.logits_rows.push_back(static_cast<int32_t>(batch.token_ids.size()) - 1);
    batch.page_table.push_back(page++);
    batch.page_table.push_back(page++);
  }
  auto together = (*model)->forward(batch);
  ASSERT_TRUE(together.has_value());
  const int64_t vocab = m.config.vocab_size;
  for (size_t s = 0; s < prompts.size(); ++s) {
    ForwardBatch one;
    one.token_ids = prompts[s];
    for (int i = 0; i < static_cast<int>(prompts[s].size()); ++i) one.positions.push_back(i);
    one.query_start = {0, static_cast<int32_t>(prompts[s].size())};
    one.page_table = {20, 21};
    one.max_pages_per_seq = 2;
    one.logits_rows = {static_cast<int32_t>(prompts[s].size()) - 1};
    auto alone = (*model)->forward(one);
    ASSERT_TRUE(alone.has_value());
    std::vector<float> ref(alone->data_as<float>(), alone->data_as<float>() + vocab);
    EXPECT_LT(relative_error(together->data_as<float>() + s * vocab, ref), 1e-3) << "prompt " << s;
  }
}

// KV pool sizes: a byte budget (serve --kv-cache-gb on a GPU) becomes whole
// pages of the model's page bytes; a budget under one sequence is refused.
TEST(CudaModel, KvCacheBytesGiveWholePages) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool;
  Loaded m = load("moe_basic", pool);
  CudaModelOptions options;
  options.page_size = 4;
  options.max_model_len = 64;
  options.num_pages = 8;
  auto fixed = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_TRUE(fixed.has_value()) << fixed.status().to_string();
  EXPECT_EQ((*fixed)->num_pages(), 8);
  const double page_bytes = static_cast<double>((*fixed)->kv_page_bytes());
  options.num_pages = 0;
  options.kv_cache_bytes = page_bytes * 100.5;
  auto budget = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_TRUE(budget.has_value()) << budget.status().to_string();
  EXPECT_EQ((*budget)->num_pages(), 100);
  options.kv_cache_bytes = page_bytes * 15;  // 64 tokens need 16 pages of 4
  auto small = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_FALSE(small.has_value());
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("needs 16"), std::string::npos) << small.status().message();
}


// A pool sized from memory that cannot hold one sequence of max_model_len is
// refused at creation, naming both remedies, instead of a scheduler that can
// never run such a sequence: ~2 GB left after what the process holds now, and
// a max_model_len of 2^30 tokens (far more than 2 GB of this model's KV).
TEST(CudaModel, MemorySizedPoolMustHoldMaxModelLen) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool;
  Loaded m = load("moe_basic", pool);
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  CudaModelOptions options;
  options.page_size = 4;
  options.max_num_tokens = 64;
  const double budget = static_cast<double>(total_bytes - free_bytes + (size_t{2} << 30));
  options.gpu_memory_utilization = std::min(0.95, budget / static_cast<double>(total_bytes));
  options.max_model_len = int64_t{1} << 30;
  auto refused = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("lower --max-model-len to at most"), std::string::npos)
      << refused.status().message();
  options.max_model_len = 256;  // the same budget holds that
  auto held = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_TRUE(held.has_value()) << held.status().to_string();
  EXPECT_GE((*held)->num_pages(), 64);
}

// Out of device memory while creating, the error names what was being placed
// and the flag that gives it room (the bare cudaMalloc error names neither):
// Qwen3-235B's 94 bf16 layers (~470 GB) stop in their weights; one layer with
// activations for 2^20 tokens a step (~200 GB of expert rows) in those.
TEST(CudaModel, OutOfMemoryNamesWhatAndTheFlag) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::ifstream file(std::string(MOE_SOURCE_DIR) + "/tests/data/configs/qwen3-235b-a22b.config.json");
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  auto config = parse_model_config(text);
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  CudaModelOptions options;
  options.max_num_tokens = 256;
  options.num_pages = 64;
  options.max_model_len = 1024;
  auto all = CudaQwen3MoeModel::create_dummy(*config, 0, options);
  ASSERT_FALSE(all.has_value());
  EXPECT_EQ(all.status().code(), StatusCode::kResourceExhausted);
  const std::string weights = all.status().message();
  EXPECT_NE(weights.find("out of GPU memory placing the weights of layer "), std::string::npos) << weights;
  EXPECT_NE(weights.find("of 94"), std::string::npos) << weights;
  EXPECT_NE(weights.find("--quantization fp8-block"), std::string::npos) << weights;
  config->num_layers = 1;
  options.max_num_tokens = 1 << 20;
  auto wide = CudaQwen3MoeModel::create_dummy(*config, 0, options);
  ASSERT_FALSE(wide.has_value());
  const std::string activations = wide.status().message();
  EXPECT_NE(activations.find("placing the activations for 1048576 tokens a step"), std::string::npos) << activations;
  EXPECT_NE(activations.find("--max-num-batched-tokens"), std::string::npos) << activations;
  // What failed is freed: a model that fits is created afterwards.
  options.max_num_tokens = 256;
  auto fits = CudaQwen3MoeModel::create_dummy(*config, 0, options);
  ASSERT_TRUE(fits.has_value()) << fits.status().to_string();
}

// The f32 logits buffer holds max_logits_rows rows (serve: each sequence's
// sampled and draft rows plus the prompt-logprobs budget; never below the 512
// a CUDA graph replay pads to) instead of a row per token: a forward within
// it gives what the unbounded model gives, one past it is refused, saying so.
TEST(CudaModel, LogitsRowsWithinMaxLogitsRows) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool;
  Loaded m = load("moe_basic", pool);
  CudaModelOptions options;
  options.page_size = 16;
  options.num_pages = 64;
  options.max_num_tokens = 640;
  auto unbounded = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_TRUE(unbounded.has_value()) << unbounded.status().to_string();
  options.max_logits_rows = 1;  // 512, the graph replays' rows
  auto bounded = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_TRUE(bounded.has_value()) << bounded.status().to_string();
  // Two sequences of 300 tokens, every token's logits.
  const int len = 300, pages = (len + 15) / 16;
  ForwardBatch batch;
  batch.query_start = {0};
  batch.max_pages_per_seq = pages;
  for (int seq = 0; seq < 2; ++seq) {
    for (int i = 0; i < len; ++i) {
      batch.token_ids.push_back(static_cast<int32_t>((i * 7 + seq * 31 + 3) % m.config.vocab_size));
      batch.positions.push_back(i);
    }
    batch.query_start.push_back(static_cast<int32_t>(batch.token_ids.size()));
    for (int p = 0; p < pages; ++p) batch.page_table.push_back(seq * pages + p);
  }
  for (int t = 0; t < 2 * len; ++t) batch.logits_rows.push_back(t);
  auto refused = (*bounded)->forward(batch);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("max_logits_rows"), std::string::npos) << refused.status().message();
  batch.logits_rows.erase(batch.logits_rows.begin() + 100, batch.logits_rows.begin() + 188);  // 512 rows
  auto within = (*bounded)->forward(batch);
  ASSERT_TRUE(within.has_value()) << within.status().to_string();
  auto reference = (*unbounded)->forward(batch);
  ASSERT_TRUE(reference.has_value()) << reference.status().to_string();
  ASSERT_EQ(within->num_elements(), reference->num_elements());
  const std::vector<float> ref(reference->data_as<float>(), reference->data_as<float>() + reference->num_elements());
  EXPECT_LT(relative_error(within->data_as<float>(), ref), 1e-5);
}

// A dummy model with head_dim 128 and 16 q heads per kv head, so the
// tensor-core attention kernels (prefill and decode) run inside the model:
// GPU logits against the CPU reference on the same weights, for a prefill
// and for decode steps through the KV cache.
TEST(CudaModel, TensorCoreAttentionPathMatchesCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto config = parse_model_config(std::string(R"({
    "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 128, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": true, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 4096})"));
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  ThreadPool pool;
  ModelWeights weights = ModelWeights::dummy(*config, 3, pool);
  Qwen3MoeModel cpu(weights);
  CudaModelOptions options;
  options.page_size = 16;
  options.num_pages = 64;
  options.max_num_tokens = 512;
  auto gpu = CudaQwen3MoeModel::create(weights, options);
  ASSERT_TRUE(gpu.has_value()) << gpu.status().to_string();
  kv::KvCache cache({config->num_layers, 1, 128, 16, 64, DType::kF32});
  std::vector<ops::PagedKv> layers;
  for (int l = 0; l < config->num_layers; ++l) layers.push_back(cache.layer(l));

  ForwardBatch batch;
  for (int i = 0; i < 300; ++i) batch.token_ids.push_back((i * 37) % 1000), batch.positions.push_back(i);
  batch.query_start = {0, 300};
  for (int p = 0; p < 20; ++p) batch.page_table.push_back(p);
  batch.max_pages_per_seq = 20;
  batch.logits_rows = {0, 150, 299};
  for (int step = 0; step < 4; ++step) {
    Tensor cpu_logits = cpu.forward(pool, batch, layers);
    auto gpu_logits = (*gpu)->forward(batch);
    ASSERT_TRUE(gpu_logits.has_value()) << gpu_logits.status().to_string();
    for (size_t r = 0; r < batch.logits_rows.size(); ++r) {
      std::vector<float> ref(cpu_logits.data_as<float>() + r * 1000, cpu_logits.data_as<float>() + (r + 1) * 1000);
      EXPECT_LT(relative_error(gpu_logits->data_as<float>() + r * 1000, ref), kLogitTolerance)
          << "step " << step << " row " << r;
    }
    // Next: one decode token at the end of the sequence.
    const int32_t pos = batch.positions.back() + 1;
    batch.token_ids = {static_cast<int32_t>(pos % 1000)};
    batch.positions = {pos};
    batch.query_start = {0, 1};
    batch.logits_rows = {0};
  }
}

// FP8 experts (fp8-block, then mxfp8) on the GPU against the CPU's quantized
// model on the same weights: the experts and (their shapes being multiples
// of 128) the attention projections through the FP8 grouped GEMMs: 200 prompt
// tokens take the 64-row tiles, 300 (600 rows over 8 experts) the prefill
// kernels with gathered rows (fp8-block; mxfp8 stays on 64-row tiles).
// Looser than kLogitTolerance: the GPU quantizes bf16
// activations, the CPU f32 ones, and a value near an E4M3 rounding boundary
// can land on either side (1/16 relative).
TEST(CudaModel, Fp8ExpertsMatchTheCpuQuantizedModel) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!ops::cuda::hopper_kernels_available()) GTEST_SKIP() << "FP8 experts need an sm_90 device";
  auto config = parse_model_config(std::string(R"({
    "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 256, "norm_topk_prob": true, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 4096})"));
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  ThreadPool pool;
  for (const ops::QuantFormat format : {ops::QuantFormat::kFp8Block, ops::QuantFormat::kMxfp8}) {
    const std::string name(ops::quant_format_name(format));
    SCOPED_TRACE(name);
    ModelWeights weights = ModelWeights::dummy(*config, 5, pool, format);
    Qwen3MoeModel cpu(weights);
    CudaModelOptions options;
    options.page_size = 16;
    options.num_pages = 64;
    options.max_num_tokens = 512;
    auto gpu = CudaQwen3MoeModel::create(weights, options);
    ASSERT_TRUE(gpu.has_value()) << gpu.status().to_string();
    for (const int tokens : {200, 300}) {
      kv::KvCache cache({config->num_layers, 2, 128, 16, 64, DType::kF32});
      std::vector<ops::PagedKv> layers;
      for (int l = 0; l < config->num_layers; ++l) layers.push_back(cache.layer(l));
      ForwardBatch batch;
      for (int i = 0; i < tokens; ++i)
        batch.token_ids.push_back((i * 53) % 1000), batch.positions.push_back(i);
      batch.query_start = {0, tokens};
      for (int p = 0; p < 20; ++p) batch.page_table.push_back(p);
      batch.max_pages_per_seq = 20;
      batch.logits_rows = {0, tokens / 2, tokens - 1};
      Tensor cpu_logits = cpu.forward(pool, batch, layers);
      auto gpu_logits = (*gpu)->forward(batch);
      ASSERT_TRUE(gpu_logits.has_value()) << gpu_logits.status().to_string();
      for (size_t r = 0; r < batch.logits_rows.size(); ++r) {
        std::vector<float> ref(cpu_logits.data_as<float>() + r * 1000,
                               cpu_logits.data_as<float>() + (r + 1) * 1000);
        const double error = relative_error(gpu_logits->data_as<float>() + r * 1000, ref);
        std::printf("%s experts, %d tokens: row %zu relative logit error %.4f\n", name.c_str(), tokens, r,
                    error);
        EXPECT_LT(error, 8e-2) << tokens << " tokens, row " << r;
      }
    }
  }
}

// Decode steps replayed as CUDA graphs (3 sequences padded to the bucket of 4,
// the padding on the scratch page; page tables of 5 and 8 pages, both padded
// to the graph's stride of 8) against the same steps run eagerly.
TEST(CudaModel, GraphReplayMatchesEagerDecode) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool;
  Loaded m = load("moe_basic", pool);
  CudaModelOptions options;
  options.page_size = 4;
  options.num_pages = 64;
  auto graphed = CudaQwen3MoeModel::create(*m.weights, options);
  options.use_cuda_graphs = false;
  auto eager = CudaQwen3MoeModel::create(*m.weights, options);
  ASSERT_TRUE(graphed.has_value() && eager.has_value());
  // Prefill three prompts (eager in both), then decode them together.
  const std::vector<std::vector<int32_t>> prompts = {{5, 9, 13, 17, 21}, {100, 200}, {7, 7, 7, 7, 7, 7, 7, 7, 7}};
  std::vector<int32_t> next(prompts.size()), lengths;
  for (size_t s = 0; s < prompts.size(); ++s) {
    ForwardBatch one;
    one.token_ids = prompts[s];
    for (int i = 0; i < static_cast<int>(prompts[s].size()); ++i) one.positions.push_back(i);
    one.query_start = {0, static_cast<int32_t>(prompts[s].size())};
    for (int p = 0; p < 8; ++p) one.page_table.push_back(static_cast<int32_t>(s) * 8 + p);
    one.max_pages_per_seq = 8;
    one.logits_rows = {static_cast<int32_t>(prompts[s].size()) - 1};
    auto a = (*graphed)->forward_greedy(one);
    auto b = (*eager)->forward_greedy(one);
    ASSERT_TRUE(a.has_value() && b.has_value());
    EXPECT_EQ(*a, *b);
    next[s] = (*a)[0];
    lengths.push_back(static_cast<int32_t>(prompts[s].size()));
  }
  for (int step = 0; step < 6; ++step) {
    // Page tables of 5 and 8 pages in turn: the same graph, the shorter table padded.
    const int pages = step % 2 == 0 ? 5 : 8;
    ForwardBatch batch;
    batch.max_pages_per_seq = pages;
    batch.query_start = {0};
    for (size_t s = 0; s < prompts.size(); ++s) {
      batch.token_ids.push_back(next[s]);
      batch.positions.push_back(lengths[s]++);
      batch.query_start.push_back(static_cast<int32_t>(s) + 1);
      batch.logits_rows.push_back(static_cast<int32_t>(s));
      for (int p = 0; p < pages; ++p) batch.page_table.push_back(static_cast<int32_t>(s) * 8 + p);
    }
    auto a = (*graphed)->forward(batch);
    auto b = (*eager)->forward(batch);
    ASSERT_TRUE(a.has_value() && b.has_value()) << a.status().to_string();
    ASSERT_EQ(a->num_elements(), b->num_elements());
    for (size_t s = 0; s < prompts.size(); ++s) {
      std::vector<float> ref(b->data_as<float>() + s * m.config.vocab_size, b->data_as<float>() + (s + 1) * m.config.vocab_size);
      EXPECT_LT(relative_error(a->data_as<float>() + s * m.config.vocab_size, ref), 1e-3) << "step " << step << " seq " << s;
      next[s] = engine_argmax(ref);
    }
  }
}


// The bundled demo model (models/moeserve-demo): GPU logits against the CPU
// reference, and GPU greedy tokens against its transformers goldens up to
// the first step whose golden margin is below bf16 noise.
TEST(CudaModel, BundledDemoModelMatchesCpuAndTransformers) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = std::string(MOE_SOURCE_DIR) + "/models/moeserve-demo";
  std::ifstream in(dir + "/golden.json");
  const json golden = json::parse(in);
  auto config = load_model_config(dir);
  ASSERT_TRUE(config.has_value()) << config.status().to_string();
  ThreadPool pool;
  auto weights = ModelWeights::load(dir, *config, pool);
  ASSERT_TRUE(weights.has_value()) << weights.status().to_string();
  Qwen3MoeModel cpu(*weights);
  CudaModelOptions options;
  options.page_size = 16;
  options.num_pages = 64;
  auto gpu = CudaQwen3MoeModel::create(*weights, options);
  ASSERT_TRUE(gpu.has_value()) << gpu.status().to_string();
  const int64_t vocab = config->vocab_size;
  int compared = 0;
  for (const char* kind : {"texts", "chats"}) {
    for (const auto& entry : golden[kind]) {
      const auto ids = entry["ids"].get<std::vector<int32_t>>();
      const ForwardBatch batch = prompt_batch(ids, 16);
      const int pages = batch.max_pages_per_seq;
      kv::KvCache cache({config->num_layers, config->num_kv_heads, config->head_dim, 16, pages, DType::kF32});
      std::vector<ops::PagedKv> layers;
      for (int l = 0; l < config->num_layers; ++l) layers.push_back(cache.layer(l));
      Tensor cpu_logits = cpu.forward(pool, batch, layers);
      auto gpu_logits = (*gpu)->forward(batch);
      ASSERT_TRUE(gpu_logits.has_value()) << gpu_logits.status().to_string();
      EXPECT_LT(relative_error(gpu_logits->data_as<float>(),
                               std::vector<float>(cpu_logits.data_as<float>(), cpu_logits.data_as<float>() + vocab)),
                kLogitTolerance)
          << kind << " prompt of " << ids.size() << " tokens";
      const auto expected = entry["greedy"].get<std::vector<int32_t>>();
      const auto margins = entry["greedy_margins"].get<std::vector<double>>();
      int robust = 0;
      while (robust < static_cast<int>(margins.size()) && margins[robust] >= kBf16Margin) ++robust;
      const auto got = gpu_greedy(**gpu, ids, robust, 16);
      EXPECT_TRUE(std::equal(got.begin(), got.end(), expected.begin())) << kind << ": first " << robust << " tokens";
      compared += robust;
    }
  }
  std::printf("demo model: %d greedy tokens compared exactly with transformers on the GPU\n", compared);
}

}  // namespace
}  // namespace moe::model
